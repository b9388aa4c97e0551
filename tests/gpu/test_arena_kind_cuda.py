"""A CUDA load with ``WEIGHTS_CPU_ATTACH=1`` is a CUDA arena, not CPU shared memory (contract
section 8: the setting allows CPU placement; it changes nothing on the card). Skipped without
CUDA; the description alone is checked on the CPU in tests/unit/test_ipc_arena_kind.py.
"""

from __future__ import annotations

import pytest
import torch

from miserver.ipc.export import export_handles
from miserver.serving.models.loader import place_model
from miserver.spec.settings import Settings, WeightsToken

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TOKEN = WeightsToken(label="forge", role="trainer", secret="s" * 24)


@pytest.mark.parametrize("cpu_attach", [False, True], ids=["cpu-attach-off", "cpu-attach-on"])
def test_a_cuda_load_is_a_cuda_ipc_arena_whatever_weights_cpu_attach_says(tmp_path, cpu_attach):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(torch.bfloat16)
    settings = Settings(
        home=str(tmp_path), device="cuda", weights_tokens=(TOKEN,), weights_cpu_attach=cpu_attach
    )
    arena = place_model(model, settings, torch.device("cuda", 0))
    assert arena is not None
    assert arena.storage_kinds == ["cuda_ipc"]
    assert arena.cpu_shared is False
    assert [st.device.type for st in arena.storages] == ["cuda"]
    storages = export_handles(arena, model).to_builtins()["storages"]
    assert [s["kind"] for s in storages] == ["cuda_ipc"]
