"""Issue 32, item 13: what miserver writes that holds an operator's data is its owner's only,
as the shared-memory files are: the Batch API's files (folder 0700, blobs 0600), its database
(with SQLite's -wal and -shm) and lock file, a checkpoint (folder 0700, files 0600) and the audit
log (0600 when created). Each is checked under the usual umask 022, which made them 0644/0755."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from miserver.serving.audit import AuditLog
from miserver.serving.batches.db import DB_NAME
from miserver.serving.batches.runner import LOCK_NAME, BatchRunner
from miserver.serving.batches.store import BatchStore
from miserver.serving.models import checkpoints as ck
from tests.unit.test_batches import FakeExecutor, line, new_batch
from tests.unit.test_checkpoints import tiny_model, tiny_tokenizer


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_batch_files_database_and_lock_are_the_owners_only(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = BatchStore(home)
    try:
        b = new_batch(store, [line("a"), line("bad", max_tokens=0)])
        runner = BatchRunner(store, FakeExecutor())
        await runner.run_until_idle()
        task_runner = BatchRunner(store, FakeExecutor(), poll_s=0.01)
        task_runner.start()  # takes the home's lock file
        try:
            for _ in range(100):
                if (home / LOCK_NAME).exists():
                    break
                await asyncio.sleep(0.01)
        finally:
            await task_runner.stop()
        done = store.get_batch(b["id"])
        assert done["output_file_id"] and done["error_file_id"]
        assert mode(home / "files") == 0o700
        blobs = list((home / "files").iterdir())
        assert len(blobs) == 3  # the input, the output and the error file
        assert {mode(p) for p in blobs} == {0o600}
        for name in (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm", LOCK_NAME):
            assert mode(home / name) == 0o600, name
    finally:
        store.close()


def test_an_existing_batch_home_is_tightened(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "files").mkdir(parents=True, mode=0o755)
    (home / DB_NAME).touch(mode=0o644)
    store = BatchStore(home)
    try:
        store.list_files()
        assert mode(home / "files") == 0o700 and mode(home / DB_NAME) == 0o600
    finally:
        store.close()


def test_a_checkpoint_is_the_owners_only(tmp_path: Path) -> None:
    saved = ck.save_checkpoint(
        tiny_model(),
        tiny_tokenizer(),
        root=tmp_path / "checkpoints",
        name="private",
        base_row_id=1,
        base_name="tiny-base",
        parent_sha256=None,
        steps_since_load=1,
        now=1_800_000_000.0,
    )
    assert mode(saved.path) == 0o700
    files = list(saved.path.rglob("*"))
    assert any(p.name == "model.safetensors" for p in files) and len(files) > 2
    assert {mode(p) for p in files if p.is_file()} == {0o600}
    assert {mode(p) for p in files if p.is_dir()} <= {0o700}
    ck.verify(ck.open_checkpoint(saved.path))  # it still verifies


def test_the_audit_log_is_created_the_owners_only(tmp_path: Path) -> None:
    log = AuditLog(str(tmp_path / "audit.jsonl"))
    try:
        assert mode(tmp_path / "audit.jsonl") == 0o600
    finally:
        log.close()
