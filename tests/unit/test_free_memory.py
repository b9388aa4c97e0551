"""What a dropped model gives back (``miserver.serving.models.host.free_memory``): cuBLAS's per-stream
workspaces go after a load's or an unload's drop, never at process shutdown, whose grace may
have ended mid-pass (the swap finding of 2026-12-03, docs/benchmarks.md). CUDA is faked here;
tests/gpu/test_model_host_cuda.py measures the real card."""

from __future__ import annotations

import torch

from miserver.serving.models import host as host_module
from miserver.serving.models.host import ModelHost, free_memory


def fake_cuda(monkeypatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(
        torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear"), raising=False
    )
    return calls


def test_the_workspaces_go_only_when_nothing_is_resident(monkeypatch) -> None:
    calls = fake_cuda(monkeypatch)
    free_memory()
    assert calls == ["empty_cache"]
    calls.clear()
    free_memory(nothing_resident=True)
    assert calls == ["clear", "empty_cache"]  # cleared first, then the cache returned


def test_a_build_without_the_call_still_empties_the_cache(monkeypatch) -> None:
    calls = fake_cuda(monkeypatch)
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces")
    free_memory(nothing_resident=True)
    assert calls == ["empty_cache"]


class _Row:
    name = "m"


class _Resident:
    row, engine_loop, arena = _Row(), None, None


class _Catalogue:
    def set_resident(self, row_id) -> None:
        pass


def bare_host() -> ModelHost:
    """A host holding a stand-in resident: only ``_drop_resident`` runs on it."""
    host = ModelHost.__new__(ModelHost)
    host.resident, host.catalogue, host.metrics, host.drop_hooks = (
        _Resident(),
        _Catalogue(),
        None,
        [],
    )
    return host


def test_a_drop_clears_the_workspaces_and_a_shutdown_does_not(monkeypatch) -> None:
    frees: list[bool] = []
    monkeypatch.setattr(
        host_module, "free_memory", lambda nothing_resident=False: frees.append(nothing_resident)
    )
    host = bare_host()
    host._drop_resident()  # what a load's and an unload's drop call
    assert frees == [True] and host.resident is None
    host = bare_host()
    host.shutdown()
    assert frees == [True, False] and host.resident is None


def test_every_drop_trims_the_c_heap_and_the_trim_works_on_this_libc(monkeypatch) -> None:
    """A dropped model's cache and weights are freed into glibc's arenas, which keep the pages
    (a trial: 2.1 -> 5.3 GB RSS over 9 swaps, 1.9 GB once trimmed): free_memory trims them."""
    import ctypes.util
    import platform

    trims: list[int] = []
    real = host_module.trim_heap
    monkeypatch.setattr(host_module, "trim_heap", lambda: trims.append(1) or True)
    free_memory()
    free_memory(nothing_resident=True)
    assert trims == [1, 1]
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert ctypes.util.find_library("c") is not None
        assert real() is True
