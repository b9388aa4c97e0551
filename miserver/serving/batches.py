"""The Batch API's store and runner: OpenAI-compatible files and batches, run exactly once.

Contract section 7 and the weights page (States; Which weights answered; The write cycle 2).

Persistence. Everything lives in ``MISERVER_HOME``: the database ``batches.sqlite3`` (files,
batches and one row per request line, with its result) and the file blobs under ``files/``.
A row's result is written in the **same SQLite transaction** that marks the row done and counts
it, so after a restart (even ``kill -9``) a batch continues where it stopped: a finished row is
never lost and never run again; a row that was running at the crash had no recorded result and
runs again. Output and error files are built from the stored results when the batch ends.

The runner depends on the serving runtime through one narrow seam, :class:`RowExecutor`:
``waiting_reason(model)`` (why a row for ``model`` cannot run now) and
``execute_row(method, url, body)`` (run one request line as ``/v1`` would, at batch priority).
A batch never loads a model: rows for a model that is not resident wait (``model_not_resident``);
while the weights are torn the batch waits (``weights_torn``); while the barrier is held the next
chunk is held in the scheduler (``quiesced``). None of these fails a row. Only the completion
window (``24h``) ends a waiting batch, as ``expired``.

Thread-safety: :class:`BatchStore` serialises every call under one lock over one connection, so
it may be called from the event loop and from worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import msgspec

from miserver.spec import codes
from miserver.spec.codes import ErrorCode

log = logging.getLogger("miserver.batches")

DB_NAME = "batches.sqlite3"
LOCK_NAME = "batches.runner.lock"
FILES_DIR = "files"

#: The endpoints a batch may target (contract 7: the two /v1 generation routes).
ENDPOINTS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions")
#: The only completion window OpenAI defines.
COMPLETION_WINDOWS: dict[str, int] = {"24h": 24 * 3600}
#: OpenAI's limit on requests per batch file.
MAX_ROWS = 50_000
MAX_CUSTOM_ID_CHARS = 512
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
#: How many line errors one 400 lists before it says "and N more".
MAX_REPORTED_ERRORS = 5

#: ``waiting_reason`` values of the batch object (contract 7).
WAITING_REASONS: tuple[str, ...] = ("quiesced", "weights_torn", "model_not_resident")
#: Reasons that stop the runner from taking a row: the row waits, it never fails.
BLOCKING_REASONS = frozenset({"weights_torn", "model_not_resident"})

BATCH_STATUSES = (
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
)
#: Statuses the runner still has work for.
ACTIVE_STATUSES = ("in_progress", "finalizing", "cancelling")
FILE_PURPOSES_IN = ("batch",)

_ROW_KEYS = frozenset({"custom_id", "method", "url", "body"})
_CREATE_KEYS = frozenset(
    {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"}
)

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.decode


class BatchRequestError(Exception):
    """A request to the store was refused; nothing was changed.

    ``code`` is one of :mod:`miserver.spec.codes` (the HTTP layer renders it in OpenAI's shape),
    ``param`` the request field at fault, when there is one.
    """

    def __init__(self, code: ErrorCode, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class RowDeferred(Exception):  # noqa: N818 - it is a signal, not a failure
    """Raised by :meth:`RowExecutor.execute_row` when the row could not run and must wait.

    ``reason`` is one of :data:`WAITING_REASONS`. The row keeps no result and runs later.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RowExecutor(Protocol):
    """The seam between the batch runner and the serving runtime."""

    def waiting_reason(self, model: str) -> str | None:
        """Why a row whose body names ``model`` cannot run now, or None when it can.

        ``"weights_torn"`` and ``"model_not_resident"`` make the runner wait without calling
        :meth:`execute_row`; ``"quiesced"`` is reported while the row's chunk is held in the
        scheduler (the runner still calls :meth:`execute_row`, which waits for the slot).
        """
        ...

    async def execute_row(
        self, method: str, url: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, str], dict[str, Any]]:
        """Run one request line as ``/v1`` would, at batch priority, never loading a model.

        Returns ``(status_code, headers, json_body)``: the body of a 2xx is the completion, any
        other an OpenAI error body. ``headers`` carries ``X-miLLM-Model`` for a served request.
        Raises :class:`RowDeferred` when the row must wait instead (torn, model not resident).
        """
        ...


@dataclass(frozen=True)
class InputRow:
    """One validated line of a batch input file (``line`` is 1-based)."""

    line: int
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]

    @property
    def model(self) -> str:
        return self.body["model"]


@dataclass(frozen=True)
class PendingRow:
    """A row the runner has still to run."""

    batch_id: str
    idx: int
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]
    model: str


# --------------------------------------------------------------------------------------------
# Validation of the input file (contract 7)
# --------------------------------------------------------------------------------------------


