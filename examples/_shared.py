"""What the examples share: their own ``miserver serve``, the command line around it, and the few
helpers of a trainer that talks to the server (not an example itself).

``train_while_serving.py`` and ``grpo_in_place.py`` import it by name: run as scripts, their folder
is the first entry of ``sys.path``. Each example starts its server with :class:`LocalServer` (a
generated trainer token, ``WEIGHTS_CPU_ATTACH=1`` on the CPU, the watchdog raised on the CPU) or
attaches to one given with ``--server`` and ``--token-file`` (:func:`add_server_args`,
:func:`connect`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

#: The served name of the embedded default model, the one the examples train.
MODEL = "smollm2-135m-instruct"
#: ``WEIGHTS_COMMIT_WATCHDOG_MS`` of a self-started server on the CPU: an AdamW step over 135M
#: parameters on two cores takes far longer than the 800 ms GPU default.
CPU_WATCHDOG_MS = 30_000


class SetupError(RuntimeError):
    """The example cannot run (no server, the wrong model, a torn set): exit status 2."""


# --- the server --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalServer:
    """``miserver serve`` in a child process with a generated trainer token (never printed).

    Args:
        device: ``DEVICE`` for the server (``auto``, ``cpu``, ``cuda:0``, ...).
        home: ``MISERVER_HOME``, or None for the environment's (else miserver's default).
        log_path: where the server's output goes.
        watchdog_ms: ``WEIGHTS_COMMIT_WATCHDOG_MS``, or None for the server's default.
        audit_path: ``WEIGHTS_AUDIT_LOG``.
        port: the port on 127.0.0.1 to serve on; None or 0 for a free one.
        extra_env: more settings for the server (``{"MAX_BATCH_SIZE": "8"}``), set last.
    """

    def __init__(
        self,
        *,
        device: str,
        home: str | None,
        log_path: Path,
        watchdog_ms: int | None,
        audit_path: Path,
        port: int | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.token = secrets.token_urlsafe(32)
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTS_")}
        env.update(
            HOST="127.0.0.1",
            PORT=str(self.port),
            DEVICE=device,
            DEFAULT_MODEL=MODEL,
            WEIGHTS_TOKENS=f"demo-trainer:trainer:{self.token}",
            WEIGHTS_AUDIT_LOG=str(audit_path),
            LOG_FORMAT="json",
            LOG_LEVEL="info",
            MAX_CONCURRENT_REQUESTS="1",
            CONTINUOUS_BATCHING="0",
        )
        if device == "cpu":
            env["WEIGHTS_CPU_ATTACH"] = "1"
        if watchdog_ms is not None:
            env["WEIGHTS_COMMIT_WATCHDOG_MS"] = str(watchdog_ms)
        if home:
            env["MISERVER_HOME"] = home
        env.update(extra_env or {})
        self._env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LocalServer:
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "miserver.cli", "serve"],
                env=self._env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return self

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise SetupError(
                f"the server exited with status {self.proc.returncode}; its log "
                f"({self.log_path}) ends with:\n{self.log_tail()}"
            )

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class StopRequest:
    """SIGINT/SIGTERM: the first asks the run to stop after the current step (the commit in
    progress ends cleanly and the trainer detaches); a second one aborts at once."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.requested = True
        print(
            f"\n{signal.Signals(signum).name}: stopping after this step (again to abort)",
            file=sys.stderr,
            flush=True,
        )


