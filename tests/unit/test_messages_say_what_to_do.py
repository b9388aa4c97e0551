"""Refusals and log lines that say what happened and what to do (issue 18): a CPU server's
NOT_ATTACHABLE names WEIGHTS_CPU_ATTACH=1, /api/health/detailed says why the resident cannot be
attached, a trainer token's clear-stale and ALREADY_ATTACHED name the operator role and the
route, and the timers' log lines name the setting, what happened and the way out."""

from __future__ import annotations

import logging

import pytest

from miserver.fsm.machine import refusal_message
from miserver.spec import codes
from tests.unit.test_weights_routes import OPS, TRN, TRN2, auth, chat, make_client, post
from tests.waiting import eventually


async def test_not_on_gpu_says_to_set_cpu_attach_and_health_says_why(tmp_path, tiny_model_dir):
    client = await make_client(tmp_path, tiny_model_dir, WEIGHTS_CPU_ATTACH="0")
    try:
        st, body, _ = await post(client, "/api/weights/attach", auth(TRN))
        err = body["error"]
        assert st == 400 and (err["code"], err["reason"]) == ("NOT_ATTACHABLE", "not_on_gpu")
        assert "WEIGHTS_CPU_ATTACH=1" in err["message"] and "restart" in err["message"]
        health = (await (await client.get("/api/health/detailed")).json())["data"]
        assert health["resident"]["attachable"] is False
        assert health["resident"]["not_attachable"] == {
            "reason": "not_on_gpu",
            "message": err["message"],
        }
    finally:
        await client.close()


async def test_an_attachable_resident_has_no_reason(client):
    health = (await (await client.get("/api/health/detailed")).json())["data"]
    assert health["resident"]["attachable"] is True
    assert "not_attachable" not in health["resident"]


def test_every_not_attachable_reason_has_its_own_advice():
    generic = refusal_message("NOT_ATTACHABLE")
    messages = {r: refusal_message("NOT_ATTACHABLE", r) for r in codes.NOT_ATTACHABLE.reasons}
    for reason, message in messages.items():
        assert message != generic, f"{reason} has no advice of its own"
    assert len(set(messages.values())) == len(messages)


async def test_clear_stale_with_a_trainer_token_and_already_attached_name_the_operator(client):
    st, body, _ = await post(client, "/api/weights/attach", auth(TRN))
    assert st == 200
    st, body, _ = await post(client, "/api/weights/clear-stale", auth(TRN2))
    assert st == 403 and body["error"]["code"] == "WEIGHTS_FORBIDDEN"
    assert "operator" in body["error"]["message"] and "WEIGHTS_TOKENS" in body["error"]["message"]
    st, body, _ = await post(client, "/api/weights/attach", auth(TRN2))
    msg = body["error"]["message"]
    assert st == 409 and body["error"]["code"] == "ALREADY_ATTACHED"
    assert "POST /api/weights/clear-stale" in msg and "operator" in msg
    assert "POST /api/weights/detach" in msg


async def test_timer_log_lines_say_what_happened_and_what_to_do(tmp_path, tiny_model_dir, caplog):
    client = await make_client(
        tmp_path,
        tiny_model_dir,
        WEIGHTS_COMMIT_WATCHDOG_MS="100",
        WEIGHTS_HOLD_TIMEOUT_S="0.2",
        WEIGHTS_HEARTBEAT_TIMEOUT_S="0.5",
        WEIGHTS_HEARTBEAT_INTERVAL_HINT_S="0.1",
    )

    def lines(word: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if word in r.getMessage()]

    try:
        with caplog.at_level(logging.WARNING, logger="miserver"):
            att = (await post(client, "/api/weights/attach", auth(TRN)))[1]["data"]
            h = auth(TRN, att["attachment_id"])
            assert (await post(client, "/api/weights/quiesce", h))[0] == 200
            (hold,) = await eventually(lambda: lines("WEIGHTS_HOLD_TIMEOUT_S ("), "hold line")
            assert "attachment trn (role trainer)" in hold and "serving resumed" in hold
            assert (await post(client, "/api/weights/quiesce", h))[0] == 200
            assert (await post(client, "/api/weights/commit-begin", h))[0] == 200
            (tear,) = await eventually(lambda: lines("WEIGHTS_COMMIT_WATCHDOG_MS (100 ms)"), "tear")
            assert "torn" in tear and "POST /api/weights/load" in tear
            assert "optimizer state" in tear
            (stale,) = await eventually(lambda: lines("WEIGHTS_HEARTBEAT_TIMEOUT_S ("), "stale")
            assert "is stale" in stale and "POST /api/weights/clear-stale" in stale
            st, body, _ = await post(client, "/api/weights/commit-end", h)
            assert st == 200 and body["data"]["overran"] is True
            (late,) = lines("came after the watchdog")
            assert "clean again" in late
        assert not [r for r in caplog.records if "record " in r.getMessage()]
        assert (await post(client, "/api/weights/resume", h))[0] == 200
        assert (await chat(client))[0] == 200
        assert (await post(client, "/api/weights/clear-stale", auth(OPS)))[0] in (200, 409)
    finally:
        await client.close()


@pytest.fixture
async def client(tmp_path, tiny_model_dir):
    c = await make_client(tmp_path, tiny_model_dir)
    yield c
    await c.close()
