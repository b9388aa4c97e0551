"""A sequence's generation as the ``/v1`` handlers and the Batch API read it: its events, and
the text released only when final.

Companion contract 4 and the design notes ("Serving"). Every sequence on a transformers resident
runs on the resident's continuous engine (:mod:`miserver.serving.engine.engine_loop`, issue 29):
a :class:`Generation` is the event-loop side of one choice (:class:`Started`, :class:`TextDelta`
s, one :class:`Finished`; cancellation; the moment the engine is done with it), whose events the
engine thread posts. A GGUF resident's sequences give the same events
(:class:`~miserver.serving.models.gguf.GGUFGeneration`).

Text is released to the caller only when it is final:

- :class:`~miserver.serving.engine.detokenize.IncrementalDetokenizer` never splits a UTF-8 character (a byte-level token may end in
  the middle of one; that text waits for the next token);
- :class:`~miserver.serving.engine.detokenize.StopMatcher` holds back any tail that could still become a stop sequence, and never
  releases any part of a matched one.

The joined :class:`TextDelta` texts are therefore exactly the completion a non-streamed request
returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# The names the callers of this module read the sampling and the token texts by.
from miserver.serving.engine.detokenize import (  # noqa: F401
    IncrementalDetokenizer,
    StopMatcher,
    token_bytes,
    token_text,
)
from miserver.serving.engine.provenance import WeightSpan
from miserver.serving.engine.sampling import (  # noqa: F401
    NonFiniteLogits,
    SamplingParams,
    SeedStream,
    TokenLogprob,
    choice_seed,
    pick_token,
    pick_tokens,
)

log = logging.getLogger("miserver.generation")


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
    """Generation failed on the engine thread; ``__cause__`` is the original exception."""


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


# --- the event facade --------------------------------------------------------------------------
@dataclass
class _Timing:
    started: float = 0.0
    ended: float = 0.0
    thread: str = ""
    steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Generation:
    """One sequence's events, produced on the engine thread and read on the event loop.

    Args:
        tokenizer: its transformers tokenizer.
        prompt_ids: the prompt's token ids (at least one).
        params: :class:`SamplingParams`.
        stream: True (the default): a :class:`TextDelta` is sent as each piece of text becomes
            final. False, for an answer that is read whole (a non-streamed request): the deltas
            are held on the engine thread and sent as one, their texts joined and their logprobs
            in order, just before the :class:`Finished` (or the failure): the same joined text
            and logprobs, with one wake-up of the event loop a sequence instead of one a token.

    The producer (:class:`~miserver.serving.engine.engine_loop.SequenceStream`, made by
    :meth:`~miserver.serving.engine.engine_loop.EngineLoop.submit`) binds it on the event loop;
    the caller iterates :meth:`events` and must keep holding its scheduler slot until
    :meth:`wait` returns (a generation binds to one parameter set). A failure on the engine
    thread is raised from :meth:`events` as :class:`GenerationError` (``__cause__``: the
    original).

    Raises:
        ValueError: the prompt has no tokens.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        stream: bool = True,
    ) -> None:
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        self.tokenizer = tokenizer
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.params = params
        self.timing = _Timing()
        self._cancel = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[Event | _Failed] | None = None
        self._done: asyncio.Future[None] | None = None
        self._started = False
        self._finished = False  # its Finished was sent (producer side)
        self._held: list[TextDelta] | None = None if stream else []  # deltas not streamed

    # --- event-loop side ----------------------------------------------------------------------
    def bind(self) -> None:
        """Make the event queue on the running loop, before the producer posts to it."""
        if self._started:
            raise RuntimeError("already started")
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._done = self._loop.create_future()
        self._started = True

    def cancel(self) -> None:
        """Ask the producer to stop before its next step (thread-safe, idempotent)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def events(self) -> AsyncIterator[Event]:
        """The events: one :class:`Started`, :class:`TextDelta` s, one :class:`Finished`.

        Raises:
            GenerationError: the producer failed (prefill or any decode step).
        """
        assert self._queue is not None, "bind() first"
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
        """Call ``callback()`` on the event loop once the producer is done with this sequence
        (at once if it is). The scheduler slot is released this way, whatever happens to the
        caller."""
        assert self._done is not None, "bind() first"
        self._done.add_done_callback(lambda _f: callback())

    async def wait(self) -> None:
        """Wait until the producer is done with this sequence (it is never left running: the
        engine may go on decoding other sequences, never this one)."""
        assert self._done is not None, "bind() first"
        await asyncio.shield(self._done)

    # --- producer side ------------------------------------------------------------------------
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


class _Sequence:
    """One sequence's text on the engine thread: released only when final (UTF-8 and stop
    sequences), its logprobs with the text they belong to, its end (contract 4). The engine
    loop's choice (:class:`~miserver.serving.engine.engine_loop._Choice`) feeds it tokens."""

    def __init__(self, gen: Generation, ends: frozenset[int]) -> None:
        params = gen.params
        self.gen = gen
        self.params = params
        self.ends = ends
        self.detok = IncrementalDetokenizer(gen.tokenizer, gen.prompt_ids)
        self.stopper = StopMatcher(params.stop)
        # Logprob entries wait with their token's start offset in the completion's text and go
        # out with the first text that reaches that offset: a token held back by the stop
        # matcher, or cut off by a stop sequence, is reported only if its text is (contract 4).
        self.pending_lp: list[tuple[int, TokenLogprob]] = []
        self.decoded = 0  # characters the detokenizer has produced
        self.released = 0  # characters of completion text sent
        self.generated = 0

    def begin(self, prompt_lp: tuple[TokenLogprob, ...] | None) -> None:
        self.gen._emit(Started(len(self.gen.prompt_ids), prompt_lp))

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
