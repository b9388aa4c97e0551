"""Attach and in-place write: export and rebuild time and storage count for a 0.5B- and an
8B-shaped bfloat16 model (random weights), and one in-place optimizer-style write against a
copy-based update of the same parameters (the trainer's tensors copied into the served ones,
what other servers do), in one run, as a ratio.

Needs CUDA. The server side is this process (miserver.ipc, no HTTP); the trainer side is a second
process (``--child``) using miserver.trainer. Prints a markdown table (docs/benchmarks.md,
section "Attach and in-place write")::

    python benchmarks/attach.py [--shapes 0.5b,8b] [--reps 20] [--out table.md]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

SHAPES = {
    # Qwen2.5-0.5B's shape (tied embeddings)
    "0.5b": (
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
        ),
    ),
    # Llama-3-8B's shape (untied)
    "8b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=False,
            max_position_embeddings=8192,
        ),
    ),
}


def sync() -> None:
    torch.cuda.synchronize()


def random_model(shape: str) -> torch.nn.Module:
    import transformers

    model_type, kw = SHAPES[shape]
    cfg = transformers.CONFIG_MAPPING[model_type](**kw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to_empty(device="cuda:0")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    sync()
    return model


def time_events(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# --- trainer process ----------------------------------------------------------------------------
def in_place_step(served: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """An SGD-style optimizer write straight into the served tensors."""
    torch._foreach_add_(served, grads, alpha=-1e-4)


def copy_based_step(
    served: list[torch.Tensor], own: list[torch.Tensor], grads: list[torch.Tensor]
) -> None:
    """The same step on the trainer's own copy, then that copy copied into the served tensors."""
    torch._foreach_add_(own, grads, alpha=-1e-4)
    torch._foreach_copy_(served, own)


def attach_cycle(path: str, reps: int, steps: bool) -> dict:
    """One attach as a trainer sees it: decode, rebuild, build the model, optionally time the
    two update styles, release. Times in ms, bytes in bytes."""
    from miserver import trainer

    t0 = time.perf_counter()
    with open(path, "rb") as f:
        body = json.loads(f.read())
    t1 = time.perf_counter()
    w = trainer.rebuild(body)
    sync()
    t2 = time.perf_counter()
    model = trainer.build_model(body, w)
    t3 = time.perf_counter()
    out = {
        "decode_ms": (t1 - t0) * 1e3,
        "rebuild_ms": (t2 - t1) * 1e3,
        "build_model_ms": (t3 - t2) * 1e3,
        "storages": w.storage_count,
    }
    if steps:
        params = w.unique_tensors()
        with torch.no_grad():
            grads = [torch.empty_like(p).normal_(0, 1e-3) for p in params]
            sync()
            base_mem = torch.cuda.memory_allocated()
            # the optimizer writes the served tensors directly
            out["in_place_ms"] = time_events(functools.partial(in_place_step, params, grads), reps)
            out["in_place_extra_bytes"] = torch.cuda.memory_allocated() - base_mem
            own = [p.detach().clone() for p in params]  # the trainer's own copy
            sync()
            out["copy_extra_bytes"] = torch.cuda.memory_allocated() - base_mem
            # step the trainer's own copy, then copy it into the served tensors
            out["copy_ms"] = time_events(
                functools.partial(copy_based_step, params, own, grads), reps
            )
            # the in-place step once more: the spread between the two is the noise
            out["in_place_again_ms"] = time_events(
                functools.partial(in_place_step, params, grads), reps
            )
            del own, grads
        del params
    del model
    w.release()
    gc.collect()
    torch.cuda.empty_cache()
    out["lingering"] = w.lingering
    return out


def child() -> None:
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("op") == "exit":
            break
        print(json.dumps(attach_cycle(msg["path"], msg["reps"], msg["steps"])), flush=True)


