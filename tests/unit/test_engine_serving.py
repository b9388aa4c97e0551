"""The continuous engine behind /v1 (issue 29, "Must show"), on the default model (SmolLM2-135M-
Instruct, bfloat16, CPU): requests join and leave the running batch at step boundaries, blocks
are reused, a small cache preempts without changing greedy text, ``n`` prefills once, greedy
text does not depend on the neighbours, a quiesce drains the engine and no step runs inside the
write, and a reader that stops reading costs only its own sequence.

Steps are counted on the engine thread (:attr:`EngineLoop.on_step`), so the assertions are in
steps, not seconds.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

from miserver.http import keys
from tests.waiting import eventually


@pytest.fixture
async def client(default_home: str, tmp_path):
    from miserver.serving.models.default_model import model_dir
    from tests.unit.test_weights_routes import make_client

    c = await make_client(tmp_path, str(model_dir(default_home)), ENGINE="continuous")
    yield c
    await c.close()


async def test_closing_the_server_ends_the_engine_thread_and_lets_go_of_its_cache(
    default_home: str, tmp_path
) -> None:
    """Whoever still holds the app or its engine loop after the server closes (aiohttp's
    middleware cache keeps applications; the scheduler a bound method), the engine thread has
    ended and the engine (its KV cache, its model) is gone: a test suite or a process that
    starts servers one after another does not keep a cache per server."""
    from miserver.serving.engine.continuous import ContinuousEngine
    from miserver.serving.models.default_model import model_dir
    from tests.unit.test_weights_routes import make_client

    c = await make_client(tmp_path, str(model_dir(default_home)))
    loop = engine_loop(c)
    assert isinstance(loop.engine, ContinuousEngine)
    cache = loop.engine.cache
    await post(c, chat("Hi", max_tokens=2))
    await c.close()
    await eventually(lambda: not loop._thread.is_alive(), "the engine thread ends", timeout=60)
    assert not isinstance(loop.engine, ContinuousEngine)
    assert cache.keys == [] and cache.values == []


async def test_the_engine_thread_computes_on_cpu_threads_and_the_event_loop_keeps_its_own(
    default_home: str, tmp_path
) -> None:
    import torch

    from miserver.serving.models.default_model import model_dir
    from tests.unit.test_weights_routes import make_client

    mine = torch.get_num_threads()
    wanted = 1 if mine > 1 else 2
    c = await make_client(
        tmp_path,
        str(model_dir(default_home)),
        CPU_THREADS=str(wanted),
        CPU_MATMUL_THREADS=str(3 - wanted),  # the other of 1 and 2 (the same bits on both)
        SPECULATIVE_TOKENS="0",  # one-row decode passes
    )
    try:
        loop = engine_loop(c)
        assert loop.threads == wanted
        runner = loop.engine.runner
        seen: list[int] = []
        loop.on_step = lambda n, outputs: seen.append(torch.get_num_threads())
        await post(c, chat("Hi", max_tokens=6))
        # settled at the engine thread's first pass: the other count, the engine's own beside it
        assert runner.matmul_threads == 3 - wanted and runner.threads.fallback == wanted
        assert seen and set(seen) == {wanted}
        assert torch.get_num_threads() == mine  # the event loop's thread is left alone
        # the products were timed on both counts for the one-row passes (a size's first two)
        timed = runner.threads._seconds
        assert {t for _, t in timed} == {1, 2}
        assert (1, 1) in timed and (1, 2) in timed
        health = await (await c.get("/api/health/detailed")).json()
        shown = json.dumps(health)
        assert f'"matmul_threads": {{"threads": {3 - wanted}, "fallback": {wanted}' in shown
    finally:
        await c.close()


async def test_speculative_tokens_reaches_the_engine_and_0_turns_it_off(
    default_home: str, tmp_path
) -> None:
    from miserver.serving.models.default_model import model_dir
    from tests.unit.test_weights_routes import make_client

    story = chat("Write a long story about the sea.", max_tokens=48)
    answers = []
    for value, expected in (("0", 0), ("auto", 4)):
        home = tmp_path / value
        home.mkdir()
        c = await make_client(home, str(model_dir(default_home)), SPECULATIVE_TOKENS=value)
        try:
            engine = engine_loop(c).engine
            assert engine.speculative_tokens == expected
            answers.append((await post(c, story))["choices"][0]["message"]["content"])
            drafted = engine.stats()["draft_tokens"]
            assert (drafted > 0) == bool(expected)
        finally:
            await c.close()
    assert answers[0] == answers[1]


class StepLog:
    """What each engine step produced: ``(step, time, {seq_id: tokens})``, and the engine's
    stats after it; filled on the engine thread."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.steps: list[tuple[int, float, dict[Any, int]]] = []
        self.stats: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        loop.on_step = self._on_step

    def _on_step(self, n: int, outputs: list[Any]) -> None:
        with self._lock:
            self.steps.append(
                (n, time.monotonic(), {o.seq_id: len(o.new_token_ids) for o in outputs})
            )
            self.stats.append(dict(self.loop.engine.stats()))

    def first_step_of(self, seq_id: Any) -> int:
        return next(n for n, _t, out in self.steps if out.get(seq_id))

    def last_step_of(self, seq_id: Any) -> int:
        return max(n for n, _t, out in self.steps if seq_id in out)


