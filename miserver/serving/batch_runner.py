"""The Batch API's runner: runs the rows of every active batch through a :class:`RowExecutor`,
one at a time, below interactive traffic, and never fails a row because the server cannot run it
now (contract 7; the weights page: States, The write cycle 2).

The runner depends on the serving runtime through one narrow seam, :class:`RowExecutor`:
``waiting_reason(model)`` (why a row for ``model`` cannot run now) and
``execute_row(method, url, body)`` (run one request line as ``/v1`` would, at batch priority).
A batch never loads a model: rows for a model that is not resident wait (``model_not_resident``);
while the weights are torn the batch waits (``weights_torn``); while the barrier is held the next
chunk is held in the scheduler (``quiesced``). Only the completion window (``24h``) ends a waiting
batch, as ``expired``. At start the runner takes the home's lock file (one runner per home); a
row that was running at a crash kept no result and runs again (:mod:`miserver.serving.batch_store`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
from collections.abc import Mapping
from typing import IO, Any, Protocol

from miserver.serving.batch_db import new_id
from miserver.serving.batch_store import BatchStore, PendingRow
from miserver.spec import codes

log = logging.getLogger("miserver.batches")

LOCK_NAME = "batches.runner.lock"
#: ``waiting_reason`` values of the batch object (contract 7).
WAITING_REASONS: tuple[str, ...] = ("quiesced", "weights_torn", "model_not_resident")
#: Reasons that stop the runner from taking a row: the row waits, it never fails.
BLOCKING_REASONS = frozenset({"weights_torn", "model_not_resident"})


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
