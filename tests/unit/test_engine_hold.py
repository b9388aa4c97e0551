"""A quiesce that holds running work across a commit, on the continuous engine (issue 30, "Must
show"; contract 4b), on the default model (SmolLM2-135M-Instruct, bfloat16, CPU,
``ENGINE=continuous``): a ``{"running": "hold"}`` quiesce returns within two forward passes
whatever the running sequences' lengths, nothing runs inside the write, after resume every
parked sequence finishes and what it produces after the resume is what a fresh request (its
prompt plus its tokens so far) gives on the new weights; the weight spans and the header's
``from_commits`` say which set produced which tokens; a tear while parked ends them with the
torn set's error.

Forward passes are counted by the engine (``counters["steps"]``), so the assertions are in
steps, not seconds.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch

from miserver.http import keys
from miserver.http.model_header import parse_from_commits, parse_model_header
from tests.unit.test_weights_routes import TRN, auth
from tests.unit.test_weights_routes import post as wpost
from tests.waiting import eventually

#: The weights written during the commit: every other channel of the final norm scaled in place
#: (its storage never moves; not a uniform scale, which would leave every argmax as it was).
SCALE = 1.5


async def make(default_home: str, tmp_path: Any, **env: str) -> Any:
    from miserver.serving.models.default_model import model_dir
    from tests.unit.test_weights_routes import make_client

    env.setdefault("WEIGHTS_COMMIT_WATCHDOG_MS", "60000")
    return await make_client(tmp_path, str(model_dir(default_home)), ENGINE="continuous", **env)


@pytest.fixture
async def client(default_home: str, tmp_path):
    c = await make(default_home, tmp_path)
    yield c
    await c.close()


def engine_loop(client: Any) -> Any:
    return client.server.app[keys.HOST].resident.engine_loop


def forward_passes(client: Any) -> int:
    return int(engine_loop(client).engine.counters["steps"])


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
    return data, resp.headers


async def attach(client: Any) -> dict[str, str]:
    st, body, _ = await wpost(client, "/api/weights/attach", auth(TRN))
    assert st == 200, body
    return auth(TRN, body["data"]["attachment_id"])


async def hold(client: Any, h: dict[str, str]) -> dict[str, Any]:
    st, body, _ = await wpost(client, "/api/weights/quiesce", h, {"running": "hold"})
    assert st == 200, body
    return body["data"]


def norm(client: Any) -> torch.Tensor:
    return client.server.app[keys.HOST].resident.model.model.norm.weight


async def commit_scaled(client: Any, h: dict[str, str]) -> tuple[int, int]:
    """commit-begin, the in-place write, commit-end; the forward passes at begin and at end."""
    assert (await wpost(client, "/api/weights/commit-begin", h))[0] == 200
    begun = forward_passes(client)
    with torch.no_grad():
        norm(client)[::2].mul_(SCALE)
    await asyncio.sleep(0.3)  # a forward pass now would show
    ended = forward_passes(client)
    assert (await wpost(client, "/api/weights/commit-end", h))[0] == 200
    return begun, ended


async def busy(client: Any, sequences: int, steps: int = 3) -> None:
    """Wait until ``sequences`` sequences have each produced a token and ``steps`` more
    forward passes ran."""
    loop = engine_loop(client)

    def producing() -> int:
        live = list(loop.engine._live.values())
        return sum(1 for s in live if s.output_token_ids)

    await eventually(lambda: producing() >= sequences, "every sequence decodes", timeout=300)
    start = forward_passes(client)
    await eventually(lambda: forward_passes(client) >= start + steps, "decode steps", timeout=300)


def parked(client: Any) -> list[Any]:
    """The engine's parked sequences (prompt and produced token ids kept)."""
    return [s for s in engine_loop(client).engine.scheduler.waiting if s.output_token_ids]