def engine_loop(client: Any) -> Any:
    return client.server.app[keys.HOST].resident.engine_loop


def chat(text: str, **kw: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        **kw,
    }


async def post(client: Any, body: dict[str, Any], path: str = "/v1/chat/completions") -> Any:
    resp = await client.post(path, json=body)
    data = await resp.json()
    assert resp.status == 200, data
    return data


def texts(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (c["message"]["content"] if "message" in c else c["text"], c["finish_reason"])
        for c in body["choices"]
    ]


async def test_a_request_arriving_while_a_long_one_decodes_gets_its_first_token_within_steps(
    client: Any,
) -> None:
    loop = engine_loop(client)
    log = StepLog(loop)
    long = asyncio.ensure_future(
        post(client, chat("Write a long story about the sea.", max_tokens=96))
    )
    await eventually(lambda: len(log.steps) >= 10, "the long one decodes", timeout=120)
    long_id = next(sid for _n, _t, out in log.steps for sid in out)
    sent_at = loop.steps
    short = await post(client, chat("Hi", max_tokens=4))
    short_id = next(s for _n, _t, out in log.steps for s in out if s != long_id)
    first = log.first_step_of(short_id)
    assert first - sent_at <= 3, (sent_at, first)  # a few steps, not after the long one ends
    assert short["choices"][0]["finish_reason"] in ("stop", "length")
    await long
    assert log.last_step_of(long_id) > log.last_step_of(short_id)  # the long one still ran


async def test_rows_leave_and_their_blocks_are_reused(client: Any) -> None:
    loop = engine_loop(client)
    log = StepLog(loop)
    total = loop.stats()["blocks_total"]
    bodies = [
        chat(f"Describe {t} in detail.", max_tokens=m)
        for t, m in (("a forest", 8), ("the moon", 40), ("a city", 16), ("rain", 64))
    ]
    await asyncio.gather(*(post(client, b) for b in bodies))
    # the answers may arrive before the engine thread logged the last step
    await eventually(lambda: log.stats[-1]["running"] == 0, "the last step is logged")
    running = [s["running"] for s in log.stats]
    free = [s["blocks_free"] for s in log.stats]
    # a sequence left while others still ran, and its blocks were free at the next step
    left = [i for i in range(1, len(running)) if 0 < running[i] < running[i - 1]]
    assert left, running
    assert any(free[i] > free[i - 1] for i in left), (running, free)
    assert running[-1] == 0 and free[-1] == total  # every block back once all ended


async def test_a_cache_too_small_preempts_and_still_completes_with_the_same_greedy_text(
    default_home: str, tmp_path
) -> None:
    from miserver.serving.models.default_model import model_dir
    from tests.unit.test_weights_routes import make_client

    # 4 MiB: 11 blocks of 16 positions (23,040 bytes a position): about two of these at once
    c = await make_client(
        tmp_path, str(model_dir(default_home)), ENGINE="continuous", KV_CACHE_BYTES="4MiB"
    )
    try:
        loop = engine_loop(c)
        assert loop.stats()["blocks_total"] <= 12
        bodies = [chat(f"Tell me about {t}.", max_tokens=48) for t in ("cats", "rivers", "bread")]
        alone = [texts(await post(c, b)) for b in bodies]
        before = loop.stats()["preemptions"]
        together = await asyncio.gather(*(post(c, b) for b in bodies))
        assert loop.stats()["preemptions"] > before  # the load did not fit: some were preempted
        assert [texts(b) for b in together] == alone
    finally:
        await c.close()


async def test_n_8_prefills_the_prompt_once(client: Any) -> None:
    loop = engine_loop(client)
    before = loop.stats()["prefills"]
    body = chat("Tell me a short story.", max_tokens=12, temperature=1.0, seed=7, n=8)
    out = await post(client, body)
    assert [c["index"] for c in out["choices"]] == list(range(8))
    assert loop.stats()["prefills"] - before == 1
    assert len({c["message"]["content"] for c in out["choices"]}) > 1  # each its own samples


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
]


