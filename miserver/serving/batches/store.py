"""The Batch API's store: OpenAI-compatible files and batches in SQLite, run exactly once.

The runner is :mod:`miserver.serving.batches.runner`, the input file's validation
:mod:`miserver.serving.batches.input_file`, the database and its recovery at start
:mod:`miserver.serving.batches.db`.

Contract section 7 and the weights page (States; Which weights answered; The write cycle 2).

Persistence. Everything lives in ``MISERVER_HOME``: the database ``batches.sqlite3`` (files,
batches and one row per request line, with its result) and the file blobs under ``files/``.
A row's result is written in the **same SQLite transaction** that marks the row done and counts
it, so after a restart (even ``kill -9``) a batch continues where it stopped: a finished row is
never lost and never run again; a row that was running at the crash had no recorded result and
runs again. Output and error files are built from the stored results when the batch ends.

Thread-safety: :class:`BatchStore` serialises every call under one lock over one connection, so
it may be called from the event loop and from worker threads.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from miserver.serving.batches.db import BatchDatabase, new_id
from miserver.serving.batches.input_file import (
    COMPLETION_WINDOWS,
    ENDPOINTS,
    BatchRequestError,
    BodyCheck,
    check_metadata,
    parse_batch_input,
    short,
)
from miserver.spec import codes

log = logging.getLogger("miserver.batches")

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
_CREATE_KEYS = frozenset(
    {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"}
)

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.decode


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
# The store
# --------------------------------------------------------------------------------------------


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


class BatchStore(BatchDatabase):
    """Files and batches in ``home/batches.sqlite3`` plus blobs in ``home/files/`` (contract 7).

    Objects are returned as dicts in OpenAI's wire shape (``File``, ``Batch``). Every method
    raises :class:`BatchRequestError` for a refused request and changes nothing then.
    ``clock`` returns Unix seconds (tests pass their own). ``body_check`` (set by the server:
    the ``/v1`` schema's checks) refuses an input line whose body its route would refuse.
    """

    body_check: BodyCheck | None = None

    # -- files ---------------------------------------------------------------------------------

    def create_file(self, data: bytes, *, filename: str, purpose: str) -> dict[str, Any]:
        """Store an uploaded batch input file (``POST /v1/files``); returns the File object.

        ``purpose`` must be ``batch`` and ``data`` a valid batch input (:func:`parse_batch_input`).
        Raises :class:`BatchRequestError` (400) otherwise; nothing is stored then.
        """
        if purpose not in FILE_PURPOSES_IN:
            raise BatchRequestError(
                codes.INVALID_REQUEST,
                f'purpose must be "batch", got {short(purpose)}',
                param="purpose",
            )
        parse_batch_input(data, self.body_check)
        return self._add_file(data, filename=filename or "batch.jsonl", purpose=purpose)

    def _add_file(self, data: bytes, *, filename: str, purpose: str) -> dict[str, Any]:
        file_id = new_id("file-")
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
                codes.NOT_FOUND, f"no file with id {short(file_id)}", param="file_id"
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
                        f"after: no object with id {short(after)}",
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
                f"endpoint must be one of {', '.join(ENDPOINTS)}, got {short(endpoint)}",
                param="endpoint",
            )
        window = request["completion_window"]
        if window not in COMPLETION_WINDOWS:
            raise BatchRequestError(
                codes.INVALID_REQUEST,
                f'completion_window must be "24h", got {short(window)}',
                param="completion_window",
            )
        metadata = check_metadata(request.get("metadata"))
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
        rows = parse_batch_input(self.file_content(file_id), self.body_check)
        wrong = [r for r in rows if r.url != endpoint]
        if wrong:
            raise BatchRequestError(
                codes.INVALID_REQUEST,
                f"line {wrong[0].line}: url {wrong[0].url} does not match the "
                f"batch endpoint {endpoint} ({len(wrong)} lines differ)",
                param="endpoint",
            )
        models = {r.model for r in rows}
        batch_id = new_id("batch_")
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
        status = row["status"]
        shown = status == "in_progress" or (
            status in ACTIVE_STATUSES and waiting_reason == "disk_full"  # output not writable
        )
        obj["waiting_reason"] = waiting_reason if shown else None
        return obj

    def _batch_row(self, batch_id: str) -> sqlite3.Row:
        with self._lock:
            row = self._db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise BatchRequestError(
                codes.NOT_FOUND, f"no batch with id {short(batch_id)}", param="batch_id"
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
                    codes.NOT_FOUND, f"no batch with id {short(batch_id)}", param="batch_id"
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
                            "id": new_id("batch_req_"),
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
        out_id = new_id("file-") if out else None
        err_id = new_id("file-") if err else None
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
