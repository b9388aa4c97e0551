"""Batches (issue 14; companion contract 4): the scheduler's grants of a group's work, the
seeds of a request's ``n`` choices, and the default model decoding several requests at once on
the continuous engine (issue 29) exactly as it decodes each alone.

The scheduler tests need no model. The others serve SmolLM2-135M-Instruct (bfloat16, CPU) with
``MAX_BATCH_SIZE=8``; requests are made to arrive together by holding the slot while they
queue, then releasing it, so every queued request joins one grant (one busy period of the
engine: :func:`~tests.unit.v1_fixtures.spy_batch_starts`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from miserver.http import keys
from miserver.serving.engine.sampling import choice_seed
from miserver.serving.engine.slot import Priority, Scheduler
from tests.unit.test_engine_serving import REQUESTS as ENGINE_REQUESTS
from tests.unit.test_engine_serving import chat
from tests.unit.test_engine_serving import texts as answer
from tests.unit.v1_fixtures import spy_batch_starts
from tests.waiting import eventually


# --- the scheduler ---------------------------------------------------------------------------
async def _queued(scheduler: Scheduler, n: int) -> None:
    await eventually(lambda: scheduler.counts().queued == n, f"{n} waiting")


async def _one_batch_of(scheduler: Scheduler, k: int) -> list[Any]:
    """``k`` grants of one group, granted together as one batch (the slot held meanwhile)."""
    held = await scheduler.acquire(Priority.INTERACTIVE)
    tasks = [
        asyncio.ensure_future(scheduler.acquire(Priority.INTERACTIVE, group="g")) for _ in range(k)
    ]
    await _queued(scheduler, k)
    scheduler.release(held)
    await asyncio.sleep(0)
    return [t.result() for t in tasks]


async def test_a_grant_takes_its_groups_waiting_work_in_priority_order_up_to_the_size() -> None:
    scheduler = Scheduler(max_batch_size=4)
    held = await scheduler.acquire(Priority.INTERACTIVE)  # the slot is busy: the others wait
    specs = [  # (name, priority, group, size), in arrival order
        ("batch-a", Priority.BATCH, "a", 1),
        ("a1", Priority.INTERACTIVE, "a", 1),
        ("b1", Priority.INTERACTIVE, "b", 1),
        ("a4", Priority.INTERACTIVE, "a", 4),  # does not fit after a1: waits for the next
        ("a2", Priority.INTERACTIVE, "a", 2),
        ("plain", Priority.INTERACTIVE, None, 1),
    ]
    tasks = {
        name: asyncio.ensure_future(scheduler.acquire(p, group=g, size=size))
        for name, p, g, size in specs
    }
    await _queued(scheduler, len(specs))
    scheduler.release(held)
    await asyncio.sleep(0)
    granted = {name for name, t in tasks.items() if t.done()}
    # a1 leads (the first interactive of the best priority), a2 fits, then batch-a: 4 sequences
    assert granted == {"a1", "a2", "batch-a"}, granted
    first = tasks["a1"].result().batch
    assert [g.size for g in first.grants] == [1, 2, 1]
    assert [g.priority for g in first.grants] == [
        Priority.INTERACTIVE,
        Priority.INTERACTIVE,
        Priority.BATCH,
    ]
    assert first.sequences == 4 and all(
        t.result().batch is first for n, t in tasks.items() if n in granted
    )
    assert scheduler.counts().running == 1  # one holder of the slot
    # the slot is free only when every member released; then b1 leads (arrived before a4)
    for name in ("a1", "batch-a"):
        scheduler.release(tasks[name].result())
        await asyncio.sleep(0)
        assert not tasks["b1"].done()
    scheduler.release(tasks["a2"].result())
    await asyncio.sleep(0)
    assert tasks["b1"].done() and not tasks["a4"].done()
    assert tasks["b1"].result().batch.grants == [tasks["b1"].result()]
    scheduler.release(tasks["b1"].result())
    await asyncio.sleep(0)
    assert tasks["a4"].done() and not tasks["plain"].done()
    scheduler.release(tasks["a4"].result())
    await asyncio.sleep(0)
    scheduler.release(tasks["plain"].result())
    assert scheduler.counts().running == 0
    with pytest.raises(RuntimeError):
        scheduler.release(tasks["plain"].result())  # released twice


async def test_a_size_beyond_the_batch_is_refused_and_a_batch_of_one_takes_nobody() -> None:
    scheduler = Scheduler(max_batch_size=2)
    for size in (0, 3, True):
        with pytest.raises(ValueError):
            await scheduler.acquire(Priority.INTERACTIVE, group="a", size=size)
    single = Scheduler()  # max_batch_size 1: every grant is its own
    held = await single.acquire(Priority.INTERACTIVE)
    a = asyncio.ensure_future(single.acquire(Priority.INTERACTIVE, group="a"))
    b = asyncio.ensure_future(single.acquire(Priority.INTERACTIVE, group="a"))
    await _queued(single, 2)
    single.release(held)
    await asyncio.sleep(0)
    assert a.done() and not b.done()
    single.release(a.result())
    await asyncio.sleep(0)
    single.release(b.result())


async def test_the_barrier_drains_a_batch_once_its_last_member_released() -> None:
    scheduler = Scheduler(max_batch_size=8)
    grants = await _one_batch_of(scheduler, 3)
    grants[0].join()
    scheduler.release(grants[1])  # leaves without joining (a refusal inside the slot)
    grants[2].join()
    assert scheduler.counts().running == 1 and scheduler.running_requests() == 2
    # the barrier drains the whole batch: it holds only once the last member released
    scheduler.barrier_begin()
    drained = asyncio.ensure_future(scheduler.barrier_wait_drained())
    scheduler.release(grants[0])
    await asyncio.sleep(0.01)
    assert not drained.done()
    scheduler.release(grants[2])
    counts = await asyncio.wait_for(drained, 1)
    assert counts.running == 0 and scheduler.barrier_held
    scheduler.barrier_release()


async def test_a_drain_timeout_counts_the_requests_of_the_batch_not_its_slot() -> None:
    from miserver.serving.engine.slot import DrainTimeout

    scheduler = Scheduler(max_batch_size=8)
    grants = await _one_batch_of(scheduler, 3)
    assert scheduler.counts().running == 1 and scheduler.running_requests() == 3
    with pytest.raises(DrainTimeout) as info:
        await scheduler.barrier_acquire(0.01)
    assert info.value.running == 3 and "3 running request(s)" in str(info.value)
    scheduler.release(grants[0])
    assert scheduler.running_requests() == 2
    for grant in grants[1:]:
        scheduler.release(grant)
    assert scheduler.running_requests() == 0 and scheduler.counts().running == 0


async def test_a_member_cancelled_as_it_is_granted_leaves_the_batch() -> None:
    scheduler = Scheduler(max_batch_size=8)
    held = await scheduler.acquire(Priority.INTERACTIVE)
    kept = asyncio.ensure_future(scheduler.acquire(Priority.INTERACTIVE, group="g"))
    gone = asyncio.ensure_future(scheduler.acquire(Priority.INTERACTIVE, group="g"))
    await _queued(scheduler, 2)
    scheduler.release(held)  # both granted in this instant ...
    gone.cancel()  # ... and one is cancelled before it runs: it hands its share back
    with pytest.raises(asyncio.CancelledError):
        await gone
    grant = await kept
    assert scheduler.running_requests() == 1  # the cancelled one's share went back
    grant.join()
    scheduler.release(grant)
    assert scheduler.counts().running == 0


def test_choice_seeds_are_the_seed_then_distinct_and_stable() -> None:
    assert choice_seed(None, 5) is None
    assert choice_seed(42, 0) == 42
    seeds = [choice_seed(42, i) for i in range(1, 64)]
    assert len(set(seeds)) == 63 and 42 not in seeds
    assert all(0 <= s < 2**64 for s in seeds)
    assert choice_seed(42, 1) == choice_seed(42, 1) != choice_seed(43, 1)


# --- the default model ------------------------------------------------------------------------
@pytest.fixture
async def client(default_home: str, tmp_path):
    from miserver.serving.models.default_model import model_dir
    from tests.unit.test_weights_routes import make_client

    c = await make_client(tmp_path, str(model_dir(default_home)), MAX_BATCH_SIZE="8")
    assert c.server.app[keys.SCHEDULER].max_batch_size == 8
    yield c
    await c.close()


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sequences of every batch (busy period of the engine) that starts."""
    return spy_batch_starts(monkeypatch)


