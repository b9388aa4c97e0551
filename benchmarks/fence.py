"""The cost of fencing out a cleared holder (issue 32 item 8): ``miserver.ipc.arena.relocate``
moves the served set to fresh storages at every accepted clear-stale, so its time is the time the
clear-stale call (and the event loop) spends moving, and a second copy of the weights is held
while the old one stays mapped by the removed process::

    python benchmarks/fence.py [--sizes tiny,0.5b] [--devices cpu,cuda] [--repeats 5]

For each size and device a random bfloat16 model of that shape (benchmarks/weight_sync.py's
shapes) is placed in an arena as the loader places a served model (``make_attachable``; shared
memory on the CPU, as ``WEIGHTS_CPU_ATTACH`` does), then, alternating, ``--repeats`` times each:

- ``copy``: the floor, one fresh allocation of the arena's size and one byte copy into it (what
  any move must do);
- ``relocate``: the fence (allocate in the arena's own kind, copy, rebind every parameter,
  record the addresses; on the CPU the shared-memory file is created and adopted, on CUDA a
  ``MemPool`` made and the device synchronised), the old arena then dropped as the runtime does.

Prints a table: arena size, milliseconds (p50, min) for each, the ratio relocate / copy and the
relocate's rate in GB/s.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny,0.5b")
    ap.add_argument("--devices", default="cpu,cuda")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import torch

    from miserver.ipc.arena import make_attachable, relocate

    def sync(device: str) -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    rows = []
    for device in [d for d in args.devices.split(",") if d]:
        if device == "cuda" and not torch.cuda.is_available():
            print("no CUDA: cuda rows skipped", file=sys.stderr)
            continue
        for size in [s for s in args.sizes.split(",") if s]:
            model = random_model(size, device)
            arena = make_attachable(model, cpu_shared=device == "cpu")
            nbytes = arena.total_bytes
            samples: dict[str, list[float]] = {"copy": [], "relocate": []}
            for _ in range(args.repeats):
                sync(device)
                t = time.perf_counter()
                floor = torch.empty(nbytes, dtype=torch.uint8, device=device)
                floor.copy_(
                    torch.empty(0, dtype=torch.uint8, device=device).set_(
                        arena.storages[0], 0, (nbytes,), (1,)
                    )
                )
                sync(device)
                samples["copy"].append((time.perf_counter() - t) * 1e3)
                del floor
                t = time.perf_counter()
                fresh = relocate(arena, model)
                samples["relocate"].append((time.perf_counter() - t) * 1e3)
                arena.release_shared_memory()  # the runtime drops the old arena
                arena = fresh
            arena.release_shared_memory()
            copy, move = (statistics.median(samples[k]) for k in ("copy", "relocate"))
            rows.append(
                (
                    device,
                    size,
                    nbytes / 2**20,
                    copy,
                    min(samples["copy"]),
                    move,
                    min(samples["relocate"]),
                    move / copy if copy else float("nan"),
                    nbytes / (move / 1e3) / 1e9 if move else float("nan"),
                )
            )
            del model, arena
    print(f"torch {torch.__version__}; {args.repeats} repeats each, alternating")
    print(
        "| device | shape | arena MiB | copy p50 ms | copy min ms | relocate p50 ms "
        "| relocate min ms | relocate / copy | relocate GB/s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for d, s, mib, c50, cmin, r50, rmin, ratio, rate in rows:
        print(
            f"| {d} | {s} | {mib:.1f} | {c50:.2f} | {cmin:.2f} | {r50:.2f} | {rmin:.2f} "
            f"| {ratio:.2f}x | {rate:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
