"""The fence of a cleared holder over CUDA IPC (issue 32 item 8): the holder, a second process,
rebuilds the attach body's CUDA IPC handles; the server relocates the arena
(:func:`miserver.ipc.arena.relocate`: a fresh ``MemPool`` allocation, a device copy, the
parameters rebound, the device synchronised) and the holder then writes zeros through its old
handles: nothing served changes. Also: the old allocation is not reused while the holder still
maps it, and the copy is exact on a model with tied weights. Skipped without CUDA; the same
scenario runs over CPU shared memory in tests/unit/test_ipc_fence.py.
"""

from __future__ import annotations

import pytest
import torch

from miserver.ipc import arena as A
from miserver.ipc import export as X
from tests.unit.test_ipc_fence import Holder, Tiny, fence_scenario, served

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_a_relocated_cuda_arena_is_out_of_reach_of_the_old_ipc_handles():
    fence_scenario("cuda")


def test_relocate_on_cuda_makes_a_new_pool_and_keeps_values_and_ties():
    model = Tiny("cuda")
    arena = A.make_attachable(model, cpu_shared=False)
    before = served(model)
    holder = Holder(X.export_handles(arena, model).to_builtins())
    try:
        fresh = A.relocate(arena, model)
        assert fresh.storage_kinds == ["cuda_ipc"]
        assert fresh.pools[0] is not None and fresh.pools[0] is not arena.pools[0]
        assert fresh.storages[0].data_ptr() != arena.storages[0].data_ptr()
        assert model.head.weight is model.embed.weight
        for name, p in model.named_parameters(remove_duplicate=False):
            assert torch.equal(p, before[name])
            assert p.untyped_storage().data_ptr() == fresh.storages[0].data_ptr()
        old = arena.storages[0].data_ptr()
        del arena
        X.reclaim()
        # the old block stays the holder's while it maps it: a new allocation never lands there
        probe = torch.empty(fresh.total_bytes, dtype=torch.uint8, device="cuda")
        assert probe.data_ptr() != old
        holder.write()
        for name, p in model.named_parameters(remove_duplicate=False):
            assert torch.equal(p, before[name])
    finally:
        holder.close()