def wait_until_ready(
    base: str, timeout_s: float, server: LocalServer | None = None, stop: StopRequest | None = None
) -> None:
    """Wait until ``MODEL`` is resident (the first start imports it, a minute or two).
    Raises KeyboardInterrupt when a stop was requested meanwhile."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if stop is not None and stop.requested:
            raise KeyboardInterrupt
        if server is not None:
            server.check_alive()
        try:
            status = requests.get(f"{base}/api/weights/status", timeout=5).json()["data"]
            resident = status.get("resident_model")
            if resident is not None:
                return
            last = "nothing resident yet"
        except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
            last = type(exc).__name__
        time.sleep(1.0)
    raise SetupError(
        f"the server at {base} did not have a model resident within {timeout_s:.0f} s ({last})"
    )


# --- the command line around the server ----------------------------------------------------------
def add_server_args(p: argparse.ArgumentParser, default_out: str) -> None:
    """The options every example takes: --server, --port, --token-file, --device, --out,
    --start-timeout (checked by :func:`check_server_args`)."""
    p.add_argument(
        "--server", help="attach to this miserver (http://host:port) instead of starting one"
    )
    p.add_argument(
        "--port",
        type=int,
        default=0,
        help="the port on 127.0.0.1 of the server the example starts (default: a free one, "
        "printed at the start; while it runs, curl or an OpenAI client can use it too)",
    )
    p.add_argument(
        "--token-file",
        help="with --server: a file holding the trainer token's "
        "secret (the secret alone, not label:role:secret)",
    )
    p.add_argument(
        "--unix-socket",
        help="with --server on the same host: send the weights calls to the server's "
        "UNIX_SOCKET at this path instead of its TCP port (the chats still go to --server)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="where the self-started server loads the "
        "model: auto (CUDA when available), cpu, cuda, cuda:N. The trainer computes "
        "where the served weights are",
    )
    p.add_argument(
        "--out",
        default=default_out,
        help="folder for results.json, the plot, the server and audit logs "
        "(default: ./%(default)s, or in the home directory when . is read-only)",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for the model to be resident",
    )


def example_parser(
    doc: str, default_out: str, schedules: Sequence[str], short_help: str
) -> argparse.ArgumentParser:
    """An example's command line: its docstring's first paragraph as the description, the
    :func:`add_server_args` options, ``--schedule`` (``short`` on the CPU, ``full`` on CUDA by
    default; ``short_help`` says what the short one does) and ``--max-steps``."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_server_args(p, default_out)
    p.add_argument(
        "--schedule",
        choices=sorted(schedules),
        default=None,
        help=f"short ({short_help}) or full (GPU); default: short on the CPU, full on CUDA",
    )
    p.add_argument("--max-steps", type=int, help="override the schedule's step count")
    return p


def check_server_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors of :func:`add_server_args`' options (``p.error``: exit status 2)."""
    if args.server and not args.token_file:
        p.error("--server needs --token-file")
    if args.token_file and not args.server:
        p.error("--token-file goes with --server")
    if getattr(args, "unix_socket", None) and not args.server:
        p.error("--unix-socket goes with --server (the server the example starts is on TCP)")
    if args.port and args.server:
        p.error("--port is for the server the example starts; --server names its own")
    if not 0 <= args.port <= 65535:
        p.error(f"--port {args.port}: not a port (1 to 65535, or 0 for a free one)")


def resolve_device(device: str) -> str:
    if device != "auto":
        return "cuda:0" if device == "cuda" else device
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def out_dir(given: str, default: str) -> Path:
    """``--out``, made; the default falls back to the home directory when . is read-only (the
    container image)."""
    out = Path(given)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except PermissionError:
        if given != default:
            raise
        out = Path.home() / default
        out.mkdir(parents=True, exist_ok=True)
    return out


def default_miserver_home() -> str:
    """``MISERVER_HOME`` from the environment, else miserver's default home."""
    from miserver.spec.settings import default_home

    return os.environ.get("MISERVER_HOME") or default_home()


@dataclass(frozen=True)
class Connection:
    """The server an example trains: its URL, the trainer token, the :class:`LocalServer` the
    example started (None with ``--server``), its ``MISERVER_HOME`` (None with ``--server``:
    that server's home is not the example's to read) and ``--unix-socket`` (the weights calls'
    path, or None for TCP)."""

    base: str
    token: str
    server: LocalServer | None
    home: str | None
    unix_socket: str | None = None


def connect(
    stack: contextlib.ExitStack,
    args: argparse.Namespace,
    out: Path,
    device: str,
    stop: StopRequest,
    extra_env: Mapping[str, str] | None = None,
) -> Connection:
    """Start the example's server (or take ``--server``'s) and wait until the model is resident.

    The started server stops when ``stack`` closes. Raises SetupError (an empty token file, a
    server that exits or never serves) and KeyboardInterrupt (a stop requested while waiting).
    """
    server = None
    home = None
    if args.server:
        base = args.server.rstrip("/")
        token = Path(args.token_file).read_text().strip()
        if not token:
            raise SetupError(f"{args.token_file} is empty")
    else:
        home = default_miserver_home()
        server = stack.enter_context(
            LocalServer(
                device=device,
                home=home,
                log_path=out / "server.log",
                watchdog_ms=CPU_WATCHDOG_MS if device == "cpu" else None,
                audit_path=out / "audit.jsonl",
                port=args.port,
                extra_env=extra_env,
            )
        )
        base, token = server.base, server.token
        print(f"started miserver on {base} (device {device}, log {out / 'server.log'})", flush=True)
    wait_until_ready(base, args.start_timeout, server, stop)
    return Connection(base, token, server, home, getattr(args, "unix_socket", None))