def _line_error(row: dict[str, Any] | Any) -> str | None:
    if not isinstance(row, dict):
        return "must be a JSON object"
    missing = sorted(_ROW_KEYS - row.keys())
    if missing:
        return "missing " + ", ".join(missing)
    unknown = sorted(row.keys() - _ROW_KEYS)
    if unknown:
        return "unknown field " + ", ".join(unknown)
    cid = row["custom_id"]
    if not isinstance(cid, str) or not cid:
        return "custom_id must be a non-empty string"
    if len(cid) > MAX_CUSTOM_ID_CHARS:
        return f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters"
    if row["method"] != "POST":
        return f'method must be "POST", got {_short(row["method"])}'
    if row["url"] not in ENDPOINTS:
        return f"url must be one of {', '.join(ENDPOINTS)}, got {_short(row['url'])}"
    body = row["body"]
    if not isinstance(body, dict):
        return "body must be a JSON object"
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return "body.model must be a non-empty string"
    if body.get("stream") not in (None, False):
        return "body.stream must be false or absent: batch rows are not streamed"
    return None


def _short(value: Any) -> str:
    text = _json_encode(value).decode("utf-8", "replace")
    return text if len(text) <= 60 else text[:57] + "..."


def parse_batch_input(data: bytes) -> list[InputRow]:
    """Validate a batch input file (JSONL) line by line and return its rows in order.

    Each non-blank line must be ``{"custom_id": str, "method": "POST", "url":
    "/v1/chat/completions" | "/v1/completions", "body": {"model": str, ...}}``, custom_ids unique,
    at most :data:`MAX_ROWS` rows. The body's other fields are checked when the row runs (as
    ``/v1`` checks them; a refusal is that row's error line).

    Raises :class:`BatchRequestError` (``INVALID_REQUEST``, param ``file``) naming the first
    :data:`MAX_REPORTED_ERRORS` bad lines by number.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchRequestError(
            codes.INVALID_REQUEST, f"the file is not UTF-8 (byte {exc.start})", param="file"
        ) from None
    rows: list[InputRow] = []
    errors: list[str] = []
    n_errors = 0
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        problem: str | None
        try:
            obj = _json_decode(raw)
        except msgspec.DecodeError as exc:
            problem = f"is not valid JSON ({exc})"
        except RecursionError:
            problem = "nests arrays or objects too deeply to decode"
        else:
            problem = _line_error(obj)
            if problem is None:
                first = seen.get(obj["custom_id"])
                if first is not None:
                    problem = f"custom_id {_short(obj['custom_id'])} repeats line {first}"
                else:
                    seen[obj["custom_id"]] = number
                    rows.append(
                        InputRow(number, obj["custom_id"], obj["method"], obj["url"], obj["body"])
                    )
        if problem is not None:
            n_errors += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(f"line {number}: {problem}")
    if n_errors:
        more = f" (and {n_errors - len(errors)} more)" if n_errors > len(errors) else ""
        raise BatchRequestError(
            codes.INVALID_REQUEST,
            "invalid batch input file: " + "; ".join(errors) + more,
            param="file",
        )
    if not rows:
        raise BatchRequestError(
            codes.INVALID_REQUEST, "the batch input file has no requests", param="file"
        )
    if len(rows) > MAX_ROWS:
        raise BatchRequestError(
            codes.INVALID_REQUEST,
            f"the batch input file has {len(rows)} requests; at most {MAX_ROWS} are allowed",
            param="file",
        )
    return rows


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise BatchRequestError(
            codes.INVALID_REQUEST, "metadata must be an object of strings", param="metadata"
        )
    if len(metadata) > MAX_METADATA_PAIRS:
        raise BatchRequestError(
            codes.INVALID_REQUEST,
            f"metadata has {len(metadata)} keys; at most {MAX_METADATA_PAIRS}",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise BatchRequestError(
                codes.INVALID_REQUEST,
                f"metadata key longer than {MAX_METADATA_KEY_CHARS} characters",
                param="metadata",
            )
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise BatchRequestError(
                codes.INVALID_REQUEST,
                f"metadata[{_short(key)}] must be a "
                f"string of at most {MAX_METADATA_VALUE_CHARS} characters",
                param="metadata",
            )
    return dict(metadata)


# --------------------------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    model TEXT,
    metadata TEXT,
    errors TEXT,
    output_file_id TEXT,
    error_file_id TEXT,
    created_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    expires_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS batch_rows (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    method TEXT NOT NULL,
    url TEXT NOT NULL,
    model TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    ok INTEGER,
    result TEXT,
    finished_at INTEGER,
    PRIMARY KEY (batch_id, idx)
);
CREATE INDEX IF NOT EXISTS batch_rows_pending ON batch_rows (batch_id, state, model, idx);
"""

