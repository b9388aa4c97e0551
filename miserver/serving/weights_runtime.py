"""The weights runtime: drives the lifecycle core and performs its effects on the server.

The handlers of ``/api/weights/*``, the management loads and ``/v1`` admission all come here.
Each call follows one shape (design notes, "Verified facts about transitions"):

1. build an :class:`~miserver.fsm.state.Event` from the request (the caller's token, label and
   ``X-miLLM-Attachment`` header; facts such as a full queue);
2. under one ``asyncio.Lock``, let :meth:`~miserver.fsm.machine.Lifecycle.handle` decide and
   perform the outcome's effects in order (:meth:`WeightsRuntime._perform`);
3. outside the lock, wait where the outcome says to wait (a quiesce waits for its drain, a save
   for its write, a management load for the load), then answer.

No rule about weights, the barrier, the attachment or a refusal is written here: this module only
translates effects (``HOLD_ADMISSIONS``, ``START_DRAIN``, ``RELEASE_HELD``, ``REFUSE_HELD_TORN``,
...) into calls on the scheduler, the model host and the IPC layer. Timers run on one asyncio
task over the core's deadlines (:meth:`WeightsRuntime._pump`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miserver.fsm.machine import Lifecycle, Outcome
from miserver.fsm.state import Caller as FsmCaller
from miserver.fsm.state import Event
from miserver.fsm.table import Answer, Effect
from miserver.http.audit import AuditLog, AuditRecord
from miserver.http.auth import Caller, attachment_ref
from miserver.http.errors import ApiError, disk_full_error, is_disk_full
from miserver.serving.scheduler import DrainTimeout, Priority
from miserver.serving.weights_transport import AttachmentTransport
from miserver.spec import codes
from miserver.spec.settings import Settings

if TYPE_CHECKING:
    from miserver.serving.host import Resident

log = logging.getLogger("miserver.weights")

#: The triggers whose accepted call waits for the pause it started to settle.
PAUSE_TRIGGERS = frozenset({"quiesce", "save", "weights_load", "adapter_change"})
#: The ``Retry-After`` value (seconds) of the refusals whose table row sends one (503
#: WEIGHTS_TORN, 503 QUEUE_FULL, 409 MODEL_BUSY when the model changed while a /v1 request waited).
RETRY_AFTER_S = 1


def rfc3339(t: float | None) -> str | None:
    """A wall-clock time (seconds since the epoch) as an RFC 3339 UTC string, ms precision."""
    if t is None:
        return None
    return (
        _dt.datetime.fromtimestamp(t, _dt.UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


class WeightsTornError(ApiError):
    """503 WEIGHTS_TORN for a request held when the set tore (weights page: States)."""

    def __init__(self) -> None:
        super().__init__(
            codes.WEIGHTS_TORN,
            "The weights are torn. Recover with POST /api/weights/load.",
            details={"recover": "POST /api/weights/load"},
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


@dataclass
class CallResult:
    """What one gated call produced: the outcome, the settled pause answer, effect outputs."""

    outcome: Outcome
    answer: Answer | None = None
    outputs: dict[str, Any] = field(default_factory=dict)
    before: str = "clean"
    after: str = "clean"
    job: dict[str, Any] = field(default_factory=dict)


PauseJob = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class WeightsRuntime:
    """One process's weights lifecycle, bound to its scheduler and model host.

    Args:
        settings: the validated configuration (timers, tokens, audit log path).
        scheduler: :class:`miserver.serving.scheduler.Scheduler` (the slots and the barrier).
        host: :class:`miserver.serving.host.ModelHost` (the resident model).
        audit: where ``weights_audit`` lines go.
        metrics: the app's metrics object, or None.
        clock: a monotonic clock in seconds (tests pass a fake one).
        wall: the wall clock matching ``clock`` (seconds since the epoch).
    """

    def __init__(
        self,
        *,
        settings: Settings,
        scheduler: Any,
        host: Any,
        audit: AuditLog | None = None,
        metrics: Any = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.host = host
        self.audit = audit or AuditLog(settings.weights_audit_log)
        self.metrics = metrics
        self.clock = clock
        self._wall_offset = wall() - clock()
        resident = host.resident
        self.lifecycle = Lifecycle.from_settings(
            settings,
            resident=resident is not None,
            served_name=resident.served_name if resident is not None else None,
        )
        self.lock = asyncio.Lock()
        #: Weights loads whose checkpoint is being checked (off the event loop, before the
        #: lifecycle decides): a catalogue DELETE waits for them as for the pause itself.
        self.loads_checking = 0
        self._pending: asyncio.Future[Answer] | None = None
        self._pending_failure: Answer | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._drained_now = False
        self._last_outputs: dict[str, Any] = {}
        self._jobs: dict[str, PauseJob] = {}
        self._job_params: dict[str, Any] = {}
        self._job_result: dict[str, Any] = {}
        self._pump_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._pump_deadline: float | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.last_save: dict[str, Any] | None = None
        self._transition_params: dict[str, Any] = {}
        self.last_export: Any = None
        #: The attachment's transport and its process group (contract 10).
        self.transport = AttachmentTransport(
            join_timeout_s=settings.weights_heartbeat_timeout_s,
            op_timeout_s=settings.weights_commit_watchdog_ms / 1000.0,
            metrics=metrics,
        )

    # --- time -------------------------------------------------------------------------------
    def now(self) -> float:
        return self.clock()

    def stamp(self, t: float | None) -> str | None:
        """A core time (the ``clock``) as an RFC 3339 string."""
        return None if t is None else rfc3339(t + self._wall_offset)

    # --- lifecycle of the runtime -------------------------------------------------------------
    def start(self) -> None:
        """Start the timer pump (call on the app's event loop)."""
        if self._pump_task is None:
            self._pump_task = asyncio.get_running_loop().create_task(self._pump())

    async def stop(self) -> None:
        self.audit.close()
        for task in [self._pump_task, self._drain_task, *self._tasks]:
            if task is not None and not task.done():
                task.cancel()
        for task in [self._pump_task, self._drain_task, *self._tasks]:
            if task is not None:
                with contextlib.suppress(BaseException):  # shutting down
                    await task
        self._pump_task = None

    def register_job(self, owner: str, job: PauseJob) -> None:
        """Register the work a pause performs once it holds the barrier (``save``,
        ``weights_load``, ``adapter``). The job returns its result dict or raises ApiError."""
        self._jobs[owner] = job

    # --- the timer pump ---------------------------------------------------------------------
    async def _pump(self) -> None:
        """Sleep until the core's next deadline (or a wake-up), then fire what is due."""
        while True:
            deadline = self.lifecycle.next_deadline()
            self._pump_deadline = deadline
            self._wake.clear()
            timeout = None if deadline is None else max(0.0, deadline - self.now())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            due = self.lifecycle.next_deadline()
            if due is None or due > self.now():
                continue  # woken for an earlier deadline, or a timer was cancelled
            async with self.lock:
                for out in self.lifecycle.fire_due(self.now()):
                    self._perform(out, {})
                    self._after_event(out)

    def _poke(self) -> None:
        """Wake the pump only when the earliest deadline moved earlier than the one it sleeps
        on (a later or cancelled deadline just costs the pump one early, empty wake-up)."""
        deadline = self.lifecycle.next_deadline()
        if deadline is not None and (self._pump_deadline is None or deadline < self._pump_deadline):
            self._pump_deadline = deadline
            self._wake.set()

    # --- the one entry point -------------------------------------------------------------------
    def decide(self, event: Event, params: dict[str, Any] | None = None) -> Outcome:
        """Handle ``event`` and perform its effects. The caller must hold :attr:`lock`."""
        out = self.lifecycle.handle(event, self.now())
        if out.kind == "accepted" and event.trigger in PAUSE_TRIGGERS:
            self._pending = asyncio.get_running_loop().create_future()
            self._pending_failure = None
            self._job_params = dict(params or {})
            self._job_result = {}
        outputs: dict[str, Any] = {}
        self._drained_now = False
        self._perform(out, outputs)
        self._after_event(out)
        if self._drained_now:
            self._drained_now = False
            self.decide(Event("drained"))
        self._last_outputs = outputs
        return out

    async def event(self, event: Event, params: dict[str, Any] | None = None) -> Outcome:
        """Lock, decide, perform (for internal completions and simple calls)."""
        async with self.lock:
            return self.decide(event, params)

    def _after_event(self, out: Outcome) -> None:
        self._sync_resident()
        self._poke()
        if self.metrics is not None and hasattr(self.metrics, "lifecycle_event"):
            self.metrics.lifecycle_event(out)

    def _sync_resident(self) -> None:
        """Mirror the core's served name, origin and commit count onto the resident (the
        ``X-miLLM-Model`` header reads them there)."""
        resident = self.host.resident
        if resident is None:
            return
        ctx = self.lifecycle.context
        if ctx.served_name is not None:
            resident.served_name = ctx.served_name
        if ctx.served_origin is not None:
            resident.origin = ctx.served_origin
        resident.commits = ctx.commits_since_name

    # --- effects ----------------------------------------------------------------------------
    def _perform(self, out: Outcome, outputs: dict[str, Any]) -> None:
        if out.kind != "accepted":
            return
        for effect in out.effects:
            self._effect(effect, out, outputs)

    def _effect(self, effect: Effect, out: Outcome, outputs: dict[str, Any]) -> None:
        sched = self.scheduler
        if effect is Effect.EXPORT_HANDLES:
            outputs["export"] = self._export()
        elif effect is Effect.RELEASE_EXPORTS:
            from miserver.ipc.export import reclaim

            reclaim()
            self.transport.ended()
        elif effect is Effect.HOLD_ADMISSIONS:
            sched.barrier_begin()
        elif effect is Effect.START_DRAIN:
            if sched.barrier_hold_if_drained():
                self._drained_now = True  # nothing runs: `drained` follows in this decision
            else:
                self._drain_task = self._spawn(self._drain())
        elif effect is Effect.CANCEL_DRAIN:
            if self._drain_task is not None and not self._drain_task.done():
                self._drain_task.cancel()
            self._drain_task = None
            sched.barrier_abandon()
        elif effect is Effect.DROP_CACHE:
            sched.drop_caches()
            self._decode_engine_effect(effect)
        elif effect is Effect.RELEASE_HELD:
            sched.barrier_release()
        elif effect is Effect.REFUSE_HELD_TORN:
            sched.fail_held(WeightsTornError(), priorities=(Priority.INTERACTIVE,))
        elif effect is Effect.ANSWER_PENDING:
            self._settle(out.pending or Answer(200))
        elif effect is Effect.FAIL_PENDING:
            self._settle(self._pending_failure or Answer(500, codes.INTERNAL_ERROR))
        elif effect in (Effect.BEGIN_SAVE, Effect.BEGIN_WEIGHTS_LOAD, Effect.BEGIN_ADAPTER_CHANGE):
            self._decode_engine_effect(effect)
            owner = {
                Effect.BEGIN_SAVE: "save",
                Effect.BEGIN_WEIGHTS_LOAD: "weights_load",
                Effect.BEGIN_ADAPTER_CHANGE: "adapter",
            }[effect]
            self._spawn(self._run_job(owner))
        elif effect in (Effect.START_MODEL_LOAD, Effect.START_MODEL_UNLOAD):
            self._decode_engine_effect(effect)
            # The row is bound now: a later event may set other parameters before the task runs.
            outputs["transition"] = self._spawn(
                self._run_transition(effect, dict(self._transition_params))
            )
        elif effect in (Effect.ADMIT, Effect.HOLD_REQUEST):
            outputs["admission"] = effect
        elif effect is Effect.APPLY_SETTINGS:
            outputs["apply_settings"] = True
        elif effect is Effect.ARM_RECEIVE:
            self.transport.arm()
        elif effect is Effect.DESTROY_GROUP:
            self.transport.destroy()
        elif effect in (
            Effect.RECORD_OVERRUN,
            Effect.RECORD_WATCHDOG,
            Effect.RECORD_HOLD_TIMEOUT,
            Effect.RECORD_STALE,
        ):
            log.warning("weights: %s", self._record_message(effect))
        else:  # pragma: no cover - a new effect the runtime does not know
            raise RuntimeError(f"unknown effect {effect}")

    def _record_message(self, effect: Effect) -> str:
        """The log line of a timer's or a late commit's record effect: what happened, and what
        to do (the on-call runbook, docs/operations.md, has the same advice)."""
        c = self.lifecycle.context
        who = f"attachment {c.attachment_label or '?'} (role {c.attachment_role or '?'})"
        st = self.settings
        if effect is Effect.RECORD_WATCHDOG:
            return (
                f"the commit of {who} stayed open longer than WEIGHTS_COMMIT_WATCHDOG_MS "
                f"({st.weights_commit_watchdog_ms:g} ms): the weights are torn, and every /v1 "
                "request is 503 weights_torn until recovered: by the trainer's late commit-end "
                "(recorded as an overrun) or by POST /api/weights/load with a checkpoint or "
                '{"model_id": N}. If the trainer\'s steps take this long, raise '
                "WEIGHTS_COMMIT_WATCHDOG_MS (on a CPU, 30000), and create the optimizer state "
                "before the first commit"
            )
        if effect is Effect.RECORD_HOLD_TIMEOUT:
            return (
                f"{who} quiesced but sent neither commit-begin nor resume within "
                f"WEIGHTS_HOLD_TIMEOUT_S ({st.weights_hold_timeout_s:g} s): serving resumed on "
                "its own, held requests were let through, and nothing was written. If the "
                "trainer needs longer between quiesce and commit-begin, raise "
                "WEIGHTS_HOLD_TIMEOUT_S"
            )
        if effect is Effect.RECORD_STALE:
            return (
                f"{who} sent no heartbeat for WEIGHTS_HEARTBEAT_TIMEOUT_S "
                f"({st.weights_heartbeat_timeout_s:g} s) and is stale. Serving continues; a new "
                "attach and every model load are refused until it heartbeats again or an "
                "operator clears it (POST /api/weights/clear-stale, operator token). Check "
                "whether the trainer process is still alive"
            )
        return (
            f"a commit-end from {who} came after the watchdog "
            f"(WEIGHTS_COMMIT_WATCHDOG_MS, {st.weights_commit_watchdog_ms:g} ms) had torn the "
            "set: the weights are clean again (GET /api/weights/status: last_overrun). If "
            "steps take this long, raise WEIGHTS_COMMIT_WATCHDOG_MS"
        )

    def _decode_engine_effect(self, effect: Effect) -> None:
        """What a lifecycle effect means for the resident's decode graphs (issue 13).

        The graphs replay kernels over the served storages, which never move: a commit, a save
        and an in-place weights load keep them (``BEGIN_SAVE``, ``BEGIN_WEIGHTS_LOAD``; a full
        reload makes a new resident, whose engine is new, and the old one is closed by the
        host). ``DROP_CACHE`` empties the static KV cache, the engine's only state between
        requests. An adapter change (``BEGIN_ADAPTER_CHANGE``) changes which modules compute,
        and a model transition (``START_MODEL_LOAD``, ``START_MODEL_UNLOAD``) the storages:
        their graphs are dropped, captured again at next use over the model of that time.
        """
        resident = self.host.resident
        engine = getattr(resident, "engine", None) if resident is not None else None
        if engine is None:
            return
        if effect is Effect.DROP_CACHE:
            engine.reset()
        elif effect in (
            Effect.BEGIN_ADAPTER_CHANGE,
            Effect.START_MODEL_LOAD,
            Effect.START_MODEL_UNLOAD,
        ):
            engine.invalidate()

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _settle(self, answer: Answer) -> None:
        if self._pending is not None and not self._pending.done():
            self._pending.set_result(answer)

    async def _drain(self) -> None:
        """Wait for the running forward passes, then report ``drained`` (the drain timer, a
        core deadline, decides a drain that takes too long)."""
        try:
            await self.scheduler.barrier_wait_drained()
        except asyncio.CancelledError:
            return
        async with self.lock:
            if self._drain_task is not asyncio.current_task():
                return  # cancelled in the meantime
            self._drain_task = None
            self.decide(Event("drained"))

    async def _run_job(self, owner: str) -> None:
        """Run a pause's work (save, weights load, adapter change) and report its end."""
        job = self._jobs.get(owner)
        done, failed = f"{owner}_done", f"{owner}_failed"
        try:
            if job is None:
                raise ApiError(codes.INTERNAL_ERROR, f"no {owner} job is registered")
            params = dict(self._job_params)
            params["mark_writing"] = self._mark_writing
            result = await job(params)
        except ApiError as err:
            async with self.lock:
                self._pending_failure = Answer(err.status, err.code, err.reason)
                self._job_result = {"error": err}
                self.decide(Event(failed))
            return
        except Exception as exc:  # noqa: BLE001 - any failure of the job is reported, not lost
            if is_disk_full(exc):  # one line, no traceback: 507 saying what to do (item 16)
                log.error("weights: the %s failed: the disk is full (%s)", owner, exc)
                err = disk_full_error(f"the {owner}", self.settings.home)
            else:
                log.exception("weights: the %s failed", owner)
                err = ApiError(codes.INTERNAL_ERROR, f"the {owner} failed: {exc}")
            async with self.lock:
                self._pending_failure = Answer(err.status, err.code, err.reason)
                self._job_result = {"error": err}
                self.decide(Event(failed))
            return
        async with self.lock:
            self._job_result = result
            self.decide(
                Event(
                    done,
                    name=result.get("served_name"),
                    applied=result.get("applied", True),
                    origin=result.get("origin"),
                    commits=result.get("commits"),
                )
            )

    async def _mark_writing(self) -> None:
        """A weights load is about to write: the set is ``writing`` from here (contract 5)."""
        await self.event(Event("weights_load_write"))

    async def _run_transition(self, effect: Effect, params: dict[str, Any]) -> Any:
        """Perform a model load or unload for the core and report its end.

        First the generations running on the resident finish: the scheduler takes every slot
        ahead of the queue (new ones are held) for at most WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S, the
        drain the weights page names for quiesce and the pauses. So an unload or swap answers
        once nothing runs on the old model, and a card never holds two models (contract 3).
        Then the host loads or unloads, and the slots are released after the core has seen
        the end (a request held meanwhile is then told its model changed, ``v1_confirm``).

        Raises:
            ApiError: 409 MODEL_BUSY ``drain_timeout`` when running generations did not finish
                in time (the table's ``transition_abandoned``: nothing loaded or unloaded),
                the host's own error (the table's ``transition_failed``).
        """
        timeout_s = self.settings.weights_quiesce_drain_timeout_s
        try:
            await self.scheduler.barrier_acquire(timeout_s)
        except BaseException as exc:
            async with self.lock:
                out = self.decide(Event("transition_abandoned"))
            if isinstance(exc, DrainTimeout) and out.pending is not None:
                raise self._drain_timeout_error(
                    out.pending, exc.running, "nothing was loaded or unloaded"
                ) from None
            raise
        try:
            try:
                if effect is Effect.START_MODEL_LOAD:
                    resident = await self.host.load(params["row_id"])
                    name, result = resident.served_name, resident
                    # The row's origin: a checkpoint row is origin=checkpoint (finding N4).
                    origin = resident.origin if resident.origin == "checkpoint" else "model"
                else:
                    result = await self.host.unload(params.get("row_id"))
                    name = origin = None
            except BaseException as exc:
                async with self.lock:
                    self.decide(Event("transition_failed"))
                if isinstance(exc, ApiError | asyncio.CancelledError):
                    raise
                raise ApiError(codes.INTERNAL_ERROR, f"the model transition failed: {exc}") from exc
            async with self.lock:
                self.decide(Event("transition_done", name=name, origin=origin))
            return result
        finally:
            self.scheduler.barrier_release()

    # --- export -----------------------------------------------------------------------------
    def _export(self) -> Any:
        resident = self.host.resident
        arena = getattr(resident, "arena", None)
        if resident is None or arena is None:  # the core checked attachability: a bug
            raise ApiError(codes.INTERNAL_ERROR, "the resident model has no parameter arena")
        body = self.transport.export(arena, resident.model)
        self.last_export = body
        if self.metrics is not None:
            self.metrics.pinned_bytes.set(body.release.pinned_bytes)
        return body

    def not_attachable_reason(self) -> str | None:
        """The resident's own NOT_ATTACHABLE reason (gguf, quantized, dtype, not_on_gpu,
        allocator), or None. The serving-wide reasons are the core's."""
        from miserver.ipc.arena import parameter_devices, parameter_dtypes
        from miserver.ipc.attachability import not_attachable_reason

        resident = self.host.resident
        if resident is None:
            return None
        row = resident.row
        reason = not_attachable_reason(
            fmt=row.format,
            quantization=row.quantization,
            param_dtypes=parameter_dtypes(resident.model),
            devices=parameter_devices(resident.model),
            arena=getattr(resident, "arena", None),
            continuous_batching=False,
            max_concurrent=1,
            model_transition=False,
            weights_writing=False,
            cpu_attach=self.settings.weights_cpu_attach,
        )
        return (
            reason if reason in ("gguf", "quantized", "dtype", "not_on_gpu", "allocator") else None
        )

    def check_addresses(self, *, full: bool = False) -> list[str]:
        """Compare every parameter's address with the export; a move tears the set
        (weights page: States). ``full`` also walks the module tree (new parameters); the
        per-commit check reads the recorded parameters only. Call under :attr:`lock`."""
        from miserver.ipc.export import moved_parameters, moved_parameters_fast

        resident = self.host.resident
        arena = getattr(resident, "arena", None) if resident is not None else None
        if arena is None or self.lifecycle.state.attachment == "none":
            return []
        moved = (
            moved_parameters(arena, resident.model)
            if full or not arena.watch
            else moved_parameters_fast(arena)
        )
        if moved:
            log.error("weights: %d parameter(s) moved since export: %s", len(moved), moved[:3])
            self.decide(Event("address_moved"))
        return moved

    # --- gated calls (the weights routes) ------------------------------------------------------
    async def gated(
        self,
        trigger: str,
        caller: Caller,
        attachment_header: str | None,
        *,
        operation: str | None,
        params: dict[str, Any] | None = None,
        **event_fields: Any,
    ) -> CallResult:
        """Run one gated call: decide under the lock, wait for a pause it started, audit.

        Raises :class:`ApiError` with the table's code, reason and status on a refusal (401s
        carry ``WWW-Authenticate: Bearer``). Weights page: Authentication; The write cycle.
        ``operation`` names the audit line; None for an ungated call (an adapter change).
        """
        fsm_caller = FsmCaller(
            token=caller.token,
            label=caller.label,  # type: ignore[arg-type]
            attachment_id=attachment_header,
        )
        if trigger == "commit_end" and self.transport.receive is not None:
            # contract 10: commit-end answers once the receive completed (or failed, or the
            # watchdog passed); the table decides what that means (received=False)
            event_fields.setdefault(
                "received",
                await self.transport.wait_received(
                    self.lifecycle.context.watchdog_deadline, self.now()
                ),
            )
        async with self.lock:
            before = self.lifecycle.state.weights
            ref = attachment_ref(self.lifecycle.context.attachment_id)
            if trigger == "commit_end":  # the write happened inside this bracket
                self.check_addresses()
            elif trigger == "detach":
                self.check_addresses(full=True)
            if trigger == "attach":
                event_fields.setdefault("not_attachable", self.not_attachable_reason())
            if trigger == "quiesce":
                event_fields.setdefault("queue_full", self._queue_full())
            if trigger == "attach":
                self.transport.requested = (params or {}).get("group_spec")
            elif trigger == "commit_begin":
                body = (params or {}).get("body")
                self.transport.check_ranges(getattr(body, "ranges", None))
                event_fields.setdefault("group_ok", self.transport.group_usable())
            out = self.decide(Event(trigger, caller=fsm_caller, **event_fields), params)
            if trigger == "commit_end" and out.kind == "accepted":
                self.transport.commit_ended()
            outputs = self._last_outputs
            pending = (
                self._pending if (out.kind == "accepted" and trigger in PAUSE_TRIGGERS) else None
            )
            if trigger == "attach" and out.kind == "accepted":
                ref = attachment_ref(self.lifecycle.context.attachment_id)
        if out.kind == "refused":
            self._audit(operation, out, caller, ref, before, refused=True)
            headers = {}
            message = out.message
            if out.code is codes.WEIGHTS_UNAUTHORIZED:
                headers["WWW-Authenticate"] = "Bearer"
                if not self.settings.weights_tokens:  # say where the fault is: the server
                    message += (
                        " This server has no tokens configured (WEIGHTS_TOKENS is empty), so"
                        " every gated call is refused; set it and restart the server."
                    )
            if out.retry_after:
                headers["Retry-After"] = str(RETRY_AFTER_S)
            message, details = self._with_numbers(out, message)
            raise ApiError(
                out.code,
                message,
                reason=out.reason,  # type: ignore[arg-type]
                details=details,
                status=out.status,
                headers=headers,
            )
        answer: Answer | None = None
        if pending is not None:
            answer = await asyncio.shield(pending)
        result = CallResult(
            out,
            answer,
            outputs,
            before,
            self.lifecycle.state.weights,
            dict(self._job_result) if pending is not None else {},
        )
        if answer is not None and answer.code is not None:
            self._audit(operation, out, caller, ref, before, refused=True, answer=answer)
            err = self._job_result.get("error") if isinstance(self._job_result, dict) else None
            if isinstance(err, ApiError):
                raise err
            if answer.code is codes.MODEL_BUSY and answer.reason == "drain_timeout":
                running = self.scheduler.counts().running
                raise self._drain_timeout_error(answer, running, "nothing is held")
            message = out.message or answer.code.name
            raise ApiError(answer.code, message, reason=answer.reason, status=answer.status)
        self._audit(operation, out, caller, ref, before, refused=False)
        return result

    def _drain_timeout_error(self, answer: Answer, running: int, outcome: str) -> ApiError:
        """409 MODEL_BUSY ``drain_timeout`` of a quiesce, a pause or a model transition, worded
        alike (weights page, The write cycle 2): how many requests still ran, the timeout, what
        was left unchanged (``outcome``) and what to do; ``details`` carries the numbers."""
        timeout_s = self.settings.weights_quiesce_drain_timeout_s
        return ApiError(
            answer.code or codes.MODEL_BUSY,
            f"{running} running request(s) did not finish within "
            f"WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S ({timeout_s:g} s); {outcome}. Retry when they end.",
            reason=answer.reason,
            status=answer.status,
            details={"running": running, "drain_timeout_s": timeout_s},
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    def _with_numbers(self, out: Outcome, message: str) -> tuple[str, dict[str, Any] | None]:
        """A refusal's message and wire details, with the numbers a reader needs: for 503
        QUEUE_FULL (a quiesce or a held ``/v1`` request) the bound and how many wait, worded
        as the scheduler's own ``/v1`` refusal (issue 16 item 12)."""
        details = self._wire_details(out.details)
        if out.code is codes.QUEUE_FULL:
            bound = self.scheduler.max_queued
            waiting = self.scheduler.interactive_waiting()
            message = (
                f"The request queue is full: MAX_QUEUED_REQUESTS ({bound}) interactive requests"
                f" are already waiting ({waiting} now); retry after Retry-After seconds."
            )
            details = {**(details or {}), "max_queued_requests": bound, "waiting": waiting}
        elif out.code is codes.GROUP_UNAVAILABLE:
            group = self.transport.describe() or {}
            state, error = group.get("group_state"), group.get("error")
            message = f"{message} The group is {state}" + (f": {error}" if error else ".")
            details = {**(details or {}), "group_state": state, "error": error}
        return message, details

    def _queue_full(self, priority: Priority = Priority.INTERACTIVE) -> bool:
        """The ``queue_full`` fact of a quiesce or a ``/v1`` request at ``priority``.

        MAX_QUEUED_REQUESTS bounds the interactive requests that wait, queued for a slot or
        held by the barrier (contract 1); batch chunks wait outside that bound (contract 7: a
        batch row waits, it is never refused for a full queue), so they neither count toward
        it nor are refused by it.
        """
        if priority != Priority.INTERACTIVE:
            return False
        return self.scheduler.interactive_waiting() >= self.scheduler.max_queued

    def _wire_details(self, details: dict[str, Any]) -> dict[str, Any] | None:
        if not details:
            return None
        out = dict(details)
        holder = out.get("holder")
        if isinstance(holder, dict):
            out["holder"] = {**holder, "attached_at": self.stamp(holder.get("attached_at"))}
        return out

    def _audit(
        self,
        operation: str,
        out: Outcome,
        caller: Caller,
        ref: str | None,
        before: str,
        *,
        refused: bool,
        answer: Answer | None = None,
    ) -> None:
        if operation is None:
            return
        code = answer.code if answer is not None else out.code
        reason = answer.reason if answer is not None else out.reason
        if (
            refused
            and code in (codes.WEIGHTS_UNAUTHORIZED, codes.WEIGHTS_FORBIDDEN)
            and operation in ("save", "load")
        ):
            operation = f"weights_{operation}"
        elapsed = steps = None
        if operation == "weights_commit_end" and not refused:
            elapsed = out.details.get("commit_ms")
            if elapsed is not None:
                elapsed = round(elapsed, 3)  # as the commit-end answer rounds it
            steps = out.details.get("steps_since_load")
        resident = self.host.resident
        self.audit.write_soon(  # after the response is on its way; see AuditLog.write_soon
            AuditRecord(
                operation=operation,
                outcome="refused" if refused else "accepted",
                code=code.name if code is not None else None,
                reason=reason,
                role=caller.role,
                label=caller.label,
                attachment_ref=ref,
                model=resident.base_name if resident is not None else None,
                weights_state=self.lifecycle.state.weights,
                weights_state_before=before,
                elapsed_ms=elapsed,
                steps=steps,
                transport=self.transport.name,
            )
        )

    # --- management loads and /v1 admission ------------------------------------------------

    def _target(self, row_id: int | None, *, check: bool = True) -> bool:
        """Whether ``row_id`` names the resident row. A row that does not exist or cannot be
        loaded is refused here, before the lifecycle sees the load (404 MODEL_NOT_FOUND,
        400 BACKEND_UNAVAILABLE), so a started load fails only for a real load error."""
        from miserver.serving.loader import check_loadable

        resident = self.host.resident
        if row_id is None:
            return True
        if resident is not None and resident.row.id == row_id:
            return True
        if resident is None and getattr(self.host, "replacing_row_id", None) == row_id:
            return True  # the row a running swap or unload replaces: resident until it ends
        row = self.host.catalogue.get(row_id)
        if row is None:
            raise ApiError(
                codes.MODEL_NOT_FOUND,
                f"no catalogue row with id {row_id}",
                details={"model_id": row_id},
            )
        if check:
            check_loadable(row)
        return False

    async def model_transition(self, kind: str, row_id: int | None) -> Any:
        """A management load (``model_load``) or unload (``model_unload``) of ``row_id``;
        waits for it and returns what the host returned (the resident, or the unloaded row).

        Raises ApiError with the table's refusal (contract 3), or the load's own error.
        """
        if kind == "model_load":
            targets_resident = self._target(row_id)
        else:
            targets_resident = True
            row = self.host.catalogue.get(row_id) if row_id is not None else None
            if row_id is not None and row is None:
                raise ApiError(
                    codes.MODEL_NOT_FOUND,
                    f"no catalogue row with id {row_id}",
                    details={"model_id": row_id},
                )
            resident = self.host.resident
            idle = not self.host.busy and self.lifecycle.state.transition == "none"
            if row is not None and idle and (resident is not None and resident.row.id != row.id):
                # Refused before any drain: an unload of a row that is not resident cannot
                # succeed, and draining for it would stall /v1 for nothing (issue 16, item 6).
                # Nothing resident at all is the table's refusal (MODEL_NOT_LOADED), also
                # before any drain.
                raise ApiError(
                    codes.MODEL_NOT_LOADED,
                    f"catalogue row {row.name!r} is not resident; the resident model is "
                    f"{resident.row.name!r} (id {resident.row.id})",
                    status=409,
                    details={"resident_id": resident.row.id},
                )
        async with self.lock:
            self._transition_params = {"row_id": row_id}
            out = self.decide(Event(kind, target="resident" if targets_resident else "other"))
            task = self._last_outputs.get("transition")
        if out.kind == "refused":
            raise self._refusal(out)
        if task is not None:
            return await task
        return self.host.resident

    async def admit_v1(
        self,
        *,
        refuse_policy: bool,
        row_id: int | None,
        priority: Priority = Priority.INTERACTIVE,
    ) -> Resident:
        """Decide a ``/v1`` request (contract 4) and return the resident it is admitted for.

        ``row_id``: the catalogue row the request names, or ``None`` when it names the resident
        (served or base name). ``priority``: the scheduler priority it will wait at
        (``Priority.BATCH`` for Batch API rows: never refused 503 QUEUE_FULL).

        The table's ``v1`` rows decide: run it, hold it (the scheduler then holds it), refuse,
        or auto-load the named row. An auto-load is awaited; then the table's ``v1_confirm``
        rows decide again, told whether the row it loaded is still the resident.

        Raises:
            ApiError: the table's refusal (409 MODEL_NOT_LOADED / ALREADY_ATTACHED /
                WEIGHTS_UNSAVED / MODEL_BUSY, 503 WEIGHTS_TORN / QUEUE_FULL; 409 MODEL_BUSY
                ``model_transition`` with ``Retry-After`` when the model changed while the
                request waited for its auto-load), 404 MODEL_NOT_FOUND and 400
                BACKEND_UNAVAILABLE for a row that cannot be loaded, or the auto-load's own
                error.
        """
        # The refuse policy refuses any swap first (weights page: Unsaved commits), before a
        # check of whether the row could be loaded at all.
        targets_resident = row_id is None or self._target(row_id, check=not refuse_policy)
        async with self.lock:
            self._transition_params = {"row_id": row_id}
            out = self.decide(
                Event(
                    "v1",
                    target="resident" if targets_resident else "other",
                    refuse_policy=refuse_policy,
                    queue_full=self._queue_full(priority),
                )
            )
            task = self._last_outputs.get("transition")
            resident = self.host.resident
        if out.kind == "refused":
            raise self._refusal(out)
        if task is None and resident is not None:
            return resident
        if task is not None:
            await task  # the auto-load; its own error propagates
            resident = self.host.resident
            if resident is not None and resident.row.id != row_id:
                resident = None  # another model is resident now, not the row it loaded
        await self.confirm_v1(resident)
        assert resident is not None  # confirmed: it is the resident
        return resident

    async def confirm_v1(
        self, resident: Resident | None, *, adapter: dict[str, Any] | None = None
    ) -> None:
        """A ``/v1`` request admitted for ``resident`` has waited (for its scheduler slot, or
        for its auto-load) and is about to go on: the table's ``v1_confirm`` rows decide, told
        whether ``resident`` is still the resident (``None``: it is known not to be).

        ``adapter``: the adapter block the request was admitted for when it named the applied
        adapter; the resident is then the same only while that application is still applied
        (the adapter removed or replaced meanwhile is a model that went away, issue 16 item 8).

        Inside the slot a pause that began meanwhile waits for this request (it holds a slot),
        so a hold is an acceptance there.

        Raises:
            ApiError: 409 MODEL_BUSY ``model_transition`` with ``Retry-After`` (the model was
                unloaded or changed while the request waited), 503 WEIGHTS_TORN (the set tore),
                409 MODEL_BUSY ``model_transition`` (a model transition is in progress).
        """
        async with self.lock:
            same = resident is not None and self.host.resident is resident
            if same and adapter is not None:
                same = resident.adapter_block is adapter
            out = self.decide(Event("v1_confirm", same_resident=same))
        if out.kind == "refused":
            raise self._refusal(out)

    async def settings_change(self, avail: str) -> Outcome:
        """PATCH /api/settings: the resulting pause availability goes through the table."""
        async with self.lock:
            out = self.decide(Event("settings_change", avail=avail))  # type: ignore[arg-type]
        if out.kind == "refused":
            raise self._refusal(out)
        return out

    def _refusal(self, out: Outcome) -> ApiError:
        headers = {}
        if out.retry_after:
            headers["Retry-After"] = str(RETRY_AFTER_S)
        message, details = self._with_numbers(out, out.message)
        return ApiError(
            out.code,
            message,
            reason=out.reason,  # type: ignore[arg-type]
            details=details,
            status=out.status,
            headers=headers,
        )

    # --- views ----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """GET /api/weights/status (weights page: Status). No token, no slot, no secret."""
        from miserver.ipc.export import cuda_memory, exports_since_start

        view = self.lifecycle.status_view(self.now())
        resident = self.host.resident
        att = view["attachment"]
        if att is not None:
            att = {
                **att,
                "attached_at": self.stamp(att["attached_at"]),
                "last_heartbeat_at": self.stamp(att["last_heartbeat_at"]),
                "stale_since": self.stamp(att["stale_since"]),
                "transport": self.transport.name,
                "process_group": self.transport.describe(),
            }
        commit = view["commit"]
        if commit is not None:
            commit = {
                **commit,
                "began_at": self.stamp(commit["began_at"]),
                "open_ms": round(commit["open_ms"] or 0.0, 3),
            }
        overrun = view["last_overrun"]
        if overrun is not None:
            overrun = {"at": self.stamp(overrun["at"]), "commit_ms": round(overrun["commit_ms"], 3)}
        counts = self.scheduler.counts()
        return {
            "attached": view["attached"],
            "attachment": att,
            "barrier": view["barrier"],
            "quiesced_at": self.stamp(view["quiesced_at"]),
            "held_requests": None if view["barrier"] == "serving" else counts.held_interactive,
            "weights_state": view["weights_state"],
            "resident_model": self.model_ref(),
            "steps_since_load": view["steps_since_load"] if resident is not None else None,
            "last_save": self.last_save,
            "commit": commit,
            "commit_overran": self.stamp(view["commit_overran"]),
            "last_hold_timeout_at": self.stamp(view["last_hold_timeout_at"]),
            "last_overrun": overrun,
            "pause_unavailable": view["pause_unavailable"],
            "adapter": self.adapter_block(),
            "cuda_memory": _with_decode_memory(cuda_memory(), resident),
            "exports_since_start": exports_since_start(),
        }

    def model_ref(self) -> dict[str, Any] | None:
        """``{model_id, name, manifest_hash}`` of the resident (the base model's served name)."""
        resident = self.host.resident
        if resident is None:
            return None
        row = resident.row
        return {
            "model_id": row.id,
            "name": resident.base_name,
            "manifest_hash": getattr(row, "checkpoint_sha256", None),
        }

    def adapter_block(self) -> dict[str, Any] | None:
        resident = self.host.resident
        block = resident.adapter_block if resident is not None else None
        return block if block is not None else {"applied": False}

    def summary(self) -> dict[str, Any]:
        """The short weights block of /api/health/detailed (weights page: Status)."""
        view = self.lifecycle.status_view(self.now())
        att = view["attachment"]
        return {
            "weights_state": view["weights_state"],
            "barrier": view["barrier"],
            "attached": view["attached"],
            "attachment_state": att["state"] if att is not None else None,
        }


def _with_decode_memory(
    cards: list[dict[str, Any]] | None, resident: Any
) -> list[dict[str, Any]] | None:
    """``cuda_memory`` with the resident's decode engine on its card: the static KV cache and
    the graphs' private pool, MiB with 3 decimals (issue 13: memory is visible)."""
    engine = getattr(resident, "engine", None) if resident is not None else None
    if cards is None or engine is None or engine.closed:
        return cards
    index = engine.device.index or 0
    for card in cards:
        if card["device_index"] == index:
            card["decode_cache_mb"] = round(engine.stats.cache_bytes / 2**20, 3)
            card["decode_graphs_mb"] = round(engine.stats.graph_pool_bytes / 2**20, 3)
    return cards
