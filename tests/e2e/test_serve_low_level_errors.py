"""``miserver serve`` answers aiohttp's low-level errors as JSON (finding 1, a real process).

An Authorization header over aiohttp's 8190-byte line limit used to get aiohttp's text/plain 400
repeating ``Bearer <token>...``. The process serves nothing (DEFAULT_MODEL empty, one catalogue
row so no default import), so it starts in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from miserver.serving.models.catalogue import Catalogue

SECRET = "operatorSecret0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    return data


def test_an_oversized_bearer_header_gets_json_and_the_token_is_nowhere(tmp_path: Path) -> None:
    home = tmp_path / "home"
    Catalogue(home).register(name="placeholder", format="safetensors", dtype="bfloat16", path=home)
    port = free_port()
    log = tmp_path / "server.log"
    env = os.environ | {
        "MISERVER_HOME": str(home),
        "PORT": str(port),
        "DEFAULT_MODEL": "",
        "DEVICE": "cpu",
        "LOG_FORMAT": "json",
        "WEIGHTS_TOKENS": f"ops:operator:{SECRET}",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "miserver.cli", "serve"],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        raw = exchange(
            port,
            b"POST /api/weights/attach HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + SECRET.encode()
            + b"A" * 9000
            + b"\r\nContent-Length: 0\r\n\r\n",
        )
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.split(b"\r\n")[0].split()[1] == b"400", raw[:300]
        assert b"content-type: application/json" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == "INVALID_REQUEST" and "8190" in error["message"]
        assert SECRET.encode() not in raw and b"AAAA" not in raw
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    text = log.read_text()
    assert code == 0, text
    assert SECRET not in text and "AAAA" not in text
    assert "unreadable HTTP request" in text
