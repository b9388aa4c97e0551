"""Error messages say what happened and what to do (findings 13 and 14).

Each test pins the part of a message a user acts on, not its whole wording.
"""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from miserver.http import keys
from miserver.http.app import create_app
from miserver.serving.models.catalogue import Catalogue
from miserver.spec.settings import load_settings

TRN = "trainer-secret-0123456789"


async def make_client(tmp_path, default_model: str = "", model_dir: str | None = None):
    home = tmp_path / "home"
    if model_dir is not None:
        Catalogue(str(home)).register(
            name="tiny", format="safetensors", dtype="bfloat16", path=model_dir
        )
    settings = load_settings(
        {
            "MISERVER_HOME": str(home),
            "DEFAULT_MODEL": default_model,
            "DEVICE": "cpu",
            "WEIGHTS_TOKENS": f"trn:trainer:{TRN}",
            "WEIGHTS_CPU_ATTACH": "1",
        }
    )
    app = create_app(settings)
    client = TestClient(TestServer(app))
    await client.start_server()
    await app[keys.STARTUP_LOAD]
    return client


@pytest.fixture
async def client(tmp_path):
    c = await make_client(tmp_path)
    yield c
    await c.close()


# attach, quiesce (contract 4b) and commit-begin take a body (contract 10): their unknown
# fields name the allowed ones
@pytest.mark.parametrize("route", ["detach", "resume", "heartbeat", "commit-end"])
async def test_an_unknown_field_on_a_route_without_a_body_says_it_takes_none(client, route) -> None:
    resp = await client.post(
        f"/api/weights/{route}", json={"foo": 1}, headers={"Authorization": f"Bearer {TRN}"}
    )
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["code"] == "INVALID_REQUEST" and error["details"] == {"field": "foo"}
    assert "this route takes no body" in error["message"]
    assert "allowed fields" not in error["message"]


async def test_an_unknown_field_on_a_route_with_fields_still_lists_them(client) -> None:
    resp = await client.post(
        "/api/weights/save", json={"nam": "x"}, headers={"Authorization": f"Bearer {TRN}"}
    )
    assert resp.status == 400
    assert "allowed fields: name" in (await resp.json())["error"]["message"]


@pytest.mark.parametrize(("raw", "what"), [("-1", "is not a row id"), ("abc", "is not a row id")])
async def test_a_row_id_that_is_not_one_says_what_an_id_is(client, raw, what) -> None:
    resp = await client.get(f"/api/models/{raw}")
    assert resp.status == 404
    error = (await resp.json())["error"]
    assert error["code"] == "MODEL_NOT_FOUND"
    assert what in error["message"] and "a row id is a positive integer" in error["message"]
    assert "ids are integers" not in error["message"]  # -1 is an integer: the old wording


async def test_a_settings_change_while_the_barrier_is_held_says_so(
    tmp_path, tiny_model_dir
) -> None:
    client = await make_client(tmp_path, "tiny", tiny_model_dir)
    try:
        auth = {"Authorization": f"Bearer {TRN}"}
        resp = await client.post("/api/weights/attach", headers=auth)
        assert resp.status == 200
        auth["X-miLLM-Attachment"] = (await resp.json())["data"]["attachment_id"]
        assert (await client.post("/api/weights/quiesce", headers=auth)).status == 200
        resp = await client.patch("/api/settings", json={"max_queued_requests": 8})
        assert resp.status == 409
        error = (await resp.json())["error"]
        assert error["code"] == "MODEL_BUSY"
        assert "barrier is held by the attached trainer's quiesce" in error["message"]
        assert "barrier: serving" in error["message"]  # what to wait for
        assert error["details"] == {
            "barrier": "quiesced",
            "pause_owner": "holder",
            "weights_state": "clean",
        }
        assert (await client.post("/api/weights/commit-begin", headers=auth)).status == 200
        resp = await client.patch("/api/settings", json={"max_queued_requests": 8})
        error = (await resp.json())["error"]
        assert resp.status == 409 and "weights are being written" in error["message"]
        assert error["details"]["weights_state"] == "writing"
        assert (await client.post("/api/weights/commit-end", headers=auth)).status == 200
        assert (await client.post("/api/weights/resume", headers=auth)).status == 200
        resp = await client.patch("/api/settings", json={"max_queued_requests": 8})
        assert resp.status == 200 and (await resp.json())["data"]["max_queued_requests"] == 8
    finally:
        await client.close()
