"""The parameter arena: every parameter of one device in one dedicated allocation.

Weights page, "Which models can be attached" and "Rebuilding the tensors in the trainer"; design
notes, "Serving": an attachable load places all parameters of one device in one dedicated
allocation, so that the exported handle exposes parameters and nothing else and each device
exports exactly one storage.

On CUDA the allocation is one exact-size ``torch.UntypedStorage`` made inside its own
``torch.cuda.MemPool``: nothing else is ever allocated in that pool, so the CUDA IPC handle of
its segment covers our parameters and nothing else. On the CPU (contract section 8,
``WEIGHTS_CPU_ATTACH=1``) it is one storage in shared memory made through PyTorch's file-system
sharing strategy (``torch_shm_manager``).

Layouts are preserved: parameters that share a source storage (tied embeddings, slices of a fused
tensor, transposed or otherwise strided views) are copied as one byte span, so in the arena they
keep their relative offsets and strides; a tied parameter (one ``nn.Parameter`` reachable under
several names) is one region listed under every name. Buffers are never moved.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

#: Byte alignment of each copied span inside the arena (vectorised kernels want 16; 256 keeps
#: every span on its own cache-line group and matches cudaMalloc's own alignment guarantees).
SPAN_ALIGN = 256
#: The arena's total size is rounded up to this, the CUDA caching allocator's block granule, so
#: the storage's size equals the allocator's block size and ``pinned_bytes`` is exact.
SIZE_GRANULE = 512

#: What an arena storage is, named as attach exports it (weights page ``storages[].kind``).
StorageKind = Literal["cuda_ipc", "cpu_shared_memory"]


class NotArenaCompatible(ValueError):
    """The model cannot be placed in an arena (a meta parameter, a mixed device, a bad target)."""


@dataclass(frozen=True)
class ParameterSlot:
    """Where one parameter lives in the arena.

    Attributes:
        name: the parameter's qualified name (``model.layers.0.mlp.up_proj.weight``).
        storage: index into :attr:`ParameterArena.storages`.
        dtype: the parameter's dtype.
        shape: its size.
        stride: its strides, in elements.
        storage_offset: its offset into the storage, in elements of ``dtype``.
        requires_grad: the parameter's ``requires_grad`` at placement.
        tied_to: the first name under which the same ``nn.Parameter`` was found, or None.
    """

    name: str
    storage: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    requires_grad: bool
    tied_to: str | None = None


@dataclass
class ParameterArena:
    """The dedicated allocations of one attachable model, one per device.

    Attributes:
        storages: one ``torch.UntypedStorage`` per device, in device order.
        devices: the device of each storage.
        nbytes: the size of each storage in bytes (a multiple of :data:`SIZE_GRANULE`).
        slots: name -> :class:`ParameterSlot`, every parameter name, tied names included, in
            ``named_parameters(remove_duplicate=False)`` order.
        addresses: name -> ``data_ptr()`` when the layout was last recorded (at placement and at
            every export); :func:`miserver.ipc.export.moved_parameters` compares against it.
        pools: the ``torch.cuda.MemPool`` of each CUDA storage (None on the CPU); kept alive
            with the arena so nothing else is ever placed in them.
    """

    storages: list[torch.UntypedStorage]
    devices: list[torch.device]
    nbytes: list[int]
    slots: dict[str, ParameterSlot]
    addresses: dict[str, int]
    pools: list[object | None] = field(default_factory=list)
    #: ``(name, owning module's _parameters dict, leaf name)`` per parameter, recorded with the
    #: addresses, so the per-commit check reads each parameter without walking the module tree.
    watch: list[tuple[str, dict, str]] = field(default_factory=list)
    #: per storage: its shared-memory file's name (``/miserver-<id>-a<n>``, owned by
    #: :mod:`miserver.ipc.shm`) for a CPU shared-memory storage, None for a CUDA one.
    shm_names: list[str | None] = field(default_factory=list)

    @property
    def storage_kinds(self) -> list[StorageKind]:
        """What each storage is, as attach exports it (weights page ``storages[].kind``):
        ``cuda_ipc`` for a storage on a CUDA device, ``cpu_shared_memory`` for one on the CPU
        (an arena storage on the CPU is always in shared memory, contract section 8)."""
        return ["cuda_ipc" if d.type == "cuda" else "cpu_shared_memory" for d in self.devices]

    @property
    def cpu_shared(self) -> bool:
        """Whether the arena holds CPU shared memory (contract section 8): True exactly when a
        storage is on the CPU. A CUDA arena is False whatever ``WEIGHTS_CPU_ATTACH`` says (the
        setting only allows CPU placement; it does not make CUDA memory shared memory)."""
        return "cpu_shared_memory" in self.storage_kinds

    @property
    def total_bytes(self) -> int:
        """Bytes held by all storages together (what an export pins)."""
        return sum(self.nbytes)

    def views(self) -> dict[str, torch.Tensor]:
        """A fresh tensor view per parameter name, built from the arena alone (no model needed)."""
        out: dict[str, torch.Tensor] = {}
        for name, s in self.slots.items():
            st = self.storages[s.storage]
            t = torch.empty(0, dtype=s.dtype, device=self.devices[s.storage])
            t.set_(st, s.storage_offset, s.shape, s.stride)
            out[name] = t
        return out

    def release_shared_memory(self) -> None:
        """Remove this arena's shared-memory files and every attach name of them (the server no
        longer serves it; :func:`miserver.ipc.shm.release`). Mappings held elsewhere stay valid
        until unmapped. Idempotent; nothing for a CUDA arena."""
        from miserver.ipc import shm

        for name in self.shm_names:
            if name is not None:
                shm.release(name)

    def record_addresses(self, model: torch.nn.Module) -> None:
        """Store every parameter's current ``data_ptr()`` (called at placement and export)."""
        watch = base_parameter_slots(model)
        self.addresses = {name: params[leaf].data_ptr() for name, params, leaf in watch}
        self.watch = watch


