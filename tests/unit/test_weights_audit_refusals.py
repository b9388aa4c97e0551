"""Every gated call writes exactly one weights_audit line, also when it is refused before the
lifecycle sees it (finding 6; weights page, Routes: "Every gated call writes one weights_audit
log line, accepted or refused").

Refusals of this kind: a body that does not decode (400), one over MAX_REQUEST_BYTES (413, by
Content-Length before the body is read or while a chunked body is read), a checkpoint or row that
does not exist (404), a save name that is taken (409), and a failure of ours (500). No model is
resident: none of these needs one, so the app starts in well under a second.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from miserver.serving.models.catalogue import Catalogue
from tests.unit.model_free_app import model_free_client, model_free_settings

TRN = "trainer-secret-0123456789"
OPS = "operator-secret-0123456789"
MAX_BYTES = 4096


@pytest.fixture
async def client(tmp_path):
    settings = model_free_settings(
        tmp_path,
        f"trn:trainer:{TRN},ops:operator:{OPS}",
        WEIGHTS_AUDIT_LOG=str(tmp_path / "audit.jsonl"),
        MAX_REQUEST_BYTES=str(MAX_BYTES),
    )
    Catalogue(str(settings.home)).register(
        name="taken", format="safetensors", dtype="bfloat16", path=str(tmp_path)
    )
    c = await model_free_client(settings)
    yield c
    await c.close()


async def audit_lines(tmp_path) -> list[dict]:
    await asyncio.sleep(0.01)  # lines are written on the loop's next turn, after the answer
    path = tmp_path / "audit.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines()]


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def call(client, path: str, secret: str = TRN, **kw) -> tuple[int, dict]:
    resp = await client.post(path, headers={**bearer(secret), **kw.pop("headers", {})}, **kw)
    return resp.status, await resp.json()


def refused(line: dict, operation: str, code: str, *, role: str = "trainer") -> None:
    expected = {
        "event": "weights_audit",
        "operation": operation,
        "outcome": "refused",
        "code": code,
        "role": role,
        "label": {"trainer": "trn", "operator": "ops"}.get(role),
        "attachment_ref": None,
        "model": None,
        "weights_state": "clean",
        "weights_state_before": "clean",
        "elapsed_ms": None,
        "steps": None,
    }
    assert {k: line[k] for k in expected} == expected, line
    assert line["ts"].endswith("Z")


@pytest.mark.parametrize(
    ("route", "operation"),
    [
        ("attach", "weights_attach"),
        ("detach", "weights_detach"),
        ("heartbeat", "weights_heartbeat"),
        ("quiesce", "weights_quiesce"),
        ("resume", "weights_resume"),
        ("commit-begin", "weights_commit_begin"),
        ("commit-end", "weights_commit_end"),
    ],
)
async def test_a_barrier_call_with_a_bad_body_writes_one_refused_line(
    client, tmp_path, route, operation
) -> None:
    status, body = await call(client, f"/api/weights/{route}", json={"foo": 1})
    assert status == 400 and body["error"]["code"] == "INVALID_REQUEST"
    status, body = await call(client, f"/api/weights/{route}", data=b"{not json")
    assert status == 400 and body["error"]["code"] == "INVALID_REQUEST"
    lines = await audit_lines(tmp_path)
    assert len(lines) == 2, lines
    for line in lines:
        refused(line, operation, "INVALID_REQUEST")
        assert line["reason"] is None


async def test_clear_stale_with_a_bad_body_is_audited_with_the_operator(client, tmp_path) -> None:
    status, _ = await call(client, "/api/weights/clear-stale", OPS, json={"foo": 1})
    assert status == 400
    [line] = await audit_lines(tmp_path)
    refused(line, "weights_clear_stale", "INVALID_REQUEST", role="operator")


async def test_a_body_over_the_limit_is_audited_by_length_and_while_chunked(
    client, tmp_path
) -> None:
    big = b"{" + b" " * (MAX_BYTES + 10) + b"}"
    status, body = await call(client, "/api/weights/attach", data=big)
    assert status == 413 and body["error"]["code"] == "PAYLOAD_TOO_LARGE"

    async def chunks():
        for _ in range(4):
            yield b" " * (MAX_BYTES // 2)

    status, body = await call(client, "/api/weights/quiesce", data=chunks())
    assert status == 413 and body["error"]["code"] == "PAYLOAD_TOO_LARGE"
    status, _ = await call(client, "/api/weights/save", data=big)
    assert status == 413
    lines = await audit_lines(tmp_path)
    assert [x["operation"] for x in lines] == ["weights_attach", "weights_quiesce", "save"]
    for line, op in zip(lines, ("weights_attach", "weights_quiesce", "save"), strict=True):
        refused(line, op, "PAYLOAD_TOO_LARGE")


async def test_load_refusals_before_the_pause_are_audited_as_load(client, tmp_path) -> None:
    status, body = await call(client, "/api/weights/load", OPS, json={"checkpoint": "nope"})
    assert status == 404 and body["error"]["code"] == "CHECKPOINT_NOT_FOUND"
    status, body = await call(client, "/api/weights/load", OPS, json={"model_id": 999})
    assert status == 404 and body["error"]["code"] == "MODEL_NOT_FOUND"
    status, body = await call(client, "/api/weights/load", OPS, json={"colour": "red"})
    assert status == 400 and body["error"]["code"] == "INVALID_REQUEST"
    lines = await audit_lines(tmp_path)
    assert len(lines) == 3, lines
    for line, code in zip(
        lines, ("CHECKPOINT_NOT_FOUND", "MODEL_NOT_FOUND", "INVALID_REQUEST"), strict=True
    ):
        refused(line, "load", code, role="operator")


async def test_save_refusals_before_the_pause_are_audited_as_save(client, tmp_path) -> None:
    status, body = await call(client, "/api/weights/save", json={"name": "taken"})
    assert status == 409 and body["error"]["code"] == "CHECKPOINT_EXISTS"
    status, body = await call(client, "/api/weights/save", json={"name": 7})
    assert status == 400 and body["error"]["code"] == "INVALID_REQUEST"
    lines = await audit_lines(tmp_path)
    assert [x["code"] for x in lines] == ["CHECKPOINT_EXISTS", "INVALID_REQUEST"]
    for line in lines:
        refused(line, "save", line["code"])


async def test_a_500_of_a_gated_route_is_audited_once(client, tmp_path, monkeypatch) -> None:
    import miserver.serving.weights.jobs as jobs

    def broken(host, body):  # fault injection: a bug of ours while the load is prepared
        raise RuntimeError("simulated fault")

    monkeypatch.setattr(jobs, "prepare_load", broken)
    status, body = await call(client, "/api/weights/load", OPS, json={"model_id": 1})
    assert status == 500 and body["error"]["code"] == "INTERNAL_ERROR"
    [line] = await audit_lines(tmp_path)
    refused(line, "load", "INTERNAL_ERROR", role="operator")


async def test_calls_the_lifecycle_audits_are_not_audited_twice(client, tmp_path) -> None:
    status, body = await call(client, "/api/weights/heartbeat")  # nothing attached: 409
    assert status == 409 and body["error"]["code"] == "NOT_ATTACHED"
    status, _ = await call(client, "/api/weights/load", "wrong-secret-0123456789", json={})
    assert status == 401
    status, _ = await call(client, "/api/weights/attach", OPS)  # nothing resident: 400
    assert status == 400
    lines = await audit_lines(tmp_path)
    assert [(x["operation"], x["code"]) for x in lines] == [
        ("weights_heartbeat", "NOT_ATTACHED"),
        ("weights_load", "WEIGHTS_UNAUTHORIZED"),
        ("weights_attach", "MODEL_NOT_LOADED"),
    ]
