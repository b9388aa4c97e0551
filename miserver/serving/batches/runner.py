"""The Batch API's runner: runs the rows of every active batch through a :class:`RowExecutor`,
a chunk at a time (the chunk's rows together, so they join the engine together), below
interactive traffic, and never fails a row because the server cannot run it now (contract 7;
the weights page: States, The write cycle 2).

The runner depends on the serving runtime through one narrow seam, :class:`RowExecutor`:
``waiting_reason(model)`` (why a row for ``model`` cannot run now) and
``execute_row(method, url, body, unit=...)`` (run one request line as ``/v1`` would, at batch
priority, in the chunk's :class:`~miserver.serving.engine.slot.Unit`).
A batch never loads a model: rows for a model that is not resident wait (``model_not_resident``);
while the weights are torn the batch waits (``weights_torn``); while the barrier is held the next
chunk is held in the scheduler (``quiesced``); while the disk of ``MISERVER_HOME`` is full
(results or output files cannot be written) every active batch waits (``disk_full``), the results
of the rows that finished meanwhile kept in memory and written once there is space, never computed
again. Only the completion window (``24h``) ends a waiting batch, as ``expired``. At start the
runner takes the home's lock file (one runner per home); the rows that were running at a crash
(at most one chunk) kept no result and run again (:mod:`miserver.serving.batches.store`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import sqlite3
from collections.abc import Callable, Mapping
from typing import IO, Any, Protocol

from miserver.serving.batches.db import new_id
from miserver.serving.batches.store import BatchStore, PendingRow
from miserver.serving.engine.slot import Unit
from miserver.spec import codes

log = logging.getLogger("miserver.batches")

LOCK_NAME = "batches.runner.lock"
#: ``waiting_reason`` values of the batch object (contract 7).
WAITING_REASONS: tuple[str, ...] = ("quiesced", "weights_torn", "model_not_resident", "disk_full")
#: Reasons that stop the runner from taking a row: the row waits, it never fails.
BLOCKING_REASONS = frozenset({"weights_torn", "model_not_resident"})
#: ``waiting_reason`` while results or output files cannot be written (issue 32, item 12).
DISK_FULL = "disk_full"


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk (or the user's quota) is full: an :class:`OSError` with
    ``ENOSPC`` or ``EDQUOT``, or SQLite's ``SQLITE_FULL`` ("database or disk is full")."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        return code == sqlite3.SQLITE_FULL or "database or disk is full" in str(exc)
    return False


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
        self, method: str, url: str, body: dict[str, Any], *, unit: Unit | None = None
    ) -> tuple[int, dict[str, str], dict[str, Any]]:
        """Run one request line as ``/v1`` would, at batch priority, never loading a model.

        ``unit`` is the row's chunk (:class:`~miserver.serving.engine.slot.Unit`, ``members``
        the chunk's rows, all started together): the row waits for the slot in it, so a held
        chunk counts once in ``held_batch_chunks`` and the chunk's rows are granted together.
        The runner makes the row leave the unit once this call has returned or raised.

        Returns ``(status_code, headers, json_body)``: the body of a 2xx is the completion, any
        other an OpenAI error body. ``headers`` carries ``X-miLLM-Model`` for a served request.
        Raises :class:`RowDeferred` when the row must wait instead (torn, model not resident).
        """
        ...


# --------------------------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------------------------

_REASON_ORDER = {"disk_full": 0, "weights_torn": 1, "quiesced": 2, "model_not_resident": 3}

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


class _Chunk:
    """The rows of one batch and model that run together, and what became of them."""

    def __init__(self, batch_id: str, model: str, unit: Unit) -> None:
        self.batch_id = batch_id
        self.model = model
        self.unit = unit
        self.tasks: list[asyncio.Task[bool]] = []
        self.stopped: set[asyncio.Task[bool]] = set()  # the row tasks cancel() stopped
        self.inside = 0  # rows inside execute_row
        self.stopping = False  # a row was deferred or crashed: rows not begun do not begin
        self.deferred = False  # some row was deferred: the batch keeps its waiting reason


class BatchRunner:
    """Runs the rows of every active batch through a :class:`RowExecutor` (contract 7).

    One asyncio task (:meth:`start` / :meth:`stop`). It takes the oldest batch with a runnable
    row, re-checks the waiting reason, claims a chunk of up to ``chunk_size`` rows of one model
    and starts them all at once, each row its own task inside ``execute_row`` (each through
    the scheduler's slot at batch priority, the chunk one
    :class:`~miserver.serving.engine.slot.Unit` whose rows are granted together, so they join
    the engine's running batch together); the next chunk starts when every row of this one has ended. Each
    result is recorded as soon as its row finishes, in one transaction of the store (a crash
    loses no finished row and runs none twice; the rows still running then keep no result and
    run again). A row that is deferred (:class:`RowDeferred`, :func:`deferral_of`) keeps no
    result and waits; the rows still running go on, rows not begun yet do not begin.
    ``poll_s`` is how often a waiting batch re-checks its reason. A row whose execution raises
    is tried :data:`MAX_ATTEMPTS` times (``retry_s`` apart, growing) before its error line is
    written, so a transient fault does not fail a whole batch in a burst. ``executor`` may be
    set after construction (before :meth:`start`).

    A full disk (:func:`is_disk_full`: a result or an output file that cannot be written) is a
    wait, not a failure (issue 32, item 12): the finished row's output line is kept in memory
    (the row stays pending in the database, so a crash meanwhile runs it again, never twice),
    the chunk's other rows go on and are kept alike, and no new chunk starts; every active batch
    reports ``waiting_reason: "disk_full"``. Each step first tries to write what it keeps; once
    that succeeds the batches resume where they stopped. One warning line when an episode
    starts, one info line when it ends, no traceback.
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
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer of at least 1, got {chunk_size!r}")
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
        self._chunks = 0
        self._chunk: _Chunk | None = None  # the chunk whose rows run now
        #: Output lines computed while the disk was full, not yet written: (batch, idx) ->
        #: (row, ok, line). Their rows stay pending in the store and are never run again.
        self._unwritten: dict[tuple[str, int], tuple[PendingRow, bool, dict[str, Any]]] = {}
        self._disk_full_since: float | None = None  # the episode's start (loop time), or None

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
        """Stop the task. The rows that were running keep no result and run after the restart."""
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

        Every row of ``batch_id`` inside ``execute_row`` (held in the scheduler by a quiesce,
        or generating) is stopped: its task is cancelled, it keeps no result, and its slot or
        its place in the queue is given back; the batch then ends ``cancelled`` with the
        results recorded so far, without waiting for the quiesce to end or the rows to finish.
        Rows of other batches are not touched. Wakes the runner.
        """
        chunk = self._chunk
        if chunk is not None and chunk.batch_id == batch_id:
            chunk.stopping = True
            for task in chunk.tasks:
                if not task.done():
                    chunk.stopped.add(task)
                    task.cancel()
        self.wake()

    def waiting_reason(self, batch_id: str) -> str | None:
        """The batch's current ``waiting_reason`` (null while it runs or once it ended;
        ``disk_full`` for every batch while results cannot be written).

        While one of its rows is inside ``execute_row`` (running, or held in the scheduler) the
        reason is probed live, so a set that tears while the chunk is held reads
        ``weights_torn``, not the ``quiesced`` it was held under.
        """
        if self._disk_full_since is not None:
            return DISK_FULL  # nothing of any batch can be written now
        chunk = self._chunk
        if (
            chunk is not None
            and chunk.batch_id == batch_id
            and chunk.inside
            and self.executor is not None
        ):
            try:
                return self.executor.waiting_reason(chunk.model)
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
        # held for the runner's life, closed by the caller; 0600 as the batch files
        fh = open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")  # noqa: SIM115
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

    # -- a full disk (issue 32, item 12) --------------------------------------------------------

    def _disk_full(self, what: str, exc: BaseException) -> None:
        """Enter (or stay in) a disk-full episode: one warning line at its start, no traceback."""
        if self._disk_full_since is None:
            self._disk_full_since = asyncio.get_running_loop().time()
            log.warning(
                "batch output: the disk of %s is full (%s: %s); batches wait "
                "(waiting_reason disk_full), finished rows' results are kept in memory and "
                "written once there is space",
                self.store.home,
                what,
                exc,
            )

    def _record(self, row: PendingRow, ok: bool, line: dict[str, Any]) -> None:
        """Write one result, or keep it in memory while the disk is full."""
        if self._disk_full_since is None:
            try:
                self.store.record_result(row, ok=ok, line=line)
                return
            except Exception as exc:
                if not is_disk_full(exc):
                    raise
                self._disk_full("a row's result", exc)
        self._unwritten[(row.batch_id, row.idx)] = (row, ok, line)

    def _flush_unwritten(self) -> bool:
        """Write the results kept during a disk-full episode; True when none is left (the
        episode, if any, is over). A still-full disk keeps them and returns False."""
        for key, (row, ok, line) in list(self._unwritten.items()):
            try:
                self.store.record_result(row, ok=ok, line=line)
            except Exception as exc:
                if not is_disk_full(exc):
                    raise
                self._disk_full("a row's result", exc)
                return False
            del self._unwritten[key]
        return True

    def _disk_space_back(self) -> None:
        if self._disk_full_since is None:
            return
        waited = asyncio.get_running_loop().time() - self._disk_full_since
        self._disk_full_since = None
        log.info("batch output: there is disk space again after %.0f s; batches resume", waited)

    async def _finish(self, batch_id: str) -> bool:
        """Finish ``batch_id`` (its output files); False while the disk is full."""
        try:
            await asyncio.to_thread(self.store.finish, batch_id)
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            self._disk_full("the output files of " + batch_id, exc)
            return False
        self._waiting.pop(batch_id, None)
        self._disk_space_back()
        return True

    async def step(self) -> bool:
        """Do one unit of work: finish an ended batch or run one chunk. False when none (or
        while the disk is full)."""
        if self.executor is None:
            return False
        had_unwritten = bool(self._unwritten)
        if not self._flush_unwritten():
            return False  # still full: every active batch waits (disk_full)
        if had_unwritten:
            self._disk_space_back()
            return True
        batches = self.store.active_batches()
        if self._disk_full_since is not None:
            # The episode began at an output file: only finishing a batch can tell whether
            # there is space again, and no chunk starts before it does.
            for batch in batches:
                if self._needs_finish(batch):
                    return await self._finish(batch["id"])
            self._disk_space_back()  # nothing left that failed to write
        for batch in batches:
            batch_id = batch["id"]
            if self._needs_finish(batch):
                return await self._finish(batch_id)
            models = self.store.pending_models(batch_id)
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

    def _needs_finish(self, batch: Any) -> bool:
        """Whether ``batch`` (a store row) has ended: cancelled, expired, or no row pending."""
        if batch["status"] != "in_progress":
            return True
        expires = batch["expires_at"]
        if expires is not None and self.store.clock() >= expires:
            return True
        return not self.store.pending_models(batch["id"])

    async def _run_chunk(self, batch_id: str, model: str) -> bool:
        """Run one chunk of ``batch_id``'s rows for ``model``, all at once; True when it made
        progress (a result recorded, a row to retry, a cancel acted on)."""
        rows = self.store.pending_rows(batch_id, model, self.chunk_size)
        if not rows:
            return False
        if self.store.batch_status(batch_id) != "in_progress":
            return True  # cancelled meanwhile: finish it on the next step
        assert self.executor is not None
        reason = self.executor.waiting_reason(model)
        self._waiting[batch_id] = reason
        if reason in BLOCKING_REASONS:
            return False
        self._chunks += 1
        unit = Unit(members=len(rows), name=f"{batch_id}#{self._chunks}")
        chunk = self._chunk = _Chunk(batch_id, model, unit)
        try:
            for row in rows:
                left = [False]

                def leave(_task: Any = None, left: list[bool] = left) -> None:
                    if not left[0]:  # once per row: after execute_row, or when its task ends
                        left[0] = True
                        unit.leave()

                task = asyncio.ensure_future(self._run_row(chunk, row, leave))
                task.add_done_callback(leave)
                chunk.tasks.append(task)
            try:
                await asyncio.wait(chunk.tasks, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                running = [t for t in chunk.tasks if not t.done()]
                for task in running:  # stop() or a crash of one row: the others keep no result
                    task.cancel()
                if running:
                    await asyncio.wait(running)
            for task in chunk.tasks:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            progressed = False
            for task in chunk.tasks:
                if task.cancelled():
                    if task not in chunk.stopped:
                        raise asyncio.CancelledError
                    progressed = True  # cancel(): the row kept no result; the next step ends it
                else:
                    progressed = task.result() or progressed
            return progressed
        finally:
            self._chunk = None

    async def _run_row(self, chunk: _Chunk, row: PendingRow, leave: Callable[[], None]) -> bool:
        """One row of ``chunk``: execute it, record its result; True when it made progress."""
        assert self.executor is not None
        batch_id = chunk.batch_id
        if chunk.stopping:
            return False  # a row of the chunk was deferred (or crashed) before this one began
        if self.store.batch_status(batch_id) != "in_progress":
            return True  # cancelled before this row began: finish it on the next step
        chunk.inside += 1
        try:
            try:
                status, headers, body = await self.executor.execute_row(
                    row.method, row.url, dict(row.body), unit=chunk.unit
                )
            finally:
                chunk.inside -= 1
                leave()  # it waits in the scheduler no more: the chunk's others need not wait
        except RowDeferred as exc:
            chunk.stopping = chunk.deferred = True
            self._waiting[batch_id] = exc.reason or None
            return False
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
                return True  # the row stays pending: a later chunk tries it again
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
        except BaseException:  # cancelled, or the process is going down: no result
            chunk.stopping = True
            raise
        deferred = deferral_of(status, body)
        if deferred is not None:
            chunk.stopping = chunk.deferred = True
            self._waiting[batch_id] = deferred or None
            return False
        if not chunk.deferred and self._disk_full_since is None:
            self._waiting[batch_id] = None
        self._attempts.pop((batch_id, row.idx), None)
        self._record(row, 200 <= status < 300, output_line(row, status, headers, body))
        self.rows_run += 1
        return True


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
        "id": new_id("batch_req_"),
        "custom_id": row.custom_id,
        "response": {
            "status_code": status,
            "request_id": request_id or new_id("req_"),
            "body": dict(body),
            "headers": {} if model_header is None else {"X-miLLM-Model": model_header},
        },
        "error": None,
    }
