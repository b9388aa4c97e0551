"""Serving under training: chat latency and tokens/s with no trainer, and with a trainer
committing as fast as it can, in one run, on the embedded default model (docs/benchmarks.md,
section "Serving under training")::

    python benchmarks/serving_under_training.py [--home DIR] [--requests 40] [--max-tokens 64]
                                                [--out DIR]

A real ``miserver serve`` process (the embedded default, SmolLM2-135M-Instruct in bfloat16,
imported on first start into ``--home`` or a fresh temporary home; ``DEVICE=auto``: the GPU when
there is one, else the CPU with ``WEIGHTS_CPU_ATTACH=1``) serves ``POST /v1/chat/completions``
(streamed, greedy, one request at a time from one client). Phases, in this order:

1. **no trainer**: ``--requests`` chat requests.
2. **trainer committing**: a trainer process (``--role trainer``) attaches over HTTP, rebuilds
   the weights (:func:`miserver.trainer.rebuild`) and loops as fast as it can: quiesce,
   commit-begin, a small in-place write (the final norm's weight multiplied by 1, so answers stay
   comparable), synchronize, commit-end, resume. The same requests are sent meanwhile.
3. **no trainer, after**: the trainer detached; the same requests again (drift check).

Per phase: failed requests, latency and time to first token (p50, p99), tokens/s (completion
tokens over the phase's wall time) and, for phase 2, the commits made and the barrier cycle.
Exit status 0 when no request failed, the trainer committed, and every phase's greedy answers
are identical (the writes leave the values unchanged).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from weight_sync import (  # noqa: E402 - the sibling benchmark's client and helpers
    REPO,
    TOKEN_LABEL,
    TOKEN_SECRET,
    HttpFailure,
    KeepAliveClient,
    child_env,
    free_port,
    get_json,
    percentile,
    stop_process,
    sync,
    timed_barrier,
    wait_until,
)

MODEL = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
PHASES = ("no trainer", "trainer committing", "no trainer, after")


# --- the trainer process ------------------------------------------------------------------------
def trainer_main(port: int) -> None:
    """Attach, then commit as fast as possible until a line arrives on stdin; print a JSON
    report (commits, cycle and barrier-call times, refusals by code) on stdout."""
    import torch

    from miserver import trainer

    client = KeepAliveClient(port, TOKEN_SECRET)
    body = client.post("/api/weights/attach")
    client.attachment = body["attachment_id"]
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    cycles, quiesces, rests, refusals = [], [], [], {}
    end: dict = {}
    with trainer.rebuild(body) as weights:
        norm = weights.tensors.get("model.norm.weight")
        if norm is None:  # any 1-D parameter will do
            norm = next(t for t in weights.unique_tensors() if t.dim() == 1)
        device = str(norm.device)

        def write(t: torch.Tensor = norm) -> None:
            with torch.no_grad():
                t.mul_(1.0)
            sync(device)

        print("attached", flush=True)
        last_beat = time.monotonic()
        started = time.perf_counter()
        while not stop.is_set():
            if time.monotonic() - last_beat > 2.0:
                client.post("/api/weights/heartbeat")
                last_beat = time.monotonic()
            t0 = time.perf_counter()
            try:
                times, _, end = timed_barrier(client, write)
            except HttpFailure as exc:
                code = exc.error.get("code", str(exc.status))
                refusals[code] = refusals.get(code, 0) + 1
                if client.post("/api/weights/status", "GET")["barrier"] == "quiesced":
                    client.post("/api/weights/resume")
                continue
            cycles.append(time.perf_counter() - t0)
            quiesces.append(times[0])  # waits for the running request (the drain)
            rests.append(sum(times[1:]))  # commit-begin, commit-end, resume
        elapsed = time.perf_counter() - started
        del norm, write
    client.post("/api/weights/detach")
    client.close()
    ms = [x * 1e3 for x in cycles]
    qs = [x * 1e3 for x in quiesces]
    rs = [x * 1e3 for x in rests]
    print(
        json.dumps(
            {
                "commits": len(cycles),
                "seconds": elapsed,
                "commits_per_s": len(cycles) / elapsed,
                "cycle_p50_ms": percentile(ms, 50),
                "cycle_p99_ms": percentile(ms, 99),
                "quiesce_p50_ms": percentile(qs, 50),
                "quiesce_p99_ms": percentile(qs, 99),
                "other_calls_p50_ms": percentile(rs, 50),
                "other_calls_p99_ms": percentile(rs, 99),
                "steps_since_load": end.get("steps_since_load"),
                "refusals": refusals,
            }
        ),
        flush=True,
    )


# --- the load generator (this process) ----------------------------------------------------------
def chat(port: int, max_tokens: int, timeout: float = 60.0) -> dict[str, Any]:
    """One streamed greedy chat completion: start time, TTFT, latency (s), tokens, text, the
    millm_model of the terminal chunk, and an error string when it failed."""
    body = {
        "model": MODEL,
        "messages": PROMPT,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    out: dict[str, Any] = {
        "start": t0,
        "ttft": None,
        "tokens": 0,
        "text": "",
        "model": None,
        "error": None,
    }
    parts = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = str(chunk["error"])
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
                if chunk.get("millm_model"):
                    out["model"] = chunk["millm_model"]
                for choice in chunk.get("choices", ()):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if out["ttft"] is None:
                            out["ttft"] = time.perf_counter() - t0
                        parts.append(piece)
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, never fatal
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["latency"] = time.perf_counter() - t0
    out["text"] = "".join(parts)
    return out


def run_phase(name: str, port: int, n: int, max_tokens: int, timeout: float) -> dict[str, Any]:
    """``n`` requests one after another; stops early after 3 failures in a row."""
    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []
    for _ in range(n):
        results.append(chat(port, max_tokens, timeout))
        if len(results) >= 3 and all(r["error"] for r in results[-3:]):
            print(
                f"{name}: 3 failures in a row, phase stopped: {results[-1]['error']}",
                file=sys.stderr,
                flush=True,
            )
            break
    wall = time.perf_counter() - t0
    print(
        f"[{name}] {len(results)} requests, {sum(bool(r['error']) for r in results)} failed, "
        f"{wall:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    n = len(results)
    ok = [r for r in results if r["error"] is None]
    lat = [r["latency"] * 1e3 for r in ok]
    ttft = [r["ttft"] * 1e3 for r in ok if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "requests": n,
        "failed": n - len(ok),
        "wall_s": wall,
        "latency_p50_ms": percentile(lat, 50),
        "latency_p99_ms": percentile(lat, 99),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "texts": sorted({r["text"] for r in ok}),
        "served_by": sorted({r["model"] for r in ok if r["model"]}),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
        "timeline": [(r["start"], r["latency"] * 1e3) for r in results],
    }


def start_server(home: str, workdir: Path) -> tuple[subprocess.Popen, int, Path]:
    import torch

    port = free_port()
    log_path = workdir / "miserver.log"
    env = child_env(
        MISERVER_HOME=home,
        HOST="127.0.0.1",
        PORT=str(port),
        DEVICE="auto",
        WEIGHTS_TOKENS=f"{TOKEN_LABEL}:trainer:{TOKEN_SECRET}",
        WEIGHTS_CPU_ATTACH="0" if torch.cuda.is_available() else "1",
        LOG_LEVEL="info",
        LOG_FORMAT="json",
    )
    env.pop("DEFAULT_MODEL", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "miserver.cli", "serve"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )

    def ready() -> bool:
        return get_json(port, "/api/weights/status")["data"]["resident_model"] is not None

    try:
        wait_until(ready, proc, f"miserver serve (log {log_path})", timeout=1200)
    except BaseException:
        stop_process(proc)
        sys.stderr.write(log_path.read_text(errors="replace")[-4000:])
        raise
    return proc, port, log_path


def _commits(header: str) -> int:
    """The commits= parameter of an X-miLLM-Model value (-1 when absent)."""
    for part in header.split(";"):
        if part.startswith("commits="):
            return int(part.removeprefix("commits="))
    return -1


def render(phases: dict[str, dict[str, Any]], report: dict[str, Any], head: str) -> str:
    base = phases[PHASES[0]]
    lines = [
        head,
        "",
        "| phase | requests (failed) | latency p50 ms | latency p99 ms | TTFT p50 ms | "
        "TTFT p99 ms | tokens/s | tokens/s vs no trainer | commits (per s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in PHASES:
        p = phases[name]
        commits = (
            f"{report['commits']} ({report['commits_per_s']:.1f}/s)" if name == PHASES[1] else "0"
        )
        lines.append(
            f"| {name} | {p['requests']} ({p['failed']}) | {p['latency_p50_ms']:.1f} | "
            f"{p['latency_p99_ms']:.1f} | {p['ttft_p50_ms']:.1f} | {p['ttft_p99_ms']:.1f} | "
            f"{p['tokens_per_s']:.1f} | {p['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
            f"{commits} |"
        )
    refusals = ", ".join(f"{k} {v}" for k, v in report["refusals"].items()) or "none"
    lines += [
        "",
        f"Trainer: {report['commits']} commits in {report['seconds']:.1f} s; barrier cycle "
        f"(quiesce .. resume, write included) p50 {report['cycle_p50_ms']:.2f} ms, p99 "
        f"{report['cycle_p99_ms']:.2f} ms; of it quiesce (waits for the running "
        f"request) p50 {report['quiesce_p50_ms']:.2f} ms, p99 "
        f"{report['quiesce_p99_ms']:.2f} ms, and commit-begin + commit-end + resume p50 "
        f"{report['other_calls_p50_ms']:.2f} ms, p99 {report['other_calls_p99_ms']:.2f} ms; "
        f"refused calls: {refusals}; steps_since_load at the end: "
        f"{report['steps_since_load']}.",
    ]
    served = sorted(phases[PHASES[1]]["served_by"], key=_commits)
    if served:
        lines.append(
            f"Answers during training were served by {len(served)} different "
            f"parameter sets (X-miLLM-Model), from `{served[0]}` to `{served[-1]}`."
        )
    return "\n".join(lines) + "\n"


def plot(phases: dict[str, dict[str, Any]], path: Path) -> None:
    """Each request's latency against the time it started, one colour per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(t for p in phases.values() for t, _ in p["timeline"])
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for name, p in phases.items():
        ax.plot(
            [t - t0 for t, _ in p["timeline"]], [ms for _, ms in p["timeline"]], ".", label=name
        )
    ax.set_xlabel("time (s)")
    ax.set_ylabel("chat latency (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Chat latency with and without a trainer committing")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--home",
        default=None,
        help="MISERVER_HOME (default: a fresh temporary one; the default model is "
        "imported on first start)",
    )
    ap.add_argument("--requests", type=int, default=40, help="chat requests per phase")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=60.0,
        help="seconds before a chat request counts as failed",
    )
    ap.add_argument("--out", default=None, help="folder for serving_under_training.md/.json/.png")
    ap.add_argument("--role", choices=("trainer",), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "trainer":
        trainer_main(args.port)
        return 0

    import torch

    workdir = Path(tempfile.mkdtemp(prefix="miserver-serving-under-training-"))
    home = args.home or str(workdir / "home")
    dest = Path(args.out) if args.out else None
    if dest is not None:
        dest.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def progress(text: str) -> None:
        print(f"[{time.perf_counter() - started:5.0f} s] {text}", file=sys.stderr, flush=True)

    progress("starting miserver serve (imports the default model on first start)")
    proc, port, log_path = start_server(home, workdir)
    load_s = time.perf_counter() - started
    progress(f"server ready on port {port}")
    phases: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {}
    trainer_proc = None
    trainer_log = workdir / "trainer.log"
    try:
        for _ in range(3):  # warm-up
            chat(port, args.max_tokens, args.request_timeout)
        phases[PHASES[0]] = run_phase(
            PHASES[0], port, args.requests, args.max_tokens, args.request_timeout
        )
        with open(trainer_log, "wb") as tlog:
            trainer_proc = subprocess.Popen(
                [sys.executable, __file__, "--role", "trainer", "--port", str(port)],
                env=child_env(),
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=tlog,
                text=True,
            )
        if trainer_proc.stdout.readline().strip() != "attached":
            raise RuntimeError(f"the trainer did not attach: {trainer_log.read_text()[-2000:]}")
        progress("trainer attached and committing")
        phases[PHASES[1]] = run_phase(
            PHASES[1], port, args.requests, args.max_tokens, args.request_timeout
        )
        trainer_proc.stdin.write("stop\n")
        trainer_proc.stdin.flush()
        out, _ = trainer_proc.communicate(timeout=120)
        if trainer_proc.returncode != 0:
            raise RuntimeError(f"the trainer failed: {trainer_log.read_text()[-2000:]}")
        report = json.loads(out.strip().splitlines()[-1])
        progress(f"trainer detached after {report['commits']} commits")
        phases[PHASES[2]] = run_phase(
            PHASES[2], port, args.requests, args.max_tokens, args.request_timeout
        )
    finally:
        if trainer_proc is not None and trainer_proc.poll() is None:
            trainer_proc.kill()
        stop_process(proc)
        if dest is not None:  # the ends of the logs, for a run on a machine one cannot visit
            for src in (log_path, trainer_log):
                if src.exists():
                    with open(src, "rb") as f:
                        f.seek(max(0, src.stat().st_size - 2_000_000))
                        (dest / f"{src.stem}.log.tail").write_bytes(f.read())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        where = f"{props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, CUDA IPC"
    else:
        where = (
            f"CPU ({os.cpu_count()} cores), torch {torch.__version__}, CPU shared memory "
            "(WEIGHTS_CPU_ATTACH=1)"
        )
    head = (
        f"{where}; `miserver serve` with the embedded default ({MODEL}, bfloat16); one "
        f"client, streamed greedy chat, max_tokens {args.max_tokens}, {args.requests} "
        f"requests per phase after 3 warm-ups; server start (import and load) "
        f"{load_s:.0f} s; {time.perf_counter() - started:.0f} s in all."
    )
    table = render(phases, report, head)
    same = len({t for p in phases.values() for t in p["texts"]}) == 1
    table += f"Greedy answers identical in every phase: {'yes' if same else 'NO'}.\n"
    print(table)
    if dest is not None:
        (dest / "serving_under_training.md").write_text(table)
        (dest / "serving_under_training.json").write_text(
            json.dumps({"phases": phases, "trainer": report}, indent=1)
        )
        plot(phases, dest / "serving_under_training.png")
    failed = sum(p["failed"] for p in phases.values())
    for p in phases.values():
        for e in p["errors"]:
            print(f"request error: {e}", file=sys.stderr)
    if not args.home:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"server log: {log_path}", file=sys.stderr)
    ok = failed == 0 and report.get("commits", 0) > 0 and same
    if not ok:
        print(
            f"check FAILED: {failed} failed requests, {report.get('commits')} commits, "
            f"identical answers: {same}",
            file=sys.stderr,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
