"""No error body repeats a configured token, two Authorization headers are refused, and a client
that closes the connection mid-body is a 400 (not a failure of ours): findings N9, N10 and N6 of
the second adversarial trial. Weights page: "A token is never ... returned or echoed in an
error"; every gated call writes one audit line. No model is resident: the app starts at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct

import pytest

from tests.unit.model_free_app import model_free_client, model_free_settings, served_port
from tests.waiting import eventually

TRN = "trainer-secret-0123456789"
TRN2 = "trainer-two-secret-0123456789"
OPS = "operator-secret-0123456789"


@pytest.fixture
async def client(tmp_path):
    c = await model_free_client(
        model_free_settings(
            tmp_path,
            f"trn:trainer:{TRN},trn2:trainer:{TRN2},ops:operator:{OPS}",
            WEIGHTS_AUDIT_LOG=str(tmp_path / "audit.jsonl"),
        )
    )
    yield c
    await c.close()


async def audit_lines(tmp_path) -> list[dict]:
    await asyncio.sleep(0.05)  # lines are written on the loop's next turn, after the answer
    path = tmp_path / "audit.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


async def test_a_token_in_the_path_is_not_echoed_by_the_404(client) -> None:
    resp = await client.get(f"/api/weights/{OPS}")
    text = await resp.text()
    assert resp.status == 404
    assert OPS not in text
    assert "/api/weights/***" in json.loads(text)["error"]["message"]


async def test_a_token_sent_as_a_checkpoint_name_is_not_echoed(client) -> None:
    resp = await client.post(
        "/api/weights/load",
        headers={"Authorization": f"Bearer {OPS}"},
        json={"checkpoint": TRN},
    )
    text = await resp.text()
    assert resp.status >= 400
    assert TRN not in text and "***" in text


async def test_two_authorization_headers_are_refused(client) -> None:
    resp = await client.post(
        "/api/weights/attach",
        headers=[("Authorization", f"Bearer {TRN}"), ("Authorization", f"Bearer {TRN2}")],
    )
    assert resp.status == 401
    assert (await resp.json())["error"]["code"] == "WEIGHTS_UNAUTHORIZED"


async def test_a_client_that_closes_mid_body_is_a_400_not_a_failure(tmp_path, caplog) -> None:
    # Through the runner `miserver serve` uses; the client resets the connection mid-body.
    caplog.set_level(logging.INFO)
    settings = model_free_settings(
        tmp_path, f"ops:operator:{OPS}", WEIGHTS_AUDIT_LOG=str(tmp_path / "audit.jsonl")
    )
    async with served_port(settings) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            (
                "POST /api/weights/save HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {OPS}\r\nContent-Type: application/json\r\n"
                'Content-Length: 50\r\n\r\n{"name":'
            ).encode()
        )
        await writer.drain()
        await asyncio.sleep(0.2)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
        writer.close()
        lines = await eventually(lambda: audit_lines(tmp_path), "the audit line was written")
    assert [(x["operation"], x["outcome"], x["code"]) for x in lines] == [
        ("save", "refused", "INVALID_REQUEST")
    ]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize(
    ("method", "path", "secret_field"),
    [
        ("save", "/api/weights/save", {"name": TRN}),
        ("adapter", "/api/weights/adapter", {"name": OPS, "path": "/nowhere"}),
        ("register", "/api/models", {"name": TRN2, "path": "/nowhere"}),
    ],
)
async def test_a_token_is_refused_as_a_public_name(client, method, path, secret_field) -> None:
    # Names are public (X-miLLM-Model, the listings): a configured token is refused as one,
    # without being repeated (third adversarial trial J5).
    resp = await client.post(path, headers={"Authorization": f"Bearer {OPS}"}, json=secret_field)
    text = await resp.text()
    assert resp.status == 400, text
    body = json.loads(text)
    assert body["error"]["code"] == "INVALID_REQUEST"
    assert body["error"]["details"] == {"field": "name"}
    assert all(secret not in text for secret in (TRN, TRN2, OPS))