async def post(client: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(path, json=body)
    data = await resp.json()
    assert resp.status == 200, data
    return data


async def together(client: Any, calls: list[Any]) -> list[Any]:
    """Run ``calls`` (coroutine functions) with the slot held until all of them wait, so they
    are granted together when it is released."""
    scheduler = client.server.app[keys.SCHEDULER]
    held = await scheduler.acquire(Priority.INTERACTIVE)
    try:
        tasks = [asyncio.ensure_future(call()) for call in calls]
        await eventually(lambda: scheduler.counts().queued == len(calls), "all queued", timeout=60)
    finally:
        scheduler.release(held)
    return await asyncio.gather(*tasks)


REQUESTS = [  # mixed prompt lengths, stops, max_tokens, both routes, and a stop on a completion
    *ENGINE_REQUESTS,
    (
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "def add(a, b):",
            "max_tokens": 5,
            "temperature": 0,
            "stop": [")"],
        },
    ),
]


async def test_batched_greedy_answers_equal_the_same_requests_run_alone(
    client: Any, batches: list[int]
) -> None:
    loop = client.server.app[keys.HOST].resident.engine_loop
    alone = []
    for path, body in REQUESTS:
        alone.append(answer(await post(client, path, body)))
        # a sequence its stop string ended leaves the engine at its next step: idle first
        await eventually(lambda: not loop._has_work(), "the engine is idle")
    assert batches == [1] * len(REQUESTS)  # each ran by itself
    batches.clear()
    together_bodies = await together(
        client, [lambda p=p, b=b: post(client, p, b) for p, b in REQUESTS]
    )
    assert batches == [len(REQUESTS)], batches  # one busy period of the engine took them all
    assert [answer(b) for b in together_bodies] == alone
    # the stop sequences and lengths really ended them differently
    assert {a[0][1] for a in alone} >= {"stop", "length"}
    assert all("\n2" not in text for (text, _f) in alone[3])
    headers = set()
    for body in together_bodies:
        assert body["usage"]["total_tokens"] > 0
    for path, body in REQUESTS[:2]:
        resp = await client.post(path, json=body)
        headers.add(resp.headers["X-miLLM-Model"])
    assert len(headers) == 1


