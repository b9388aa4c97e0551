"""Filling the running batch (``fill_running``; contract 4a): a GGUF resident's requests go into
its running work as they arrive, while that work has room (``MAX_BATCH_SIZE`` sequences), since
llama.cpp's parallel slots batch whatever they hold at each of its steps. The barrier, the queue
and the held counts stay the scheduler's. No model is needed."""

from __future__ import annotations

import asyncio

import pytest

from miserver.serving.engine.slot import Priority, QueueFull, Scheduler
from tests.waiting import eventually

I = Priority.INTERACTIVE  # noqa: E741


def _fill(scheduler: Scheduler, size: int = 1, priority: Priority = I) -> asyncio.Future:
    return asyncio.ensure_future(
        scheduler.acquire(priority, group="gguf", size=size, fill_running=True)
    )


async def test_a_request_joins_the_running_work_at_once_while_it_has_room() -> None:
    scheduler = Scheduler(max_batch_size=3)
    first = await scheduler.acquire(I, group="gguf", fill_running=True)
    second = await scheduler.acquire(I, group="gguf", size=2, fill_running=True)
    assert second.batch is first.batch  # not held back until the first one ends
    assert scheduler.counts().running == 1 and scheduler.running_requests() == 2
    third = _fill(scheduler)  # no room: 3 sequences decode already
    await eventually(lambda: scheduler.counts().queued == 1, "the third waits")
    assert not third.done()
    scheduler.release(second)  # two sequences free: the waiter goes in, the first still runs
    await asyncio.sleep(0)
    assert third.done() and third.result().batch is first.batch
    assert scheduler.counts().queued == 0
    scheduler.release(first)
    scheduler.release(third.result())
    assert scheduler.counts().running == 0 and scheduler.running_requests() == 0


async def test_without_fill_or_join_running_a_batch_keeps_later_requests_waiting() -> None:
    scheduler = Scheduler(max_batch_size=3)
    first = await scheduler.acquire(I, group="g")
    later = asyncio.ensure_future(scheduler.acquire(I, group="g"))
    await eventually(lambda: scheduler.counts().queued == 1, "the later one waits")
    scheduler.release(first)
    await asyncio.sleep(0)
    assert later.done() and later.result().batch is not first.batch
    scheduler.release(later.result())


async def test_waiters_go_in_first_come_first_served_none_overtaking_one_that_does_not_fit() -> (
    None
):
    scheduler = Scheduler(max_batch_size=4)
    a = await scheduler.acquire(I, group="gguf", size=2, fill_running=True)
    b = await scheduler.acquire(I, group="gguf", size=2, fill_running=True)
    big = _fill(scheduler, size=3)
    await eventually(lambda: scheduler.counts().queued == 1, "big waits")
    small = _fill(scheduler)  # would fit the room left by a, but big came first
    await eventually(lambda: scheduler.counts().queued == 2, "small waits")
    scheduler.release(a)  # room 2: not enough for big, and small may not overtake it
    await asyncio.sleep(0)
    assert not big.done() and not small.done()
    scheduler.release(b)  # the batch ended: big and small are granted as a new batch
    await asyncio.sleep(0)
    assert big.done() and small.done()
    assert big.result().batch is small.result().batch
    scheduler.release(big.result())
    scheduler.release(small.result())


async def test_the_barrier_holds_new_requests_and_its_drain_waits_for_the_joined_ones() -> None:
    scheduler = Scheduler(max_batch_size=4)
    first = await scheduler.acquire(I, group="gguf", fill_running=True)
    joined = await scheduler.acquire(I, group="gguf", fill_running=True)
    drain = asyncio.ensure_future(scheduler.barrier_acquire(5.0))
    await eventually(lambda: scheduler.barrier_draining, "draining")
    held = _fill(scheduler)  # room left, but the barrier drains: held, not joined
    await eventually(lambda: scheduler.counts().held_interactive == 1, "held")
    scheduler.release(first)
    await asyncio.sleep(0)
    assert not drain.done() and not held.done()  # the joined request still decodes
    scheduler.release(joined)
    counts = await asyncio.wait_for(drain, 5)
    assert counts.held_interactive == 1 and not held.done()
    scheduler.barrier_release()
    await asyncio.sleep(0)
    assert held.done()
    scheduler.release(held.result())


async def test_a_full_batch_leaves_requests_queued_and_the_queue_bounded() -> None:
    scheduler = Scheduler(max_batch_size=1, max_queued=1)
    first = await scheduler.acquire(I, group="gguf", fill_running=True)
    waiting = _fill(scheduler)
    await eventually(lambda: scheduler.counts().queued == 1, "one queued")
    with pytest.raises(QueueFull):
        await scheduler.acquire(I, group="gguf", fill_running=True)
    scheduler.release(first)
    await asyncio.sleep(0)
    scheduler.release(waiting.result())


async def test_a_gguf_resident_is_bounded_also_when_the_engine_joins_running_batches() -> None:
    # the server sets join_running for every group; a GGUF resident has no engine of
    # ours to queue its requests, so its running work still takes only MAX_BATCH_SIZE
    scheduler = Scheduler(max_batch_size=2, join_running=True, max_concurrent=2)
    engine = await scheduler.acquire(I, group="engine")
    joined = await scheduler.acquire(I, group="engine", size=2)  # the engine's stay unbounded
    assert joined.batch is engine.batch
    first = await scheduler.acquire(I, group="gguf", size=2, fill_running=True)
    later = _fill(scheduler)
    await eventually(lambda: scheduler.counts().queued == 1, "no room: it waits")
    scheduler.release(first)
    await asyncio.sleep(0)
    assert later.done()
    for grant in (later.result(), engine, joined):
        scheduler.release(grant)
