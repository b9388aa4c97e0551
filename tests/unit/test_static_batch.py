"""The static batch (issue 14; companion contract 4): the scheduler's grants, and the default
model decoding several requests in one pass exactly as it decodes each alone.

The scheduler tests need no model. The others serve SmolLM2-135M-Instruct (bfloat16, CPU) with
``MAX_BATCH_SIZE=8``; a batch is forced by holding the slot while the requests queue, then
releasing it, so every queued request joins one grant.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from miserver.http import keys
from miserver.serving.engine.generation import StaticBatch
from miserver.serving.engine.slot import Priority, Scheduler
from miserver.serving.engine.static_batch import choice_seed
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


async def test_when_ready_waits_for_every_member_to_join_or_leave() -> None:
    scheduler = Scheduler(max_batch_size=8)
    grants = await _one_batch_of(scheduler, 3)
    batch = grants[0].batch
    ready: list[int] = []
    batch.when_ready(lambda: ready.append(1))
    grants[0].join()
    assert not ready
    scheduler.release(grants[1])  # leaves without joining (a refusal inside the slot)
    assert not ready
    grants[2].join()
    assert ready == [1]
    batch.when_ready(lambda: ready.append(2))  # already ready: at once
    assert ready == [1, 2]
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
    ready: list[int] = []
    grant.batch.when_ready(lambda: ready.append(1))
    grant.join()
    assert ready == [1]
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

    # the static batch's own behaviour: pinned (the continuous engine is the default)
    c = await make_client(
        tmp_path, str(model_dir(default_home)), MAX_BATCH_SIZE="8", ENGINE="static"
    )
    assert c.server.app[keys.SCHEDULER].max_batch_size == 8
    yield c
    await c.close()


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sequences of every static batch that starts."""
    return spy_batch_starts(monkeypatch)


async def post(client: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(path, json=body)
    data = await resp.json()
    assert resp.status == 200, data
    return data


async def together(client: Any, calls: list[Any]) -> list[Any]:
    """Run ``calls`` (coroutine functions) with the slot held until all of them wait, so they
    form one static batch when it is released."""
    scheduler = client.server.app[keys.SCHEDULER]
    held = await scheduler.acquire(Priority.INTERACTIVE)
    try:
        tasks = [asyncio.ensure_future(call()) for call in calls]
        await eventually(lambda: scheduler.counts().queued == len(calls), "all queued", timeout=60)
    finally:
        scheduler.release(held)
    return await asyncio.gather(*tasks)


def chat(text: str, **kw: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        **kw,
    }


REQUESTS = [  # mixed prompt lengths, stops, max_tokens, both routes
    ("/v1/chat/completions", chat("What is the capital of France?", max_tokens=20)),
    ("/v1/chat/completions", chat("Hi", max_tokens=32)),
    (
        "/v1/chat/completions",
        chat("Explain recursion to a five year old child in a few simple words.", max_tokens=28),
    ),
    ("/v1/chat/completions", chat("List three colors.", max_tokens=24, stop=["\n2"])),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 30, "temperature": 0},
    ),
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


