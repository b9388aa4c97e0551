"""The paged KV cache at several budgets: its size follows the budget, not rows x context (issue 29).

For each budget in ``--budgets`` (sizes as ``KV_CACHE_BYTES`` takes them, default ``8MiB,32MiB,
128MiB``) the continuous engine (:class:`~miserver.serving.engine.continuous.ContinuousEngine`)
is built in this process on ``--device`` (default ``cpu``) the way a resident's engine is built
at load (:func:`miserver.serving.engine.engine_setup.build`: ``MAX_BATCH_SIZE`` auto's 64
sequences a step; on CUDA its step token limits and ``--decode-graphs``), and ``--requests``
greedy sequences (each a random ``--prompt``-token prompt of its own, exactly ``--tokens``
tokens: no end token stops them) are submitted at once and stepped until every one has ended.

One markdown table, a row per budget: the cache bytes actually allocated, its blocks (of 16
positions) and the token positions they hold, the sequences of ``--prompt`` + ``--tokens``
positions that fit at once, the peak running sequences observed after a step and the largest
batch a step computed (``peak_batch``), preemptions (a sequence whose blocks were taken back
and recomputed later), the requests completed with all their tokens, whether each sequence's
greedy tokens equal those at the largest budget ("same text"), the wall time, the process's CPU
time (less sensitive than wall time to other work on a shared machine) and the generated tokens
a second over the whole run's wall time (prefills and recomputes included). A line above the table
gives what a static cache of ``--requests`` rows x the model's context would take.

The script exits 1 when a request did not complete or its text differs from the largest
budget's. Usage::

    python benchmarks/kv_budget.py [--model FOLDER] [--device cpu] [--budgets 8MiB,32MiB,128MiB]
        [--prompt 64] [--tokens 32] [--requests 32]

``--model`` is a transformers folder (default: the embedded SmolLM2-135M-Instruct, imported into
a temporary ``MISERVER_HOME``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_models import bfloat16_model  # noqa: E402

from miserver.serving.engine.continuous import DEFAULT_BLOCK_SIZE, ContinuousEngine  # noqa: E402
from miserver.serving.engine.engine_setup import CUDA_STEP_TOKENS  # noqa: E402
from miserver.serving.engine.generation import SamplingParams, context_length  # noqa: E402
from miserver.serving.engine.kv_cache import cache_shape  # noqa: E402
from miserver.serving.engine.sequence import Sequence  # noqa: E402
from miserver.spec.settings import (  # noqa: E402
    DEFAULT_ENGINE_MAX_SEQS,
    ConfigError,
    parse_memory_bytes,
)


def parse_budgets(text: str) -> list[int]:
    """``8MiB,32MiB,128MiB`` -> bytes, each parsed as ``KV_CACHE_BYTES`` is
    (:func:`~miserver.spec.settings.parse_memory_bytes`).

    Raises:
        ConfigError: a part is not a size (``auto`` included) or is below 1 MiB.
    """
    budgets = []
    for part in text.split(","):
        value = parse_memory_bytes("--budgets", part)
        if value is None:
            raise ConfigError("--budgets", f"a size is needed, not {part!r}")
        budgets.append(value)
    return budgets


def make_prompts(requests: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``requests`` random prompts of ``length`` token ids each (in ``[10, vocab - 10)``), one
    of their own each (no shared prefix), reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for _ in range(requests)]


def engine_kwargs(device: torch.device, decode_graphs: str) -> dict[str, Any]:
    """The engine's limits as :func:`~miserver.serving.engine.engine_setup.build` gives them on
    ``device`` (``MAX_BATCH_SIZE`` auto)."""
    cuda = device.type == "cuda"
    return {
        "max_num_seqs": DEFAULT_ENGINE_MAX_SEQS,
        "decode_graphs": decode_graphs if cuda else "off",
        "prefix_cache": device.type != "cpu",
        **(CUDA_STEP_TOKENS if cuda else {}),
    }


def run_budget(
    model: Any,
    budget: int,
    prompts: list[list[int]],
    tokens: int,
    engine_kw: dict[str, Any],
    step_limit: int = 1_000_000,
) -> dict[str, Any]:
    """Build an engine over ``budget`` bytes of cache, run every prompt to ``tokens`` greedy
    tokens at once, and count. Returns a dict: ``budget``, ``cache_bytes``, ``blocks``,
    ``block_size``, ``cache_tokens``, ``fit`` (sequences of prompt + ``tokens`` positions the
    blocks hold at once), ``peak_running``, ``peak_batch``, ``preemptions``, ``completed``,
    ``outputs`` (seq index -> token ids), ``wall_s``, ``cpu_s`` (this process's CPU time: less
    sensitive than wall time to other work on a shared machine), ``tokens_per_s`` (generated tokens over
    the wall time); when not even one sequence fits, the run is skipped (``completed`` 0,
    ``skipped`` True).

    Raises:
        ValueError: the budget holds fewer than two blocks (the engine's own refusal).
        RuntimeError: the engine did not finish within ``step_limit`` steps.
    """
    engine = ContinuousEngine(model, budget, **engine_kw)
    stats = engine.stats()
    block_size = stats["block_size"]
    per_seq = -(-(len(prompts[0]) + tokens) // block_size)
    row: dict[str, Any] = {
        "budget": budget,
        "cache_bytes": stats["cache_bytes"],
        "blocks": stats["blocks_total"],
        "block_size": block_size,
        "cache_tokens": stats["blocks_total"] * block_size,
        "fit": stats["blocks_total"] // per_seq,
        "requests": len(prompts),
        "skipped": False,
    }
    if row["fit"] == 0:
        row.update(
            skipped=True, peak_running=0, peak_batch=0, preemptions=0, completed=0, outputs={}
        )
        row.update(wall_s=0.0, cpu_s=0.0, tokens_per_s=0.0)
        engine.close()
        return row
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    finished: dict[int, str] = {}
    peak_running = 0
    started, cpu = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(prompts):
        engine.add(Sequence(i, prompt, SamplingParams(max_tokens=tokens, temperature=0)))
    steps = 0
    while engine.has_work():
        steps += 1
        if steps > step_limit:
            raise RuntimeError(f"the engine did not finish in {step_limit} steps")
        for out in engine.step():
            outputs[out.seq_id].extend(out.new_token_ids)
            if out.finished:
                finished[out.seq_id] = out.finish_reason or ""
        peak_running = max(peak_running, engine.stats()["running"])
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    stats = engine.stats()
    engine.close()
    generated = sum(len(v) for v in outputs.values())
    row.update(
        peak_running=peak_running,
        peak_batch=stats["peak_batch"],
        preemptions=stats["preemptions"],
        completed=sum(
            1 for i, reason in finished.items() if reason == "length" and len(outputs[i]) == tokens
        ),
        outputs=outputs,
        wall_s=wall,
        cpu_s=cpu,
        tokens_per_s=generated / wall if wall > 0 else 0.0,
    )
    return row


def measure(
    model: Any,
    budgets: list[int],
    prompt_len: int,
    tokens: int,
    requests: int,
    decode_graphs: str = "off",
    warm: bool = True,
) -> list[dict[str, Any]]:
    """:func:`run_budget` for each budget (in the order given) on the same prompts, then
    ``same_text`` per row: how many sequences' greedy tokens equal those at the largest budget
    (None for a skipped row). ``warm`` runs one short untimed sequence first (the first
    forward passes' one-time costs)."""
    device = next(model.parameters()).device
    kw = engine_kwargs(device, decode_graphs)
    prompts = make_prompts(requests, prompt_len, model.config.vocab_size)
    if warm:
        run_budget(model, max(budgets), prompts[:1], min(tokens, 4), kw)
    rows = [run_budget(model, budget, prompts, tokens, kw) for budget in budgets]
    reference = max(rows, key=lambda r: r["budget"])["outputs"]
    for row in rows:
        row["same_text"] = (
            None
            if row["skipped"]
            else sum(1 for i, ids in row["outputs"].items() if ids == reference.get(i))
        )
    return rows


def _size(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def table(rows: list[dict[str, Any]], prompt_len: int, tokens: int) -> str:
    """The markdown table of :func:`measure`'s rows."""
    head = (
        f"| budget | cache allocated | blocks | tokens held | fit at once ({prompt_len}+{tokens}) "
        "| peak running | peak batch | preemptions | completed | same text | wall s | CPU s | tokens/s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    largest = max(r["budget"] for r in rows)
    for r in rows:
        same = (
            "-"
            if r["same_text"] is None
            else ("reference" if r["budget"] == largest else f"{r['same_text']}/{r['requests']}")
        )
        lines.append(
            f"| {_size(r['budget'])} | {_size(r['cache_bytes'])} | {r['blocks']} "
            f"| {r['cache_tokens']:,} | {r['fit']} | {r['peak_running']} | {r['peak_batch']} "
            f"| {r['preemptions']} | {r['completed']}/{r['requests']} | {same} "
            f"| {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['tokens_per_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a transformers folder (default: SmolLM2)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--budgets", default="8MiB,32MiB,128MiB")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens a sequence")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens a sequence")
    parser.add_argument("--requests", type=int, default=32, help="sequences submitted at once")
    parser.add_argument(
        "--decode-graphs",
        default="captured",
        choices=("captured", "compiled", "eager", "off"),
        help="CUDA only, DECODE_GRAPHS (default captured, as the server); the CPU runs off, as the server does",
    )
    args = parser.parse_args()
    try:
        budgets = parse_budgets(args.budgets)
    except ConfigError as exc:
        parser.error(str(exc))
    if min(args.prompt, args.tokens, args.requests) < 1:
        parser.error("--prompt, --tokens and --requests must be at least 1")
    model = bfloat16_model(args.model).to(args.device)
    try:
        rows = measure(model, budgets, args.prompt, args.tokens, args.requests, args.decode_graphs)
    except ValueError as exc:  # a budget of fewer than two blocks of this model
        parser.error(str(exc))
    shape = cache_shape(model)
    context = context_length(model)
    print(
        f"\n{args.requests} greedy sequences of {args.prompt} + {args.tokens} tokens at once on "
        f"{args.device} ({torch.get_num_threads()} threads); "
        f"{shape.bytes_per_token:,} cache bytes a token position, blocks of {DEFAULT_BLOCK_SIZE}; "
        f"a static cache of {args.requests} rows x the model's context ({context:,}) would take "
        f"{_size(args.requests * context * shape.bytes_per_token)}\n"
    )
    print(table(rows, args.prompt, args.tokens))
    bad = [
        r
        for r in rows
        if not r["skipped"] and (r["completed"] != r["requests"] or r["same_text"] != r["requests"])
    ]
    for r in bad:
        print(f"FAILED at {_size(r['budget'])}: {r['completed']} completed, {r['same_text']} same")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
