"""The process-group commit (contract section 10) against what peers do, on the CPU over gloo.

Per step the trainer (rank 0, a second process) broadcasts the whole arena's bytes once; the
server (rank 1, this process) receives them either

- **in place**: miserver's :class:`~miserver.ipc.process_group.ArenaGroup` posts the broadcast
  straight into the arena storage (what commit-begin arms) and waits for its completion (what
  commit-end waits for); or
- **staging + copy**: a plain gloo broadcast into a staging tensor of the arena's size, then
  ``arena.copy_(staging)`` (SGLang's ``update_weights_from_distributed``, vLLM's NCCL weight
  transfer).

Both see the same bytes over the same group, interleaved step by step in one run (so drift
hits both alike); the table gives each one's median and p90 per-step time, the ratio, and the
extra memory the server holds (the staging copy). Each step's bytes differ, and the server
checks that the arena holds the trainer's bytes after every step (exit 1 otherwise)::

    python benchmarks/process_group_commit.py [--sizes 16,64,256] [--steps 20] [--out DIR]

Sizes are MiB of arena (SmolLM2-135M in bfloat16 is about 258 MiB).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from miserver.ipc.process_group import (  # noqa: E402
    ArenaGroup,
    GroupSpec,
    broadcast_options,
    byte_view,
)
from miserver.trainer.process_group import FlatWeights, TrainerGroup  # noqa: E402

TIMEOUT_S = 120.0


def _export(nbytes: int) -> dict:
    return {
        "storages": [{"kind": "process_group", "storage_size_bytes": nbytes}],
        "parameters": [
            {"name": "arena", "storage": 0, "dtype": "uint8", "shape": [nbytes], "stride": [1],
             "storage_offset": 0, "requires_grad": False}
        ],
    }  # fmt: skip


def _fill(buf: torch.Tensor, step: int) -> None:
    buf.fill_(step % 251)
    buf[::4099] = (step * 7) % 256


def child(port: int, sizes: list[int], steps: int) -> None:
    """Rank 0: host the rendezvous, send every step's bytes."""
    trainer = TrainerGroup(2, port=port, timeout_s=TIMEOUT_S)
    trainer.connect()
    group = trainer.group
    for nbytes in sizes:
        weights = FlatWeights.from_export(_export(nbytes))
        for step in range(2 * steps + 2):  # two warm-up steps, then both approaches alternately
            _fill(weights.buffers[0], step)
            group.barrier().wait()
            trainer.send(weights)
    group.barrier().wait()
    trainer.destroy()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="16,64,256", help="arena sizes in MiB, comma-separated")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per approach")
    ap.add_argument("--out", type=Path, default=None, help="write the table and JSON here")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(float(s) * 2**20) for s in args.sizes.split(",")]
    if args.child is not None:
        child(args.child, sizes, args.steps)
        return 0
    torch.set_num_threads(1)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", str(port), "--sizes", args.sizes,
         "--steps", str(args.steps)]
    )  # fmt: skip
    rows = []
    failures = []
    try:
        server = None
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:  # the child's store may not listen yet
            arena0 = torch.zeros(1, dtype=torch.uint8).untyped_storage()
            spec = GroupSpec.parse(f"tcp://127.0.0.1:{port}", 2, 1)
            server = ArenaGroup(spec, [arena0], connect_timeout_s=TIMEOUT_S, op_timeout_s=60)
            if server.start().wait_ready(TIMEOUT_S):
                break
            time.sleep(0.2)
        if server is None or server.state != "ready":
            print(f"could not join the trainer: {server and server.error}", file=sys.stderr)
            return 1
        group = server._group
        for nbytes in sizes:
            arena = torch.zeros(nbytes, dtype=torch.uint8).untyped_storage()
            # the same group, re-pointed at this size's arena (ArenaGroup is one arena's)
            server.storages, server.nbytes = [arena], [nbytes]
            arena_t = byte_view(arena)
            staging = None
            times: dict[str, list[float]] = {"in place": [], "staging + copy": []}
            for step in range(2 * args.steps + 2):
                approach = "in place" if step % 2 == 0 else "staging + copy"
                group.barrier().wait()
                t0 = time.perf_counter()
                if approach == "in place":
                    receive = server.arm()
                    if not receive.wait(TIMEOUT_S):
                        failures.append(f"{nbytes}: step {step}: {receive.error}")
                        break
                else:
                    if staging is None:
                        staging = torch.empty(nbytes, dtype=torch.uint8)
                    group.broadcast([staging], broadcast_options()).wait()
                    arena_t.copy_(staging)
                dt = time.perf_counter() - t0
                expected = torch.empty(nbytes, dtype=torch.uint8)
                _fill(expected, step)
                if not torch.equal(arena_t, expected):
                    failures.append(f"{nbytes} B, step {step} ({approach}): arena differs")
                if step >= 2:
                    times[approach].append(dt * 1e3)
            med = {k: statistics.median(v) for k, v in times.items() if v}
            p90 = {k: sorted(v)[int(0.9 * (len(v) - 1))] for k, v in times.items() if v}
            for approach in times:
                rows.append(
                    {
                        "approach": approach,
                        "arena_mib": round(nbytes / 2**20, 1),
                        "steps": len(times[approach]),
                        "median_ms": round(med.get(approach, float("nan")), 3),
                        "p90_ms": round(p90.get(approach, float("nan")), 3),
                        "gib_per_s": round(nbytes / 2**30 / (med[approach] / 1e3), 3)
                        if approach in med
                        else None,
                        "extra_server_bytes": 0 if approach == "in place" else nbytes,
                        "ratio_to_in_place": round(med[approach] / med["in place"], 3)
                        if approach in med and "in place" in med
                        else None,
                    }
                )
            del staging
        group.barrier().wait()
        server.destroy()
    finally:
        try:
            proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
    lines = [
        "| arena MiB | approach | median ms/step | p90 ms | GiB/s | extra server memory | "
        "× in place |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arena_mib']} | {r['approach']} | {r['median_ms']} | {r['p90_ms']} | "
            f"{r['gib_per_s']} | {r['extra_server_bytes'] / 2**20:.1f} MiB | "
            f"{r['ratio_to_in_place']} |"
        )
    table = "\n".join(lines)
    print(f"torch {torch.__version__}, gloo over loopback, 2 processes, {args.steps} steps each")
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "process_group_commit.md").write_text(table + "\n")
        (args.out / "process_group_commit.json").write_text(json.dumps(rows, indent=1))
    if failures or proc.returncode != 0:
        print("FAILED:", *failures, f"trainer exit {proc.returncode}", sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
