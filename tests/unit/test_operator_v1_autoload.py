"""Breaker finding F10: under MANAGEMENT_AUTH=operator an anonymous /v1 request naming another
catalogue row loaded (swapped) it, the load the operator gate refuses on
POST /api/models/{id}/load. Now it is 409 model_not_loaded naming the served model and how to
load, unless the request carries an operator token; the default mode keeps the auto-load."""

from __future__ import annotations

from miserver.http import keys
from tests.unit.test_weights_routes import OPS, TRN, auth, make_client

CHAT = "/v1/chat/completions"


def chat(model: str) -> dict:
    return {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}


async def test_operator_mode_refuses_an_anonymous_auto_load(tmp_path, tiny_model_dir) -> None:
    c = await make_client(tmp_path, tiny_model_dir, MANAGEMENT_AUTH="operator")
    try:
        other = c.app[keys.CATALOGUE].register(
            name="copy1", format="safetensors", dtype="bfloat16", path=tiny_model_dir
        )
        host = c.app[keys.HOST]
        for headers in ({}, auth(TRN), {"Authorization": "Bearer not-a-token-0000000000"}):
            resp = await c.post(CHAT, json=chat("copy1"), headers=headers)
            body = await resp.json()
            assert resp.status == 409, body
            err = body["error"]
            assert err["code"] == "model_not_loaded" and err["param"] == "model"
            assert "'tiny'" in err["message"]  # the served model
            assert f"POST /api/models/{other.id}/load" in err["message"]
            assert "MANAGEMENT_AUTH=operator" in err["message"]
            assert TRN not in err["message"]
            assert host.resident.row.name == "tiny"
        resp = await c.post(CHAT, json={**chat("copy1"), "stream": True})
        assert resp.status == 409, await resp.text()  # refused before any stream opens
        assert (await resp.json())["error"]["code"] == "model_not_loaded"
        assert host.resident.row.name == "tiny"
        resp = await c.post(CHAT, json=chat("tiny"))  # inference on the resident stays open
        assert resp.status == 200, await resp.text()
        resp = await c.post(CHAT, json=chat("copy1"), headers=auth(OPS))  # an operator may load
        assert resp.status == 200, await resp.text()
        assert host.resident.row.name == "copy1"
    finally:
        await c.close()


async def test_the_default_mode_still_auto_loads(tmp_path, tiny_model_dir) -> None:
    c = await make_client(tmp_path, tiny_model_dir)
    try:
        c.app[keys.CATALOGUE].register(
            name="copy1", format="safetensors", dtype="bfloat16", path=tiny_model_dir
        )
        resp = await c.post(CHAT, json=chat("copy1"))
        assert resp.status == 200, await resp.text()
        assert c.app[keys.HOST].resident.row.name == "copy1"
    finally:
        await c.close()


async def test_v1_load_policy_refuse_never_auto_loads(tmp_path, tiny_model_dir) -> None:
    """Issue 32, item 3: ``V1_LOAD_POLICY=refuse`` makes every ``/v1`` request behave as
    ``X-miLLM-Load-Policy: refuse``: 409 model_not_loaded, whatever the request carries (an
    operator token, ``X-miLLM-Load-Policy: auto``); the resident is still served."""
    c = await make_client(tmp_path, tiny_model_dir, V1_LOAD_POLICY="refuse")
    try:
        other = c.app[keys.CATALOGUE].register(
            name="copy1", format="safetensors", dtype="bfloat16", path=tiny_model_dir
        )
        host = c.app[keys.HOST]
        for headers in ({}, auth(OPS), {"X-miLLM-Load-Policy": "auto"}):
            resp = await c.post(CHAT, json=chat("copy1"), headers=headers)
            body = await resp.json()
            assert resp.status == 409, body
            err = body["error"]
            assert err["code"] == "model_not_loaded" and err["param"] == "model"
            assert err["type"] == "invalid_request_error"
            assert "'tiny'" in err["message"] and "V1_LOAD_POLICY=refuse" in err["message"]
            assert f"POST /api/models/{other.id}/load" in err["message"]
            assert host.resident.row.name == "tiny"
        resp = await c.post(CHAT, json=chat("copy1"), headers={"X-miLLM-Load-Policy": "bogus"})
        assert resp.status == 400  # the header is still checked
        resp = await c.post(CHAT, json=chat("tiny"))
        assert resp.status == 200, await resp.text()
        resp = await c.post(f"/api/models/{other.id}/load")  # the management load still works
        assert resp.status == 200, await resp.text()
        assert host.resident.row.name == "copy1"
    finally:
        await c.close()
