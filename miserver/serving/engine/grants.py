"""What the execution slots hand out and keep (:mod:`~miserver.serving.engine.slot`): the
priorities, a grant and the batch it belongs to, a Batch API chunk's unit, a waiter, the held
counts, and the two refusals (a full queue, a drain past its timeout).

Everything here runs on the event loop's thread; nothing blocks and nothing imports torch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from enum import IntEnum

log = logging.getLogger("miserver.scheduler")


class Priority(IntEnum):
    """Who gets the next free slot: lower values first (design notes, "Serving")."""

    BARRIER = 0
    INTERACTIVE = 1
    BATCH = 2


class QueueFull(Exception):
    """More interactive requests would wait than ``max_queued`` allows (503 QUEUE_FULL)."""

    def __init__(self, max_queued: int) -> None:
        super().__init__(
            f"The request queue is full: MAX_QUEUED_REQUESTS ({max_queued}) interactive requests"
            " are already waiting; retry after Retry-After seconds."
        )
        self.max_queued = max_queued


class DrainTimeout(Exception):
    """The running requests did not finish within the drain timeout (409 MODEL_BUSY,
    reason drain_timeout). The barrier holds nothing when this is raised."""

    def __init__(self, timeout_s: float, running: int) -> None:
        super().__init__(f"{running} running request(s) did not finish within {timeout_s:g} s")
        self.timeout_s = timeout_s
        self.running = running


@dataclass(frozen=True)
class HeldCounts:
    """A snapshot of the scheduler.

    Attributes:
        held_interactive: interactive requests waiting because the barrier is held or draining.
        held_batch: batch chunks waiting because the barrier is held or draining: the distinct
            :class:`Unit` of the held batch waiters, a batch waiter without a unit counting
            alone.
        running: slots held by requests (the barrier's own hold is not counted).
        queued: requests waiting for a slot while the barrier is neither held nor draining.
    """

    held_interactive: int
    held_batch: int
    running: int
    queued: int


class Unit:
    """Waiters that belong together (a Batch API chunk): :meth:`Scheduler.acquire`'s ``unit``.

    ``HeldCounts.held_batch`` counts the held batch waiters of one unit once. With ``members``
    (how many waiters the unit will have, >= 1) the unit *gathers*: the scheduler grants none
    of its waiters until each member is waiting in the queue or has left the unit
    (:meth:`leave`); then they are granted as waiters are (the best first, its group joining
    it up to ``max_batch_size`` sequences), so they share one :class:`SlotBatch`. A member that
    is refused before it reaches the queue must leave, or the others wait for it. ``members``
    None: a tag only, nothing gathers. ``name`` is for logs. Hashed by identity.

    Raises ``ValueError`` for ``members`` below 1.
    """

    __slots__ = ("members", "name", "_left", "_gathered", "_listeners")

    def __init__(self, members: int | None = None, name: str = "") -> None:
        if members is not None and (
            isinstance(members, bool) or not isinstance(members, int) or members < 1
        ):
            raise ValueError(f"members must be an integer of at least 1, got {members!r}")
        self.members = members
        self.name = name
        self._left = 0
        self._gathered = members is None
        self._listeners: list[Callable[[Unit], None]] = []

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, members={self.members}, left={self._left})"

    @property
    def gathering(self) -> bool:
        """Its waiters are still kept from a grant (some member neither waits nor left)."""
        return not self._gathered

    def leave(self) -> None:
        """One member will not wait (any more): it ended, was refused before it reached the
        queue, or stopped waiting. Call it once per member; it may end the gathering."""
        self._left += 1
        if self._gathered:
            return
        for listener in list(self._listeners):
            listener(self)

    def _watch(self, listener: Callable[[Unit], None]) -> None:
        if listener not in self._listeners:
            self._listeners.append(listener)


class SlotBatch:
    """The work one grant of a slot runs together: one holder of the slot (the resident's
    running batch).

    Attributes:
        grants: every member's :class:`Grant`, in the order they were taken (the leader first).
        sequences: the sequences the members decode together (the sum of their sizes).
    """

    def __init__(self) -> None:
        self.grants: list[Grant] = []
        self.sequences = 0
        self.group: Hashable | None = None  # set when waiters may join it (join_running)
        self.bounded = False  # joined only while it has room (fill_running)
        self._holding: set[int] = set()  # members that have not released their grant

    def _add(self, grant: Grant) -> None:
        self.grants.append(grant)
        self.sequences += grant.size
        self._holding.add(id(grant))


class Grant:
    """One waiter's share of a granted slot (:meth:`Scheduler.acquire`).

    Attributes:
        batch: the :class:`SlotBatch` it belongs to.
        size: the sequences it decodes (>= 1).
        priority: the priority it waited at.
    """

    __slots__ = ("batch", "size", "priority", "released", "joined")

    def __init__(self, batch: SlotBatch, size: int, priority: Priority) -> None:
        self.batch = batch
        self.size = size
        self.priority = priority
        self.released = False
        #: The member has handed its sequences to the batch (:meth:`join`).
        self.joined = False

    def join(self) -> None:
        """This member has handed its sequences to the engine (idempotent): from now on the
        engine counts it, not the scheduler (:meth:`Scheduler.counts`)."""
        self.joined = True


class _Waiter:
    __slots__ = ("priority", "seq", "future", "group", "size", "unit", "fill")

    def __init__(
        self,
        priority: Priority,
        seq: int,
        future: asyncio.Future[Grant],
        group: Hashable | None = None,
        size: int = 1,
        unit: Unit | None = None,
        fill: bool = False,
    ) -> None:
        self.priority = priority
        self.seq = seq
        self.future = future
        self.group = group
        self.size = size
        self.unit = unit
        self.fill = fill

    def ready(self) -> bool:
        """Still waiting, and not kept back by a gathering unit."""
        return not self.future.done() and (self.unit is None or not self.unit.gathering)

    def __lt__(self, other: _Waiter) -> bool:
        return (self.priority, self.seq) < (other.priority, other.seq)
