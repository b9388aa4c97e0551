"""``/v1`` admission when something changes while a request waits, and the queue bound by
priority (contract 1, 4, 7; the table's ``v1`` and ``v1_confirm`` rows).

Over a live app serving the tiny real Llama on the CPU: a request whose auto-load is followed
at once by a management unload is refused by the table's ``v1_confirm`` rows; the runtime's
confirmation refuses a request whose model is gone, with ``Retry-After``; batch rows are never
refused 503 QUEUE_FULL and do not count toward ``MAX_QUEUED_REQUESTS``, interactive requests do.
(The slot-side race, a model swapped or unloaded while a request waits for its slot, runs over
HTTP against the table in tests/model/test_http_stateful.py, scenario ``resident_changed``.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from miserver.http import keys
from miserver.http.v1 import run_completion
from miserver.serving.engine.slot import Priority
from miserver.spec import codes
from miserver.spec.errors import ApiError
from tests.unit.test_weights_routes import TRN, auth, make_client, post

CHAT = "/v1/chat/completions"


def body(model: str = "tiny") -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "temperature": 0,
    }


async def wait_until(predicate: Any, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def test_an_unload_that_starts_as_the_auto_load_ends_refuses_the_request(
    tmp_path, tiny_model_dir
):
    """The auto-load of ``tiny-b`` finishes and a management unload starts before the waiting
    request goes on: the table's ``v1_confirm`` (a model transition in progress) answers 409
    model_busy; the unload completes and nothing is served on the model it drops."""
    c = await make_client(tmp_path, tiny_model_dir)
    try:
        app = c.server.app
        host, runtime = app[keys.HOST], app[keys.WEIGHTS]
        app[keys.CATALOGUE].register(
            name="tiny-b", format="safetensors", dtype="bfloat16", path=tiny_model_dir
        )
        real_load = host.load
        unload: list[asyncio.Task[Any]] = []
        confirms: list[str] = []
        real_decide = runtime.decide

        def spy(event: Any, params: Any = None) -> Any:
            out = real_decide(event, params)
            if event.trigger == "v1_confirm":
                confirms.append(f"{out.kind} {out.code.name if out.code else ''}".strip())
            return out

        async def load_then_an_unload_arrives(row_id: int, **kw: Any) -> Any:
            resident = await real_load(row_id, **kw)
            # a management unload whose handler runs before the request resumes
            unload.append(asyncio.ensure_future(runtime.model_transition("model_unload", None)))
            return resident

        host.load = load_then_an_unload_arrives  # type: ignore[method-assign]
        runtime.decide = spy  # type: ignore[method-assign]
        resp = await c.post(CHAT, json=body("tiny-b"))
        err = (await resp.json())["error"]
        assert (resp.status, err["code"]) == (409, "model_busy"), err
        assert confirms == ["refused MODEL_BUSY"]  # decided by the table after the auto-load
        await unload[0]
        assert host.resident is None
        status = (await (await c.get("/api/weights/status")).json())["data"]
        assert status["resident_model"] is None and status["weights_state"] == "clean"
    finally:
        await c.close()


async def test_confirm_refuses_a_request_whose_model_is_gone(tmp_path, tiny_model_dir):
    """``confirm_v1`` with a resident that is no longer the resident (``None``: known not to
    be) is 409 MODEL_BUSY model_transition with ``Retry-After: 1`` and changes nothing; with
    the resident it lets the request go on."""
    c = await make_client(tmp_path, tiny_model_dir)
    try:
        runtime = c.server.app[keys.WEIGHTS]
        resident = c.server.app[keys.HOST].resident
        before = runtime.lifecycle.snapshot()
        with pytest.raises(ApiError) as info:
            await runtime.confirm_v1(None)
        err = info.value
        assert (err.code, err.status, err.reason) == (codes.MODEL_BUSY, 409, "model_transition")
        assert err.headers == {"Retry-After": "1"}
        assert "unloaded or changed while the request waited" in str(err.message)
        assert runtime.lifecycle.snapshot() == before
        await runtime.confirm_v1(resident)  # the same resident: it goes on
    finally:
        await c.close()


async def test_batch_rows_are_held_not_refused_when_interactive_requests_fill_the_queue(
    tmp_path, tiny_model_dir
):
    """MAX_QUEUED_REQUESTS=1 while quiesced: one interactive request is held, a second is 503
    queue_full with Retry-After; a batch row is held as a batch chunk, not refused (contract
    7), and runs after resume with the held request."""
    c = await make_client(tmp_path, tiny_model_dir, MAX_QUEUED_REQUESTS="1")
    try:
        app = c.server.app
        scheduler = app[keys.SCHEDULER]
        st, data, _ = await post(c, "/api/weights/attach", auth(TRN))
        assert st == 200, data
        h = auth(TRN, data["data"]["attachment_id"])
        assert (await post(c, "/api/weights/quiesce", h))[0] == 200
        held = asyncio.ensure_future(c.post(CHAT, json=body()))
        await wait_until(lambda: scheduler.counts().held_interactive == 1)
        resp = await c.post(CHAT, json=body())
        err = (await resp.json())["error"]
        assert (resp.status, err["code"]) == (503, "queue_full")
        assert resp.headers.get("Retry-After") == "1"
        row = asyncio.ensure_future(run_completion(app, CHAT, body(), priority=Priority.BATCH))
        await wait_until(lambda: scheduler.counts().held_batch == 1)
        assert not row.done()
        assert (await post(c, "/api/weights/resume", h))[0] == 200
        assert (await held).status == 200
        result = await asyncio.wait_for(row, 30)
        assert result.body["object"] == "chat.completion"
    finally:
        await c.close()


@pytest.mark.parametrize(("waiting", "quiesce_status"), [("batch", 200), ("interactive", 503)])
async def test_only_waiting_interactive_requests_fill_the_queue_for_quiesce(
    tmp_path, tiny_model_dir, waiting: str, quiesce_status: int
):
    """MAX_QUEUED_REQUESTS=1 with one request waiting for the busy slot: a waiting batch row
    does not make quiesce 503 QUEUE_FULL (it is held as a batch chunk and runs after resume),
    a waiting interactive request does (weights page: The write cycle 2; contract 1)."""
    c = await make_client(tmp_path, tiny_model_dir, MAX_QUEUED_REQUESTS="1")
    try:
        app = c.server.app
        scheduler = app[keys.SCHEDULER]
        st, data, _ = await post(c, "/api/weights/attach", auth(TRN))
        assert st == 200, data
        h = auth(TRN, data["data"]["attachment_id"])
        await scheduler.acquire(Priority.INTERACTIVE)  # a forward pass holds the one slot
        priority = Priority.BATCH if waiting == "batch" else Priority.INTERACTIVE
        request = asyncio.ensure_future(run_completion(app, CHAT, body(), priority=priority))
        await wait_until(lambda: scheduler.counts().queued == 1)
        quiesce = asyncio.ensure_future(post(c, "/api/weights/quiesce", h))
        if quiesce_status == 200:  # accepted: it drains until the forward pass ends
            await wait_until(lambda: scheduler.barrier_draining)
        else:  # refused at once, the slot still busy
            await asyncio.wait_for(asyncio.shield(quiesce), 30)
        scheduler.release()  # the forward pass ends
        st, data, headers = await asyncio.wait_for(quiesce, 30)
        assert st == quiesce_status, data
        if st == 200:
            assert data["data"]["held_batch_chunks"] == 1
            assert (await post(c, "/api/weights/resume", h))[0] == 200
        else:
            assert data["error"]["code"] == "QUEUE_FULL" and headers.get("Retry-After") == "1"
        result = await asyncio.wait_for(request, 30)
        assert result.body["object"] == "chat.completion"
    finally:
        await c.close()
