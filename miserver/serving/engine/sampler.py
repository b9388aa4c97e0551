"""Choosing each sequence's next token: greedy, temperature, top-p, seeds, logprobs, constraints.

The arithmetic is :func:`~miserver.serving.engine.generation.pick_token`'s (float64 after
subtracting the row's maximum, the top-p cut over the sorted probabilities, the inverse CDF of a
:class:`~miserver.serving.engine.generation.SeedStream` draw), so a request's ``seed`` gives the
same samples on the continuous engine as on the old path. On the CPU each row is picked by
itself (a row's result never depends on its neighbours); on CUDA the rows go through
:func:`~miserver.serving.engine.generation.pick_tokens` (a few batched operations, one read).

Constraints (ENGINE_API.md, "Constraint hook"): a sequence whose ``params.constraint`` is set has
a matcher; its row is copied and ``matcher.fill_mask(row)`` sets the disallowed tokens to
``-inf`` before the choice, ``matcher.accept(token)`` follows it, and a terminated matcher ends
the sequence (``stop``). Logprobs are reported from the model's own, unmasked log-softmax (as
vLLM does by default).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from miserver.serving.engine.sampling import NonFiniteLogits, pick_token, pick_tokens
from miserver.serving.engine.sequence import Sequence, TokenLogprobIds


@dataclass
class Sampled:
    """One row's result: ``token`` (None when ``error``), its logprob entry when asked for,
    ``terminated`` when the constraint's grammar is complete after it."""

    token: int | None
    logprob: TokenLogprobIds | None = None
    terminated: bool = False
    error: BaseException | None = None


def logprob_entry(logprobs_row: torch.Tensor, token: int, top: int) -> TokenLogprobIds:
    """``token``'s entry from one row of log-probabilities (``[vocab]``, float32), with the
    ``top`` best alternatives."""
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logprobs_row, top)
        alternatives = tuple(
            (int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)
        )
    return TokenLogprobIds(int(token), float(logprobs_row[token]), alternatives)


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], top: int) -> list[TokenLogprobIds]:
    """Scores of prompt tokens ``1 .. n-1``: ``logits`` ``[n - 1, vocab]`` (position ``i``
    predicts token ``i + 1``), in 256-row slices (a long prompt's full log-softmax at once
    would take ``n x vocab`` floats)."""
    entries: list[TokenLogprobIds] = []
    for start in range(0, len(prompt) - 1, 256):
        rows = torch.log_softmax(logits[start : min(start + 256, len(prompt) - 1)].float(), dim=-1)
        for j in range(rows.shape[0]):
            entries.append(logprob_entry(rows[j], prompt[start + j + 1], top))
    return entries


@contextmanager
def one_thread(on_cpu: bool) -> Iterator[None]:
    """Run the body with this thread's intra-op parallelism at 1 on the CPU, restored after.

    Sampling works on rows of ``vocab`` values (49,152 for SmolLM2): above torch's grain, so
    each conversion, softmax and cumulative sum is split between threads, and on a machine
    whose other cores are busy (the server's event loop, other processes) each such operation
    waits for a descheduled worker: measured on the shared 2-core machine, ``pick_token`` of one
    row took 4,992 us with 2 threads against 702 with 1 (``torch.set_num_threads`` is per
    thread under OpenMP, and costs under a microsecond). One thread also makes a seed's draw
    independent of the machine's thread count."""
    before = torch.get_num_threads() if on_cpu else 1
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sample(seqs: list[Sequence], logits: torch.Tensor) -> list[Sampled]:
    """The next token of each of ``seqs`` from its row of ``logits`` (``[len(seqs), vocab]``,
    any float dtype; rows are read as float32). A row that cannot be sampled (non-finite
    logits, a failing matcher) gets ``error`` set; the others go on. On the CPU it runs on one
    thread (:func:`one_thread`)."""
    with one_thread(not logits.is_cuda):
        return _sample_rows(seqs, logits)


def _sample_rows(seqs: list[Sequence], logits: torch.Tensor) -> list[Sampled]:
    logits = logits.float()
    rows = logits
    constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if constrained:
        rows = logits.clone()
        for i in constrained:
            try:
                seqs[i].matcher.fill_mask(rows[i])
            except Exception as exc:  # noqa: BLE001 - reported on this sequence
                rows[i].fill_(float("nan"))
                seqs[i]._matcher_error = exc  # type: ignore[attr-defined]
    results: list[Sampled] = []
    if logits.is_cuda and len(seqs) > 1:
        picked = pick_tokens(rows, [s.params for s in seqs], [s.generator for s in seqs])
    else:
        picked = []
        for i, seq in enumerate(seqs):
            try:
                picked.append(pick_token(rows[i], seq.params, seq.generator))
            except NonFiniteLogits as exc:
                picked.append(exc)
    for i, (seq, choice) in enumerate(zip(seqs, picked, strict=True)):
        error = getattr(seq, "_matcher_error", None)
        if error is not None:
            del seq._matcher_error  # type: ignore[attr-defined]
            results.append(Sampled(None, error=error))
            continue
        if isinstance(choice, BaseException):
            results.append(Sampled(None, error=choice))
            continue
        token = int(choice)
        entry = None
        if seq.params.logprobs is not None:
            entry = logprob_entry(torch.log_softmax(logits[i], dim=-1), token, seq.params.logprobs)
        terminated = False
        if seq.matcher is not None:
            try:
                seq.matcher.accept(token)
                terminated = bool(seq.matcher.is_terminated())
            except Exception as exc:  # noqa: BLE001 - reported on this sequence
                results.append(Sampled(None, error=exc))
                continue
        results.append(Sampled(token, entry, terminated))
    return results
