"""Issue 32, item 12: a full disk during Batch output is a wait, not a loop of failures.

The batch waits with ``waiting_reason: "disk_full"``, the log has one line for the episode (no
traceback), the rows that finished while the disk was full are not decoded again, and once there
is space the batch resumes and ends with every row exactly once. The disk is made "full" by
making the store's writes fail as a full disk makes them fail (SQLite's ``SQLITE_FULL`` on a
transaction, ``ENOSPC`` on a blob), which a test cannot do to a real file system unprivileged.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import sqlite3
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from miserver.serving.batches.runner import BatchRunner, is_disk_full
from miserver.serving.batches.store import BatchStore
from tests.unit.test_batches import FakeExecutor, line, new_batch, output


class FullDisk:
    """Makes ``store``'s transactions and blob writes fail as on a full disk while ``full``."""

    def __init__(self, store: BatchStore) -> None:
        self.store = store
        self.full = False
        self.blobs_only = False
        self.refused = 0
        real_tx, real_blob = store._tx, store._write_blob

        @contextlib.contextmanager
        def tx() -> Iterator[sqlite3.Connection]:
            with real_tx() as db:
                yield db
                if self.full and not self.blobs_only:
                    self.refused += 1
                    raise sqlite3.OperationalError("database or disk is full")  # at COMMIT

        def blob(file_id: str, data: bytes) -> Path:
            if self.full:
                self.refused += 1
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_blob(file_id, data)

        store._tx = tx  # type: ignore[method-assign]
        store._write_blob = blob  # type: ignore[method-assign]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BatchStore]:
    s = BatchStore(tmp_path)
    yield s
    s.close()


def _episode_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "miserver.batches"]


def test_disk_full_is_recognised() -> None:
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(sqlite3.OperationalError("database or disk is full"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(sqlite3.OperationalError("database is locked"))
    assert not is_disk_full(ValueError("database or disk is full"))


async def test_results_wait_for_space_and_are_never_computed_again(
    store: BatchStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="miserver.batches")
    b = new_batch(store, [line(f"r{i}") for i in range(5)])
    disk = FullDisk(store)
    ex = FakeExecutor()
    runner = BatchRunner(store, ex, chunk_size=2, poll_s=0.01)
    disk.full = True
    await runner.run_until_idle()
    for _ in range(20):  # the runner's polls while the disk stays full
        assert not await runner.step()
    now = store.get_batch(b["id"], runner.waiting_reason(b["id"]))
    assert now["status"] == "in_progress" and now["waiting_reason"] == "disk_full"
    assert now["request_counts"] == {"total": 5, "completed": 0, "failed": 0}
    assert ex.calls == Counter({"r0": 1, "r1": 1})  # one chunk ran; nothing ran again
    assert disk.refused > 20  # it did try to write on each poll
    lines = _episode_lines(caplog)
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, lines
    assert lines[0].exc_info is None and "disk_full" in lines[0].getMessage()

    disk.full = False
    await runner.run_until_idle()
    done = store.get_batch(b["id"], runner.waiting_reason(b["id"]))
    assert done["status"] == "completed" and done["waiting_reason"] is None
    assert done["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    out, err = output(store, b)
    assert [x["custom_id"] for x in out] == [f"r{i}" for i in range(5)] and not err
    assert ex.calls == Counter({f"r{i}": 1 for i in range(5)})  # nothing lost or doubled
    lines = _episode_lines(caplog)
    assert len(lines) == 2 and lines[1].levelno == logging.INFO and lines[1].exc_info is None


async def test_a_full_disk_while_writing_the_output_files_waits_then_finishes(
    store: BatchStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="miserver.batches")
    b = new_batch(store, [line("a"), line("bad", max_tokens=0)])
    disk = FullDisk(store)
    ex = FakeExecutor()
    runner = BatchRunner(store, ex, poll_s=0.01)
    disk.full = disk.blobs_only = True  # the results fit; the output files do not
    await runner.run_until_idle()
    for _ in range(10):
        assert not await runner.step()
    now = store.get_batch(b["id"], runner.waiting_reason(b["id"]))
    assert now["status"] == "finalizing" and now["waiting_reason"] == "disk_full"
    assert now["output_file_id"] is None
    assert len(_episode_lines(caplog)) == 1
    disk.full = False
    await runner.run_until_idle()
    out, err = output(store, b)
    assert [x["custom_id"] for x in out] == ["a"] and [x["custom_id"] for x in err] == ["bad"]
    assert store.get_batch(b["id"])["status"] == "completed"
    assert ex.calls == Counter({"a": 1, "bad": 1})


async def test_a_batch_created_during_the_episode_waits_too(store: BatchStore) -> None:
    first = new_batch(store, [line("a")])
    disk = FullDisk(store)
    runner = BatchRunner(store, FakeExecutor(), poll_s=0.01)
    disk.full = True
    await runner.run_until_idle()
    disk.full = False
    second = new_batch(store, [line("b")])  # an upload fits again, the episode is not over yet
    assert runner.waiting_reason(second["id"]) == "disk_full"
    await runner.run_until_idle()
    for b in (first, second):
        assert store.get_batch(b["id"])["status"] == "completed"
        assert runner.waiting_reason(b["id"]) is None
