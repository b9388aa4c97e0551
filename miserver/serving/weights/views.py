"""The read-only views of the weights lifecycle: ``GET /api/weights/status`` and the weights block
of ``/api/health/detailed`` (weights page: Status).

:class:`StatusViews` is the collaborator of
:class:`~miserver.serving.weights.runtime.WeightsRuntime` that renders the core's status view
with wall-clock stamps, the scheduler's counts and the resident's memory. It changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class StatusViews:
    """The status views of one runtime (read-only).

    Args:
        lifecycle: the :class:`~miserver.fsm.machine.Lifecycle` whose status view is rendered.
        host: :class:`miserver.serving.models.host.ModelHost` (the resident).
        scheduler: :class:`miserver.serving.engine.slot.Scheduler` (the held count).
        transport: the attachment's :class:`~miserver.serving.weights.transport.AttachmentTransport`.
        now: the runtime's monotonic clock (seconds).
        stamp: a core time as an RFC 3339 string.
    """

    def __init__(
        self,
        *,
        lifecycle: Any,
        host: Any,
        scheduler: Any,
        transport: Any,
        now: Callable[[], float],
        stamp: Callable[[float | None], str | None],
    ) -> None:
        self.lifecycle = lifecycle
        self.host = host
        self.scheduler = scheduler
        self.transport = transport
        self.now = now
        self.stamp = stamp

    def status(self, last_save: dict[str, Any] | None = None) -> dict[str, Any]:
        """GET /api/weights/status (weights page: Status). No token, no slot, no secret.

        ``last_save``: the last save's block (the runtime keeps it; the save job writes it)."""
        from miserver.ipc.export import cuda_memory, exports_since_start

        view = self.lifecycle.status_view(self.now())
        resident = self.host.resident
        att = view["attachment"]
        if att is not None:
            att = {
                **att,
                "attached_at": self.stamp(att["attached_at"]),
                "last_heartbeat_at": self.stamp(att["last_heartbeat_at"]),
                "stale_since": self.stamp(att["stale_since"]),
                "transport": self.transport.name,
                "process_group": self.transport.describe(),
            }
        commit = view["commit"]
        if commit is not None:
            commit = {
                **commit,
                "began_at": self.stamp(commit["began_at"]),
                "open_ms": round(commit["open_ms"] or 0.0, 3),
            }
        overrun = view["last_overrun"]
        if overrun is not None:
            overrun = {"at": self.stamp(overrun["at"]), "commit_ms": round(overrun["commit_ms"], 3)}
        counts = self.scheduler.counts()
        return {
            "attached": view["attached"],
            "attachment": att,
            "barrier": view["barrier"],
            "quiesced_at": self.stamp(view["quiesced_at"]),
            "held_requests": None if view["barrier"] == "serving" else counts.held_interactive,
            "parked_sequences": None if view["barrier"] == "serving" else self.parked_sequences(),
            "weights_state": view["weights_state"],
            "resident_model": self.model_ref(),
            "steps_since_load": view["steps_since_load"] if resident is not None else None,
            "last_save": last_save,
            "commit": commit,
            "commit_overran": self.stamp(view["commit_overran"]),
            "last_hold_timeout_at": self.stamp(view["last_hold_timeout_at"]),
            "last_overrun": overrun,
            "pause_unavailable": view["pause_unavailable"],
            "adapter": self.adapter_block(),
            "cuda_memory": _with_decode_memory(cuda_memory(), resident),
            "exports_since_start": exports_since_start(),
        }

    def parked_sequences(self) -> int:
        """How many sequences a ``{"running": "hold"}`` quiesce parked (contract 4b)."""
        from miserver.serving.engine.parking import parking_of

        parking = parking_of(self.host)
        return parking.parked_sequences() if parking is not None else 0

    def model_ref(self) -> dict[str, Any] | None:
        """``{model_id, name, manifest_hash}`` of the row whose weights are resident: the
        base tensors' row, also while an adapter is applied; after a checkpoint load (in place
        or a reload), that checkpoint's row, its name and manifest hash (issue 32, item 1)."""
        resident = self.host.resident
        if resident is None:
            return None
        row = resident.row
        return {
            "model_id": row.id,
            "name": row.name,
            "manifest_hash": getattr(row, "checkpoint_sha256", None),
        }

    def adapter_block(self) -> dict[str, Any] | None:
        resident = self.host.resident
        block = resident.adapter_block if resident is not None else None
        return block if block is not None else {"applied": False}

    def summary(self) -> dict[str, Any]:
        """The short weights block of /api/health/detailed (weights page: Status)."""
        view = self.lifecycle.status_view(self.now())
        att = view["attachment"]
        return {
            "weights_state": view["weights_state"],
            "barrier": view["barrier"],
            "attached": view["attached"],
            "attachment_state": att["state"] if att is not None else None,
        }


def _with_decode_memory(
    cards: list[dict[str, Any]] | None, resident: Any
) -> list[dict[str, Any]] | None:
    """``cuda_memory`` with the resident's continuous engine on its card: its paged KV cache
    (``kv_cache_mb``, issue 29) and what its decode graphs' captures allocated
    (``decode_graphs_mb``), MiB with 3 decimals (issue 13: memory is visible)."""
    loop = getattr(resident, "engine_loop", None) if resident is not None else None
    if cards is not None and loop is not None and not loop.closed:
        device = getattr(loop.engine, "device", None)
        if device is not None and device.type == "cuda":
            stats = loop.stats()
            graphs = stats.get("decode_graphs") or {}
            for card in cards:
                if card["device_index"] == (device.index or 0):
                    card["kv_cache_mb"] = round(stats.get("cache_bytes", 0) / 2**20, 3)
                    card["decode_graphs_mb"] = round(graphs.get("bytes", 0) / 2**20, 3)
    return cards
