"""aiohttp's own low-level errors answer JSON and never echo the request (finding 1).

A request aiohttp's parser refuses never reaches the app; aiohttp's stock answer was a text/plain
400 repeating the first ~100 bytes of the offending line, a Bearer token included. These tests
drive the real app through :class:`miserver.http.protocol.AppRunner` (what ``miserver serve``
runs) with raw sockets, since no HTTP client sends such requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest

from tests.unit.model_free_app import model_free_settings, served_port

SECRET = "operatorSecret0123456789abcdef"


@pytest.fixture
async def port(tmp_path):
    async with served_port(model_free_settings(tmp_path, f"ops:operator:{SECRET}")) as p:
        yield p


def exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` raw and read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    return data


def split(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return status, headers, json.loads(body)


async def send(port: int, request: bytes) -> tuple[bytes, int, dict[str, str], dict]:
    raw = await asyncio.to_thread(exchange, port, request)
    return (raw, *split(raw))


LONG = b"A" * 9000


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(
            b"POST /api/weights/attach HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + SECRET.encode()
            + LONG
            + b"\r\nContent-Length: 0\r\n\r\n",
            id="authorization-header-over-8190-bytes",
        ),
        pytest.param(
            b"GET /api/weights/status?token=" + SECRET.encode() + LONG + b" HTTP/1.1\r\n"
            b"Host: x\r\n\r\n",
            id="url-over-8190-bytes",
        ),
        pytest.param(
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Secret: "
            + SECRET.encode()
            + LONG
            + b"\r\n\r\n",
            id="v1-header-over-8190-bytes",
        ),
    ],
)
async def test_an_oversized_line_is_a_json_400_that_echoes_nothing(
    port, request_bytes, caplog
) -> None:
    caplog.set_level(logging.DEBUG)
    raw, status, headers, body = await send(port, request_bytes)
    assert status == 400
    assert headers["content-type"].startswith("application/json")
    assert SECRET.encode() not in raw and b"AAAA" not in raw
    assert body["success"] is False and body["data"] is None
    error = body["error"]
    assert error["code"] == "INVALID_REQUEST"
    assert "longer than 8190 bytes" in error["message"]
    assert error["details"] == {"limit_bytes": 8190}
    # exchange() read until the server closed the connection: nothing after it is parsed.
    # The log names the fault, never the request's bytes (no masking needed: nothing to mask).
    assert "unreadable HTTP request" in caplog.text
    assert SECRET not in caplog.text and "AAAA" not in caplog.text


async def test_a_malformed_header_and_a_garbage_request_line_are_json(port) -> None:
    raw, status, headers, body = await send(
        port, b"GET /api/health HTTP/1.1\r\nHost: x\r\nBad Header" + SECRET.encode() + b"\r\n\r\n"
    )
    assert status == 400 and headers["content-type"].startswith("application/json")
    assert body["error"]["code"] == "INVALID_REQUEST" and SECRET.encode() not in raw
    raw, status, _, body = await send(port, b"\x16\x03\x01 " + SECRET.encode() + b"\r\n\r\n")
    assert status == 400 and body["error"]["code"] == "INVALID_REQUEST"
    assert SECRET.encode() not in raw


async def test_a_well_formed_request_is_served_as_usual_on_the_same_runner(port) -> None:
    raw, status, headers, body = await send(
        port, b"GET /api/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert status == 200 and body["success"] is True


@pytest.mark.parametrize(
    ("status", "message"),
    [(500, "internal server error"), (504, "The request handler timed out; retry the request.")],
)
def test_a_server_side_low_level_error_is_a_json_internal_error(status, message) -> None:
    from miserver.http.protocol import low_level_error

    resp = low_level_error(status, RuntimeError(SECRET))
    assert resp.status == status and resp.content_type == "application/json"
    error = json.loads(resp.body)["error"]
    assert error == {"code": "INTERNAL_ERROR", "message": message, "reason": None, "details": None}