async def fresh_greedy(client: Any, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    """What fresh greedy requests ``(prompt_ids, max_tokens)`` produce on the weights of now,
    submitted together in this order (so the engine batches them as it batched the resumed
    sequences: the CPU's rounding depends on the batch's shape)."""
    from miserver.serving.engine.generation import SamplingParams

    loop = engine_loop(client)
    with loop._cv:  # one intake: the engine thread admits them in one step, in this order
        streams = [
            loop.submit(ids, SamplingParams(max_tokens=m, temperature=0.0))[0]
            for ids, m in requests
        ]
    for stream in streams:
        async for _event in stream.events():
            pass
    return [list(s._request.sequences[0].output_token_ids) for s in streams]


async def test_a_hold_parks_16_long_generations_within_two_steps_and_they_continue_exactly(
    client: Any,
) -> None:
    h = await attach(client)
    old_norm = norm(client).detach().clone()
    max_tokens = 40
    runs = [
        asyncio.ensure_future(
            post(
                client,
                chat(f"Count from {i} to {i + 200}, one number a line.", max_tokens=max_tokens),
            )
        )
        for i in range(16)
    ]
    await busy(client, 16)
    before = forward_passes(client)
    answer = await hold(client, h)
    at_answer = forward_passes(client)
    assert at_answer - before <= 2  # the quiesce returned within two decode steps
    held = parked(client)
    assert len(held) == 16 and answer["parked_sequences"] == 16
    assert all(len(s.output_token_ids) < max_tokens for s in held)
    so_far = {s.seq_id: (list(s.prompt_token_ids), list(s.output_token_ids)) for s in held}
    status = (await (await client.get("/api/weights/status")).json())["data"]
    assert status["parked_sequences"] == 16
    await asyncio.sleep(0.3)
    assert forward_passes(client) == at_answer  # parked: the step loop stopped
    begun, ended = await commit_scaled(client, h)
    assert ended == begun  # no token was produced inside the write
    assert (await wpost(client, "/api/weights/resume", h))[0] == 200
    answers = [await r for r in runs]
    for body, headers in answers:
        (choice,) = body["choices"]
        assert choice["finish_reason"] in ("stop", "length")
        spans = choice["millm_weight_spans"]
        assert [s["commits"] for s in spans] == [0, 1]
        assert sum(s["tokens"] for s in spans) == body["usage"]["completion_tokens"]
        assert parse_model_header(headers["X-miLLM-Model"])[2] == 1
        assert parse_from_commits(headers["X-miLLM-Model"]) == 0
    # the re-prefill is exact: what each produced after the resume is a fresh request's
    held.sort(key=lambda s: s.arrival)
    requests = []
    for seq in held:
        prompt, produced = so_far[seq.seq_id]
        assert list(seq.output_token_ids)[: len(produced)] == produced  # nothing sent changed
        assert len(seq.output_token_ids) > len(produced), "it continued after the resume"
        requests.append((prompt + produced, max_tokens - len(produced)))
    fresh = await fresh_greedy(client, requests)
    for seq, again in zip(held, fresh, strict=True):
        assert list(seq.output_token_ids)[len(so_far[seq.seq_id][1]) :] == again
    # ... and the old weights would have given something else (the write mattered)
    with torch.no_grad():
        norm(client).copy_(old_norm)
    assert await fresh_greedy(client, requests) != fresh
    assert (await wpost(client, "/api/weights/detach", h))[0] == 200


async def read_stream(client: Any, body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    """The chunks of a streamed chat (``[DONE]`` left out) and the response headers."""
    resp = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert resp.status == 200
    chunks = []
    async for raw in resp.content:
        text = raw.decode().strip()
        if text.startswith("data: ") and text != "data: [DONE]":
            chunks.append(json.loads(text[len("data: ") :]))
    return chunks, resp.headers


async def batch_line(client: Any, body: dict[str, Any]) -> asyncio.Future[dict[str, Any]]:
    """Start a Batch API job of one chat line; a future of its output line."""
    import aiohttp

    line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": body}
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field(
        "file",
        json.dumps(line).encode() + b"\n",
        filename="in.jsonl",
        content_type="application/jsonl",
    )
    f = await (await client.post("/v1/files", data=form)).json()
    resp = await client.post(
        "/v1/batches",
        json={
            "input_file_id": f["id"],
            "completion_window": "24h",
            "endpoint": "/v1/chat/completions",
        },
    )
    batch = await resp.json()
    assert resp.status == 200, batch

    async def output() -> dict[str, Any]:
        async def ended() -> dict[str, Any] | None:
            b = await (await client.get(f"/v1/batches/{batch['id']}")).json()
            return b if b["status"] in ("completed", "failed", "expired", "cancelled") else None

        done = await eventually(ended, "the batch ended", timeout=300)
        assert done["status"] == "completed", done
        content = await (await client.get(f"/v1/files/{done['output_file_id']}/content")).read()
        (out,) = [json.loads(x) for x in content.decode().splitlines()]
        return out

    return asyncio.ensure_future(output())


def assert_spans(choice: dict[str, Any], tokens: int | None = None) -> None:
    spans = choice["millm_weight_spans"]
    assert [s["commits"] for s in spans] == [0, 1] and all(s["tokens"] >= 1 for s in spans)
    if tokens is not None:
        assert sum(s["tokens"] for s in spans) == tokens


async def test_spans_and_from_commits_for_streamed_whole_n_2_and_batch_output(client: Any) -> None:
    h = await attach(client)
    long = "Count from 1 to 300, one number a line."
    streamed = asyncio.ensure_future(read_stream(client, chat(long, max_tokens=30, n=2)))
    whole = asyncio.ensure_future(post(client, chat(long + " Go.", max_tokens=30, n=2)))
    batched = await batch_line(client, chat(long + " Now.", max_tokens=30))
    await busy(client, 5)
    assert (await hold(client, h))["parked_sequences"] == 5
    await commit_scaled(client, h)
    assert (await wpost(client, "/api/weights/resume", h))[0] == 200

    body, headers = await whole
    for choice in body["choices"]:
        assert_spans(choice)
    assert (
        sum(s["tokens"] for c in body["choices"] for s in c["millm_weight_spans"])
        == body["usage"]["completion_tokens"]
    )
    value = headers["X-miLLM-Model"]
    assert parse_model_header(value)[2] == 1 and parse_from_commits(value) == 0

    chunks, headers = await streamed
    assert parse_from_commits(headers["X-miLLM-Model"]) is None  # sent before the commit
    finals = {c["index"]: c for ch in chunks for c in ch["choices"] if c.get("finish_reason")}
    assert sorted(finals) == [0, 1]
    for choice in finals.values():
        assert_spans(choice)
    terminal = [ch for ch in chunks if "millm_model" in ch][-1]["millm_model"]
    assert parse_model_header(terminal)[2] == 1 and parse_from_commits(terminal) == 0
    for index in (0, 1):  # each choice's tokens are counted once: nothing was sent twice
        sent = [c for ch in chunks for c in ch["choices"] if c["index"] == index]
        assert all(c.get("finish_reason") is None for c in sent[:-1])

    out = await batched
    response = out["response"]
    assert response["status_code"] == 200, out
    (choice,) = response["body"]["choices"]
    assert_spans(choice, response["body"]["usage"]["completion_tokens"])
    assert (await wpost(client, "/api/weights/detach", h))[0] == 200


async def test_a_request_on_one_set_reports_no_spans(client: Any) -> None:
    body, headers = await post(client, chat("Hi", max_tokens=5))
    assert "millm_weight_spans" not in body["choices"][0]
    assert parse_from_commits(headers["X-miLLM-Model"]) is None


async def test_a_tear_while_parked_ends_the_parked_with_the_torn_error(
    default_home: str, tmp_path: Any
) -> None:
    client = await make(default_home, tmp_path, WEIGHTS_COMMIT_WATCHDOG_MS="200")
    try:
        h = await attach(client)
        long = "Count from 1 to 300, one number a line."
        streamed = asyncio.ensure_future(read_stream(client, chat(long, max_tokens=60)))
        whole = asyncio.ensure_future(
            client.post("/v1/chat/completions", json=chat(long, max_tokens=60))
        )
        await busy(client, 2)
        assert (await hold(client, h))["parked_sequences"] == 2
        passes = forward_passes(client)
        assert (await wpost(client, "/api/weights/commit-begin", h))[0] == 200
        await eventually(
            lambda: engine_loop(client).parked_sequences() == 0, "the watchdog tears", timeout=60
        )
        resp = await whole
        data = await resp.json()
        # the torn set's error ends it: the 503 WEIGHTS_TORN a held request gets
        assert resp.status == 503, data
        assert data["error"]["code"] == "weights_torn", data
        assert "The weights are torn" in data["error"]["message"], data
        chunks, _ = await streamed
        assert "The weights are torn" in chunks[-1]["error"]["message"], chunks[-1]
        assert not any(c.get("finish_reason") for ch in chunks for c in ch.get("choices", []))
        assert forward_passes(client) == passes  # nothing ran on the torn set
        status = (await (await client.get("/api/weights/status")).json())["data"]
        assert status["weights_state"] == "torn"
    finally:
        await client.close()


async def test_a_finish_quiesce_parks_nothing_and_waits_for_the_running(client: Any) -> None:
    h = await attach(client)
    run = asyncio.ensure_future(post(client, chat("Count from 1 to 300.", max_tokens=12)))
    await busy(client, 1, steps=1)
    st, body, _ = await wpost(client, "/api/weights/quiesce", h)
    assert st == 200 and body["data"]["parked_sequences"] == 0
    assert run.done()  # the drain waited for it
    (choice,) = (await run)[0]["choices"]
    assert "millm_weight_spans" not in choice
    assert (await wpost(client, "/api/weights/resume", h))[0] == 200
    assert (await wpost(client, "/api/weights/detach", h))[0] == 200


async def test_a_hold_without_a_commit_is_one_set_and_a_cancelled_parked_stream_leaves(
    client: Any,
) -> None:
    h = await attach(client)
    long = "Count from 1 to 300, one number a line."
    kept = asyncio.ensure_future(post(client, chat(long, max_tokens=30)))
    resp = await client.post(
        "/v1/chat/completions", json={**chat(long, max_tokens=200), "stream": True}
    )
    assert resp.status == 200
    await busy(client, 2)
    assert (await hold(client, h))["parked_sequences"] == 2
    passes = forward_passes(client)
    resp.close()  # the client of the streamed one leaves while it is parked
    await eventually(
        lambda: engine_loop(client).parked_sequences() == 1, "the cancelled one leaves", timeout=60
    )
    assert forward_passes(client) == passes  # leaving runs no forward pass
    assert (await wpost(client, "/api/weights/resume", h))[0] == 200
    body, headers = await kept
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert "millm_weight_spans" not in body["choices"][0]  # the same weights before and after
    assert parse_from_commits(headers["X-miLLM-Model"]) is None
    assert (await wpost(client, "/api/weights/detach", h))[0] == 200
