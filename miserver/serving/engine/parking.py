"""What a quiesce that holds running work needs from the engine (contract 4b; issue 30).

The lifecycle table decides when (``PARK_RUNNING``, ``RESUME_PARKED``, ``END_PARKED_TORN``);
:class:`~miserver.serving.weights.effects.EffectPerformer` calls these methods on the resident's
engine when the engine offers them. A resident without one (a GGUF resident, llama.cpp) makes a
``{"running": "hold"}`` quiesce a 409 ``BARRIER_UNAVAILABLE`` reason ``hold_unsupported``: a
hold is never faked by a drain.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger("miserver.engine")


@runtime_checkable
class Parking(Protocol):
    """An engine that can park its running sequences at a step boundary.

    The continuous engine implements it over ``ContinuousEngine.close_admission``,
    ``preempt_all`` and ``open_admission``: parking frees every running sequence's KV blocks
    and keeps its prompt and produced token ids, so a parked sequence is prefilled again (prompt
    plus produced tokens) when it is admitted again, on the weights of that time, and continues;
    the tokens a client was sent are never sent again or changed.
    """

    def park_running(self) -> None:
        """Stop at the next step boundary and park every running sequence. Returns at once
        (called on the event loop, under the weights lock). An engine that also offers
        ``async wait_parked()`` ends the quiesce's drain when that returns (the step in progress
        ended; the parked requests keep their share of the slot, computing nothing); without
        it the drain waits for the slot as a ``finish`` drain does."""

    def parked_sequences(self) -> int:
        """How many sequences are parked now (a request with ``n`` choices counts ``n``)."""

    def resume_parked(self) -> int:
        """Admit the parked sequences again, ahead of new requests; returns how many."""

    def end_parked(self, exc: BaseException) -> int:
        """End every parked sequence with ``exc`` (a torn set's 503 ``WEIGHTS_TORN``: its
        stream ends with one error event); returns how many."""


def parking_of(host: Any) -> Parking | None:
    """The resident's engine when it can park running sequences, else ``None``.

    ``host``: a :class:`~miserver.serving.models.host.ModelHost`: its resident's ``engine_loop``
    (:class:`~miserver.serving.engine.engine_loop.EngineLoop`; None on a GGUF resident).
    """
    resident = getattr(host, "resident", None)
    engine = getattr(resident, "engine_loop", None) if resident is not None else None
    return engine if isinstance(engine, Parking) else None  # issue 30


class EngineHold:
    """The hold of one :class:`~miserver.serving.engine.engine_loop.EngineLoop` (its
    :class:`Parking` side; issue 30): what is parked, and which parameter set computes now.

    The event-loop calls (:meth:`park_running`, :meth:`resume_parked`, :meth:`end_parked`) only
    set flags and queue work under the loop's condition; the engine thread acts on them at its
    next step boundary (:meth:`park_now`, :meth:`unpark`), so no step is ever cut in two.

    Attributes:
        set_id: the parameter set computing now; it grows at a resume when the resident's
            served name, origin or commit count differ from the park's (or are not known).
        set_commits: each set's ``commits`` as ``X-miLLM-Model`` states it (None: not known).
        parked_ids: the ids of the sequences parked (engine thread writes, under the condition).
        holding: the engine's admission is closed for a hold (engine thread).
    """

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.park_requested = False
        self.park_future: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None
        self.parked = False  # a hold is in force (parked, or asked to park)
        self.holding = False
        self.parked_ids: set[Any] = set()
        self.park_key: tuple[Any, ...] | None = None
        self.set_id = 0
        self.set_commits: dict[int, int | None] = {}

    def _served(self) -> tuple[tuple[Any, ...] | None, int | None]:
        source = getattr(self.loop, "served_weights", None)
        served = source() if source is not None else None
        if served is None:
            return None, None
        commits = getattr(served, "commits", None)
        key = (getattr(served, "served_name", None), getattr(served, "origin", None), commits)
        return key, commits

    # --- event loop ---------------------------------------------------------------------------
    def park_running(self) -> None:
        """See :meth:`Parking.park_running`."""
        try:
            aio: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            aio = None
        key, commits = self._served()
        with self.loop._cv:
            self.park_key = key
            self.set_commits[self.set_id] = commits
            self.parked = True
            if self.loop.closed:  # nothing runs any more: nothing to wait for
                return
            self.park_requested = True
            if aio is not None:
                self.park_future = (aio, aio.create_future())
            self.loop._cv.notify()

    async def wait_parked(self) -> None:
        """Return once the engine thread parked (at once when no park is pending)."""
        with self.loop._cv:
            pending = self.park_future
        if pending is not None:
            await asyncio.shield(pending[1])

    def parked_sequences(self) -> int:
        """See :meth:`Parking.parked_sequences`."""
        with self.loop._cv:
            return len(self.parked_ids) if self.parked else 0

    def resume_parked(self) -> int:
        """See :meth:`Parking.resume_parked`: a new set when the served weights changed."""
        key, commits = self._served()
        with self.loop._cv:
            if not self.parked:
                return 0
            self._cancel_pending_park()
            n = len(self.parked_ids)
            if key is None or key != self.park_key:
                self.set_id += 1
                self.set_commits[self.set_id] = commits
            self.parked = False
            self.parked_ids = set()
            self.loop._inbox.append(("resume", None))
            self.loop._cv.notify()
        return n

    def end_parked(self, exc: BaseException) -> int:
        """See :meth:`Parking.end_parked`; every sequence the hold kept ends too."""
        with self.loop._cv:
            if not self.parked:
                return 0
            self._cancel_pending_park()
            n = len(self.parked_ids)
            self.parked = False
            self.parked_ids = set()
            self.loop._inbox.append(("end_parked", exc))
            self.loop._cv.notify()
        return n

    def _cancel_pending_park(self) -> None:
        """A hold that ends before the engine thread parked (an idle engine's quiesce answers
        at once): the thread must not park after the end (caller holds the condition)."""
        if self.park_requested:
            self.park_requested = False
            future, self.park_future = self.park_future, None
            if future is not None:
                future[0].call_soon_threadsafe(_resolve, future[1])

    # --- engine thread ------------------------------------------------------------------------
    def park_now(self) -> None:
        """At a step boundary: close admission and park every sequence (recompute-preempted
        ones waiting too, so nothing is admissible and no forward pass runs)."""
        from miserver.serving.engine.sequence import SequenceStatus

        engine = self.loop.engine
        engine.close_admission()
        engine.preempt_all()
        scheduler = getattr(engine, "scheduler", None)
        for seq in list(getattr(scheduler, "waiting", ())):
            if seq.status is SequenceStatus.PREEMPTED:
                seq.parked = True
        self.holding = True
        with self.loop._cv:
            self.parked_ids = set(self.loop._choices)
            future, self.park_future = self.park_future, None
        if future is not None:
            aio, fut = future
            aio.call_soon_threadsafe(_resolve, fut)

    def unpark(self, exc: BaseException | None) -> None:
        """End the hold; with ``exc`` every sequence the engine holds ends with it first."""
        loop = self.loop
        if exc is not None:
            for seq_id, choice in list(loop._choices.items()):
                try:
                    loop.engine.abort(seq_id, "error")
                except Exception:  # noqa: BLE001 - the sequence ends anyway
                    log.exception("engine: abort of a parked sequence")
                choice.failed(exc)
                del loop._choices[seq_id]
                loop._done(choice.gen)
        self.holding = False
        loop.engine.open_admission()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
