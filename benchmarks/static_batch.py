"""The static batch (issue 14): concurrent chats and a Batch API job at several MAX_BATCH_SIZE.

For each ``MAX_BATCH_SIZE`` in ``--sizes`` the benchmark starts a ``miserver serve`` on the
embedded default (SmolLM2-135M-Instruct, bfloat16) with that setting, warms it with one chat,
then, in one run and through the official ``openai`` SDK:

- ``--clients`` chat clients at once, each one greedy chat of ``--tokens`` tokens (different
  prompts): the wall time until the last answer, and completion tokens a second. Each client is
  a process of its own (``--clients-in processes``, the default: they send at one agreed time,
  and the table's ``sent ms`` is the spread from the first send to the last); ``--clients-in
  threads`` sends from threads of this process, whose shared interpreter lock spreads the
  requests over 100-200 ms (docs/benchmarks.md);
- with ``--batch-rows`` above 0, a Batch API job of that many ``/v1/chat/completions`` rows of
  ``--row-tokens`` tokens each (upload, create, poll until ``completed``): rows a second and
  completion tokens a second.

Each size's figures are also given as a ratio to the first size's (``--sizes`` should start at
1): the runs share the machine's noise, the ratios are what to compare. Usage::

    python benchmarks/static_batch.py                                  # CPU: 16 chats, 1 vs 8
    python benchmarks/static_batch.py --device cuda --sizes 1,8,32,64 --clients 64 \\
        --batch-rows 512 --row-tokens 128 [--model ROW]                # the H200 run

``--shape 0.5b`` serves a model of Qwen2.5-0.5B's layers (24 x 896, 14 heads, 2 key-value
heads) with SmolLM2's tokenizer and vocabulary (49152: the only tokenizer on the offline GPU
machine), random bfloat16 weights, saved into the home and registered in its catalogue.
``--first-rows`` runs fewer Batch API rows at the first size (its rate, rows a second, is that
of rows run one after another; said in the table). ``--in-process`` adds the decode step alone:
ms a step and tokens a second at each size, through the one-sequence graphs (1), the batched
graphs and the eager batched decoder (CUDA).

Each chat row also says how the requests were batched (``/metrics``: static batches started
during the chats, and sequences a batch). ``--batch-delay-ms`` sets ``MAX_BATCH_DELAY_MS`` on
every server (default: unset, the device's ``auto``); ``--compare-delay-ms`` adds a row beside:
the chats again at the largest size with that delay (``0``: no gathering), in the same run.
The batched graphs of a (rows, length) bucket are captured at its first use, so the timed burst
of a fresh server pays the captures of the buckets it meets; ``--warm-burst`` runs the burst
once untimed first (a long-running server's figures).

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
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_graphs import SHAPES as DECODE_SHAPES  # noqa: E402 - one 8B shape
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


SHAPE_05B = dict(
    model_type="qwen2",
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=49152,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def _start(
    home: str, device: str, size: int, model: str, log_path: str | None, delay_ms: str | None
) -> tuple[subprocess.Popen[bytes], str]:
    env = {"MAX_BATCH_SIZE": str(size), "MAX_QUEUED_REQUESTS": "1024", "DEFAULT_MODEL": model}
    if delay_ms is not None:
        env["MAX_BATCH_DELAY_MS"] = delay_ms
    return start_server(home, device, extra_env=env, ready_timeout_s=600, log_path=log_path)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server and wait for it (killed after 30 s)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _batches(base: str) -> tuple[float, float]:
    """(static batches started, sequences decoded in them) so far, from ``/metrics``."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = {"count": 0.0, "sum": 0.0}
    for line in text.splitlines():
        for key in found:
            if line.startswith(f"miserver_static_batch_sequences_{key} "):
                found[key] = float(line.split()[1])
    return found["count"], found["sum"]


