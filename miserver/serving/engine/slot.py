"""The execution slots: a bounded priority queue in front of ``max_concurrent`` slots.

Companion contract 1 and 4, weights page "The write cycle" 2. A forward pass runs only while its
caller holds a slot. Waiters are granted in priority order (:class:`Priority`: the barrier first,
then interactive requests, then batch chunks), first come first served within a priority.

**Batches** (contract 4, issue 14). A waiter may name a ``group`` (the resident and adapter it
is computed on) and a ``size`` (the sequences it decodes: a request's ``n``). When a free slot
is granted to a grouped waiter, the waiting work of that group joins it, in priority order
(interactive first, then batch chunks; first come first served within a priority), up to
``max_batch_size`` sequences: one :class:`SlotBatch`, one holder of the slot. Every member gets
its own :class:`Grant`; the slot is free again when the last member released its grant. A
member tells the scheduler it has handed its sequences to the engine with :meth:`Grant.join`.
Without ``join_running`` or ``fill_running``, work that arrives meanwhile waits for
the next grant, as it waits for the slot.

**Joining the running batch** (``join_running``, issue 29; the server always sets it: the
continuous engine serves every transformers resident): a grouped waiter is granted at once
into its group's running batch (one holder) unless the barrier holds or drains or a waiter as
good waits; the engine admits it at its next step; a drain waits for every member. A member is
queued (counted toward ``max_queued``) only while the engine has no place for it in the running
batch (``batch_waiting``: the engine's count; a member not yet handed to the engine is told to it).

**Filling the running batch** (``fill_running``, a GGUF resident: llama.cpp's parallel slots
batch whatever they hold at each of its steps): as joining the running batch, but only while the
batch has room (``max_batch_size`` sequences of members that have not released); a waiter that
does not fit waits, held and counted as any, and joins when a member releases.

**The batch delay** (``MAX_BATCH_DELAY_MS``, contract 1; the max batch delay of TorchServe and
Triton's dynamic batcher). With a delay set, a grouped waiter that finds a slot free does not
take it alone at once: the free slot *gathers*. It is granted (to the waiters queued by then,
in the usual order) when the waiting grouped work fills ``max_batch_size`` sequences, when no
new grouped waiter has arrived for ``batch_delay_s`` (a quiet gap: a burst of clients that
keep arriving keeps the slot gathering), or at the latest ``GATHER_CAP_FACTOR`` x
``batch_delay_s`` after the gathering began (a lone request pays the gap once). A gathering
slot holds nothing: the barrier's drain does not wait for it (its waiters are held), and a
slot freed with work already queued is granted at once.

**Units** (a Batch API chunk). A waiter may belong to a :class:`Unit`: the held counts count a
unit's held batch waiters once (``held_batch`` is chunks, not rows), and a unit made with
``members`` gathers: none of its waiters is granted until every member is waiting or has left
it, so a chunk's rows are granted together, never the first alone.

The step barrier is built on :meth:`Scheduler.barrier_acquire`: it stops granting slots, waits
until every running holder has released its slot (the drain), then holds all of them. Waiters
that arrive meanwhile are *held*, not failed; :meth:`Scheduler.barrier_release` lets them run in
their original order, :meth:`Scheduler.fail_held` refuses them (a torn set).

Everything here runs on the event loop's thread; nothing blocks and nothing imports torch.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Hashable, Iterable
from contextlib import asynccontextmanager

from miserver.serving.engine.grants import (  # noqa: F401 - re-exported: slot's public names
    DrainTimeout,
    Grant,
    HeldCounts,
    Priority,
    QueueFull,
    SlotBatch,
    Unit,
    _Waiter,
)

log = logging.getLogger("miserver.scheduler")

#: A gathering slot is granted at the latest this many batch delays after it began gathering.
GATHER_CAP_FACTOR = 10


class Scheduler:
    """``max_concurrent`` execution slots behind a priority queue of at most ``max_queued``
    waiting interactive requests; a grant of a slot takes up to ``max_batch_size`` sequences of
    one group (:class:`SlotBatch`).

    Use :meth:`slot` around every forward pass::

        async with scheduler.slot(Priority.INTERACTIVE):
            ...  # run the generation to its end

    Raises ``ValueError`` for a limit below 1.
    """

    def __init__(
        self,
        max_concurrent: int = 1,
        max_queued: int = 64,
        max_batch_size: int = 1,
        batch_delay_s: float = 0.0,
        join_running: bool = False,
    ) -> None:
        self._max_concurrent = 1
        self.join_running = bool(join_running)  #: see the module docstring
        self._open: dict[Hashable, SlotBatch] = {}  # group -> its running batch (join_running)
        #: Interactive requests of the running batch (``join_running``) that wait for a place
        #: in it, told the members granted into it that have not joined yet (their
        #: ``(priority, size)``, in grant order): the engine's count
        #: (:meth:`~miserver.serving.engine.engine_loop.EngineLoop.waiting`); queued, and
        #: bounded by ``max_queued`` with the waiters. Without an engine none waits.
        self.batch_waiting: Callable[[list[tuple[int, int]]], int] = lambda pending: 0
        self._unjoined: dict[int, Grant] = {}  # grants into a running batch not joined yet
        self._max_queued = 1
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int):
            raise ValueError(f"max_batch_size must be an integer, got {max_batch_size!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        #: The most sequences one grant of a slot decodes together (``MAX_BATCH_SIZE``).
        self.max_batch_size = max_batch_size
        if isinstance(batch_delay_s, bool) or not isinstance(batch_delay_s, int | float):
            raise ValueError(f"batch_delay_s must be a number, got {batch_delay_s!r}")
        if not 0 <= batch_delay_s <= 10:
            raise ValueError(f"batch_delay_s must be within 0..10 s, got {batch_delay_s}")
        #: The quiet gap a free slot waits for more grouped work (``MAX_BATCH_DELAY_MS``; 0: none).
        self.batch_delay_s = float(batch_delay_s)
        self._gather_began: float | None = None  # loop time a free slot began gathering
        self._last_arrival = 0.0  # loop time of the newest grouped waiter while gathering
        self._gather_timer: asyncio.TimerHandle | None = None
        #: Gatherings ended by each cause (``full``, ``gap``, ``cap``), for the metrics.
        self.gathers = {"full": 0, "gap": 0, "cap": 0}
        self.set_limits(max_concurrent=max_concurrent, max_queued=max_queued)
        self._running = 0
        self._running_requests = 0  # grants not yet released, over every running batch
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self._barrier_draining = False
        self._barrier_held = False
        self._drained: asyncio.Event | None = None
        self._cache_droppers: list[Callable[[], None]] = []

    # --- limits -------------------------------------------------------------------------------
    @property
    def max_concurrent(self) -> int:
        return self._max_concurrent

    @property
    def max_queued(self) -> int:
        return self._max_queued

    def set_limits(self, max_concurrent: int | None = None, max_queued: int | None = None) -> None:
        """Change the limits at run time (``PATCH /api/settings``, contract 1).

        A lower ``max_concurrent`` lets running requests finish and grants no new slot until
        fewer run; a higher one grants waiting requests at once. Raises ``ValueError`` below 1.
        """
        for name, value in (("max_concurrent", max_concurrent), ("max_queued", max_queued)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")
        if max_concurrent is not None:
            self._max_concurrent = max_concurrent
        if max_queued is not None:
            self._max_queued = max_queued
        if hasattr(self, "_heap"):
            self._grant()

    # --- state --------------------------------------------------------------------------------
    @property
    def barrier_held(self) -> bool:
        """The barrier holds every slot (quiesced)."""
        return self._barrier_held

    @property
    def barrier_draining(self) -> bool:
        """:meth:`barrier_acquire` is waiting for running requests to finish."""
        return self._barrier_draining

    def counts(self) -> HeldCounts:
        """The current :class:`HeldCounts`."""
        waiting = [w for w in self._heap if not w.future.done()]
        inter = sum(1 for w in waiting if w.priority == Priority.INTERACTIVE)
        batch = [w for w in waiting if w.priority == Priority.BATCH]
        if self._barrier_held or self._barrier_draining:
            chunks = len({id(w.unit) for w in batch if w.unit is not None})
            chunks += sum(1 for w in batch if w.unit is None)
            return HeldCounts(inter, chunks, self._running, len(waiting) - inter - len(batch))
        return HeldCounts(0, 0, self._running, len(waiting) + self._engine_waiting())

    def interactive_waiting(self) -> int:
        """Interactive requests waiting for a slot, queued or held by the barrier: what
        ``max_queued`` (MAX_QUEUED_REQUESTS, contract 1) bounds. Batch chunks are not counted."""
        return self._waiting_interactive()

    def _waiting_interactive(self) -> int:
        return self._engine_waiting() + sum(
            1 for w in self._heap if w.priority == Priority.INTERACTIVE and not w.future.done()
        )

    def _engine_waiting(self) -> int:
        """Interactive requests of the running batch waiting for a place in it: a member
        granted into it counts as the engine counts a request it was handed, once it joins
        (the engine loop's ``waiting``), and, until then, as one handed to it last."""
        live = {k: g for k, g in self._unjoined.items() if not (g.joined or g.released)}
        self._unjoined = live
        return self.batch_waiting([(int(g.priority), g.size) for g in live.values()])

    def _track(self, grant: Grant) -> Grant:
        """Remember a grant into a running batch (``join_running``) until it joins."""
        if grant.batch.group is not None and not grant.batch.bounded:
            self._unjoined[id(grant)] = grant
        return grant

    # --- slots --------------------------------------------------------------------------------
    async def acquire(
        self,
        priority: Priority,
        *,
        group: Hashable | None = None,
        size: int = 1,
        unit: Unit | None = None,
        fill_running: bool = False,
    ) -> Grant:
        """Wait for a slot. Pair with :meth:`release`; prefer :meth:`slot`.

        ``group`` (any hashable: the resident a request is computed on) lets the
        grant join a batch: a grouped waiter granted a free slot takes the waiting work of its
        group along, up to ``max_batch_size`` sequences; ``size`` is how many sequences this
        waiter decodes (1..``max_batch_size``). Without a group the grant is a batch of one.
        ``unit`` (a :class:`Unit`, a Batch API chunk): the waiter is counted once with the
        unit's other held batch waiters, and while the unit gathers it waits even for a free
        slot. ``fill_running`` (with a ``group``): the grant joins its group's running batch
        while that batch has room for ``size`` more sequences (the module docstring).

        Raises :class:`QueueFull` at once (nothing queued) when an interactive request would
        make more than ``max_queued`` interactive requests wait, and ``ValueError`` for a
        ``size`` outside 1..``max_batch_size``. Cancelled while waiting, it leaves no trace (a
        slot granted in that instant is handed on).
        """
        priority = Priority(priority)
        if (
            isinstance(size, bool)
            or not isinstance(size, int)
            or not (1 <= size <= self.max_batch_size)
        ):
            raise ValueError(f"size must be within 1..{self.max_batch_size}, got {size!r}")
        gathering = unit is not None and unit.gathering
        delayed = (
            group is not None
            and self.batch_delay_s > 0
            and self.max_batch_size > 1
            and size < self.max_batch_size
        )
        fill = fill_running and group is not None
        if not gathering and group is not None and self._can_join_now(group, priority, size, fill):
            if priority == Priority.INTERACTIVE and self._waiting_interactive() >= self._max_queued:
                raise QueueFull(self._max_queued)  # the engine's waiting requests count
            return self._join_open(self._open[group], priority, size)
        if not gathering and not delayed and self._can_grant_now(priority):
            return self._new_batch(priority, size, group, fill)
        start_gather = not gathering and delayed and self._can_grant_now(priority)
        if priority == Priority.INTERACTIVE and self._waiting_interactive() >= self._max_queued:
            raise QueueFull(self._max_queued)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(priority, next(self._seq), loop.create_future(), group, size, unit, fill)
        heapq.heappush(self._heap, waiter)
        if gathering:
            assert unit is not None
            unit._watch(self._unit_changed)
            self._unit_changed(unit)  # this arrival may be the last one awaited
        if start_gather:
            self._begin_gather(loop)
        elif self._gather_began is not None and group is not None:
            self._last_arrival = loop.time()
            if self._grouped_waiting(group) >= self.max_batch_size:
                self._end_gather("full")
        try:
            return await waiter.future
        except BaseException:
            if (
                waiter.future.done()
                and not waiter.future.cancelled()
                and waiter.future.exception() is None
            ):
                # Granted, then cancelled before we could use it: hand the slot on.
                self.release(waiter.future.result())
            else:
                self._remove(waiter)
            raise

    def _unit_changed(self, unit: Unit) -> None:
        """A member of a gathering ``unit`` arrived or left: end the gathering once every
        member waits or has left, and grant."""
        if unit._gathered or unit.members is None:
            return
        waiting = sum(1 for w in self._heap if w.unit is unit and not w.future.done())
        if waiting + unit._left >= unit.members:
            unit._gathered = True
            self._grant()

    # --- the batch delay ----------------------------------------------------------------------
    @property
    def gathering(self) -> bool:
        """A free slot is waiting for more grouped work (the batch delay)."""
        return self._gather_began is not None

    def _grouped_waiting(self, group: Hashable) -> int:
        return sum(w.size for w in self._heap if w.group == group and w.ready())

    def _begin_gather(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        self._gather_began = self._last_arrival = now
        self._gather_timer = loop.call_at(now + self.batch_delay_s, self._gather_tick)

    def _gather_tick(self) -> None:
        """The gathering's timer: grant after a quiet gap or at the cap, else wait on."""
        self._gather_timer = None
        if self._gather_began is None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        cap = self._gather_began + GATHER_CAP_FACTOR * self.batch_delay_s
        quiet = self._last_arrival + self.batch_delay_s
        if now >= cap - 1e-6:
            self._end_gather("cap")
        elif now >= quiet - 1e-6:
            self._end_gather("gap")
        else:
            self._gather_timer = loop.call_at(min(quiet, cap), self._gather_tick)

    def _end_gather(self, cause: str | None) -> None:
        """Stop gathering and grant (``cause`` None: abandoned, as by the barrier: no grant)."""
        if self._gather_began is None:
            return
        self._gather_began = None
        if self._gather_timer is not None:
            self._gather_timer.cancel()
            self._gather_timer = None
        if cause is not None:
            self.gathers[cause] += 1
            self._grant()

    def running_requests(self) -> int:
        """Requests inside the slots now: the members of the running batches that have
        not released their grant (a batch of eight requests is one running slot, eight running
        requests). What a drain waits for, counted as the drain timeout's message counts it."""
        return self._running_requests

    def _new_batch(
        self, priority: Priority, size: int, group: Hashable | None = None, fill: bool = False
    ) -> Grant:
        self._running += 1
        self._running_requests += 1
        batch = self._opened(SlotBatch(), group, fill)
        grant = self._track(Grant(batch, size, priority))
        batch._add(grant)
        return grant

    def _opened(self, batch: SlotBatch, group: Hashable | None, fill: bool = False) -> SlotBatch:
        if (self.join_running or fill) and group is not None:  # later waiters may join it
            batch.group, self._open[group] = group, batch
            batch.bounded = fill  # fill_running: only while it has room (also on ENGINE=continuous)
        return batch

    def _room(self, batch: SlotBatch) -> int:
        """Sequences a bounded running batch can still take (``fill_running``)."""
        return self.max_batch_size - sum(g.size for g in batch.grants if not g.released)

    def _can_join_now(
        self, group: Hashable, priority: Priority, size: int = 1, fill: bool = False
    ) -> bool:
        if not (self.join_running or fill) or group not in self._open or self._blocked():
            return False
        batch = self._open[group]
        if batch.bounded and size > self._room(batch):
            return False
        return not any(w.priority <= priority and w.ready() for w in self._heap)

    def _join_open(self, batch: SlotBatch, priority: Priority, size: int) -> Grant:
        self._running_requests += 1
        grant = self._track(Grant(batch, size, priority))
        batch._add(grant)
        return grant

    def _grant_into_open(self) -> None:
        """Grant the ready waiters of each running batch's group into it, best first."""
        if self._blocked():
            return
        joined: list[_Waiter] = []
        room: dict[Hashable, int] = {}  # a bounded batch's room left (fill_running)
        for w in sorted(self._heap):
            if not w.ready() or w.group not in self._open:
                continue
            batch = self._open[w.group]
            if batch.bounded:
                left = room.setdefault(w.group, self._room(batch))
                if w.size > left:  # first come first served: nobody of the group overtakes
                    room[w.group] = 0
                    continue
                room[w.group] = left - w.size
            joined.append(w)
        if not joined:
            return
        self._heap = [w for w in self._heap if w not in joined]
        heapq.heapify(self._heap)
        for waiter in joined:
            grant = self._join_open(self._open[waiter.group], waiter.priority, waiter.size)
            waiter.future.set_result(grant)

    def release(self, grant: Grant | None = None) -> None:
        """Give a grant back; the slot is free once every member of its batch released, and the
        next waiter is granted. ``grant`` None releases a batch of one (a waiter without a
        group). Raises ``RuntimeError`` if no slot is held or the grant was released already."""
        if grant is not None:
            if grant.released:
                raise RuntimeError("release() of a grant already released")
            grant.released = True
            self._unjoined.pop(id(grant), None)
            self._running_requests -= 1
            batch = grant.batch
            batch._holding.discard(id(grant))
            if batch._holding:
                if batch.bounded:  # room for a waiter of the group (fill_running)
                    self._grant_into_open()
                return  # other members still decode: the batch holds the slot
            if batch.group is not None and self._open.get(batch.group) is batch:
                del self._open[batch.group]
        if self._running <= 0:
            raise RuntimeError("release() without a held slot")
        if grant is None:
            self._running_requests -= 1
        self._running -= 1
        if self._running == 0 and self._drained is not None:
            self._drained.set()
        self._grant()

    @asynccontextmanager
    async def slot(self, priority: Priority = Priority.INTERACTIVE) -> AsyncIterator[None]:
        """Hold one slot for the body of the ``async with`` (see :meth:`acquire`)."""
        grant = await self.acquire(priority)
        try:
            yield
        finally:
            self.release(grant)

    def _blocked(self) -> bool:
        return self._barrier_held or self._barrier_draining

    def _can_grant_now(self, priority: Priority) -> bool:
        if self._blocked() or self._running >= self._max_concurrent or self.gathering:
            return False
        # Nobody of the same or a better priority is waiting (FIFO within a priority).
        return not any(w.priority <= priority and not w.future.done() for w in self._heap)

    def _remove(self, waiter: _Waiter) -> None:
        try:
            self._heap.remove(waiter)
        except ValueError:
            return
        heapq.heapify(self._heap)

    def _grant(self) -> None:
        if self.gathering:
            return  # the gathering's end grants
        kept: list[_Waiter] = []  # held back by a gathering unit: they stay queued
        while self._heap and not self._blocked() and self._running < self._max_concurrent:
            waiter = heapq.heappop(self._heap)
            if waiter.future.done():  # cancelled or failed: already gone
                continue
            if not waiter.ready():
                kept.append(waiter)
                continue
            self._running += 1
            batch = self._opened(SlotBatch(), waiter.group, waiter.fill)
            members = [waiter]
            if waiter.group is not None and self.max_batch_size > 1:
                room = self.max_batch_size - waiter.size
                for other in sorted(self._heap):  # priority order, first come first served
                    if room <= 0:
                        break
                    if not other.ready() or other.group != waiter.group or other.size > room:
                        continue
                    members.append(other)
                    room -= other.size
                if len(members) > 1:
                    taken = {id(m) for m in members}
                    self._heap = [w for w in self._heap if id(w) not in taken]
                    heapq.heapify(self._heap)
            grants = [self._track(Grant(batch, m.size, m.priority)) for m in members]
            self._running_requests += len(grants)
            for grant in grants:
                batch._add(grant)
            for member, grant in zip(members, grants, strict=True):
                member.future.set_result(grant)
        for waiter in kept:
            heapq.heappush(self._heap, waiter)
        self._grant_into_open()

    # --- the barrier --------------------------------------------------------------------------
    def barrier_begin(self) -> None:
        """Stop granting slots now, synchronously: from this call on new interactive and batch
        waiters are held (quiesce's first half; weights page, "The write cycle" 2).

        Raises ``RuntimeError`` when the barrier is already held or draining. Follow with
        :meth:`barrier_wait_drained`, or undo with :meth:`barrier_abandon`.
        """
        if self._barrier_held or self._barrier_draining:
            raise RuntimeError("the barrier is already held or draining")
        self._end_gather(None)  # its waiters are held like any other; resume grants them
        self._barrier_draining = True
        self._drained = asyncio.Event()
        if self._running == 0:
            self._drained.set()

    async def barrier_wait_drained(self) -> HeldCounts:
        """Wait until no slot is running, then hold every slot (quiesce's second half).

        Returns the counts at the moment the barrier holds (``running`` is 0). Cancelled, it
        abandons the drain: the barrier holds nothing and held waiters are granted again.
        """
        if not self._barrier_draining or self._drained is None:
            raise RuntimeError("barrier_begin() was not called")
        try:
            await self._drained.wait()
        except BaseException:
            self._abandon_drain()
            raise
        self._barrier_draining = False
        self._barrier_held = True
        self._drained = None
        return self.counts()

    def barrier_hold_if_drained(self, parked: bool = False) -> bool:
        """Finish a drain at once when nothing runs or, with ``parked``, when what runs is
        parked by a hold (contract 4b: it keeps its shares and computes nothing until
        resumed): the barrier then holds every slot. Returns whether it did."""
        if self._barrier_draining and (parked or self._running == 0):
            self._barrier_draining = False
            self._barrier_held = True
            self._drained = None
            return True
        return False

    def barrier_abandon(self) -> None:
        """Give up a drain in progress (a drain timeout); a no-op when not draining."""
        if self._barrier_draining:
            self._abandon_drain()

    async def barrier_acquire(self, timeout_s: float) -> HeldCounts:
        """Take every slot ahead of the queue once the running requests finish (quiesce).

        :meth:`barrier_begin` then :meth:`barrier_wait_drained` with a timeout. Raises
        :class:`DrainTimeout` when requests still run after ``timeout_s`` seconds, and
        ``RuntimeError`` when the barrier is already held or draining; in both cases, and when
        cancelled, the barrier holds nothing and held waiters are granted again.
        Weights page, "The write cycle" 2.
        """
        self.barrier_begin()
        try:
            return await asyncio.wait_for(self.barrier_wait_drained(), timeout_s)
        except TimeoutError:
            running = self._running_requests
            self._abandon_drain()
            raise DrainTimeout(timeout_s, running) from None

    def _abandon_drain(self) -> None:
        self._barrier_draining = False
        self._drained = None
        self._grant()

    def barrier_release(self) -> None:
        """Release the barrier: held waiters run in their original order (resume).

        Releasing a barrier that is not held is a no-op.
        """
        if not self._barrier_held:
            return
        self._barrier_held = False
        self._grant()

    def fail_held(
        self,
        exc: BaseException,
        priorities: Iterable[Priority] = (Priority.INTERACTIVE, Priority.BATCH),
    ) -> int:
        """Refuse every waiter of ``priorities`` with ``exc`` (a torn set); returns how many.

        The barrier stays held. Pass ``(Priority.INTERACTIVE,)`` to keep batch chunks waiting
        (weights page, "States": batch rows do not fail on torn).
        """
        wanted = {Priority(p) for p in priorities}
        failed = 0
        keep: list[_Waiter] = []
        for waiter in self._heap:
            if waiter.future.done():
                continue
            if waiter.priority in wanted:
                waiter.future.set_exception(exc)
                failed += 1
            else:
                keep.append(waiter)
        heapq.heapify(keep)
        self._heap = keep
        return failed

    # --- cross-request caches -----------------------------------------------------------------
    def register_cache_dropper(self, dropper: Callable[[], None]) -> None:
        """Register a function that empties a cross-request cache computed from the weights.

        :meth:`drop_caches` calls it inside the barrier (weights page, "The write cycle" 2).
        """
        self._cache_droppers.append(dropper)

    def drop_caches(self) -> int:
        """Call every registered cache dropper; returns how many ran.

        An exception in one is logged and the others still run.
        """
        ran = 0
        for dropper in list(self._cache_droppers):
            try:
                dropper()
                ran += 1
            except Exception:  # noqa: BLE001 - one bad hook must not keep stale caches alive
                log.exception("cache dropper %r failed", dropper)
        return ran
