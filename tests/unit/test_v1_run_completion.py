"""``miserver.http.v1.run_completion``: the one run path of non-streamed ``/v1`` requests and of
Batch API rows (contract 4 and 7), over a live app serving a tiny real Llama.

Shows that the ``priority`` argument reaches the scheduler (a batch row waits behind an
interactive request that came later; a quiesce holds it as a batch chunk), and that the runner
answers and refuses exactly as ``/v1`` over HTTP does.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from miserver.http import keys
from miserver.http.app import create_app
from miserver.http.errors import openai_error_body
from miserver.http.model_header import HEADER, parse_model_header
from miserver.http.v1 import CompletionResult, RequestCancelled, run_completion
from miserver.serving.engine.slot import Priority
from miserver.serving.models.catalogue import Catalogue
from miserver.spec.errors import ApiError
from miserver.spec.settings import Settings
from tests.unit.v1_fixtures import tiny_model_folder

MODEL = "tiny"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_folder(tmp_path_factory.getbasetemp().parent / "miserver-v1-cache")


@pytest.fixture
async def client(folder: Path, tmp_path: Path):
    home = tmp_path / "home"
    cat = Catalogue(home)
    for name in (MODEL, "other"):
        cat.register(name=name, format="safetensors", dtype="float32", path=str(folder))
    app = create_app(Settings(home=str(home), default_model=MODEL, device="cpu", log_format="text"))
    c = TestClient(TestServer(app))
    await c.start_server()
    await app[keys.STARTUP_LOAD]
    assert app[keys.HOST].resident is not None
    yield c
    await c.close()


def chat(text: str = "Hello", **kw: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": text}],
        **kw,
    }


async def wait_until(predicate: Any, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_batch_priority_reaches_the_scheduler(client: TestClient):
    """A batch request queued first is granted after an interactive one queued later."""
    app = client.server.app
    scheduler = app[keys.SCHEDULER]
    granted: list[Priority] = []
    real_acquire = scheduler.acquire

    async def spy(priority: Priority, **kw: Any) -> Any:
        grant = await real_acquire(priority, **kw)
        granted.append(Priority(priority))
        return grant

    scheduler.acquire = spy  # type: ignore[method-assign]
    held = await scheduler.acquire(Priority.INTERACTIVE)  # hold the one slot
    granted.clear()
    try:
        batch = asyncio.create_task(
            run_completion(app, CHAT, chat("batch"), priority=Priority.BATCH)
        )
        await wait_until(lambda: scheduler.counts().queued == 1)
        interactive = asyncio.create_task(run_completion(app, CHAT, chat("now")))
        await wait_until(lambda: scheduler.counts().queued == 2)
    finally:
        scheduler.release(held)
    results = await asyncio.gather(batch, interactive)
    assert granted == [Priority.INTERACTIVE, Priority.BATCH]  # the later interactive first
    for result in results:
        assert result.body["object"] == "chat.completion"
        assert parse_model_header(result.model_header) == (MODEL, "model", 0)
    assert scheduler.counts().running == 0


async def test_a_quiesce_holds_a_batch_request_as_a_batch_chunk(client: TestClient):
    app = client.server.app
    scheduler = app[keys.SCHEDULER]
    await scheduler.barrier_acquire(5.0)
    try:
        task = asyncio.create_task(run_completion(app, CHAT, chat(), priority=Priority.BATCH))
        await wait_until(lambda: scheduler.counts().held_batch == 1)
        assert scheduler.counts().held_interactive == 0
        assert not task.done()
    finally:
        scheduler.barrier_release()
    result = await task
    assert result.body["choices"][0]["finish_reason"] in ("stop", "length")


async def test_the_answer_is_the_one_v1_gives(client: TestClient):
    app = client.server.app
    body = chat("Count to three", max_tokens=6, logprobs=True, top_logprobs=2)
    resp = await client.post(CHAT, json=body)
    assert resp.status == 200
    over_http = await resp.json()
    for priority in (Priority.INTERACTIVE, Priority.BATCH):
        result = await run_completion(app, CHAT, body, priority=priority)
        assert isinstance(result, CompletionResult)
        assert result.headers == {HEADER: resp.headers[HEADER]}
        for key in ("id", "created"):
            assert result.body.pop(key) and over_http.get(key)
        expected = {k: v for k, v in over_http.items() if k not in ("id", "created")}
        assert result.body == expected


async def test_completions_and_raw_bytes_run_too(client: TestClient):
    app = client.server.app
    raw = b'{"model": "tiny", "prompt": "1, 2, 3,", "max_tokens": 3, "temperature": 0}'
    result = await run_completion(app, "/v1/completions", raw, priority=Priority.BATCH)
    assert result.body["object"] == "text_completion"
    assert result.body["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(max_tokens=10**6), "max_tokens"),
        (chat(temperature=3), "temperature"),
        (chat(frobnicate=1), "frobnicate"),
        (chat(model="no-such-model"), "model"),
        ({**chat(), "max_tokens": True}, "max_tokens"),
    ],
)
async def test_refusals_are_the_ones_v1_answers(client: TestClient, body: Any, param: str):
    resp = await client.post(CHAT, json=body)
    over_http = await resp.json()
    with pytest.raises(ApiError) as info:
        await run_completion(client.server.app, CHAT, body, priority=Priority.BATCH)
    assert info.value.status == resp.status >= 400
    assert openai_error_body(info.value) == over_http
    assert over_http["error"]["param"] == param


async def test_a_batch_request_never_loads_a_model(client: TestClient):
    app = client.server.app
    with pytest.raises(ApiError) as info:
        await run_completion(
            app, CHAT, chat(model="other"), priority=Priority.BATCH, load_policy="refuse"
        )
    assert (info.value.status, info.value.code.wire) == (409, "model_not_loaded")
    assert app[keys.HOST].resident.row.name == MODEL


async def test_stream_and_misuse_are_refused(client: TestClient):
    app = client.server.app
    with pytest.raises(ApiError) as info:
        await run_completion(app, CHAT, chat(stream=True))
    assert (info.value.status, info.value.param) == (400, "stream")
    with pytest.raises(ValueError, match="endpoint"):
        await run_completion(app, "/v1/embeddings", chat())
    with pytest.raises(ValueError, match="priority"):
        await run_completion(app, CHAT, chat(), priority=Priority.BARRIER)


async def test_cancelled_while_waiting_leaves_no_trace(client: TestClient):
    app = client.server.app
    scheduler = app[keys.SCHEDULER]
    await scheduler.acquire(Priority.INTERACTIVE)
    stop = False
    try:
        task = asyncio.create_task(
            run_completion(app, CHAT, chat(), priority=Priority.BATCH, cancelled=lambda: stop)
        )
        await wait_until(lambda: scheduler.counts().queued == 1)
        stop = True
        with pytest.raises(RequestCancelled):
            await task
        assert scheduler.counts().queued == 0
    finally:
        scheduler.release()
    assert scheduler.counts().running == 0


async def test_check_in_slot_runs_inside_the_slot_and_gives_it_back(client: TestClient):
    app = client.server.app
    scheduler = app[keys.SCHEDULER]
    seen: list[int] = []

    class Blocked(Exception):
        pass

    def check(resident: Any) -> None:
        seen.append(scheduler.counts().running)
        assert resident is app[keys.HOST].resident
        raise Blocked

    with pytest.raises(Blocked):
        await run_completion(app, CHAT, chat(), priority=Priority.BATCH, check_in_slot=check)
    assert seen == [1]  # called holding the slot
    assert scheduler.counts().running == 0  # and the slot was given back


async def test_lifecycle_refusals_name_their_details_in_the_openai_message(
    tmp_path: Path, tiny_model_dir: str
):
    """Weights page, Unsaved commits: the message names the resident's served name, the number
    of unsaved commits and the ways forward; /v1 bodies keep OpenAI's four fields (contract 2),
    so the message carries them. ALREADY_ATTACHED names the holder the same way."""
    import torch

    from tests.unit.test_weights_routes import TRN, auth, make_client, post

    c = await make_client(tmp_path, tiny_model_dir)
    try:
        app = c.server.app
        app[keys.CATALOGUE].register(
            name="tiny-b", format="safetensors", dtype="bfloat16", path=tiny_model_dir
        )
        st, body, _ = await post(c, "/api/weights/attach", auth(TRN))
        assert st == 200, body
        h = auth(TRN, body["data"]["attachment_id"])
        other = {**chat(), "model": "tiny-b"}

        resp = await c.post(CHAT, json=other)
        attached = (await resp.json())["error"]
        assert (resp.status, attached["code"]) == (409, "already_attached")
        assert "trainer 'trn' (active)" in attached["message"]

        for path in ("quiesce", "commit-begin"):
            assert (await post(c, f"/api/weights/{path}", h))[0] == 200
        with torch.no_grad():
            app[keys.HOST].resident.model.model.norm.weight.add_(0.5)
        for path in ("commit-end", "resume", "detach"):
            assert (await post(c, f"/api/weights/{path}", h))[0] == 200

        resp = await c.post(CHAT, json=other)
        over_http = await resp.json()
        err = over_http["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (resp.status, err["code"], err["type"]) == (
            409,
            "weights_unsaved",
            "invalid_request_error",
        )
        for words in ("tiny carries 1 unsaved commit;", "POST /api/weights/save", "/load"):
            assert words in err["message"], err["message"]
        with pytest.raises(ApiError) as info:
            await run_completion(app, CHAT, other, priority=Priority.BATCH, load_policy="auto")
        assert openai_error_body(info.value) == over_http
        assert app[keys.HOST].resident.row.name == "tiny"  # nothing was loaded
    finally:
        await c.close()