def _chat_row(
    client: Any,
    base: str,
    model: str,
    clients: int,
    tokens: int,
    warm_burst: bool = False,
    pool: Any = None,
) -> dict[str, Any]:
    """The chat burst on one server: from ``pool``'s client processes when given, else from
    threads of this process."""

    def burst() -> tuple[float, int, float | None]:
        if pool is not None:
            return process_chats(pool, base, model, clients, tokens)
        return (*chats(client, model, clients, tokens), None)

    chats(client, model, 1, 4)  # warm-up
    if warm_burst:  # the batch graphs a burst needs are captured at their first use
        burst()
    before = _batches(base)
    wall, used, spread = burst()
    after = _batches(base)
    formed = after[0] - before[0]
    return {
        "chat_wall_s": wall,
        "chat_tokens": used,
        "chat_send_spread_s": spread,
        "chat_batches": formed,
        "chat_rows_per_batch": (after[1] - before[1]) / formed if formed else 0.0,
    }


#: Llama-3-8B's layers (32 x 4096, 32 heads, 8 key-value heads, vocabulary 128256 as in
#: ``benchmarks/decode_graphs.py``): SmolLM2's tokenizer covers the first 49152 ids; the output
#: rows past them are zero (see :func:`make_shape`).
SHAPE_8B = dict(DECODE_SHAPES["8b"])


