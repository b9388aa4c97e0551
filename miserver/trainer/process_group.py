"""The trainer's half of the process-group transport (contract section 10): rank 0 of the group
that writes every replica's arena with one broadcast.

Public API::

    from miserver.trainer.process_group import TrainerGroup

    group = TrainerGroup(world_size=3, advertise_host="trainer.example")  # hosts the TCPStore
    body = {"transport": "process_group", "init_method": group.init_method,
            "world_size": 3, "rank": 1}                                   # rank 2 for replica 2
    ... POST /api/weights/attach with that body to each replica ...
    weights = group.layout(attach_response_data)  # one flat uint8 buffer per storage
    weights.fill_from(model.state_dict())         # the same values the replicas serve
    group.connect()                               # blocks until every replica has joined
    ... quiesce + commit-begin on every replica ...
    group.send(weights)                           # one broadcast per storage (or range)
    ... commit-end + resume on every replica ...
    group.destroy()

:class:`~miserver.trainer.replicas.ReplicaSet` does the HTTP side for several replicas.

Rank 0 serves a ``torch.distributed.TCPStore`` for ``world_size`` ranks; every rank builds the
group over ``PrefixStore("miserver", store)``: ``ProcessGroupGloo`` for CPU arenas,
``ProcessGroupNCCL`` for CUDA ones; never the default group, so the training process may use
``torch.distributed`` for its own work beside it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from miserver.ipc.process_group import (
    TRANSPORT,
    GroupUnavailable,
    broadcast_options,
    build_group,
    byte_view,
    resolve_ranges,
)
from miserver.trainer.weights import distinct_tensors

__all__ = ["FlatWeights", "GroupUnavailable", "LayoutError", "TrainerGroup"]


class LayoutError(ValueError):
    """An attach response that is not a process-group export, or whose ``parameters[]`` do not
    fit its ``storages[]``, or a state dict that does not match it."""


def _dtype(name: Any, where: str) -> torch.dtype:
    d = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(d, torch.dtype):
        raise LayoutError(f"{where}: unknown dtype {name!r}")
    return d


class FlatWeights(Mapping[str, torch.Tensor]):
    """The trainer's copy of the served layout: one flat ``uint8`` buffer per storage, each
    parameter a view at its ``storage_offset`` (elements of its dtype) with its shape and
    stride, so one broadcast of a buffer writes every parameter of that storage.

    Attributes:
        buffers: one ``uint8`` tensor per storage entry (``storage_size_bytes`` each).
        tensors: name -> view (tied names map to the same tensor object).
        nbytes: each buffer's size in bytes.

    It is a mapping name -> view, so :func:`miserver.trainer.bind_into` (and
    :func:`miserver.trainer.build_model`) bind it into a model like rebuilt weights.
    """

    def __init__(self, buffers: list[torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
        self.buffers = buffers
        self.tensors = tensors
        self.nbytes = [b.numel() for b in buffers]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def unique_tensors(self) -> list[torch.Tensor]:
        """Each distinct view once (a tied name is listed under its first name only)."""
        return distinct_tensors(self.tensors)

    def fill_from(self, state: Mapping[str, torch.Tensor]) -> FlatWeights:
        """Copy ``state`` (name -> tensor, e.g. ``model.state_dict()`` or a safetensors file)
        into the views: the trainer starts from the values the replicas serve. Every distinct
        view needs one of its names in ``state`` with the same shape (a tied view is filled
        from whichever of its names is there: a checkpoint stores tied weights once).

        Raises:
            LayoutError: a view none of whose names is in ``state``, or another shape.
        """
        names: dict[int, list[str]] = {}
        for n, t in self.tensors.items():
            names.setdefault(id(t), []).append(n)
        plan = []
        missing, wrong = [], []
        for t in self.unique_tensors():
            found = [n for n in names[id(t)] if n in state]
            if not found:
                missing.append(names[id(t)][0])
            elif tuple(state[found[0]].shape) != tuple(t.shape):
                wrong.append(found[0])
            else:
                plan.append((t, state[found[0]]))
        if missing:
            raise LayoutError(f"not in the state dict: {', '.join(missing[:5])}")
        if wrong:
            raise LayoutError(f"shapes differ from the export: {', '.join(wrong[:5])}")
        with torch.no_grad():
            for t, src in plan:
                t.copy_(src)
        return self

    @classmethod
    def from_export(cls, body: Mapping[str, Any], device: torch.device | str = "cpu"):
        """Lay the buffers out as the attach response says (contract section 10: storages of
        ``kind: process_group``, the weights page's ``parameters[]``), on ``device``.

        Raises:
            LayoutError: a storage entry that is not ``process_group``, or a parameter that does
                not fit its storage.
        """
        device = torch.device(device)
        storages = body.get("storages")
        params = body.get("parameters")
        if not isinstance(storages, list) or not isinstance(params, list):
            raise LayoutError("the attach response has no storages[] and parameters[]")
        buffers = []
        for i, s in enumerate(storages):
            if not isinstance(s, Mapping) or s.get("kind") != TRANSPORT:
                kind = s.get("kind") if isinstance(s, Mapping) else None
                raise LayoutError(
                    f"storages[{i}] is {kind!r}, not {TRANSPORT!r}: attach with "
                    '{"transport": "process_group", ...}'
                )
            size = s.get("storage_size_bytes")
            if not isinstance(size, int) or size < 0:
                raise LayoutError(f"storages[{i}].storage_size_bytes must be an integer >= 0")
            buffers.append(torch.zeros(size, dtype=torch.uint8, device=device))
        tensors: dict[str, torch.Tensor] = {}
        by_region: dict[tuple[int, int, str, tuple, tuple], torch.Tensor] = {}
        for j, p in enumerate(params):
            where = f"parameters[{j}]"
            sidx = p.get("storage")
            if not isinstance(sidx, int) or not 0 <= sidx < len(buffers):
                raise LayoutError(f"{where}: storage {sidx!r} does not exist")
            dtype = _dtype(p.get("dtype"), where)
            shape, stride = tuple(p.get("shape") or ()), tuple(p.get("stride") or ())
            offset = p.get("storage_offset")
            if len(shape) != len(stride) or not isinstance(offset, int) or offset < 0:
                raise LayoutError(f"{where}: bad shape, stride or storage_offset")
            key = (sidx, offset, str(dtype), shape, stride)
            if key in by_region:  # a tied name: the same tensor object
                tensors[p["name"]] = by_region[key]
                continue
            itemsize = torch.empty(0, dtype=dtype).element_size()
            numel = 1
            for n in shape:
                numel *= n
            end = (
                0
                if numel == 0
                else offset + sum((a - 1) * b for a, b in zip(shape, stride, strict=True)) + 1
            )
            st = buffers[sidx].untyped_storage()
            if end * itemsize > st.nbytes():
                raise LayoutError(f"{where} ({p.get('name')}): ends past its storage")
            t = torch.empty(0, dtype=dtype, device=device).set_(st, offset, shape, stride)
            t.requires_grad_(bool(p.get("requires_grad", False)))
            tensors[p["name"]] = by_region[key] = t
        return cls(buffers, tensors)


class TrainerGroup:
    """Rank 0 of the process-group transport: hosts the rendezvous, joins the group, sends.

    Args:
        world_size: ranks in all: 1 (this trainer) + the number of replicas.
        port: the TCP port the ``TCPStore`` listens on (all interfaces); 0 picks a free one
            (:attr:`port` then says which).
        advertise_host: the host name or address the replicas reach this trainer at; it goes
            into :attr:`init_method`. On two hosts, the trainer's address on the network both
            share (``127.0.0.1`` only when every replica runs on this host).
        device: where the flat buffers live: ``cpu`` (gloo) or a CUDA device (NCCL).
        timeout_s: how long :meth:`connect` waits for every replica to join, and each
            collective's timeout.

    Raises:
        GroupUnavailable: the port is in use (from the ``TCPStore``).
    """

    def __init__(
        self,
        world_size: int,
        *,
        port: int = 0,
        advertise_host: str = "127.0.0.1",
        device: torch.device | str = "cpu",
        timeout_s: float = 60.0,
    ) -> None:
        import torch.distributed as dist

        if not isinstance(world_size, int) or world_size < 2:
            raise ValueError("world_size must be at least 2 (the trainer and one replica)")
        self.world_size = world_size
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.advertise_host = advertise_host
        try:
            self.store = dist.TCPStore(
                "0.0.0.0",
                port,
                world_size,
                True,
                _dt.timedelta(seconds=self.timeout_s),
                wait_for_workers=False,
            )
        except Exception as exc:  # noqa: BLE001 - a bind failure is a clear error
            raise GroupUnavailable(f"could not serve the rendezvous on port {port}: {exc}") from exc
        self.port: int = int(self.store.port)
        self.group: Any = None
        self._lock = threading.Lock()
        self.sends = 0
        self.bytes_sent = 0

    @property
    def init_method(self) -> str:
        """``tcp://HOST:PORT`` for the attach body (contract section 10)."""
        host = self.advertise_host
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{self.port}"

    def attach_body(self, rank: int) -> dict[str, Any]:
        """The POST /attach body for the replica of ``rank`` (1..world_size-1)."""
        if not 0 < rank < self.world_size:
            raise ValueError(f"rank must be in 1..{self.world_size - 1}")
        return {
            "transport": TRANSPORT,
            "init_method": self.init_method,
            "world_size": self.world_size,
            "rank": rank,
        }

    def layout(self, body: Mapping[str, Any]) -> FlatWeights:
        """:meth:`FlatWeights.from_export` on this group's device."""
        return FlatWeights.from_export(body, self.device)

    def connect(self) -> None:
        """Join the group as rank 0; blocks until every replica has joined (at most
        ``timeout_s``). Call after every replica's attach was accepted.

        Raises:
            GroupUnavailable: not every replica joined in time.
        """
        with self._lock:
            if self.group is not None:
                return
            self.group, _ = build_group(
                "0.0.0.0",
                self.port,
                0,
                self.world_size,
                self.device,
                timeout_s=self.timeout_s,
                store=self.store,
            )

    def send(self, weights: FlatWeights, ranges: Sequence[Sequence[int]] | None = None) -> int:
        """Broadcast the buffers (whole, or the byte ``ranges`` the commit-begins named, in the
        same order) to every replica; returns once this rank's part completed (on CUDA: once
        the buffers were sent, after a synchronize of the current stream). Returns the bytes
        sent per replica.

        Raises:
            GroupUnavailable: :meth:`connect` was not called, or the group was destroyed.
            RuntimeError: the backend's error (a replica left, a timeout).
        """
        group = self.group
        if group is None:
            raise GroupUnavailable("the group is not joined: call connect() first")
        spans = resolve_ranges(weights.nbytes, ranges)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the optimizer's writes
        opts = broadcast_options()
        works = [
            group.broadcast([byte_view(weights.buffers[i].untyped_storage(), off, n)], opts)
            for i, off, n in spans
        ]
        for w in works:
            w.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        n = sum(length for _, _, length in spans)
        self.sends += 1
        self.bytes_sent += n
        return n

    def destroy(self) -> None:
        """Leave the group and stop serving the rendezvous. Idempotent."""
        with self._lock:
            group, self.group = self.group, None
            self.store = None
        if group is not None and self.device.type == "cuda":
            with contextlib.suppress(Exception):  # best effort at teardown
                group.abort()

    def __enter__(self) -> TrainerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()
