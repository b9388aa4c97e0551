"""A cleared trainer is fenced out (issue 32 item 8), over HTTP on a real app serving a tiny Llama
attachably on the CPU (``WEIGHTS_CPU_ATTACH=1``, contract section 8).

The breaker's scenario: a trainer attaches and rebuilds the body in a second process, stops
heartbeating (frozen), goes stale, an operator clears it, a second trainer attaches, and the
first wakes up and zeroes every tensor outside any bracket. Before the fence the status said
``clean`` and the next chat answered from the zeroed set; now the write lands in storages
nothing serves. The table's ``FENCE_ARENA`` effect does the move; a move that cannot allocate
tears the set (``fence_failed``); the decode engine's graphs follow the move.
"""

from __future__ import annotations

import pytest
import torch

from miserver.http import keys
from tests.unit.test_ipc_fence import Holder
from tests.unit.test_weights_routes import OPS, TRN, TRN2, auth, chat, make_client, post
from tests.waiting import eventually

FAST_STALE = {
    "WEIGHTS_HEARTBEAT_TIMEOUT_S": "0.5",
    "WEIGHTS_HEARTBEAT_INTERVAL_HINT_S": "0.1",
}


def _served(client) -> dict[str, torch.Tensor]:
    model = client.app[keys.HOST].resident.model
    return {n: p.detach().clone() for n, p in model.named_parameters()}


async def _status(client) -> dict:
    return (await (await client.get("/api/weights/status")).json())["data"]


async def _stale(client):
    status = await _status(client)
    return status if (status["attachment"] or {}).get("state") == "stale" else None


async def _attach_and_go_stale(client) -> tuple[dict, Holder]:
    st, body, _ = await post(client, "/api/weights/attach", auth(TRN))
    assert st == 200, body
    holder = Holder(body["data"])  # rebuilt in a second process, kept mapped
    await eventually(lambda: _stale(client), "the frozen trainer went stale")
    return body["data"], holder


@pytest.fixture
async def client(tmp_path, tiny_model_dir):
    c = await make_client(tmp_path, tiny_model_dir, **FAST_STALE)
    yield c
    await c.close()


async def test_a_cleared_trainer_that_wakes_up_cannot_write_what_is_served(client):
    st, before_chat, _ = await chat(client, max_tokens=4)
    assert st == 200
    before = _served(client)
    first, holder = await _attach_and_go_stale(client)
    try:
        st, body, _ = await post(client, "/api/weights/clear-stale", auth(OPS))
        assert st == 200 and body["data"]["cleared"]["label"] == "trn", body
        st, body, _ = await post(client, "/api/weights/attach", auth(TRN2))
        assert st == 200, body
        second = body["data"]
        assert second["storages"][0]["storage_handle"] != first["storages"][0]["storage_handle"]
        holder.write()  # the cleared trainer resumes and zeroes every tensor, outside a bracket
        after = _served(client)
        assert all(torch.equal(after[n], v) for n, v in before.items()), "a write got through"
        assert (await _status(client))["weights_state"] == "clean"
        st, after_chat, headers = await chat(client, max_tokens=4)
        assert st == 200 and headers["X-miLLM-Model"] == '"tiny";origin=model;commits=0'
        assert after_chat["choices"][0]["message"] == before_chat["choices"][0]["message"]
        # the second trainer's handles do reach the served set
        second_holder = Holder(second)
        try:
            second_holder.write()
            assert not any(p.any() for p in _served(client).values())
        finally:
            second_holder.close()
    finally:
        holder.close()


async def test_the_engine_drops_its_graphs_and_cache_with_the_move(client, monkeypatch):
    """The move's ``FENCE_ARENA`` drops the continuous engine's decode graphs (they address the
    old storages) and its ``DROP_CACHE`` the prefix cache (computed on them)."""
    _, holder = await _attach_and_go_stale(client)
    loop = client.app[keys.HOST].resident.engine_loop
    calls: list[str] = []
    for name in ("drop_graphs", "drop_prefix_cache"):
        real = getattr(loop, name)
        monkeypatch.setattr(
            loop, name, lambda real=real, name=name: (calls.append(name), real())[1]
        )
    try:
        st, _, _ = await post(client, "/api/weights/clear-stale", auth(OPS))
        assert st == 200
        assert "drop_graphs" in calls and "drop_prefix_cache" in calls
    finally:
        holder.close()


async def test_a_move_that_cannot_allocate_tears_the_set(client, monkeypatch):
    from miserver.ipc import arena as arena_module

    before = _served(client)
    _, holder = await _attach_and_go_stale(client)

    def no_room(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(arena_module, "relocate", no_room)
    try:
        st, body, _ = await post(client, "/api/weights/clear-stale", auth(OPS))
        assert st == 200, body
        assert body["data"]["weights_state"] == "torn"
        status = await _status(client)
        assert status["weights_state"] == "torn" and status["attached"] is False
        st, body, headers = await chat(client)
        assert st == 503 and body["error"]["code"] == "weights_torn"
        assert "Retry-After" in headers
        assert all(torch.equal(_served(client)[n], v) for n, v in before.items())
    finally:
        holder.close()
