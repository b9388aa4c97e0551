"""The decode step in process on CUDA: the continuous engine with its decode graphs against the
same engine without them (issues 29 and 34), one run.

For each model shape (:func:`bench_models.build_model`: the embedded SmolLM2-135M when imported,
random Qwen2.5-0.5B and Llama-3-8B shapes), bfloat16 on one CUDA card, greedy:

- ``eager 1``: :class:`~miserver.serving.engine.continuous.ContinuousEngine` with
  ``decode_graphs=off`` (``DECODE_GRAPHS=off``), one sequence: ``engine.step()`` whole;
- ``graphs B``: the same engine with ``decode_graphs=captured``, ``B`` sequences
  (``--batches``, default 1, 8, 64) decoding together: ``engine.step()`` whole (scheduling,
  the graph's replay, sampling, bookkeeping).

Columns: ms a step (median of the timed steps, after ``--warm`` untimed ones), ms a token (a step
/ B), tokens/s, and for ``graphs 1`` its speed-up over ``eager 1``. Then the engine's graph
buckets captured and the bytes they allocated, the paged cache's size, and the greedy tokens of
``--prompts`` prompts, graphs against eager (counted: equal to rounding). The one-sequence graph
engine measured before the continuous engine was removed (docs/benchmarks.md holds its figures);
to measure it again, run an older tree's copy of this script.

``--prefill N`` instead: the step that admits ``N`` prompts at once (lengths 8 to about 300,
the prompts above), each prompt's chunk attended alone (one attention call a chunk and a layer)
against packed (one call a pack and a layer: ``pack_spans``), alternating ``--rounds`` times:
ms of the steps until every prompt has its first token (median round), and whether the greedy
tokens (16 a prompt) are the same both ways.

Usage (on the GPU machine)::

    python benchmarks/engine_cuda_step.py [--shapes smollm2,0.5b,8b] [--batches 1,8,64]
        [--tokens 64] [--json out.json]
    python benchmarks/engine_cuda_step.py --shapes smollm2 --prefill 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_models import build_model, prompts  # noqa: E402


def new_engine(model: Any, rows: int, budget: int, graphs: str = "captured") -> Any:
    from miserver.serving.engine.continuous import ContinuousEngine

    return ContinuousEngine(model, budget, max_num_seqs=max(rows, 1), decode_graphs=graphs)


def run_new(
    model: Any, ps: list[list[int]], tokens: int, warm: int, budget: int, graphs: str = "captured"
) -> dict:
    """``len(ps)`` sequences decoding together: per-step seconds once all run, their tokens."""
    import torch

    from miserver.serving.engine.generation import SamplingParams
    from miserver.serving.engine.sequence import Sequence

    engine = new_engine(model, len(ps), budget, graphs)
    for i, p in enumerate(ps):
        engine.add(Sequence(i, p, SamplingParams(max_tokens=tokens + warm, temperature=0)))
    out: dict[Any, list[int]] = {i: [] for i in range(len(ps))}
    times: list[float] = []
    with torch.inference_mode():
        while engine.has_work():
            decoding = engine.stats()["running"] == len(ps) and all(out.values())
            t0 = time.perf_counter()
            outputs = engine.step()
            if decoding:
                times.append(time.perf_counter() - t0)
            for o in outputs:
                out[o.seq_id] += o.new_token_ids
    stats = engine.stats()
    del engine
    torch.cuda.empty_cache()
    timed = times[warm:] or times
    return {
        "step_ms": statistics.median(timed) * 1000 if timed else float("nan"),
        "tokens": [out[i] for i in range(len(ps))],
        "graphs": stats.get("decode_graphs"),
        "cache_mb": stats["cache_bytes"] / 2**20,
        "blocks": stats["blocks_total"],
    }


def run_prefill(model: Any, ps: list[list[int]], packed: bool, budget: int) -> dict:
    """Admit ``ps`` at once: seconds of the steps until each has its first token; the tokens
    (16 each, greedy)."""
    import torch

    from miserver.serving.engine.continuous import ContinuousEngine
    from miserver.serving.engine.generation import SamplingParams
    from miserver.serving.engine.sequence import Sequence

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    engine = ContinuousEngine(
        model,
        budget,
        max_num_seqs=len(ps),
        max_num_batched_tokens=16384,
        prefill_chunk=512,
        decode_graphs="captured" if cuda else "off",
        prefix_cache=False,
        packed_prefill=packed,
    )
    for i, p in enumerate(ps):
        engine.add(Sequence(i, p, SamplingParams(max_tokens=16, temperature=0)))
    out: dict[Any, list[int]] = {i: [] for i in range(len(ps))}
    prefill_s = 0.0
    steps = 0
    with torch.inference_mode():
        while engine.has_work():
            first = not all(out.values())
            sync()
            t0 = time.perf_counter()
            outputs = engine.step()
            sync()
            if first:
                prefill_s += time.perf_counter() - t0
                steps += 1
            for o in outputs:
                out[o.seq_id] += o.new_token_ids
    del engine
    torch.cuda.empty_cache()
    return {"s": prefill_s, "steps": steps, "tokens": [out[i] for i in range(len(ps))]}


def prefill_main(args: Any) -> int:
    import torch

    rows = []
    for shape in args.shapes.split(","):
        model, label = build_model(shape, args.device, args.context)
        ps = prompts(args.prefill, 32000)
        ps = [[t % model.config.vocab_size for t in p] for p in ps]
        run_prefill(model, ps[:4], True, args.budget_mib << 20)  # warm both paths
        run_prefill(model, ps[:4], False, args.budget_mib << 20)
        times: dict[bool, list[float]] = {False: [], True: []}
        tokens: dict[bool, list[list[int]]] = {}
        steps = {}
        for _ in range(args.rounds):
            for packed in (False, True):
                res = run_prefill(model, ps, packed, args.budget_mib << 20)
                times[packed].append(res["s"] * 1000)
                tokens[packed], steps[packed] = res["tokens"], res["steps"]
        same = sum(a == b for a, b in zip(tokens[False], tokens[True], strict=True))
        alone, packed = statistics.median(times[False]), statistics.median(times[True])
        row = {
            "shape": shape,
            "label": label,
            "prompts": len(ps),
            "prompt_tokens": sum(map(len, ps)),
            "alone_ms": alone,
            "packed_ms": packed,
            "steps": steps,
            "same_tokens": same,
        }
        rows.append(row)
        print(
            f"{shape}: {len(ps)} prompts ({row['prompt_tokens']} tokens) admitted at once: "
            f"alone {alone:.1f} ms, packed {packed:.1f} ms ({alone / packed:.2f}x) over "
            f"{steps[True]} step(s); greedy 16 tokens the same for {same}/{len(ps)}",
            flush=True,
        )
        del model
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="smollm2,0.5b,8b")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--warm", type=int, default=8, help="untimed steps first")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--context", type=int, default=4096, help="cap the context")
    parser.add_argument("--budget-mib", type=int, default=2048, help="the paged cache, MiB")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--json", default=None)
    parser.add_argument("--prefill", type=int, default=0, help="time admitting N prompts")
    parser.add_argument("--rounds", type=int, default=3, help="--prefill: rounds each way")
    args = parser.parse_args()
    if args.prefill:
        return prefill_main(args)

    import torch

    from miserver.serving.engine.generation import context_length

    budget = args.budget_mib << 20
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        model, label = build_model(shape, args.device, args.context)
        context = context_length(model)
        ps = prompts(max(args.prompts, max(int(b) for b in args.batches.split(","))), 32000)
        ps = [[t % model.config.vocab_size for t in p] for p in ps]
        print(f"{shape}: {label}, context {context}", flush=True)
        eager = run_new(model, ps[:1], args.tokens, args.warm, budget, graphs="off")
        rows.append({"shape": shape, "path": "eager", "B": 1, "step_ms": eager["step_ms"]})
        print(f"  eager 1: {eager['step_ms']:.2f} ms a step", flush=True)
        # greedy agreement, 16 tokens, the prompts side by side, without and with graphs
        plain = run_new(model, ps[: args.prompts], 16, 0, budget, graphs="off")
        graphed = run_new(model, ps[: args.prompts], 16, 0, budget)
        same = sum(a == b for a, b in zip(graphed["tokens"], plain["tokens"], strict=True))
        for b in (int(x) for x in args.batches.split(",")):
            try:
                res = run_new(model, ps[:b], args.tokens, args.warm, budget)
            except Exception as exc:  # noqa: BLE001 - a row fails, the table goes on
                print(f"  graphs {b}: failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            row = {
                "shape": shape,
                "path": "graphs",
                "B": b,
                "step_ms": res["step_ms"],
                "graphs": res["graphs"],
                "cache_mb": res["cache_mb"],
                "blocks": res["blocks"],
            }
            rows.append(row)
            print(f"  graphs {b}: {res['step_ms']:.2f} ms a step; {res['graphs']}", flush=True)
        rows.append({"shape": shape, "path": "agree", "same": same, "of": args.prompts})
        del model
        torch.cuda.empty_cache()
    print()
    print(
        f"{'shape':<9}{'path':<8}{'B':>4}{'ms/step':>9}{'ms/tok':>9}{'tok/s':>9}"
        f"{'eager/graphs':>13}"
    )
    eagers = {r["shape"]: r["step_ms"] for r in rows if r["path"] == "eager"}
    for r in rows:
        if r["path"] == "agree":
            print(
                f"{r['shape']:<9}greedy 16 tokens: graphs = eager for {r['same']}/{r['of']} prompts"
            )
            continue
        ms, b = r["step_ms"], r["B"]
        ratio = f"{eagers[r['shape']] / ms:13.2f}" if r["path"] == "graphs" and b == 1 else ""
        print(
            f"{r['shape']:<9}{r['path']:<8}{b:>4}{ms:>9.2f}{ms / b:>9.3f}{1000 * b / ms:>9.0f}"
            f"{ratio}"
        )
    for r in rows:
        if r["path"] == "graphs":
            g = r["graphs"] or {}
            print(
                f"{r['shape']} B={r['B']}: cache {r['cache_mb']:.0f} MiB ({r['blocks']} blocks), "
                f"graphs {g.get('captured')} {g.get('bytes', 0) / 2**20:.1f} MiB, "
                f"failed {g.get('failed')}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
