"""The weights routes wired to the lifecycle, the scheduler and the export (issue 5).

A real app (aiohttp test server) serving a tiny real Llama attachably on the CPU
(``WEIGHTS_CPU_ATTACH=1``), driven over HTTP.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from miserver.http import keys
from miserver.http.app import create_app
from miserver.serving.models.catalogue import Catalogue
from miserver.spec.settings import load_settings
from tests.waiting import eventually

TRN = "trainer-secret-0123456789"
TRN2 = "trainer2-secret-0123456789"
OPS = "operator-secret-0123456789"


def auth(secret: str, attachment: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {secret}"}
    if attachment:
        headers["X-miLLM-Attachment"] = attachment
    return headers


async def make_client(tmp_path, model_dir, **env: str) -> TestClient:
    home = tmp_path / "home"
    Catalogue(str(home)).register(
        name="tiny", format="safetensors", dtype="bfloat16", path=model_dir
    )
    audit = tmp_path / "audit.jsonl"
    settings = load_settings(
        {
            "MISERVER_HOME": str(home),
            "DEFAULT_MODEL": "tiny",
            "DEVICE": "cpu",
            "WEIGHTS_TOKENS": f"trn:trainer:{TRN},trn2:trainer:{TRN2},ops:operator:{OPS}",
            "WEIGHTS_CPU_ATTACH": "1",
            "WEIGHTS_AUDIT_LOG": str(audit),
            **env,
        }
    )
    app = create_app(settings)
    client = TestClient(TestServer(app))
    await client.start_server()
    await app[keys.STARTUP_LOAD]
    return client


@pytest.fixture
async def client(tmp_path, tiny_model_dir):
    c = await make_client(tmp_path, tiny_model_dir)
    yield c
    await c.close()


async def post(client, path, headers=None, body=None):
    resp = await client.post(path, headers=headers or {}, json=body)
    return resp.status, await resp.json(), resp.headers


def audit_lines(tmp_path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]


async def chat(client, **extra):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
        **extra,
    }
    resp = await client.post("/v1/chat/completions", json=body)
    return resp.status, await resp.json(), resp.headers


async def test_full_write_cycle_and_the_header_counts_commits(client, tmp_path):
    st, body, _ = await post(client, "/api/weights/attach", auth(TRN))
    assert st == 200, body
    data = body["data"]
    att = data["attachment_id"]
    assert data["weights_state"] == "clean" and data["steps_since_load"] == 0
    assert data["storages"] and data["storages"][0]["kind"] == "cpu_shared_memory"
    assert data["model"]["name"] == "tiny" and data["config"]["model_type"] == "llama"
    h = auth(TRN, att)
    st, body, _ = await post(client, "/api/weights/quiesce", h)
    assert st == 200 and body["data"]["weights_state"] == "clean"
    st, body, _ = await post(client, "/api/weights/commit-begin", h)
    assert st == 200 and body["data"]["weights_state"] == "writing"
    st, body, _ = await post(client, "/api/weights/commit-end", h)
    assert st == 200 and body["data"]["steps_since_load"] == 1
    assert body["data"]["overran"] is False
    commit_ms = body["data"]["commit_ms"]
    st, body, _ = await post(client, "/api/weights/resume", h)
    assert body["data"] == {"barrier": "serving", "weights_state": "clean"}
    st, _, headers = await chat(client)
    assert st == 200
    assert headers["X-miLLM-Model"] == '"tiny";origin=model;commits=1'
    status = (await (await client.get("/api/weights/status")).json())["data"]
    assert status["attached"] and status["steps_since_load"] == 1
    assert att not in json.dumps(status) and TRN not in json.dumps(status)
    st, body, _ = await post(client, "/api/weights/detach", h)
    assert body["data"] == {"weights_state": "clean", "barrier": "serving"}
    lines = audit_lines(tmp_path)
    assert [line["operation"] for line in lines] == [
        "weights_attach",
        "weights_quiesce",
        "weights_commit_begin",
        "weights_commit_end",
        "weights_resume",
        "weights_detach",
    ]
    assert all(line["outcome"] == "accepted" for line in lines)
    assert lines[3]["steps"] == 1 and lines[3]["elapsed_ms"] == commit_ms  # rounded alike
    assert all(att not in json.dumps(line) for line in lines)
    assert len({line["attachment_ref"] for line in lines}) == 1


async def test_auth_order_and_refusals_are_audited(client, tmp_path):
    st, body, headers = await post(client, "/api/weights/quiesce")
    assert st == 401 and body["error"]["code"] == "WEIGHTS_UNAUTHORIZED"
    assert headers["WWW-Authenticate"] == "Bearer"
    st, body, _ = await post(client, "/api/weights/clear-stale", auth(TRN))
    assert st == 403 and body["error"]["code"] == "WEIGHTS_FORBIDDEN"
    st, body, _ = await post(client, "/api/weights/quiesce", auth(TRN))
    assert st == 409 and body["error"]["code"] == "NOT_ATTACHED"
    att = (await post(client, "/api/weights/attach", auth(TRN)))[1]["data"]["attachment_id"]
    st, body, _ = await post(client, "/api/weights/quiesce", auth(TRN))
    assert st == 403 and body["error"]["code"] == "NOT_ATTACHMENT_HOLDER"
    st, body, _ = await post(client, "/api/weights/quiesce", auth(TRN2, att))
    assert st == 403 and body["error"]["code"] == "NOT_ATTACHMENT_HOLDER"
    st, body, _ = await post(client, "/api/weights/attach", auth(TRN2))
    assert st == 409 and body["error"]["code"] == "ALREADY_ATTACHED"
    assert body["error"]["details"]["holder"]["label"] == "trn"
    st, body, _ = await post(client, "/api/weights/commit-end", auth(TRN, att))
    assert st == 409 and body["error"]["code"] == "NO_OPEN_COMMIT"
    lines = audit_lines(tmp_path)
    assert len(lines) == 8
    assert [line["code"] for line in lines if line["outcome"] == "refused"] == [
        "WEIGHTS_UNAUTHORIZED",
        "WEIGHTS_FORBIDDEN",
        "NOT_ATTACHED",
        "NOT_ATTACHMENT_HOLDER",
        "NOT_ATTACHMENT_HOLDER",
        "ALREADY_ATTACHED",
        "NO_OPEN_COMMIT",
    ]


async def test_held_request_waits_for_resume_and_loads_are_refused_while_attached(client):
    att = (await post(client, "/api/weights/attach", auth(TRN)))[1]["data"]["attachment_id"]
    h = auth(TRN, att)
    st, body, _ = await post(client, "/api/models/1/unload")
    assert st == 409 and body["error"]["code"] == "ALREADY_ATTACHED"
    assert (await post(client, "/api/weights/quiesce", h))[0] == 200
    pending = asyncio.ensure_future(chat(client))
    await asyncio.sleep(0.3)
    assert not pending.done()
    status = (await (await client.get("/api/weights/status")).json())["data"]
    assert status["barrier"] == "quiesced" and status["held_requests"] == 1
    assert (await post(client, "/api/weights/resume", h))[0] == 200
    st, _, _ = await asyncio.wait_for(pending, 30)
    assert st == 200


async def torn_status(client) -> dict | None:
    status = (await (await client.get("/api/weights/status")).json())["data"]
    return status if status["weights_state"] == "torn" else None


async def test_watchdog_tears_then_v1_is_503_and_late_commit_end_recovers(tmp_path, tiny_model_dir):
    client = await make_client(tmp_path, tiny_model_dir, WEIGHTS_COMMIT_WATCHDOG_MS="100")
    try:
        att = (await post(client, "/api/weights/attach", auth(TRN)))[1]["data"]["attachment_id"]
        h = auth(TRN, att)
        await post(client, "/api/weights/quiesce", h)
        await post(client, "/api/weights/commit-begin", h)
        status = await eventually(lambda: torn_status(client), "the watchdog tore the commit")
        assert status["weights_state"] == "torn" and status["commit"]["overran"] is True
        assert status["commit_overran"] is not None
        await post(client, "/api/weights/resume", h)
        st, body, headers = await chat(client)
        assert st == 503 and body["error"]["code"] == "weights_torn"
        assert headers["Retry-After"] == "1"
        st, body, _ = await post(client, "/api/weights/commit-end", h)
        assert st == 200 and body["data"]["overran"] is True
        assert body["data"]["weights_state"] == "clean"
        status = (await (await client.get("/api/weights/status")).json())["data"]
        assert status["last_overrun"]["commit_ms"] >= 100
    finally:
        await client.close()


async def test_hold_timeout_resumes_on_its_own(tmp_path, tiny_model_dir):
    client = await make_client(tmp_path, tiny_model_dir, WEIGHTS_HOLD_TIMEOUT_S="0.2")
    try:
        att = (await post(client, "/api/weights/attach", auth(TRN)))[1]["data"]["attachment_id"]
        st, body, _ = await post(client, "/api/weights/quiesce", auth(TRN, att))
        assert st == 200 and body["data"]["hold_deadline"] is not None

        async def resumed():
            status = (await (await client.get("/api/weights/status")).json())["data"]
            return status if status["barrier"] == "serving" else None

        status = await eventually(resumed, "the hold timer resumed serving")
        assert status["barrier"] == "serving" and status["last_hold_timeout_at"] is not None
        assert (await chat(client))[0] == 200
    finally:
        await client.close()


async def test_concurrent_duplicate_commit_begins_accept_exactly_once(client, tmp_path):
    att = (await post(client, "/api/weights/attach", auth(TRN)))[1]["data"]["attachment_id"]
    h = auth(TRN, att)
    await post(client, "/api/weights/quiesce", h)
    results = await asyncio.gather(
        *[post(client, "/api/weights/commit-begin", h) for _ in range(20)]
    )
    statuses = sorted(r[0] for r in results)
    assert statuses.count(200) == 1 and statuses.count(409) == 19
    assert {r[1]["error"]["code"] for r in results if r[0] == 409} == {"WEIGHTS_NOT_CLEAN"}
    begins = [line for line in audit_lines(tmp_path) if line["operation"] == "weights_commit_begin"]
    assert len(begins) == 20 and sum(b["outcome"] == "accepted" for b in begins) == 1


async def test_two_concurrent_attaches_accept_exactly_once(client):
    results = await asyncio.gather(
        post(client, "/api/weights/attach", auth(TRN)),
        post(client, "/api/weights/attach", auth(TRN2)),
    )
    assert sorted(r[0] for r in results) == [200, 409]


async def test_health_detailed_carries_the_weights_summary(client):
    data = (await (await client.get("/api/health/detailed")).json())["data"]
    assert data["weights"] == {
        "weights_state": "clean",
        "barrier": "serving",
        "attached": False,
        "attachment_state": None,
    }


async def test_settings_change_is_model_busy_while_the_barrier_is_held(client):
    att = (await post(client, "/api/weights/attach", auth(TRN)))[1]["data"]["attachment_id"]
    await post(client, "/api/weights/quiesce", auth(TRN, att))
    resp = await client.patch("/api/settings", json={"max_concurrent_requests": 2})
    body = await resp.json()
    assert resp.status == 409 and body["error"]["code"] == "MODEL_BUSY"
    assert client.app[keys.SCHEDULER].max_concurrent == 1
    await post(client, "/api/weights/resume", auth(TRN, att))
    resp = await client.patch("/api/settings", json={"max_concurrent_requests": 2})
    assert resp.status == 200
    status = (await (await client.get("/api/weights/status")).json())["data"]
    assert status["pause_unavailable"] == "concurrency"
    st, body, _ = await post(client, "/api/weights/quiesce", auth(TRN, att))
    assert st == 409 and body["error"]["code"] == "BARRIER_UNAVAILABLE"
    assert body["error"]["reason"] == "concurrency"


async def test_metrics_count_barrier_holds_commits_and_attachments(client):
    h = auth(
        TRN, (await post(client, "/api/weights/attach", auth(TRN)))[1]["data"]["attachment_id"]
    )
    for path in ("quiesce", "commit-begin", "commit-end", "resume", "detach"):
        assert (await post(client, f"/api/weights/{path}", h))[0] == 200
    text = await (await client.get("/metrics")).text()
    assert "miserver_barrier_holds_total 1.0" in text
    assert "miserver_commit_seconds_count 1.0" in text
    assert 'miserver_attachments_total{event="attach"} 1.0' in text
    assert 'miserver_attachments_total{event="detach"} 1.0' in text
    assert "miserver_barrier_hold_seconds_count 1.0" in text
    assert "miserver_pinned_bytes" in text


async def test_a_parameter_moved_during_a_commit_tears_the_set(client):
    import torch

    att = (await post(client, "/api/weights/attach", auth(TRN)))[1]["data"]["attachment_id"]
    h = auth(TRN, att)
    await post(client, "/api/weights/quiesce", h)
    await post(client, "/api/weights/commit-begin", h)
    norm = client.app[keys.HOST].resident.model.model.norm
    norm.weight.data = torch.ones_like(norm.weight.data)  # rebinds storage out of the arena
    st, body, _ = await post(client, "/api/weights/commit-end", h)
    # the move orphaned the commit: no late commit-end can repair moved storage (the table)
    assert st == 403 and body["error"]["code"] == "NOT_ATTACHMENT_HOLDER"
    status = (await (await client.get("/api/weights/status")).json())["data"]
    assert status["weights_state"] == "torn"


async def test_refuse_policy_refuses_a_swap_before_the_row_is_checked(client):
    client.app[keys.CATALOGUE].register(
        name="tiny-q4",
        format="gguf",
        dtype="float16",
        path="/nonexistent/tiny.gguf",
        quantization="gguf",
    )
    body = {"model": "tiny-q4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    resp = await client.post(
        "/v1/chat/completions", json=body, headers={"X-miLLM-Load-Policy": "refuse"}
    )
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "model_not_loaded"
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "model_load_failed"
    assert client.app[keys.HOST].resident.row.name == "tiny"


@pytest.mark.parametrize(
    "path, body",
    [
        ("/api/weights/load", {"checkpoint": 5}),
        ("/api/weights/load", {"checkpoint": "x", "model_id": 1}),
        ("/api/weights/load", {}),
        ("/api/weights/attach", [1, 2]),
        ("/api/weights/save", {"name": "ok", "extra": True}),
    ],
)
async def test_bad_bodies_are_400_json_and_change_nothing(client, tmp_path, path, body):
    st, data, _ = await post(client, path, auth(OPS), body)
    assert st == 400 and data["error"]["code"] == "INVALID_REQUEST", data
    assert OPS not in json.dumps(data)
    status = (await (await client.get("/api/weights/status")).json())["data"]
    assert status["attached"] is False and status["weights_state"] == "clean"


async def test_with_no_tokens_configured_the_401_says_the_server_has_none(tmp_path, tiny_model_dir):
    client = await make_client(tmp_path, tiny_model_dir, WEIGHTS_TOKENS="")
    try:
        st, body, headers = await post(client, "/api/weights/attach", auth("anything-at-all-123"))
        assert st == 401 and body["error"]["code"] == "WEIGHTS_UNAUTHORIZED"
        assert headers["WWW-Authenticate"] == "Bearer"
        assert "no tokens configured (WEIGHTS_TOKENS is empty)" in body["error"]["message"]
    finally:
        await client.close()


async def test_with_tokens_configured_the_401_does_not_mention_their_absence(client):
    st, body, _ = await post(client, "/api/weights/attach", auth("not-a-configured-token-1"))
    assert st == 401 and "no tokens configured" not in body["error"]["message"]
