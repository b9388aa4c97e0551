"""The CPU decode step with the linear layers as ``weight @ inputᵀ`` against ``F.linear`` (issue 29).

For each batch size in ``--batches`` (default 1, 16, 32, 64), ``B`` sequences of a
``--prompt``-token prompt are prefilled in one :class:`ContinuousEngine`, then decode steps are
timed with the runner's ``weight_first`` on and off, alternating ``--rounds`` times (both sides
share the machine's noise; each side keeps its median round). Off is the engine as it was:
``F.linear`` and at most 32 one-query rows a forward pass (a step of 64 is two passes); on:
:mod:`miserver.serving.engine.cpu_linear` and up to 128 rows a pass. The greedy tokens of both
sides are compared (they must be the same: the columns of ``weight @ inputᵀ`` carry the bits
``F.linear`` gives a row in a product of 2 to 32 rows).

Usage::

    python benchmarks/cpu_linear.py [--model FOLDER] [--batches 1,16,32,64] [--threads N]

``--model`` is a transformers folder (default: the embedded SmolLM2-135M-Instruct, imported into
a temporary ``MISERVER_HOME``). The table: wall ms a step, CPU ms a step (the process's CPU
time), and on / off.
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
from miserver.serving.engine.model_runner import LINEAR_MAX_ROWS, MAX_ROWS  # noqa: E402
from miserver.serving.engine.sampling import SamplingParams  # noqa: E402
from miserver.serving.engine.sequence import Sequence  # noqa: E402


def _set(engine: ContinuousEngine, on: bool) -> None:
    engine.runner.weight_first = on
    engine.runner.max_rows = MAX_ROWS if on else LINEAR_MAX_ROWS


def _engine(model: Any, rows: int, prompt: list[int], total: int, budget: int) -> ContinuousEngine:
    engine = ContinuousEngine(model, budget, max_num_seqs=max(rows, 2))
    for i in range(rows):
        params = SamplingParams(max_tokens=total + 8, temperature=0)
        engine.add(Sequence(i, [t + i for t in prompt], params))
    while engine.stats()["running"] < rows:
        engine.step()
    return engine


def _timed(engine: ContinuousEngine, steps: int) -> tuple[float, float, list[Any]]:
    outs: list[Any] = []
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        outs.extend((o.seq_id, tuple(o.new_token_ids)) for o in engine.step())
    return time.perf_counter() - wall, time.process_time() - cpu, outs


def measure(
    model: Any,
    batches: list[int],
    prompt: list[int],
    steps: int,
    rounds: int,
    budget: int = 512 << 20,
) -> list[tuple[int, tuple[float, float], tuple[float, float], bool]]:
    """For each batch size: (batch, (wall ms, CPU ms) a step off, the same on, whether both
    sides produced the same tokens). Off and on alternate ``rounds`` times, ``steps`` steps
    each; each side keeps its median round. ``budget``: each engine's KV cache, bytes."""
    total = steps * rounds
    table = []
    with torch.inference_mode():
        for batch in batches:
            sides = {on: _engine(model, batch, prompt, total, budget) for on in (True, False)}
            for on, engine in sides.items():
                _set(engine, on)
                engine.step()  # warm
            times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            tokens: dict[bool, list[Any]] = {True: [], False: []}
            for _ in range(rounds):
                for on in (False, True):
                    wall, cpu, outs = _timed(sides[on], steps)
                    times[on].append((wall, cpu))
                    tokens[on].extend(outs)
            med = {
                on: (
                    statistics.median(w for w, _ in v) / steps * 1e3,
                    statistics.median(c for _, c in v) / steps * 1e3,
                )
                for on, v in times.items()
            }
            table.append((batch, med[False], med[True], tokens[True] == tokens[False]))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="1,16,32,64")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prompt", type=int, default=48)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = bfloat16_model(args.model)
    prompt = [int(t) for t in torch.randint(100, 40000, (args.prompt,), generator=None)]
    batches = [int(b) for b in args.batches.split(",")]
    table = measure(model, batches, prompt, args.steps, args.rounds)
    print(
        f"\nthreads {args.threads}, {args.steps} steps x {args.rounds} rounds a side\n"
        f"{'batch':>5} | {'F.linear ms':>11} {'W@xT ms':>9} | {'F.linear cpu':>12} "
        f"{'W@xT cpu':>9} | {'on/off':>6} | same tokens"
    )
    for batch, (ow, oc), (nw, nc), same in table:
        print(
            f"{batch:>5} | {ow:>11.1f} {nw:>9.1f} | {oc:>12.1f} {nc:>9.1f} | "
            f"{nw / ow:>6.2f} | {same}"
        )


if __name__ == "__main__":
    main()
