"""Issue 16, item 6: an unload that cannot succeed is refused before it drains anything, and the
opt-in MANAGEMENT_AUTH=operator puts every mutating management and batch route behind an
operator token, checked and audited as the weights routes are. The default stays open."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from miserver.http import keys
from miserver.serving.engine.slot import Priority
from miserver.spec.settings import ConfigError, load_settings
from tests.unit.model_free_app import model_free_client, model_free_settings
from tests.unit.test_weights_routes import make_client

TRN = "trainer-secret-0123456789"
OPS = "operator-secret-0123456789"
TOKENS = f"trn:trainer:{TRN},ops:operator:{OPS}"

ROUTES = [
    ("POST", "/api/models", {"name": "m", "path": "/nowhere"}, "model_register"),
    ("DELETE", "/api/models/999", None, "model_delete"),
    ("POST", "/api/models/999/load", None, "model_load"),
    ("POST", "/api/models/999/unload", None, "model_unload"),
    ("PATCH", "/api/settings", {"max_concurrent_requests": 4}, "settings_change"),
    ("POST", "/v1/files", None, "file_upload"),
    ("DELETE", "/v1/files/file-nope", None, "file_delete"),
    ("POST", "/v1/batches", {"input_file_id": "file-nope"}, "batch_create"),
    ("POST", "/v1/batches/batch_nope/cancel", None, "batch_cancel"),
    # breaker finding F4: an adapter change changes what every client is served
    ("POST", "/api/weights/adapter", {"name": "a", "path": "/nowhere"}, "adapter"),
    ("DELETE", "/api/weights/adapter", None, "adapter"),
]


async def _audit(tmp_path) -> list[dict]:
    await asyncio.sleep(0.05)
    path = tmp_path / "audit.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
async def guarded(tmp_path):
    c = await model_free_client(
        model_free_settings(
            tmp_path,
            TOKENS,
            MANAGEMENT_AUTH="operator",
            WEIGHTS_AUDIT_LOG=str(tmp_path / "audit.jsonl"),
        )
    )
    yield c
    await c.close()


@pytest.mark.parametrize(("method", "path", "body", "operation"), ROUTES)
async def test_operator_mode_guards_and_audits_each_mutating_route(
    guarded, tmp_path, method, path, body, operation
) -> None:
    before = (await (await guarded.get("/api/settings")).json())["data"]
    for headers, status, code in (
        ({}, 401, "WEIGHTS_UNAUTHORIZED"),
        ({"Authorization": "Bearer not-a-configured-token-00"}, 401, "WEIGHTS_UNAUTHORIZED"),
        ({"Authorization": f"Bearer {TRN}"}, 403, "WEIGHTS_FORBIDDEN"),
    ):
        resp = await guarded.request(method, path, json=body, headers=headers)
        text = await resp.text()
        assert resp.status == status, text
        err = json.loads(text)["error"]
        assert err["code"].upper() == code
        if status == 401:
            assert resp.headers["WWW-Authenticate"] == "Bearer"
        assert TRN not in text and OPS not in text
    resp = await guarded.request(
        method, path, json=body, headers={"Authorization": f"Bearer {OPS}"}
    )
    assert resp.status not in (401, 403), await resp.text()  # the route's own answer
    lines = [x for x in await _audit(tmp_path) if x["operation"] == operation]
    assert [(x["outcome"], x["code"], x["role"]) for x in lines[:3]] == [
        ("refused", "WEIGHTS_UNAUTHORIZED", None),
        ("refused", "WEIGHTS_UNAUTHORIZED", None),
        ("refused", "WEIGHTS_FORBIDDEN", "trainer"),
    ]
    assert len(lines) == 4 and lines[3]["role"] == "operator" and lines[3]["label"] == "ops"
    after = (await (await guarded.get("/api/settings")).json())["data"]
    if operation != "settings_change":
        assert after == before
    else:
        assert after["max_concurrent_requests"] == 4  # only the operator's call changed it


async def test_operator_mode_leaves_reads_and_inference_open(guarded) -> None:
    for path in ("/api/models", "/api/settings", "/api/health", "/v1/models"):
        resp = await guarded.get(path)
        assert resp.status == 200, (path, await resp.text())


BATCH_READS = [
    ("/v1/files", "file_read"),
    ("/v1/files/{file}", "file_read"),
    ("/v1/files/{file}/content", "file_read"),
    ("/v1/batches", "batch_read"),
    ("/v1/batches/{batch}", "batch_read"),
]


@pytest.mark.parametrize(("template", "operation"), BATCH_READS)
async def test_operator_mode_guards_every_batch_read(
    guarded, tmp_path, template, operation
) -> None:
    """Issue 32, item 9: with MANAGEMENT_AUTH=operator nobody but an operator reads the Batch
    API's files (an operator's prompts, the model's completions) or lists the jobs."""
    ops = {"Authorization": f"Bearer {OPS}"}
    line = b'{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": '
    line += b'{"model": "m", "messages": [{"role": "user", "content": "secret prompt"}]}}\n'
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", line, filename="in.jsonl", content_type="application/jsonl")
    resp = await guarded.post("/v1/files", data=form, headers=ops)
    assert resp.status == 200, await resp.text()
    file_id = (await resp.json())["id"]
    resp = await guarded.post(
        "/v1/batches",
        json={
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
        headers=ops,
    )
    assert resp.status == 200, await resp.text()
    batch_id = (await resp.json())["id"]
    path = template.format(file=file_id, batch=batch_id)
    for headers, status, code in (
        ({}, 401, "WEIGHTS_UNAUTHORIZED"),
        ({"Authorization": "Bearer not-a-configured-token-00"}, 401, "WEIGHTS_UNAUTHORIZED"),
        ({"Authorization": f"Bearer {TRN}"}, 403, "WEIGHTS_FORBIDDEN"),
    ):
        resp = await guarded.get(path, headers=headers)
        text = await resp.text()
        assert resp.status == status, (path, text)
        assert json.loads(text)["error"]["code"].upper() == code
        assert "secret prompt" not in text and file_id not in text
    resp = await guarded.get(path, headers=ops)
    assert resp.status == 200, (path, await resp.text())
    lines = [x for x in await _audit(tmp_path) if x["operation"] == operation]
    assert [(x["outcome"], x["code"]) for x in lines] == [
        ("refused", "WEIGHTS_UNAUTHORIZED"),
        ("refused", "WEIGHTS_UNAUTHORIZED"),
        ("refused", "WEIGHTS_FORBIDDEN"),
    ]  # an accepted read is not audited (clients poll)


async def test_batch_reads_stay_open_in_the_default_mode(tmp_path) -> None:
    c = await model_free_client(model_free_settings(tmp_path, TOKENS))
    try:
        for path in ("/v1/files", "/v1/batches"):
            resp = await c.get(path)
            assert resp.status == 200, (path, await resp.text())
    finally:
        await c.close()


async def test_the_default_stays_open(tmp_path) -> None:
    c = await model_free_client(model_free_settings(tmp_path, TOKENS))
    try:
        resp = await c.patch("/api/settings", json={"max_queued_requests": 7})
        assert resp.status == 200, await resp.text()
    finally:
        await c.close()


async def test_adapter_changes_are_audited_in_the_default_mode_too(tmp_path) -> None:
    """Breaker finding F4: adapter changes are among the weights page's audit operations."""
    c = await model_free_client(
        model_free_settings(tmp_path, TOKENS, WEIGHTS_AUDIT_LOG=str(tmp_path / "audit.jsonl"))
    )
    try:
        resp = await c.delete("/api/weights/adapter", headers={"Authorization": f"Bearer {OPS}"})
        assert resp.status == 400, await resp.text()  # nothing is resident
        resp = await c.post("/api/weights/adapter", json={"name": "a", "path": "relative"})
        assert resp.status == 400, await resp.text()
    finally:
        await c.close()
    lines = [x for x in await _audit(tmp_path) if x["operation"] == "adapter"]
    assert [(x["outcome"], x["code"], x["role"], x["label"]) for x in lines] == [
        ("refused", "MODEL_NOT_LOADED", "operator", "ops"),
        ("refused", "INVALID_REQUEST", None, None),
    ]


def test_operator_mode_needs_an_operator_token(tmp_path) -> None:
    env = {"MISERVER_HOME": str(tmp_path), "MANAGEMENT_AUTH": "operator"}
    with pytest.raises(ConfigError) as exc:
        load_settings({**env, "WEIGHTS_TOKENS": f"trn:trainer:{TRN}"})
    assert exc.value.variable == "MANAGEMENT_AUTH" and TRN not in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        load_settings({**env, "MANAGEMENT_AUTH": "admin"})
    assert exc.value.variable == "MANAGEMENT_AUTH"


async def test_an_unload_of_a_row_not_resident_is_refused_before_any_drain(
    tmp_path, tiny_model_dir
) -> None:
    c = await make_client(tmp_path, tiny_model_dir, WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S="5")
    try:
        app = c.server.app
        other = app[keys.CATALOGUE].register(
            name="tiny-b", format="safetensors", dtype="bfloat16", path=tiny_model_dir
        )
        scheduler = app[keys.SCHEDULER]
        await scheduler.acquire(Priority.INTERACTIVE)  # a generation is running
        try:
            started = time.monotonic()
            resp = await c.post(f"/api/models/{other.id}/unload")
            elapsed = time.monotonic() - started
            body = await resp.json()
            assert resp.status == 409 and body["error"]["code"] == "MODEL_NOT_LOADED", body
            assert elapsed < 2.0, f"it drained for {elapsed:.1f} s first"
            assert not scheduler.barrier_held and not scheduler.barrier_draining
        finally:
            scheduler.release()
        assert app[keys.HOST].resident is not None  # nothing changed
    finally:
        await c.close()
