"""How a token is picked from a decode step's logits (contract 4): the sampling parameters of a
request, its seeded stream of draws, and the greedy / temperature / top-p choice of one row
(:func:`pick_token`) or of a batch's rows at once (:func:`pick_tokens`), and the seed of each of
a request's ``n`` choices (:func:`choice_seed`). Used by the continuous engine's sampler
(:mod:`miserver.serving.engine.sampler`) and, for the seeds, by a GGUF resident."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request with ``seed`` (contract 4, ``n``).

    Choice 0 samples with ``seed`` itself, so ``n=1`` and the first choice of any ``n`` give the
    same answer. Choice ``i > 0`` samples with the integer whose big-endian bytes are the first
    eight of ``sha256(b"miserver-choice:<seed>:<i>")`` (decimal ``seed`` and ``i``): a request
    with that seed and ``n=1`` reproduces choice ``i``. None (no seed) stays None.

    >>> choice_seed(7, 0), choice_seed(None, 3)
    (7, None)
    """
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"miserver-choice:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens (contract 4).

    Attributes:
        max_tokens: the most tokens to generate (>= 1).
        temperature: 0 is greedy (argmax); otherwise logits are divided by it (0 < t <= 2).
        top_p: nucleus sampling mass, in (0, 1].
        seed: seeds this request's own :class:`SeedStream` (any int: every seed its own
            samples); None draws from the global RNG.
        stop: stop sequences; the completion ends before the first one and never contains it.
        logprobs: how many alternatives to report per token (0..20); None reports no logprobs.
        echo: also score the prompt (prompt token logprobs, needs ``logprobs``).
        constraint: a grammar every sequence's tokens must follow
            (:class:`~miserver.serving.engine.constraints.Constraint`, shared by the ``n``
            choices, each with its own matcher); None samples freely. Its mask applies before
            the choice (greedy too); logprobs stay the model's own (unmasked); a complete
            grammar ends the sequence as ``stop`` (issue 33). On a GGUF resident, a
            :class:`~miserver.serving.models.gguf.JsonSchemaGrammar` that llama.cpp enforces.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    echo: bool = False
    constraint: Any = None


@dataclass(frozen=True)
class TokenLogprob:
    """One token and its log-probability under the served weights (natural log).

    ``text`` is the token decoded alone (U+FFFD for part of a character), ``bytes`` its raw
    bytes (:func:`~miserver.serving.engine.detokenize.token_bytes`). ``logprob`` is None for the first prompt token (nothing
    precedes it); ``top`` lists the most likely alternatives at that position as
    ``(token_id, text, logprob, bytes)``, best first.
    """

    token_id: int
    text: str
    bytes: bytes
    logprob: float | None
    top: tuple[tuple[int, str, float, bytes], ...] = ()


class SeedStream:
    """The random draws of one request's ``seed``: every accepted seed its own stream.

    ``torch.Generator.manual_seed`` keeps only the low 32 bits on the CPU (mt19937) and maps a
    negative seed onto ``2**64 + seed``, so seeds 0, 2**32 and 2**63 gave the same samples
    (issue 16 item 9). Here the seed, any Python int (the API accepts
    [-2**63, 2**64 - 1]), is mapped one-to-one onto a non-negative int (zigzag: ``2n`` for
    ``n >= 0``, ``-2n - 1`` below) that seeds a Mersenne Twister with all its bits
    (:class:`random.Random` seeds from the whole int). Draws are uniform in [0, 1), 53 bits.
    The same seed gives the same draws on every device.
    """

    __slots__ = ("_rng",)

    def __init__(self, seed: int) -> None:
        seed = int(seed)
        self._rng = random.Random(2 * seed if seed >= 0 else -2 * seed - 1)

    def uniform(self) -> float:
        """The next draw, uniform in [0, 1)."""
        return self._rng.random()


class NonFiniteLogits(RuntimeError):
    """The model's logits hold NaN or infinity: nothing can be sampled from them (issue 16
    item 10). The weights themselves hold non-finite values (a diverged trainer step, or a
    write outside the commit bracket)."""

    def __init__(self) -> None:
        super().__init__(
            "the model produced non-finite logits (NaN or infinity): the served weights hold "
            "non-finite values (a diverged training step, or weights written outside the commit "
            "bracket); load finite weights (POST /api/weights/load with a saved checkpoint, or "
            "reload the model) and retry"
        )


def _sample(probs: torch.Tensor, generator: torch.Generator | SeedStream | None) -> int:
    """One index drawn from the (unnormalised, non-negative, 1-D) ``probs``."""
    # Inverse CDF: the first index whose cumulative mass exceeds u * total (a token of
    # probability 0 is never chosen: its cumulative mass equals its predecessor's). Unseeded, u
    # is a draw of torch's generator (``generator``, or the global one): ``torch.multinomial``
    # draws from the same distribution but took 887 us a row of SmolLM2's 49,152 tokens on the
    # CPU against 31 us for this (2-core machine, 1 thread).
    cumulative = torch.cumsum(probs, dim=-1)
    if isinstance(generator, SeedStream):
        draw: float | torch.Tensor = generator.uniform()  # on the logits' device, no copy
    else:
        draw = torch.rand(1, dtype=cumulative.dtype, device=probs.device, generator=generator)
    index = torch.searchsorted(cumulative, cumulative[-1:] * draw, right=True)
    return min(int(index), probs.shape[-1] - 1)


