"""The model host on a CUDA card: loads land on the card with one copy at a time (also an
attachable load, placed in the parameter arena); unload and swap return the memory.

Skipped without CUDA (run on the GPU machine). The CPU suite covers the same paths on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miserver.serving.models.catalogue import Catalogue
from miserver.serving.models.default_model import model_dir
from miserver.serving.models.host import ModelHost
from miserver.spec.settings import Settings, WeightsToken

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MIB = 1024 * 1024


TOKEN = WeightsToken(label="forge", role="trainer", secret="s" * 24)


#: What a load's peak may exceed the resident's own memory by: the decode engine's capture
#: scratch, never a second copy of the weights (a quarter of them).
PEAK_SLACK = 64 * MIB


def _live() -> int:
    """Bytes of live tensors on card 0: synchronized, and the blocks whose free waits on another
    stream's event (the decode engine captures on a side stream) given back first, so a block
    already freed is not counted (``empty_cache`` processes those events; the allocator does so
    otherwise only at its next allocation). The H200 run of 2026-12-02 counted exactly one
    batch-cache layer (192 MiB, [64, 3, 8192, 64] bfloat16) after a swap without this; not yet
    re-run with it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(0)


def make_host(tmp_path: Path, default_home: str, attach: bool) -> ModelHost:
    cat = Catalogue(tmp_path)
    for name in ("smol-a", "smol-b"):
        cat.register(
            name=name, format="safetensors", dtype="bfloat16", path=str(model_dir(default_home))
        )
    tokens = (TOKEN,) if attach else ()
    return ModelHost(Settings(home=str(tmp_path), device="cuda:0", weights_tokens=tokens), cat)


@pytest.mark.parametrize("attach", [False, True], ids=["attach-off", "attach-on"])
async def test_load_unload_and_swap_return_cuda_memory(
    tmp_path: Path, default_home: str, attach: bool
) -> None:
    # One coroutine, no yield between the steps: before the fix the load's asyncio futures
    # kept the last model (269 MB) through the unload. tests/gpu/diagnose_cuda_unload.py tells
    # what holds the memory when this fails.
    host = make_host(tmp_path, default_home, attach)
    baseline = _live()
    torch.cuda.reset_peak_memory_stats(0)
    resident = await host.ensure_for_request("smol-a")
    assert resident.device == torch.device("cuda:0")
    assert resident.attachable == attach and (resident.arena is not None) == attach
    assert {p.device.type for p in resident.model.parameters()} == {"cuda"}
    assert {b.device.type for b in resident.model.buffers()} == {"cuda"}
    assert {p.dtype for p in resident.model.parameters()} == {torch.bfloat16}
    assert resident.model.lm_head.weight is resident.model.model.embed_tokens.weight
    one_model = _live() - baseline
    assert one_model > 200 * MIB  # 134.5M bf16 parameters
    # one copy on the card while loading (an attachable load goes from the CPU straight into
    # the arena; it used to move to the card first, then copy into the arena: two copies).
    # ``one_model`` also holds the decode engine's caches (allocated at load); its captures'
    # scratch adds a few MiB above them at the peak (18.9 MiB on the H200, 2026-12-02), far
    # below a second copy of the weights (269 MB).
    assert torch.cuda.max_memory_allocated(0) - baseline < one_model + PEAK_SLACK
    del resident

    torch.cuda.reset_peak_memory_stats(0)
    await host.ensure_for_request("smol-b")  # a swap: never two models at once
    assert _live() - baseline < one_model + 16 * MIB
    assert torch.cuda.max_memory_allocated(0) - baseline < one_model + PEAK_SLACK

    await host.unload()
    assert _live() - baseline < 16 * MIB
