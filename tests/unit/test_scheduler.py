"""The scheduler: slots, priorities, the bounded queue, cancellation and the barrier."""

from __future__ import annotations

import asyncio

import pytest

from miserver.serving.engine.slot import (
    DrainTimeout,
    HeldCounts,
    Priority,
    QueueFull,
    Scheduler,
    Unit,
)


async def _spin(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _holder(
    s: Scheduler, prio: Priority, log: list[str], name: str, gate: asyncio.Event | None = None
) -> None:
    async with s.slot(prio):
        log.append(name)
        if gate is not None:
            await gate.wait()


async def test_one_slot_serialises_and_fifo_within_priority() -> None:
    s = Scheduler(1, 10)
    gate = asyncio.Event()
    log: list[str] = []
    first = asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, "a", gate))
    await _spin()
    others = [asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, n)) for n in "bcd"]
    await _spin()
    assert log == ["a"]
    assert s.counts() == HeldCounts(0, 0, 1, 3)
    gate.set()
    await asyncio.gather(first, *others)
    assert log == ["a", "b", "c", "d"]
    assert s.counts() == HeldCounts(0, 0, 0, 0)


async def test_priority_order_barrier_then_interactive_then_batch() -> None:
    s = Scheduler(1, 10)
    gate = asyncio.Event()
    log: list[str] = []
    first = asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, "running", gate))
    await _spin()
    tasks = []
    for name, prio in (
        ("batch1", Priority.BATCH),
        ("int1", Priority.INTERACTIVE),
        ("bar", Priority.BARRIER),
        ("batch2", Priority.BATCH),
        ("int2", Priority.INTERACTIVE),
    ):
        tasks.append(asyncio.create_task(_holder(s, prio, log, name)))
        await _spin(1)
    await _spin()
    gate.set()
    await asyncio.gather(first, *tasks)
    assert log == ["running", "bar", "int1", "int2", "batch1", "batch2"]


async def test_queue_full_counts_waiting_interactive_only() -> None:
    s = Scheduler(1, 2)
    gate = asyncio.Event()
    log: list[str] = []
    running = asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, "r", gate))
    await _spin()
    waiting = [asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, n)) for n in "xy"]
    await _spin()
    with pytest.raises(QueueFull) as info:
        await s.acquire(Priority.INTERACTIVE)
    assert info.value.max_queued == 2
    # Refused: nothing was queued by the refusal.
    assert s.counts() == HeldCounts(0, 0, 1, 2)
    # Batch chunks are not bounded by MAX_QUEUED_REQUESTS.
    batch = asyncio.create_task(_holder(s, Priority.BATCH, log, "b"))
    await _spin()
    assert s.counts().queued == 3
    gate.set()
    await asyncio.gather(running, *waiting, batch)
    assert log == ["r", "x", "y", "b"]


async def test_cancel_while_waiting_leaves_no_trace() -> None:
    s = Scheduler(1, 1)
    gate = asyncio.Event()
    log: list[str] = []
    running = asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, "r", gate))
    await _spin()
    doomed = asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, "doomed"))
    await _spin()
    assert s.counts().queued == 1
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert s.counts() == HeldCounts(0, 0, 1, 0)
    # The queue has room again (max_queued 1).
    later = asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, "later"))
    await _spin()
    gate.set()
    await asyncio.gather(running, later)
    assert log == ["r", "later"]
    assert s.counts() == HeldCounts(0, 0, 0, 0)


async def test_cancel_after_grant_hands_the_slot_on() -> None:
    s = Scheduler(1, 5)
    await s.acquire(Priority.INTERACTIVE)
    log: list[str] = []
    granted_then_cancelled = asyncio.create_task(s.acquire(Priority.INTERACTIVE))
    nxt = asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, "next"))
    await _spin()
    s.release()  # grants the first waiter's future ...
    granted_then_cancelled.cancel()  # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await granted_then_cancelled
    await asyncio.wait_for(nxt, 1)
    assert log == ["next"]
    assert s.counts() == HeldCounts(0, 0, 0, 0)


async def test_exception_in_body_frees_the_slot() -> None:
    s = Scheduler(1, 5)
    with pytest.raises(ZeroDivisionError):
        async with s.slot(Priority.INTERACTIVE):
            raise ZeroDivisionError
    assert s.counts().running == 0
    async with s.slot(Priority.INTERACTIVE):
        assert s.counts().running == 1


