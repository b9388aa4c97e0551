"""The engine thread of a resident: the one place its forward passes run (issue 29).

An :class:`EngineLoop` owns one :class:`~miserver.serving.engine.continuous.ContinuousEngine`
and one daemon thread. While the engine has work the thread runs
:meth:`~miserver.serving.engine.continuous.ContinuousEngine.step` in a loop (one scheduler step
and its forward passes each); between two steps it takes what the event loop handed over (new
sequences, cancellations), so requests join and leave the running batch at step boundaries. With
no work it sleeps.

Requests reach it through :meth:`EngineLoop.submit`, which returns one :class:`SequenceStream`
per choice: the :class:`~miserver.serving.engine.generation.Generation` facade the ``/v1`` and
Batch API code already reads (``events()``: one ``Started``, ``TextDelta`` s, one ``Finished``;
``cancel()``; ``wait()``; ``add_done_callback()``). Text is released as
:class:`~miserver.serving.engine.generation.Generation` releases it (whole UTF-8 characters,
stop sequences never emitted: :class:`~miserver.serving.engine.detokenize.StopMatcher`).

**The slot.** The caller holds a share of the scheduler's slot for each request
(:class:`~miserver.serving.engine.slot.Scheduler` with ``join_running``: the requests of the
resident's running batch are one holder). A stream is *done* (:meth:`SequenceStream.wait`
returns, its done callbacks run, the share is released) only once the engine has dropped its
sequence (the step that reported it finished has returned), so a drain that sees every share
released sees an engine with nothing to compute, and no forward pass runs until a new request
joins (after the barrier's release).

**No reader can stall the engine.** The thread never waits on the event loop: events are posted
with ``call_soon_threadsafe``. A stream whose reader has left more than
:data:`STREAM_BUFFER_EVENTS` events unread (a client that stopped reading its stream: the
handler is stuck in a socket write) is cancelled at the next step, with a warning naming the
reason; it costs only its own sequence.

**Holding running work across a commit** (contract 4b; issue 30). The loop implements
:class:`~miserver.serving.engine.parking.Parking`: :meth:`EngineLoop.park_running` asks the
thread to stop at the next step boundary, where it closes the engine's admission and parks every
sequence (:meth:`~miserver.serving.engine.continuous.ContinuousEngine.preempt_all`: KV blocks
freed, prompt and produced token ids kept); no forward pass runs until
:meth:`EngineLoop.resume_parked` reopens admission (each parked sequence is prefilled again,
prompt plus produced tokens, on the weights of that time, ahead of requests that arrive after
it, and continues; a stream simply pauses, nothing sent is sent again) or
:meth:`EngineLoop.end_parked` ends every parked sequence with an error (a torn set). Each produced
token is stamped with the parameter set it was computed on; a choice that spans two or more sets
reports them as :class:`~miserver.serving.engine.provenance.WeightSpan` runs on its
``Finished.weight_spans``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from miserver.serving.engine.detokenize import token_bytes, token_text
from miserver.serving.engine.generation import (
    Finished,
    Generation,
    SamplingParams,
    Started,
    TextDelta,
    TokenLogprob,
    _Sequence,
    end_token_ids,
)
from miserver.serving.engine.parking import EngineHold
from miserver.serving.engine.provenance import WeightSpan
from miserver.serving.engine.slot import Priority

log = logging.getLogger("miserver.engine")

#: Undelivered events (text deltas) one streamed sequence may have before it is cancelled as a
#: reader that stopped reading (issue 29, "No client can stall the engine").
STREAM_BUFFER_EVENTS = 1024

_SEQ_IDS = itertools.count(1)


class SequenceStream(Generation):
    """One choice of one request on the engine: :class:`Generation`'s event facade.

    Made by :meth:`EngineLoop.submit` (bound to the running event loop); never started by
    itself. ``seq_id`` is its sequence's id in the engine. ``cancel()`` asks the engine thread
    to drop the sequence at its next step boundary (``Finished("cancelled")`` follows).
    """

    def __init__(
        self,
        loop: EngineLoop,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        stream: bool,
    ) -> None:
        super().__init__(tokenizer, prompt_ids, params, stream=stream)
        self.seq_id = next(_SEQ_IDS)
        self._engine_loop = loop
        self._request: _Request | None = None  # set by EngineLoop.submit
        self._posted = 0  # events posted (engine thread)
        self._taken = 0  # events taken by the reader (event loop)
        #: ``[set_id, tokens]`` runs: the parameter set each produced token was computed on
        #: (engine thread; contract 4).
        self._runs: list[list[int]] = []
        self.bind()

    def start(self) -> None:  # pragma: no cover - the engine loop runs it
        raise RuntimeError("an engine sequence is started by EngineLoop.submit")

    def cancel(self) -> None:
        """Drop the sequence at the engine's next step (thread-safe, idempotent)."""
        if not self._cancel.is_set():
            self._cancel.set()
            self._engine_loop._request_abort(self)

    @property
    def undelivered(self) -> int:
        """Events posted to the reader and not yet taken."""
        return self._posted - self._taken

    def _took(self) -> None:
        self._taken += 1

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        self._posted += 2 if callback == self._put_two else 1
        super()._post(callback, *args)

    def _stamp(self, set_id: int) -> None:
        """One more token produced by parameter set ``set_id`` (engine thread)."""
        if self._runs and self._runs[-1][0] == set_id:
            self._runs[-1][1] += 1
        else:
            self._runs.append([set_id, 1])

    def weight_spans(self) -> tuple[WeightSpan, ...]:
        """The runs of tokens each parameter set produced, in order, when they are two or more
        sets; ``()`` for one set (then the response's ``X-miLLM-Model`` is the resident's)."""
        if len(self._runs) < 2:
            return ()
        commits = self._engine_loop.hold.set_commits
        return tuple(WeightSpan(sid, commits.get(sid), k) for sid, k in self._runs)

    def _emit(self, event: Any) -> None:
        if isinstance(event, Finished) and not event.weight_spans:
            spans = self.weight_spans()
            if spans:
                event = dataclasses.replace(event, weight_spans=spans)
        super()._emit(event)


