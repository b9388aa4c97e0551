"""The weights in the trainer: rebuild the storages miserver exports, bind them into a model,
release them (weights page "Rebuilding the tensors in the trainer" and "Releasing the handles";
contract section 8 for CPU shared memory).

:func:`rebuild` opens each exported storage exactly once and takes every parameter as a view of
it; :class:`AttachedWeights` holds them and releases them in the documented order;
:func:`bind_into` and :func:`build_model` put them into a module (tied parameters stay tied).
Re-exported by :mod:`miserver.trainer`.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import gc
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from miserver.ipc.devices import local_index_for_uuid
from miserver.trainer.errors import (
    AlreadyRebuilt,
    DeviceNotVisible,
    InvalidExport,
    LayoutMismatch,
    ProducerMismatch,
    Released,
    StaleExport,
)


def _shm_identity(handle: bytes) -> bytes:
    """What identifies a shared-memory file across its names (each attach exports its own hard
    link of one file): its device and inode, or the handle where /dev/shm is not its home."""
    try:
        st = os.stat(os.path.join("/dev/shm", handle.decode(errors="replace").lstrip("/")))
    except OSError:
        return handle
    return f"inode:{st.st_dev}:{st.st_ino}".encode()


def _os_reason(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return "no such file" if "No such file" in text else text[:200]


# (kind, handle bytes, offset) -> True for every storage this process holds rebuilt.
_live: dict[tuple[str, bytes, int], bool] = {}
_live_lock = threading.Lock()


def check_producer(producer: Mapping[str, Any] | None) -> None:
    """Raise :class:`ProducerMismatch` unless ``producer``'s ``torch`` and ``cuda`` equal this
    process's ``torch.__version__`` and ``torch.version.cuda`` (the driver is informative)."""
    if not isinstance(producer, Mapping):
        raise InvalidExport("the export has no producer block")
    ours = {"torch": str(torch.__version__), "cuda": torch.version.cuda}
    diff = {k: (producer.get(k), v) for k, v in ours.items() if producer.get(k) != v}
    if diff:
        raise ProducerMismatch(diff)


def _b64(entry: Mapping[str, Any], key: str) -> bytes | None:
    v = entry.get(key)
    if v is None:
        return None
    try:
        return base64.b64decode(v, validate=True)
    except (ValueError, TypeError) as e:
        raise InvalidExport(f"storage field {key} is not base64") from e