async def test_max_concurrent_runs_that_many_at_once() -> None:
    s = Scheduler(3, 5)
    gate = asyncio.Event()
    log: list[str] = []
    tasks = [asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, n, gate)) for n in "abcd"]
    await _spin()
    assert log == ["a", "b", "c"]
    assert s.counts() == HeldCounts(0, 0, 3, 1)
    gate.set()
    await asyncio.gather(*tasks)


async def test_set_limits_at_run_time() -> None:
    s = Scheduler(1, 5)
    gate = asyncio.Event()
    log: list[str] = []
    tasks = [asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, n, gate)) for n in "abc"]
    await _spin()
    assert log == ["a"]
    s.set_limits(max_concurrent=3)
    await _spin()
    assert log == ["a", "b", "c"]
    s.set_limits(max_queued=1)
    assert s.max_queued == 1 and s.max_concurrent == 3
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            s.set_limits(max_concurrent=bad)  # type: ignore[arg-type]
    gate.set()
    await asyncio.gather(*tasks)


async def test_barrier_drains_holds_and_releases_in_order() -> None:
    s = Scheduler(1, 10)
    gate = asyncio.Event()
    log: list[str] = []
    running = asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, "r", gate))
    await _spin()
    barrier = asyncio.create_task(s.barrier_acquire(5))
    await _spin()
    assert s.barrier_draining and not barrier.done()
    held = [
        asyncio.create_task(_holder(s, p, log, n))
        for n, p in (
            ("b1", Priority.BATCH),
            ("i1", Priority.INTERACTIVE),
            ("i2", Priority.INTERACTIVE),
        )
    ]
    await _spin()
    assert s.counts() == HeldCounts(2, 1, 1, 0)
    gate.set()
    counts = await asyncio.wait_for(barrier, 1)
    assert counts == HeldCounts(2, 1, 0, 0)
    assert s.barrier_held
    await _spin()
    assert log == ["r"], "nothing runs while the barrier holds"
    s.barrier_release()
    await asyncio.gather(running, *held)
    assert log == ["r", "i1", "i2", "b1"]
    s.barrier_release()  # a second release is a no-op
    assert s.counts() == HeldCounts(0, 0, 0, 0)


async def test_barrier_on_idle_scheduler_is_immediate_and_exclusive() -> None:
    s = Scheduler(2, 10)
    counts = await asyncio.wait_for(s.barrier_acquire(1), 1)
    assert counts == HeldCounts(0, 0, 0, 0)
    with pytest.raises(RuntimeError):
        await s.barrier_acquire(1)
    s.barrier_release()
    async with s.slot(Priority.INTERACTIVE):
        pass


async def test_drain_timeout_holds_nothing() -> None:
    s = Scheduler(1, 10)
    gate = asyncio.Event()
    log: list[str] = []
    running = asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, "r", gate))
    await _spin()
    waiter = asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, "w"))
    with pytest.raises(DrainTimeout) as info:
        await s.barrier_acquire(0.05)
    assert info.value.running == 1
    assert not s.barrier_held and not s.barrier_draining
    gate.set()
    await asyncio.gather(running, waiter)
    assert log == ["r", "w"]


async def test_cancelled_barrier_acquire_holds_nothing() -> None:
    s = Scheduler(1, 10)
    gate = asyncio.Event()
    log: list[str] = []
    running = asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, "r", gate))
    await _spin()
    barrier = asyncio.create_task(s.barrier_acquire(10))
    await _spin()
    barrier.cancel()
    with pytest.raises(asyncio.CancelledError):
        await barrier
    assert not s.barrier_draining
    gate.set()
    await running
    async with s.slot(Priority.INTERACTIVE):
        pass


async def test_fail_held_refuses_waiters_and_keeps_the_barrier() -> None:
    s = Scheduler(1, 10)
    await s.barrier_acquire(1)
    log: list[str] = []
    inter = asyncio.create_task(_holder(s, Priority.INTERACTIVE, log, "i"))
    batch = asyncio.create_task(_holder(s, Priority.BATCH, log, "b"))
    await _spin()
    assert s.fail_held(RuntimeError("torn"), priorities=(Priority.INTERACTIVE,)) == 1
    with pytest.raises(RuntimeError, match="torn"):
        await inter
    assert s.barrier_held
    assert s.counts() == HeldCounts(0, 1, 0, 0)
    s.barrier_release()
    await batch
    assert log == ["b"]
    assert s.counts() == HeldCounts(0, 0, 0, 0)


async def test_fail_held_default_refuses_every_held_waiter() -> None:
    s = Scheduler(1, 10)
    await s.barrier_acquire(1)
    tasks = [asyncio.create_task(s.acquire(p)) for p in (Priority.INTERACTIVE, Priority.BATCH)]
    await _spin()
    assert s.fail_held(ValueError("x")) == 2
    for t in tasks:
        with pytest.raises(ValueError):
            await t
    s.barrier_release()
    assert s.counts() == HeldCounts(0, 0, 0, 0)