def answer(body: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for choice in body["choices"]:
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        out.append((text, choice["finish_reason"]))
    return out


async def test_batched_greedy_answers_equal_the_same_requests_run_alone(
    client: Any, batches: list[int]
) -> None:
    alone = [answer(await post(client, path, body)) for path, body in REQUESTS]
    assert batches == [1] * len(REQUESTS)  # each ran by itself
    batches.clear()
    together_bodies = await together(
        client, [lambda p=p, b=b: post(client, p, b) for p, b in REQUESTS]
    )
    assert batches == [len(REQUESTS)], batches  # one pass decoded all of them
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
    metric = client.server.app[keys.METRICS].batch_sequences.collect()[0]
    sums = {s.name: s.value for s in metric.samples}
    assert sums["miserver_static_batch_sequences_sum"] == 4  # one batch of four observed
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


async def test_a_quiesce_sent_during_a_batch_returns_after_the_whole_batch(
    client: Any, batches: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from miserver.serving.engine import generation
    from tests.unit.test_weights_routes import TRN, auth
    from tests.unit.test_weights_routes import post as wpost

    st, body, _ = await wpost(client, "/api/weights/attach", auth(TRN))
    assert st == 200, body
    h = auth(TRN, body["data"]["attachment_id"])
    # when each token is taken, on the decoding thread: what the server did, not when this
    # loaded event loop got round to reading it
    tokens: list[float] = []
    advance = generation._Sequence.advance

    def timed(self: Any, *args: Any) -> int | None:
        tokens.append(time.monotonic())
        return advance(self, *args)

    monkeypatch.setattr(generation._Sequence, "advance", timed)
    first_token = asyncio.Event()

    async def stream(max_tokens: int) -> None:
        body = chat("Count slowly from one to fifty.", max_tokens=max_tokens, stream=True)
        resp = await client.post("/v1/chat/completions", json=body)
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content"' in line:
                first_token.set()

    async def quiesce_when_serving() -> tuple[float, int]:
        await first_token.wait()
        st, _b, _h = await wpost(client, "/api/weights/quiesce", h)
        return time.monotonic(), st

    quiesce = asyncio.ensure_future(quiesce_when_serving())
    await together(client, [lambda n=n: stream(n) for n in (8, 24, 48)])
    assert batches[-1] == 3
    answered, st = await quiesce
    assert st == 200
    assert max(tokens) <= answered  # every sequence of the batch ended before the quiesce
    # nothing is produced inside the write; a chat sent meanwhile waits, then is answered
    assert (await wpost(client, "/api/weights/commit-begin", h))[0] == 200
    begun = time.monotonic()
    held = asyncio.ensure_future(post(client, "/v1/chat/completions", chat("Hi", max_tokens=3)))
    await asyncio.sleep(0.3)
    assert not held.done()
    ended = time.monotonic()
    assert (await wpost(client, "/api/weights/commit-end", h))[0] == 200
    assert not any(begun <= t <= ended for t in tokens)
    assert (await wpost(client, "/api/weights/resume", h))[0] == 200
    assert (await held)["choices"][0]["finish_reason"] in ("stop", "length")
    assert (await wpost(client, "/api/weights/detach", h))[0] == 200


# --- the decoder, on a tiny float32 model (no server) ------------------------------------------
@pytest.mark.parametrize("by_row", [True, False], ids=["attention-by-row", "padding-mask"])
def test_the_batch_decoder_follows_each_sequence_as_it_decodes_alone(
    tmp_path, monkeypatch: pytest.MonkeyPatch, by_row: bool
) -> None:
    """Rows of different lengths, rows leaving (the cache shrinks and its shared padding is
    cropped): every row's logits stay those of its sequence decoded alone (float32 products are
    not batch-invariant on the CPU, so to rounding here; the default model's bfloat16 test above
    checks the bits)."""
    import torch

    from miserver.serving.engine import static_batch
    from miserver.serving.engine.generation import _EagerDecoder, cache_kwarg
    from tests.unit.v1_fixtures import cached_tokenizer, tiny_model

    model = tiny_model(cached_tokenizer(tmp_path.parent / "miserver-v1-cache"))
    monkeypatch.setattr(static_batch, "_by_row_ok", lambda m, d: by_row)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18]]
    forced = [[20 + i + r for i in range(6)] for r in range(len(prompts))]  # tokens fed per row
    with torch.inference_mode():
        alone = []
        for prompt, tokens in zip(prompts, forced, strict=True):
            dec = _EagerDecoder(model, torch.device("cpu"))
            rows = [dec.prefill(prompt, all_logits=False)[-1].float()]
            rows += [dec.step(t).clone() for t in tokens]
            alone.append(rows)
        batch = static_batch.BatchDecoder(model, torch.device("cpu"), cache_kwarg(model))
        firsts = [batch.prefill(p, all_logits=False)[-1].float() for p in prompts]
        batch.begin([0, 1, 2, 3])
        live = [0, 1, 2, 3]
        for r in live:
            torch.testing.assert_close(firsts[r], alone[r][0], rtol=0, atol=0)  # prefill alone
        for step in range(6):
            logits = batch.step([forced[r][step] for r in live])
            for i, r in enumerate(live):
                torch.testing.assert_close(logits[i], alone[r][step + 1], rtol=1e-4, atol=1e-4)
            if step == 1:  # the longest prompt leaves: the padding all rows share is cropped
                batch.keep([1, 2, 3])
                live = [1, 2, 3]
            if step == 3:  # down to one sequence (computed as two rows)
                batch.keep([1])
                live = [2]
        assert batch.rows == 1


