"""The GGUF row's overhead: miserver serving ``smollm2-135m-instruct-q4`` through llama.cpp
(contract 4a) against llama.cpp's own server from the same library (``xllamacpp.Server``, its
HTTP endpoint), same file, same settings, same requests, in one run.

Both servers run as subprocesses at once, each with ``--threads`` llama.cpp threads,
``--parallel`` slots over one unified KV cache of the file's context (what miserver gives
llama.cpp: ``GGUF_THREADS``, ``MAX_BATCH_SIZE``), and are measured in turns (miserver, then
llama.cpp, then miserver, ...) so background load hits both alike; medians are reported.

Rows: one chat (batch 1, greedy, ``--tokens`` tokens: tokens/s of the completion),
``--concurrent`` chats sent at once (total completion tokens / wall time of the whole set), and
on miserver one chat asking for ``n = --concurrent`` choices (how ``n`` runs on a GGUF
resident: in llama.cpp's parallel slots; compare with ``--concurrent`` times one chat's rate for
what running them one after another would give). The
ratio column is miserver's tokens/s over llama.cpp's (the target: at least 0.90, issue 31).
Each request is ``POST /v1/chat/completions`` with the same body on both servers; the token
counts are each server's own ``usage``.

``--before DIR`` adds a third server in the same turns: miserver run from another checkout
(``DIR``, for instance ``git archive`` of the commit before a change), so a change is measured
side by side with what it replaced and with llama.cpp, under the same load.

Usage::

    python benchmarks/gguf_peers.py [--home DIR] [--tokens 64] [--repeats 3] [--concurrent 16]
        [--before DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
Q4 = "smollm2-135m-instruct-q4"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chat(base: str, model: str, tokens: int, seed: int, n: int = 1) -> int:
    """One non-streamed greedy chat with ``n`` choices; returns its completion tokens."""
    body = {
        "model": model,
        "messages": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "seed": seed,
        "n": n,
    }
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=900) as resp:
        return int(json.loads(resp.read())["usage"]["completion_tokens"])


def _rate(base: str, model: str, tokens: int, k: int) -> float:
    """Completion tokens per second of ``k`` chats sent at once (k = 1: one chat)."""
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(k) as pool:
        done = sum(pool.map(lambda i: _chat(base, model, tokens, i), range(k)))
    return done / (time.perf_counter() - t0)


def _rate_n(base: str, model: str, tokens: int, n: int) -> float:
    """Completion tokens per second of one chat asking for ``n`` choices."""
    t0 = time.perf_counter()
    done = _chat(base, model, tokens, 0, n)
    return done / (time.perf_counter() - t0)


def _wait(base: str, path: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{base} exited: {log.read_text(errors='replace')[-2000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{base} not ready: {log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(f"{base}{path}", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)


def llama_server(path: str, port: int, threads: int, parallel: int) -> None:
    """Run llama.cpp's own server (``xllamacpp.Server``) on ``port`` until killed, configured as
    miserver configures it (:class:`miserver.serving.models.gguf.GGUFModel`)."""
    import xllamacpp as xlc

    from miserver.serving.models.gguf import gguf_context_length

    params = xlc.CommonParams()
    params.model.path = path
    params.n_ctx = gguf_context_length(path)
    params.n_parallel = parallel
    params.kv_unified = True
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.hostnames = ["127.0.0.1"]
    params.port = port
    params.verbosity = -1
    params.warmup = False
    server = xlc.Server(params)
    print(f"llama.cpp listening on {server.listening_address}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", help="a MISERVER_HOME with the imported default (else a temp one)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--before", help="also run miserver from this checkout (side by side)")
    ap.add_argument("--llama-server", nargs=2, metavar=("PATH", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo))
    if args.llama_server:
        llama_server(args.llama_server[0], int(args.llama_server[1]), args.threads, args.concurrent)
        return 0

    import tempfile

    from miserver.serving.models.catalogue import Catalogue
    from miserver.serving.models.default_model import import_default

    home = args.home or str(Path(tempfile.gettempdir()) / "miserver-bench-gguf")
    import_default(home, progress=False)
    row = Catalogue(home).get_by_name(Q4)
    assert row is not None, f"no {Q4} row in {home}"
    logs = Path(tempfile.mkdtemp(prefix="gguf-peers-"))
    env = dict(
        os.environ,
        MISERVER_HOME=home,
        DEVICE="cpu",
        DEFAULT_MODEL=Q4,
        GGUF_THREADS=str(args.threads),
        MAX_BATCH_SIZE=str(args.concurrent),
        MAX_QUEUED_REQUESTS=str(max(64, args.concurrent)),
        LOG_FORMAT="text",
        LOG_LEVEL="warning",
        PYTHONPATH=str(repo),
    )
    env.pop("WEIGHTS_TOKENS", None)
    mi_port, ll_port, before_port = _free_port(), _free_port(), _free_port()
    mi_log, ll_log, before_log = logs / "miserver.log", logs / "llama.log", logs / "before.log"
    with mi_log.open("wb") as out:
        mi = subprocess.Popen(
            [sys.executable, "-m", "miserver.cli", "serve", "--port", str(mi_port)],
            env=env,
            stdout=out,
            stderr=out,
        )
    before = None
    if args.before:
        with before_log.open("wb") as out:
            before = subprocess.Popen(
                [sys.executable, "-m", "miserver.cli", "serve", "--port", str(before_port)],
                env={**env, "PYTHONPATH": str(Path(args.before).resolve())},
                cwd=args.before,
                stdout=out,
                stderr=out,
            )
    with ll_log.open("wb") as out:
        ll = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--llama-server",
                row.path,
                str(ll_port),
                "--threads",
                str(args.threads),
                "--concurrent",
                str(args.concurrent),
            ],
            env=env,
            stdout=out,
            stderr=out,
        )
    peers = {
        "miserver (q4 row)": (f"http://127.0.0.1:{mi_port}", Q4),
        "llama.cpp server": (f"http://127.0.0.1:{ll_port}", "q4"),
    }
    if before is not None:
        peers["miserver (before)"] = (f"http://127.0.0.1:{before_port}", Q4)
    minis = [name for name in peers if name.startswith("miserver")]
    try:
        _wait(peers["miserver (q4 row)"][0], "/api/health/ready", mi, mi_log)
        _wait(peers["llama.cpp server"][0], "/health", ll, ll_log)
        if before is not None:
            _wait(peers["miserver (before)"][0], "/api/health/ready", before, before_log)
        for base, model in peers.values():  # warm both (first-touch of the mapped file)
            _chat(base, model, 4, 0)
        results: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.repeats):
            for k in (1, args.concurrent):
                for name, (base, model) in peers.items():
                    results.setdefault((name, k), []).append(_rate(base, model, args.tokens, k))
            for name in minis:
                base, model = peers[name]
                results.setdefault((name, -1), []).append(
                    _rate_n(base, model, args.tokens, args.concurrent)
                )
    finally:
        for proc in (mi, ll, before):
            if proc is None:
                continue
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(
        f"\n{Q4} on {args.threads} threads, {args.tokens} tokens a chat, greedy, "
        f"median of {args.repeats} (runs interleaved)\n"
    )
    print(f"| {'chats at once':>13} | {'server':<18} | {'tokens/s':>9} | {'vs llama.cpp':>12} |")
    print(f"|{'-' * 15}|{'-' * 20}|{'-' * 11}|{'-' * 14}|")
    for k in (1, args.concurrent):
        ref = statistics.median(results[("llama.cpp server", k)])
        for name in peers:
            rate = statistics.median(results[(name, k)])
            print(f"| {k:>13} | {name:<18} | {rate:>9.1f} | {rate / ref:>12.2f} |")
    ref = statistics.median(results[("llama.cpp server", args.concurrent)])
    label = f"n={args.concurrent}"
    for name in minis:
        rate = statistics.median(results[(name, -1)])
        print(f"| {label:>13} | {name:<18} | {rate:>9.1f} | {rate / ref:>12.2f} |")
    print(
        f"\nn={args.concurrent}: one request for {args.concurrent} choices on miserver (its "
        "choices share llama.cpp's parallel slots), against llama.cpp's "
        f"{args.concurrent} concurrent chats."
    )
    print(f"\nlogs: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