def _is_tuner_layer(module: torch.nn.Module) -> bool:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(module, BaseTunerLayer)


def base_parameter_slots(model: torch.nn.Module) -> list[tuple[str, dict, str]]:
    """``(name, owning module's _parameters, leaf)`` for every parameter, tied names each listed,
    in ``named_parameters(remove_duplicate=False)`` order, looking through LoRA (PEFT tuner)
    layers: with an adapter applied (contract 6) the base parameters keep their base names and
    the adapter's own parameters are left out, so an export and the moved-address check see the
    served base tensors only."""
    out: list[tuple[str, dict, str]] = []

    def walk(module: torch.nn.Module, prefix: str) -> None:
        if _is_tuner_layer(module):
            module = module.get_base_layer()
        for leaf, p in module._parameters.items():
            if p is not None:
                out.append((prefix + leaf, module._parameters, leaf))
        for name, child in module._modules.items():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(model, "")
    return out


def _byte_extent(t: torch.Tensor) -> int:
    """Bytes from the tensor's first element to one past its last one (0 when empty)."""
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def _storage_key(p: torch.Tensor) -> tuple[str, int]:
    st = p.untyped_storage()
    return (str(p.device), st.data_ptr() if st.nbytes() else -id(p))


def _unique_parameters(
    model: torch.nn.Module,
) -> tuple[list[tuple[str, torch.nn.Parameter]], dict[str, str]]:
    """Unique parameters (first name) and tied names -> first name."""
    first: dict[int, str] = {}
    unique: list[tuple[str, torch.nn.Parameter]] = []
    tied: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
            unique.append((name, p))
    return unique, tied


