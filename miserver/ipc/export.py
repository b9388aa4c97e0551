"""Exporting an arena's handles: ``storages[]``, ``parameters[]``, ``producer``, ``release``,
``config`` of the POST /attach response, plus ``exports_since_start`` and ``cuda_memory``.

Weights page, "Routes" (POST /attach), "Rebuilding the tensors in the trainer", "Releasing the
handles", "Status"; contract section 8 for ``cpu_shared_memory`` entries.

Each storage is shared exactly once per export, which opens one CUDA IPC reference count for it
(or, on the CPU, one shared-memory reference that the trainer's rebuild takes over). A storage
entry carries the fields PyTorch's own reducer emits (``torch.multiprocessing.reductions``:
``reduce_tensor`` for CUDA, ``reduce_storage`` under the ``file_system`` strategy for the CPU),
byte fields base64-encoded.
"""

from __future__ import annotations

import base64
import json
import threading
from typing import Any

import msgspec
import torch

from miserver.ipc import shm
from miserver.ipc.arena import ParameterArena, base_parameter_slots
from miserver.ipc.devices import device_uuid, producer_info

# The wire Structs live in miserver/spec/weights.py (one definition, no torch there); the export
# builds them directly.
from miserver.spec.weights import (
    CpuSharedMemoryStorage,
    CudaIpcStorage,
    ParameterEntry,
    ProcessGroupStorage,
    Producer,
    Release,
)

#: The release contract stated in every export (weights page "Releasing the handles").
RELEASE_CONTRACT = (
    "Rebuild each storage exactly once and take every parameter as a view of it. To release: "
    "drop every rebuilt tensor and anything viewing them, call torch.cuda.ipc_collect(), then "
    "POST /api/weights/detach. pinned_bytes stays reserved in miserver until every storage has "
    "been rebuilt once and released; handles never rebuilt, or still held by a process that "
    "exits or crashes, stay pinned until miserver restarts (detach, clear-stale, reload and "
    "unload do not return them). miserver.trainer does this by construction."
)


class ExportBody(msgspec.Struct, kw_only=True):
    """The handle part of the POST /attach response (weights page "Routes")."""

    storages: list[CudaIpcStorage | CpuSharedMemoryStorage | ProcessGroupStorage]
    parameters: list[ParameterEntry]
    producer: Producer
    release: Release
    config: dict[str, Any] | None

    def to_builtins(self) -> dict[str, Any]:
        """The body as plain JSON types (what a trainer receives)."""
        return msgspec.to_builtins(self)


class ParametersMoved(RuntimeError):
    """A parameter no longer lives where the arena placed it; exporting would hand out handles
    the server no longer reads. ``names`` lists them (weights page "States": torn)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(
            f"{len(names)} parameter(s) moved out of the arena: "
            + ", ".join(names[:5])
            + (" ..." if len(names) > 5 else "")
        )
        self.names = names


_lock = threading.Lock()
_exports = 0


def exports_since_start() -> int:
    """How many times this process has exported handles (weights page "Status")."""
    return _exports


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode("ascii")


def model_config(model: torch.nn.Module) -> dict[str, Any] | None:
    """The architecture config exactly as loaded, every attribute stated (``to_json_string(
    use_diff=False)``), or None when the model has none."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    return json.loads(config.to_json_string(use_diff=False))


_data_ptr = torch.Tensor.data_ptr


def moved_parameters_fast(arena: ParameterArena) -> list[str]:
    """The recorded parameters whose address changed since the arena recorded them, reading
    each through its owning module (no walk of the module tree): a parameter replaced in its
    module, or whose ``.data`` was rebound, is listed. New modules are not seen here; the full
    :func:`moved_parameters` covers them. Sorted. It runs at every commit-end, inside the
    barrier: the common case (nothing moved) is one pass in C over every parameter's
    ``data_ptr()`` compared with the recorded list (about a third less than a Python loop)."""
    # The probe ``(watch, addresses, owners, leaves, expected)`` lives on the arena (so it goes
    # with it), valid while ``watch`` and ``addresses`` are those objects (``record_addresses``
    # replaces both).
    probe = getattr(arena, "_moved_probe", None)
    if probe is None or probe[0] is not arena.watch or probe[1] is not arena.addresses:
        watch, addresses = arena.watch, arena.addresses
        probe = (
            watch,
            addresses,
            [params for _, params, _ in watch],
            [leaf for _, _, leaf in watch],
            [addresses[name] for name, _, _ in watch],
        )
        arena._moved_probe = probe  # type: ignore[attr-defined]
    try:
        if list(map(_data_ptr, map(dict.get, probe[2], probe[3]))) == probe[4]:
            return []
    except TypeError:  # a parameter is gone from its module (dict.get gave None)
        pass
    addresses = arena.addresses
    moved = [
        name
        for name, params, leaf in arena.watch
        if (p := params.get(leaf)) is None or p.data_ptr() != addresses[name]
    ]
    moved.sort()
    return moved


def moved_parameters(arena: ParameterArena, model: torch.nn.Module) -> list[str]:
    """Names whose address changed since the arena last recorded it (placement or export).

    A name is listed when its ``data_ptr()`` differs, when its storage is no longer an arena
    storage, when it is new, or when an arena name is gone. Sorted. The caller turns a
    non-empty answer into a torn set (weights page "States").
    """
    arena_ptrs = {st.data_ptr() for st in arena.storages}
    seen: set[str] = set()
    moved: list[str] = []
    for name, params, leaf in base_parameter_slots(model):
        p = params[leaf]
        seen.add(name)
        if (
            arena.addresses.get(name) != p.data_ptr()
            or p.untyped_storage().data_ptr() not in arena_ptrs
        ):
            moved.append(name)
    moved.extend(n for n in arena.slots if n not in seen)
    return sorted(moved)


