"""Structured outputs' cost (issue 33): tokens/s of 16 concurrent chats with and without a JSON
schema, in one run against one ``miserver serve`` (the embedded default model)::

    python benchmarks/structured.py [--home DIR] [--device cpu] [--concurrency 16] [--tokens 64]

Each mode sends ``--concurrency`` chat requests at once (``MAX_BATCH_SIZE`` is set to that, so
they decode together in the engine's running batch) with ``max_tokens`` ``--tokens``, temperature 0.7 and a seed
per request: ``free`` with no ``response_format``, ``json_schema`` with a schema whose answers
are at least ``--tokens`` long (an array of strings of bounded length, so the grammar rarely
ends first). A warm-up request of each mode runs first (the schema's first request builds
llguidance's view of the tokenizer, seconds, once per model). The table gives completion tokens,
wall seconds, tokens/s, the server's CPU seconds per token (all its threads, from
``/proc/<pid>/stat``), and the json_schema / free ratios. On a shared machine the wall clock
measures the neighbours too: CPU time per token is the grammar's cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import _cpu_s, start_server  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "lines": {
            "type": "array",
            "items": {"type": "string", "maxLength": 60},
            "minItems": 12,
            "maxItems": 40,
        },
    },
    "required": ["title", "lines"],
    "additionalProperties": False,
}
TOPICS = [
    "the sea",
    "a lighthouse",
    "autumn",
    "a train",
    "the moon",
    "a garden",
    "rain",
    "a city",
    "mountains",
    "a river",
    "winter",
    "a library",
    "the desert",
    "a forest",
    "bread",
    "a bridge",
]


def _chat(base: str, i: int, tokens: int, schema: bool, out: list[int]) -> None:
    body: dict = {
        "model": "smollm2-135m-instruct",
        "messages": [
            {"role": "user", "content": f"Write a poem about {TOPICS[i % len(TOPICS)]} as JSON."}
        ],
        "max_tokens": tokens,
        "temperature": 0.7,
        "seed": i,
    }
    if schema:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "poem", "schema": SCHEMA, "strict": True},
        }
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=1800) as r:
        answer = json.loads(r.read())
    out[i] = answer["usage"]["completion_tokens"]


def run_mode(base: str, pid: int, n: int, tokens: int, schema: bool) -> tuple[int, float, float]:
    """``(completion tokens, wall s, server CPU s)`` of ``n`` concurrent chats."""
    counts = [0] * n
    threads = [
        threading.Thread(target=_chat, args=(base, i, tokens, schema, counts)) for i in range(n)
    ]
    cpu0, t0 = _cpu_s(pid), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), time.perf_counter() - t0, _cpu_s(pid) - cpu0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", help="MISERVER_HOME (default: the default home)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from miserver.serving.models.default_model import import_default
    from miserver.spec.settings import default_home

    home = args.home or default_home()
    import_default(home, progress=True)
    env = {
        "MAX_BATCH_SIZE": str(args.concurrency),
        "MAX_QUEUED_REQUESTS": str(4 * args.concurrency),
        "DEFAULT_MODEL": "smollm2-135m-instruct",
    }
    env.setdefault("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    proc, base = start_server(home, args.device, extra_env=env)
    try:
        for schema in (False, True):  # warm-up: first request of each mode
            _chat(base, 0, 4, schema, [0])
        rows = {}
        for name, schema in (("free", False), ("json_schema", True)):
            rows[name] = run_mode(base, proc.pid, args.concurrency, args.tokens, schema)
    finally:
        proc.terminate()
        proc.wait(30)
    print(
        f"\n{args.concurrency} concurrent chats, max_tokens {args.tokens}, device {args.device}\n"
    )
    print(f"{'mode':<12} {'tokens':>7} {'wall s':>8} {'tokens/s':>9} {'CPU ms/token':>13}")
    for name, (count, wall, cpu) in rows.items():
        print(f"{name:<12} {count:>7} {wall:>8.1f} {count / wall:>9.1f} {cpu / count * 1e3:>13.1f}")
    (fc, fw, fcpu), (sc, sw, scpu) = rows["free"], rows["json_schema"]
    print(
        f"\njson_schema / free: tokens/s {sc / sw / (fc / fw):.2f}x, "
        f"CPU per token {scpu / sc / (fcpu / fc):.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