def _allocate(
    nbytes: int, device: torch.device, cpu_shared: bool, *, zero: bool = True
) -> tuple[torch.UntypedStorage, object | None, str | None]:
    """One arena storage of ``nbytes`` on ``device`` (its own ``MemPool`` on CUDA, shared memory
    owned by :mod:`miserver.ipc.shm` on the CPU when ``cpu_shared``); ``zero``: zero it (a
    caller that overwrites every byte passes False)."""
    if device.type == "cuda":
        pool = torch.cuda.MemPool()
        make = torch.zeros if zero else torch.empty
        with torch.cuda.use_mem_pool(pool, device=device):
            st = make(nbytes, dtype=torch.uint8, device=device).untyped_storage()
        return st, pool, None
    st = torch.UntypedStorage(nbytes)
    name = None
    if cpu_shared:
        from miserver.ipc import shm

        # Move it into shared memory through the file-system strategy now, so views taken later
        # already point at the shared pages; the data pointer never changes after this. The
        # server then owns the file (miserver.ipc.shm: no trainer's close can remove it).
        st._share_filename_cpu_()
        name = shm.adopt(st)
    if zero:  # Zero the padding: the handle then exposes parameters and zeros, nothing stale.
        torch.empty(0, dtype=torch.uint8).set_(st, 0, (nbytes,), (1,)).zero_()
    return st, None, name