# --- server process -----------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="0.5b,8b")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child()
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attach.py needs CUDA")
    import msgspec

    from miserver.ipc.arena import make_attachable
    from miserver.ipc.export import export_handles, reclaim

    worker = subprocess.Popen(
        [sys.executable, __file__, "--child"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        },
    )
    rows = []
    for shape in args.shapes.split(","):
        model = random_model(shape)
        n_params = sum(p.numel() for p in model.parameters())
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        arena = make_attachable(model, cpu_shared=False)
        sync()
        t_place = time.perf_counter() - t0
        peak_extra = torch.cuda.max_memory_allocated() - before
        cycles = []
        for steps in (False, True):  # the first attach of this shape, then the next one
            t0 = time.perf_counter()
            body = export_handles(arena, model)
            raw = msgspec.json.encode(body)
            t_export = time.perf_counter() - t0
            with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as f:
                f.write(raw)
            worker.stdin.write(
                json.dumps({"path": f.name, "reps": args.reps, "steps": steps}) + "\n"
            )
            worker.stdin.flush()
            r = json.loads(worker.stdout.readline())
            os.unlink(f.name)
            reclaim()
            r["export_ms"] = t_export * 1e3
            r["attach_rebuild_ms"] = r["export_ms"] + r["decode_ms"] + r["rebuild_ms"]
            cycles.append(r)
        first, r = cycles
        rows.append(
            {
                "shape": shape,
                "params_b": n_params / 1e9,
                "gib": arena.total_bytes / 2**30,
                "storages": len(body.storages),
                "trainer_storages": r["storages"],
                "place_s": t_place,
                "place_peak_extra_gib": peak_extra / 2**30,
                "export_ms": r["export_ms"],
                "body_kib": len(raw) / 1024,
                "decode_ms": r["decode_ms"],
                "rebuild_ms": r["rebuild_ms"],
                "first_rebuild_ms": first["rebuild_ms"],
                "build_model_ms": r["build_model_ms"],
                "first_build_model_ms": first["build_model_ms"],
                "attach_rebuild_ms": r["attach_rebuild_ms"],
                "first_attach_rebuild_ms": first["attach_rebuild_ms"],
                "in_place_ms": r["in_place_ms"],
                "in_place_again_ms": r["in_place_again_ms"],
                "copy_ms": r["copy_ms"],
                "ratio": r["copy_ms"] / r["in_place_ms"],
                "in_place_extra_gib": r["in_place_extra_bytes"] / 2**30,
                "copy_extra_gib": r["copy_extra_bytes"] / 2**30,
                "lingering": max(first["lingering"], r["lingering"]),
            }
        )
        del model, arena, body
        gc.collect()
        torch.cuda.empty_cache()
    worker.stdin.write(json.dumps({"op": "exit"}) + "\n")
    worker.stdin.close()
    worker.wait(timeout=120)

    props = torch.cuda.get_device_properties(0)
    head = (
        f"{props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}; steps: median "
        f"of {args.reps} CUDA-event-timed steps after 3 warm-ups; one run. Attach times are "
        "the second attach of the shape; (first) is the first, in a trainer process that "
        "had not yet initialised CUDA (0.5b) or imported the architecture (both).\n\n"
    )
    cols = [
        ("shape", "shape", "{}"),
        ("params (B)", "params_b", "{:.2f}"),
        ("weights GiB", "gib", "{:.2f}"),
        ("storages (server/trainer)", None, None),
        ("make_attachable s (peak extra GiB)", None, None),
        ("export+encode ms", "export_ms", "{:.1f}"),
        ("body KiB", "body_kib", "{:.0f}"),
        ("decode ms", "decode_ms", "{:.1f}"),
        ("rebuild ms (first)", None, None),
        ("attach+rebuild ms (first)", None, None),
        ("build_model ms (first)", None, None),
        ("in-place step ms (repeat)", None, None),
        ("copy-based step ms", "copy_ms", "{:.2f}"),
        ("copy / in-place", "ratio", "{:.2f}x"),
        ("extra GiB in-place / copy-based", None, None),
    ]
    special = {
        "storages": lambda r: f"{r['storages']}/{r['trainer_storages']}",
        "make_attachable": lambda r: f"{r['place_s']:.2f} ({r['place_peak_extra_gib']:.2f})",
        "rebuild ms": lambda r: f"{r['rebuild_ms']:.1f} ({r['first_rebuild_ms']:.0f})",
        "attach+rebuild": lambda r: (
            f"{r['attach_rebuild_ms']:.1f} ({r['first_attach_rebuild_ms']:.0f})"
        ),
        "build_model": lambda r: f"{r['build_model_ms']:.0f} ({r['first_build_model_ms']:.0f})",
        "in-place step": lambda r: f"{r['in_place_ms']:.2f} ({r['in_place_again_ms']:.2f})",
        "extra": lambda r: f"{r['in_place_extra_gib']:.2f} / {r['copy_extra_gib']:.2f}",
    }
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        cells = []
        for title, key, fmt in cols:
            fn = next((f for k, f in special.items() if title.startswith(k)), None)
            cells.append(fn(row) if fn else fmt.format(row[key]))
        lines.append("| " + " | ".join(cells) + " |")
    table = head + "\n".join(lines) + "\n"
    print(table)
    print(json.dumps(rows, indent=1))
    if args.out:
        Path(args.out).write_text(table + "\n```json\n" + json.dumps(rows, indent=1) + "\n```\n")


if __name__ == "__main__":
    main()