async def test_one_sequence_that_fails_ends_alone_and_the_batch_goes_on(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence whose sampling fails (here: non-finite logits in its row, injected) gets its
    GenerationError; the other sequences of the batch finish as they would have alone."""
    from miserver.serving.engine import generation
    from miserver.serving.engine.generation import (
        Finished,
        GenerationError,
        NonFiniteLogits,
        SamplingParams,
        TextDelta,
    )
    from tests.unit.v1_fixtures import cached_tokenizer, tiny_model

    tok = cached_tokenizer(tmp_path.parent / "miserver-v1-cache")
    model = tiny_model(tok)
    real = generation.pick_token

    def pick(logits, params, generator):  # noqa: ANN001, ANN202
        if params.max_tokens == 7:
            raise NonFiniteLogits()
        return real(logits, params, generator)

    async def text_of(gen) -> tuple[str, str]:  # noqa: ANN001
        parts, finish = [], None
        async for ev in gen.events():
            if isinstance(ev, TextDelta):
                parts.append(ev.text)
            elif isinstance(ev, Finished):
                finish = ev.finish_reason
        return "".join(parts), finish

    greedy = SamplingParams(max_tokens=12, temperature=0)
    batch = StaticBatch()
    (ok,) = batch.join(model, tok, [5, 6, 7], greedy)
    (bad,) = batch.join(model, tok, [8, 9], SamplingParams(max_tokens=7, temperature=0))
    monkeypatch.setattr(generation, "pick_token", pick)
    batch.start()
    with pytest.raises(GenerationError) as info:
        await text_of(bad)
    assert isinstance(info.value.__cause__, NonFiniteLogits)
    batched = await text_of(ok)
    await ok.wait()
    alone = StaticBatch()
    (again,) = alone.join(model, tok, [5, 6, 7], greedy)
    alone.start()
    assert await text_of(again) == batched and batched[1] == "length"


async def test_a_request_cancelled_before_the_batch_starts_costs_no_prefill(tmp_path) -> None:
    """A client gone while its request waited for the batch to start (the others' prefill):
    its sequences end ``cancelled`` without a prefill of their own, and the others' answers are
    what they would have been (breaker14: the prompt was prefilled anyway, a whole prefill of
    the shared thread spent on an answer nobody reads before anyone's next token)."""
    from miserver.serving.engine.generation import Finished, SamplingParams, Started, TextDelta
    from tests.unit.v1_fixtures import SlowModel, cached_tokenizer, tiny_model

    tok = cached_tokenizer(tmp_path.parent / "miserver-v1-cache")
    model = SlowModel(tiny_model(tok))

    async def run(gen) -> tuple[str, str]:  # noqa: ANN001
        parts, finish = [], None
        async for ev in gen.events():
            if isinstance(ev, TextDelta):
                parts.append(ev.text)
            elif isinstance(ev, Finished):
                finish = ev.finish_reason
            else:
                assert isinstance(ev, Started)
        return "".join(parts), finish

    greedy = SamplingParams(max_tokens=6, temperature=0)
    batch = StaticBatch()
    (ok,) = batch.join(model, tok, [5, 6, 7], greedy)
    gone = batch.join(model, tok, list(range(10, 60)), greedy, n=2)
    for gen in gone:
        gen.cancel()
    batch.start()
    answered = await run(ok)
    assert [await run(gen) for gen in gone] == [("", "cancelled")] * 2
    assert sum(model.prefills) == 1  # the cancelled request's 50-token prompt was not prefilled
    alone = StaticBatch()
    (again,) = alone.join(model, tok, [5, 6, 7], greedy)
    alone.start()
    assert await run(again) == answered


async def test_a_sequence_that_ends_at_its_first_token_is_done_before_the_next_prefill(
    tmp_path,
) -> None:
    """``max_tokens=1`` in a batch: its answer is complete once its own prefill gave its token;
    the request is done then (its share of the slot given back, its answer sent), not after
    the prefills of every other member (breaker14)."""
    from miserver.serving.engine.generation import SamplingParams
    from tests.unit.v1_fixtures import SlowModel, cached_tokenizer, tiny_model

    tok = cached_tokenizer(tmp_path.parent / "miserver-v1-cache")
    model = SlowModel(tiny_model(tok), delay=0.2)
    batch = StaticBatch()
    (short,) = batch.join(model, tok, [5, 6, 7], SamplingParams(max_tokens=1, temperature=0))
    for i in range(3):
        batch.join(model, tok, [8 + i, 9, 10], SamplingParams(max_tokens=2, temperature=0))
    done_at: list[int] = []
    short.add_done_callback(lambda: done_at.append(model.calls))
    batch.start()
    await short.wait()
    assert done_at and done_at[0] <= 2, done_at  # before the third prefill, not after all four
    for gen in batch._sequences:
        await gen.wait()