def make_attachable(
    model: torch.nn.Module, *, cpu_shared: bool, device: torch.device | str | None = None
) -> ParameterArena:
    """Move every parameter of ``model`` into one dedicated allocation per device.

    Weights page "Which models can be attached" (the ``allocator`` condition) and contract
    section 8. Each parameter keeps its ``nn.Parameter`` object (only ``.data`` is replaced), so
    ties, hooks and references held elsewhere stay valid; shape, stride, dtype and
    ``requires_grad`` are unchanged and values are copied bit for bit. Buffers are not moved.

    Args:
        model: the loaded model; its parameters must be on CUDA devices (or on the CPU when
            ``cpu_shared``). Several CUDA devices give one storage each.
        cpu_shared: allow CPU placement, in shared memory (``WEIGHTS_CPU_ATTACH=1``). Without
            it a CPU parameter is refused. It changes nothing for CUDA parameters: the arena's
            :attr:`ParameterArena.cpu_shared` says what the storages are, not this permission.
        device: place the arena on this device instead of each parameter's own (for a model
            loaded on the CPU and served from one GPU: the GPU then never holds two copies);
            buffers are moved there too (outside the arena).

    Returns:
        The :class:`ParameterArena` describing the layout, with addresses recorded.

    Raises:
        NotArenaCompatible: a parameter is on the meta device, or on the CPU without
            ``cpu_shared``, or ``device`` is the CPU without ``cpu_shared``.
    """
    target = torch.device(device) if device is not None else None
    if target is not None and target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    unique, tied = _unique_parameters(model)
    if not unique:
        raise NotArenaCompatible("the model has no parameters")

    # group: device -> source storage -> params
    by_device: dict[torch.device, dict[tuple[str, int], list[tuple[str, torch.Tensor]]]] = {}
    for name, p in unique:
        if p.device.type == "meta":
            raise NotArenaCompatible(f"parameter {name} is on the meta device (not loaded)")
        dev = target or p.device
        if dev.type == "cpu" and not cpu_shared:
            raise NotArenaCompatible(
                f"parameter {name} is on the CPU; CPU placement needs cpu_shared=True "
                "(WEIGHTS_CPU_ATTACH=1)"
            )
        if dev.type not in ("cpu", "cuda"):
            raise NotArenaCompatible(f"parameter {name} is on {dev}, not CUDA or CPU")
        by_device.setdefault(dev, {}).setdefault(_storage_key(p), []).append((name, p.data))

    storages: list[torch.UntypedStorage] = []
    devices: list[torch.device] = []
    nbytes_list: list[int] = []
    pools: list[object | None] = []
    shm_names: list[str | None] = []
    slots_by_name: dict[str, ParameterSlot] = {}
    new_data: dict[str, torch.Tensor] = {}

    def _dev_order(d: torch.device) -> tuple[int, int]:
        return (0 if d.type == "cuda" else 1, d.index or 0)

    with torch.no_grad():
        for dev in sorted(by_device, key=_dev_order):
            groups = by_device[dev]
            # Plan: each source storage's used byte span, placed at an aligned arena offset.
            plan: list[tuple[int, int, int, list[tuple[str, torch.Tensor]]]] = []
            cursor = 0
            for members in groups.values():
                lo = min(t.storage_offset() * t.element_size() for _, t in members)
                hi = max(
                    t.storage_offset() * t.element_size() + _byte_extent(t) for _, t in members
                )
                lo = lo // 16 * 16  # keeps every member's element alignment (itemsize | 16)
                plan.append((cursor, lo, hi, members))
                cursor = _round_up(cursor + (hi - lo), SPAN_ALIGN)
            total = max(_round_up(cursor, SIZE_GRANULE), SIZE_GRANULE)
            st, pool, shm_name = _allocate(total, dev, cpu_shared)
            index = len(storages)
            storages.append(st)
            shm_names.append(shm_name)
            devices.append(dev)
            nbytes_list.append(total)
            pools.append(pool)
            dst_bytes = torch.empty(0, dtype=torch.uint8, device=dev).set_(st, 0, (total,), (1,))
            for arena_off, lo, hi, members in plan:
                src0 = members[0][1]
                if hi > lo:
                    src = torch.empty(0, dtype=torch.uint8, device=src0.device).set_(
                        src0.untyped_storage(), lo, (hi - lo,), (1,)
                    )
                    dst_bytes[arena_off : arena_off + (hi - lo)].copy_(src)
                for name, t in members:
                    byte_off = arena_off + t.storage_offset() * t.element_size() - lo
                    assert byte_off % t.element_size() == 0
                    elem_off = byte_off // t.element_size()
                    view = torch.empty(0, dtype=t.dtype, device=dev).set_(
                        st, elem_off, tuple(t.shape), tuple(t.stride())
                    )
                    new_data[name] = view
                    slots_by_name[name] = ParameterSlot(
                        name=name,
                        storage=index,
                        dtype=t.dtype,
                        shape=tuple(t.shape),
                        stride=tuple(t.stride()),
                        storage_offset=elem_off,
                        requires_grad=False,
                    )
        if any(d.type == "cuda" for d in devices):
            for d in devices:
                if d.type == "cuda":
                    torch.cuda.synchronize(d)
        # Swap .data in place: the Parameter objects (and so ties and optimizer references)
        # stay the same; the old storages are freed once nothing else holds them.
        for name, p in unique:
            p.data = new_data[name]
        if target is not None:  # buffers follow to the target device (they are not in the arena)
            for module in model.modules():
                for bname, buf in list(module._buffers.items()):
                    if buf is not None and buf.device != target:
                        module._buffers[bname] = buf.to(target)

    slots: dict[str, ParameterSlot] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        base = tied.get(name, name)
        s = slots_by_name[base]
        slots[name] = ParameterSlot(
            name=name,
            storage=s.storage,
            dtype=s.dtype,
            shape=s.shape,
            stride=s.stride,
            storage_offset=s.storage_offset,
            requires_grad=p.requires_grad,
            tied_to=tied.get(name),
        )
    arena = ParameterArena(
        storages=storages,
        devices=devices,
        nbytes=nbytes_list,
        slots=slots,
        addresses={},
        pools=pools,
        shm_names=shm_names,
    )
    arena.record_addresses(model)
    return arena


