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
from typing import Any

from miserver.fsm.machine import Lifecycle, Outcome
from miserver.fsm.state import Caller as FsmCaller
from miserver.fsm.state import Event
from miserver.fsm.table import Answer
from miserver.serving.audit import AuditLog, AuditRecord
from miserver.serving.auth import Caller, attachment_ref
from miserver.serving.weights.admission import AdmissionMixin
from miserver.serving.weights.effects import EffectsMixin
from miserver.serving.weights.refusals import RefusalsMixin
from miserver.serving.weights.transport import AttachmentTransport
from miserver.serving.weights.views import StatusViewsMixin
from miserver.spec import codes
from miserver.spec.errors import ApiError
from miserver.spec.settings import Settings

log = logging.getLogger("miserver.weights")

#: The triggers whose accepted call waits for the pause it started to settle.
PAUSE_TRIGGERS = frozenset({"quiesce", "save", "weights_load", "adapter_change"})


def rfc3339(t: float | None) -> str | None:
    """A wall-clock time (seconds since the epoch) as an RFC 3339 UTC string, ms precision."""
    if t is None:
        return None
    return (
        _dt.datetime.fromtimestamp(t, _dt.UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
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


class WeightsRuntime(EffectsMixin, AdmissionMixin, RefusalsMixin, StatusViewsMixin):
    """One process's weights lifecycle, bound to its scheduler and model host.

    This module holds the core of the runtime: the lock, the one entry point (:meth:`decide`),
    the timer pump, the gated calls of the weights routes and their audit lines. The effects
    (:mod:`~miserver.serving.weights.effects`), management loads and ``/v1`` admission
    (:mod:`~miserver.serving.weights.admission`), the wording of refusals
    (:mod:`~miserver.serving.weights.refusals`) and the status views
    (:mod:`~miserver.serving.weights.views`) are mixed in from their modules.

    Args:
        settings: the validated configuration (timers, tokens, audit log path).
        scheduler: :class:`miserver.serving.engine.slot.Scheduler` (the slots and the barrier).
        host: :class:`miserver.serving.models.host.ModelHost` (the resident model).
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
            # Woken by ``_wake`` (``_poke``) or at the deadline: a timer that sets the same
            # event, not ``asyncio.wait_for``, which makes a task of every wait.
            timer = None
            if timeout is not None:
                timer = asyncio.get_running_loop().call_later(timeout, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                if timer is not None:
                    timer.cancel()
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
        ``operation`` names the audit line (None: no line).
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
            raise self._refusal(out, message, headers)
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
                running = self.scheduler.running_requests()
                raise self._drain_timeout_error(answer, running, "nothing is held")
            message = out.message or answer.code.name
            raise ApiError(answer.code, message, reason=answer.reason, status=answer.status)
        self._audit(operation, out, caller, ref, before, refused=False)
        return result

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
