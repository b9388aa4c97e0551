"""SIGTERM drains (issue 16, item 2): new requests get 503 SHUTTING_DOWN with Retry-After,
running ones finish within SHUTDOWN_GRACE_S, what still runs after it is answered 503 (a stream
gets an error event), and the process exits 0.

The server is miserver's app served by ``miserver.http.protocol.run_app`` (what ``miserver
serve`` runs) in a subprocess, with two slow routes added under /v1 so that a request is
reliably running when the signal arrives without a model: a plain one and an event stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import aiohttp
import pytest

SERVER = textwrap.dedent(
    """
    import asyncio, sys
    from aiohttp import web
    from miserver.http.app import create_app
    from miserver.http.protocol import run_app
    from miserver.spec.settings import load_settings

    home, port, grace = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    settings = load_settings({"MISERVER_HOME": home, "DEFAULT_MODEL": "", "DEVICE": "cpu",
                              "SHUTDOWN_GRACE_S": grace})
    app = create_app(settings)

    async def slow(request):
        await asyncio.sleep(float(request.query["s"]))
        return web.json_response({"done": True})

    async def slow_stream(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(int(float(request.query["s"]) / 0.1)):
            await resp.write(b'data: {"i": %d}\\n\\n' % i)
            await asyncio.sleep(0.1)
        await resp.write(b"data: [DONE]\\n\\n")
        await resp.write_eof()
        return resp

    app.router.add_get("/v1/test-slow", slow)
    app.router.add_get("/v1/test-slow-stream", slow_stream)
    run_app(app, host="127.0.0.1", port=port, on_listening=lambda: print("up", flush=True))
    print("exited cleanly", flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path: Path, grace: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(tmp_path / "home"), str(port), grace],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"LOG_FORMAT": "text"},
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, port
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not start: " + proc.communicate()[1][-2000:])


async def _plain(session: aiohttp.ClientSession, url: str) -> tuple[int, dict, dict]:
    async with session.get(url) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


async def _stream(session: aiohttp.ClientSession, url: str) -> list[str]:
    events = []
    async with session.get(url) as resp:
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
    return events