async def test_greedy_text_does_not_depend_on_what_runs_beside_it(client: Any) -> None:
    alone = [texts(await post(client, body, path)) for path, body in REQUESTS]
    log = StepLog(engine_loop(client))
    together = await asyncio.gather(*(post(client, body, path) for path, body in REQUESTS))
    assert max(len(out) for _n, _t, out in log.steps) >= 3  # they really shared steps
    assert [texts(b) for b in together] == alone


async def test_a_quiesce_during_a_busy_engine_returns_once_the_running_sequences_end(
    client: Any,
) -> None:
    from tests.unit.test_weights_routes import TRN, auth
    from tests.unit.test_weights_routes import post as wpost

    st, body, _ = await wpost(client, "/api/weights/attach", auth(TRN))
    assert st == 200, body
    h = auth(TRN, body["data"]["attachment_id"])
    log = StepLog(engine_loop(client))
    runs = [
        asyncio.ensure_future(post(client, chat("Count slowly from one to fifty.", max_tokens=m)))
        for m in (8, 24, 48)
    ]
    await eventually(lambda: len(log.steps) >= 3, "the engine is busy", timeout=120)
    st, _b, _h = await wpost(client, "/api/weights/quiesce", h)
    answered = time.monotonic()
    assert st == 200
    token_times = [t for _n, t, out in log.steps if any(out.values())]
    assert max(token_times) <= answered  # every running sequence ended before quiesce returned
    assert (await wpost(client, "/api/weights/commit-begin", h))[0] == 200
    begun = time.monotonic()
    held = asyncio.ensure_future(post(client, chat("Hi", max_tokens=3)))
    await asyncio.sleep(0.5)
    assert not held.done()
    ended = time.monotonic()
    assert (await wpost(client, "/api/weights/commit-end", h))[0] == 200
    assert not any(begun <= t <= ended for _n, t, _o in log.steps)  # no step inside the write
    assert (await wpost(client, "/api/weights/resume", h))[0] == 200
    assert (await held)["choices"][0]["finish_reason"] in ("stop", "length")
    for r in runs:
        assert (await r)["choices"][0]["finish_reason"] in ("stop", "length")
    assert (await wpost(client, "/api/weights/detach", h))[0] == 200


async def test_a_stream_nobody_reads_does_not_delay_another_chat(client: Any) -> None:
    loop = engine_loop(client)
    log = StepLog(loop)
    port = client.server.port
    body = (
        b'{"model":"tiny","stream":true,"n":8,"max_tokens":120,"temperature":0,'
        b'"messages":[{"role":"user","content":"Write a very long story."}]}'
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()  # and never read a byte of the answer
    try:
        await eventually(lambda: len(log.steps) >= 5, "the unread stream decodes", timeout=120)
        unread = set(log.steps[-1][2])
        sent_at = loop.steps
        out = await post(client, chat("Hi", max_tokens=6))
        other = next(s for _n, _t, o in log.steps for s in o if s not in unread)
        assert log.first_step_of(other) - sent_at <= 3
        assert out["choices"][0]["finish_reason"] in ("stop", "length")
        # the other chat finished while the unread stream was still decoding
        ended = log.last_step_of(other)
        await eventually(lambda: log.steps[-1][0] > ended, "a step after the chat", timeout=60)
        assert unread & set(next(o for n, _t, o in log.steps if n == ended + 1))
    finally:
        writer.close()


async def test_a_reader_that_stops_reading_is_cancelled_at_the_bound(
    client: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from miserver.serving.engine import engine_loop as module
    from miserver.serving.engine.generation import SamplingParams

    monkeypatch.setattr(module, "STREAM_BUFFER_EVENTS", 5)
    loop = engine_loop(client)
    tok = client.server.app[keys.HOST].resident.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Write a long story about a dragon."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    (stream,) = loop.submit(ids, SamplingParams(max_tokens=150, temperature=0.0))
    (reader,) = loop.submit(ids, SamplingParams(max_tokens=20, temperature=0.0))
    got = [e async for e in reader.events()]  # this one is read; the first never is
    assert got[-1].finish_reason in ("stop", "length")
    await asyncio.wait_for(stream.wait(), 120)  # its share of the engine ends without a reader
    events = [e async for e in stream.events()]
    assert events[-1].finish_reason == "cancelled" and events[-1].completion_tokens < 150
    assert "stopped reading" in caplog.text