def run_example(
    name: str,
    out: Path,
    device: str,
    train: Callable[[StopRequest], dict[str, Any]],
    plot: Callable[[dict[str, Any], Path], None],
    table: Callable[[dict[str, Any]], str],
    epilogue: Callable[[dict[str, Any]], str] | None = None,
) -> int:
    """Run ``train`` (it starts or reaches the server and returns the results) under a
    :class:`StopRequest`, then write ``results.json`` and ``<name>.png`` to ``out``, print the
    table, the notes and ``epilogue``'s text.

    Returns the exit status: 0 when ``results["summary"]["passed"]``, 1 when not, 2 on a
    SetupError (printed as ``name: message``), 130 when interrupted.
    """
    stop = StopRequest()
    stop.install()
    try:
        results = train(stop)
    except SetupError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    results["summary"]["device"] = device
    (out / "results.json").write_text(json.dumps(results, indent=1))
    png = out / f"{name}.png"
    try:
        plot(results, png)
        wrote = f"{out / 'results.json'} and {png}"
    except ImportError:
        wrote = f"{out / 'results.json'} (no plot: pip install matplotlib)"
    print(table(results))
    for note in results["summary"]["notes"]:
        print(f"note: {note}")
    if epilogue is not None:
        print(epilogue(results))
    print(f"wrote {wrote}")
    if results["summary"]["interrupted"]:
        return 130
    return 0 if results["summary"]["passed"] else 1


# --- the trainer's side ------------------------------------------------------------------------
def check_attachment(att: Any, notes: list[str], what: str) -> None:
    """Refuse an attachment the example cannot train (another model, a torn set) with a
    SetupError; note commits the served weights already carried. ``what``: the example's aim,
    for the message ("this demo teaches")."""
    if att.model_ref.get("name") != MODEL:
        raise SetupError(
            f"the server serves {att.model_ref.get('name')!r}; {what} {MODEL!r} (load it first)"
        )
    if att.weights_state != "clean":
        raise SetupError(
            f"the served weights are {att.weights_state}; recover "
            "with POST /api/weights/load first (docs/operations.md)"
        )
    if att.steps_since_load:
        notes.append(
            f"the served weights already carried {att.steps_since_load} commits when the "
            "trainer attached"
        )


def fused_if_supported(device: Any) -> dict[str, bool]:
    """``fused=True`` for AdamW where torch has the fused kernel (CPU and CUDA): on the CPU the
    fused step over bfloat16 parameters is several times faster than the foreach one."""
    return {"fused": True} if device.type in ("cpu", "cuda") else {}


def json_or_raise(r: requests.Response) -> dict[str, Any]:
    """The JSON object of a 200 answer; any other answer raises SetupError naming the route,
    the status and the error body."""
    try:
        body = r.json()
    except ValueError:
        body = None
    if r.status_code != 200 or not isinstance(body, dict):
        err = body.get("error") if isinstance(body, dict) else None
        raise SetupError(
            f"{r.request.method} {r.url} answered {r.status_code}: {err or r.text[:300]}"
        )
    return body


def parse_served_by(value: str | None) -> tuple[str | None, str | None, int | None]:
    """``X-miLLM-Model`` -> (served name, origin, commits); Nones when absent or malformed."""
    if not value:
        return None, None, None
    from miserver.http.model_header import parse_model_header

    try:
        return parse_model_header(value)
    except ValueError:
        return None, None, None


def fmt(v: Any, unit: str = "", digits: int = 3) -> str:
    """A table cell: "-" for None, a float with ``digits`` decimals, anything else as is;
    ``unit`` appended."""
    if v is None:
        return "-"
    return f"{v:.{digits}f}{unit}" if isinstance(v, float) else f"{v}{unit}"


def table_text(rows: Sequence[str], summary: Sequence[tuple[str, str]]) -> str:
    """A results table: ``rows``, a blank line, then the summary's ``(label, value)`` pairs
    with the values aligned."""
    width = max(len(k) for k, _ in summary)
    return "\n".join([*rows, "", *(f"{k:<{width}}  {v}" for k, v in summary)])


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, nearest rank); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]