async def test_drop_caches_runs_every_hook_even_after_a_failure() -> None:
    s = Scheduler()
    calls: list[str] = []

    def bad() -> None:
        raise RuntimeError("boom")

    s.register_cache_dropper(bad)
    s.register_cache_dropper(lambda: calls.append("ok"))
    assert s.drop_caches() == 1
    assert calls == ["ok"]


def test_release_without_slot_is_an_error() -> None:
    with pytest.raises(RuntimeError):
        Scheduler().release()


async def test_held_batch_counts_a_unit_once_and_a_waiter_without_one_alone() -> None:
    s = Scheduler(1, 10, max_batch_size=8)
    await s.barrier_acquire(1.0)
    chunk, other = Unit(), Unit()
    tasks = [
        asyncio.create_task(s.acquire(Priority.BATCH, group="g", unit=unit))
        for unit in (chunk, chunk, chunk, other, None, None)
    ]
    tasks.append(asyncio.create_task(s.acquire(Priority.INTERACTIVE, group="g")))
    await _spin()
    assert s.counts() == HeldCounts(1, 4, 0, 0)  # chunk, other and the two alone; six rows
    s.barrier_release()
    await _spin()
    assert s.counts() == HeldCounts(0, 0, 1, 0)  # one batch took all seven
    grants = [t.result() for t in tasks]
    assert len({id(g.batch) for g in grants}) == 1 and grants[0].batch.sequences == 7
    for grant in grants:
        s.release(grant)
    assert s.counts() == HeldCounts(0, 0, 0, 0)


async def test_a_gathering_unit_is_granted_together_once_every_member_waits_or_left() -> None:
    """Members reach the queue at different moments; none is granted on the free slot until
    each member is waiting or has left, then they share one grant."""
    s = Scheduler(1, 10, max_batch_size=8)
    chunk = Unit(members=4, name="chunk")
    first = asyncio.create_task(s.acquire(Priority.BATCH, group="g", unit=chunk))
    await _spin()
    assert not first.done() and chunk.gathering  # the slot is free, but the chunk gathers
    assert s.counts() == HeldCounts(0, 0, 0, 1)
    now = asyncio.create_task(s.acquire(Priority.INTERACTIVE, group="g"))
    await _spin()
    assert now.done() and now.result().batch.sequences == 1  # interactive work is not held
    s.release(now.result())
    second = asyncio.create_task(s.acquire(Priority.BATCH, group="g", unit=chunk))
    await _spin()
    assert not first.done() and not second.done()
    chunk.leave()  # a member refused before it reached the queue
    await _spin()
    assert not first.done()
    third = asyncio.create_task(s.acquire(Priority.BATCH, group="g", unit=chunk))
    await _spin()  # the last member awaited arrived: one grant for the three waiting
    assert not chunk.gathering
    grants = [t.result() for t in (first, second, third)]
    assert all(g.batch is grants[0].batch for g in grants) and grants[0].batch.sequences == 3
    assert s.counts() == HeldCounts(0, 0, 1, 0)
    late = asyncio.create_task(s.acquire(Priority.BATCH, group="g", unit=chunk))
    await _spin()
    assert not late.done()  # the unit gathered: a later waiter waits for the slot as any
    for grant in grants:
        s.release(grant)
    await _spin()
    assert late.done()
    s.release(late.result())


async def test_a_member_cancelled_while_its_unit_gathers_leaves_no_trace() -> None:
    s = Scheduler(1, 10, max_batch_size=8)
    chunk = Unit(members=2)
    a = asyncio.create_task(s.acquire(Priority.BATCH, group="g", unit=chunk))
    await _spin()
    a.cancel()
    with pytest.raises(asyncio.CancelledError):
        await a
    assert s.counts() == HeldCounts(0, 0, 0, 0)
    chunk.leave()  # its caller leaves the unit (the batch runner does, as the row ends)
    assert chunk.gathering  # the other member neither waits nor left yet
    b = asyncio.create_task(s.acquire(Priority.BATCH, group="g", unit=chunk))
    await _spin()
    assert not chunk.gathering and b.done() and b.result().batch.sequences == 1
    s.release(b.result())
    assert s.counts() == HeldCounts(0, 0, 0, 0)


@pytest.mark.parametrize("members", [0, -1, True, 1.5])
def test_a_unit_needs_at_least_one_member(members: object) -> None:
    with pytest.raises(ValueError, match="members"):
        Unit(members=members)  # type: ignore[arg-type]


