"""The decode step: the old eager path against the continuous engine (issue 29), one run.

For each batch size in ``--batches`` (default 1, 8, 16) and each thread count in ``--threads``,
``B`` sequences of a ``--prompt``-token prompt are prefilled, then ``--steps`` decode steps are
timed, alternating old and new ``--rounds`` times (they share the machine's noise) and keeping
each side's median round:

- ``old``: :class:`~miserver.serving.engine.static_batch.BatchDecoder`, the eager decode the
  static batch and a lone CPU request run today (a ``DynamicCache``, a row per sequence, one
  attention call per row, at least two rows);
- ``new``: :class:`~miserver.serving.engine.continuous.ContinuousEngine` ``step()`` (paged cache,
  ``miserver_paged`` attention, greedy sampling included).

The table gives wall ms a step, ms a token (a step / B), CPU ms a token (the process's CPU time:
less sensitive to other work on a shared machine than wall time), and new / old. Usage::

    python benchmarks/engine_step.py [--model FOLDER] [--batches 1,8,16] [--threads 1,2]

``--model`` is a transformers folder (default: the embedded SmolLM2-135M-Instruct, imported into
a temporary ``MISERVER_HOME``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from miserver.serving.engine.continuous import ContinuousEngine  # noqa: E402
from miserver.serving.engine.generation import SamplingParams  # noqa: E402
from miserver.serving.engine.sequence import Sequence  # noqa: E402
from miserver.serving.engine.static_batch import BatchDecoder  # noqa: E402


def _model(folder: str | None) -> Any:
    from transformers import AutoModelForCausalLM

    if folder is None:
        from miserver.serving.models.default_model import import_default, model_dir

        home = tempfile.mkdtemp(prefix="miserver-bench-")
        import_default(home, progress=False)
        folder = str(model_dir(home))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


def _timed(fn: Any, steps: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _old(model: Any, prompt: list[int], rows: int) -> Any:
    decoder = BatchDecoder(model, torch.device("cpu"), "cache")
    with torch.inference_mode():
        decoder.prefill(prompt, all_logits=False)
        decoder.begin([0] * rows)
        tokens = [5] * rows

        def step() -> None:
            with torch.inference_mode():
                logits = decoder.step(tokens)
                torch.argmax(logits, dim=-1).tolist()

        step()
    return step


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
    model = _model(args.model)
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
            old = _old(model, prompt, batch)
            new, _engine = _new(model, prompt, batch, args.steps * args.rounds)
            times: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
            for _ in range(args.rounds):
                times["old"].append(_timed(old, args.steps))
                times["new"].append(_timed(new, args.steps))
            med = {
                k: (
                    statistics.median(w for w, _ in v) / args.steps * 1e3,
                    statistics.median(c for _, c in v) / args.steps * 1e3,
                )
                for k, v in times.items()
            }
            rows.append((threads, batch, med["old"], med["new"]))
    print(
        f"\n{'threads':>7} {'batch':>5} | {'old ms/step':>11} {'new ms/step':>11} | "
        f"{'old ms/tok':>10} {'new ms/tok':>10} | {'old cpu/tok':>11} {'new cpu/tok':>11} | "
        f"{'new/old':>7}"
    )
    for threads, batch, (ow, oc), (nw, nc) in rows:
        print(
            f"{threads:>7} {batch:>5} | {ow:>11.1f} {nw:>11.1f} | {ow / batch:>10.1f} "
            f"{nw / batch:>10.1f} | {oc / batch:>11.1f} {nc / batch:>11.1f} | {nw / ow:>7.2f}"
        )


if __name__ == "__main__":
    main()
