"""A trainer committing in a loop against long-tailed generations: ``finish`` against ``hold``
(issue 30, contract 4b; docs/benchmarks.md, section "Commit while sequences are in flight")::

    python benchmarks/inflight_commit.py [--home DIR] [--seconds 40] [--clients 16]
        [--device cpu|cuda] [--tail 16,24,...]

One in-process miserver (aiohttp test server; the embedded default, SmolLM2-135M-Instruct in
bfloat16, on ``--device`` (default the CPU), ``ENGINE=continuous``, ``WEIGHTS_CPU_ATTACH=1``)
serves ``--clients`` concurrent clients, each sending greedy chat requests one after another
whose ``max_tokens`` are drawn from ``--tail`` (default long-tailed, most short, one in eight
long: :data:`TAIL`; the GPU run of issue 34 uses ``--clients 64 --tail 2000``). A trainer loops: quiesce
(``finish`` in the first phase, ``{"running": "hold"}`` in the second), commit-begin, an in-place
write of the final norm (multiplied by 1, so answers stay comparable), commit-end, resume, then
a pause of ``--gap`` seconds (the trainer's own step). Per phase: the commits made, the time
from the quiesce call to resume's answer (p50, p99), and the tokens/s served (completion
tokens of the requests that ended in the phase over its wall time; and the tokens decoded in it,
finished or not, from the engine's counter: with 2,000-token generations few requests end in a
phase), and the engine steps that
ran while the quiesce call was in flight (the most over the phase: a ``hold`` quiesce returns
within one or two decode steps, a ``finish`` one after the running sequences end).

It prints a table; the ratios are hold over finish in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TRN = "trainer-secret-0123456789"
#: ``max_tokens`` of the clients' requests: a long tail (RL rollouts: most short, a few long).
TAIL = (16, 24, 24, 32, 32, 48, 64, 192)
PROMPT = "Count from 1 to 500, one number a line."


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


async def make_client(home: str, tmp: Path, device: str = "cpu") -> Any:
    from aiohttp.test_utils import TestClient, TestServer

    from miserver.http import keys
    from miserver.http.app import create_app
    from miserver.serving.models.catalogue import Catalogue
    from miserver.serving.models.default_model import import_default, model_dir
    from miserver.spec.settings import load_settings

    import_default(home, progress=False)
    fresh = tmp / "home"
    Catalogue(str(fresh)).register(
        name="tiny", format="safetensors", dtype="bfloat16", path=str(model_dir(home))
    )
    settings = load_settings(
        {
            "MISERVER_HOME": str(fresh),
            "DEFAULT_MODEL": "tiny",
            "DEVICE": device,
            "WEIGHTS_TOKENS": f"trn:trainer:{TRN}",
            "WEIGHTS_CPU_ATTACH": "1",
            "WEIGHTS_COMMIT_WATCHDOG_MS": "60000",
            "WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S": "600",
            "WEIGHTS_HEARTBEAT_TIMEOUT_S": "3600",  # the loop sends no heartbeats
        }
    )
    client = TestClient(TestServer(create_app(settings)))
    await client.start_server()
    await client.app[keys.STARTUP_LOAD]
    return client


async def call(client: Any, path: str, headers: dict[str, str], body: Any = None) -> dict:
    resp = await client.post(path, headers=headers, json=body)
    data = await resp.json()
    if resp.status != 200:
        raise RuntimeError(f"{path}: {resp.status} {data}")
    return data


async def serve_client(
    client: Any, rng: random.Random, stop: asyncio.Event, done: list, tail: tuple[int, ...]
) -> None:
    while not stop.is_set():
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": PROMPT}],
            "temperature": 0,
            "max_tokens": rng.choice(tail),
        }
        resp = await client.post("/v1/chat/completions", json=body)
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"chat: {resp.status} {data}")
        done.append((time.perf_counter(), data["usage"]["completion_tokens"]))


async def phase(client: Any, h: dict[str, str], mode: str, args: argparse.Namespace) -> dict:
    from miserver.http import keys

    resident = client.app[keys.HOST].resident
    norm = resident.model.model.norm.weight
    loop = resident.engine_loop
    stop = asyncio.Event()
    done: list[tuple[float, int]] = []
    rng = random.Random(0)
    clients = [
        asyncio.ensure_future(
            serve_client(client, random.Random(rng.random()), stop, done, args.tail)
        )
        for _ in range(args.clients)
    ]
    await asyncio.sleep(args.warmup)
    start = time.perf_counter()
    decoded0 = loop.stats()["decode_tokens"]
    cycles: list[float] = []
    parked: list[int] = []
    steps_in_quiesce: list[int] = []
    body = None if mode == "finish" else {"running": "hold"}
    while time.perf_counter() - start < args.seconds:
        t0 = time.perf_counter()
        steps0 = loop.steps
        answer = await call(client, "/api/weights/quiesce", h, body)
        steps_in_quiesce.append(loop.steps - steps0)
        parked.append(answer["data"]["parked_sequences"] or 0)
        await call(client, "/api/weights/commit-begin", h)
        import torch

        with torch.no_grad():
            norm.mul_(1.0)
        if norm.is_cuda:
            torch.cuda.synchronize(norm.device)
        await call(client, "/api/weights/commit-end", h)
        await call(client, "/api/weights/resume", h)
        cycles.append(time.perf_counter() - t0)
        await asyncio.sleep(args.gap)
    end = time.perf_counter()
    decoded = loop.stats()["decode_tokens"] - decoded0
    stop.set()
    await asyncio.gather(*clients)
    tokens = sum(k for t, k in done if start <= t <= end)
    return {
        "mode": mode,
        "commits": len(cycles),
        "p50_ms": 1000 * statistics.median(cycles) if cycles else float("nan"),
        "p99_ms": 1000 * percentile(cycles, 99),
        "parked_mean": statistics.mean(parked) if parked else 0.0,
        "quiesce_steps_max": max(steps_in_quiesce, default=0),
        "tokens_s": tokens / (end - start),
        "decoded_s": decoded / (end - start),
        "requests": sum(1 for t, _ in done if start <= t <= end),
    }


async def main_async(args: argparse.Namespace) -> int:
    home = args.home or str(Path(tempfile.gettempdir()) / "miserver-bench-default")
    with tempfile.TemporaryDirectory() as tmp:
        client = await make_client(home, Path(tmp), args.device)
        try:
            st = await call(client, "/api/weights/attach", {"Authorization": f"Bearer {TRN}"})
            h = {
                "Authorization": f"Bearer {TRN}",
                "X-miLLM-Attachment": st["data"]["attachment_id"],
            }
            rows = [await phase(client, h, mode, args) for mode in ("finish", "hold")]
            await call(client, "/api/weights/detach", h)
        finally:
            await client.close()
    fin, hold = rows
    print(
        f"{args.clients} clients, max_tokens drawn from {args.tail}, {args.seconds:g} s a "
        f"phase, trainer gap {args.gap:g} s, device {args.device}"
    )
    print(
        "| running | commits | quiesce->resume p50 ms | p99 ms | parked (mean) | "
        "engine steps inside a quiesce (max) | tokens/s (ended requests) | tokens decoded/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['commits']} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
            f"{r['parked_mean']:.1f} | {r['quiesce_steps_max']} | {r['tokens_s']:.1f} | "
            f"{r['decoded_s']:.1f} |"
        )
    print(
        f"| hold / finish | {hold['commits'] / max(fin['commits'], 1):.2f}x | "
        f"{hold['p50_ms'] / fin['p50_ms']:.2f}x | {hold['p99_ms'] / fin['p99_ms']:.2f}x | | | "
        f"{hold['tokens_s'] / max(fin['tokens_s'], 1e-9):.2f}x | "
        f"{hold['decoded_s'] / max(fin['decoded_s'], 1e-9):.2f}x |"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", help="MISERVER_HOME holding (or to import) the default model")
    parser.add_argument("--seconds", type=float, default=40.0, help="length of each phase")
    parser.add_argument("--clients", type=int, default=16, help="concurrent chat clients")
    parser.add_argument("--gap", type=float, default=0.5, help="trainer seconds between commits")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before measuring")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--tail",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        default=TAIL,
        help="comma-separated max_tokens the clients draw from (default the long tail)",
    )
    args = parser.parse_args()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
