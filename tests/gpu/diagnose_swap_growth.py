"""Does a swap leave memory behind each time, or once? (the H200 finding of 2026-12-02:
``test_load_unload_and_swap_return_cuda_memory[attach-off]`` counted 192-384 MiB more allocated
after a swap than after the first load, with no live tensor found by ``gc``).

Loads ``smol-a`` then swaps between two catalogue rows of the default model six times and
unloads, printing the bytes allocated on card 0 after each step (synchronized, ``empty_cache``
first), for ``MAX_BATCH_SIZE`` 64 and 1 (one decode bucket), attach off and on.
Run on the GPU machine: ``python tests/gpu/diagnose_swap_growth.py``. Not a test (no asserts):
a diagnosis printed for the notes. The last line clears cuBLAS's per-stream workspaces after the
unload: what it frees is what they held (the cause found on 2026-12-03: a new warm-up stream per
capture, fixed by one warm-up stream per device, now ``devices.warmup_stream``).
"""

from __future__ import annotations

import asyncio
import gc
import os
import tempfile

import torch

from miserver.serving.models.catalogue import Catalogue
from miserver.serving.models.default_model import model_dir
from miserver.serving.models.host import ModelHost
from miserver.spec.settings import Settings, WeightsToken

MIB = 1024 * 1024
TOKEN = WeightsToken(label="forge", role="trainer", secret="s" * 24)


def live() -> float:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(0) / MIB


async def scenario(default_home: str, rows: int, attach: bool) -> None:
    home = tempfile.mkdtemp(prefix="swap-growth-")
    cat = Catalogue(home)
    for name in ("smol-a", "smol-b"):
        cat.register(
            name=name, format="safetensors", dtype="bfloat16", path=str(model_dir(default_home))
        )
    settings = Settings(
        home=home,
        device="cuda:0",
        weights_tokens=(TOKEN,) if attach else (),
        max_batch_size=rows,
    )
    host = ModelHost(settings, cat)
    base = live()
    steps = []
    await host.ensure_for_request("smol-a")
    steps.append(("load a", live() - base))
    for i in range(6):
        await host.ensure_for_request("smol-b" if i % 2 == 0 else "smol-a")
        steps.append((f"swap {i + 1}", live() - base))
    await host.unload()
    steps.append(("unload", live() - base))
    # the suspected holder: cuBLAS's workspace per stream it ran on (allocator memory, never
    # freed by empty_cache); clearing them after the unload shows what they held
    torch._C._cuda_clearCublasWorkspaces()
    steps.append(("- cuBLAS", live() - base))
    first = steps[0][1]
    print(f"MAX_BATCH_SIZE={rows} attach={'on' if attach else 'off'} (MiB above the start)")
    for name, mib in steps:
        print(f"  {name:8} {mib:10.2f}   vs the first load {mib - first:+9.2f}")


async def main() -> None:
    default_home = os.environ.get("MISERVER_TEST_HOME") or os.environ["MISERVER_HOME"]
    for rows in (64, 1):
        for attach in (False, True):
            await scenario(default_home, rows, attach)


if __name__ == "__main__":
    asyncio.run(main())
