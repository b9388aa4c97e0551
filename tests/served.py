"""A ``miserver serve`` subprocess for the end-to-end tests: started on a free port with the
caller's settings, waited for until a row is resident, stopped (terminate, then kill).

The environment is the test process's own, less any ``WEIGHTS_*`` variable (and whatever
``drop_prefixes`` names), plus the given settings; ``OMP_WAIT_POLICY`` defaults to ``PASSIVE``:
two cores shared with the test process, where OpenMP's spin-waiting costs ten times the compute
(benchmarks/serving.py); an operator's own setting is kept.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import requests

#: Seconds a server gets to import, load its default row and answer.
START_TIMEOUT_S = 240


S = TypeVar("S", bound="ServedProcess")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServedProcess:
    """A running ``miserver serve``: ``proc``, its ``base`` URL and its ``log`` file."""

    def __init__(self, proc: subprocess.Popen[bytes], base: str, log: Path) -> None:
        self.proc = proc
        self.base = base
        self.log = log

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def resident_models(self) -> list[str]:
        """The ``/v1/models`` ids marked resident."""
        models = requests.get(f"{self.base}/v1/models", timeout=2).json()["data"]
        return [m["id"] for m in models if m.get("resident")]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def start_serve(
    cls: type[S],
    log: Path,
    ready: Callable[[S], bool],
    *,
    drop_prefixes: tuple[str, ...] = (),
    **settings: str,
) -> S:
    """Start ``miserver serve`` with ``settings`` (``HOST``/``PORT`` chosen here, the log to
    ``log``) as a ``cls`` and poll ``ready(server)`` every half second until it is true.

    Raises:
        AssertionError: the process exited, or was not ready within :data:`START_TIMEOUT_S`
            (the message holds the log's tail).
    """
    port = free_port()
    dropped = ("WEIGHTS_", *drop_prefixes)
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    env.update(HOST="127.0.0.1", PORT=str(port), **settings)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "miserver.cli", "serve"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    srv = cls(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{srv.log_tail()}"
            assert time.monotonic() < deadline, f"server not ready:\n{srv.log_tail()}"
            try:
                if ready(srv):
                    return srv
            except (requests.RequestException, ValueError, KeyError, TypeError):
                pass
            time.sleep(0.5)
    except BaseException:
        srv.stop()
        raise
