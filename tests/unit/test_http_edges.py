"""The HTTP layer's answers to what aiohttp accepts but misreads, answers in text, or waits on
for ever (breaker findings F1, F2, F5, F6, F18 of 2026-12-01; docs/decisions.md, HTTP edges).

Raw sockets against the app served by :class:`miserver.http.protocol.AppRunner` (what ``miserver
serve`` runs), since no HTTP client sends these requests. Each test failed on the code before
its fix (checked by reverting the fix in the working tree; see the commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import socket
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from tests.unit.model_free_app import model_free_client, model_free_settings, served_port

SECRET = "operatorSecret0123456789abcdef"
SETTINGS_BODY = b'{"max_concurrent_requests": 1}'


def exchange(
    port: int, request: bytes, *, shut: bool = False, timeout: float = 10
) -> tuple[bytes, float]:
    """Send ``request`` raw (then half-close when ``shut``), read until the server closes.
    Returns ``(bytes, seconds until the close)``."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(request)
        if shut:
            conn.shutdown(socket.SHUT_WR)
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := conn.recv(65536):
                data += chunk
    return data, time.monotonic() - started


def split(raw: bytes) -> tuple[bytes, int, dict[str, str], dict]:
    """``(status line, status, headers, JSON body)`` of one response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return lines[0].encode(), int(lines[0].split()[1]), headers, json.loads(body)


def post(path: str, body: bytes, *headers: str, method: str = "POST") -> bytes:
    extra = "".join(f"{h}\r\n" for h in headers)
    return (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\n{extra}Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body


@pytest.fixture
async def port(tmp_path) -> AsyncIterator[int]:
    async with served_port(model_free_settings(tmp_path, f"ops:operator:{SECRET}")) as p:
        yield p


def assert_json_error(raw: bytes, status: int, code: str) -> dict:
    """The response is ``status`` with a JSON error of ``code`` (either shape); its body."""
    line, got, headers, body = split(raw)
    assert got == status, raw[:400]
    assert line.startswith(b"HTTP/1.1 "), line
    assert headers["content-type"].startswith("application/json"), headers
    err = body["error"]
    assert err["code"] in (code, code.lower()), body
    return err


# --- F1: a body that is not what its Content-Encoding says -------------------------------------
@pytest.mark.parametrize("path", ["/api/settings", "/v1/chat/completions"])
async def test_a_body_that_is_not_gzip_is_a_400_naming_the_coding_without_a_traceback(
    port, path, caplog
):
    method = "PATCH" if path == "/api/settings" else "POST"
    request = post(
        path,
        SETTINGS_BODY,
        "Content-Type: application/json",
        "Content-Encoding: gzip",
        method=method,
    )
    with caplog.at_level(logging.WARNING):
        raw, _ = await asyncio.to_thread(exchange, port, request)
        await asyncio.sleep(0.2)  # what the server logs after the answer
    err = assert_json_error(raw, 400, "INVALID_REQUEST")
    assert "gzip" in err["message"], err
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], [
        (r.name, r.getMessage()) for r in caplog.records
    ]


async def test_a_gzip_body_is_still_decoded(port):
    body = gzip.compress(SETTINGS_BODY)
    request = post(
        "/api/settings",
        body,
        "Content-Type: application/json",
        "Content-Encoding: gzip",
        method="PATCH",
    )
    raw, _ = await asyncio.to_thread(exchange, port, request)
    _, status, _, answer = split(raw)
    assert status == 200 and answer["data"]["max_concurrent_requests"] == 1, answer


@pytest.mark.parametrize("coding", ["banana", "gzip, gzip", "x-squash"])
async def test_a_content_coding_the_server_does_not_decode_is_415(port, coding):
    """aiohttp passed an unknown coding through as if there were none: the body was read raw."""
    request = post(
        "/api/settings",
        SETTINGS_BODY,
        "Content-Type: application/json",
        f"Content-Encoding: {coding}",
        method="PATCH",
    )
    raw, _ = await asyncio.to_thread(exchange, port, request)
    err = assert_json_error(raw, 415, "UNSUPPORTED_MEDIA_TYPE")
    assert "gzip" in err["message"] and coding not in err["message"], err


# --- F2: an Expect other than 100-continue ----------------------------------------------------
@pytest.mark.parametrize("path", ["/api/settings", "/v1/chat/completions", "/nowhere"])
async def test_an_unknown_expect_is_a_json_417(port, path):
    request = post(path, SETTINGS_BODY, "Content-Type: application/json", "Expect: banana")
    raw, _ = await asyncio.to_thread(exchange, port, request)
    err = assert_json_error(raw, 417, "INVALID_REQUEST")
    assert "100-continue" in err["message"] and "banana" not in err["message"], err
    if path.startswith("/v1/"):
        assert set(err) == {"message", "type", "param", "code"}  # the OpenAI shape


async def test_expect_100_continue_still_gets_its_interim_answer(port):
    head = (
        b"PATCH /api/settings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
        % len(SETTINGS_BODY)
    )

    def talk() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(head)
            interim = conn.recv(100)
            conn.sendall(SETTINGS_BODY)
            data = interim
            while chunk := conn.recv(65536):
                data += chunk
        return data

    raw = await asyncio.to_thread(talk)
    assert raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 "), raw[:200]


# --- F18: versions, transfer codings, media types ---------------------------------------------
@pytest.mark.parametrize("version", [b"HTTP/2.0", b"HTTP/0.9"])
async def test_an_http_version_other_than_1_0_and_1_1_is_a_505_in_http_1_1(port, version):
    request = b"GET /api/health " + version + b"\r\nHost: x\r\nConnection: close\r\n\r\n"
    raw, _ = await asyncio.to_thread(exchange, port, request)
    err = assert_json_error(raw, 505, "INVALID_REQUEST")
    assert "HTTP/1.1" in err["message"], err


async def test_http_1_0_is_still_served(port):
    raw, _ = await asyncio.to_thread(exchange, port, b"GET /api/health HTTP/1.0\r\n\r\n")
    assert raw.startswith(b"HTTP/1.0 200 "), raw[:100]


def chunked(body: bytes, te: str) -> bytes:
    return (
        b"PATCH /api/settings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: " + te.encode() + b"\r\nConnection: close\r\n\r\n"
        b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    )


@pytest.mark.parametrize("te", ["gzip, chunked", "identity, chunked"])
async def test_a_transfer_coding_besides_chunked_is_refused(port, te):
    """aiohttp de-chunked ``gzip, chunked`` and ignored the gzip (a proxy honouring it reads
    another body)."""
    raw, _ = await asyncio.to_thread(exchange, port, chunked(SETTINGS_BODY, te))
    err = assert_json_error(raw, 400, "INVALID_REQUEST")
    assert "chunked" in err["message"], err


async def test_a_chunked_body_is_still_read(port):
    raw, _ = await asyncio.to_thread(exchange, port, chunked(SETTINGS_BODY, "chunked"))
    assert split(raw)[1] == 200, raw[:300]


@pytest.fixture
async def client(tmp_path):
    c = await model_free_client(model_free_settings(tmp_path, f"ops:operator:{SECRET}"))
    yield c
    await c.close()


@pytest.mark.parametrize(
    "path, media",
    [
        ("/api/settings", "image/png"),
        ("/api/settings", "text/plain"),
        ("/api/settings", "application/x-www-form-urlencoded"),
        ("/api/settings", "multipart/form-data; boundary=x"),
        ("/v1/completions", "application/xml"),
        ("/v1/chat/completions", "text/plain"),
        ("/v1/chat/completions", "multipart/form-data; boundary=x"),
        ("/v1/batches", "application/x-www-form-urlencoded"),
        ("/api/weights/adapter", "text/plain"),
        ("/v1/files", "application/json"),
    ],
)
async def test_a_body_of_another_media_type_than_the_routes_is_415(client, path, media):
    method = "PATCH" if path == "/api/settings" else "POST"
    resp = await client.request(method, path, data=b"{}", headers={"Content-Type": media})
    answer = await resp.json()
    assert resp.status == 415, answer
    code = answer["error"]["code"]
    assert code in ("UNSUPPORTED_MEDIA_TYPE", "unsupported_media_type"), answer
    expected = "a multipart/form-data" if path == "/v1/files" else "an application/json"
    assert f"reads {expected} body" in answer["error"]["message"], answer
    if media.startswith("application/x-www"):
        assert "-H 'Content-Type: application/json'" in answer["error"]["message"]


@pytest.mark.parametrize(
    "headers",
    [
        {"Content-Type": "application/json"},
        {"Content-Type": "application/json; charset=utf-8"},
        {"Content-Type": "Application/JSON"},
        {"Content-Type": "application/vnd.miserver+json"},
        {"Content-Type": "application/octet-stream"},  # aiohttp's and others' raw bytes
        {},
    ],
    ids=["json", "charset", "case", "plus-json", "octet-stream", "none"],
)
async def test_json_bodies_typed_json_or_untyped_are_read(client, headers):
    resp = await client.patch("/api/settings", data=SETTINGS_BODY, headers=headers)
    assert resp.status == 200, await resp.json()


async def test_a_request_without_a_body_is_not_checked(client):
    resp = await client.get("/api/health", headers={"Content-Type": "image/png"})
    assert resp.status == 200


# --- F5: a body that stalls -------------------------------------------------------------------
@pytest.fixture
async def fast_port(tmp_path) -> AsyncIterator[int]:
    settings = model_free_settings(tmp_path, f"ops:operator:{SECRET}", BODY_READ_TIMEOUT_S="1")
    async with served_port(settings) as p:
        yield p


@pytest.mark.parametrize("path", ["/api/settings", "/v1/chat/completions", "/v1/files"])
async def test_a_stalled_body_is_answered_408_and_closed(fast_port, path, caplog):
    method = "PATCH" if path == "/api/settings" else "POST"
    media = "multipart/form-data; boundary=b" if path == "/v1/files" else "application/json"
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {media}\r\n"
        "Content-Length: 500\r\n\r\n"
    ).encode()
    with caplog.at_level(logging.WARNING):
        raw, took = await asyncio.to_thread(exchange, fast_port, head + b'{"model"', timeout=15)
        await asyncio.sleep(0.2)
    assert took < 5, took  # 1 s of silence; it waited for ever
    err = assert_json_error(raw, 408, "INVALID_REQUEST")
    assert "BODY_READ_TIMEOUT_S" in err["message"], err
    if path.startswith("/v1/"):
        assert set(err) == {"message", "type", "param", "code"}
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def trickle(port: int, head: bytes, body: bytes, pieces: int, pause_s: float) -> bytes:
    """Send ``head``, then ``body`` in ``pieces`` parts ``pause_s`` apart; the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
        conn.sendall(head)
        step = -(-len(body) // pieces)
        for i in range(0, len(body), step):
            time.sleep(pause_s)
            conn.sendall(body[i : i + step])
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    return data


async def test_a_body_that_keeps_coming_is_read_past_the_timeout(fast_port):
    """The deadline is on each pause, not the whole body: 3 s of pauses of 0.4 s are fine."""
    body = b'{"max_concurrent_requests": 1' + b" " * 200 + b"}"
    head = (
        b"PATCH /api/settings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    )
    raw = await asyncio.to_thread(trickle, fast_port, head, body, 8, 0.4)
    assert split(raw)[1] == 200, raw[:300]


async def test_a_multipart_upload_that_keeps_coming_is_stored(fast_port):
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    jsonl = (json.dumps(line) + "\n").encode()
    body = (
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n'
        b"Content-Type: application/jsonl\r\n\r\n" + jsonl + b"\r\n--b--\r\n"
    )
    head = (
        b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b"
        b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    )
    raw = await asyncio.to_thread(trickle, fast_port, head, body, 8, 0.4)
    _, status, _, answer = split(raw)
    assert status == 200 and answer["id"].startswith("file-"), answer


# --- F6: a half-closed /v1 generation is never answered with a bare 499 -----------------------
@contextlib.asynccontextmanager
async def served_tiny(tmp_path, model_dir) -> AsyncIterator[int]:
    from miserver.http import keys
    from miserver.http.app import create_app
    from miserver.http.protocol import AppRunner
    from miserver.serving.models.catalogue import Catalogue
    from miserver.spec.settings import load_settings

    home = tmp_path / "home"
    Catalogue(str(home)).register(
        name="tiny", format="safetensors", dtype="bfloat16", path=model_dir
    )
    settings = load_settings({"MISERVER_HOME": str(home), "DEFAULT_MODEL": "tiny", "DEVICE": "cpu"})
    app = create_app(settings)
    runner = AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        await app[keys.STARTUP_LOAD]
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_half_closed_generation_request_gets_no_bare_499(tmp_path, tiny_model_dir, path):
    """docs/decisions.md: a half-closed generation is cancelled, not answered. What reaches
    the client is then nothing (the connection ends), never a status line with no reason and
    an empty, non-JSON body."""
    field = (
        {"messages": [{"role": "user", "content": "hi"}]}
        if path.endswith("chat/completions")
        else {"prompt": "hi"}
    )
    body = json.dumps({"model": "tiny", "max_tokens": 4, **field}).encode()
    request = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    async with served_tiny(tmp_path, tiny_model_dir) as port:
        raw, _ = await asyncio.to_thread(exchange, port, request, shut=True, timeout=30)
        if raw:  # an answer, if any, is a whole JSON response
            _, status, _, answer = split(raw)
            assert status != 499 and answer, raw[:300]
        # The connection still serves a client that does not half-close.
        raw, _ = await asyncio.to_thread(
            exchange,
            port,
            request.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1),
            timeout=30,
        )
        assert split(raw)[1] == 200, raw[:300]
