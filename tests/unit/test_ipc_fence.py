"""The fence of a cleared holder (issue 32 item 8): :func:`miserver.ipc.arena.relocate` moves
the served set to fresh storages, so the handles an earlier attach exported no longer reach
what is served.

The old holder is a real second process: it rebuilds the attach body with the public client
(:func:`miserver.trainer.rebuild`), keeps the tensors, and writes zeros through them when told
to, after the server side moved. On the CPU this is the shared-memory attach (contract section
8); tests/gpu/test_fence_cuda.py runs the same scenario over CUDA IPC.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from miserver.ipc import arena as A
from miserver.ipc import export as X

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shm in /dev/shm")

#: The cleared holder: rebuild, say so, wait for "write", zero every tensor, say so, then keep
#: its mapping until stdin closes (a frozen-then-resumed trainer).
HOLDER = textwrap.dedent(
    """
    import json, sys, torch
    from miserver import trainer
    body = json.loads(sys.stdin.readline())
    w = trainer.rebuild(body)
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "write"
    with torch.no_grad():
        for t in w.unique_tensors():
            t.zero_()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print("written", flush=True)
    sys.stdin.read()
    """
)


class Holder:
    """The cleared holder's process (see :data:`HOLDER`)."""

    def __init__(self, body: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        self.proc.stdin.write(json.dumps(body) + "\n")
        self.proc.stdin.flush()
        self.expect("ready")

    def expect(self, word: str) -> None:
        line = self.proc.stdout.readline().strip()
        if line != word:
            self.proc.kill()
            raise AssertionError(f"holder said {line!r}: {self.proc.stderr.read()[-2000:]}")

    def write(self) -> None:
        self.proc.stdin.write("write\n")
        self.proc.stdin.flush()
        self.expect("written")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)


class Tiny(torch.nn.Module):
    """Two layers and a tied pair (one ``nn.Parameter`` under two names), bfloat16."""

    def __init__(self, device: str) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(64, 32)
        self.proj = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight  # tied
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.to(device=device, dtype=torch.bfloat16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.embed(ids)))


def served(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def fence_scenario(device: str) -> None:
    """Attach (export), the holder rebuilds; the server relocates and drops the old arena; the
    holder writes zeros through its old handles: nothing served changes, and the model's output
    is the one computed before."""
    model = Tiny(device)
    arena = A.make_attachable(model, cpu_shared=device == "cpu")
    ids = torch.arange(8, device=device).unsqueeze(0)
    before_out = model(ids).detach().clone()
    before = served(model)
    holder = Holder(X.export_handles(arena, model).to_builtins())
    try:
        old_ptrs = [st.data_ptr() for st in arena.storages]
        fresh = A.relocate(arena, model)
        arena.release_shared_memory()  # the server drops the old arena (as the runtime does)
        X.reclaim()
        del arena
        assert all(st.data_ptr() not in old_ptrs for st in fresh.storages)
        assert A.is_in_arena(fresh, model.parameters())
        assert X.moved_parameters(fresh, model) == []  # the address check sees no move
        assert model.head.weight is model.embed.weight  # still one Parameter
        holder.write()  # the cleared holder resumes and writes zeros everywhere
        after = served(model)
        for name, value in before.items():
            assert torch.equal(after[name], value), f"{name} changed through the old handle"
        assert torch.equal(model(ids), before_out)
        # a new attach exports the fresh storages, and its writes do reach what is served
        second = Holder(X.export_handles(fresh, model).to_builtins())
        try:
            second.write()
            assert all(not p.any() for p in model.parameters())
        finally:
            second.close()
        fresh.release_shared_memory()
    finally:
        holder.close()


def test_a_relocated_cpu_arena_is_out_of_reach_of_the_old_shared_memory_handles():
    fence_scenario("cpu")


def test_without_the_move_the_old_handles_do_reach_the_served_set():
    """The control: the scenario's write does land when nothing moves (the test can fail)."""
    model = Tiny("cpu")
    arena = A.make_attachable(model, cpu_shared=True)
    holder = Holder(X.export_handles(arena, model).to_builtins())
    try:
        holder.write()
        assert all(not p.any() for p in model.parameters())
    finally:
        holder.close()
        arena.release_shared_memory()


def test_relocate_keeps_layout_values_requires_grad_and_the_old_arena_intact():
    model = Tiny("cpu")
    model.proj.bias.requires_grad_(False)
    arena = A.make_attachable(model, cpu_shared=True)
    before = served(model)
    fresh = A.relocate(arena, model)
    try:
        assert fresh.slots == arena.slots and fresh.nbytes == arena.nbytes
        assert fresh.storage_kinds == ["cpu_shared_memory"]
        assert fresh.shm_names[0] != arena.shm_names[0]
        assert os.path.exists("/dev/shm" + fresh.shm_names[0])
        # padding and all: the new storage is the old one byte for byte
        (old,), (new,) = arena.storages, fresh.storages
        as_bytes = lambda st: torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))  # noqa: E731
        assert torch.equal(as_bytes(old), as_bytes(new))
        for name, p in model.named_parameters(remove_duplicate=False):
            assert torch.equal(p, before[name])
            assert p.untyped_storage().data_ptr() == new.data_ptr()
        assert model.proj.bias.requires_grad is False and model.proj.weight.requires_grad
        assert fresh.addresses == {n: p.data_ptr() for n, p in model.named_parameters()} | {
            "head.weight": model.head.weight.data_ptr()
        }
    finally:
        arena.release_shared_memory()
        fresh.release_shared_memory()


def test_a_failed_allocation_changes_nothing_and_leaks_no_file(monkeypatch):
    from miserver.ipc import shm

    model = Tiny("cpu")
    arena = A.make_attachable(model, cpu_shared=True)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    mine = lambda: sorted(f for f in os.listdir("/dev/shm") if shm.server_id() in f)  # noqa: E731
    files = mine()

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(A, "_allocate", full)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            A.relocate(arena, model)
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
        assert mine() == files
    finally:
        arena.release_shared_memory()
