"""The step barrier's latency through the trainer's client, beside the raw HTTP round trip.

One full cycle is ``with client.commit(): pass``: quiesce, commit-begin, (an empty write),
commit-end, resume, through :class:`miserver.trainer.WeightsClient` on loopback. Beside it, in
the same run and interleaved sample by sample, the round trip of ``GET /api/weights/status`` on
the same server over a bare keep-alive ``http.client`` connection (the raw HTTP round trip, RTT)
and through the client, and of one gated call (``POST /heartbeat``: token,
attachment, lifecycle lock, audit line), and each of the four calls on its own. The target is a full cycle
within 4 round trips plus 0.5 ms at p50; the table gives the ratio (below 1.0 meets it).

The server is a real ``miserver serve`` process serving the embedded default model on the CPU in
shared memory (``WEIGHTS_CPU_ATTACH=1``); no request is running, so the drain is immediate and
the cycle measures the barrier itself. Prints a markdown table::

    python benchmarks/barrier.py [--cycles 500] [--home MISERVER_HOME] [--out table.md]
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-trainer-secret-0123456789"


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) of ``xs`` by linear interpolation."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(home: str, log: Path) -> tuple[subprocess.Popen, str]:
    import requests

    port = free_port()
    env = dict(
        os.environ,
        MISERVER_HOME=home,
        PORT=str(port),
        DEVICE="cpu",
        WEIGHTS_CPU_ATTACH="1",
        WEIGHTS_TOKENS=f"bench:trainer:{TOKEN}",
        LOG_FORMAT="json",
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "miserver.cli", "serve"],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"miserver serve exited:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(url + "/api/health/detailed", timeout=5).json()["data"]["resident"]:
                return proc, url
        except (requests.RequestException, ValueError, KeyError):
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not load its model in 300 s")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0


def measure(url: str, cycles: int, warmup: int) -> dict[str, list[float]]:
    from miserver.trainer import WeightsClient

    client = WeightsClient(url, TOKEN, timeout=60)
    client.attach()

    def cycle() -> None:
        with client.commit():
            pass

    host, port = url.removeprefix("http://").split(":")
    raw = http.client.HTTPConnection(host, int(port), timeout=60)  # keep-alive, no library

    def raw_status() -> None:
        raw.request("GET", "/api/weights/status")
        resp = raw.getresponse()
        resp.read()
        assert resp.status == 200

    samples: dict[str, list[float]] = {
        k: []
        for k in (
            "raw",
            "status",
            "heartbeat",
            "cycle",
            "quiesce",
            "commit_begin",
            "commit_end",
            "resume",
        )
    }
    try:
        for i in range(warmup + cycles):
            row = {
                "raw": timed(raw_status),
                "status": timed(client.status),
                "heartbeat": timed(client.heartbeat),
                "cycle": timed(cycle),
                "quiesce": timed(client.quiesce),
                "commit_begin": timed(client.commit_begin),
                "commit_end": timed(client.commit_end),
                "resume": timed(client.resume),
            }
            if i >= warmup:
                for k, v in row.items():
                    samples[k].append(v)
    finally:
        client.close()
        raw.close()
    return samples


def table(samples: dict[str, list[float]]) -> str:
    rtt50, rtt99 = pct(samples["raw"], 50), pct(samples["raw"], 99)
    target50, target99 = 4 * rtt50 + 0.5, 4 * rtt99 + 0.5
    rows = [
        ("GET /api/weights/status, raw round trip (http.client)", "raw", None),
        ("GET /api/weights/status through the client", "status", None),
        ("POST /heartbeat (one gated call)", "heartbeat", None),
        ("quiesce", "quiesce", None),
        ("commit-begin", "commit_begin", None),
        ("commit-end", "commit_end", None),
        ("resume", "resume", None),
        ("**full cycle** (client.commit(), empty write)", "cycle", (target50, target99)),
    ]
    out = [
        "| call | p50 ms | p99 ms | p50 / round trip | vs 4 RTT + 0.5 ms (p50, p99) |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, key, target in rows:
        xs = samples[key]
        p50, p99 = pct(xs, 50), pct(xs, 99)
        ratio = (
            f"{p50 / target[0]:.2f}x of {target[0]:.2f} ms, {p99 / target[1]:.2f}x of "
            f"{target[1]:.2f} ms"
            if target
            else ""
        )
        out.append(f"| {label} | {p50:.3f} | {p99:.3f} | {p50 / rtt50:.2f} | {ratio} |")
    n = len(samples["cycle"])
    out.append("")
    out.append(
        f"{n} interleaved samples each; target: full cycle p50 <= 4 x RTT p50 + 0.5 ms = "
        f"{target50:.2f} ms ({'met' if pct(samples['cycle'], 50) <= target50 else 'NOT met'}"
        f"); {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}."
    )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument(
        "--home",
        default=os.environ.get("MISERVER_HOME")
        or str(Path(tempfile.gettempdir()) / f"miserver-bench-home-{os.getuid()}"),
        help="MISERVER_HOME (the default model is imported there once)",
    )
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args()

    from miserver.serving.models.default_model import import_default

    import_default(args.home, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(args.home, Path(tmp) / "server.log")
        try:
            samples = measure(url, args.cycles, args.warmup)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    text = table(samples)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