def relocate(arena: ParameterArena, model: torch.nn.Module) -> ParameterArena:
    """Fence the served set: copy every arena storage into a fresh allocation of the same kind
    and size, and rebind every base parameter (``.data``) to its view of the copy. Issue 32
    item 8; weights page "Timers" (clear-stale): once an operator removed a holder that did not
    detach itself, the handles that holder rebuilt (CUDA IPC, or the shared-memory file of
    contract section 8) map the *old* storages, which the server no longer reads.

    The layout is unchanged (same slots, offsets, strides, dtypes; tied names stay one region),
    the values are copied bit for bit, the ``nn.Parameter`` objects stay the same (only
    ``.data`` is rebound, as :func:`make_attachable` does) and the addresses are recorded anew,
    so the per-commit address check sees no move. An applied adapter's own parameters are not
    in the arena and are left alone. The caller drops the old arena: on the CPU it removes the
    old shared-memory file (:meth:`ParameterArena.release_shared_memory`; a process that still
    maps it keeps writing into pages nobody reads, freed when it unmaps them); on CUDA the old
    allocation stays pinned for as long as a process holds its IPC handle (weights page
    "Releasing the handles"). Anything that captured the old addresses (the decode engine's
    CUDA graphs) must be dropped by the caller; caches computed from the old storages hold the
    same values but are dropped with them.

    Args:
        arena: the resident's arena (its storages are read; the object is not changed).
        model: the resident model whose parameters live in ``arena``.

    Returns:
        The new :class:`ParameterArena` (fresh storages, pools and shared-memory names).

    Raises:
        torch.OutOfMemoryError / RuntimeError / OSError: the fresh allocation failed (a card
            with no room for a second copy); nothing was rebound, the model still serves the
            old storages, and nothing was leaked.
    """
    storages: list[torch.UntypedStorage] = []
    pools: list[object | None] = []
    shm_names: list[str | None] = []
    try:
        for dev, n in zip(arena.devices, arena.nbytes, strict=True):
            st, pool, shm_name = _allocate(n, dev, cpu_shared=dev.type == "cpu", zero=False)
            storages.append(st)
            pools.append(pool)
            shm_names.append(shm_name)
    except BaseException:
        from miserver.ipc import shm

        for name in shm_names:
            if name is not None:
                shm.release(name)
        raise
    with torch.no_grad():
        pairs = zip(arena.storages, storages, arena.devices, arena.nbytes, strict=True)
        for old, new, dev, n in pairs:
            dst = torch.empty(0, dtype=torch.uint8, device=dev).set_(new, 0, (n,), (1,))
            dst.copy_(torch.empty(0, dtype=torch.uint8, device=dev).set_(old, 0, (n,), (1,)))
        for dev in arena.devices:
            if dev.type == "cuda":  # every stream then reads the copy, whatever it runs on
                torch.cuda.synchronize(dev)
        views: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], torch.Tensor]
        views = {}
        for name, params, leaf in base_parameter_slots(model):
            s = arena.slots.get(name)
            if s is None:  # not an arena parameter (the address check reports it)
                continue
            key = (s.storage, s.storage_offset, s.shape, s.stride, s.dtype)
            view = views.get(key)
            if view is None:
                view = torch.empty(0, dtype=s.dtype, device=arena.devices[s.storage]).set_(
                    storages[s.storage], s.storage_offset, s.shape, s.stride
                )
                views[key] = view
            params[leaf].data = view
    fresh = ParameterArena(
        storages=storages,
        devices=list(arena.devices),
        nbytes=list(arena.nbytes),
        slots=dict(arena.slots),
        addresses={},
        pools=pools,
        shm_names=shm_names,
    )
    fresh.record_addresses(model)
    return fresh


def parameter_devices(model: torch.nn.Module) -> list[str]:
    """The distinct devices of the model's base parameters (an applied adapter's own are left
    out), as strings (``cuda:0``, ``cpu``)."""
    return sorted({str(params[leaf].device) for _, params, leaf in base_parameter_slots(model)})


def parameter_dtypes(model: torch.nn.Module) -> list[str]:
    """The distinct dtypes of the model's base parameters (an applied adapter's own are left
    out), without the ``torch.`` prefix."""
    return sorted(
        {
            str(params[leaf].dtype).removeprefix("torch.")
            for _, params, leaf in base_parameter_slots(model)
        }
    )


def is_in_arena(arena: ParameterArena, tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every tensor's storage is one of the arena's storages."""
    ptrs = {st.data_ptr() for st in arena.storages}
    return all(t.untyped_storage().data_ptr() in ptrs for t in tensors)
