"""The loader's make_attachable hook (weights page "Which models can be attached", the
``allocator`` row; contract 8): which loads get a parameter arena."""

from __future__ import annotations

import pytest
import torch

from miserver.ipc.arena import ParameterArena
from miserver.serving.models.loader import make_attachable
from miserver.spec.settings import Settings, WeightsToken

TOKEN = WeightsToken(label="forge", role="trainer", secret="s" * 24)


def model(dtype=torch.bfloat16) -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    return m.to(dtype)


@pytest.mark.parametrize(
    "tokens, cpu_attach, dtype, attachable",
    [
        ((TOKEN,), True, torch.bfloat16, True),
        ((TOKEN,), True, torch.float16, True),
        ((), True, torch.bfloat16, False),  # no token configured at load time
        ((TOKEN,), False, torch.bfloat16, False),  # CPU without WEIGHTS_CPU_ATTACH
        ((TOKEN,), True, torch.float32, False),  # FP32 is never attachable
    ],
)
def test_which_loads_get_an_arena(tmp_path, tokens, cpu_attach, dtype, attachable):
    settings = Settings(home=str(tmp_path), weights_tokens=tokens, weights_cpu_attach=cpu_attach)
    m = model(dtype)
    before = [p.data_ptr() for p in m.parameters()]
    arena = make_attachable(m, settings)
    if attachable:
        assert isinstance(arena, ParameterArena) and len(arena.storages) == 1
        assert all(
            p.untyped_storage().data_ptr() == arena.storages[0].data_ptr() for p in m.parameters()
        )
    else:
        assert arena is None
        assert [p.data_ptr() for p in m.parameters()] == before  # nothing moved


def test_a_quantized_model_gets_no_arena(tmp_path):
    settings = Settings(home=str(tmp_path), weights_tokens=(TOKEN,), weights_cpu_attach=True)
    m = model()
    m.is_quantized = True
    assert make_attachable(m, settings) is None
