"""Model loads, swaps and unloads against ``/v1`` traffic, over HTTP on a live app serving the
tiny real Llama attachably on the CPU (contract 3, 4; weights page: States, Unsaved commits and
the auto-load).

- During a management swap away from a resident with unsaved commits, a ``/v1`` request naming
  the resident (served or base name) or the swap's target is 409 model_busy (a transition in
  progress), not 409 weights_unsaved (finding 8): the resident is the lifecycle's resident
  until the transition ends, and the running load is the operator's deliberate discard.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from miserver.http import keys
from tests.unit.test_weights_routes import TRN, auth, make_client, post

CHAT = "/v1/chat/completions"


def body(model: str = "tiny", max_tokens: int = 1) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


async def wait_until(predicate: Any, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def one_unsaved_commit(c: Any) -> None:
    st, data, _ = await post(c, "/api/weights/attach", auth(TRN))
    assert st == 200, data
    h = auth(TRN, data["data"]["attachment_id"])
    for route in ("quiesce", "commit-begin", "commit-end", "resume", "detach"):
        st, data, _ = await post(c, f"/api/weights/{route}", h)
        assert st == 200, (route, data)


def gate_loads(host: Any) -> tuple[threading.Event, threading.Event]:
    """Make the host's loads wait (in their worker thread) until ``release`` is set."""
    started, release = threading.Event(), threading.Event()
    real = host._loader

    def gated(row: Any, settings: Any) -> Any:
        started.set()
        assert release.wait(30), "the test never released the load"
        return real(row, settings)

    host._loader = gated
    return started, release


async def test_v1_during_a_swap_from_an_unsaved_resident_is_model_busy(tmp_path, tiny_model_dir):
    c = await make_client(tmp_path, tiny_model_dir)
    try:
        app = c.server.app
        host = app[keys.HOST]
        other = app[keys.CATALOGUE].register(
            name="tiny-b", format="safetensors", dtype="bfloat16", path=tiny_model_dir
        )
        await one_unsaved_commit(c)
        # nothing in progress: the resident is served as usual, another model is refused
        resp = await c.post(CHAT, json=body("tiny"))
        assert resp.status == 200, await resp.text()
        resp = await c.post(CHAT, json=body("tiny-b"))
        assert (resp.status, (await resp.json())["error"]["code"]) == (409, "weights_unsaved")

        started, release = gate_loads(host)
        swap = asyncio.ensure_future(c.post(f"/api/models/{other.id}/load"))
        await wait_until(started.is_set)
        assert host.resident is None  # dropped before the new one is read
        try:
            for name in ("tiny", "tiny-b"):  # the resident's name, the swap's target
                resp = await c.post(CHAT, json=body(name))
                err = (await resp.json())["error"]
                assert (resp.status, err["code"]) == (409, "model_busy"), (name, err)
                assert "unsaved" not in err["message"]
            # X-miLLM-Load-Policy: refuse refuses a swap first, but "tiny" names the resident
            refuse = {"X-miLLM-Load-Policy": "refuse"}
            resp = await c.post(CHAT, json=body("tiny"), headers=refuse)
            assert (resp.status, (await resp.json())["error"]["code"]) == (409, "model_busy")
            resp = await c.post(CHAT, json=body("tiny-b"), headers=refuse)
            assert (resp.status, (await resp.json())["error"]["code"]) == (409, "model_not_loaded")
        finally:
            release.set()
        resp = await swap
        assert resp.status == 200, await resp.text()
        resp = await c.post(CHAT, json=body("tiny-b"))
        assert resp.status == 200, await resp.text()
    finally:
        await c.close()


def slow_resident(host: Any, delay: float) -> Any:
    """Wrap the resident's model so every forward pass takes ``delay`` seconds more."""
    from tests.unit import v1_fixtures

    return v1_fixtures.slow_resident(host.resident, delay)


def record_drops(host: Any) -> list[float]:
    """``time.perf_counter()`` of every drop of a resident (unload, swap)."""
    drops: list[float] = []
    real = host._drop_resident

    def drop(**kwargs: Any) -> None:
        if host.resident is not None:
            drops.append(time.perf_counter())
        real(**kwargs)

    host._drop_resident = drop
    return drops


