"""The model host on a CUDA card: loads land on the card; unload and swap return the memory.

Skipped without CUDA (run on the GPU machine). The CPU suite covers the same paths on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miserver.serving.catalogue import Catalogue
from miserver.serving.default_model import model_dir
from miserver.serving.host import ModelHost
from miserver.spec.settings import Settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MIB = 1024 * 1024


@pytest.fixture
def host(tmp_path: Path, default_home: str) -> ModelHost:
    cat = Catalogue(tmp_path)
    for name in ("smol-a", "smol-b"):
        cat.register(
            name=name, format="safetensors", dtype="bfloat16", path=str(model_dir(default_home))
        )
    return ModelHost(Settings(home=str(tmp_path), device="cuda:0"), cat)


async def test_load_unload_and_swap_return_cuda_memory(host: ModelHost) -> None:
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(0)
    resident = await host.ensure_for_request("smol-a")
    assert resident.device == torch.device("cuda:0")
    assert {p.device.type for p in resident.model.parameters()} == {"cuda"}
    assert {p.dtype for p in resident.model.parameters()} == {torch.bfloat16}
    one_model = torch.cuda.memory_allocated(0) - baseline
    assert one_model > 200 * MIB  # 134.5M bf16 parameters
    del resident

    await host.ensure_for_request("smol-b")  # a swap: never two models at once afterwards
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(0) - baseline < one_model + 16 * MIB

    await host.unload()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(0) - baseline < 16 * MIB
