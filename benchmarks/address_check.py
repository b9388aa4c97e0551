"""The per-commit address check (``miserver.ipc.export.moved_parameters_fast``: a ``map`` of
``Tensor.data_ptr`` over the recorded parameters) against PyTorch's own C++ pointer comparison
(``torch._C._tensors_data_ptrs_at_indices_equal``, what CUDA graph trees use for their static
inputs; CUDA builds only), side by side in one run (issue 15: the check runs inside every
commit-end, so its cost is on every step's path)::

    python benchmarks/address_check.py [--sizes 0.5b,8b] [--devices cuda,cpu] [--repeats 2000]

For each size and device, a random bfloat16 model of that shape (benchmarks/attach.py's shapes)
is placed in an arena as the loader places a served model (``miserver.ipc.arena
.make_attachable``), and each way of checking runs ``--repeats`` times, alternating in blocks.
Prints a table: microseconds per check (p50, min), the ratio map / native, and the check's answer
(both must find nothing moved). Measured on an H200 (docs/benchmarks.md): the same cost both
ways, so miserver keeps the ``map``. CPU rows use shared memory (``WEIGHTS_CPU_ATTACH``); the 8B shape
on the CPU is skipped unless named in ``--cpu-sizes``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from weight_sync import random_model  # noqa: E402


def time_check(fn, repeats: int, block: int = 100) -> list[float]:
    out = []
    for _ in range(repeats // block):
        t = time.perf_counter()
        for _ in range(block):
            fn()
        out.append((time.perf_counter() - t) / block * 1e6)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0.5b,8b")
    ap.add_argument("--devices", default="cuda,cpu")
    ap.add_argument("--cpu-sizes", default="tiny,0.5b", help="sizes also run on the CPU")
    ap.add_argument("--repeats", type=int, default=2000)
    args = ap.parse_args()

    import torch

    from miserver.ipc import export
    from miserver.ipc.arena import make_attachable

    rows = []
    for device in [d for d in args.devices.split(",") if d]:
        if device == "cuda" and not torch.cuda.is_available():
            print("no CUDA: cuda rows skipped", file=sys.stderr)
            continue
        for size in [s for s in args.sizes.split(",") if s]:
            if device == "cpu" and size not in args.cpu_sizes.split(","):
                continue
            model = random_model(size, device)
            arena = make_attachable(model, cpu_shared=device == "cpu")
            params = len(arena.watch)
            export.moved_parameters_fast(arena)  # builds the probe the native way reads
            probe = arena._moved_probe
            indices = list(range(len(probe[4])))
            native = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)

            def native_check(p=probe, i=indices, f=native) -> list[str]:
                current = list(map(dict.get, p[2], p[3]))
                return [] if f(current, p[4], i) else ["(a pointer differs)"]

            ways = {"map": lambda a=arena: export.moved_parameters_fast(a)}
            if native is not None:
                ways["native"] = native_check
            answers = {k: f() for k, f in ways.items()}
            samples: dict[str, list[float]] = {k: [] for k in ways}
            for _ in range(4):  # alternate: a drift of the machine falls on both
                for k, f in ways.items():
                    samples[k] += time_check(f, args.repeats // 4)
            for k in ways:
                xs = samples[k]
                rows.append(
                    dict(
                        size=size,
                        device=device,
                        way=k,
                        params=params,
                        p50=statistics.median(xs),
                        min=min(xs),
                        answer=answers[k],
                    )
                )
            del model, arena, ways, probe
            if device == "cuda":
                torch.cuda.empty_cache()
    print(f"torch {torch.__version__}; {args.repeats} checks per way, in blocks of 100\n")
    print(
        "| size | device | parameters | way (map: miserver's) | us per check, p50 | min | "
        "map / native | moved |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        other = next(
            o
            for o in rows
            if o["size"] == r["size"] and o["device"] == r["device"] and o["way"] == "map"
        )
        ratio = f"{other['p50'] / r['p50']:.1f}x" if r["way"] == "native" else "-"
        print(
            f"| {r['size']} | {r['device']} | {r['params']} | {r['way']} | {r['p50']:.1f} | "
            f"{r['min']:.1f} | {ratio} | {r['answer'] or 'none'} |"
        )
    return 1 if any(r["answer"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