def pick_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | SeedStream | None],
) -> list[int | NonFiniteLogits]:
    """:func:`pick_token` for every row of ``logits`` (float32 ``[rows, vocab]``) at once: the
    same arithmetic (float64 after subtracting each row's maximum, the top-p cut over the sorted
    probabilities, the inverse CDF of a :class:`SeedStream` draw or of one of torch's), done
    as a few batched operations and one read to the host instead of several synchronisations a
    row. Row ``r`` takes ``params[r]`` and ``generators[r]`` (a ``SeedStream`` draws once, as
    ``pick_token`` would). A row whose maximum is not finite gets a :class:`NonFiniteLogits`
    instead of a token. Batched reductions may round otherwise than one row's (so the static
    batch uses this on CUDA only, where a batch equals a request alone to rounding anyway)."""
    rows = logits.shape[0]
    best, index = torch.max(logits, dim=-1)
    best_values, best_index = best.tolist(), index.tolist()
    out: list[int | NonFiniteLogits] = [0] * rows
    groups: dict[bool, list[int]] = {True: [], False: []}  # top-p cut or not -> rows
    for r in range(rows):
        if not math.isfinite(best_values[r]):
            out[r] = NonFiniteLogits()
        elif params[r].temperature == 0:
            out[r] = int(best_index[r])
        elif isinstance(generators[r], torch.Generator):  # not batched: its own generator
            out[r] = pick_token(logits[r], params[r], generators[r])
        else:
            groups[params[r].top_p < 1.0].append(r)
    device = logits.device
    for cut, members in groups.items():
        if not members:
            continue
        sel = torch.tensor(members, dtype=torch.long, device=device)
        temperature = torch.tensor(
            [params[r].temperature for r in members], dtype=torch.float64, device=device
        )[:, None]
        scaled = logits.index_select(0, sel).double() - best.index_select(0, sel).double()[:, None]
        scaled = scaled / temperature
        order = None
        if not cut:
            probs = scaled.exp_()  # unnormalised, as pick_token's
        else:
            probs = torch.softmax(scaled, dim=-1)
            top_p = torch.tensor(
                [params[r].top_p for r in members], dtype=torch.float64, device=device
            )[:, None]
            probs, order = torch.sort(probs, dim=-1, descending=True)
            cumulative = torch.cumsum(probs, dim=-1)
            drop = cumulative - probs >= top_p
            drop[:, 0] = False  # always keeps the best token
            probs = probs.masked_fill(drop, 0.0)
        # the inverse CDF of each row's draw: its SeedStream's, else torch's global generator
        draws = torch.rand(len(members), 1, dtype=torch.float64, device=device)
        seeded = [i for i, r in enumerate(members) if isinstance(generators[r], SeedStream)]
        if seeded:
            draws[torch.tensor(seeded, dtype=torch.long, device=device)] = torch.tensor(
                [generators[members[i]].uniform() for i in seeded],  # type: ignore[union-attr]
                dtype=torch.float64,
                device=device,
            )[:, None]
        cumulative = torch.cumsum(probs, dim=-1)
        found = torch.searchsorted(cumulative, cumulative[:, -1:] * draws, right=True)[:, 0]
        picked = found.clamp(max=probs.shape[-1] - 1)
        if order is not None:
            picked = order.gather(1, picked[:, None])[:, 0]
        for r, token in zip(members, picked.tolist(), strict=True):
            out[r] = int(token)
    return out


def pick_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | SeedStream | None,
) -> int:
    """Choose the next token from ``logits`` (shape ``[vocab]``, float32).

    Greedy (argmax) at temperature 0; otherwise softmax(logits / temperature) restricted to the
    smallest set of tokens whose mass reaches ``top_p``, sampled with ``generator`` (a request's
    :class:`SeedStream`, a ``torch.Generator``, or None for the global RNG). Any value the
    contract admits (temperature in (0, 2], top_p in (0, 1]) works, however small.

    Raises:
        NonFiniteLogits: the largest logit is NaN or infinite (any NaN, any +inf, or all -inf).
    """
    if params.temperature == 0:
        best, index = torch.max(logits, dim=-1)
        if not math.isfinite(float(best)):  # torch.max propagates NaN
            raise NonFiniteLogits()
        return int(index)
    best_value = float(torch.max(logits))
    if not math.isfinite(best_value):
        raise NonFiniteLogits()
    # In float64 after subtracting the maximum: every scaled logit is <= 0 (the best is 0), so a
    # temperature as small as 5e-324 gives -inf for the others (a one-hot), never inf or nan.
    scaled = (logits.double() - best_value).div_(params.temperature)
    if params.top_p >= 1.0:
        # no cut: the inverse CDF needs no normalisation, exp's unnormalised weights do (softmax
        # divides them by their sum: a pass more; 221 against 116 us a row of 49,152 tokens,
        # 2-core machine, 1 thread)
        return _sample(scaled.exp_(), generator)
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    drop = cumulative - sorted_probs >= params.top_p
    drop[0] = False  # always keeps the best token (a top_p below the float's resolution too)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return int(order[_sample(sorted_probs, generator)])