def make_shape(
    home: str, name: str, shape: dict[str, Any] | None = None, device: str = "cpu"
) -> None:
    """Save a random bfloat16 model of ``shape`` (default :data:`SHAPE_05B`) with the default
    model's tokenizer into ``home`` and register it as ``name`` (nothing when the row exists).
    The output embedding is scaled by 8 (greedy decoding well defined); where the shape's
    vocabulary is larger than the tokenizer's, the output rows past the tokenizer's are zero, so
    their logits (0) stay far below the top ones and no id the tokenizer lacks is picked (the
    cost of the full-width head is kept). ``device``: where the weights are drawn (``cuda``: an
    8B shape in seconds, not minutes)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from miserver.serving.models.catalogue import Catalogue
    from miserver.serving.models.default_model import DEFAULT_NAME, model_dir

    catalogue = Catalogue(home)
    if catalogue.get_by_name(name) is not None:
        return
    folder = Path(home) / "bench-models" / name
    default = catalogue.get_by_name(DEFAULT_NAME)  # its folder may be another home's
    tokenizer = AutoTokenizer.from_pretrained(default.path if default else model_dir(home))
    config = AutoConfig.for_model(
        **(shape or SHAPE_05B),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(8.0)  # greedy decoding well defined
        if head.shape[0] > len(tokenizer):
            head[len(tokenizer) :].zero_()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    catalogue.register(name=name, format="safetensors", dtype="bfloat16", path=folder)


def in_process(home: str, model_name: str, sizes: list[int], tokens: int) -> list[dict]:
    """ms per decode step at each size: one-sequence graphs (1), batched graphs, eager batch."""
    import torch
    from transformers import AutoModelForCausalLM

    from miserver.serving.engine.decode_graphs import DecodeEngine
    from miserver.serving.engine.generation import _GraphDecoder, cache_kwarg
    from miserver.serving.engine.static_batch import BatchDecoder
    from miserver.serving.models.catalogue import Catalogue

    row = Catalogue(home).get_by_name(model_name)
    model = AutoModelForCausalLM.from_pretrained(row.path, dtype=torch.bfloat16).eval().cuda()
    device = torch.device("cuda:0")
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(10, 40000, (30 + 7 * (i % 9),), generator=g).tolist()
        for i in range(max(sizes))
    ]
    out = []
    with torch.inference_mode():
        engine = DecodeEngine(model, "captured", 1024, max_rows=max(sizes))
        engine.warm()

        def timed(step, rows: int) -> float:
            for _ in range(3):
                step(rows)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(tokens):
                step(rows)
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) * 1000 / tokens

        for size in sizes:
            result = {"rows": size}
            batch = prompts[:size]
            if size == 1:
                with engine.session(model) as session:
                    dec = _GraphDecoder(session)
                    dec.prefill(batch[0], all_logits=False)
                    result["graphs_ms"] = timed(lambda _r, d=dec: int(d.step(7).argmax()), 1)
            else:
                with engine.batch_session(model, size, 200 + tokens * 2) as bs:
                    bs.expect(batch)
                    for p in batch:
                        bs.prefill(p, all_logits=False)
                    bs.begin(list(range(size)))
                    result["graphs_ms"] = timed(
                        lambda r: bs.step([7] * r).argmax(-1).tolist(), size
                    )
            eager = BatchDecoder(model, device, cache_kwarg(model))
            for p in batch:
                eager.prefill(p, all_logits=False)
            eager.begin(list(range(size)))
            result["eager_ms"] = timed(lambda r, e=eager: e.step([7] * r).argmax(-1).tolist(), size)
            out.append(result)
            print(f"in process, {size} rows: {result}", file=sys.stderr, flush=True)
    del engine, model
    torch.cuda.empty_cache()
    return out


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a few sentences about {TOPICS[i % len(TOPICS)]}."}]


def chats(client: Any, model: str, clients: int, tokens: int) -> tuple[float, int]:
    """``clients`` chats at once from threads of this process; returns (wall seconds until the
    last answer, tokens). The SDK's work in the threads shares one interpreter lock, so the
    requests reach the server spread out (see :func:`process_chats`)."""

    def one(i: int) -> int:
        out = client.chat.completions.create(
            model=model, messages=_messages(i), max_tokens=tokens, temperature=0
        )
        return out.usage.completion_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(one, range(clients)))
    return time.perf_counter() - t0, sum(done)


_CLIENTS: dict[str, Any] = {}  # one SDK client per server in each client process (keep-alive)


def _client_process_start() -> None:
    import openai  # noqa: F401 - imported before the timing


def _one_chat(job: tuple[str, str, int, int, float]) -> tuple[float, float, int]:
    """A client process's chat: wait until ``fire_at`` (wall clock), send, return (sent, done,
    completion tokens), wall-clock seconds."""
    base, model, i, tokens, fire_at = job
    from openai import OpenAI

    client = _CLIENTS.get(base)
    if client is None:
        client = _CLIENTS[base] = OpenAI(
            base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=3600
        )
    time.sleep(max(0.0, fire_at - time.time()))
    sent = time.time()
    out = client.chat.completions.create(
        model=model, messages=_messages(i), max_tokens=tokens, temperature=0
    )
    return sent, time.time(), out.usage.completion_tokens


def process_chats(
    pool: Any, base: str, model: str, clients: int, tokens: int
) -> tuple[float, int, float]:
    """``clients`` chats sent together by ``clients`` client processes (one chat each, as
    independent clients would: no interpreter lock shared); returns (wall seconds from the
    agreed send time to the last answer, tokens, seconds between the first send and the last)."""
    fire_at = time.time() + 0.5
    done = pool.map(
        _one_chat, [(base, model, i, tokens, fire_at) for i in range(clients)], chunksize=1
    )
    sent = [d[0] for d in done]
    return max(d[1] for d in done) - fire_at, sum(d[2] for d in done), max(sent) - min(sent)


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
    ap.add_argument("--shape", choices=("default", "0.5b"), default="default")
    ap.add_argument("--first-rows", type=int, default=0, help="Batch API rows at the first size")
    ap.add_argument("--in-process", action="store_true", help="also time the decode step alone")
    ap.add_argument("--server-log", help="append the servers' logs to this file")
    ap.add_argument(
        "--batch-delay-ms", help="MAX_BATCH_DELAY_MS of every server (default: unset, auto)"
    )
    ap.add_argument(
        "--warm-burst",
        action="store_true",
        help="run the chat burst once untimed first (its batch graphs captured before the timing)",
    )
    ap.add_argument(
        "--compare-delay-ms",
        help="also run the chats at the largest size with each of these MAX_BATCH_DELAY_MS "
        "(comma-separated; a row beside each)",
    )
    ap.add_argument(
        "--clients-in",
        choices=("processes", "threads"),
        default="processes",
        help="the chat clients as one process each (default) or as threads of this one",
    )
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]

    home = args.home
    if home is None:
        from miserver.serving.models.default_model import import_default

        home = tempfile.mkdtemp(prefix="miserver-bench-")
        import_default(home, progress=False)
    if args.shape == "0.5b":
        args.model = "qwen2.5-0.5b-shape"
        make_shape(home, args.model)
    pool = None
    if args.clients_in == "processes":  # started before any CUDA work of this process
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(
            args.clients, initializer=_client_process_start
        )
    try:
        return _run(args, home, sizes, pool)
    finally:
        if pool is not None:
            pool.terminate()


def _run(args: argparse.Namespace, home: str, sizes: list[int], pool: Any) -> int:
    from openai import OpenAI

    steps = in_process(home, args.model, sizes, 64) if args.in_process else []
    results = []
    for index, size in enumerate(sizes):
        proc, base = _start(
            home, args.device, size, args.model, args.server_log, args.batch_delay_ms
        )
        try:
            client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=3600)
            row = {"max_batch_size": size, "delay_ms": args.batch_delay_ms or "auto"}
            row.update(
                _chat_row(
                    client, base, args.model, args.clients, args.tokens, args.warm_burst, pool
                )
            )
            if args.batch_rows:
                rows = args.batch_rows
                if index == 0 and args.first_rows:
                    rows = min(rows, args.first_rows)
                bwall, bused = batch_job(client, args.model, rows, args.row_tokens)
                row.update(batch_wall_s=bwall, batch_tokens=bused, batch_rows=rows)
            results.append(row)
            print(f"MAX_BATCH_SIZE={size}: {row}", file=sys.stderr, flush=True)
        finally:
            _stop(proc)
    for delay in (args.compare_delay_ms or "").split(","):
        if not delay:
            continue
        size = max(sizes)
        proc, base = _start(home, args.device, size, args.model, args.server_log, delay)
        try:
            client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=3600)
            row = {"max_batch_size": size, "delay_ms": delay}
            row.update(
                _chat_row(
                    client, base, args.model, args.clients, args.tokens, args.warm_burst, pool
                )
            )
            results.append(row)
            print(f"MAX_BATCH_SIZE={size}: {row}", file=sys.stderr, flush=True)
        finally:
            _stop(proc)
    base_row = results[0]
    head = (
        f"{'MAX_BATCH_SIZE':>14} {'delay ms':>8} {'chats s':>9} {'chat tok/s':>11} {'x':>6}"
        f" {'batches':>7} {'rows/batch':>10} {'sent ms':>7}"
    )
    if args.batch_rows:
        head += f" {'batch s':>9} {'rows/s':>8} {'tok/s':>8} {'x':>6}"
    print(
        f"{args.clients} concurrent chats of {args.tokens} tokens"
        + (
            f"; a Batch API job of {args.batch_rows} rows x {args.row_tokens} tokens"
            if args.batch_rows
            else ""
        )
        + f" ({args.model}, {args.device}; chat clients: {args.clients_in}"
        + (", each burst after an untimed one" if args.warm_burst else "")
        + ")"
    )
    print(head)
    for row in results:
        rate = row["chat_tokens"] / row["chat_wall_s"]
        line = (
            f"{row['max_batch_size']:>14} {row['delay_ms']:>8} {row['chat_wall_s']:>9.2f} "
            f"{rate:>11.1f} {base_row['chat_wall_s'] / row['chat_wall_s']:>6.2f}"
            f" {row['chat_batches']:>7.0f} {row['chat_rows_per_batch']:>10.1f}"
            + (
                f" {row['chat_send_spread_s'] * 1000:>7.1f}"
                if row["chat_send_spread_s"] is not None
                else f" {'-':>7}"
            )
        )
        if args.batch_rows and "batch_wall_s" in row:
            rows_s = row["batch_rows"] / row["batch_wall_s"]
            base_rate = base_row["batch_rows"] / base_row["batch_wall_s"]
            line += (
                f" {row['batch_wall_s']:>9.2f} {rows_s:>8.2f} "
                f"{row['batch_tokens'] / row['batch_wall_s']:>8.1f} "
                f"{rows_s / base_rate:>6.2f}"
            )
            if row["batch_rows"] != args.batch_rows:
                line += f"  ({row['batch_rows']} rows)"
        print(line)
    if steps:
        print("decode step alone (in process, 64 steps after 3): ms a step, tokens/s, x 1 row")
        one = steps[0]["graphs_ms"]
        for st in steps:
            rate = st["rows"] * 1000 / st["graphs_ms"]
            print(
                f"{st['rows']:>5} rows  graphs {st['graphs_ms']:7.2f} ms {rate:9.0f} tok/s "
                f"x{rate / (1000 / one):6.1f}   eager batch {st['eager_ms']:7.2f} ms "
                f"{st['rows'] * 1000 / st['eager_ms']:9.0f} tok/s"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "steps": steps}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