async def test_a_grant_into_the_running_batch_is_told_to_the_engine_until_it_joins() -> None:
    """On the continuous engine (``join_running``) a request granted into the running batch is
    not queued by the scheduler; until it hands its sequences over (``Grant.join``) the
    engine's count is told of it, so a burst granted before any request was submitted is
    still bounded by ``max_queued``."""
    s = Scheduler(1, 2, max_batch_size=8, join_running=True)
    told: list[list[tuple[int, int]]] = []

    def engine_waiting(pending: list[tuple[int, int]]) -> int:
        told.append(list(pending))
        return max(0, len(pending) - 1)  # an engine with one free place

    s.batch_waiting = engine_waiting
    first = await s.acquire(Priority.INTERACTIVE, group="r")
    assert s.counts().queued == 0 and told[-1] == [(int(Priority.INTERACTIVE), 1)]
    second = await s.acquire(Priority.INTERACTIVE, group="r", size=2)
    assert s.counts().queued == 1
    third = await s.acquire(Priority.INTERACTIVE, group="r")
    assert s.counts().queued == 2
    with pytest.raises(QueueFull):
        await s.acquire(Priority.INTERACTIVE, group="r")
    assert s.counts() == HeldCounts(0, 0, 1, 2)  # refused: nothing granted or queued
    first.join()
    s.counts()
    assert told[-1] == [(int(Priority.INTERACTIVE), 2), (int(Priority.INTERACTIVE), 1)]
    s.release(second)
    s.counts()
    assert told[-1] == [(int(Priority.INTERACTIVE), 1)]
    third.join()
    assert s.counts().queued == 0 and told[-1] == []
    for grant in (first, third):
        s.release(grant)
    assert s.counts() == HeldCounts(0, 0, 0, 0)


def test_the_engine_counts_as_waiting_only_what_its_running_batch_has_no_place_for() -> None:
    """``EngineLoop.waiting``: a request not begun is admitted, as the engine admits it, when
    the requests ahead of it in admission order (priority, then arrival) leave a place for its
    first choice, and takes the places left for its ``n`` choices; the ones past the places
    wait. Choices of a request begun (running, preempted or parked) hold their places."""
    import threading
    from types import SimpleNamespace

    from miserver.serving.engine.engine_loop import EngineLoop, _Request
    from miserver.serving.engine.sequence import SequenceStatus

    ids = iter(range(1, 100))
    loop = EngineLoop.__new__(EngineLoop)  # its bookkeeping only: no engine thread
    loop._cv = threading.Condition()
    loop._live = {}

    def places(n: int) -> None:
        config = SimpleNamespace(max_num_seqs=n)
        loop.engine = SimpleNamespace(scheduler=SimpleNamespace(config=config))

    def submit(priority: Priority, n: int = 1, *statuses: SequenceStatus) -> _Request:
        r = _Request(int(priority), open_ids={next(ids) for _ in range(n)})
        r.sequences = [SimpleNamespace(status=st) for st in statuses]
        loop._live[id(r)] = r
        return r

    inter, batch = Priority.INTERACTIVE, Priority.BATCH
    places(1)
    first = submit(inter)  # not handed to the engine thread yet
    assert loop.waiting() == 0  # the engine has a place for it: being served, not queued
    submit(inter)
    submit(inter, 1, SequenceStatus.WAITING)
    assert loop.waiting() == 2
    assert loop.waiting(pending=[(int(inter), 1)]) == 3  # granted, not submitted yet
    first.sequences = [SimpleNamespace(status=SequenceStatus.RUNNING)]  # admitted
    assert loop.waiting() == 2
    loop._live.clear()

    places(5)
    submit(inter, 2, SequenceStatus.RUNNING, SequenceStatus.WAITING)  # holds 2 places
    parked = submit(batch, 1, SequenceStatus.PREEMPTED)  # parked by a hold: holds 1
    parked.begun = True
    submit(batch)  # an earlier batch request: interactive requests go ahead of it
    submit(inter, 3)  # admitted (a place for its first choice), takes the 2 left
    submit(inter)  # no place left: waits
    submit(inter, 2)  # waits
    assert loop.waiting() == 2
    assert loop.waiting(batch) == 1
    assert loop.waiting(pending=[(int(batch), 1), (int(inter), 1)]) == 3
    places(8)  # 3 held; the interactive requests' first choices fit, and take the 5 left
    assert loop.waiting() == 0 and loop.waiting(batch) == 1
    places(10)
    assert loop.waiting() == 0 and loop.waiting(batch) == 0
