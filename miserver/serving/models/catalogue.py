"""The model catalogue: one SQLite database in ``MISERVER_HOME/catalogue.sqlite3`` (contract 3).

A row names a model folder (safetensors, Hugging Face layout) or a ``.gguf`` file, with its dtype,
quantization and origin (``model`` for a registered/imported model, ``checkpoint`` for a saved
checkpoint whose ``parent_id`` is the base row). ``resident`` is not stored: it is this process's
view (which row the model host holds right now), so a restart starts with nothing resident
(weights page: States) even when two processes share one home.

Thread-safe: every call opens its own short-lived connection under one lock, so the catalogue can
be used from the event loop and from worker threads alike.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import msgspec

FORMATS = ("safetensors", "gguf")
DTYPES = ("float16", "bfloat16", "float32")
QUANTIZATIONS = ("none", "bitsandbytes-8bit", "bitsandbytes-4bit", "gptq", "awq", "gguf")
ORIGINS = ("model", "checkpoint")
DB_NAME = "catalogue.sqlite3"
#: The folder under ``MISERVER_HOME`` that holds the checkpoints miserver saves (contract 5).
CHECKPOINTS_DIR = "checkpoints"
#: Prefix a deleted checkpoint's folder is renamed to before it is removed (never a checkpoint;
#: :func:`miserver.serving.models.checkpoints.remove_partial_saves` removes a leftover at start-up).
DELETING_PREFIX = ".deleting-"
#: The largest row id SQLite can store (a signed 64-bit INTEGER PRIMARY KEY); ids start at 1.
MAX_ROW_ID = 2**63 - 1

Format = Literal["safetensors", "gguf"]
Dtype = Literal["float16", "bfloat16", "float32"]
Quantization = Literal["none", "bitsandbytes-8bit", "bitsandbytes-4bit", "gptq", "awq", "gguf"]
Origin = Literal["model", "checkpoint"]


class CatalogueRow(msgspec.Struct, frozen=True, kw_only=True):
    """One catalogue row, exactly the wire shape of ``GET /api/models/{id}`` (contract 3).

    ``created_at`` is an RFC 3339 UTC timestamp (``2026-11-30T08:00:00.123456Z``).
    ``checkpoint_sha256`` is the sha256 of a checkpoint's ``manifest.json`` (contract 5), else
    null. ``description``: what the row's weights are, where the other fields cannot say it
    (the embedded default: dequantized from the Q4_1 GGUF file, so its quality is the Q4's;
    issue 32, item 4); a row without one has no such key (``msgspec.UNSET``), so its wire
    shape stays the contract's. ``resident`` is whether this process's model host holds the
    row now.
    """

    id: int
    name: str
    format: Format
    dtype: Dtype
    quantization: Quantization
    path: str
    origin: Origin
    parent_id: int | None
    checkpoint_sha256: str | None
    created_at: str
    description: str | msgspec.UnsetType = msgspec.UNSET
    resident: bool = False


class CatalogueError(ValueError):
    """A catalogue write was refused (invalid value or duplicate name); nothing was changed."""


class DuplicateName(CatalogueError):
    """A row with this name already exists (``POST /api/models`` answers 409)."""

    def __init__(self, name: str, existing_id: int) -> None:
        super().__init__(f"a catalogue row named {name!r} already exists (id {existing_id})")
        self.name = name
        self.existing_id = existing_id


_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE,
    format TEXT NOT NULL,
    dtype TEXT NOT NULL,
    quantization TEXT NOT NULL,
    path TEXT NOT NULL,
    origin TEXT NOT NULL,
    parent_id INTEGER,
    checkpoint_sha256 TEXT,
    created_at TEXT NOT NULL,
    description TEXT
)
"""
_COLUMNS = (
    "id",
    "name",
    "format",
    "dtype",
    "quantization",
    "path",
    "origin",
    "parent_id",
    "checkpoint_sha256",
    "created_at",
    "description",
)


def is_row_id(value: object) -> bool:
    """Whether ``value`` can be a row id: an ``int`` (not a ``bool``) in 1..:data:`MAX_ROW_ID`.

    Ids come from clients (``{"model_id": N}``, ``/api/models/{id}``); one outside SQLite's
    64-bit range would raise ``OverflowError`` in the driver instead of finding no row.
    """
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_ROW_ID


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


