"""The Batch API's database and blob files, opened and recovered at start (contract 7).

:class:`BatchDatabase` owns ``MISERVER_HOME/batches.sqlite3`` (WAL, ``synchronous=FULL``: a
result written is on disk) and the blobs under ``files/``. The database is opened, and its schema
created, on first use, so a home whose Batch API was never used gets none; opening it is the
recovery at start: blobs written by an upload that crashed before its row was committed are
removed. A batch's own state needs no other recovery: a row's result is written in the same
transaction that marks it done, so a row that was running at a crash has none and runs again.
:class:`~miserver.serving.batches.store.BatchStore` is the store over it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

DB_NAME = "batches.sqlite3"
FILES_DIR = "files"

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


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class BatchDatabase:
    """The connection (one, under one lock: callable from the event loop and worker threads),
    its transactions and the blob files. ``clock`` returns Unix seconds (tests pass their own)."""

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
                self._private_files()
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

    def _private_files(self) -> None:
        """The batch files are an operator's prompts and the model's answers: ``files/`` 0700,
        the database (and SQLite's ``-wal``/``-shm``, which take its mode) and every blob 0600
        (issue 32, item 13). An existing home's are tightened too: only miserver reads them."""
        self.files_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.files_dir, 0o700)
        db = self.home / DB_NAME
        os.close(os.open(db, os.O_RDWR | os.O_CREAT, 0o600))
        for path in (db, db.with_name(DB_NAME + "-wal"), db.with_name(DB_NAME + "-shm")):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(path, 0o600)

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
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as fh:
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
