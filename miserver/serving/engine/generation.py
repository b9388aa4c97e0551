"""Token generation in a worker thread, streamed back to the event loop.

Companion contract 4 and the design notes ("Serving"). A :class:`Generation` is one sequence:
a prefill of the prompt, then a decode loop, in a worker thread (torch releases the GIL inside
its kernels, so ``MAX_CONCURRENT_REQUESTS`` slots really run at once). A :class:`StaticBatch`
runs the sequences of one grant of the slot (the requests of a static batch, ``n`` each) in one
thread, one forward pass a token for all of them
(:class:`~miserver.serving.engine.static_batch.BatchDecoder`); a lone sequence on a CUDA resident
decodes through the decode engine's graphs. Between two decode steps each sequence checks its
cancellation flag, so a disconnected client stops costing compute within one step, and a
sequence that ends leaves the batch while the others go on.

Text is released to the caller only when it is final:

- :class:`~miserver.serving.engine.detokenize.IncrementalDetokenizer` never splits a UTF-8 character (a byte-level token may end in
  the middle of one; that text waits for the next token);
- :class:`~miserver.serving.engine.detokenize.StopMatcher` holds back any tail that could still become a stop sequence, and never
  releases any part of a matched one.

The joined :class:`TextDelta` texts are therefore exactly the completion a non-streamed request
returns. Cross-request caches: none. The KV cache lives and dies with its request, so nothing
computed on old weights survives a weight update (weights page, "The write cycle" 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# re-exported from here for the callers of old: cache_kwarg, _EagerDecoder, _GraphDecoder (the
# decoders), the sampling names (how tokens are picked), _WorkerThreads
from miserver.serving.engine.decoders import _decoder, _EagerDecoder, _GraphDecoder, cache_kwarg  # noqa: F401
from miserver.serving.engine.detokenize import (
    IncrementalDetokenizer,
    StopMatcher,
    token_bytes,
    token_text,
)
from miserver.serving.engine.provenance import WeightSpan
from miserver.serving.engine.sampling import (
    NonFiniteLogits,
    SamplingParams,
    SeedStream,
    TokenLogprob,
    pick_token,
    pick_tokens,
)
from miserver.serving.engine.workers import _WorkerThreads

log = logging.getLogger("miserver.generation")

_WORKERS = _WorkerThreads()


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
    (an end token included). ``weight_spans``: the runs of tokens each parameter set produced,
    in order (:mod:`miserver.serving.engine.provenance`; contract 4); empty when the engine
    does not record them, which means one set."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    weight_spans: tuple[WeightSpan, ...] = ()


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
        engine: the resident's :class:`~miserver.serving.engine.decode_graphs.DecodeEngine` (CUDA
            graphs over a static KV cache), or None to decode eagerly. A busy or closed engine
            is not waited for: the generation decodes eagerly (the tokens are the same).
        stream: True (the default): a :class:`TextDelta` is sent as each piece of text becomes
            final. False, for an answer that is read whole (a non-streamed request): the deltas
            are held on the worker thread and sent as one, their texts joined and their logprobs
            in order, just before the :class:`Finished` (or the failure): the same joined text
            and logprobs, with one wake-up of the event loop a sequence instead of one a token.

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
        stream: bool = True,
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
        self._finished = False  # its Finished was sent (thread side)
        self._prefill_group: object | None = None  # sequences of one request share a prefill
        self._held: list[TextDelta] | None = None if stream else []  # deltas not streamed

    # --- event-loop side ----------------------------------------------------------------------
    def bind(self) -> None:
        """Make the event queue on the running loop, before the thread starts (a static batch
        binds each of its sequences, then runs them in one thread: :class:`StaticBatch`)."""
        if self._started:
            raise RuntimeError("already started")
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._done = self._loop.create_future()
        self._started = True

    def start(self) -> None:
        """Start the generation alone on a worker thread (call on the event loop)."""
        self.bind()
        _WORKERS.submit(lambda: _run_sequences([self]))

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
            self._took()
            if isinstance(event, _Failed):
                raise GenerationError(
                    f"generation failed: {type(event.error).__name__}: {event.error}"
                ) from event.error
            yield event
            if isinstance(event, Finished):
                return

    def _took(self) -> None:
        """An event was taken from the queue (a subclass counts them)."""

    def add_done_callback(self, callback: Any) -> None:
        """Call ``callback()`` on the event loop once the worker thread is done with this
        sequence (at once if it is). The scheduler slot is released this way, whatever happens
        to the caller."""
        assert self._done is not None, "start() first"
        self._done.add_done_callback(lambda _f: callback())

    async def wait(self) -> None:
        """Wait until the worker thread is done with this sequence (it is never left running:
        a sequence of a static batch is done when it finished and the thread will not touch
        it again; the thread may go on decoding the batch's other sequences)."""
        assert self._done is not None, "start() first"
        await asyncio.shield(self._done)

    # --- thread side --------------------------------------------------------------------------
    def _emit(self, event: Event | _Failed) -> None:
        assert self._loop is not None and self._queue is not None
        held = self._held
        if held is not None:  # not streamed: the deltas go out as one, before the end
            if isinstance(event, TextDelta):
                held.append(event)
                return
            if held:
                self._held = []
                merged = TextDelta(
                    "".join(d.text for d in held), tuple(e for d in held for e in d.logprobs)
                )
                self._post(self._put_two, merged, event)
                return
        self._post(self._queue.put_nowait, event)

    def _put_two(self, first: Event, second: Event | _Failed) -> None:
        assert self._queue is not None
        self._queue.put_nowait(first)
        self._queue.put_nowait(second)

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
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


class StaticBatch:
    """The sequences one grant of the slot decodes together (a static batch, contract 4).

    On the event loop, each member of the grant :meth:`join` s with its prompt, sampling and
    ``n``; once every member has joined or left, :meth:`start` runs all the sequences in one
    worker thread, one forward pass a token for all of them
    (:class:`~miserver.serving.engine.static_batch.BatchDecoder`). Each sequence is a
    :class:`Generation` of its own: its events, its cancellation, its end (a sequence that
    stops, reaches its length or is cancelled leaves the batch; the others go on). The batch
    ends when its last sequence ends.
    """

    def __init__(self) -> None:
        self._sequences: list[Generation] = []
        self._started = False

    @property
    def sequences(self) -> int:
        """Sequences joined so far."""
        return len(self._sequences)

    def join(
        self,
        model: Any,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        n: int = 1,
        engine: Any = None,
        stream: bool = True,
    ) -> list[Generation]:
        """Add one request's ``n`` sequences (call on the event loop, before :meth:`start`).

        Choice ``i`` samples with :func:`~miserver.serving.engine.static_batch.choice_seed` of the
        request's seed; the ``n`` sequences share one prefill. Returns their
        :class:`Generation` s, bound to the running loop, in choice order. ``stream``: as
        :class:`Generation`'s (False: each sequence's text comes as one delta at its end).

        Raises:
            RuntimeError: the batch has started.
            ValueError: ``n`` is below 1, the prompt is empty, or ``model`` is not the model
                of the sequences already joined.
        """
        from miserver.serving.engine.static_batch import choice_seed

        if self._started:
            raise RuntimeError("the batch has started")
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        if self._sequences and self._sequences[0].model is not model:
            raise ValueError("a static batch decodes one model")
        prefill = object()  # the n sequences of one request share its prefill
        gens = []
        for i in range(n):
            gen = Generation(
                model,
                tokenizer,
                prompt_ids,
                dataclasses.replace(params, seed=choice_seed(params.seed, i)),
                engine=engine,
                stream=stream,
            )
            gen._prefill_group = prefill
            gen.bind()
            gens.append(gen)
        self._sequences.extend(gens)
        return gens

    def start(self) -> None:
        """Run every joined sequence in one worker thread (idempotent; nothing when none)."""
        if self._started:
            return
        self._started = True
        if self._sequences:
            sequences = list(self._sequences)
            _WORKERS.submit(lambda: _run_sequences(sequences))


# --- the worker ------------------------------------------------------------------------------
def _run_sequences(gens: list[Generation]) -> None:
    """Decode ``gens`` together in this thread (one sequence: the generation alone)."""
    import time

    now = time.perf_counter()
    for gen in gens:
        gen.timing.started = now
        gen.timing.thread = threading.current_thread().name
    try:
        with torch.inference_mode():
            _decode_sequences(gens)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
        log.warning("generation failed: %s: %s", type(exc).__name__, exc)
        for gen in gens:
            if not gen._finished:
                gen._emit(_Failed(exc))
    finally:
        now = time.perf_counter()
        for gen in gens:
            if not gen.timing.ended:
                gen.timing.ended = now
            gen._finish_thread()


class _Sequence:
    """One sequence's decoding state on the worker thread: sampling, logprobs, text released
    only when final (UTF-8 and stop sequences), cancellation (contract 4)."""

    def __init__(self, gen: Generation, ends: frozenset[int]) -> None:
        params = gen.params
        self.gen = gen
        self.params = params
        self.ends = ends
        self.generator: SeedStream | None = None
        if params.seed is not None and params.temperature > 0:
            self.generator = SeedStream(params.seed)
        self.want_logprobs = params.logprobs is not None
        self.detok = IncrementalDetokenizer(gen.tokenizer, gen.prompt_ids)
        self.stopper = StopMatcher(params.stop)
        # Logprob entries wait with their token's start offset in the completion's text and go
        # out with the first text that reaches that offset: a token held back by the stop
        # matcher, or cut off by a stop sequence, is reported only if its text is (contract 4).
        self.pending_lp: list[tuple[int, TokenLogprob]] = []
        self.decoded = 0  # characters the detokenizer has produced
        self.released = 0  # characters of completion text sent
        self.generated = 0
        # The constraint hook (ENGINE_API "Constraint hook"): mask before the choice, accept after.
        self.matcher = params.constraint.new_matcher() if params.constraint is not None else None

    def begin(self, prompt_lp: tuple[TokenLogprob, ...] | None) -> None:
        self.gen._emit(Started(len(self.gen.prompt_ids), prompt_lp))

    def advance(
        self,
        logits: torch.Tensor,
        full: bool,
        best: tuple[float, int] | None = None,
        picked: int | NonFiniteLogits | None = None,
        unmasked: torch.Tensor | None = None,
    ) -> int | None:
        """Take the next token from ``logits`` (float32 ``[vocab]``); returns it when the
        sequence goes on (``full``: no further position fits), None when it ended (its
        :class:`Finished` sent). ``best``: ``torch.max`` of ``logits`` (value, index), when the
        caller has it: a greedy sequence takes its index (what :func:`pick_token` would).
        ``picked``: this row's :func:`pick_tokens` result, when the caller sampled the batch.
        ``unmasked``: for a constrained sequence whose row the caller already masked
        (:func:`_mask_constrained`), the row before masking (its logprobs); without it a constrained
        sequence masks a copy of ``logits`` here (``best`` and ``picked`` are then unused)."""
        gen = self.gen
        if gen._cancel.is_set():
            return self._end("cancelled", matched_stop=False)
        if self.matcher is not None and unmasked is None:
            unmasked = logits
            logits = logits.clone()
            self.matcher.fill_mask(logits)
            best = picked = None
        if isinstance(picked, NonFiniteLogits):
            raise picked
        if picked is not None:
            token = int(picked)
        elif best is not None and self.params.temperature == 0:
            if not math.isfinite(best[0]):
                raise NonFiniteLogits()
            token = int(best[1])
        else:
            token = pick_token(logits, self.params, self.generator)
        self.generated += 1
        gen.timing.steps = self.generated
        if token in self.ends:
            return self._end("stop", matched_stop=False)
        if self.matcher is not None:
            self.matcher.accept(token)
        if self.want_logprobs:
            raw = unmasked if unmasked is not None else logits
            entry = gen._logprob_entry(torch.log_softmax(raw, dim=-1), token)
            self.pending_lp.append((self.decoded, entry))
        piece = self.detok.add(token)
        self.decoded += len(piece)
        text, matched_stop = self.stopper.feed(piece)
        self.released += len(text)
        ready: tuple[TokenLogprob, ...] = ()
        if self.pending_lp:  # without logprobs there are none: no scan a token
            released = self.released
            ready = tuple(e for start, e in self.pending_lp if start < released)
            if ready:
                self.pending_lp = [(start, e) for start, e in self.pending_lp if start >= released]
        if text or ready:
            gen._emit(TextDelta(text, ready))
        if matched_stop:
            return self._end("stop", matched_stop=True)
        if self.matcher is not None and self.matcher.is_terminated():
            return self._end("stop", matched_stop=False)
        if self.generated >= self.params.max_tokens or full:
            return self._end("length", matched_stop=False)
        return token

    def advance_or_fail(
        self,
        logits: torch.Tensor,
        full: bool,
        best: tuple[float, int] | None = None,
        picked: int | NonFiniteLogits | None = None,
        unmasked: torch.Tensor | None = None,
    ) -> int | None:
        """:meth:`advance`; a failure of this sequence alone (its sampling, e.g. non-finite
        logits in its row, or its grammar) ends it with the failure, and the batch's other
        sequences go on."""
        try:
            return self.advance(logits, full, best, picked, unmasked)
        except Exception as exc:  # noqa: BLE001 - reported to this sequence's caller
            log.warning("generation failed: %s: %s", type(exc).__name__, exc)
            self.fail(exc)
            return None

    def fail(self, exc: BaseException) -> None:
        """End this sequence with ``exc`` (raised from its :meth:`Generation.events`)."""
        self.gen._emit(_Failed(exc))
        self.gen._finished = True

    def _end(self, finish: str, matched_stop: bool) -> None:
        gen = self.gen
        if not matched_stop:
            # Text still held: an incomplete character, or a tail that could have begun a stop
            # sequence. The stream ended, so it is ordinary text unless a stop matches in it.
            tail, matched_stop = self.stopper.feed(self.detok.flush())
            if matched_stop:
                finish = "stop"
            else:
                tail += self.stopper.flush()
            self.released += len(tail)
            ready = tuple(
                e for start, e in self.pending_lp if not matched_stop or start < self.released
            )
            if tail or ready:
                gen._emit(TextDelta(tail, ready))
        gen._emit(Finished(finish, len(gen.prompt_ids), self.generated))
        gen._finished = True
        return None


def _decode_sequences(gens: list[Generation]) -> None:
    """Prefill each distinct prompt alone, then decode every sequence together, one forward
    pass a step, until the last one ends (module docstring; :mod:`miserver.serving.engine.static_batch`)."""
    first = gens[0]
    model = first.model
    ends = end_token_ids(model, first.tokenizer)
    groups: dict[int, list[_Sequence]] = {}
    for gen in gens:
        groups.setdefault(id(gen._prefill_group or gen), []).append(_Sequence(gen, ends))
    with _decoder(gens) as decoder:
        for gen in gens:
            gen.timing.extra["decoder"] = decoder.kind
        sources: list[int] = []
        active: list[_Sequence] = []
        tokens: list[int] = []
        prefilled = 0
        ended: list[_Sequence] = []  # ended before the decode, not yet told done

        def done_now(more: bool) -> None:
            # Sequences that ended while a prefill is still to come are done at once (another
            # member still holds the slot); the last ones are done once the thread is through
            # with the model (below, or by _run_sequences).
            if more:
                for seq in ended:
                    seq.gen._finish_thread()
                ended.clear()

        order = list(groups.values())
        for number, group in enumerate(order, start=1):
            lead = group[0]
            more = number < len(order)
            if all(seq.gen._cancel.is_set() for seq in group):
                # Its client went away while the batch formed: no prefill for nobody to read.
                for seq in group:
                    seq.begin(None)
                    seq._end("cancelled", matched_stop=False)
                    ended.append(seq)
                done_now(more)
                continue
            score = lead.params.echo and lead.want_logprobs
            try:
                prompt_logits = decoder.prefill(lead.gen.prompt_ids, all_logits=score)
                prompt_lp = lead.gen._prompt_logprobs(prompt_logits[:-1]) if score else None
            except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
                if len(groups) == 1:
                    raise
                log.warning("generation failed: %s: %s", type(exc).__name__, exc)
                for seq in group:
                    seq.fail(exc)
                    ended.append(seq)
                done_now(more)
                continue
            index = prefilled
            prefilled += 1
            logits = prompt_logits[-1].float()
            del prompt_logits
            for seq in group:
                seq.begin(prompt_lp)
                token = seq.advance_or_fail(logits, decoder.full(0))
                if token is None:  # ended at its first token: done before the next prefill
                    ended.append(seq)
                    continue
                sources.append(index)
                active.append(seq)
                tokens.append(token)
            done_now(more)
        if not active:
            return
        for seq in ended:  # the others go on
            seq.gen._finish_thread()
        decoder.begin(sources)
        greedy = any(seq.params.temperature == 0 for seq in active)
        while active:
            logits = decoder.step(tokens)
            unmasked = _mask_constrained(logits, active)
            batched_sampling = len(active) > 1 and _samples_batched(logits)
            # the greedy rows' tokens in one pass and one read (a GPU sync per row is slow)
            best = None
            picked = None
            if batched_sampling:
                # every row's token in a few batched operations and one read (a GPU sync per
                # row was most of a step of many sequences)
                picked = pick_tokens(
                    logits, [q.params for q in active], [q.generator for q in active]
                )
            elif greedy and len(active) > 1:
                values, indices = torch.max(logits, dim=-1)
                best = list(zip(values.tolist(), indices.tolist(), strict=True))
            kept: list[int] = []
            still: list[_Sequence] = []
            tokens = []
            for row, seq in enumerate(active):
                token = seq.advance_or_fail(
                    logits[row],
                    decoder.full(row),
                    best[row] if best is not None else None,
                    picked[row] if picked is not None else None,
                    unmasked[row] if unmasked is not None else None,
                )
                if token is None:
                    continue
                kept.append(row)
                still.append(seq)
                tokens.append(token)
            if still:
                for seq in active:
                    if seq.gen._finished:  # the others go on: this one is done with
                        seq.gen._finish_thread()
                decoder.keep(kept)
            active = still


def _mask_constrained(
    logits: torch.Tensor, active: list[_Sequence]
) -> list[torch.Tensor | None] | None:
    """The constraint hook for a decode step: mask the rows of constrained sequences in
    ``logits`` (float32 ``[rows, vocab]``, in place) before any token is chosen; return each
    masked row as it was (for logprobs; None for a free row), or None (``logits`` untouched)
    when no sequence is constrained. A row whose grammar fails is left as it was (None): its
    :meth:`_Sequence.advance` masks it again and reports the failure to that sequence alone."""
    rows = [r for r, seq in enumerate(active) if seq.matcher is not None]
    if not rows:
        return None
    before = logits.clone()
    unmasked: list[torch.Tensor | None] = [None] * len(active)
    for r in rows:
        try:
            active[r].matcher.fill_mask(logits[r])  # type: ignore[union-attr]
            unmasked[r] = before[r]
        except Exception:  # noqa: BLE001 - raised again for this sequence in advance()
            logits[r] = before[r]
    return unmasked


def _samples_batched(logits: torch.Tensor) -> bool:
    """Whether a batch's rows are sampled together (:func:`pick_tokens`): on CUDA, where a
    synchronisation a row is expensive and a batch equals its requests alone to rounding only;
    on the CPU row by row, which keeps a batched answer the bits of the request alone."""
    return logits.is_cuda
