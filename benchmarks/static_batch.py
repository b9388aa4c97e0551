"""The static batch (issue 14): concurrent chats and a Batch API job at several MAX_BATCH_SIZE.

For each ``MAX_BATCH_SIZE`` in ``--sizes`` the benchmark starts a ``miserver serve`` on the
embedded default (SmolLM2-135M-Instruct, bfloat16) with that setting, warms it with one chat,
then, in one run and through the official ``openai`` SDK:

- ``--clients`` chat clients at once, each one greedy chat of ``--tokens`` tokens (different
  prompts): the wall time until the last answer, and completion tokens a second;
- with ``--batch-rows`` above 0, a Batch API job of that many ``/v1/chat/completions`` rows of
  ``--row-tokens`` tokens each (upload, create, poll until ``completed``): rows a second and
  completion tokens a second.

Each size's figures are also given as a ratio to the first size's (``--sizes`` should start at
1): the runs share the machine's noise, the ratios are what to compare. Usage::

    python benchmarks/static_batch.py                                  # CPU: 16 chats, 1 vs 8
    python benchmarks/static_batch.py --device cuda --sizes 1,8,32,64 --clients 64 \\
        --batch-rows 512 --row-tokens 128 [--model ROW]                # the H200 run

``--home`` is a ``MISERVER_HOME`` (default: a temporary one importing the default).
"""

from __future__ import annotations

import argparse
import io
import json
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import start_server  # noqa: E402 - the sibling benchmark's server start

TOPICS = (
    "the sea",
    "a forest",
    "the moon",
    "a city at night",
    "a mountain",
    "rain",
    "a library",
    "the desert",
    "a garden",
    "winter",
    "a train",
    "the sun",
    "a river",
    "a market",
    "an old house",
    "the stars",
)


def _start(home: str, device: str, size: int) -> tuple[subprocess.Popen[bytes], str]:
    return start_server(
        home,
        device,
        extra_env={"MAX_BATCH_SIZE": str(size), "MAX_QUEUED_REQUESTS": "1024"},
        ready_timeout_s=600,
    )


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a few sentences about {TOPICS[i % len(TOPICS)]}."}]


def chats(client: Any, model: str, clients: int, tokens: int) -> tuple[float, int]:
    """``clients`` chats at once; returns (wall seconds until the last answer, tokens)."""

    def one(i: int) -> int:
        out = client.chat.completions.create(
            model=model, messages=_messages(i), max_tokens=tokens, temperature=0
        )
        return out.usage.completion_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(one, range(clients)))
    return time.perf_counter() - t0, sum(done)


def batch_job(client: Any, model: str, rows: int, tokens: int) -> tuple[float, int]:
    """A Batch API job of ``rows`` chat rows; returns (seconds to completed, tokens)."""
    lines = [
        json.dumps(
            {
                "custom_id": f"row-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": _messages(i),
                    "max_tokens": tokens,
                    "temperature": 0,
                },
            }
        )
        for i in range(rows)
    ]
    t0 = time.perf_counter()
    upload = client.files.create(
        file=("rows.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    elapsed = time.perf_counter() - t0
    if batch.status != "completed" or not batch.output_file_id:
        raise SystemExit(f"the batch ended {batch.status}: {batch.errors}")
    text = client.files.content(batch.output_file_id).text
    used = 0
    for line in text.splitlines():
        body = json.loads(line)["response"]["body"]
        used += body["usage"]["completion_tokens"]
    return elapsed, used


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", help="MISERVER_HOME (default: a temporary one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="catalogue row to serve")
    ap.add_argument("--sizes", default="1,8", help="MAX_BATCH_SIZE values, comma-separated")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch-rows", type=int, default=0)
    ap.add_argument("--row-tokens", type=int, default=128)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    from openai import OpenAI

    home = args.home
    if home is None:
        from miserver.serving.default_model import import_default

        home = tempfile.mkdtemp(prefix="miserver-bench-")
        import_default(home, progress=False)
    results = []
    for size in sizes:
        proc, base = _start(home, args.device, size)
        try:
            client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=3600)
            chats(client, args.model, 1, 4)  # warm-up
            wall, used = chats(client, args.model, args.clients, args.tokens)
            row = {"max_batch_size": size, "chat_wall_s": wall, "chat_tokens": used}
            if args.batch_rows:
                bwall, bused = batch_job(client, args.model, args.batch_rows, args.row_tokens)
                row.update(batch_wall_s=bwall, batch_tokens=bused)
            results.append(row)
            print(f"MAX_BATCH_SIZE={size}: {row}", file=sys.stderr, flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    base_row = results[0]
    head = f"{'MAX_BATCH_SIZE':>14} {'chats s':>9} {'chat tok/s':>11} {'x':>6}"
    if args.batch_rows:
        head += f" {'batch s':>9} {'rows/s':>8} {'tok/s':>8} {'x':>6}"
    print(
        f"{args.clients} concurrent chats of {args.tokens} tokens"
        + (
            f"; a Batch API job of {args.batch_rows} rows x {args.row_tokens} tokens"
            if args.batch_rows
            else ""
        )
        + f" ({args.model}, {args.device})"
    )
    print(head)
    for row in results:
        rate = row["chat_tokens"] / row["chat_wall_s"]
        line = (
            f"{row['max_batch_size']:>14} {row['chat_wall_s']:>9.2f} {rate:>11.1f} "
            f"{base_row['chat_wall_s'] / row['chat_wall_s']:>6.2f}"
        )
        if args.batch_rows:
            rows_s = args.batch_rows / row["batch_wall_s"]
            line += (
                f" {row['batch_wall_s']:>9.2f} {rows_s:>8.2f} "
                f"{row['batch_tokens'] / row['batch_wall_s']:>8.1f} "
                f"{base_row['batch_wall_s'] / row['batch_wall_s']:>6.2f}"
            )
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
