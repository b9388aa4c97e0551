"""The contract's error: a code of :mod:`miserver.spec.codes` with its status, reason, details,
message and the headers its answer carries, raised anywhere below a handler.

This module imports nothing above :mod:`miserver.spec` (docs/architecture.md, Layers): the
serving layer and the lifecycle raise :class:`ApiError`; :mod:`miserver.http.errors` renders it as
the management envelope or an OpenAI error (contract section 2). Also here: a full disk, read from
any exception (:func:`is_disk_full`), and its 507 (:func:`disk_full_error`).
"""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import Mapping
from typing import Any

from miserver.spec import codes
from miserver.spec.codes import ErrorCode


class ApiError(Exception):
    """Raise anywhere under a handler to answer with ``code`` (status from the code unless given).

    ``details`` must never hold a token or an attachment ID.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        reason: str | None = None,
        details: Mapping[str, Any] | None = None,
        status: int | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.details = dict(details) if details is not None else None
        self.status = status or code.status
        self.param = param
        self.headers = dict(headers or {})


_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: How a full disk reads in errors that carry no errno (SQLite's SQLITE_FULL, safetensors' Rust
#: io::Error inside a SafetensorError), lower case.
_FULL_WORDS = (
    "database or disk is full",
    "no space left on device",
    "disk quota exceeded",
    "storagefull",
    "os error 28",
)


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says the disk or a quota is full:
    ``OSError`` ENOSPC / EDQUOT / EFBIG, SQLite's SQLITE_FULL ("database or disk is full"), or
    a library error whose message says so."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return True
        if isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", None) == 13:
            return True  # SQLITE_FULL
        text = str(exc).lower()
        if any(word in text for word in _FULL_WORDS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full_error(what: str, where: str | None = None) -> ApiError:
    """507 INSUFFICIENT_STORAGE (reason ``disk_full``): ``what`` (a sentence subject: "the
    save", "the upload") could not be written because the disk is full; ``where`` names the
    folder (``MISERVER_HOME``). Nothing was kept of it (issue 16 item 16)."""
    place = f" ({where})" if where else ""
    return ApiError(
        codes.INSUFFICIENT_STORAGE,
        f"{what} could not be written: the disk{place} is full (no space left on device). "
        "Nothing of it was kept. Free space there (old checkpoints: DELETE /api/models/{id};"
        " batch files: DELETE /v1/files/{id}) or give the server a larger volume, then retry.",
        reason="disk_full",
        details={"path": where} if where else None,
    )
