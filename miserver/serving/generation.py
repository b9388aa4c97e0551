"""Token generation in a worker thread, streamed back to the event loop.

Companion contract 4 and the design notes ("Serving"). One :class:`Generation` runs one request:
a prefill of the prompt, then a decode loop with the model's KV cache, one token per forward
pass, in its own thread (torch releases the GIL inside its kernels, so ``MAX_CONCURRENT_REQUESTS``
generations really run at once). Between two decode steps it checks its cancellation flag, so a
disconnected client stops costing compute within one step.

Text is released to the caller only when it is final:

- :class:`~miserver.serving.detokenize.IncrementalDetokenizer` never splits a UTF-8 character (a byte-level token may end in
  the middle of one; that text waits for the next token);
- :class:`~miserver.serving.detokenize.StopMatcher` holds back any tail that could still become a stop sequence, and never
  releases any part of a matched one.

The joined :class:`TextDelta` texts are therefore exactly the completion a non-streamed request
returns. Cross-request caches: none. The KV cache lives and dies with its request, so nothing
computed on old weights survives a weight update (weights page, "The write cycle" 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import queue
import random
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from miserver.serving.detokenize import IncrementalDetokenizer, StopMatcher, token_bytes, token_text

log = logging.getLogger("miserver.generation")

_THREAD_IDS = itertools.count(1)


class _WorkerThreads:
    """Long-lived daemon threads that run generations, one at a time each, reused.

    A thread's first CUDA work is slow for a long while: measured on the H200 (2026-11-30,
    torch 2.11, SmolLM2-135M shape), a KV-cache decode loop took 57-67 ms a token in a fresh
    thread against 17.7 ms in a thread that had already run one (and 17-19 ms in the main
    thread); a thread per request made every answer three times slower. Idle threads wait for
    the next job; a job while all are busy gets a new thread (the scheduler bounds how many run).
    A finished job keeps no reference to its generation (an unloaded model can be freed).
    Not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined at interpreter exit,
    so a generation still running at shutdown (nothing cancels it there) would hold the exit;
    these are daemon threads, as the thread per request was.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(
                target=self._serve,
                args=(inbox,),
                daemon=True,
                name=f"miserver-generation-{next(_THREAD_IDS)}",
            ).start()
        inbox.put(job)

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            job = inbox.get()
            try:
                job()
            except BaseException:  # noqa: BLE001 - a job reports its own failures
                log.exception("generation worker: a job raised")
            del job  # hold nothing of a finished generation while idle
            with self._lock:
                self._idle.append(inbox)


_WORKERS = _WorkerThreads()


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
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    echo: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    """One token and its log-probability under the served weights (natural log).

    ``text`` is the token decoded alone (U+FFFD for part of a character), ``bytes`` its raw
    bytes (:func:`token_bytes`). ``logprob`` is None for the first prompt token (nothing
    precedes it); ``top`` lists the most likely alternatives at that position as
    ``(token_id, text, logprob, bytes)``, best first.
    """

    token_id: int
    text: str
    bytes: bytes
    logprob: float | None
    top: tuple[tuple[int, str, float, bytes], ...] = ()