class Catalogue:
    """The catalogue of one ``MISERVER_HOME``.

    Args:
        home: the ``MISERVER_HOME`` directory (created if missing); the database is
            ``home/catalogue.sqlite3``.
    """

    def __init__(self, home: str | Path) -> None:
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.path = self.home / DB_NAME
        self._lock = threading.RLock()
        self._resident_id: int | None = None
        with self._connect() as db:
            db.execute(_SCHEMA)
            columns = {r[1] for r in db.execute("PRAGMA table_info(models)").fetchall()}
            if "description" not in columns:  # a catalogue written before the column
                try:
                    db.execute("ALTER TABLE models ADD COLUMN description TEXT")
                except sqlite3.OperationalError as exc:  # another process added it meanwhile
                    if "duplicate column" not in str(exc):
                        raise

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            db = sqlite3.connect(self.path, timeout=30.0)
            try:
                with db:  # commits on success, rolls back on an exception
                    yield db
            finally:
                db.close()

    def _row(self, values: tuple) -> CatalogueRow:
        fields = dict(zip(_COLUMNS, values, strict=True))
        if fields["description"] is None:
            fields["description"] = msgspec.UNSET
        return CatalogueRow(**fields, resident=fields["id"] == self._resident_id)

    def list(self) -> list[CatalogueRow]:
        """Every row, ordered by id."""
        with self._connect() as db:
            rows = db.execute(f"SELECT {', '.join(_COLUMNS)} FROM models ORDER BY id").fetchall()
        return [self._row(r) for r in rows]

    def get(self, row_id: int) -> CatalogueRow | None:
        """The row with this id, or None (also for an id no row can have: below 1, above
        :data:`MAX_ROW_ID`, or not an integer, so a client's id never reaches SQLite unbounded)."""
        if not is_row_id(row_id):
            return None
        with self._connect() as db:
            r = db.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM models WHERE id = ?", (row_id,)
            ).fetchone()
        return self._row(r) if r else None

    def get_by_name(self, name: str) -> CatalogueRow | None:
        """The row with this exact name, or None."""
        with self._connect() as db:
            r = db.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM models WHERE name = ?", (name,)
            ).fetchone()
        return self._row(r) if r else None

    def is_empty(self) -> bool:
        """Whether the catalogue has no rows (the default model is imported then; contract 3)."""
        with self._connect() as db:
            return db.execute("SELECT COUNT(*) FROM models").fetchone()[0] == 0

    def register(
        self,
        *,
        name: str,
        format: Format,
        dtype: Dtype,
        path: str | Path,
        quantization: Quantization = "none",
        origin: Origin = "model",
        parent_id: int | None = None,
        checkpoint_sha256: str | None = None,
        description: str | None = None,
    ) -> CatalogueRow:
        """Add a row and return it (``description``: see :class:`CatalogueRow`).

        Raises:
            CatalogueError: an empty name, or a format/dtype/quantization/origin outside the
                contract's lists, or a ``parent_id`` that names no row.
            DuplicateName: a row with ``name`` exists (nothing is changed).
        """
        if not name or name != name.strip():
            raise CatalogueError("name must be non-empty and have no surrounding whitespace")
        for label, value, allowed in (
            ("format", format, FORMATS),
            ("dtype", dtype, DTYPES),
            ("quantization", quantization, QUANTIZATIONS),
            ("origin", origin, ORIGINS),
        ):
            if value not in allowed:
                raise CatalogueError(f"{label} must be one of {', '.join(allowed)}; got {value!r}")
        with self._connect() as db:
            existing = db.execute("SELECT id FROM models WHERE name = ?", (name,)).fetchone()
            if existing:
                raise DuplicateName(name, existing[0])
            if parent_id is not None and (
                not is_row_id(parent_id)
                or not db.execute("SELECT 1 FROM models WHERE id = ?", (parent_id,)).fetchone()
            ):
                raise CatalogueError(f"parent_id {parent_id} names no catalogue row")
            cur = db.execute(
                "INSERT INTO models (name, format, dtype, quantization, path, origin, parent_id,"
                " checkpoint_sha256, created_at, description)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    name,
                    format,
                    dtype,
                    quantization,
                    str(path),
                    origin,
                    parent_id,
                    checkpoint_sha256,
                    _now(),
                    description,
                ),
            )
            row_id = cur.lastrowid
        row = self.get(row_id)
        assert row is not None
        return row

    def delete(self, row_id: int) -> bool:
        """Remove the row. Returns whether a row was removed.

        A checkpoint row takes its folder with it when miserver wrote that folder (origin
        ``checkpoint``, directly under ``MISERVER_HOME/checkpoints``) and no other row names
        it: a save writes the folder and registers the row as one unit (contract 5: no
        unregistered checkpoint is left), so the name is free to save again and the disk space
        comes back. The folder is renamed away at once (``.deleting-*``) and then removed; a
        leftover is removed at the next start. Every other row's files stay: they are the
        user's (``POST /api/models`` registers a folder, it does not take it over).

        Raises:
            CatalogueError: the row is resident (``DELETE /api/models/{id}`` answers 409
                MODEL_RESIDENT; the route checks first, this is the backstop).
        """
        if not is_row_id(row_id):
            return False
        with self._connect() as db:
            if row_id == self._resident_id:
                raise CatalogueError(f"catalogue row {row_id} is resident; unload it first")
            found = db.execute("SELECT origin, path FROM models WHERE id = ?", (row_id,)).fetchone()
            removed = db.execute("DELETE FROM models WHERE id = ?", (row_id,)).rowcount > 0
            others = [r[0] for r in db.execute("SELECT path FROM models").fetchall()]
        if removed and found is not None and found[0] == "checkpoint":
            self._remove_checkpoint_folder(Path(found[1]), others)
        return removed

    def owned_checkpoint_folder(self, path: str | Path) -> Path | None:
        """``path`` resolved, if it is a folder miserver's saves own: directly under
        ``MISERVER_HOME/checkpoints``, not hidden; else None."""
        try:
            root = (self.home / CHECKPOINTS_DIR).resolve()
            folder = Path(path).resolve()
        except (OSError, RuntimeError):
            return None
        if folder.parent != root or folder.name.startswith("."):
            return None
        return folder

    def _remove_checkpoint_folder(self, path: Path, other_paths: list[str]) -> None:
        folder = self.owned_checkpoint_folder(path)
        if folder is None or not folder.is_dir():
            return
        for other in other_paths:
            try:
                theirs = Path(other).resolve()
            except (OSError, RuntimeError):
                continue
            if theirs == folder or folder in theirs.parents:
                return  # another row (a registered copy) still uses these files
        trash = folder.with_name(f"{DELETING_PREFIX}{folder.name}-{secrets.token_hex(4)}")
        try:
            os.rename(folder, trash)
        except OSError:
            return  # the name stays taken; a save names the folder in its 409
        shutil.rmtree(trash, ignore_errors=True)

    def set_path(self, row_id: int, path: str | Path) -> bool:
        """Point the row at ``path`` (its files moved), keeping its id and everything else.
        Returns whether a row was changed.

        Raises:
            CatalogueError: the row is resident (its files are in use).
        """
        if not is_row_id(row_id):
            return False
        with self._connect() as db:
            if row_id == self._resident_id:
                raise CatalogueError(f"catalogue row {row_id} is resident; unload it first")
            cur = db.execute("UPDATE models SET path = ? WHERE id = ?", (str(path), row_id))
            return cur.rowcount > 0

    def set_description(self, row_id: int, description: str | None) -> bool:
        """Set the row's ``description`` (see :class:`CatalogueRow`), keeping everything else.
        Returns whether a row was changed."""
        if not is_row_id(row_id):
            return False
        with self._connect() as db:
            cur = db.execute(
                "UPDATE models SET description = ? WHERE id = ?", (description, row_id)
            )
            return cur.rowcount > 0

    def set_resident(self, row_id: int | None) -> None:
        """Record which row this process holds now (None: nothing resident)."""
        with self._lock:
            self._resident_id = row_id

    @property
    def resident_id(self) -> int | None:
        """The id of the resident row, or None."""
        return self._resident_id
