"""Issue 32, item 13: what a request is refused with before its body is read.

A declared oversize body to a token-gated route is 401 when the caller has no valid token (the
token is checked first; a caller with one gets the 413), and ``Expect: 100-continue`` gets no
``100 Continue`` when the final answer will not read the body (an oversize length, a missing
token): the 413 (or 401) is the only answer. Raw sockets against the app as ``miserver serve``
runs it, since HTTP clients do not send these requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator

import pytest

from tests.unit.model_free_app import model_free_settings, served_port

TRN = "trainerSecret0123456789abcdef"
OPS = "operatorSecret0123456789abcdef"
TOKENS = f"trn:trainer:{TRN},ops:operator:{OPS}"
LIMIT = 4096
HUGE = 10 * LIMIT


@pytest.fixture(params=["none", "operator"])
async def port(request, tmp_path) -> AsyncIterator[int]:
    settings = model_free_settings(
        tmp_path, TOKENS, MAX_REQUEST_BYTES=str(LIMIT), MANAGEMENT_AUTH=request.param
    )
    async with served_port(settings) as p:
        yield p


def head(method: str, path: str, length: int, *extra: str) -> bytes:
    lines = "".join(f"{h}\r\n" for h in extra)
    return (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{lines}"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def first_answer(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send ``data`` (a head, no body) and read the first answer's head and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(data)
        raw = b""
        with contextlib.suppress(ConnectionResetError, TimeoutError, socket.timeout):
            while b"\r\n\r\n" not in raw or not _complete(raw):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                raw += chunk
    return raw


def _complete(raw: bytes) -> bool:
    top, _, body = raw.partition(b"\r\n\r\n")
    if top.startswith(b"HTTP/1.1 100 "):
        return False  # an interim answer: the final one follows
    for line in top.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return True


def status_and_error(raw: bytes) -> tuple[int, dict]:
    top, _, body = raw.partition(b"\r\n\r\n")
    return int(top.split()[1]), json.loads(body)["error"]


GATED = ["/api/weights/attach", "/api/weights/save", "/api/weights/load", "/api/weights/quiesce"]


@pytest.mark.parametrize("path", GATED)
async def test_an_oversize_body_without_a_token_is_401_not_413(port, path):
    for auth in ((), (f"Authorization: Bearer not-{TRN}",)):
        raw = await asyncio.to_thread(first_answer, port, head("POST", path, HUGE, *auth))
        status, err = status_and_error(raw)
        assert status == 401, raw[:300]
        assert err["code"].upper() == "WEIGHTS_UNAUTHORIZED"
        assert str(LIMIT) not in json.dumps(err)  # nothing about the body limit
    raw = await asyncio.to_thread(
        first_answer, port, head("POST", path, HUGE, f"Authorization: Bearer {TRN}")
    )
    assert status_and_error(raw)[0] == 413, raw[:300]  # a valid token: the limit applies


async def test_an_oversize_body_to_an_open_route_is_still_413(port):
    raw = await asyncio.to_thread(first_answer, port, head("POST", "/v1/chat/completions", HUGE))
    assert status_and_error(raw)[0] == 413, raw[:300]


@pytest.mark.parametrize(
    ("path", "auth", "status"),
    [
        ("/v1/chat/completions", (), 413),
        ("/api/weights/attach", (), 401),
        ("/api/weights/attach", (f"Authorization: Bearer {TRN}",), 413),
    ],
)
async def test_expect_100_continue_with_an_oversize_length_gets_only_the_final_answer(
    port, path, auth, status
):
    data = head("POST", path, HUGE, "Expect: 100-continue", *auth)
    raw = await asyncio.to_thread(first_answer, port, data)
    assert not raw.startswith(b"HTTP/1.1 100"), raw[:200]
    assert status_and_error(raw)[0] == status, raw[:300]


async def test_expect_100_continue_within_the_limit_still_continues(port):
    body = b'{"max_concurrent_requests": 1}'
    auth = f"Authorization: Bearer {OPS}"
    data = head("PATCH", "/api/settings", len(body), "Expect: 100-continue", auth)

    def talk() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(data)
            interim = conn.recv(100)
            conn.sendall(body)
            return interim + conn.recv(65536)

    raw = await asyncio.to_thread(talk)
    assert raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 "), raw[:200]


async def test_expect_100_continue_without_the_operator_token_gets_only_the_refusal(tmp_path):
    settings = model_free_settings(tmp_path, TOKENS, MANAGEMENT_AUTH="operator")
    async with served_port(settings) as p:
        data = head("PATCH", "/api/settings", 30, "Expect: 100-continue")
        raw = await asyncio.to_thread(first_answer, p, data)
    assert not raw.startswith(b"HTTP/1.1 100"), raw[:200]
    assert status_and_error(raw)[0] == 401, raw[:300]


def _answers(port: int, data: bytes) -> list[tuple[int, bytes]]:
    """Send ``data`` in one write, read until the server closes; (status, body) of each answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(data)
        raw = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := conn.recv(65536):
                raw += chunk
    out = []
    while raw:
        top, _, rest = raw.partition(b"\r\n\r\n")
        length = next(
            int(x.split(b":")[1])
            for x in top.split(b"\r\n")
            if x.lower().startswith(b"content-length:")
        )
        out.append((int(top.split()[1]), rest[:length]))
        raw = rest[length:]
    return out


@pytest.mark.parametrize(
    "bad",
    [b"GARBAGE\r\n\r\n", b"GET /x HTTP/1.1\r\nBad Header\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00"],
)
async def test_a_valid_pipelined_request_before_an_unparseable_one_is_run_and_answered(port, bad):
    """Issue 32, item 13: aiohttp's parser dropped every request of a read once one failed to
    parse: the valid first request was neither run nor answered."""
    body = b'{"max_queued_requests": 7}'
    first = (
        b"PATCH /api/settings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + OPS.encode() + b"\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    second = b"GET /api/health HTTP/1.1\r\nHost: x\r\n\r\n"
    answers = await asyncio.to_thread(_answers, port, first + second + bad)
    assert [s for s, _ in answers] == [200, 200, 400], answers
    assert json.loads(answers[0][1])["data"]["max_queued_requests"] == 7  # it ran
    assert json.loads(answers[2][1])["error"]["code"].upper() == "INVALID_REQUEST"


async def test_pipelined_requests_are_all_answered_in_order(port):
    one = b"GET /api/health HTTP/1.1\r\nHost: x\r\n\r\n"
    last = b"GET /api/settings HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    answers = await asyncio.to_thread(_answers, port, one * 40 + last)
    assert [s for s, _ in answers] == [200] * 41
    assert "max_concurrent_requests" in json.loads(answers[-1][1])["data"]