def _exit(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err


@pytest.mark.full  # seconds to tens of seconds: left out of make quick
async def test_running_requests_finish_and_new_ones_get_503(tmp_path) -> None:
    proc, port = _start(tmp_path, "10")
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            plain = asyncio.create_task(_plain(session, f"{base}/v1/test-slow?s=2"))
            stream = asyncio.create_task(_stream(session, f"{base}/v1/test-slow-stream?s=2"))
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            async with aiohttp.ClientSession() as fresh:  # a new connection, a new request
                status, headers, body = await _plain(fresh, f"{base}/v1/models")
                m_status, m_headers, m_body = await _plain(fresh, f"{base}/api/models")
            assert status == 503 and body["error"]["code"] == "shutting_down", body
            assert int(headers["Retry-After"]) >= 1
            assert m_status == 503 and m_body["error"]["code"] == "SHUTTING_DOWN", m_body
            assert "Retry-After" in m_headers
            p_status, _, p_body = await plain
            assert (p_status, p_body) == (200, {"done": True})
            events = await stream
            assert events[-1] == "[DONE]" and len(events) == 21, events
        rc, out, err = _exit(proc)
        assert rc == 0 and "exited cleanly" in out, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.full  # seconds to tens of seconds: left out of make quick
async def test_after_the_grace_a_request_gets_503_and_a_stream_an_error_event(tmp_path) -> None:
    proc, port = _start(tmp_path, "1")
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            plain = asyncio.create_task(_plain(session, f"{base}/v1/test-slow?s=30"))
            stream = asyncio.create_task(_stream(session, f"{base}/v1/test-slow-stream?s=30"))
            await asyncio.sleep(0.5)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            status, headers, body = await asyncio.wait_for(plain, 10)
            assert status == 503 and body["error"]["code"] == "shutting_down", body
            assert "Retry-After" in headers
            events = await asyncio.wait_for(stream, 10)
            last = json.loads(events[-1])
            assert last["error"]["code"] == "shutting_down", events[-3:]
            # Both were running: they were ended after the grace, not refused as new ones.
            for message in (body["error"]["message"], last["error"]["message"]):
                assert "SHUTDOWN_GRACE_S" in message and "ended" in message, message
                assert "takes no new requests" not in message, message
        rc, out, err = _exit(proc)
        assert rc == 0 and "exited cleanly" in out, err[-2000:]
        assert time.monotonic() - signalled < 10  # bounded by the grace, not the 30 s requests
    finally:
        if proc.poll() is None:
            proc.kill()


def _stalled_body(port: int) -> socket.socket:
    """A connection that sent a request head and 8 bytes of the 500 its body declares."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=30)
    conn.sendall(
        b"POST /api/models HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 500\r\n\r\n{"name":'
    )
    return conn


def _read_to_close(conn: socket.socket) -> bytes:
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


@pytest.mark.full  # seconds to tens of seconds: left out of make quick
async def test_liveness_answers_while_draining_and_a_stalled_body_is_closed_in_the_grace(
    tmp_path,
) -> None:
    """Breaker finding F7: /api/health is liveness, "200 whenever the process answers", also
    while the process drains (readiness, /api/health/detailed, is 503). Finding F5: a request
    whose body stalled holds the drain only until the grace ends, then gets its 503 and its
    connection closes at once (BODY_READ_TIMEOUT_S, 20 s here, is longer than the grace)."""
    proc, port = _start(tmp_path, "2")
    base = f"http://127.0.0.1:{port}"
    try:
        conn = await asyncio.to_thread(_stalled_body, port)
        await asyncio.sleep(0.5)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        async with aiohttp.ClientSession() as fresh:
            live, _, live_body = await _plain(fresh, f"{base}/api/health")
            ready, _, ready_body = await _plain(fresh, f"{base}/api/health/detailed")
        assert live == 200 and live_body["data"]["status"] == "ok", live_body
        assert ready == 503 and ready_body["error"]["code"] == "SHUTTING_DOWN", ready_body
        raw = await asyncio.to_thread(_read_to_close, conn)
        closed_after = time.monotonic() - signalled
        conn.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), raw[:300]
        assert json.loads(body)["error"]["code"] == "SHUTTING_DOWN", body
        assert closed_after < 2 + 1.5, closed_after  # the grace, not the body timeout
        rc, out, err = _exit(proc)
        assert rc == 0 and "exited cleanly" in out, err[-2000:]
        assert time.monotonic() - signalled < 2 + 5
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_a_ctrl_c_is_named_and_a_second_one_counts_the_seconds_that_passed(tmp_path) -> None:
    """Issue 32, item 6: after a Ctrl-C the messages said SIGTERM, and after a second signal
    they said the request ran the whole SHUTDOWN_GRACE_S (here 30 s) when it had run 1 s."""
    proc, port = _start(tmp_path, "30")
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            plain = asyncio.create_task(_plain(session, f"{base}/v1/test-slow?s=60"))
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            await asyncio.sleep(0.5)
            async with aiohttp.ClientSession() as fresh:
                status, _, body = await _plain(fresh, f"{base}/api/models")
            assert status == 503, body
            assert "SIGINT" in body["error"]["message"], body
            assert "SIGTERM" not in body["error"]["message"], body
            await asyncio.sleep(0.5)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGINT)
            status, _, body = await asyncio.wait_for(plain, 10)
            message = body["error"]["message"]
            assert status == 503 and "SIGINT" in message and "SIGTERM" not in message, message
            assert "second signal" in message and "30 s" not in message, message
            seconds = float(message.split("second signal came, ")[1].split(" s ")[0])
            assert 0.5 <= seconds < 10, message
        rc, out, err = _exit(proc)
        assert rc == 0 and "exited cleanly" in out, err[-2000:]
        assert time.monotonic() - signalled < 10
        ended = [x for x in err.splitlines() if "with 503 SHUTTING_DOWN" in x]
        assert len(ended) == 1 and "second signal" in ended[0] and "30 s" not in ended[0], ended
    finally:
        if proc.poll() is None:
            proc.kill()
