"""Which names reach which weights (weights page: Which weights answered; contract 5 and 6):
findings N1, N4 and N7 of the second adversarial trial of 2026-11-30, each a test that failed on
the code before its fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miserver.http import keys
from miserver.serving.models import checkpoints
from tests.unit.test_weights_adapter_requests import apply, header, remove, status
from tests.unit.test_weights_checkpoints_routes import attach, bump, commit, make_adapter, scores
from tests.unit.test_weights_routes import OPS, auth, make_client, post


@pytest.fixture
async def client(tmp_path, tiny_model_dir):
    c = await make_client(tmp_path, tiny_model_dir)
    yield c
    await c.close()


@pytest.fixture(scope="module")
def lora(tiny_model_dir, tmp_path_factory) -> Path:
    """A LoRA adapter (q_proj, v_proj) for the tiny model."""
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "lora")


# --- N7: a catalogue row may not take the applied adapter's name --------------------------------
async def test_registering_a_row_named_as_the_applied_adapter_is_400(client, lora, tiny_model_dir):
    assert (await apply(client, "tiny-lora", lora))[0] == 200
    before = [r.id for r in client.app[keys.CATALOGUE].list()]
    resp = await client.post("/api/models", json={"name": "tiny-lora", "path": str(tiny_model_dir)})
    body = await resp.json()
    assert resp.status == 400, body
    assert body["error"]["code"] == "INVALID_REQUEST"
    assert body["error"]["details"] == {"field": "name", "adapter": "tiny-lora"}
    assert "DELETE /api/weights/adapter" in body["error"]["message"]
    assert [r.id for r in client.app[keys.CATALOGUE].list()] == before  # nothing registered
    assert await header(client, "tiny-lora") == '"tiny-lora";origin=adapter;commits=0'
    # Once the adapter is removed the name is free.
    assert (await remove(client))[0] == 200
    resp = await client.post("/api/models", json={"name": "tiny-lora", "path": str(tiny_model_dir)})
    assert resp.status == 201, await resp.json()


# --- N4: a checkpoint row loaded through the catalogue is origin=checkpoint ----------------------
async def saved_checkpoint(client, name: str = "ck") -> int:
    """Save the resident as checkpoint ``name`` (detached afterwards); its row id."""
    h = await attach(client)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": name})
    assert st == 200, body
    assert (await post(client, "/api/weights/detach", h))[0] == 200
    return body["data"]["model_id"]


async def test_a_checkpoint_row_loaded_through_the_catalogue_is_origin_checkpoint(client):
    ck = await saved_checkpoint(client)
    tiny = client.app[keys.CATALOGUE].get_by_name("tiny").id
    assert (await post(client, f"/api/models/{tiny}/unload"))[0] == 200
    st, body, _ = await post(client, f"/api/models/{ck}/load")
    assert st == 200, body
    assert await header(client, "ck") == '"ck";origin=checkpoint;commits=0'
    assert client.app[keys.HOST].resident.origin == "checkpoint"
    assert (await post(client, f"/api/models/{ck}/unload"))[0] == 200
    assert await header(client, "ck") == '"ck";origin=checkpoint;commits=0'  # a /v1 auto-load
    assert (await post(client, f"/api/models/{tiny}/load"))[0] == 200
    assert await header(client) == '"tiny";origin=model;commits=0'


# --- N1: a save while an adapter is applied ------------------------------------------------------
# Contract 6: while an adapter is applied, X-miLLM-Model says origin=adapter under the adapter's
# name. The save stores the base tensors (never the LoRA tensors), so the checkpoint's name names
# the set served only once the adapter is gone.
async def test_a_save_under_an_adapter_keeps_serving_as_the_adapter(client, lora):
    base = await scores(client)
    assert (await apply(client, "good", lora))[0] == 200
    adapted = await scores(client, "good")
    assert adapted != base
    h = await attach(client)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "ck2"})
    assert st == 200, body
    assert (await post(client, "/api/weights/detach", h))[0] == 200

    assert await header(client) == '"good";origin=adapter;commits=0'
    assert (await status(client))["adapter"]["name"] == "good"
    assert await scores(client, "good") == adapted
    # The checkpoint's name reaches the resident (contract 5), which still computes the adapter
    # and says so.
    assert await header(client, "ck2") == '"good";origin=adapter;commits=0'
    handle = checkpoints.open_checkpoint(body["data"]["path"])
    assert not [n for n in handle.manifest.names() if "lora" in n]  # the base tensors only

    st, body, _ = await post(client, "/api/weights/load", auth(OPS), {"checkpoint": "ck2"})
    assert st == 200 and body["data"]["in_place"] is True, body
    assert await header(client, "ck2") == '"ck2";origin=checkpoint;commits=0'
    assert await scores(client, "ck2") == base  # exactly what the header names
    assert (await status(client))["adapter"] == {"applied": False}


async def test_commits_under_an_adapter_after_a_save_count_from_the_save(client, lora):
    assert (await apply(client, "good", lora))[0] == 200
    h = await attach(client)
    await commit(client, h, bump)
    assert (await post(client, "/api/weights/save", h, {"name": "ck"}))[0] == 200
    assert await header(client, "good") == '"good";origin=adapter;commits=1'  # the name stays
    await commit(client, h, bump)
    assert (await post(client, "/api/weights/detach", h))[0] == 200
    assert await header(client, "good") == '"good";origin=adapter;commits=2'
    assert (await remove(client))[0] == 200
    assert await header(client, "ck") == '"ck";origin=checkpoint;commits=1'  # 1 since the save


async def test_a_checkpoint_saved_before_an_adapter_reaches_the_resident(client, lora):
    ck = await saved_checkpoint(client, "ck")
    assert (await apply(client, "good", lora))[0] == 200
    resident = client.app[keys.HOST].resident
    # No auto-load of the ck row (a swap that would drop the adapter): the resident's base
    # tensors are that checkpoint, served through the adapter, as its base name is.
    assert await header(client, "ck") == '"good";origin=adapter;commits=0'
    assert client.app[keys.HOST].resident is resident and resident.row.id != ck
    assert (await remove(client))[0] == 200
    assert await header(client, "ck") == '"ck";origin=checkpoint;commits=0'


# --- third adversarial trial: J2 (a save named as the applied adapter), J1 (DEFAULT_MODEL's row)
async def test_a_save_named_as_the_applied_adapter_is_400(client, lora):
    assert (await apply(client, "tiny-lora", lora))[0] == 200
    h = await attach(client)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "tiny-lora"})
    assert st == 400, body
    assert body["error"]["details"] == {"field": "name", "adapter": "tiny-lora"}
    assert client.app[keys.CATALOGUE].get_by_name("tiny-lora") is None  # nothing saved
    assert await header(client, "tiny-lora") == '"tiny-lora";origin=adapter;commits=0'


async def test_the_default_models_row_is_not_deleted(client):
    tiny = client.app[keys.CATALOGUE].get_by_name("tiny")
    assert (await client.post(f"/api/models/{tiny.id}/unload")).status == 200
    resp = await client.delete(f"/api/models/{tiny.id}")
    body = await resp.json()
    assert resp.status == 409, body
    assert body["error"]["code"] == "MODEL_RESIDENT"
    assert body["error"]["details"] == {"model_id": tiny.id, "setting": "DEFAULT_MODEL"}
    assert client.app[keys.CATALOGUE].get(tiny.id) is not None
