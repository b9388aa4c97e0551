"""Weights load and save requests over HTTP: ids no row can have, and a deleted checkpoint's
name (contract 3, 5). Findings 2 and 15 of the adversarial trial of 2026-11-30.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miserver.http import keys
from tests.unit.test_weights_checkpoints_routes import attach, bump, commit
from tests.unit.test_weights_routes import OPS, TRN, auth, make_client, post


@pytest.fixture
async def client(tmp_path, tiny_model_dir):
    c = await make_client(tmp_path, tiny_model_dir)
    yield c
    await c.close()


# --- finding 2: a model id beyond SQLite's range ------------------------------------------------
@pytest.mark.parametrize("model_id", [2**70, 2**63, -1, 0])
async def test_a_load_of_an_id_no_row_can_have_is_404_like_the_models_route(client, model_id):
    st, body, _ = await post(client, "/api/weights/load", auth(OPS), {"model_id": model_id})
    assert st == 404, body
    assert body["error"]["code"] == "MODEL_NOT_FOUND"
    assert body["error"]["details"] == {"model_id": model_id}
    resp = await client.get(f"/api/models/{model_id}")
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "MODEL_NOT_FOUND"


# --- finding 15: a deleted checkpoint's name ----------------------------------------------------
async def test_a_deleted_checkpoints_name_can_be_saved_again(client):
    h = await attach(
        client,
    )
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "ck"})
    assert st == 200, body
    first = body["data"]
    assert Path(first["path"]).is_dir()
    resp = await client.delete(f"/api/models/{first['model_id']}")
    assert resp.status == 200, await resp.text()
    assert not Path(first["path"]).exists()
    st, body, _ = await post(client, "/api/weights/load", auth(OPS), {"checkpoint": "ck"})
    assert (st, body["error"]["code"]) == (404, "CHECKPOINT_NOT_FOUND")
    await commit(client, h, bump)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "ck"})
    assert st == 200, body
    assert body["data"]["path"] == first["path"]
    assert body["data"]["checkpoint_sha256"] != first["checkpoint_sha256"]


async def test_a_folder_no_row_names_is_a_409_that_says_what_to_do(client):
    folder = Path(client.app[keys.SETTINGS].home) / "checkpoints" / "orphan"
    folder.mkdir(parents=True)
    h = await attach(client)
    assert (await post(client, "/api/weights/quiesce", h))[0] == 200
    assert (await post(client, "/api/weights/commit-begin", h))[0] == 200
    # Answered before the pause: a commit is open, which the table would refuse with 409
    # WEIGHTS_NOT_CLEAN.
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "orphan"})
    assert st == 409, body
    error = body["error"]
    assert error["code"] == "CHECKPOINT_EXISTS"
    assert "no catalogue row names it" in error["message"]
    assert "choose another name, or move or remove that folder" in error["message"]
    assert error["details"] == {"name": "orphan", "path": str(folder)}
    assert (await post(client, "/api/weights/commit-end", h))[0] == 200


async def test_a_name_a_row_holds_is_a_409_naming_the_row(client):
    h = await attach(client)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "tiny"})
    assert st == 409, body
    assert body["error"]["details"] == {"name": "tiny", "model_id": 1}
    assert "DELETE /api/models/1" in body["error"]["message"]
    assert TRN not in json.dumps(body)