@dataclass(frozen=True)
class Started:
    """The prompt is processed. ``prompt_logprobs`` is set when ``echo`` and ``logprobs``."""

    prompt_tokens: int
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class TextDelta:
    """Final completion text, and the logprobs of the tokens generated since the last delta."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The end: ``finish_reason`` is ``stop`` (an end token or a stop sequence), ``length``
    (``max_tokens`` reached) or ``cancelled``. ``completion_tokens`` counts every sampled token
    (an end token included)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


Event = Started | TextDelta | Finished


class GenerationError(RuntimeError):
    """Generation failed inside the worker thread; ``__cause__`` is the original exception."""


@dataclass
class _Failed:
    error: BaseException


# --- tokens -----------------------------------------------------------------------------------
def end_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end a completion: the tokenizer's EOS and the generation config's."""
    ids: set[int] = set()
    for value in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def context_length(model: Any) -> int:
    """The model's context window in tokens (``max_position_embeddings``; 2048 if unknown)."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def cache_kwarg(model: Any) -> str:
    """The forward argument that takes the KV cache: ``cache`` (transformers >= 5.2x) or
    ``past_key_values``. Wrappers (PEFT) are looked through to the first module that names one.
    """
    import inspect

    modules = model.modules() if isinstance(model, torch.nn.Module) else iter((model,))
    for module in modules:
        try:
            names = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            continue
        for name in ("cache", "past_key_values"):
            if name in names:
                return name
    return "past_key_values"


def _cache_of(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


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
    if isinstance(generator, SeedStream):
        # Inverse CDF: the first index whose cumulative mass exceeds u * total (a token of
        # probability 0 is never chosen: its cumulative mass equals its predecessor's).
        cumulative = torch.cumsum(probs, dim=-1)
        target = cumulative[-1:] * generator.uniform()  # on the logits' device, no copy
        index = torch.searchsorted(cumulative, target, right=True)
        return min(int(index), probs.shape[-1] - 1)
    return int(torch.multinomial(probs, 1, generator=generator))


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
    best, index = torch.max(logits, dim=-1)
    best_value = float(best)
    if not math.isfinite(best_value):  # torch.max propagates NaN
        raise NonFiniteLogits()
    if params.temperature == 0:
        return int(index)
    # In float64 after subtracting the maximum: every scaled logit is <= 0 (the best is 0), so a
    # temperature as small as 5e-324 gives -inf for the others (a one-hot), never inf or nan.
    scaled = (logits.double() - best_value) / params.temperature
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs >= params.top_p
        drop[0] = False  # always keeps the best token (a top_p below the float's resolution too)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        return int(order[_sample(sorted_probs, generator)])
    return _sample(probs, generator)


# --- the worker ------------------------------------------------------------------------------
@dataclass
class _Timing:
    started: float = 0.0
    ended: float = 0.0
    thread: str = ""
    steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Generation:
    """One request's generation, run in its own worker thread.

    Args:
        model: a causal LM (``torch.nn.Module``) in eval mode; its forward accepts
            ``input_ids``, ``past_key_values``, ``use_cache`` and returns ``.logits``
            (``[1, seq, vocab]``) and ``.past_key_values``.
        tokenizer: its transformers tokenizer.
        prompt_ids: the prompt's token ids (at least one).
        params: :class:`SamplingParams`.
        engine: the resident's :class:`~miserver.serving.decode_graphs.DecodeEngine` (CUDA
            graphs over a static KV cache), or None to decode eagerly. A busy or closed engine
            is not waited for: the generation decodes eagerly (the tokens are the same).

    Call :meth:`start` on the event loop, then iterate :meth:`events`. The caller must keep
    holding its scheduler slot until :meth:`wait` returns (a generation binds to one parameter
    set). An exception inside the thread is raised from :meth:`events` as
    :class:`GenerationError` (``__cause__``: the original), and the thread ends.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        engine: Any = None,
    ) -> None:
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        self.model = model
        self.engine = engine
        self.tokenizer = tokenizer
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.params = params
        self.timing = _Timing()
        self._cancel = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[Event | _Failed] | None = None
        self._done: asyncio.Future[None] | None = None
        self._started = False

    # --- event-loop side ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the generation on a worker thread (call on the event loop)."""
        if self._started:
            raise RuntimeError("already started")
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._done = self._loop.create_future()
        self._started = True
        _WORKERS.submit(self._run)

    def cancel(self) -> None:
        """Ask the thread to stop before its next decode step (thread-safe, idempotent)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def events(self) -> AsyncIterator[Event]:
        """The events: one :class:`Started`, :class:`TextDelta` s, one :class:`Finished`.

        Raises:
            GenerationError: the thread failed (prefill or any decode step).
        """
        assert self._queue is not None, "start() first"
        while True:
            event = await self._queue.get()
            if isinstance(event, _Failed):
                raise GenerationError(
                    f"generation failed: {type(event.error).__name__}: {event.error}"
                ) from event.error
            yield event
            if isinstance(event, Finished):
                return

    def add_done_callback(self, callback: Any) -> None:
        """Call ``callback()`` on the event loop once the worker thread has ended (at once if it
        has). The scheduler slot is released this way, whatever happens to the caller."""
        assert self._done is not None, "start() first"
        self._done.add_done_callback(lambda _f: callback())

    async def wait(self) -> None:
        """Wait until the worker thread has ended (it is never left running)."""
        assert self._done is not None, "start() first"
        await asyncio.shield(self._done)

    # --- thread side --------------------------------------------------------------------------
    def _emit(self, event: Event | _Failed) -> None:
        assert self._loop is not None and self._queue is not None
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody listens any more
            self._cancel.set()

    def _finish_thread(self) -> None:
        assert self._loop is not None and self._done is not None
        done = self._done

        def _set() -> None:
            if not done.done():
                done.set_result(None)

        with contextlib.suppress(RuntimeError):  # the loop is closed
            self._loop.call_soon_threadsafe(_set)

    def _run(self) -> None:
        import time

        self.timing.started = time.perf_counter()
        self.timing.thread = threading.current_thread().name
        try:
            with torch.inference_mode():
                self._generate()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
            log.warning("generation failed: %s: %s", type(exc).__name__, exc)
            self._emit(_Failed(exc))
        finally:
            self.timing.ended = time.perf_counter()
            self._finish_thread()

    def _logprob_entry(self, logprobs_row: torch.Tensor, token_id: int) -> TokenLogprob:
        tok = self.tokenizer
        k = self.params.logprobs or 0
        top: tuple[tuple[int, str, float, bytes], ...] = ()
        if k > 0:
            values, ids = torch.topk(logprobs_row, k)
            top = tuple(
                (int(i), token_text(tok, int(i)), float(v), token_bytes(tok, int(i)))
                for v, i in zip(values.tolist(), ids.tolist(), strict=True)
            )
        return TokenLogprob(
            token_id,
            token_text(tok, token_id),
            token_bytes(tok, token_id),
            float(logprobs_row[token_id]),
            top,
        )

    def _prompt_logprobs(self, logits: torch.Tensor) -> tuple[TokenLogprob, ...]:
        """``logits``: ``[seq, vocab]`` of the prefill; position i predicts token i + 1."""
        tok = self.tokenizer
        ids = self.prompt_ids
        entries = [TokenLogprob(ids[0], token_text(tok, ids[0]), token_bytes(tok, ids[0]), None)]
        for start in range(0, len(ids) - 1, 256):
            rows = torch.log_softmax(logits[start : min(start + 256, len(ids) - 1)].float(), dim=-1)
            for j in range(rows.shape[0]):
                entries.append(self._logprob_entry(rows[j], ids[start + j + 1]))
        return tuple(entries)

    def _generate(self) -> None:
        params = self.params
        model = self.model
        device = next(model.parameters()).device
        generator: SeedStream | None = None
        if params.seed is not None and params.temperature > 0:
            generator = SeedStream(params.seed)
        want_logprobs = params.logprobs is not None
        score_prompt = params.echo and want_logprobs
        ends = end_token_ids(model, self.tokenizer)
        with self._decoder(model, device) as decoder:
            self.timing.extra["decoder"] = decoder.kind
            self._decode(decoder, generator, ends, score_prompt, want_logprobs)

    @contextlib.contextmanager
    def _decoder(self, model: Any, device: torch.device) -> Any:
        """The resident's decode engine if it is free, else an eager decoder."""
        if self.engine is not None:
            with self.engine.session(model) as session:
                if session is not None:
                    yield _GraphDecoder(session)
                    return
        yield _EagerDecoder(model, device)

    def _decode(
        self,
        decoder: Any,
        generator: SeedStream | None,
        ends: frozenset[int],
        score_prompt: bool,
        want_logprobs: bool,
    ) -> None:
        params = self.params
        prompt_logits = decoder.prefill(self.prompt_ids, all_logits=score_prompt)
        prompt_lp = self._prompt_logprobs(prompt_logits[:-1]) if score_prompt else None
        logits = prompt_logits[-1].float()
        del prompt_logits
        self._emit(Started(len(self.prompt_ids), prompt_lp))

        detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)
        stopper = StopMatcher(params.stop)
        # Logprob entries wait with their token's start offset in the completion's text and go
        # out with the first text that reaches that offset: a token held back by the stop
        # matcher, or cut off by a stop sequence, is reported only if its text is (contract 4).
        pending_lp: list[tuple[int, TokenLogprob]] = []
        decoded = 0  # characters the detokenizer has produced
        released = 0  # characters of completion text sent
        generated = 0
        finish = "length"
        matched_stop = False
        while True:
            if self._cancel.is_set():
                finish = "cancelled"
                break
            token = pick_token(logits, params, generator)
            generated += 1
            self.timing.steps = generated
            if token in ends:
                finish = "stop"
                break
            if want_logprobs:
                entry = self._logprob_entry(torch.log_softmax(logits, dim=-1), token)
                pending_lp.append((decoded, entry))
            piece = detok.add(token)
            decoded += len(piece)
            text, matched_stop = stopper.feed(piece)
            released += len(text)
            ready = tuple(e for start, e in pending_lp if start < released)
            if ready:
                pending_lp = [(start, e) for start, e in pending_lp if start >= released]
            if text or ready:
                self._emit(TextDelta(text, ready))
            if matched_stop:
                finish = "stop"
                break
            if generated >= params.max_tokens or decoder.full:
                break
            logits = decoder.step(token)
        if not matched_stop:
            # Text still held: an incomplete character, or a tail that could have begun a stop
            # sequence. The stream ended, so it is ordinary text unless a stop matches in it.
            tail, matched_stop = stopper.feed(detok.flush())
            if matched_stop:
                finish = "stop"
            else:
                tail += stopper.flush()
            released += len(tail)
            ready = tuple(e for start, e in pending_lp if not matched_stop or start < released)
            if tail or ready:
                self._emit(TextDelta(tail, ready))
        self._emit(Finished(finish, len(self.prompt_ids), generated))