_TIMESTAMPS = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class BatchStore:
    """Files and batches in ``home/batches.sqlite3`` plus blobs in ``home/files/`` (contract 7).

    Objects are returned as dicts in OpenAI's wire shape (``File``, ``Batch``). Every method
    raises :class:`BatchRequestError` for a refused request and changes nothing then.
    ``clock`` returns Unix seconds (tests pass their own).
    """

    def __init__(
        self, home: str | os.PathLike[str], *, clock: Callable[[], float] = time.time
    ) -> None:
        self.home = Path(home)
        self.files_dir = self.home / FILES_DIR
        self.clock = clock
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None

    # -- plumbing ------------------------------------------------------------------------------

    @property
    def _db(self) -> sqlite3.Connection:
        """The connection, opened (and the schema created) on first use, so a home whose Batch
        API was never used gets no database."""
        with self._lock:
            if self._conn is None:
                self.files_dir.mkdir(parents=True, exist_ok=True)
                conn = sqlite3.connect(
                    self.home / DB_NAME, check_same_thread=False, isolation_level=None
                )
                conn.row_factory = sqlite3.Row
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
                conn.execute("PRAGMA busy_timeout=5000")
                conn.executescript(_SCHEMA)
                self._conn = conn
                self._remove_orphan_blobs()
            return self._conn

    def exists(self) -> bool:
        """Whether the database exists (the Batch API was used in this home)."""
        return self._conn is not None or (self.home / DB_NAME).exists()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                # Also a failed COMMIT (SQLITE_FULL leaves the transaction open): roll back, or
                # every later BEGIN fails on this connection.
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def _now(self) -> int:
        return int(self.clock())

    def _blob(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def _write_blob(self, file_id: str, data: bytes) -> Path:
        self._db  # noqa: B018 - open first: opening removes blobs that have no row yet
        path = self._blob(file_id)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:  # a full disk: no partial blob left behind
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(self.files_dir)
        return path

    def _remove_orphan_blobs(self) -> None:
        """Blobs written by a write that crashed before its row was committed."""
        with self._lock:
            known = {r[0] for r in self._db.execute("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.suffix == ".tmp" or (path.suffix == ".jsonl" and path.stem not in known):
                with contextlib.suppress(OSError):
                    path.unlink()

    # -- files ---------------------------------------------------------------------------------

    def create_file(self, data: bytes, *, filename: str, purpose: str) -> dict[str, Any]:
        """Store an uploaded batch input file (``POST /v1/files``); returns the File object.

        ``purpose`` must be ``batch`` and ``data`` a valid batch input (:func:`parse_batch_input`).
        Raises :class:`BatchRequestError` (400) otherwise; nothing is stored then.
        """
        if purpose not in FILE_PURPOSES_IN:
            raise BatchRequestError(
                codes.INVALID_REQUEST,
                f'purpose must be "batch", got {_short(purpose)}',
                param="purpose",
            )
        parse_batch_input(data)
        return self._add_file(data, filename=filename or "batch.jsonl", purpose=purpose)

    def _add_file(self, data: bytes, *, filename: str, purpose: str) -> dict[str, Any]:
        file_id = _new_id("file-")
        path = self._write_blob(file_id, data)
        now = self._now()
        try:
            with self._tx() as db:
                db.execute(
                    "INSERT INTO files (id, filename, purpose, bytes, created_at) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (file_id, filename, purpose, len(data), now),
                )
        except BaseException:  # no row (a full database): no blob either
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        return self.get_file(file_id)

    @staticmethod
    def _file_obj(row: sqlite3.Row) -> dict[str, Any]:
        return {
            "id": row["id"],
            "object": "file",
            "bytes": row["bytes"],
            "created_at": row["created_at"],
            "expires_at": None,
            "filename": row["filename"],
            "purpose": row["purpose"],
            "status": "processed",
            "status_details": None,
        }

    def _file_row(self, file_id: str) -> sqlite3.Row:
        with self._lock:
            row = self._db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise BatchRequestError(
                codes.NOT_FOUND, f"no file with id {_short(file_id)}", param="file_id"
            )
        return row

    def get_file(self, file_id: str) -> dict[str, Any]:
        """The File object of ``file_id``. Raises :class:`BatchRequestError` (404)."""
        return self._file_obj(self._file_row(file_id))

    def file_content(self, file_id: str) -> bytes:
        """The bytes of ``file_id`` (JSONL). Raises :class:`BatchRequestError` (404)."""
        self._file_row(file_id)
        try:
            return self._blob(file_id).read_bytes()
        except FileNotFoundError:
            raise BatchRequestError(
                codes.NOT_FOUND,
                f"the content of {file_id} is missing from {self.files_dir}",
                param="file_id",
            ) from None

    def list_files(
        self,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 10000,
        order: str = "desc",
    ) -> dict[str, Any]:
        """``GET /v1/files``: ``{object: "list", data, first_id, last_id, has_more}``."""
        return self._page(
            "files",
            self._file_obj,
            after=after,
            limit=limit,
            order=order,
            where=("purpose = ?", (purpose,)) if purpose else None,
        )

    def delete_file(self, file_id: str) -> dict[str, Any]:
        """``DELETE /v1/files/{id}``. A batch keeps running: its rows were copied at creation."""
        self._file_row(file_id)
        with self._tx() as db:
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        with contextlib.suppress(FileNotFoundError):
            self._blob(file_id).unlink()
        return {"id": file_id, "object": "file", "deleted": True}

    def _page(
        self,
        table: str,
        render: Callable[[sqlite3.Row], dict[str, Any]],
        *,
        after: str | None,
        limit: int,
        order: str = "desc",
        where: tuple[str, tuple[Any, ...]] | None = None,
    ) -> dict[str, Any]:
        if order not in ("asc", "desc"):
            raise BatchRequestError(
                codes.INVALID_REQUEST, "order must be asc or desc", param="order"
            )
        clauses, args = [], []
        if where:
            clauses.append(where[0])
            args.extend(where[1])
        with self._lock:
            if after is not None:
                cur = self._db.execute(f"SELECT seq FROM {table} WHERE id = ?", (after,)).fetchone()
                if cur is None:
                    raise BatchRequestError(
                        codes.INVALID_REQUEST,
                        f"after: no object with id {_short(after)}",
                        param="after",
                    )
                clauses.append("seq < ?" if order == "desc" else "seq > ?")
                args.append(cur[0])
            sql = f"SELECT * FROM {table}"
            if clauses:
                sql += " WHERE " + " AND ".join(clauses)
            sql += f" ORDER BY seq {order.upper()} LIMIT ?"
            rows = self._db.execute(sql, (*args, limit + 1)).fetchall()
            data = [render(r) for r in rows[:limit]]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(rows) > limit,
        }

    # -- batches -------------------------------------------------------------------------------

    def create_batch(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """``POST /v1/batches``: create a batch from ``{input_file_id, endpoint,
        completion_window, metadata?}`` and return the Batch object (status ``in_progress``).

        Every line's url must equal ``endpoint``. The rows are copied into the database in the
        same transaction that creates the batch. Raises :class:`BatchRequestError` (400, or 404
        for an unknown file) and changes nothing then.
        """
        if not isinstance(request, Mapping):
            raise BatchRequestError(codes.INVALID_REQUEST, "the body must be a JSON object")
        unknown = sorted(set(request) - _CREATE_KEYS)
        if unknown:
            raise BatchRequestError(
                codes.INVALID_REQUEST, f"unknown field {unknown[0]}", param=unknown[0]
            )
        for key in ("input_file_id", "endpoint", "completion_window"):
            if key not in request:
                raise BatchRequestError(codes.INVALID_REQUEST, f"{key} is required", param=key)
            if not isinstance(request[key], str):
                raise BatchRequestError(codes.INVALID_REQUEST, f"{key} must be a string", param=key)
        endpoint = request["endpoint"]
        if endpoint not in ENDPOINTS:
            raise BatchRequestError(
                codes.INVALID_REQUEST,
                f"endpoint must be one of {', '.join(ENDPOINTS)}, got {_short(endpoint)}",
                param="endpoint",
            )
        window = request["completion_window"]
        if window not in COMPLETION_WINDOWS:
            raise BatchRequestError(
                codes.INVALID_REQUEST,
                f'completion_window must be "24h", got {_short(window)}',
                param="completion_window",
            )
        metadata = _check_metadata(request.get("metadata"))
        file_id = request["input_file_id"]
        try:
            file_row = self._file_row(file_id)
        except BatchRequestError as exc:
            exc.param = "input_file_id"
            raise
        if file_row["purpose"] != "batch":
            raise BatchRequestError(
                codes.INVALID_REQUEST,
                f"file {file_id} has purpose {file_row['purpose']}, not batch",
                param="input_file_id",
            )
        rows = parse_batch_input(self.file_content(file_id))
        wrong = [r for r in rows if r.url != endpoint]
        if wrong:
            raise BatchRequestError(
                codes.INVALID_REQUEST,
                f"line {wrong[0].line}: url {wrong[0].url} does not match the "
                f"batch endpoint {endpoint} ({len(wrong)} lines differ)",
                param="endpoint",
            )
        models = {r.model for r in rows}
        batch_id = _new_id("batch_")
        now = self._now()
        with self._tx() as db:
            db.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, "
                "model, metadata, created_at, in_progress_at, expires_at, total) "
                "VALUES (?, ?, ?, ?, 'in_progress', ?, ?, ?, ?, ?, ?)",
                (
                    batch_id,
                    endpoint,
                    file_id,
                    window,
                    models.pop() if len(models) == 1 else None,
                    None if metadata is None else _json_encode(metadata).decode(),
                    now,
                    now,
                    now + COMPLETION_WINDOWS[window],
                    len(rows),
                ),
            )
            db.executemany(
                "INSERT INTO batch_rows (batch_id, idx, custom_id, method, url, model, body) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    (
                        batch_id,
                        i,
                        r.custom_id,
                        r.method,
                        r.url,
                        r.model,
                        _json_encode(r.body).decode(),
                    )
                    for i, r in enumerate(rows)
                ),
            )
        return self.get_batch(batch_id)

    @staticmethod
    def _batch_obj(row: sqlite3.Row, waiting_reason: str | None = None) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": row["id"],
            "object": "batch",
            "endpoint": row["endpoint"],
            "model": row["model"],
            "errors": None if row["errors"] is None else _json_decode(row["errors"]),
            "input_file_id": row["input_file_id"],
            "completion_window": row["completion_window"],
            "status": row["status"],
            "output_file_id": row["output_file_id"],
            "error_file_id": row["error_file_id"],
        }
        for key in _TIMESTAMPS:
            obj[key] = row[key]
        obj["request_counts"] = {
            "total": row["total"],
            "completed": row["completed"],
            "failed": row["failed"],
        }
        obj["usage"] = {
            "input_tokens": row["input_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": row["output_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": row["input_tokens"] + row["output_tokens"],
        }
        obj["metadata"] = None if row["metadata"] is None else _json_decode(row["metadata"])
        obj["waiting_reason"] = waiting_reason if row["status"] == "in_progress" else None
        return obj

    def _batch_row(self, batch_id: str) -> sqlite3.Row:
        with self._lock:
            row = self._db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise BatchRequestError(
                codes.NOT_FOUND, f"no batch with id {_short(batch_id)}", param="batch_id"
            )
        return row

    def get_batch(self, batch_id: str, waiting_reason: str | None = None) -> dict[str, Any]:
        """The Batch object (OpenAI's shape plus ``waiting_reason``). Raises 404."""
        return self._batch_obj(self._batch_row(batch_id), waiting_reason)

    def list_batches(
        self,
        *,
        after: str | None = None,
        limit: int = 20,
        waiting: Callable[[str], str | None] | None = None,
    ) -> dict[str, Any]:
        """``GET /v1/batches``: newest first, ``after`` a batch id, ``limit`` 1..100."""
        if not 1 <= limit <= 100:
            raise BatchRequestError(
                codes.INVALID_REQUEST, "limit must be between 1 and 100", param="limit"
            )
        return self._page(
            "batches",
            lambda r: self._batch_obj(r, waiting and waiting(r["id"])),
            after=after,
            limit=limit,
        )

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        """``POST /v1/batches/{id}/cancel``: ``in_progress`` becomes ``cancelling``; the runner
        finishes the row it is running, then writes the results so far and marks it
        ``cancelled``. Cancelling a cancelling or cancelled batch returns it unchanged.
        Raises :class:`BatchRequestError` (400) for a batch that has already ended.
        """
        with self._tx() as db:
            row = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                raise BatchRequestError(
                    codes.NOT_FOUND, f"no batch with id {_short(batch_id)}", param="batch_id"
                )
            status = row["status"]
            if status in ("validating", "in_progress"):
                db.execute(
                    "UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ?",
                    (self._now(), batch_id),
                )
            elif status not in ("cancelling", "cancelled"):
                raise BatchRequestError(
                    codes.INVALID_REQUEST,
                    f"batch {batch_id} is {status} and cannot be cancelled",
                    param="batch_id",
                )
        return self.get_batch(batch_id)

    # -- the runner's side ---------------------------------------------------------------------

    def active_batches(self) -> list[sqlite3.Row]:
        """Batches with work left (in_progress, finalizing, cancelling), oldest first."""
        if not self.exists():
            return []
        with self._lock:
            return self._db.execute(
                "SELECT * FROM batches WHERE status IN (?, ?, ?) ORDER BY seq", ACTIVE_STATUSES
            ).fetchall()

    def pending_models(self, batch_id: str) -> list[str]:
        """The models named by the batch's rows still to run, in row order of first use."""
        with self._lock:
            rows = self._db.execute(
                "SELECT model, MIN(idx) AS first FROM batch_rows WHERE batch_id = ? AND "
                "state = 'pending' GROUP BY model ORDER BY first",
                (batch_id,),
            ).fetchall()
        return [r["model"] for r in rows]

    def pending_rows(self, batch_id: str, model: str, limit: int) -> list[PendingRow]:
        """Up to ``limit`` rows of ``batch_id`` for ``model`` still to run, in file order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM batch_rows WHERE batch_id = ? AND state = 'pending' AND model = ? "
                "ORDER BY idx LIMIT ?",
                (batch_id, model, limit),
            ).fetchall()
        return [
            PendingRow(
                r["batch_id"],
                r["idx"],
                r["custom_id"],
                r["method"],
                r["url"],
                _json_decode(r["body"]),
                r["model"],
            )
            for r in rows
        ]

    def batch_status(self, batch_id: str) -> str:
        return self._batch_row(batch_id)["status"]

    def record_result(self, row: PendingRow, *, ok: bool, line: Mapping[str, Any]) -> bool:
        """Store one row's output line and mark the row done, in ONE transaction.

        ``ok`` counts it as completed (2xx) or failed. Token usage is taken from the response
        body's ``usage``. Returns False, changing nothing, when the row is not pending any more
        (it was recorded before): a row is never counted twice.
        """
        usage = (line.get("response") or {}).get("body") or {}
        usage = usage.get("usage") if isinstance(usage, dict) else None
        tokens_in = tokens_out = 0
        if isinstance(usage, dict):
            tokens_in = _int(usage.get("prompt_tokens"))
            tokens_out = _int(usage.get("completion_tokens"))
        with self._tx() as db:
            cur = db.execute(
                "UPDATE batch_rows SET state = 'done', ok = ?, result = ?, finished_at = ? "
                "WHERE batch_id = ? AND idx = ? AND state = 'pending'",
                (int(ok), _json_encode(dict(line)).decode(), self._now(), row.batch_id, row.idx),
            )
            if cur.rowcount != 1:
                return False
            db.execute(
                "UPDATE batches SET completed = completed + ?, failed = failed + ?, "
                "input_tokens = input_tokens + ?, output_tokens = output_tokens + ? "
                "WHERE id = ?",
                (int(ok), int(not ok), tokens_in, tokens_out, row.batch_id),
            )
        return True

    def done_results(self, batch_id: str) -> dict[str, dict[str, Any]]:
        """Every recorded output line of ``batch_id`` by custom_id (for inspection and tests)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT custom_id, result FROM batch_rows WHERE batch_id = ? AND state = 'done' "
                "ORDER BY idx",
                (batch_id,),
            ).fetchall()
        return {r["custom_id"]: _json_decode(r["result"]) for r in rows}

    def finish(self, batch_id: str) -> dict[str, Any]:
        """End a batch: write its output and error files from the stored results and set the
        final status (``completed``; ``cancelled`` after a cancel; ``expired`` past
        ``expires_at``, with every row not run written to the error file as ``batch_expired``).

        Safe to repeat after a crash: the status moves to ``finalizing`` first, and the files and
        the final status are committed in one transaction.
        """
        row = self._batch_row(batch_id)
        status = row["status"]
        if status not in ACTIVE_STATUSES:
            return self._batch_obj(row)
        now = self._now()
        if status == "in_progress":
            with self._tx() as db:
                db.execute(
                    "UPDATE batches SET status = 'finalizing', finalizing_at = ? "
                    "WHERE id = ? AND status = 'in_progress'",
                    (now, batch_id),
                )
            row = self._batch_row(batch_id)
        if row["status"] == "cancelling":
            final = "cancelled"
        elif row["expires_at"] is not None and now >= row["expires_at"]:
            final = "expired"
        else:
            final = "completed"
        with self._lock:
            rows = self._db.execute(
                "SELECT custom_id, state, ok, result FROM batch_rows WHERE batch_id = ? "
                "ORDER BY idx",
                (batch_id,),
            ).fetchall()
        out: list[bytes] = []
        err: list[bytes] = []
        expired_rows = 0
        for r in rows:
            if r["state"] == "done":
                (out if r["ok"] else err).append(r["result"].encode())
            elif final == "expired":
                expired_rows += 1
                err.append(
                    _json_encode(
                        {
                            "id": _new_id("batch_req_"),
                            "custom_id": r["custom_id"],
                            "response": None,
                            "error": {
                                "code": "batch_expired",
                                "message": "This request could not be "
                                "executed before the completion window expired.",
                            },
                        }
                    )
                )
        out_id = _new_id("file-") if out else None
        err_id = _new_id("file-") if err else None
        for file_id, lines in ((out_id, out), (err_id, err)):
            if file_id is not None:
                self._write_blob(file_id, b"\n".join(lines) + b"\n")
        with self._tx() as db:
            cur = db.execute(
                f"UPDATE batches SET status = ?, {final}_at = ?, output_file_id = ?, "
                f"error_file_id = ?, failed = failed + ? WHERE id = ? AND status = ?",
                (final, now, out_id, err_id, expired_rows, batch_id, row["status"]),
            )
            if cur.rowcount == 1:
                for file_id, lines, kind in ((out_id, out, "output"), (err_id, err, "errors")):
                    if file_id is not None:
                        size = sum(len(x) + 1 for x in lines)
                        db.execute(
                            "INSERT INTO files (id, filename, purpose, bytes, created_at) "
                            "VALUES (?, ?, 'batch_output', ?, ?)",
                            (file_id, f"{batch_id}_{kind}.jsonl", size, now),
                        )
        if cur.rowcount != 1:  # someone else finished it (a cancel raced us): drop our blobs
            for file_id in (out_id, err_id):
                if file_id is not None:
                    with contextlib.suppress(FileNotFoundError):
                        self._blob(file_id).unlink()
            return self.finish(batch_id)
        return self.get_batch(batch_id)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


# --------------------------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------------------------

_REASON_ORDER = {"weights_torn": 0, "quiesced": 1, "model_not_resident": 2}

#: /v1 error codes that mean "not now" rather than "this row is wrong": the row waits, with
#: this ``waiting_reason`` ("" waits a poll without naming a reason: the interactive queue is
#: full, which batch rows do not count against).
DEFERRING_CODES: dict[str, str] = {
    codes.WEIGHTS_TORN.wire: "weights_torn",
    codes.MODEL_NOT_LOADED.wire: "model_not_resident",
    codes.ALREADY_ATTACHED.wire: "model_not_resident",
    codes.WEIGHTS_UNSAVED.wire: "model_not_resident",
    codes.MODEL_BUSY.wire: "model_not_resident",
    codes.QUEUE_FULL.wire: "",
}
#: How often a row whose execution raised (a bug, a transient fault) is tried before its
#: error line is written with ``internal_error``; the tries are ``retry_s * n`` seconds apart.
MAX_ATTEMPTS = 3


def deferral_of(status: int, body: Mapping[str, Any]) -> str | None:
    """The waiting reason a ``/v1`` refusal stands for, or None when it is the row's own error.

    A batch never fails a row because the server cannot run it now (torn, a model not resident,
    a transition, a full queue): such a row waits (contract 7).
    """
    if status < 400:
        return None
    err = body.get("error") if isinstance(body, Mapping) else None
    code = err.get("code") if isinstance(err, Mapping) else None
    return DEFERRING_CODES.get(code) if isinstance(code, str) else None


class BatchRunner:
    """Runs the rows of every active batch through a :class:`RowExecutor` (contract 7).

    One asyncio task (:meth:`start` / :meth:`stop`). It takes the oldest batch with a runnable
    row, claims a chunk of up to ``chunk_size`` rows of one model, and runs them one at a time
    (each through the scheduler's slot at batch priority, inside ``execute_row``), re-checking
    the waiting reason before each row. Each result is recorded before the next row starts.
    ``poll_s`` is how often a waiting batch re-checks its reason. A row whose execution raises
    is tried :data:`MAX_ATTEMPTS` times (``retry_s`` apart, growing) before its error line is
    written, so a transient fault does not fail a whole batch in a burst. ``executor`` may be
    set after construction (before :meth:`start`).
    """

    def __init__(
        self,
        store: BatchStore,
        executor: RowExecutor | None,
        *,
        chunk_size: int = 8,
        poll_s: float = 0.5,
        retry_s: float = 1.0,
    ) -> None:
        self.store = store
        self.executor = executor
        self.chunk_size = chunk_size
        self.poll_s = poll_s
        self.retry_s = retry_s
        self._attempts: dict[tuple[str, int], int] = {}
        self._waiting: dict[str, str | None] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.rows_run = 0
        self._current: tuple[str, str] | None = None  # (batch_id, model) inside execute_row
        self._row_task: asyncio.Future[tuple[int, dict[str, str], dict[str, Any]]] | None = None
        self._stopping_row: asyncio.Future[Any] | None = None  # the row cancel() stopped

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the runner task on the running loop (idempotent). Needs an executor."""
        if self.executor is None:
            raise RuntimeError("BatchRunner.start() without an executor")
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self.run_forever(), name="miserver-batch-runner"
            )

    async def stop(self) -> None:
        """Stop the task. A row that was running keeps no result and runs after the restart."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def wake(self) -> None:
        """Look for work now (a batch was created or cancelled)."""
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """Act on a cancel now (call it after :meth:`BatchStore.cancel_batch`).

        A row of ``batch_id`` inside ``execute_row`` (held in the scheduler by a quiesce, or
        generating) is stopped: its task is cancelled, it keeps no result, and its slot or its
        place in the queue is given back; the batch then ends ``cancelled`` with the results
        recorded so far, without waiting for the quiesce to end or the row to finish. Rows of
        other batches are not touched. Wakes the runner.
        """
        task, current = self._row_task, self._current
        if task is not None and not task.done() and current is not None and current[0] == batch_id:
            self._stopping_row = task
            task.cancel()
        self.wake()

    def waiting_reason(self, batch_id: str) -> str | None:
        """The batch's current ``waiting_reason`` (null while it runs or once it ended).

        While one of its rows is inside ``execute_row`` (running, or held in the scheduler) the
        reason is probed live, so a set that tears while the chunk is held reads
        ``weights_torn``, not the ``quiesced`` it was held under.
        """
        current = self._current
        if current is not None and current[0] == batch_id and self.executor is not None:
            try:
                return self.executor.waiting_reason(current[1])
            except Exception:  # noqa: BLE001 - a status read must not fail
                log.exception("waiting_reason probe failed")
        return self._waiting.get(batch_id)

    # -- the loop ------------------------------------------------------------------------------

    async def run_forever(self) -> None:
        """Run batches until cancelled. Only one runner per home runs at a time (a lock file,
        released by the kernel when its process dies, so a second server on the same home
        takes over after the first is killed and never runs a row the first is running)."""
        lock = await self._take_home_lock()
        try:
            await self._loop()
        finally:
            lock.close()

    async def _take_home_lock(self) -> IO[bytes]:
        path = self.store.home / LOCK_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "ab")  # noqa: SIM115 - held for the runner's life, closed by the caller
        warned = False
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fh
            except BlockingIOError:
                if not warned:
                    log.warning(
                        "another process runs the batches of %s; this one waits", self.store.home
                    )
                    warned = True
            except BaseException:
                fh.close()
                raise
            try:
                await asyncio.sleep(self.poll_s)
            except BaseException:
                fh.close()
                raise

    @property
    def running(self) -> bool:
        """Whether the runner task is alive."""
        return self._task is not None and not self._task.done()

    async def _loop(self) -> None:
        while True:
            try:
                progressed = await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep serving batches; the store is consistent
                log.exception("batch runner step failed")
                progressed = False
            if not progressed:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.poll_s)

    async def run_until_idle(self) -> None:
        """Step until no batch can make progress now (tests and benchmarks)."""
        while await self.step():
            pass

    async def step(self) -> bool:
        """Do one unit of work: finish an ended batch or run one chunk. False when none."""
        if self.executor is None:
            return False
        for batch in self.store.active_batches():
            batch_id = batch["id"]
            now = self.store.clock()
            if batch["status"] != "in_progress" or (
                batch["expires_at"] is not None and now >= batch["expires_at"]
            ):
                await asyncio.to_thread(self.store.finish, batch_id)
                self._waiting.pop(batch_id, None)
                return True
            models = self.store.pending_models(batch_id)
            if not models:
                await asyncio.to_thread(self.store.finish, batch_id)
                self._waiting.pop(batch_id, None)
                return True
            reasons = {m: self.executor.waiting_reason(m) for m in models}
            runnable = [m for m in models if reasons[m] not in BLOCKING_REASONS]
            if not runnable:
                self._waiting[batch_id] = min(
                    (r for r in reasons.values() if r), key=lambda r: _REASON_ORDER.get(r, 9)
                )
                continue
            if await self._run_chunk(batch_id, runnable[0]):
                return True
        return False

    async def _run_chunk(self, batch_id: str, model: str) -> bool:
        try:
            return await self._run_rows(batch_id, model)
        finally:
            self._current = None

    async def _run_rows(self, batch_id: str, model: str) -> bool:
        ran = False
        for row in self.store.pending_rows(batch_id, model, self.chunk_size):
            if self.store.batch_status(batch_id) != "in_progress":
                return True  # cancelled meanwhile: finish it on the next step
            reason = self.executor.waiting_reason(model)
            self._waiting[batch_id] = reason
            if reason in BLOCKING_REASONS:
                return ran
            self._current = (batch_id, model)
            task = self._row_task = asyncio.ensure_future(
                self.executor.execute_row(row.method, row.url, dict(row.body))
            )
            try:
                status, headers, body = await task
            except RowDeferred as exc:
                self._waiting[batch_id] = exc.reason or None
                return ran
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if self._stopping_row is task and (current is None or not current.cancelling()):
                    return True  # cancel(): the row keeps no result; the next step finishes
                raise
            except Exception as exc:  # noqa: BLE001 - a bug in one row must not stop the batch
                key = (batch_id, row.idx)
                tries = self._attempts[key] = self._attempts.get(key, 0) + 1
                log.exception(
                    "batch %s row %s failed (try %d of %d)",
                    batch_id,
                    row.custom_id,
                    tries,
                    MAX_ATTEMPTS,
                )
                if tries < MAX_ATTEMPTS:
                    await asyncio.sleep(self.retry_s * tries)
                    return True
                status, headers, body = (
                    500,
                    {},
                    {
                        "error": {
                            "message": f"the row could not be run: {type(exc).__name__} "
                            f"({MAX_ATTEMPTS} tries; see the server log)",
                            "type": codes.INTERNAL_ERROR.openai_type,
                            "param": None,
                            "code": codes.INTERNAL_ERROR.wire,
                        }
                    },
                )
            finally:
                self._row_task = self._stopping_row = None
            deferred = deferral_of(status, body)
            if deferred is not None:
                self._waiting[batch_id] = deferred or None
                return ran
            self._current = None
            self._waiting[batch_id] = None
            self._attempts.pop((batch_id, row.idx), None)
            self.store.record_result(
                row, ok=200 <= status < 300, line=output_line(row, status, headers, body)
            )
            self.rows_run += 1
            ran = True
        return ran


def output_line(
    row: PendingRow, status: int, headers: Mapping[str, str], body: Mapping[str, Any]
) -> dict[str, Any]:
    """One line of an output or error file, in OpenAI's shape, carrying ``X-miLLM-Model``.

    ``{"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id", "body",
    "headers": {"X-miLLM-Model": ...}}, "error": null}`` (weights page: Which weights answered).
    """
    model_header = next((v for k, v in headers.items() if k.lower() == "x-millm-model"), None)
    request_id = next((v for k, v in headers.items() if k.lower() == "x-request-id"), None)
    return {
        "id": _new_id("batch_req_"),
        "custom_id": row.custom_id,
        "response": {
            "status_code": status,
            "request_id": request_id or _new_id("req_"),
            "body": dict(body),
            "headers": {} if model_header is None else {"X-miLLM-Model": model_header},
        },
        "error": None,
    }
