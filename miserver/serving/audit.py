"""The ``weights_audit`` log: one JSON line per gated call, accepted or refused.

Weights page, Authentication and headers: operation, outcome, code and reason, role, label, an
8-character reference to the attachment (never the ID), the resident model's served name, the
weights state after the call (``weights_state``) and before it (``weights_state_before``), and
``elapsed_ms`` and ``steps`` for a commit-end. A token refusal (401/403) is audited too. Lines go
to the ``miserver.audit`` logger and, with ``WEIGHTS_AUDIT_LOG`` set, are appended to that file,
flushed per line (contract section 1).

A call refused before the lifecycle sees it (a body that does not decode, one over
MAX_REQUEST_BYTES, a checkpoint that does not exist, a failure of ours) is audited by the route's
wrapper (:func:`miserver.http.weights.gated_route`), which learns from :class:`AuditScope`
whether the call already wrote its line, so each call writes exactly one.

The routes use :meth:`AuditLog.write_soon`: the record is built and stamped when the call is
decided, and written on the event loop's next turn, after the response has gone out, so a
barrier call does not wait for its own audit line (lines keep the order of the calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger("miserver.audit")

#: The operation names of the weights page. ``save``/``load`` are used for the checkpoint routes'
#: accepted and non-token refusals; ``weights_save``/``weights_load`` for their token refusals.
OPERATIONS = (
    "weights_attach",
    "weights_detach",
    "weights_heartbeat",
    "weights_quiesce",
    "weights_resume",
    "weights_commit_begin",
    "weights_commit_end",
    "weights_clear_stale",
    "weights_save",
    "weights_load",
    "save",
    "load",
    "adapter",
    # MANAGEMENT_AUTH=operator (miserver.http.management_auth): the guarded management routes
    "model_register",
    "model_delete",
    "model_load",
    "model_unload",
    "settings_change",
    "file_upload",
    "file_delete",
    "batch_create",
    "batch_cancel",
    "file_read",  # refused Batch API reads only (issue 32, item 9)
    "batch_read",
)


def info_line(logger: logging.Logger, msg: str, *args: object) -> None:
    """``logger.info(msg, *args)`` without the caller lookup, and without a ``LogRecord`` when
    miserver's own handler is the only one the line reaches.

    ``Logger.info`` walks the stack for the file, line and function of the call
    (``findCaller``), a large part of a log line's cost, which the barrier calls pay twice each
    (the access line and the audit line). Those fields are ``(unknown file)``, 0 and
    ``(unknown function)`` here, as with ``logging._srcfile = None``; miserver's formats do not
    show them. Levels, filters and handlers apply as for ``info``.

    When the line would reach exactly one handler and that handler offers
    ``emit_line(name, levelno, message) -> bool`` (``miserver serve``'s
    :class:`miserver.server.LineHandler`), the handler writes the line from its parts: the
    same bytes as through the record, without building one (issue 15). Any other set-up (a
    second handler, a logger filter, a test's capture handler) takes the record path.
    """
    if not logger.isEnabledFor(logging.INFO):
        return
    handler = _sole_handler(logger)
    if handler is not None:
        emit_line = getattr(handler, "emit_line", None)
        if emit_line is not None and _emit_line(emit_line, logger.name, msg, args):
            return
    logger.handle(
        logger.makeRecord(
            logger.name,
            logging.INFO,
            "(unknown file)",
            0,
            msg,
            args,
            None,
            "(unknown function)",
        )
    )


def _sole_handler(logger: logging.Logger) -> logging.Handler | None:
    """The one handler a record of ``logger`` would be offered to (``Logger.callHandlers``'s
    walk up the hierarchy), or None when there are several, none, or the logger would filter
    or drop the record itself."""
    if logger.filters or logger.disabled:
        return None
    found: logging.Handler | None = None
    c: logging.Logger | None = logger
    while c is not None:
        for h in c.handlers:
            if found is not None:
                return None
            found = h
        if not c.propagate:
            break
        c = c.parent
    return found


def _emit_line(emit_line: Any, name: str, msg: str, args: tuple[object, ...]) -> bool:
    """``LogRecord.getMessage()`` of ``msg`` and ``args``, handed to ``emit_line``; False (take
    the record path) where the record would format it otherwise: a non-string message, one
    mapping as the arguments, or arguments that do not fit the format (the record path then
    reports that as logging does)."""
    if type(msg) is not str:
        return False
    if args:
        if len(args) == 1 and isinstance(args[0], Mapping):
            return False
        try:
            msg = msg % args
        except Exception:  # noqa: BLE001 - logging reports it on the record path
            return False
    return emit_line(name, logging.INFO, msg)


def info_stamped_object(logger: logging.Logger, line: str, ts: str) -> None:
    """:func:`info_line` of ``line``, an :class:`AuditRecord` as msgspec encodes it (``ts``
    its stamp): the sole handler's ``emit_stamped_object`` when it has one
    (:meth:`miserver.server.LineHandler.emit_stamped_object`, which writes the JSON line with
    one encoding instead of decoding the record's and encoding it again), else
    :func:`info_line`. The same bytes either way."""
    if not logger.isEnabledFor(logging.INFO):
        return
    handler = _sole_handler(logger)
    if handler is not None:
        emit = getattr(handler, "emit_stamped_object", None)
        if emit is not None and emit(logger.name, logging.INFO, line, ts):
            return
    info_line(logger, line)


_stamp_second = -1
_stamp_prefix = ""


def utc_stamp() -> str:
    """Now as RFC 3339 UTC with milliseconds (``2026-12-02T18:15:43.123Z``), what
    ``datetime.now(UTC).isoformat(timespec="milliseconds")`` gives with ``Z`` for ``+00:00``;
    the date and time of day are formatted once a second (every gated call stamps a line)."""
    global _stamp_second, _stamp_prefix
    ms = time.time_ns() // 1_000_000
    second, ms = divmod(ms, 1000)
    if second != _stamp_second:
        _stamp_prefix = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        _stamp_second = second
    return f"{_stamp_prefix}.{ms:03d}Z"


class AuditRecord(msgspec.Struct, kw_only=True):
    """One ``weights_audit`` line. ``elapsed_ms`` and ``steps`` are set for a commit-end only;
    ``transport`` names the attachment's transport (contract 10)."""

    operation: str
    outcome: str  # "accepted" | "refused"
    code: str | None
    reason: str | None
    role: str | None
    label: str | None
    attachment_ref: str | None
    model: str | None
    weights_state: str
    weights_state_before: str
    elapsed_ms: float | None = None
    steps: int | None = None
    #: The attachment's transport (``cuda_ipc``, ``cpu_shared_memory``, ``process_group``;
    #: contract 10) after the call, or None with nothing attached.
    transport: str | None = None
    ts: str = ""  # RFC 3339 UTC, like every other time miserver writes
    event: str = "weights_audit"


class AuditScope:
    """One gated call's audit state: whether a line was written for it (see :data:`CURRENT_CALL`)."""

    __slots__ = ("written",)

    def __init__(self) -> None:
        self.written = False


#: The gated call the running task serves (aiohttp runs each request in its own task, with its
#: own copy of the context). :class:`AuditLog` marks it when it writes that call's line.
CURRENT_CALL: ContextVar[AuditScope | None] = ContextVar("miserver_audit_call", default=None)


class AuditLog:
    """Writes :class:`AuditRecord` lines to the log and, optionally, to a file (thread-safe)."""

    def __init__(self, path: str | None = None) -> None:
        self._path = Path(path) if path else None
        self._lock = threading.Lock()
        self._encoder = msgspec.json.Encoder()
        self.count = 0
        #: Lines that could not be appended to the file (a full disk); each is in the log.
        self.file_failures = 0
        self._failing = False
        self._fd: int | None = None
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            # Kept open (appends, one write a line): reopening per line costs the barrier time.
            # 0600 when created (issue 32, item 13): who did what to the weights is the
            # operator's; an existing file keeps the mode its operator gave it.
            self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def write(self, record: AuditRecord) -> None:
        """Write ``record`` now. Raises ``ValueError`` for an operation not in :data:`OPERATIONS`.

        The line always goes to the ``miserver.audit`` logger. A line the file cannot take (a
        full disk) is not left half-written there (the file is cut back to its size before)
        and does not raise: one warning says so when appends start failing, one info line
        when they work again (issue 16 item 16); :attr:`file_failures` counts the lines.
        """
        self._check_and_stamp(record)
        line = self._encoder.encode(record).decode()
        with self._lock:
            self.count += 1
            info_stamped_object(log, line, record.ts)
            if self._fd is not None:
                self._append((line + "\n").encode())

    def _append(self, data: bytes) -> None:
        fd = self._fd
        assert fd is not None
        size: int | None = None
        try:
            size = os.fstat(fd).st_size
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"wrote {written} of {len(data)} bytes")
        except OSError as exc:
            if size is not None:
                with contextlib.suppress(OSError):  # no half line left for the next one
                    os.ftruncate(fd, size)
            self.file_failures += 1
            if not self._failing:
                self._failing = True
                log.warning(
                    "audit log %s cannot be written (%s); its lines go to the server log "
                    "only until it can (free space there)",
                    self._path,
                    exc.strerror or exc,
                )
            return
        if self._failing:
            self._failing = False
            log.info(
                "audit log %s is written again (%d line(s) are only in the server log)",
                self._path,
                self.file_failures,
            )

    def write_soon(self, record: AuditRecord) -> None:
        """Check and stamp ``record`` now (``ValueError`` as :meth:`write`); write it on the running
        event loop's next turn, or at once outside one."""
        self._check_and_stamp(record)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.write(record)
            return
        loop.call_soon(self.write, record)

    @staticmethod
    def _check_and_stamp(record: AuditRecord) -> None:
        if record.operation not in OPERATIONS:
            raise ValueError(f"unknown audit operation {record.operation!r}")
        if not record.ts:
            record.ts = utc_stamp()
        call = CURRENT_CALL.get()
        if call is not None:
            call.written = True

    def close(self) -> None:
        """Close the audit file (the server's shutdown)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
