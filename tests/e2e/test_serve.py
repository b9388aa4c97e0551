"""``miserver serve`` as a real process: starts, loads DEFAULT_MODEL, answers, stops cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SECRET = "trainer-secret-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def start(home: str, tmp_path: Path, **env: str) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    log = tmp_path / "server.log"
    full = (
        os.environ
        | {
            "MISERVER_HOME": home,
            "PORT": str(port),
            "LOG_FORMAT": "json",
            "DEVICE": "cpu",
            "WEIGHTS_TOKENS": f"lab:trainer:{SECRET}",
        }
        | env
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "miserver.cli", "serve"],
        env=full,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    return proc, port, log


def test_serve_loads_the_default_and_stops_cleanly(home_with_default: str, tmp_path: Path) -> None:
    proc, port, log = start(home_with_default, tmp_path)
    try:
        deadline = time.monotonic() + 120
        resident = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status, body = get(port, "/api/health/detailed")
            except OSError:
                time.sleep(0.3)
                continue
            assert status == 200
            resident = body["data"]["resident"]
            if resident:
                break
            time.sleep(0.3)
        assert proc.poll() is None, log.read_text()
        assert resident and resident["name"] == "smollm2-135m-instruct", log.read_text()
        status, body = get(port, "/api/models")
        assert status == 200
        assert [r["resident"] for r in body["data"]] == [True, False]
        status, body = get(port, "/api/nothing")
        assert status == 404 and body["error"]["code"] == "NOT_FOUND"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    text = log.read_text()
    assert code == 0, text
    assert SECRET not in text
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    messages = [line.get("message", "") for line in lines]
    assert any("resident on cpu" in m for m in messages), messages
    assert any("listening on http://127.0.0.1" in m for m in messages), messages
    assert all({"ts", "level", "logger"} <= set(line) for line in lines)


def test_unknown_default_model_exits_2(home_with_default: str, tmp_path: Path) -> None:
    proc, _port, log = start(home_with_default, tmp_path, DEFAULT_MODEL="no-such-model")
    assert proc.wait(timeout=60) == 2
    text = log.read_text()
    assert "DEFAULT_MODEL" in text and "no-such-model" in text
    assert "smollm2-135m-instruct" in text  # names the rows that do exist
