"""Deleting the checkpoint row that holds the resident weights' last save (contract 3, 5; the
weights page: Unsaved commits and the auto-load, Status ``last_save``). Finding N2 of the second
adversarial trial of 2026-11-30: the DELETE answered 200 and removed the folder, the only copy
of the saved commits; unsaved stayed 0, so the next /v1 auto-load discarded them unrefused.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miserver.http import keys
from tests.unit.test_weights_checkpoints_routes import attach, bump, commit
from tests.unit.test_weights_routes import OPS, auth, chat, make_client, post


@pytest.fixture
async def client(tmp_path, tiny_model_dir):
    c = await make_client(tmp_path, tiny_model_dir)
    c.app[keys.CATALOGUE].register(
        name="tiny-b", format="safetensors", dtype="bfloat16", path=tiny_model_dir
    )
    yield c
    await c.close()


async def save(client, h, name: str) -> dict:
    st, body, _ = await post(client, "/api/weights/save", h, {"name": name})
    assert st == 200, body
    return body["data"]


async def delete(client, row_id: int) -> tuple[int, dict]:
    resp = await client.delete(f"/api/models/{row_id}")
    return resp.status, await resp.json()


async def test_the_last_saves_row_is_409_until_the_weights_are_unloaded(client):
    h = await attach(client)
    await commit(client, h, bump)
    saved = await save(client, h, "ckB")
    assert (await post(client, "/api/weights/detach", h))[0] == 200

    st, body = await delete(client, saved["model_id"])
    assert st == 409, body
    error = body["error"]
    assert error["code"] == "MODEL_RESIDENT"
    assert "last save of the resident weights" in error["message"]
    assert "the only copy of the 1 commit(s) that save recorded" in error["message"]
    assert "POST /api/weights/save" in error["message"]
    assert "POST /api/models/1/unload" in error["message"]
    assert error["details"] == {
        "model_id": saved["model_id"],
        "resident_model_id": 1,
        "commits": 1,
        "last_save": {"path": saved["path"], "at": saved["at"]},
    }
    assert Path(saved["path"]).is_dir()
    assert client.app[keys.CATALOGUE].get(saved["model_id"]) is not None
    st, _, headers = await chat(client, model="ckB")
    assert st == 200 and headers["X-miLLM-Model"] == '"ckB";origin=checkpoint;commits=0'

    # Once the weights are unloaded the row is an ordinary checkpoint row: deleted with its
    # folder (4890e1a).
    assert (await post(client, "/api/models/1/unload"))[0] == 200
    st, body = await delete(client, saved["model_id"])
    assert st == 200, body
    assert not Path(saved["path"]).exists()


async def test_a_commit_after_the_save_still_keeps_the_row(client):
    h = await attach(client)
    await commit(client, h, bump)
    saved = await save(client, h, "ckB")
    await commit(client, h, bump)  # unsaved 1: the commit before the save exists only in ckB
    st, body = await delete(client, saved["model_id"])
    assert (st, body["error"]["code"]) == (409, "MODEL_RESIDENT")
    assert Path(saved["path"]).is_dir()


async def test_an_earlier_save_is_deleted_with_its_folder(client):
    h = await attach(client)
    first = await save(client, h, "ck1")
    await commit(client, h, bump)
    await save(client, h, "ck2")
    st, body = await delete(client, first["model_id"])
    assert st == 200, body
    assert not Path(first["path"]).exists()


async def test_a_save_that_recorded_no_commit_is_deleted_with_its_folder(client):
    # A copy of the loaded row's weights (which stays): finding 15's delete-and-save-again.
    h = await attach(client)
    saved = await save(client, h, "ckB")
    assert saved["steps_since_load"] == 0
    st, body = await delete(client, saved["model_id"])
    assert st == 200, body
    assert not Path(saved["path"]).exists()
    await commit(client, h, bump)
    assert (await save(client, h, "ckB"))["path"] == saved["path"]


async def test_after_a_swap_the_saved_row_is_deleted_with_its_folder(client):
    h = await attach(client)
    await commit(client, h, bump)
    saved = await save(client, h, "ckB")
    assert (await post(client, "/api/weights/detach", h))[0] == 200
    assert (await chat(client, model="tiny-b"))[0] == 200  # the auto-load: saved, so allowed
    st, body = await delete(client, saved["model_id"])
    assert st == 200, body
    assert not Path(saved["path"]).exists()


async def test_after_an_in_place_load_of_another_checkpoint_the_last_save_is_deletable(client):
    h = await attach(client)
    older = await save(client, h, "ck-a")
    await commit(client, h, bump)
    newer = await save(client, h, "ck-b")
    st, body, _ = await post(client, "/api/weights/load", auth(OPS), {"checkpoint": "ck-a"})
    assert st == 200 and body["data"]["in_place"] is True, body
    st, body = await delete(client, newer["model_id"])  # the weights are ck-a's now
    assert st == 200, body
    assert not Path(newer["path"]).exists()
    st, body = await delete(client, older["model_id"])  # resident
    assert (st, body["error"]["code"]) == (409, "MODEL_RESIDENT")