async def test_n_gives_n_choices_each_reproducible_with_its_seed(
    client: Any, batches: list[int]
) -> None:
    body = chat("Tell me a short story.", max_tokens=16, temperature=1.0, seed=123, n=4)
    out = await post(client, "/v1/chat/completions", body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert batches == [4]
    texts = [c["message"]["content"] for c in out["choices"]]
    assert len(set(texts)) > 1  # sampled: the choices differ
    usage = out["usage"]
    assert usage["completion_tokens"] >= 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    one = await post(client, "/v1/chat/completions", {**body, "n": 1})
    assert one["usage"]["prompt_tokens"] == usage["prompt_tokens"]  # the prompt counted once
    for i, text in enumerate(texts):
        alone = await post(
            client, "/v1/chat/completions", {**body, "n": 1, "seed": choice_seed(123, i)}
        )
        assert alone["choices"][0]["message"]["content"] == text, i
    # completions too, and n above MAX_BATCH_SIZE is refused naming n
    comp = await post(
        client,
        "/v1/completions",
        {"model": "tiny", "prompt": "The sea", "max_tokens": 6, "n": 3, "seed": 5},
    )
    assert [c["index"] for c in comp["choices"]] == [0, 1, 2]
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "n": 9})
    err = (await resp.json())["error"]
    assert resp.status == 400 and err["param"] == "n" and "MAX_BATCH_SIZE" in err["message"]


async def sse(client: Any, path: str, body: dict[str, Any]) -> list[Any]:
    resp = await client.post(path, json={**body, "stream": True})
    assert resp.status == 200
    raw = (await resp.read()).decode()
    return [
        "[DONE]" if b[6:] == "[DONE]" else json.loads(b[6:]) for b in raw.split("\n\n") if b.strip()
    ]


async def test_a_streamed_n_carries_each_choice_by_index(client: Any) -> None:
    body = chat(
        "Name a fruit.",
        max_tokens=12,
        temperature=1.0,
        seed=9,
        n=3,
        stream_options={"include_usage": True},
    )
    events = await sse(client, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: "", 2: ""}
    finished = {}
    for ev in events[:-1]:
        for choice in ev["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
            if choice["finish_reason"] is not None:
                finished[choice["index"]] = ev["millm_model"]
    assert set(finished) == {0, 1, 2}
    usage = events[-2]["usage"]
    plain = await post(
        client, "/v1/chat/completions", {**body, "stream": False, "stream_options": None}
    )
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in plain["choices"]]
    assert usage == plain["usage"]


async def test_a_client_that_disconnects_ends_only_its_own_sequence(
    client: Any, batches: list[int]
) -> None:
    long = chat("Write a long poem about the sea.", max_tokens=80)
    other = chat("Describe a forest in detail.", max_tokens=40)
    alone = answer(await post(client, "/v1/chat/completions", other))
    batches.clear()

    async def hang_up() -> str:
        resp = await client.post("/v1/chat/completions", json={**long, "stream": True})
        await resp.content.readuntil(b"\n\n")
        await resp.content.readuntil(b"\n\n")
        resp.close()
        return "gone"

    results = await together(client, [hang_up, lambda: post(client, "/v1/chat/completions", other)])
    assert batches == [2]
    assert answer(results[1]) == alone
    scheduler = client.server.app[keys.SCHEDULER]
    await eventually(lambda: scheduler.counts().running == 0, "the slot is free")