def _share(arena: ParameterArena, i: int) -> CudaIpcStorage | CpuSharedMemoryStorage:
    st = arena.storages[i]
    if arena.storage_kinds[i] == "cuda_ipc":
        (index, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = st._share_cuda_()
        return CudaIpcStorage(
            device_index=int(index),
            device_uuid=device_uuid(int(index)),
            handle=_b64(handle),
            storage_size_bytes=int(size),
            storage_offset_bytes=int(offset),
            ref_counter_handle=_b64(rc_handle),
            ref_counter_offset=int(rc_offset),
            event_handle=_b64(ev_handle),
            event_sync_required=bool(ev_sync),
        )
    manager, handle, size = st._share_filename_cpu_()
    # The server owns the file (miserver.ipc.shm): its header count is pinned, so no reference
    # is added for the receiver, and each attach gets its own name, removed at detach.
    names = arena.shm_names
    if i < len(names) and names[i] is not None:
        handle = shm.export_name(names[i]).encode()
    return CpuSharedMemoryStorage(
        manager_handle=_b64(manager), storage_handle=_b64(handle), storage_size_bytes=int(size)
    )


def parameter_entries(arena: ParameterArena, model: torch.nn.Module) -> list[ParameterEntry]:
    """``parameters[]``: every parameter name as a view of one storage (shape, stride and
    storage offset in elements; tied names share a region). Weights page, POST /attach."""
    params = []
    for name, owner, leaf in base_parameter_slots(model):
        p = owner[leaf]
        s = arena.slots[name]
        params.append(
            ParameterEntry(
                name=name,
                storage=s.storage,
                dtype=str(s.dtype).removeprefix("torch."),
                shape=list(s.shape),
                stride=list(s.stride),
                storage_offset=s.storage_offset,
                requires_grad=bool(p.requires_grad),
                tied_to=s.tied_to,
            )
        )
    return params


#: The release contract of a process-group attach (contract 10): nothing is exported.
PROCESS_GROUP_RELEASE = (
    "Nothing is exported: the trainer writes the arena through the attachment's process group "
    "(one broadcast from rank 0 per commit). Detach destroys the group; nothing stays pinned."
)


def export_process_group(arena: ParameterArena, model: torch.nn.Module) -> ExportBody:
    """The POST /attach body of the process-group transport (contract 10): ``storages[]`` of
    ``kind: process_group`` (size, device, the dtypes laid out in it; no handle), the same
    ``parameters[]`` as :func:`export_handles`, ``release.pinned_bytes`` 0. Shares nothing and
    does not count as an export (:func:`exports_since_start`); re-records every parameter's
    address.

    Raises:
        ParametersMoved: a parameter no longer lives where the arena put it.
    """
    moved = moved_parameters(arena, model)
    if moved:
        raise ParametersMoved(moved)
    params = parameter_entries(arena, model)
    storages = []
    for i, st in enumerate(arena.storages):
        dev = st.device
        index = dev.index if dev.type == "cuda" else None
        if dev.type == "cuda" and index is None:
            index = torch.cuda.current_device()
        dtypes = sorted({p.dtype for p in params if p.storage == i})
        storages.append(
            ProcessGroupStorage(
                storage_size_bytes=int(st.nbytes()),
                device_type="cuda" if dev.type == "cuda" else "cpu",
                device_index=index,
                device_uuid=device_uuid(index) if index is not None else None,
                dtypes=dtypes,
            )
        )
    arena.record_addresses(model)
    return ExportBody(
        storages=storages,
        parameters=params,
        producer=Producer(**producer_info()),
        release=Release(pinned_bytes=0, contract=PROCESS_GROUP_RELEASE),
        config=model_config(model),
    )


def export_handles(arena: ParameterArena, model: torch.nn.Module) -> ExportBody:
    """Share every arena storage once and describe every parameter as a view of one.

    Weights page POST /attach (storages, parameters, producer, release, config). Counts one
    export (:func:`exports_since_start`) and re-records every parameter's address.

    Raises:
        ParametersMoved: a parameter no longer lives where the arena put it.
    """
    global _exports
    moved = moved_parameters(arena, model)
    if moved:
        raise ParametersMoved(moved)
    with _lock:
        storages = [_share(arena, i) for i in range(len(arena.storages))]
        _exports += 1
    params = parameter_entries(arena, model)
    arena.record_addresses(model)
    return ExportBody(
        storages=storages,
        parameters=params,
        producer=Producer(**producer_info()),
        release=Release(pinned_bytes=arena.total_bytes, contract=RELEASE_CONTRACT),
        config=model_config(model),
    )


def cuda_memory() -> list[dict[str, Any]] | None:
    """``[{device_index, allocated_mb, reserved_mb}]`` from this process's CUDA caching
    allocator, MiB with 3 decimals; None without CUDA (weights page "Status")."""
    if not torch.cuda.is_available():
        return None
    out = []
    for i in range(torch.cuda.device_count()):
        out.append(
            {
                "device_index": i,
                "allocated_mb": round(torch.cuda.memory_allocated(i) / 2**20, 3),
                "reserved_mb": round(torch.cuda.memory_reserved(i) / 2**20, 3),
            }
        )
    return out


def reclaim() -> None:
    """Free the shared blocks trainers have released (``torch.cuda.ipc_collect()``) and remove
    every attach name of a CPU shared-memory arena (a kept body is then refused when rebuilt;
    :func:`miserver.ipc.shm.revoke_exports`); the detach handler calls it (weights page
    "Rebuilding the tensors": miserver reclaims the shared blocks you released). The CUDA part
    is a no-op without an initialised CUDA context."""
    shm.revoke_exports()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()