# --- decoders ---------------------------------------------------------------------------------
class _EagerDecoder:
    """Today's path: one eager forward per token with the model's dynamic KV cache."""

    kind = "eager"
    full = False

    def __init__(self, model: Any, device: torch.device) -> None:
        self._model = model
        self._device = device
        self._cache_name = cache_kwarg(model)
        self._past: Any = None

    def prefill(self, prompt_ids: Sequence[int], *, all_logits: bool) -> torch.Tensor:
        """Logits ``[n, vocab]`` (``all_logits``) or ``[1, vocab]`` of the prompt."""
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self._device)
        kwargs: dict[str, Any] = {"use_cache": True}
        if not all_logits:
            kwargs["logits_to_keep"] = 1
        out = self._model(input_ids=input_ids, **kwargs)
        self._past = _cache_of(out)
        return out.logits[0]

    def step(self, token: int) -> torch.Tensor:
        """The next position's logits, float32 ``[vocab]``."""
        out = self._model(
            input_ids=torch.tensor([[token]], dtype=torch.long, device=self._device),
            use_cache=True,
            **{self._cache_name: self._past},
        )
        self._past = _cache_of(out)
        return out.logits[0, -1].float()


class _GraphDecoder:
    """The decode engine's session: eager prefill into the static cache, replayed steps."""

    def __init__(self, session: Any) -> None:
        self._s = session
        self.kind = f"graphs:{session._e.mode}"

    @property
    def full(self) -> bool:
        """The static cache holds the whole context: no further position fits."""
        return self._s.position >= self._s.capacity

    def prefill(self, prompt_ids: Sequence[int], *, all_logits: bool) -> torch.Tensor:
        return self._s.prefill(prompt_ids, all_logits=all_logits)

    def step(self, token: int) -> torch.Tensor:
        return self._s.step(token)