def _field(entry: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in entry:
        raise InvalidExport(f"{where}: missing field {key}")
    v = entry[key]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise InvalidExport(f"{where}: {key} must be an integer")
    if kind is str and not isinstance(v, str):
        raise InvalidExport(f"{where}: {key} must be a string")
    return v


def _rebuild_storage(
    entry: Mapping[str, Any], i: int
) -> tuple[torch.UntypedStorage, tuple[str, bytes, int]]:
    where = f"storages[{i}]"
    kind = entry.get("kind")
    if kind == "cuda_ipc":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        uuid = _field(entry, "device_uuid", str, where)
        size = _field(entry, "storage_size_bytes", int, where)
        offset = _field(entry, "storage_offset_bytes", int, where)
        handle = _b64(entry, "handle")
        if handle is None:
            raise InvalidExport(f"{where}: missing field handle")
        key = ("cuda_ipc", handle, offset)
        if not torch.cuda.is_available():
            raise DeviceNotVisible(
                f"{where} is on CUDA device {uuid}, and this process has no CUDA"
            )
        index = local_index_for_uuid(uuid)
        if index is None:
            raise DeviceNotVisible(
                f"{where} is on CUDA device {uuid}, which this process does "
                "not see (check CUDA_VISIBLE_DEVICES)"
            )
        _claim(key, where)
        try:
            whole = rebuild_cuda_tensor(
                torch.Tensor,
                (size,),
                (1,),
                0,
                torch.UntypedStorage,
                torch.uint8,
                index,
                handle,
                size,
                offset,
                False,
                _b64(entry, "ref_counter_handle"),
                _field(entry, "ref_counter_offset", int, where),
                _b64(entry, "event_handle"),
                bool(entry.get("event_sync_required")),
            )
        except BaseException:
            _unclaim(key)
            raise
        return whole.untyped_storage(), key
    if kind == "cpu_shared_memory":
        manager = _b64(entry, "manager_handle")
        handle = _b64(entry, "storage_handle")
        size = _field(entry, "storage_size_bytes", int, where)
        if manager is None or handle is None:
            raise InvalidExport(f"{where}: missing manager_handle or storage_handle")
        key = ("cpu_shared_memory", _shm_identity(handle), 0)
        _claim(key, where)
        try:
            # Open the file and hold one reference of our own, released when the storage is
            # freed; unlike torch's rebuild_storage_filename, no reference of the server's is
            # taken over, so no number of rebuilds, in any processes, can free the server's file.
            st = torch.UntypedStorage._new_shared_filename_cpu(manager, handle, size)
        except RuntimeError as exc:
            _unclaim(key)
            raise StaleExport(
                f"{where} cannot be opened ({_os_reason(exc)}): this attach body is no longer "
                "served (detached, reloaded or unloaded since, or the server restarted); "
                "POST /api/weights/attach again and rebuild the body it returns"
            ) from None
        except BaseException:
            _unclaim(key)
            raise
        return st, key
    raise InvalidExport(f"{where}: unknown kind {kind!r} (expected cuda_ipc or cpu_shared_memory)")


def _claim(key: tuple[str, bytes, int], where: str) -> None:
    with _live_lock:
        if key in _live:
            raise AlreadyRebuilt(
                f"{where} is already rebuilt in this process; release the first AttachedWeights "
                "before rebuilding (each storage is rebuilt exactly once)"
            )
        _live[key] = True


def _unclaim(key: tuple[str, bytes, int]) -> None:
    with _live_lock:
        _live.pop(key, None)


def _dtype(name: Any, where: str) -> torch.dtype:
    d = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(d, torch.dtype):
        raise InvalidExport(f"{where}: unknown dtype {name!r}")
    return d


def _view(storages: list[torch.UntypedStorage], p: Mapping[str, Any], j: int) -> torch.Tensor:
    where = f"parameters[{j}]"
    sidx = _field(p, "storage", int, where)
    if not 0 <= sidx < len(storages):
        raise InvalidExport(f"{where}: storage {sidx} does not exist")
    dtype = _dtype(p.get("dtype"), where)
    shape, stride = tuple(p.get("shape", ())), tuple(p.get("stride", ()))
    if len(shape) != len(stride) or any(
        isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in shape + stride
    ):
        raise InvalidExport(
            f"{where}: shape and stride must be equal-length lists of non-negative integers"
        )
    offset = _field(p, "storage_offset", int, where)
    st = storages[sidx]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    end = (
        0
        if numel == 0
        else (offset + sum((s - 1) * t for s, t in zip(shape, stride, strict=True)) + 1)
    )
    if offset < 0 or end * itemsize > st.nbytes():
        raise InvalidExport(
            f"{where} ({p.get('name')}): the view ends at byte {end * itemsize},"
            f" beyond its storage of {st.nbytes()} bytes"
        )
    t = torch.empty(0, dtype=dtype, device=st.device)
    t.set_(st, offset, shape, stride)
    return t.requires_grad_(bool(p.get("requires_grad", False)))


def distinct_tensors(tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of ``tensors`` each once, in order (a view listed under several names,
    a tied parameter, comes under its first name only)."""
    seen: set[int] = set()
    out = []
    for t in tensors.values():
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


class AttachedWeights:
    """The rebuilt weights of one attach: one storage per exported storage entry and one view
    per parameter name (tied names map to the same tensor object).

    Use as a context manager, or call :meth:`release`. Attributes: ``tensors`` (name -> view),
    ``pinned_bytes`` (the export's release.pinned_bytes), ``released``, ``lingering`` (after
    release: storages something outside still referenced, which then stay pinned in the server).
    """

    def __init__(
        self,
        storages: list[torch.UntypedStorage],
        keys: list[tuple[str, bytes, int]],
        tensors: dict[str, torch.Tensor],
        pinned_bytes: int | None,
        on_release: Callable[[], Any] | None,
    ) -> None:
        self._storages = storages
        self._storage_count = len(storages)
        self._keys = keys
        self.tensors = tensors
        self.pinned_bytes = pinned_bytes
        self._on_release = on_release
        self._bound: list[torch.nn.Parameter] = []
        self._lock = threading.Lock()
        self.released = False
        self.lingering = 0
        atexit.register(self._release_at_exit)

    # --- access -----------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        self._check()
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def storage_count(self) -> int:
        """How many storages were rebuilt (one per exported entry); kept after release."""
        return self._storage_count

    def unique_tensors(self) -> list[torch.Tensor]:
        """Each distinct view once (a tied parameter once), in export order."""
        self._check()
        return distinct_tensors(self.tensors)

    def _check(self) -> None:
        if self.released:
            raise Released("these weights were released; attach and rebuild again")

    # --- release ----------------------------------------------------------------------------
    def release(self) -> None:
        """Release in the documented order: drop every view (the ``tensors`` and every
        parameter bound into a model become empty), ``torch.cuda.ipc_collect()``, then the
        ``on_release`` callback (detach). Idempotent. Weights page "Releasing the handles".

        Warns (``ResourceWarning``) when a storage is still referenced from outside (a view the
        caller made itself): that storage stays pinned in the server until this process ends.
        """
        with self._lock:
            if self.released:
                return
            self.released = True
        try:
            atexit.unregister(self._release_at_exit)
            from torch.multiprocessing.reductions import StorageWeakRef

            refs = [StorageWeakRef(s) for s in self._storages]
            with torch.no_grad():
                for t in list(self.tensors.values()) + self._bound:
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
            self.tensors = {}
            self._bound = []
            self._storages = []
            if any(not r.expired() for r in refs):
                gc.collect()
            self.lingering = sum(not r.expired() for r in refs)
            with _live_lock:
                for k in self._keys:
                    _live.pop(k, None)
            if self.lingering:
                warnings.warn(
                    f"{self.lingering} rebuilt storage(s) are still referenced outside "
                    "AttachedWeights (a view you made of a parameter); they stay pinned in the "
                    "server until this process exits",
                    ResourceWarning,
                    stacklevel=2,
                )
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.ipc_collect()
        finally:
            cb, self._on_release = self._on_release, None
            if cb is not None:
                cb()

    def _release_at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.release()

    def __enter__(self) -> AttachedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # --- models -----------------------------------------------------------------------------
    def bind_into(self, model: torch.nn.Module) -> torch.nn.Module:
        """See :func:`bind_into`."""
        return bind_into(model, self)

    def __repr__(self) -> str:
        state = "released" if self.released else f"{len(self._storages)} storage(s)"
        return f"<AttachedWeights {len(self.tensors)} parameter(s), {state}>"


def rebuild(
    body: Mapping[str, Any], *, on_release: Callable[[], Any] | None = None
) -> AttachedWeights:
    """Rebuild the exported weights: each storage exactly once, every parameter as a view.

    Weights page "Rebuilding the tensors in the trainer". ``body`` is the POST /attach response
    data (or :meth:`miserver.ipc.export.ExportBody.to_builtins`), decoded from JSON. Tied names
    (same storage entry and offset) map to one tensor object. Views carry the parameters'
    ``requires_grad``: write under ``torch.no_grad()``.

    Args:
        body: ``{producer, storages[], parameters[], release, ...}``.
        on_release: called last by :meth:`AttachedWeights.release` (the client's detach).

    Raises:
        ProducerMismatch: the server's torch or CUDA build differs from this process's.
        DeviceNotVisible: a CUDA storage's device UUID is not visible here.
        AlreadyRebuilt: a storage is already rebuilt and not released in this process.
        StaleExport: a CPU shared-memory storage is no longer served (attach again).
        InvalidExport: the body is malformed or a view falls outside its storage.
    """
    if not isinstance(body, Mapping):
        raise InvalidExport("the export body must be a JSON object")
    check_producer(body.get("producer"))
    entries, params = body.get("storages"), body.get("parameters")
    if not isinstance(entries, list) or not isinstance(params, list):
        raise InvalidExport("the export body needs storages[] and parameters[]")
    storages: list[torch.UntypedStorage] = []
    keys: list[tuple[str, bytes, int]] = []
    try:
        for i, entry in enumerate(entries):  # ONE rebuild per storage entry
            if not isinstance(entry, Mapping):
                raise InvalidExport(f"storages[{i}] must be an object")
            st, key = _rebuild_storage(entry, i)
            storages.append(st)
            keys.append(key)
        tensors: dict[str, torch.Tensor] = {}
        by_layout: dict[tuple, torch.Tensor] = {}
        for j, p in enumerate(params):  # a VIEW per parameter (tied names share one)
            if not isinstance(p, Mapping) or not isinstance(p.get("name"), str):
                raise InvalidExport(f"parameters[{j}] must be an object with a name")
            layout = (
                p.get("storage"),
                p.get("storage_offset"),
                p.get("dtype"),
                tuple(p.get("shape", ())),
                tuple(p.get("stride", ())),
            )
            tied = p.get("tied_to")
            if tied is not None and tied in tensors:
                tensors[p["name"]] = tensors[tied]
            elif layout in by_layout:
                tensors[p["name"]] = by_layout[layout]
            else:
                t = _view(storages, p, j)
                by_layout[layout] = t
                tensors[p["name"]] = t
    except BaseException:
        with _live_lock:
            for k in keys:
                _live.pop(k, None)
        raise
    release = body.get("release") or {}
    return AttachedWeights(storages, keys, tensors, release.get("pinned_bytes"), on_release)


def _set_parameter(model: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    module._parameters[leaf] = param


def bind_into(
    model: torch.nn.Module, weights: AttachedWeights | Mapping[str, torch.Tensor]
) -> torch.nn.Module:
    """Make ``model``'s parameters the rebuilt views, so an optimizer steps the served tensors.

    Every name of ``model.named_parameters(remove_duplicate=False)`` must be exported with the
    same shape and dtype, and every exported name must exist in the model. Names exported as one
    tensor (tied weights) become one ``nn.Parameter`` (they stay tied). The model may live on the
    meta device (see :func:`build_model`). With an :class:`AttachedWeights`, the parameters are
    emptied by its :meth:`~AttachedWeights.release`.

    Raises:
        LayoutMismatch: names, shapes or dtypes differ (nothing is changed then).
    """
    views = weights.tensors if isinstance(weights, AttachedWeights) else dict(weights)
    if isinstance(weights, AttachedWeights):
        weights._check()
    current = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(current) - set(views))
    extra = sorted(set(views) - set(current))
    wrong = [
        f"{n}: model {tuple(p.shape)} {p.dtype}, export {tuple(views[n].shape)} {views[n].dtype}"
        for n, p in current.items()
        if n in views and (tuple(p.shape) != tuple(views[n].shape) or p.dtype != views[n].dtype)
    ]
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"not exported: {', '.join(missing[:5])}")
        if extra:
            parts.append(f"not in the model: {', '.join(extra[:5])}")
        if wrong:
            parts.append("; ".join(wrong[:5]))
        raise LayoutMismatch("the model does not match the export (" + "; ".join(parts) + ")")
    made: dict[int, torch.nn.Parameter] = {}
    for name in current:
        v = views[name]
        if id(v) not in made:
            made[id(v)] = torch.nn.Parameter(v, requires_grad=v.requires_grad)
        _set_parameter(model, name, made[id(v)])
    if isinstance(weights, AttachedWeights):
        weights._bound.extend(made.values())
    return model


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While active, every parameter registered is moved to the meta device at once (buffers
    stay where they are made). The same technique as accelerate's ``init_empty_weights``."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_model(
    body: Mapping[str, Any],
    weights: AttachedWeights | None = None,
    *,
    model_class: type | None = None,
) -> torch.nn.Module:
    """Build the served architecture from ``body["config"]`` and bind ``weights`` into it.

    The graph comes from the config the server exported (weights page: rebuild the graph from
    this, not from a copy). Parameters are created on the meta device and replaced by the views,
    so no second copy of the weights is ever allocated; buffers (rotary tables, ...) are built on
    the weights' device. Tied weights stay tied.

    Args:
        body: the export (needs ``config`` and ``parameters``).
        weights: from :func:`rebuild`; None builds them here with ``rebuild(body)`` (release
            them through ``model.attached_weights``).
        model_class: the transformers class; default ``config["architectures"][0]``, else
            ``AutoModelForCausalLM``.

    Raises:
        InvalidExport: ``config`` is null or names an unknown model type.
        LayoutMismatch: the built model's parameters differ from the export.
    """
    import transformers

    config = body.get("config")
    if not isinstance(config, Mapping) or "model_type" not in config:
        raise InvalidExport(
            "the export has no config; build the model yourself and call bind_into(model, weights)"
        )
    try:
        cfg_cls = transformers.CONFIG_MAPPING[config["model_type"]]
    except KeyError as e:
        raise InvalidExport(
            f"unknown model_type {config['model_type']!r} for this "
            f"transformers {transformers.__version__}"
        ) from e
    cfg = cfg_cls.from_dict(dict(config))
    if weights is None:
        weights = rebuild(body)
    dtypes = [v.dtype for v in weights.unique_tensors()]
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else torch.get_default_dtype()
    device = weights.unique_tensors()[0].device if len(weights) else torch.device("cpu")
    if model_class is None:
        arch = (config.get("architectures") or [None])[0]
        model_class = getattr(transformers, arch, None) if arch else None
    with torch.device(device), _parameters_on_meta():
        if model_class is None:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        else:
            model = model_class._from_config(cfg, dtype=dtype)
    bind_into(model, weights)
    model.attached_weights = weights  # keeps them alive as long as the model is
    return model
