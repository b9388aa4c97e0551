"""Issue 16 ("Hardening"), items 8 to 18: wrong answers and wrong errors.

Each test failed on the code before its fix (checked by reverting the fix; see the commit).
"""

from __future__ import annotations

import asyncio

import pytest

from miserver.http import keys
from miserver.serving.scheduler import Priority
from tests.unit.test_weights_checkpoints_routes import make_adapter
from tests.unit.test_weights_routes import make_client


@pytest.fixture
async def client(tmp_path, tiny_model_dir):
    c = await make_client(tmp_path, tiny_model_dir)
    yield c
    await c.close()


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


# --- item 8: a queued request naming an adapter removed before it runs ---------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_a_queued_request_for_a_removed_adapter_is_refused_not_served_by_the_base(
    client, tmp_path, tiny_model_dir, stream
):
    lora = make_adapter(tiny_model_dir, tmp_path / "lora")
    resp = await client.post("/api/weights/adapter", json={"name": "tiny-lora", "path": str(lora)})
    assert resp.status == 200, await resp.json()
    scheduler = client.app[keys.SCHEDULER]
    await scheduler.acquire(Priority.INTERACTIVE)  # a running request holds the only slot
    body = {
        "model": "tiny-lora",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": stream,
    }
    request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
    await wait_until(lambda: scheduler.counts().queued == 1)
    removal = asyncio.ensure_future(client.delete("/api/weights/adapter"))
    await wait_until(lambda: scheduler.barrier_draining)
    scheduler.release()  # the running request ends; the removal drains, runs, resumes
    removed = await removal
    assert removed.status == 200, await removed.json()
    resp = await request
    answer = await resp.json()
    assert resp.status == 409, answer
    assert answer["error"]["code"] == "model_busy"
    assert resp.headers["Retry-After"]
    assert "X-miLLM-Model" not in resp.headers
    # The retry is admitted anew: the adapter's name is no model now.
    resp = await client.post("/v1/chat/completions", json={**body, "stream": False})
    assert resp.status == 404, await resp.json()
