"""``ParameterArena.cpu_shared`` and ``storage_kinds`` say what the storages are (contract
section 8), not whether ``WEIGHTS_CPU_ATTACH`` is on: a CUDA arena made with the setting on is
not CPU shared memory, and attach exports each storage under the kind its device gives.

The CUDA arena itself needs a card (tests/gpu/test_arena_kind_cuda.py places one through the
loader with the setting on); here the arena's description is checked as data, and the CPU arena
and its export run for real.
"""

from __future__ import annotations

import torch

from miserver.ipc.arena import ParameterArena, make_attachable
from miserver.ipc.export import export_handles


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


def described(*devices: str) -> ParameterArena:
    """An arena record over ``devices`` (no storage is allocated: only the description)."""
    devs = [torch.device(d) for d in devices]
    return ParameterArena(
        storages=[], devices=devs, nbytes=[512] * len(devs), slots={}, addresses={}
    )


def test_a_cuda_arena_is_not_cpu_shared_memory():
    arena = described("cuda:0")
    assert arena.storage_kinds == ["cuda_ipc"]
    assert arena.cpu_shared is False


def test_a_two_card_arena_is_cuda_ipc_on_each_card():
    arena = described("cuda:0", "cuda:1")
    assert arena.storage_kinds == ["cuda_ipc", "cuda_ipc"]
    assert arena.cpu_shared is False


def test_an_arena_with_a_cpu_storage_holds_cpu_shared_memory():
    arena = described("cuda:0", "cpu")
    assert arena.storage_kinds == ["cuda_ipc", "cpu_shared_memory"]
    assert arena.cpu_shared is True


def test_a_cpu_arena_is_shared_memory_and_exported_as_such():
    model = Tiny().to(torch.bfloat16)
    arena = make_attachable(model, cpu_shared=True)
    assert arena.storage_kinds == ["cpu_shared_memory"]
    assert arena.cpu_shared is True
    assert all(st.is_shared() for st in arena.storages)
    storages = export_handles(arena, model).to_builtins()["storages"]
    assert [s["kind"] for s in storages] == arena.storage_kinds