async def test_a_swap_waits_for_the_running_generation_then_answers(tmp_path, tiny_model_dir):
    """Finding 7: a swap (and an unload) answered while a generation still ran on the old
    model, so two models were in memory at once. Now the running generation finishes first
    (new requests for the resident are 409 model_busy meanwhile), then the model is dropped."""
    c = await make_client(tmp_path, tiny_model_dir)
    try:
        app = c.server.app
        host, scheduler = app[keys.HOST], app[keys.SCHEDULER]
        other = app[keys.CATALOGUE].register(
            name="tiny-b", format="safetensors", dtype="bfloat16", path=tiny_model_dir
        )
        slow = slow_resident(host, 0.3)
        drops = record_drops(host)
        gen = asyncio.ensure_future(c.post(CHAT, json=body("tiny", max_tokens=4)))
        await wait_until(lambda: slow.calls >= 1)
        swap = asyncio.ensure_future(c.post(f"/api/models/{other.id}/load"))
        await wait_until(lambda: scheduler.barrier_draining)
        assert not swap.done() and host.resident is not None and not drops
        resp = await c.post(CHAT, json=body("tiny"))
        err = (await resp.json())["error"]
        assert (resp.status, err["code"]) == (409, "model_busy"), err
        resp = await gen
        assert resp.status == 200, await resp.text()
        resp = await swap
        assert resp.status == 200, await resp.text()
        assert host.resident.row.name == "tiny-b"
        assert len(drops) == 1 and drops[0] >= slow.windows[-1][1], "dropped mid-generation"
        # and an unload waits the same way
        slow = slow_resident(host, 0.3)
        gen = asyncio.ensure_future(c.post(CHAT, json=body("tiny-b", max_tokens=4)))
        await wait_until(lambda: slow.calls >= 1)
        resp = await c.post(f"/api/models/{other.id}/unload")
        assert resp.status == 200, await resp.text()
        assert (await gen).status == 200
        assert len(drops) == 2 and drops[1] >= slow.windows[-1][1], "unloaded mid-generation"
        assert not scheduler.barrier_held and not scheduler.barrier_draining
    finally:
        await c.close()


async def test_an_unload_past_the_drain_timeout_is_refused_and_changes_nothing(
    tmp_path, tiny_model_dir
):
    """A generation that outlasts WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S: the unload is 409
    MODEL_BUSY drain_timeout, the model stays resident, the generation completes, requests
    are admitted again, and the unload succeeds once nothing runs."""
    c = await make_client(tmp_path, tiny_model_dir, WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S="0.2")
    try:
        app = c.server.app
        host, scheduler, runtime = app[keys.HOST], app[keys.SCHEDULER], app[keys.WEIGHTS]
        tiny = app[keys.CATALOGUE].get_by_name("tiny").id
        slow = slow_resident(host, 1.0)
        drops = record_drops(host)
        gen = asyncio.ensure_future(c.post(CHAT, json=body("tiny", max_tokens=2)))
        await wait_until(lambda: slow.calls >= 1)
        resp = await c.post(f"/api/models/{tiny}/unload")
        data = await resp.json()
        assert resp.status == 409, data
        assert (data["error"]["code"], data["error"]["reason"]) == ("MODEL_BUSY", "drain_timeout")
        assert "WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S" in data["error"]["message"]
        assert host.resident is not None and not drops
        assert runtime.lifecycle.state.transition == "none"
        assert not scheduler.barrier_held and not scheduler.barrier_draining
        assert (await gen).status == 200
        slow.delay = 0.0
        resp = await c.post(CHAT, json=body("tiny"))
        assert resp.status == 200, await resp.text()
        resp = await c.post(f"/api/models/{tiny}/unload")
        assert resp.status == 200, await resp.text()
        assert host.resident is None and len(drops) == 1
    finally:
        await c.close()


async def test_a_quiesce_and_an_unload_past_the_drain_timeout_answer_alike(
    tmp_path, tiny_model_dir
):
    """Both drain timeouts (weights page, The write cycle 2, and the drain before a model
    transition) say how many requests still ran, the timeout and what was left unchanged, and
    carry the numbers in ``details``."""
    c = await make_client(tmp_path, tiny_model_dir, WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S="0.2")
    try:
        app = c.server.app
        tiny = app[keys.CATALOGUE].get_by_name("tiny").id
        st, data, _ = await post(c, "/api/weights/attach", auth(TRN))  # exports the real model
        assert st == 200, data
        h = auth(TRN, data["data"]["attachment_id"])
        slow = slow_resident(app[keys.HOST], 1.0)
        errors = []
        for route in ("/api/weights/quiesce", f"/api/models/{tiny}/unload"):
            gen = asyncio.ensure_future(c.post(CHAT, json=body("tiny", max_tokens=2)))
            calls = slow.calls
            await wait_until(lambda calls=calls: slow.calls > calls)
            if route.startswith("/api/weights"):
                st, data, _ = await post(c, route, h)
            else:
                st, data, _ = await post(c, "/api/weights/detach", h)
                assert st == 200, data
                resp = await c.post(route)
                st, data = resp.status, await resp.json()
            assert st == 409, data
            errors.append(data["error"])
            assert (await gen).status == 200
        for err in errors:
            assert (err["code"], err["reason"]) == ("MODEL_BUSY", "drain_timeout")
            assert err["details"] == {"running": 1, "drain_timeout_s": 0.2}
            assert "1 running request(s) did not finish within " in err["message"]
            assert "WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S (0.2 s)" in err["message"]
        assert "nothing is held" in errors[0]["message"]
        assert "nothing was loaded or unloaded" in errors[1]["message"]
    finally:
        await c.close()
