"""The current attachment's transport on the server (contract section 10): which one it is, and
for the process-group transport its group and the receive of the open commit.

The weights runtime owns one :class:`AttachmentTransport`. It performs the table's effects on it
(``EXPORT_HANDLES`` -> :meth:`AttachmentTransport.export`, ``ARM_RECEIVE`` ->
:meth:`~AttachmentTransport.arm`, ``DESTROY_GROUP`` -> :meth:`~AttachmentTransport.destroy`,
``RELEASE_EXPORTS`` -> :meth:`~AttachmentTransport.ended`) and asks it, before deciding a
commit-end, whether the commit's bytes arrived (:meth:`~AttachmentTransport.wait_received`).
No rule of the lifecycle is here: what a failed receive means is the table's
(``receive_incomplete``), when the group ends is the table's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from miserver.ipc.process_group import (
    TRANSPORT,
    ArenaGroup,
    GroupSpec,
    GroupSpecError,
    RangeError,
    Receive,
    resolve_ranges,
)
from miserver.spec import codes
from miserver.spec.errors import ApiError

log = logging.getLogger("miserver.weights")

#: How long past the commit watchdog a commit-end still waits for its receive (seconds): the
#: receive's own timeout is the watchdog, so it has failed or completed by then.
RECEIVE_GRACE_S = 0.5


def group_spec(body: Any) -> GroupSpec | None:
    """The process-group rendezvous a POST /attach body asks for (contract 10), or None for
    the weights page's attach (no body, ``{}``, ``{"transport": "cuda_ipc"}``).

    Raises:
        ApiError: 400 INVALID_REQUEST: a ``process_group`` body whose ``init_method``,
            ``world_size`` or ``rank`` is missing or unusable, or a ``cuda_ipc`` body that
            carries them.
    """
    transport = getattr(body, "transport", "cuda_ipc")
    fields = {k: getattr(body, k, None) for k in ("init_method", "world_size", "rank")}
    if transport != TRANSPORT:
        given = [k for k, v in fields.items() if v is not None]
        if given:
            raise ApiError(
                codes.INVALID_REQUEST,
                f"{', '.join(given)} apply to the process_group transport only "
                '(send "transport": "process_group")',
                param=given[0],
            )
        return None
    missing = [k for k, v in fields.items() if v is None]
    if missing:
        raise ApiError(
            codes.INVALID_REQUEST,
            f"the process_group transport needs {', '.join(missing)} (contract 10: "
            '{"transport": "process_group", "init_method": "tcp://HOST:PORT", '
            '"world_size": W, "rank": R})',
            param=missing[0],
        )
    try:
        return GroupSpec.parse(fields["init_method"], fields["world_size"], fields["rank"])
    except GroupSpecError as exc:
        raise ApiError(codes.INVALID_REQUEST, str(exc)) from None


class AttachmentTransport:
    """The current attachment's transport and, for ``process_group``, its group.

    Args:
        join_timeout_s: how long the group may take to form after the attach (the trainer
            joins last, once every replica attached): WEIGHTS_HEARTBEAT_TIMEOUT_S.
        op_timeout_s: each collective's timeout: WEIGHTS_COMMIT_WATCHDOG_MS, in seconds.
        metrics: the app's metrics object, or None.

    Attributes:
        name: ``cuda_ipc``, ``cpu_shared_memory`` or ``process_group`` while attached, else
            None.
        group: the attachment's :class:`~miserver.ipc.process_group.ArenaGroup` (kept, as
            ``destroyed``, after a tear until the attachment ends), or None.
        receive: the open commit's receive, or None.
        requested: the rendezvous the attach being decided asked for (set just before it is
            decided).
        next_ranges: the byte ranges the commit-begin being decided names, or None.
        received_bytes: bytes received through this attachment's group.
    """

    def __init__(self, *, join_timeout_s: float, op_timeout_s: float, metrics: Any = None):
        self.join_timeout_s = join_timeout_s
        self.op_timeout_s = op_timeout_s
        self.metrics = metrics
        self.name: str | None = None
        self.group: ArenaGroup | None = None
        self.receive: Receive | None = None
        self.requested: GroupSpec | None = None
        self.next_ranges: list[list[int]] | None = None
        self.received_bytes = 0
        self._counted: Receive | None = None

    # --- effects ---------------------------------------------------------------------------
    def export(self, arena: Any, model: Any) -> Any:
        """``EXPORT_HANDLES``: the attach body of the requested transport. For a process
        group the group starts forming now (on its own thread) and the body names no handle."""
        from miserver.ipc.export import export_handles, export_process_group

        spec, self.requested = self.requested, None
        self._drop_group()
        if spec is None:
            body = export_handles(arena, model)
            self.name = arena.storage_kinds[0] if arena.storages else "cuda_ipc"
        else:
            body = export_process_group(arena, model)
            self.group = ArenaGroup(
                spec,
                arena.storages,
                connect_timeout_s=self.join_timeout_s,
                op_timeout_s=self.op_timeout_s,
            ).start()
            self.name = TRANSPORT
        self._set_metric()
        return body

    def arm(self) -> None:
        """``ARM_RECEIVE``: post the open commit's receive (a no-op without a group)."""
        ranges, self.next_ranges = self.next_ranges, None
        if self.group is None:
            self.receive = None
            return
        self.receive = self.group.arm(ranges)

    def destroy(self) -> None:
        """``DESTROY_GROUP``: tear the attachment's group down (a no-op without one)."""
        if self.group is not None and self.group.state != "destroyed":
            log.info("weights: the attachment's process group is destroyed")
            self.group.destroy()

    def ended(self) -> None:
        """``RELEASE_EXPORTS``: the attachment is gone; so is its transport."""
        self._drop_group()
        self.name = None
        self._set_metric()

    def _drop_group(self) -> None:
        if self.group is not None:
            self.group.destroy()
        self.group = None
        self.receive = None
        self.received_bytes = 0

    # --- the facts of commit-begin and commit-end -------------------------------------------
    def group_usable(self) -> bool:
        """``commit_begin``'s ``group_ok``: no group (another transport), or one that is
        joining or joined; False once it failed to form or was destroyed."""
        return self.group is None or self.group.state in ("connecting", "ready")

    def check_ranges(self, ranges: list[list[int]] | None) -> None:
        """Validate a commit-begin's ``ranges`` before the lifecycle decides it.

        Raises:
            ApiError: 400 INVALID_REQUEST: ranges without a process-group attachment, or ranges
                that do not fit the arena (:func:`~miserver.ipc.process_group.resolve_ranges`).
        """
        self.next_ranges = None
        if ranges is None:
            return
        if self.group is None:
            raise ApiError(
                codes.INVALID_REQUEST,
                "ranges apply to a process_group attachment only (contract 10)",
                param="ranges",
            )
        try:
            resolve_ranges(self.group.nbytes, ranges)
        except RangeError as exc:
            raise ApiError(codes.INVALID_REQUEST, str(exc), param="ranges") from None
        self.next_ranges = ranges

    async def wait_received(self, deadline: float | None, now: float) -> bool:
        """Whether the open commit's bytes all arrived: waits (off the event loop) until the
        receive completed or failed, at most until ``deadline`` (the watchdog's, in the
        runtime's clock ``now`` is read from) plus :data:`RECEIVE_GRACE_S`. True when there is
        no receive (another transport, or no commit of this attachment)."""
        receive = self.receive
        if receive is None:
            return True
        if receive.pending:
            budget = RECEIVE_GRACE_S + (max(0.0, deadline - now) if deadline is not None else 0)
            await asyncio.to_thread(receive.wait, budget)
        ok = receive.ok
        if not receive.pending and self._counted is not receive:  # each receive counted once
            self._counted = receive
            metrics = self.metrics
            if metrics is not None and hasattr(metrics, "process_group_receive"):
                metrics.process_group_receive(ok, receive.nbytes if ok else 0)
            if ok:
                self.received_bytes += receive.nbytes
        if not ok:
            log.error(
                "weights: the commit's receive did not complete (%s); commit-end is refused "
                "and the watchdog tears the set",
                receive.error or "still in flight",
            )
        return ok

    def commit_ended(self) -> None:
        """The commit-end was decided: its receive is spent."""
        self.receive = None

    # --- views -----------------------------------------------------------------------------
    def describe(self) -> dict[str, Any] | None:
        """The status block of the process group, or None for the other transports."""
        if self.group is None:
            return None
        d = self.group.describe()
        return {
            "backend": d["backend"],
            "init_method": d["init_method"],
            "world_size": d["world_size"],
            "rank": d["rank"],
            "group_state": d["group_state"],
            "error": d["error"],
            "receives": self.group.receives,
            "received_bytes": self.received_bytes,
        }

    def _set_metric(self) -> None:
        if self.metrics is not None and hasattr(self.metrics, "set_transport"):
            self.metrics.set_transport(self.name)