class _Choice(_Sequence):
    """The engine thread's state of one :class:`SequenceStream`: text released when final."""

    def __init__(self, stream: SequenceStream, ends: frozenset[int]) -> None:
        super().__init__(stream, ends)
        self.started = False
        self.ended = False  # its Finished (or failure) is sent; the engine may still hold it

    def take(self, token: int, entry: TokenLogprob | None) -> bool:
        """One sampled token; False once the sequence ended here (its ``Finished`` sent)."""
        gen = self.gen
        self.generated += 1
        gen.timing.steps = self.generated
        if token in self.ends:
            self._finish("stop", matched_stop=False)
            return False
        if entry is not None:
            self.pending_lp.append((self.decoded, entry))
        piece = self.detok.add(token)
        self.decoded += len(piece)
        text, matched_stop = self.stopper.feed(piece)
        self.released += len(text)
        ready: tuple[TokenLogprob, ...] = ()
        if self.pending_lp:
            released = self.released
            ready = tuple(e for start, e in self.pending_lp if start < released)
            if ready:
                self.pending_lp = [(s, e) for s, e in self.pending_lp if s >= released]
        if text or ready:
            gen._emit(TextDelta(text, ready))
        if matched_stop:
            self._finish("stop", matched_stop=True)
            return False
        if self.generated >= self.params.max_tokens:
            self._finish("length", matched_stop=False)
            return False
        return True

    def _finish(self, reason: str, *, matched_stop: bool) -> None:
        if not self.ended:
            self.ended = True
            self._end(reason, matched_stop)

    def failed(self, exc: BaseException) -> None:
        if not self.ended:
            self.ended = True
            self.fail(exc)


