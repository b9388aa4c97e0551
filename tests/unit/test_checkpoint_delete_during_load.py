"""A checkpoint row deleted, or its folder changed, while a weights load of it runs (contract 3:
409 MODEL_BUSY while a load, save or weights load runs; contract 5: 400 CHECKPOINT_CORRUPT
before anything is written). Finding N3 of the second adversarial trial of 2026-11-30: the
DELETE answered 200 during the load, the load then failed on the vanished folder after it had
marked the set writing, and the weights were left torn.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from miserver.http import keys
from miserver.serving.models import checkpoints
from tests.unit.test_weights_checkpoints_routes import attach, bump, commit
from tests.unit.test_weights_routes import OPS, auth, chat, make_client, post
from tests.waiting import eventually


@pytest.fixture
async def client(tmp_path, tiny_model_dir):
    c = await make_client(tmp_path, tiny_model_dir)
    yield c
    await c.close()


async def saved_then_trained(client) -> dict[str, Any]:
    """Save ``ck``, then one more commit (unsaved), detached: the load has work to do."""
    h = await attach(client)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "ck"})
    assert st == 200, body
    await commit(client, h, bump)
    assert (await post(client, "/api/weights/detach", h))[0] == 200
    return body["data"]


def status_of(client) -> Any:
    return client.get("/api/weights/status")


def norm_weight(client) -> torch.Tensor:
    return client.app[keys.HOST].resident.model.model.norm.weight.detach().clone()


class InJob:
    """Patches the checkpoint reader: the first read (the request's check, before the pause)
    runs as is; the read inside the pause's job first calls ``inside``."""

    def __init__(self, monkeypatch, inside) -> None:
        self.calls = 0
        self.inside = inside
        real = checkpoints._read_verified

        def read(handle: Any, keep: bool) -> Any:
            self.calls += 1
            if self.calls > 1:
                self.inside(handle)
            return real(handle, keep)

        monkeypatch.setattr(checkpoints, "_read_verified", read)


async def test_a_delete_while_a_weights_load_of_the_row_runs_is_409_and_the_load_completes(
    client, monkeypatch
):
    saved = await saved_then_trained(client)
    started, go = threading.Event(), threading.Event()

    def hold(_handle: Any) -> None:
        started.set()
        assert go.wait(30)

    InJob(monkeypatch, hold)
    load = asyncio.ensure_future(post(client, "/api/weights/load", auth(OPS), {"checkpoint": "ck"}))
    try:
        await eventually(started.is_set, "the load job started")
        resp = await client.delete(f"/api/models/{saved['model_id']}")
        body = await resp.json()
        assert resp.status == 409, body
        error = body["error"]
        assert (error["code"], error["reason"]) == ("MODEL_BUSY", "model_transition")
        assert "POST /api/weights/load" in error["message"]
        assert error["details"] == {"model_id": saved["model_id"], "pause_owner": "weights_load"}
    finally:
        go.set()
        st, body, _ = await load
    assert st == 200, body
    assert body["data"]["weights_state"] == "clean" and body["data"]["in_place"] is True
    assert Path(saved["path"]).is_dir()
    assert client.app[keys.CATALOGUE].get(saved["model_id"]) is not None
    assert (await chat(client, model="ck"))[0] == 200


async def test_a_checkpoint_changed_after_the_check_is_refused_with_nothing_written(
    client, monkeypatch
):
    saved = await saved_then_trained(client)
    before = norm_weight(client)

    def remove_tokenizer_config(handle: Any) -> None:
        (Path(handle.path) / "tokenizer_config.json").unlink()

    reads = InJob(monkeypatch, remove_tokenizer_config)
    st, body, _ = await post(client, "/api/weights/load", auth(OPS), {"checkpoint": "ck"})
    assert reads.calls == 2
    assert st == 400, body
    assert body["error"]["code"] == "CHECKPOINT_CORRUPT"
    assert body["error"]["details"] == {"path": saved["path"], "file": "tokenizer_config.json"}
    status = (await (await status_of(client)).json())["data"]
    assert status["weights_state"] == "clean" and status["barrier"] == "serving"
    assert status["steps_since_load"] == 1  # the commit after the save: still there
    assert torch.equal(norm_weight(client), before)
    st, _, headers = await chat(client)
    assert st == 200 and headers["X-miLLM-Model"] == '"ck";origin=checkpoint;commits=1'


async def test_a_checkpoint_replaced_after_the_check_is_refused_with_nothing_written(client):
    saved = await saved_then_trained(client)
    handle = checkpoints.open_checkpoint(saved["path"])
    manifest = Path(saved["path"]) / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b"}", b" }", 1))
    with pytest.raises(checkpoints.CheckpointCorrupt, match="changed after the load was checked"):
        checkpoints.reopen(handle)
    manifest.parent.rename(manifest.parent.with_name("moved"))
    with pytest.raises(checkpoints.CheckpointNotFound):
        checkpoints.reopen(handle)


async def test_a_delete_while_a_save_runs_is_409(client, monkeypatch):
    h = await attach(client)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "first"})
    assert st == 200, body
    first = body["data"]
    started, go = threading.Event(), threading.Event()
    real = checkpoints.save_checkpoint

    def held_save(*args: Any, **kwargs: Any) -> Any:
        started.set()
        assert go.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoints, "save_checkpoint", held_save)
    save = asyncio.ensure_future(post(client, "/api/weights/save", h, {"name": "second"}))
    try:
        await eventually(started.is_set, "the save job started")
        resp = await client.delete(f"/api/models/{first['model_id']}")
        body = await resp.json()
        assert resp.status == 409, body
        assert body["error"]["details"]["pause_owner"] == "save"
        assert "POST /api/weights/save" in body["error"]["message"]
    finally:
        go.set()
        st, body, _ = await save
    assert st == 200, body
    resp = await client.delete(f"/api/models/{first['model_id']}")  # after it: allowed
    assert resp.status == 200, await resp.text()


async def test_a_delete_while_the_load_checks_the_checkpoint_is_409(client, monkeypatch):
    """Before its pause a weights load checks the checkpoint off the event loop (seconds for a
    large model): a DELETE then is refused as during the pause (third adversarial trial J4: it
    removed the checkpoint, and the load answered 404)."""
    saved = await saved_then_trained(client)
    started, go = threading.Event(), threading.Event()
    real = checkpoints._read_verified

    def read(handle: Any, keep: bool) -> Any:
        if not started.is_set():  # the request's check
            started.set()
            assert go.wait(30)
        return real(handle, keep)

    monkeypatch.setattr(checkpoints, "_read_verified", read)
    load = asyncio.ensure_future(post(client, "/api/weights/load", auth(OPS), {"checkpoint": "ck"}))
    try:
        await eventually(started.is_set, "the load job started")
        assert client.app[keys.WEIGHTS].lifecycle.state.owner != "weights_load"  # not paused yet
        resp = await client.delete(f"/api/models/{saved['model_id']}")
        body = await resp.json()
        assert resp.status == 409, body
        assert body["error"]["details"] == {
            "model_id": saved["model_id"],
            "pause_owner": "weights_load",
        }
    finally:
        go.set()
        st, body, _ = await load
    assert st == 200, body
    assert Path(saved["path"]).is_dir()
    assert client.app[keys.WEIGHTS].loads_checking == 0
