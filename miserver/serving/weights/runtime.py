"""The weights runtime: drives the lifecycle core and performs its effects on the server.

The handlers of ``/api/weights/*``, the management loads and ``/v1`` admission all come here.
Each call follows one shape (design notes, "Verified facts about transitions"):

1. build an :class:`~miserver.fsm.state.Event` from the request (the caller's token, label and
   ``X-miLLM-Attachment`` header; facts such as a full queue);
2. under one ``asyncio.Lock``, let :meth:`~miserver.fsm.machine.Lifecycle.handle` decide and
   perform the outcome's effects in order (:meth:`EffectPerformer.perform
   <miserver.serving.weights.effects.EffectPerformer.perform>`);
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miserver.fsm.machine import Lifecycle, Outcome
from miserver.fsm.state import Caller as FsmCaller
from miserver.fsm.state import Event
from miserver.fsm.table import Answer
from miserver.serving.audit import AuditLog, AuditRecord
from miserver.serving.auth import Caller, attachment_ref
from miserver.serving.engine.slot import Priority
from miserver.serving.weights.admission import AdmissionGate
from miserver.serving.weights.effects import EffectPerformer, PauseJob, decode_engine_effect
from miserver.serving.weights.refusals import Refusals
from miserver.serving.weights.transport import AttachmentTransport
from miserver.serving.weights.views import StatusViews
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


__all__ = ["PAUSE_TRIGGERS", "CallResult", "PauseJob", "WeightsRuntime", "rfc3339"]


class WeightsRuntime:
    """One process's weights lifecycle, bound to its scheduler and model host.

    This class holds the core of the runtime: the lock, the one entry point (:meth:`decide`),
    the timer pump, the gated calls of the weights routes and their audit lines. It is composed
    of four collaborators, each owning its state, built here with what they touch:

    - :attr:`effects`, an :class:`~miserver.serving.weights.effects.EffectPerformer`: performs
      the effects (owns the pending answer, the jobs, the drain and spawned tasks);
    - :attr:`admission`, an :class:`~miserver.serving.weights.admission.AdmissionGate`:
      management loads and unloads and ``/v1`` admission;
    - :attr:`refusals`, :class:`~miserver.serving.weights.refusals.Refusals`: the wording of
      refusals;
    - :attr:`views`, :class:`~miserver.serving.weights.views.StatusViews`: the status views.

    The public methods the handlers call (``admit_v1``, ``status``, ...) delegate to them.

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
        self._pump_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._pump_deadline: float | None = None
        #: The last save's block of ``GET /api/weights/status`` (the save job writes it).
        self.last_save: dict[str, Any] | None = None
        #: The attachment's transport and its process group (contract 10).
        self.transport = AttachmentTransport(
            join_timeout_s=settings.weights_heartbeat_timeout_s,
            op_timeout_s=settings.weights_commit_watchdog_ms / 1000.0,
            metrics=metrics,
        )
        self.refusals = Refusals(
            settings=settings, scheduler=scheduler, transport=self.transport, stamp=self.stamp
        )
        self.effects = EffectPerformer(
            settings=settings,
            scheduler=scheduler,
            host=host,
            transport=self.transport,
            lifecycle=self.lifecycle,
            lock=self.lock,
            decide=self._decide_late,
            refusals=self.refusals,
            metrics=metrics,
        )
        self.admission = AdmissionGate(
            host=host,
            lifecycle=self.lifecycle,
            lock=self.lock,
            decide=self._decide_late,
            effects=self.effects,
            refusals=self.refusals,
        )
        self.views = StatusViews(
            lifecycle=self.lifecycle,
            host=host,
            scheduler=scheduler,
            transport=self.transport,
            now=self.now,
            stamp=self.stamp,
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
        tasks = [self._pump_task, self.effects.drain_task, *self.effects.tasks]
        for task in tasks:
            if task is not None and not task.done():
                task.cancel()
        for task in tasks:
            if task is not None:
                with contextlib.suppress(BaseException):  # shutting down
                    await task
        self._pump_task = None

    def register_job(self, owner: str, job: PauseJob) -> None:
        """Register the work a pause performs once it holds the barrier (``save``,
        ``weights_load``, ``adapter``). The job returns its result dict or raises ApiError."""
        self.effects.jobs[owner] = job

    @property
    def _jobs(self) -> dict[str, PauseJob]:
        """The registered pause jobs, by owner (kept by :attr:`effects`)."""
        return self.effects.jobs

    @property
    def last_export(self) -> Any:
        """The last attach's export body (kept by :attr:`effects`)."""
        return self.effects.last_export

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
                    self.effects.perform(out, {})
                    self._after_event(out)

    def _poke(self) -> None:
        """Wake the pump only when the earliest deadline moved earlier than the one it sleeps
        on (a later or cancelled deadline just costs the pump one early, empty wake-up)."""
        deadline = self.lifecycle.next_deadline()
        if deadline is not None and (self._pump_deadline is None or deadline < self._pump_deadline):
            self._pump_deadline = deadline
            self._wake.set()

    # --- the one entry point -------------------------------------------------------------------
    def _decide_late(self, event: Event, params: dict[str, Any] | None = None) -> Outcome:
        """The collaborators' way to :meth:`decide`: looked up at each call, so that whatever
        stands in ``self.decide`` (a test's spy, a wrapper) sees every decision."""
        return self.decide(event, params)

    def decide(self, event: Event, params: dict[str, Any] | None = None) -> Outcome:
        """Handle ``event`` and perform its effects. The caller must hold :attr:`lock`."""
        effects = self.effects
        out = self.lifecycle.handle(event, self.now())
        if out.kind == "accepted" and event.trigger in PAUSE_TRIGGERS:
            effects.open_pending(params)
        outputs: dict[str, Any] = {}
        effects.drained_now = effects.fence_failed_now = False
        effects.perform(out, outputs)
        self._after_event(out)
        if effects.fence_failed_now:  # FENCE_ARENA could not move the set (issue 32 item 8)
            effects.fence_failed_now = False
            self.decide(Event("fence_failed"))
        if effects.drained_now:
            effects.drained_now = False
            self.decide(Event("drained"))
        effects.last_outputs = outputs
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

    # --- delegated to the collaborators (the handlers and tests call these) ----------------------
    async def model_transition(self, kind: str, row_id: int | None) -> Any:
        """See :meth:`AdmissionGate.model_transition
        <miserver.serving.weights.admission.AdmissionGate.model_transition>`."""
        return await self.admission.model_transition(kind, row_id)

    async def admit_v1(
        self,
        *,
        refuse_policy: bool,
        row_id: int | None,
        priority: Priority = Priority.INTERACTIVE,
    ) -> Any:
        """See :meth:`AdmissionGate.admit_v1
        <miserver.serving.weights.admission.AdmissionGate.admit_v1>`."""
        return await self.admission.admit_v1(
            refuse_policy=refuse_policy, row_id=row_id, priority=priority
        )

    async def confirm_v1(
        self, resident: Any, *, adapter: dict[str, Any] | None = None, model: str | None = None
    ) -> Any:
        """See :meth:`AdmissionGate.confirm_v1
        <miserver.serving.weights.admission.AdmissionGate.confirm_v1>`."""
        return await self.admission.confirm_v1(resident, adapter=adapter, model=model)

    async def wait_reloaded(self, deadline: float) -> None:
        """See :meth:`AdmissionGate.wait_reloaded
        <miserver.serving.weights.admission.AdmissionGate.wait_reloaded>`."""
        await self.admission.wait_reloaded(deadline)

    def catalogue_delete(self, row_id: int, name: str) -> None:
        """See :meth:`AdmissionGate.catalogue_delete
        <miserver.serving.weights.admission.AdmissionGate.catalogue_delete>` (told
        :attr:`loads_checking`)."""
        self.admission.catalogue_delete(row_id, name, loads_checking=self.loads_checking)

    async def settings_change(self, avail: str) -> Outcome:
        """See :meth:`AdmissionGate.settings_change
        <miserver.serving.weights.admission.AdmissionGate.settings_change>`."""
        return await self.admission.settings_change(avail)

    def status(self) -> dict[str, Any]:
        """GET /api/weights/status: :meth:`StatusViews.status
        <miserver.serving.weights.views.StatusViews.status>` with :attr:`last_save`."""
        return self.views.status(self.last_save)

    def summary(self) -> dict[str, Any]:
        """The weights block of /api/health/detailed (:attr:`views`)."""
        return self.views.summary()

    def model_ref(self) -> dict[str, Any] | None:
        """``{model_id, name, manifest_hash}`` of the resident (:attr:`views`)."""
        return self.views.model_ref()

    def adapter_block(self) -> dict[str, Any] | None:
        """The applied adapter's block, or ``{"applied": False}`` (:attr:`views`)."""
        return self.views.adapter_block()

    def not_attachable_reason(self) -> str | None:
        """The resident's own NOT_ATTACHABLE reason, or None (:attr:`effects`)."""
        return self.effects.not_attachable_reason()

    def gguf_facts(self) -> dict[str, Any]:
        """The ``resident_gguf`` fact of a save, a weights load or an adapter change, with the
        resident's row (``model_id``, ``name``) the table's GGUF_UNSUPPORTED names (contract
        4a): ``{}`` unless the resident is a GGUF file served by llama.cpp. A handler that
        skips its body's checks on a GGUF resident passes these facts to :meth:`gated`, so the
        table decides on what the handler saw."""
        resident = self.host.resident
        row = getattr(resident, "row", None)
        if getattr(row, "format", None) != "gguf":
            return {}
        return {"resident_gguf": True, "model_id": row.id, "name": row.name}

    def check_addresses(self, *, full: bool = False) -> list[str]:
        """The address check of the export (:attr:`effects`); call under :attr:`lock`."""
        return self.effects.check_addresses(full=full)

    def _decode_engine_effect(self, effect: Any) -> None:
        """:func:`~miserver.serving.weights.effects.decode_engine_effect` on :attr:`host`."""
        decode_engine_effect(self.host, effect)

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
            if trigger in ("save", "adapter_change") or (
                trigger == "weights_load" and event_fields.get("checkpoint_load", True)
            ):
                for key, value in self.gguf_facts().items():
                    event_fields.setdefault(key, value)
            if trigger == "quiesce":
                event_fields.setdefault("queue_full", self.refusals.queue_full())
                event_fields.setdefault("hold_supported", self.effects.can_park())
            if trigger == "attach":
                self.transport.requested = (params or {}).get("group_spec")
            elif trigger == "commit_begin":
                body = (params or {}).get("body")
                self.transport.check_ranges(getattr(body, "ranges", None))
                event_fields.setdefault("group_ok", self.transport.group_usable())
            out = self.decide(Event(trigger, caller=fsm_caller, **event_fields), params)
            if trigger == "commit_end" and out.kind == "accepted":
                self.transport.commit_ended()
            outputs = self.effects.last_outputs
            pending = (
                self.effects.pending
                if (out.kind == "accepted" and trigger in PAUSE_TRIGGERS)
                else None
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
            raise self.refusals.refusal(out, message, headers)
        answer: Answer | None = None
        if pending is not None:
            answer = await asyncio.shield(pending)
        result = CallResult(
            out,
            answer,
            outputs,
            before,
            self.lifecycle.state.weights,
            dict(self.effects.job_result) if pending is not None else {},
        )
        if answer is not None and answer.code is not None:
            self._audit(operation, out, caller, ref, before, refused=True, answer=answer)
            job_result = self.effects.job_result
            err = job_result.get("error") if isinstance(job_result, dict) else None
            if isinstance(err, ApiError):
                raise err
            if answer.code is codes.MODEL_BUSY and answer.reason == "drain_timeout":
                running = self.scheduler.running_requests()
                raise self.refusals.drain_timeout_error(answer, running, "nothing is held")
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
