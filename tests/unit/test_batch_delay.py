"""The batch delay (``MAX_BATCH_DELAY_MS``, contract 1 and 4): a free slot gathers grouped work
for a quiet gap before it is granted, so requests that arrive together join the engine together.

Timer margins are wide (gaps of 0.5 s against arrivals 10-20 ms apart) so a loaded CI
machine does not change the outcome; what each test checks is which requests share a batch and
why the gathering ended, not how fast."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from miserver.serving.engine import slot as scheduler_module
from miserver.serving.engine.slot import Priority, Scheduler
from miserver.spec.settings import (
    ConfigError,
    Settings,
    load_settings,
    resolved_batch_delay_s,
)
from tests.unit.v1_fixtures import spy_batch_starts
from tests.waiting import eventually


def _acquire(s: Scheduler, group: object = "g", size: int = 1) -> asyncio.Future[Any]:
    return asyncio.ensure_future(s.acquire(Priority.INTERACTIVE, group=group, size=size))


async def test_requests_arriving_within_the_gap_share_one_batch() -> None:
    s = Scheduler(max_batch_size=8, batch_delay_s=0.5)
    first = _acquire(s)
    await asyncio.sleep(0.01)
    assert not first.done() and s.gathering  # the free slot waits for more
    later = []
    for _ in range(3):
        later.append(_acquire(s))
        await asyncio.sleep(0.01)
    grants = await asyncio.wait_for(asyncio.gather(first, *later), 5)
    batch = grants[0].batch
    assert all(g.batch is batch for g in grants) and batch.sequences == 4
    assert s.gathers == {"full": 0, "gap": 1, "cap": 0} and not s.gathering
    for g in grants:
        s.release(g)
    assert s.counts().running == 0


async def test_a_full_batch_is_granted_at_once_without_waiting_for_the_gap() -> None:
    s = Scheduler(max_batch_size=4, batch_delay_s=5.0)
    t0 = time.monotonic()
    tasks = [_acquire(s, size=size) for size in (1, 2, 1)]
    grants = await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert time.monotonic() - t0 < 2.5  # far below the 5 s gap
    assert {id(g.batch) for g in grants} == {id(grants[0].batch)}
    assert grants[0].batch.sequences == 4 and s.gathers["full"] == 1


async def test_a_request_of_the_whole_batch_and_an_ungrouped_one_take_the_slot_at_once() -> None:
    s = Scheduler(max_batch_size=4, batch_delay_s=5.0)
    whole = await asyncio.wait_for(s.acquire(Priority.INTERACTIVE, group="g", size=4), 1)
    s.release(whole)
    plain = await asyncio.wait_for(s.acquire(Priority.INTERACTIVE), 1)  # no group: no batch
    s.release(plain)
    assert s.gathers == {"full": 0, "gap": 0, "cap": 0}


async def test_arrivals_that_never_pause_are_granted_at_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scheduler_module, "GATHER_CAP_FACTOR", 3)
    s = Scheduler(max_batch_size=256, batch_delay_s=0.5)
    t0 = time.monotonic()
    tasks = [_acquire(s)]
    while not tasks[0].done() and time.monotonic() - t0 < 5:
        tasks.append(_acquire(s))
        await asyncio.sleep(0.02)  # always well inside the 0.5 s gap
    first = tasks[0].result()
    assert s.gathers["cap"] == 1 and s.gathers["gap"] == 0
    assert time.monotonic() - t0 >= 1.45  # about 3 x 0.5 s after the first arrival
    assert first.batch.sequences > 1
    for t in tasks:
        if not t.done():
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_slot_freed_with_work_waiting_is_granted_at_once() -> None:
    s = Scheduler(max_batch_size=2, batch_delay_s=5.0)
    a, b = _acquire(s), _acquire(s)  # fills the batch: granted without the gap
    first = await asyncio.wait_for(asyncio.gather(a, b), 2)
    queued = _acquire(s)
    await asyncio.sleep(0.01)
    assert not queued.done() and not s.gathering  # the slot is busy: it simply waits
    for g in first:
        s.release(g)
    await asyncio.sleep(0)
    assert queued.done()  # granted on release, not after another 5 s gathering
    s.release(queued.result())


async def test_a_quiesce_does_not_wait_for_a_gathering_slot_and_resume_grants_its_work() -> None:
    s = Scheduler(max_batch_size=8, batch_delay_s=5.0)
    waiting = [_acquire(s), _acquire(s)]
    await asyncio.sleep(0.01)
    assert s.gathering
    counts = await asyncio.wait_for(s.barrier_acquire(timeout_s=1), 1)  # nothing runs
    assert counts.running == 0 and counts.held_interactive == 2
    assert not s.gathering and not any(t.done() for t in waiting)
    s.barrier_release()
    await asyncio.sleep(0)
    grants = [t.result() for t in waiting]  # at once, together: no second gathering
    assert grants[0].batch is grants[1].batch
    for g in grants:
        s.release(g)


async def test_a_request_cancelled_while_the_slot_gathers_leaves_no_trace() -> None:
    s = Scheduler(max_batch_size=8, batch_delay_s=0.1)
    gone = _acquire(s)
    await asyncio.sleep(0.01)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    await eventually(lambda: not s.gathering, "the gathering ends")
    assert s.counts().queued == 0 and s.counts().running == 0
    again = await asyncio.wait_for(_acquire(s), 2)  # the slot works as before
    assert again.batch.sequences == 1
    s.release(again)


async def test_no_delay_grants_a_lone_request_synchronously() -> None:
    s = Scheduler(max_batch_size=8)  # batch_delay_s 0: the default on the CPU
    task = _acquire(s)
    await asyncio.sleep(0)
    assert task.done() and not s.gathering
    s.release(task.result())


@pytest.mark.parametrize("bad", [-1.0, 10.5, float("nan"), True, "5"])
def test_a_bad_delay_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        Scheduler(max_batch_size=8, batch_delay_s=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "expected"), [("", None), ("auto", None), ("AUTO", None), ("0", 0.0), ("2.5", 2.5)]
)
def test_the_setting_reads_auto_or_milliseconds(raw: str, expected: float | None) -> None:
    settings = load_settings({"MAX_BATCH_DELAY_MS": raw})
    assert settings.max_batch_delay_ms == expected


@pytest.mark.parametrize("raw", ["-1", "1001", "nan", "inf", "5ms", "soon"])
def test_a_bad_setting_names_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"MAX_BATCH_DELAY_MS": raw})
    assert "MAX_BATCH_DELAY_MS" in str(info.value)


def test_auto_is_10_ms_on_cuda_none_on_the_cpu_and_a_number_is_milliseconds() -> None:
    auto = Settings(home="/nonexistent")
    assert resolved_batch_delay_s(auto, "cpu") == 0.0
    assert resolved_batch_delay_s(auto, "cuda") == 0.010  # measured: docs/benchmarks.md
    set_ = Settings(home="/nonexistent", max_batch_delay_ms=12.0)
    assert resolved_batch_delay_s(set_, "cpu") == resolved_batch_delay_s(set_, "cuda") == 0.012


async def test_the_server_batches_chats_sent_together_under_the_delay(
    tiny_model_dir: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from miserver.http import keys
    from tests.unit.test_weights_routes import make_client

    batches = spy_batch_starts(monkeypatch)
    client = await make_client(
        tmp_path, tiny_model_dir, MAX_BATCH_SIZE="8", MAX_BATCH_DELAY_MS="1000"
    )
    try:
        assert client.server.app[keys.SCHEDULER].batch_delay_s == pytest.approx(1.0)

        async def one(i: int) -> int:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"Say {i}."}],
                "max_tokens": 2,
                "temperature": 0,
            }
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status == 200, await resp.text()
            return (await resp.json())["usage"]["completion_tokens"]

        done = await asyncio.gather(*(one(i) for i in range(3)))
        assert all(n >= 1 for n in done)
        assert batches == [3]  # not one alone and then two
    finally:
        await client.close()
