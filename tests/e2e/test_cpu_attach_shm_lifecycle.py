"""``miserver serve`` with CPU shared memory (contract 8) against trainers that rebuild one attach
body in two processes, keep a body past its detach, and reattach; then unload and SIGTERM
(issue 16, items 1 and 4). The server never aborts, a stale body is refused with a TrainerError,
and no file of the server is left in /dev/shm."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from miserver.serving.models.catalogue import Catalogue
from tests.e2e.test_serve import free_port
from tests.unit.test_ipc_shm_ownership import TRAINER

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shm in /dev/shm"),
]

SECRET = "trainer-secret-0123456789abcdef"


def call(port: int, method: str, path: str, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", method=method, headers=headers or {}, data=b""
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def trainer(body: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", TRAINER],
        input=json.dumps(body),
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def server_id(pid: int) -> str:
    """The miserver.ipc.shm id of process ``pid``: the lock file it holds open."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            name = os.path.basename(target)
            if target.startswith("/dev/shm/miserver-") and name.endswith(".lock"):
                return name.removeprefix("miserver-").removesuffix(".lock")
    raise AssertionError("the server holds no miserver lock file")


def files_of(pid: int, sid: str) -> set[str]:
    """The server's files in /dev/shm (other processes on this machine have their own)."""
    return {f for f in os.listdir("/dev/shm") if sid in f or f.startswith(f"torch_{pid}_")}


def test_two_rebuilds_a_stale_body_unload_and_sigterm(tmp_path: Path, tiny_model_dir: str):
    home = tmp_path / "home"
    row = Catalogue(str(home)).register(
        name="tiny", format="safetensors", dtype="bfloat16", path=tiny_model_dir
    )
    port = free_port()
    log = tmp_path / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "miserver.cli", "serve"],
        env=os.environ
        | {
            "MISERVER_HOME": str(home),
            "PORT": str(port),
            "DEFAULT_MODEL": "tiny",
            "DEVICE": "cpu",
            "WEIGHTS_CPU_ATTACH": "1",
            "WEIGHTS_TOKENS": f"lab:trainer:{SECRET}",
            "LOG_FORMAT": "text",
        },
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                st, data = call(port, "GET", "/api/health/detailed")
                if st == 200 and data["data"]["resident"]:
                    break
            except OSError:
                pass
            time.sleep(0.3)
        auth = {"Authorization": f"Bearer {SECRET}"}
        st, data = call(port, "POST", "/api/weights/attach", auth)
        assert st == 200, data
        body, aid = data["data"], data["data"]["attachment_id"]
        assert trainer(body) == {"ok": True}  # two processes rebuild one body
        assert trainer(body) == {"ok": True}
        held = auth | {"X-miLLM-Attachment": aid}
        assert call(port, "POST", "/api/weights/detach", held)[0] == 200
        assert trainer(body)["error"] == "StaleExport"  # the body kept past its detach
        st, data = call(port, "POST", "/api/weights/attach", auth)
        assert st == 200, data
        assert trainer(data["data"]) == {"ok": True}  # the next attach works
        held = auth | {"X-miLLM-Attachment": data["data"]["attachment_id"]}
        assert call(port, "POST", "/api/weights/detach", held)[0] == 200
        st, data = call(port, "POST", f"/api/models/{row.id}/unload")
        assert st == 200, data
        assert proc.poll() is None, log.read_text()[-3000:]
        sid = server_id(proc.pid)
        left = files_of(proc.pid, sid)
        assert left == {f"miserver-{sid}.lock"}, left  # no arena or attach name after unload
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert files_of(proc.pid, sid) == set()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
