"""Which names reach which weights (weights page: Which weights answered; contract 5 and 6):
findings N1, N4 and N7 of the second adversarial trial of 2026-11-30, each a test that failed on
the code before its fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miserver.http import keys
from tests.unit.test_weights_adapter_requests import apply, header, remove
from tests.unit.test_weights_checkpoints_routes import attach, make_adapter
from tests.unit.test_weights_routes import make_client, post


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
