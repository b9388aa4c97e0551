"""The continuous engine's decode step on the CPU by batch size and thread count (issue 29).

For each batch size in ``--batches`` (default 1, 8, 16) and each thread count in ``--threads``,
``B`` sequences of a ``--prompt``-token prompt (one prefill, the ``B`` choices of one request)
are prefilled, then ``--steps`` decode steps of
:meth:`~miserver.serving.engine.continuous.ContinuousEngine.step` (paged cache,
``miserver_paged`` attention, greedy sampling included) are timed ``--rounds`` times, keeping
the median round.

The table gives wall ms a step, ms a token (a step / B) and CPU ms a token (the process's CPU
time: less sensitive to other work on a shared machine than wall time). The eager static-batch
decoder this was first measured against was removed (docs/benchmarks.md holds those figures).
Usage::

    python benchmarks/engine_step.py [--model FOLDER] [--batches 1,8,16] [--threads 1,2]

``--model`` is a transformers folder (default: the embedded SmolLM2-135M-Instruct, imported into
a temporary ``MISERVER_HOME``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import bfloat16_model  # noqa: E402

from miserver.serving.engine.continuous import ContinuousEngine  # noqa: E402
from miserver.serving.engine.generation import SamplingParams  # noqa: E402
from miserver.serving.engine.sequence import Sequence  # noqa: E402


def _timed(fn: Any, steps: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _new(model: Any, prompt: list[int], rows: int, total: int) -> tuple[Any, ContinuousEngine]:
    engine = ContinuousEngine(model, 256 << 20, max_num_seqs=max(rows, 2))
    group = object()
    for i in range(rows):
        params = SamplingParams(max_tokens=total + 8, temperature=0)
        engine.add(Sequence(i, prompt, params, group=group))
    while engine.stats()["running"] < rows:
        engine.step()
    engine.step()
    return engine.step, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--threads", default=str(torch.get_num_threads()))
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = bfloat16_model(args.model)
    prompt = [
        int(t)
        for t in torch.randint(
            100, 40000, (args.prompt,), generator=torch.Generator().manual_seed(0)
        )
    ]
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for batch in [int(b) for b in args.batches.split(",")]:
            step, _engine = _new(model, prompt, batch, args.steps * args.rounds)
            times = [_timed(step, args.steps) for _ in range(args.rounds)]
            wall = statistics.median(w for w, _ in times) / args.steps * 1e3
            cpu = statistics.median(c for _, c in times) / args.steps * 1e3
            rows.append((threads, batch, wall, cpu))
    print(f"\n{'threads':>7} {'batch':>5} | {'ms/step':>8} {'ms/tok':>8} {'cpu ms/tok':>10}")
    for threads, batch, wall, cpu in rows:
        print(f"{threads:>7} {batch:>5} | {wall:>8.1f} {wall / batch:>8.1f} {cpu / batch:>10.1f}")


if __name__ == "__main__":
    main()