class EngineLoop:
    """The engine thread of one resident (module docstring).

    Args:
        engine: a :class:`~miserver.serving.engine.continuous.ContinuousEngine` (``add``,
            ``abort``, ``step``, ``has_work``, ``drop_prefix_cache``, ``stats``).
        model: the resident's model (its end tokens; ``echo`` scoring is the engine's).
        tokenizer: its tokenizer (token texts for logprobs, the detokenizer).
        name: the thread's name.
    """

    def __init__(
        self,
        engine: Any,
        model: Any,
        tokenizer: Any,
        name: str = "engine",
        *,
        cross_request_prefix_cache: bool = True,
        threads: int | None = None,
    ) -> None:
        self.engine = engine
        #: torch's intra-op threads on the engine thread (``CPU_THREADS``); None: as it is
        self.threads = threads
        #: False: every new request prefills its whole prompt (the cache is forgotten before
        #: it is admitted), so an answer never depends on what ran before it; the ``n`` choices
        #: of one request still share their prefill (issue 29: on the CPU a prefill of a
        #: prompt's tail alone rounds otherwise than the whole prompt's).
        self.cross_request_prefix_cache = cross_request_prefix_cache
        self.tokenizer = tokenizer
        self._ends = end_token_ids(model, tokenizer)
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, Any]] = []  # ("add", [streams]) / ("abort", stream)
        self._choices: dict[int, _Choice] = {}  # engine thread only
        self._step_lock = threading.Lock()  # held by the engine thread around a step
        #: Work for the step boundary, asked for while a step ran (engine thread runs it).
        self._deferred: list[Callable[[], Any]] = []
        self._closed = False
        #: Steps run since the start (each one scheduler step: one forward pass, on the CPU
        #: passes of up to 128 rows: model_runner.MAX_ROWS).
        self.steps = 0
        #: Submitted requests with a choice not ended yet, in submission order (the places of
        #: the running batch they take or wait for: :meth:`waiting`).
        self._live: dict[int, _Request] = {}
        #: Called on the engine thread after every step's forward pass with its outputs, before
        #: they are delivered (so a step is seen before any request it ends is answered; tests).
        self.on_step: Callable[[int, list[Any]], None] | None = None
        #: Where the served parameter set is named (``served_name``, ``origin``, ``commits``:
        #: the resident the ``X-miLLM-Model`` header reads); set by the weights runtime when it
        #: parks. None: a set's ``commits`` is not known.
        self.served_weights: Callable[[], Any] | None = None
        #: The hold's state and its engine-thread side (contract 4b).
        self.hold = EngineHold(self)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"miserver-{name}")
        self._thread.start()

    # --- event-loop side ----------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        n: int = 1,
        stream: bool = True,
        priority: Priority = Priority.INTERACTIVE,
    ) -> list[SequenceStream]:
        """Add one request's ``n`` choices (call on the event loop); they join the running batch
        at the engine's next step. Choice ``i`` samples with
        :func:`~miserver.serving.engine.sampling.choice_seed` of ``params.seed``; the ``n``
        sequences share one prefill of the prompt (one group). ``stream`` False: each choice's
        text comes as one delta at its end. Returns the streams in choice order.

        Raises:
            RuntimeError: the loop is closed (its resident was dropped).
            ValueError: ``n`` below 1 or an empty prompt.
        """
        from miserver.serving.engine.sampling import choice_seed

        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        if self._closed:
            raise RuntimeError("the engine of this model is closed")
        streams = [
            SequenceStream(
                self,
                self.tokenizer,
                prompt_ids,
                dataclasses.replace(params, seed=choice_seed(params.seed, i)),
                stream,
            )
            for i in range(n)
        ]
        request = _Request(int(priority), open_ids={s.seq_id for s in streams})
        for stream in streams:
            stream._request = request
        with self._cv:
            self._live[id(request)] = request
            self._inbox.append(("add", (streams, int(priority))))
            self._cv.notify()
        return streams

    def waiting(
        self,
        priority: Priority = Priority.INTERACTIVE,
        pending: Sequence[tuple[int, int]] = (),
    ) -> int:
        """Requests of ``priority`` that wait for a place in the running batch: what the
        scheduler counts as queued (``MAX_QUEUED_REQUESTS`` bounds waiting requests, not the
        ones being served; companion contract 1).

        The running batch has ``max_num_seqs`` places (``MAX_BATCH_SIZE`` sequences). A
        request none of whose choices is admitted yet (still waiting, or not yet handed to the
        engine thread) is admitted, as the engine admits it, when the requests ahead of it in
        the engine's admission order (priority, then arrival: ``StepScheduler.schedule``) leave
        a place for its first choice; it then takes the places left for its ``n`` choices (the
        others fork from the first as places free up). Every choice of a request begun
        (decoding, prefilling, preempted or parked by a hold) holds a place. So a request
        submitted to an engine with room is being served (the engine admits it at its next
        step), not queued, as a request granted a free slot is; one past
        the places waits, and is counted, as is every one behind it (admission is in order).

        ``pending``: requests granted a share of the running batch's slot and not submitted
        yet, as ``(priority, n)`` in grant order (the scheduler's); each is counted as a
        request submitted after every one submitted now. Returns a count.
        """
        with self._cv:
            requests = list(self._live.values())
        waiting = [r for r in requests if r.waiting()]
        unbegun = {id(r) for r in waiting}
        free = self._places()
        free -= sum(len(r.open_ids) for r in requests if id(r) not in unbegun)
        queue = [(r.priority, len(r.open_ids)) for r in waiting] + [
            (int(p), int(n)) for p, n in pending
        ]
        count = 0
        for prio, n in sorted(queue, key=lambda item: item[0]):  # stable: arrival within one
            if free > 0:
                free -= min(n, free)
                continue
            count += prio == int(priority)  # no place: it waits, and so does every one behind
        return count

    def _places(self) -> int:
        """The running batch's places (the engine's ``max_num_seqs``; 0 when it has none to
        give, as a closed engine: every request not begun then waits)."""
        config = getattr(getattr(self.engine, "scheduler", None), "config", None)
        return int(getattr(config, "max_num_seqs", 0))

    def interactive_waiting(self, pending: Sequence[tuple[int, int]] = ()) -> int:
        """:meth:`waiting` of interactive requests (the scheduler's ``batch_waiting``)."""
        return self.waiting(Priority.INTERACTIVE, pending)

    def _request_abort(self, stream: SequenceStream) -> None:
        with self._cv:
            self._inbox.append(("abort", stream))
            self._cv.notify()

    def _at_step_boundary(self, work: Callable[[], Any]) -> bool:
        """Run ``work`` now when no step is in flight (inside the barrier none is), else at the
        end of the step in flight, before the next one begins (engine thread). Never waits for
        a step: the caller is the event loop. Returns whether it ran now."""
        if self._step_lock.acquire(blocking=False):
            try:
                work()
            finally:
                self._step_lock.release()
            return True
        with self._cv:
            self._deferred.append(work)
            self._cv.notify()
        return False

    def _run_deferred(self) -> None:
        """Engine thread, holding the step lock: the work asked for while a step ran."""
        with self._cv:
            work, self._deferred = self._deferred, []
        for fn in work:
            try:
                fn()
            except Exception:  # noqa: BLE001 - the thread must outlive it
                log.exception("engine: work at the step boundary failed")

    def drop_prefix_cache(self) -> int:
        """Forget every cached prefix block (the table's ``DROP_CACHE``: nothing computed on old
        weights is reused) before the next step; returns how many blocks are cached now. Does
        not wait for a step in flight (inside the barrier none is): the drop then happens when
        that step ends, before any later admission."""
        cached = int(self.engine.stats().get("prefix_cached_blocks", 0))
        self._at_step_boundary(self.engine.drop_prefix_cache)
        return cached

    def drop_graphs(self) -> None:
        """Drop the engine's captured decode graphs (an adapter change or a model transition:
        the effects that drop graphs; captured again at next use), at the next step boundary
        (a step in flight may be replaying one)."""
        drop = getattr(self.engine, "drop_graphs", None)
        if drop is None:  # the engine's runner's graphs (ContinuousEngine has no method yet)
            graphs = getattr(getattr(self.engine, "runner", None), "graphs", None)
            drop = getattr(graphs, "drop", None)
        if drop is not None:
            self._at_step_boundary(drop)

    # --- Parking (contract 4b; the state is :class:`~miserver.serving.engine.parking.EngineHold`)
    def park_running(self) -> None:
        """Stop at the next step boundary and park every sequence (module docstring). Returns
        at once (event loop); :meth:`wait_parked` waits for the step in progress to end."""
        self.hold.park_running()

    async def wait_parked(self) -> None:
        """Return once no forward pass runs and every sequence is parked."""
        await self.hold.wait_parked()

    def parked_sequences(self) -> int:
        """How many sequences are parked now (a request with ``n`` choices counts ``n``)."""
        return self.hold.parked_sequences()

    def resume_parked(self) -> int:
        """Admit the parked sequences again, ahead of requests that arrive after this call;
        each is prefilled again on the weights of now. Returns how many were parked."""
        return self.hold.resume_parked()

    def end_parked(self, exc: BaseException) -> int:
        """End every parked sequence with ``exc`` (its reader's ``events()`` raises
        :class:`GenerationError` from it); returns how many were parked."""
        return self.hold.end_parked(exc)

    def stats(self) -> dict[str, Any]:
        """The engine's :meth:`~miserver.serving.engine.continuous.ContinuousEngine.stats`
        plus ``steps``."""
        stats = dict(self.engine.stats())
        stats["steps"] = self.steps
        return stats

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the thread once it is idle (the resident is dropped; nothing runs after a
        drain), waiting up to ``wait_s`` seconds for it to end; then the engine (its KV cache)
        is let go. Idempotent."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if wait_s > 0 and self._thread is not threading.current_thread():
            self._thread.join(wait_s)
        if not self._thread.is_alive():
            self._release_engine()
        # else the thread releases the engine as it ends (:meth:`_run`)

    @property
    def closed(self) -> bool:
        return self._closed

    # --- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        finally:  # closed (or failed for good): the engine's cache and model go with the thread,
            # whoever still holds this loop (an app kept alive by a cache, a bound method)
            self._release_engine()

    def _release_engine(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            try:
                close()  # ends anything left, lets go of the cache tensors
            except Exception:  # noqa: BLE001 - the engine goes either way
                log.exception("engine: close failed")
        self.engine = _Closed()

    def _serve(self) -> None:
        if self.threads is not None:  # per thread under OpenMP: the event loop keeps its own
            torch.set_num_threads(self.threads)
        with torch.inference_mode():
            while True:
                with self._cv:
                    while (
                        not self._inbox
                        and not self._closed
                        and not self.hold.park_requested
                        and not self._has_work()
                    ):
                        self._cv.wait()
                    if self._closed and not self._inbox and not self._has_work():
                        return
                    inbox, self._inbox = self._inbox, []
                    park, self.hold.park_requested = self.hold.park_requested, False
                for kind, item in inbox:
                    if kind in ("resume", "end_parked"):
                        try:
                            self.hold.unpark(item)
                        except Exception:  # noqa: BLE001 - the thread must outlive it
                            log.exception("engine: %s failed", kind)
                        continue
                    try:
                        if kind == "add":
                            self._add(*item)
                        else:
                            self._abort(item, "cancelled")
                    except Exception as exc:  # noqa: BLE001 - that request fails, others go on
                        log.exception("engine: %s failed", kind)
                        for stream in item[0] if kind == "add" else (item,):
                            self._fail_stream(stream, exc)
                if park:
                    try:
                        self.hold.park_now()
                    except Exception:  # noqa: BLE001 - the thread must outlive it
                        log.exception("engine: parking failed")
                try:
                    if self._has_work():
                        self._step()
                    self._settle_idle()
                except Exception:  # noqa: BLE001 - the thread must outlive any bug of a step
                    log.exception("engine loop: a step's bookkeeping failed")
                    time.sleep(0.05)

    def _has_work(self) -> bool:
        try:
            return bool(self.engine.has_work())
        except Exception:  # noqa: BLE001 - an engine that cannot say has nothing to run
            log.exception("engine: has_work failed")
            return False

    def _add(self, streams: list[SequenceStream], priority: int) -> None:
        from miserver.serving.engine.sequence import Sequence as EngineSequence

        if not self.cross_request_prefix_cache:
            self.engine.drop_prefix_cache()
        group = object()
        now = time.perf_counter()
        for stream in streams:
            stream.timing.started = now
            stream.timing.thread = threading.current_thread().name
            self._choices[stream.seq_id] = _Choice(stream, self._ends)
            if stream.cancelled:  # its client left before it was added
                self._end_now(stream, "cancelled")
                continue
            seq = EngineSequence(
                seq_id=stream.seq_id,
                prompt_token_ids=list(stream.prompt_ids),
                params=stream.params,
                priority=priority,
                group=group if len(streams) > 1 else None,
                stop_token_ids=self._ends,
            )
            self.engine.add(seq)
            if stream._request is not None:
                stream._request.sequences.append(seq)

    def _abort(self, stream: SequenceStream, reason: str) -> None:
        choice = self._choices.get(stream.seq_id)
        if choice is None:
            return  # finished and gone
        self.engine.abort(stream.seq_id, reason)

    def _end_now(self, stream: SequenceStream, reason: str) -> None:
        """End a stream the engine never held (or no longer holds) at once."""
        choice = self._choices.pop(stream.seq_id, None)
        if choice is None:
            return
        if not choice.started:
            choice.started = True
            choice.begin(None)
        choice._finish(reason, matched_stop=False)
        self._done(stream)

    def _fail_stream(self, stream: SequenceStream, exc: BaseException) -> None:
        choice = self._choices.pop(stream.seq_id, None)
        if choice is not None:
            choice.failed(exc)
            self._done(stream)

    def _begun(self, stream: SequenceStream) -> None:
        request = stream._request
        if request is not None and not request.begun:
            request.begun = True

    def _done(self, stream: SequenceStream) -> None:
        if self.hold.parked_ids:  # a parked sequence its client cancelled is parked no more
            with self._cv:
                self.hold.parked_ids.discard(stream.seq_id)
        self._begun(stream)
        request = stream._request
        if request is not None:
            with self._cv:
                request.open_ids.discard(stream.seq_id)
                if not request.open_ids:
                    self._live.pop(id(request), None)
        stream.timing.ended = time.perf_counter()
        stream._finish_thread()

    def _step(self) -> None:
        set_id = self.hold.set_id  # the weights this step computes on (no hold ends mid-step)
        try:
            with self._step_lock:
                self._run_deferred()
                try:
                    outputs = self.engine.step()
                finally:
                    self._run_deferred()
        except Exception as exc:  # noqa: BLE001 - every running sequence fails with it
            log.warning("engine step failed: %s: %s", type(exc).__name__, exc)
            for seq_id, choice in list(self._choices.items()):
                try:
                    self.engine.abort(seq_id, "error")
                except Exception:  # noqa: BLE001 - the sequence fails anyway
                    log.exception("engine: abort after a failed step")
                choice.failed(exc)
                del self._choices[seq_id]
                self._done(choice.gen)  # type: ignore[arg-type]
            time.sleep(0.05)  # an engine that fails every step must not spin the core
            return
        self.steps += 1
        if self.on_step is not None:  # before any output is delivered: a step is observed
            self.on_step(self.steps, outputs)  # before a request it ends can be answered
        for out in outputs:
            choice = self._choices.get(out.seq_id)
            if choice is None:
                continue
            self._take(choice, out, set_id)
        for choice in list(self._choices.values()):
            stream = choice.gen
            if (
                not choice.ended
                and stream._held is None
                and stream.undelivered > STREAM_BUFFER_EVENTS
                and not stream.cancelled
            ):
                log.warning(
                    "engine: cancelling sequence %s: its reader left %d events unread (a "
                    "client that stopped reading its stream; STREAM_BUFFER_EVENTS %d)",
                    stream.seq_id,
                    stream.undelivered,
                    STREAM_BUFFER_EVENTS,
                )
                stream._cancel.set()
                self.engine.abort(stream.seq_id, "cancelled")

    def _take(self, choice: _Choice, out: Any, set_id: int = 0) -> None:
        stream = choice.gen
        assert isinstance(stream, SequenceStream)
        if (
            not choice.started
            and out.error is None
            and (out.new_token_ids or out.first or out.finished)
        ):
            choice.started = True
            self._begun(stream)
            choice.begin(self._prompt_entries(stream, out.prompt_logprobs))
        if out.error is not None:
            choice.failed(out.error)
        elif not choice.ended:
            entries = out.logprobs or []
            for i, token in enumerate(out.new_token_ids):
                entry = self._entry(entries[i]) if i < len(entries) else None
                stream._stamp(set_id)
                if not choice.take(int(token), entry):
                    if not out.finished:
                        self.engine.abort(stream.seq_id, choice_reason(choice))
                    break
        if out.finished:
            if not choice.ended:
                reason = out.finish_reason or "stop"
                choice._finish(
                    reason if reason in ("stop", "length") else "cancelled", matched_stop=False
                )
            del self._choices[stream.seq_id]
            self._done(stream)

    def _settle_idle(self) -> None:
        """Nothing left to compute: a stream the engine no longer reports on ends now (its
        sequence left without a final output), so no share of the slot is kept for ever."""
        if self._choices and not self.hold.holding and not self._has_work():
            with self._cv:
                if self._inbox:
                    return
            for stream in [c.gen for c in self._choices.values()]:
                assert isinstance(stream, SequenceStream)
                self._end_now(stream, "cancelled")

    def _entry(self, item: Any) -> TokenLogprob:
        tok = self.tokenizer
        top = tuple(
            (int(i), token_text(tok, int(i)), float(v), token_bytes(tok, int(i)))
            for i, v in item.top
        )
        token = int(item.token_id)
        return TokenLogprob(
            token, token_text(tok, token), token_bytes(tok, token), float(item.logprob), top
        )

    def _prompt_entries(
        self, stream: SequenceStream, items: Sequence[Any] | None
    ) -> tuple[TokenLogprob, ...] | None:
        if items is None or not (stream.params.echo and stream.params.logprobs is not None):
            return None
        tok = self.tokenizer
        first = stream.prompt_ids[0]
        head = TokenLogprob(first, token_text(tok, first), token_bytes(tok, first), None)
        return (head, *(self._entry(item) for item in items))


@dataclasses.dataclass
class _Request:
    """The choices of one submitted request: whether any of them has begun, and which have
    not ended (``open_ids``: their ``seq_id`` s; under the loop's condition)."""

    priority: int
    begun: bool = False
    open_ids: set[int] = dataclasses.field(default_factory=set)
    sequences: list[Any] = dataclasses.field(default_factory=list)  # the engine's, once added

    def waiting(self) -> bool:
        """Not begun, and no sequence admitted (each one still waits, or is not added yet)."""
        from miserver.serving.engine.sequence import SequenceStatus

        if self.begun:
            return False
        return all(s.status is SequenceStatus.WAITING for s in list(self.sequences))


class _Closed:
    """The engine of a closed loop: nothing to do, nothing held."""

    def has_work(self) -> bool:
        return False

    def drop_prefix_cache(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {}


def choice_reason(choice: _Choice) -> str:
    """The reason an engine sequence is dropped after its text ended it (a stop sequence or
    the length the stream counted): for the log."""
    return "stop" if choice.generated < choice.params.max_tokens else "length"


__all__ = ["STREAM_BUFFER_EVENTS", "EngineLoop", "SequenceStream", "Started"]
