"""A public name or listed field that CONTAINS a configured token is refused (issue 16, item 5):
names go out in X-miLLM-Model, /v1/models and GET /api/weights/status; the batch and file lists
are unauthenticated. The refusal never repeats the token. No model is resident."""

from __future__ import annotations

import json

import aiohttp
import pytest

from tests.unit.model_free_app import model_free_client, model_free_settings

TRN = "trainer-secret-0123456789"
OPS = "operator-secret-0123456789"
AUTH = {"Authorization": f"Bearer {OPS}"}


@pytest.fixture
async def client(tmp_path):
    c = await model_free_client(
        model_free_settings(tmp_path, f"trn:trainer:{TRN},ops:operator:{OPS}")
    )
    yield c
    await c.close()


def refused(text: str) -> dict:
    assert TRN not in text and OPS not in text
    return json.loads(text)["error"]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/weights/save", {"name": f"x-{TRN}"}, "name"),
        ("/api/weights/save", {"name": f"{OPS}-step3"}, "name"),
        ("/api/weights/adapter", {"name": f"lora-{OPS}-v2", "path": "/nowhere"}, "name"),
        ("/api/weights/adapter", {"name": "lora", "path": f"/data/{TRN}/lora"}, "path"),
        ("/api/models", {"name": f"m.{TRN}", "path": "/nowhere"}, "name"),
        ("/api/models", {"name": "m", "path": f"/models/{OPS}"}, "path"),
    ],
)
async def test_a_name_containing_a_token_is_refused(client, path, body, field) -> None:
    resp = await client.post(path, headers=AUTH, json=body)
    text = await resp.text()
    assert resp.status == 400, text
    err = refused(text)
    assert err["code"] == "INVALID_REQUEST" and err["details"] == {"field": field}


async def test_a_batch_whose_metadata_contains_a_token_is_refused_and_not_listed(client) -> None:
    line = {
        "custom_id": "r1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", json.dumps(line) + "\n", filename="rows.jsonl")
    resp = await client.post("/v1/files", data=form)
    assert resp.status == 200, await resp.text()
    file_id = (await resp.json())["id"]
    for metadata in ({"run": f"nightly {TRN}"}, {f"k{OPS}": "v"}, {"a": "fine", "b": OPS}):
        resp = await client.post(
            "/v1/batches",
            json={
                "input_file_id": file_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "metadata": metadata,
            },
        )
        text = await resp.text()
        assert resp.status == 400, text
        assert TRN not in text and OPS not in text
        assert json.loads(text)["error"]["param"] == "metadata"
    listing = await (await client.get("/v1/batches")).text()
    assert json.loads(listing)["data"] == []


async def test_an_uploaded_file_named_with_a_token_is_refused_and_not_listed(client) -> None:
    line = {
        "custom_id": "r1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", json.dumps(line) + "\n", filename=f"rows-{TRN}.jsonl")
    resp = await client.post("/v1/files", data=form)
    text = await resp.text()
    assert resp.status == 400, text
    assert TRN not in text and json.loads(text)["error"]["param"] == "filename"
    listing = await (await client.get("/v1/files")).text()
    assert TRN not in listing and json.loads(listing)["data"] == []
