"""The sans-IO core of the weights lifecycle: events in, an outcome with effects out.

No I/O, no clock reads, no asyncio: every input carries ``now`` (seconds on one monotonic clock
the caller chooses), and timers are deadlines kept in the state.

How an HTTP handler drives it (the lead's issue 5)::

    lifecycle = Lifecycle.from_settings(settings, resident=True)
    lock = asyncio.Lock()

    async def quiesce(request):
        caller = Caller(token=role_or_none_or_invalid, label=label,
                        attachment_id=request.headers.get("X-miLLM-Attachment"))
        async with lock:                                   # decide -> apply, serialised
            out = lifecycle.handle(Event("quiesce", caller=caller,
                                         queue_full=scheduler.full()), time.monotonic())
            pending = runtime.perform(out)                # START_DRAIN, HOLD_ADMISSIONS, ...
        if not out.accepted:
            raise ApiError(out.code, out.message, reason=out.reason, details=out.details,
                           status=out.status)
        answer = await pending                            # resolved by `drained` / drain_expired
        ...

    # the scheduler reports completions as events:
    async with lock:
        runtime.perform(lifecycle.handle(Event("drained"), time.monotonic()))

    # the timer pump: sleep until next_deadline(), then fire what is due:
    while True:
        deadline = lifecycle.next_deadline()
        await wait_until(deadline)                        # or until woken by a new event
        async with lock:
            for out in lifecycle.fire_due(time.monotonic()):
                runtime.perform(out)

``Outcome.effects`` are performed in order; ``Outcome.pending`` is the answer for the call that
is waiting on a pause (a quiesce waiting for its drain is answered 200 by ``drained`` or 409
MODEL_BUSY drain_timeout by ``drain_expired``). A refused outcome changed nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Any, Literal

from miserver.fsm.compiled import Compiled, TableError, compile_table
from miserver.fsm.context import Context, Provenance
from miserver.fsm.messages import _MESSAGES, _REASON_MESSAGES, refusal_message
from miserver.fsm.plan import (
    _ATTACHMENT_SLOTS,
    _BEGAN_AT,
    _CONTEXT_INDEX,
    _QUIESCED_AT,
    _SLOT_SETTERS,
    _TIMED_OUT,
    _TORN_AT,
    _context_values,
    _evolve_context,
    _Plan,
    _timer_settings,
)
from miserver.fsm.state import NAMED, TIMERS, Event, LifecycleState
from miserver.fsm.table import TABLE, Answer, Effect, Refusal, Row, message_values
from miserver.spec.codes import ErrorCode

__all__ = [
    "Lifecycle",
    "Outcome",
    "Snapshot",
    "TableError",
    "Event",
    "LifecycleState",
    "refusal_message",
]


_deadlines = attrgetter(*(f"{t}_deadline" for t in TIMERS))

#: When several timers are due at once they fire in this order (a commit tears before a hold
#: it suspended could time out).
TIMER_ORDER: tuple[str, ...] = ("watchdog", "drain", "hold", "heartbeat")
TIMER_EVENTS: dict[str, str] = {
    "hold": "hold_expired",
    "watchdog": "watchdog_expired",
    "heartbeat": "heartbeat_lapsed",
    "drain": "drain_expired",
}


@dataclass(frozen=True)
class Outcome:
    """What one event did.

    Attributes:
        kind: ``accepted``, ``refused`` or ``ignored`` (an internal event that did not apply).
        trigger: the event's trigger.
        status: the HTTP status for the caller (200 unless refused).
        code, reason, message, details: the refusal (``None`` / empty when accepted), or for
            an accepted event the values its response needs (commit_ms, overran, cleared, ...).
        effects: what the serving layer performs, in order.
        pending: the answer for the call waiting on a pause, when this event settles it.
        row: the table row that decided (``trigger#n``).
        before, after: the abstract states.
        retry_after: a refusal answered with ``Retry-After`` (the row's
            :attr:`~miserver.fsm.table.Refusal.sends_retry_after`).
    """

    kind: Literal["accepted", "refused", "ignored"]
    trigger: str
    status: int
    code: ErrorCode | None
    reason: str | None
    message: str
    details: dict[str, Any]
    effects: tuple[Effect, ...]
    pending: Answer | None
    row: str
    before: LifecycleState
    after: LifecycleState
    retry_after: bool = False

    @property
    def accepted(self) -> bool:
        return self.kind != "refused"


@dataclass(frozen=True)
class Snapshot:
    """The whole core state: abstract state plus context. Hashable."""

    state: LifecycleState
    context: Context = field(default_factory=Context)


class Lifecycle:
    """The weights lifecycle of one server process (weights page; contract 3-6).

    Args:
        hold_timeout_s: WEIGHTS_HOLD_TIMEOUT_S.
        watchdog_ms: WEIGHTS_COMMIT_WATCHDOG_MS.
        heartbeat_timeout_s: WEIGHTS_HEARTBEAT_TIMEOUT_S.
        drain_timeout_s: WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S.
        heartbeat_interval_hint_s: WEIGHTS_HEARTBEAT_INTERVAL_HINT_S (reported only).
        avail: the starting pause availability (``ok``, ``cbm``, ``concurrency``).
        resident: a model is resident at start (``served_name`` names it).
        table: the rows to run (the production :data:`~miserver.fsm.table.TABLE` by default).
        id_factory: makes attachment IDs (default ``secrets.token_urlsafe(24)``).
        via_machine: decide each event by stepping the compiled ``transitions`` machine
            (:meth:`~miserver.fsm.compiled.Compiled.fire`, what ``miserver check`` does) instead
            of the decision lookup read out of that machine
            (:meth:`~miserver.fsm.compiled.Compiled.decide`, the default: the same decisions,
            without the machine's per-event overhead), and apply it through the general
            :meth:`_apply_context` and :meth:`_outcome` instead of the row's :class:`_Plan`
            (the server's path: the same outcome and snapshot, with what depends only on the
            row and the two states read once per source state and row).
    """

    def __init__(
        self,
        *,
        hold_timeout_s: float = 5.0,
        watchdog_ms: float = 800.0,
        heartbeat_timeout_s: float = 30.0,
        drain_timeout_s: float = 60.0,
        heartbeat_interval_hint_s: float = 5.0,
        avail: str = "ok",
        resident: bool = False,
        served_name: str | None = None,
        table: tuple[Row, ...] = TABLE,
        id_factory: Callable[[], str] | None = None,
        via_machine: bool = False,
    ) -> None:
        self.durations = {
            "hold": hold_timeout_s,
            "watchdog": watchdog_ms / 1000.0,
            "heartbeat": heartbeat_timeout_s,
            "drain": drain_timeout_s,
        }
        self.watchdog_ms = watchdog_ms
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.heartbeat_interval_hint_s = heartbeat_interval_hint_s
        self.compiled: Compiled = compile_table(table)
        self.via_machine = via_machine
        self._decide = self.compiled.fire if via_machine else self.compiled.decide
        self._after: dict[tuple[LifecycleState, int], tuple[Row, LifecycleState]] = {}
        #: ``(source state, id(row))`` -> its :class:`_Plan` (the server's path, ``handle``).
        self._plans: dict[tuple[LifecycleState, int], _Plan] = {}
        self._timers: dict[int, tuple[Row, tuple[tuple[str, str | None], ...]]] = {}
        self._id_factory = id_factory or (lambda: secrets.token_urlsafe(24))
        state = LifecycleState(resident=resident, avail=avail)  # type: ignore[arg-type]
        ctx = Context(
            steps_since_load=0 if resident else None,
            commits_since_name=0 if resident else None,
            served_name=served_name if resident else None,
            served_origin="model" if resident else None,
        )
        self._snap = Snapshot(state, ctx)

    @classmethod
    def from_settings(
        cls, settings: Any, *, resident: bool = False, served_name: str | None = None, **kwargs: Any
    ) -> Lifecycle:
        """Build from :class:`miserver.spec.settings.Settings` (timers, pause availability)."""
        if settings.continuous_batching:
            avail = "cbm"
        elif settings.max_concurrent_requests != 1:
            avail = "concurrency"
        else:
            avail = "ok"
        return cls(
            hold_timeout_s=settings.weights_hold_timeout_s,
            watchdog_ms=settings.weights_commit_watchdog_ms,
            heartbeat_timeout_s=settings.weights_heartbeat_timeout_s,
            drain_timeout_s=settings.weights_quiesce_drain_timeout_s,
            heartbeat_interval_hint_s=settings.weights_heartbeat_interval_hint_s,
            avail=avail,
            resident=resident,
            served_name=served_name,
            **kwargs,
        )

    # --- state ------------------------------------------------------------------------
    @property
    def state(self) -> LifecycleState:
        return self._snap.state

    @property
    def context(self) -> Context:
        return self._snap.context

    def snapshot(self) -> Snapshot:
        """The whole state as one hashable value."""
        return self._snap

    def restore(self, snap: Snapshot) -> None:
        """Put the core back into ``snap`` (tests, the checker)."""
        self._snap = snap

    # --- events -------------------------------------------------------------------------
    def handle(self, event: Event, now: float) -> Outcome:
        """Decide ``event`` at time ``now`` and apply it.

        Returns the :class:`Outcome`. Raises :class:`TableError` when the table has no row for
        the event in this state (a bug of the table, found by ``miserver check``).
        """
        before, ctx = self._snap.state, self._snap.context
        row, named = self._decide(before, ctx, event)
        if not self.via_machine:
            # The server's path: what the row does from this source, read once (_Plan); the
            # same outcome and snapshot as the general path below, which ``miserver check``
            # steps (via_machine) and tests compare against this one in every state it reaches.
            plan = self._plans.get((before, id(row)))
            if plan is None or plan.row is not row:
                plan = self._plans[(before, id(row))] = _Plan(row, before, named)
            if plan.accepted:
                return self._handle_planned(plan, event, ctx, now)
            self._snap = Snapshot(plan.after, ctx)
            return self._outcome(row, event, before, plan.after, ctx, ctx)
        # The destination is a function of the source and the row (the machine's destination
        # state plus the row's other settings): computed once per pair, then reused.
        known = self._after.get((before, id(row)))
        if known is not None and known[0] is row:
            after = known[1]
        else:
            variables = {k: v for k, v in row.set if k not in NAMED}
            after = replace(before, **named, **variables)  # type: ignore[arg-type]
            self._after[(before, id(row))] = (row, after)
        if row.kind != "accepted":
            # The table says a refusal changes nothing; apply what it says regardless, so a
            # table that breaks the rule is caught by the checker's invariant.
            self._snap = Snapshot(after, ctx)
            return self._outcome(row, event, before, after, ctx, ctx)
        new_ctx = self._apply_context(row, event, before, after, ctx, now)
        self._snap = Snapshot(after, new_ctx)
        return self._outcome(row, event, before, after, ctx, new_ctx, now)

    def next_deadline(self) -> float | None:
        """The earliest armed timer's deadline, or ``None`` when no timer is armed."""
        armed = [t for t in _deadlines(self._snap.context) if t is not None]
        return min(armed) if armed else None

    def fire_due(self, now: float) -> list[Outcome]:
        """Fire every timer whose deadline is at or before ``now``, earliest first."""
        outcomes: list[Outcome] = []
        for _ in range(len(TIMERS) * 2):
            ctx = self._snap.context
            due = [
                (getattr(ctx, f"{t}_deadline"), TIMER_ORDER.index(t), t)
                for t in TIMER_ORDER
                if getattr(ctx, f"{t}_deadline") is not None
                and getattr(ctx, f"{t}_deadline") <= now
            ]
            if not due:
                break
            _, _, timer = min(due)
            outcomes.append(self.handle(Event(TIMER_EVENTS[timer]), now))
            if (
                getattr(self._snap.context, f"{timer}_deadline") is not None
                and getattr(self._snap.context, f"{timer}_deadline") <= now
            ):
                # the table left the timer armed and due: do not spin
                ctx2 = replace(self._snap.context, **{f"{timer}_deadline": None})
                self._snap = Snapshot(self._snap.state, ctx2)
        return outcomes

    # --- views --------------------------------------------------------------------------
    @property
    def unsaved_commits(self) -> int:
        ctx = self._snap.context
        return max(0, (ctx.steps_since_load or 0) - ctx.saved_steps)

    def answer_view(self) -> dict[str, Any]:
        """The few fields a barrier call's answer reports (weights page, Routes), as
        :meth:`status_view` reports them, without building the whole status: ``weights_state``,
        ``barrier`` (``serving`` or ``quiesced``), ``attachment_state`` (None when nothing is
        attached), ``steps_since_load`` (None when nothing is resident), ``quiesced_at`` and
        ``hold_deadline`` (on the core's clock)."""
        s, c = self._snap.state, self._snap.context
        return {
            "weights_state": s.weights,
            "barrier": "serving" if s.barrier == "serving" else "quiesced",
            "attachment_state": None if s.attachment == "none" else s.attachment,
            "steps_since_load": c.steps_since_load if s.resident else None,
            "quiesced_at": c.quiesced_at,
            "hold_deadline": c.hold_deadline,
        }

    def status_view(self, now: float | None = None) -> dict[str, Any]:
        """What GET /api/weights/status needs that the core knows (weights page: Status).

        Times are on the ``now`` clock; the HTTP layer converts them to wall-clock stamps.
        ``barrier`` is ``serving`` or ``quiesced`` (a draining pause holds new requests, so it
        reports ``quiesced``); ``draining`` says whether the drain is still running.
        """
        s, c = self._snap.state, self._snap.context
        attachment = None
        if s.attachment != "none":
            attachment = {
                "state": s.attachment,
                "role": c.attachment_role,
                "label": c.attachment_label,
                "attached_at": c.attached_at,
                "last_heartbeat_at": c.last_heartbeat_at,
                "stale_since": c.stale_since,
            }
        commit = None
        if s.commit != "none" or (s.weights == "torn" and c.commit_began_at is not None):
            # Weights page, Status: ``commit`` while a commit is open or torn. ``overran``: the
            # watchdog timed it out (open longer than WEIGHTS_COMMIT_WATCHDOG_MS), not merely
            # torn (a detach while writing, a moved address). ``open_ms`` runs while the commit
            # is open and stops where it tore (the watchdog, a detach, a moved address), also
            # while its beginner may still end it late: the value never changes after the tear,
            # a clear-stale included (issue 16 item 15). A late commit-end reports its own
            # length (``last_overrun.commit_ms``).
            end = now if c.commit_torn_at is None else c.commit_torn_at
            open_ms = None
            if end is not None and c.commit_began_at is not None:
                open_ms = (end - c.commit_began_at) * 1000.0
            commit = {
                "began_at": c.commit_began_at,
                "open_ms": open_ms,
                "watchdog_ms": self.watchdog_ms,
                "overran": c.commit_timed_out,
            }
        last_overrun = None
        if c.last_overrun is not None:
            last_overrun = {"at": c.last_overrun[0], "commit_ms": c.last_overrun[1]}
        answer = self.answer_view()
        return {
            "attached": s.attachment != "none",
            "attachment": attachment,
            "barrier": answer["barrier"],
            "draining": s.barrier == "draining",
            "pause_owner": None if s.owner == "none" else s.owner,
            "quiesced_at": answer["quiesced_at"],
            "weights_state": answer["weights_state"],
            "steps_since_load": answer["steps_since_load"],
            "unsaved_commits": self.unsaved_commits if s.resident else None,
            "commit": commit,
            "commit_overran": c.commit_overran,
            "last_hold_timeout_at": c.last_hold_timeout_at,
            "last_overrun": last_overrun,
            "pause_unavailable": None if s.avail == "ok" else s.avail,
            "adapter_applied": s.adapter,
            "model_transition": None if s.transition == "none" else s.transition,
            "hold_deadline": answer["hold_deadline"],
            "served": {
                "name": c.served_name,
                "origin": c.served_origin,
                "commits": c.commits_since_name,
            },
            "exports_since_start": c.exports,
            "saves_since_start": c.saves,
        }

    # --- internals ----------------------------------------------------------------------
    def _apply_context(
        self, row: Row, event: Event, b: LifecycleState, a: LifecycleState, c: Context, now: float
    ) -> Context:
        ch = self._action_changes(row, event, c, now)
        self._consequences(ch, row, b, a, c, now)
        return _evolve_context(c, ch)

    def _action_changes(self, row: Row, event: Event, c: Context, now: float) -> dict[str, Any]:
        """What the row's actions change in the context, in their order."""
        ch: dict[str, Any] = {}
        for action in row.actions:
            if action == "attach":
                caller = event.caller
                ch.update(
                    attachment_id=self._id_factory(),
                    attachment_label=caller.label if caller else None,
                    attachment_role=caller.token if caller else None,
                    attached_at=now,
                    last_heartbeat_at=now,
                    stale_since=None,
                    exports=c.exports + 1,
                )
            elif action == "heartbeat":
                ch.update(last_heartbeat_at=now, stale_since=None)
            elif action == "stale":
                ch.update(stale_since=now)
            elif action == "begin_commit":
                ch.update(commit_began_at=now)
            elif action == "end_commit":
                ch.update(
                    steps_since_load=(c.steps_since_load or 0) + 1,
                    commits_since_name=(
                        None if c.commits_since_name is None else c.commits_since_name + 1
                    ),
                )
            elif action == "overrun":
                began = c.commit_began_at if c.commit_began_at is not None else now
                ch.update(last_overrun=(now, (now - began) * 1000.0))
            elif action == "watchdog":
                ch.update(commit_overran=now, commit_torn_at=now, commit_timed_out=True)
            elif action == "hold_timeout":
                ch.update(last_hold_timeout_at=now)
            elif action == "save":
                steps = c.steps_since_load or 0
                ch.update(saved_steps=steps, saves=c.saves + 1)
                if c.served_origin != "adapter":  # contract 5: the set is the checkpoint now
                    ch.update(
                        served_name=event.name or c.served_name,
                        served_origin="checkpoint",
                        commits_since_name=0,
                    )
                else:
                    # contract 6: the adapter still computes and keeps its name; the checkpoint
                    # holds the base tensors, the name restored once the adapter is removed,
                    # its commits counted from this save (finding N1)
                    ch.update(before_adapter=Provenance(event.name, "checkpoint", 0, steps))
            elif action == "load":
                inferred = "checkpoint" if event.trigger.startswith("weights_") else "model"
                ch.update(
                    steps_since_load=0,
                    saved_steps=0,
                    commits_since_name=0,
                    served_name=event.name or c.served_name,
                    served_origin=event.origin or inferred,
                    before_adapter=None,  # a load replaces the adapted model
                )
            elif action == "unload":
                ch.update(
                    steps_since_load=None,
                    saved_steps=0,
                    commits_since_name=None,
                    served_name=None,
                    served_origin=None,
                    before_adapter=None,  # the adapter went with the resident
                )
            elif action == "adapter":
                ch.update(self._adapter_provenance(event, c))
            else:  # pragma: no cover - a typo in the table
                raise TableError(f"row {row.id}: unknown action {action!r}")
        return ch

    def _consequences(
        self,
        ch: dict[str, Any],
        row: Row,
        b: LifecycleState,
        a: LifecycleState,
        c: Context,
        now: float,
    ) -> None:
        """Add to ``ch`` the consequences of the state change itself and the row's timers."""
        if a.attachment == "none" and b.attachment != "none":
            ch.update(
                attachment_id=None,
                attachment_label=None,
                attachment_role=None,
                attached_at=None,
                last_heartbeat_at=None,
                stale_since=None,
            )
        if (
            a.weights == "torn"
            and b.weights != "torn"
            and c.commit_began_at is not None
            and "watchdog" not in row.actions
        ):
            # a detach while writing, or a moved address, tore the open commit: not the watchdog
            ch.update(commit_torn_at=now, commit_timed_out=False)
        if a.commit == "none" and "end_commit" not in row.actions:
            ch.setdefault("commit_began_at", None)
        if "end_commit" in row.actions:
            ch["commit_began_at"] = None
        if (c.commit_torn_at is not None or c.commit_timed_out) and (
            ch.get("commit_began_at", c.commit_began_at) is None or "begin_commit" in row.actions
        ):
            ch.update(commit_torn_at=None, commit_timed_out=False)  # that commit is over
        if a.barrier == "serving":
            ch["quiesced_at"] = None
        elif b.barrier == "serving":
            ch["quiesced_at"] = now
        known = self._timers.get(id(row))  # read once per row (rows are immutable values)
        if known is None or known[0] is not row:
            known = self._timers[id(row)] = (row, _timer_settings(row))
        for deadline, timer in known[1]:
            ch[deadline] = now + self.durations[timer] if timer is not None else None

    def _handle_planned(self, plan: _Plan, event: Event, c: Context, now: float) -> Outcome:
        """``handle`` of an accepted row from its :class:`_Plan`: the context
        :meth:`_apply_context` gives and the outcome :meth:`_outcome` gives, written slot by
        slot in the same order (a later write wins, as a later ``ch`` update does)."""
        values = list(_context_values(c))
        ch = self._action_changes(plan.row, event, c, now) if plan.actions else None
        if ch:
            index = _CONTEXT_INDEX
            for name, value in ch.items():
                values[index[name]] = value
        if plan.clears_attachment:
            for i in _ATTACHMENT_SLOTS:
                values[i] = None
        if plan.tears and c.commit_began_at is not None:
            values[_TORN_AT] = now
            values[_TIMED_OUT] = False
        if plan.commit_none and (ch is None or "commit_began_at" not in ch):
            values[_BEGAN_AT] = None  # ch.setdefault("commit_began_at", None)
        if plan.end_commit:
            values[_BEGAN_AT] = None
        if (c.commit_torn_at is not None or c.commit_timed_out) and (
            values[_BEGAN_AT] is None or plan.begin_commit
        ):
            values[_TORN_AT] = None
            values[_TIMED_OUT] = False
        if plan.quiesced is not None:
            values[_QUIESCED_AT] = now if plan.quiesced else None
        durations = self.durations
        for i, timer in plan.timers:
            values[i] = now + durations[timer] if timer is not None else None
        new = object.__new__(Context)
        for setter, value in zip(_SLOT_SETTERS, values, strict=True):
            setter(new, value)
        after = plan.after
        before = plan.before
        self._snap = Snapshot(after, new)
        details: dict[str, Any] = {}
        if plan.attach_id:
            details["attachment_id"] = new.attachment_id
        if plan.end_commit:
            began = c.commit_began_at
            details.update(
                commit_ms=None if began is None else (now - began) * 1000.0,
                overran=plan.overran,
                steps_since_load=new.steps_since_load,
            )
        if plan.cleared:
            details["cleared"] = {
                "role": c.attachment_role,
                "label": c.attachment_label,
                "stale_since": c.stale_since,
            }
        if plan.begin_commit:
            details.update(began_at=new.commit_began_at, watchdog_ms=self.watchdog_ms)
        out = object.__new__(Outcome)  # Outcome(...) without the frozen __init__'s setattrs
        vars(out).update(
            kind="accepted",
            trigger=event.trigger,
            status=200,
            code=None,
            reason=None,
            message=plan.message,
            details=details,
            effects=plan.effects,
            pending=plan.pending,
            row=plan.row_id,
            before=before,
            after=after,
            retry_after=False,
        )
        return out

    @staticmethod
    def _adapter_provenance(event: Event, c: Context) -> dict[str, Any]:
        """The served name, origin and commit count an adapter change sets (weights page:
        Which weights answered; contract 6), and the :class:`Provenance` it records: applied,
        the adapter's name with origin ``adapter`` and commits from 0, recording what was
        served before the first adapter (a replacing adapter keeps that record); removed, the
        event's name, origin and count (the serving layer computes them from the record with
        :func:`~miserver.fsm.context.served_after_removal`), and the record is dropped."""
        if event.applied:
            before = c.before_adapter
            if before is None:
                before = Provenance(
                    c.served_name, c.served_origin, c.commits_since_name, c.steps_since_load
                )
            return {
                "served_name": event.name or c.served_name,
                "served_origin": "adapter",
                "commits_since_name": 0,
                "before_adapter": before,
            }
        return {
            "served_name": event.name or c.served_name,
            "served_origin": event.origin or "model",
            "commits_since_name": event.commits if event.commits is not None else 0,
            "before_adapter": None,
        }

    def _outcome(
        self,
        row: Row,
        event: Event,
        b: LifecycleState,
        a: LifecycleState,
        c_before: Context,
        c_after: Context,
        now: float | None = None,
    ) -> Outcome:
        if row.refuse is not None:
            ref = row.refuse
            if ref.message is not None:
                message = ref.message.format_map(message_values(ref, b, event))
            else:
                message = _REASON_MESSAGES.get(
                    (ref.code.name, ref.reason or ""), _MESSAGES.get(ref.code.name, ref.code.name)
                )
            return Outcome(
                "refused",
                event.trigger,
                ref.http_status,
                ref.code,
                ref.reason,
                message,
                self._details(ref, b, c_before, event),
                (),
                None,
                row.id,
                b,
                a,
                ref.sends_retry_after,
            )
        details: dict[str, Any] = {}
        if event.trigger == "attach" and row.kind == "accepted":
            details["attachment_id"] = c_after.attachment_id
        if "end_commit" in row.actions:
            began = c_before.commit_began_at
            details.update(
                commit_ms=None if began is None or now is None else (now - began) * 1000.0,
                overran="overrun" in row.actions,
                steps_since_load=c_after.steps_since_load,
            )
        if event.trigger == "clear_stale":
            details["cleared"] = {
                "role": c_before.attachment_role,
                "label": c_before.attachment_label,
                "stale_since": c_before.stale_since,
            }
        if "begin_commit" in row.actions:
            details.update(began_at=c_after.commit_began_at, watchdog_ms=self.watchdog_ms)
        pending = row.pending
        message = ""
        if pending is not None and pending.code is not None:
            message = _REASON_MESSAGES.get(
                (pending.code.name, pending.reason or ""), _MESSAGES.get(pending.code.name, "")
            )
        return Outcome(
            row.kind,
            event.trigger,
            200,
            None,
            None,
            message,  # type: ignore[arg-type]
            details,
            row.effects,
            pending,
            row.id,
            b,
            a,
        )

    def _details(self, ref: Refusal, s: LifecycleState, c: Context, event: Event) -> dict[str, Any]:
        kind = ref.details
        if kind == "holder":
            return {
                "holder": {
                    "role": c.attachment_role,
                    "label": c.attachment_label,
                    "state": s.attachment,
                    "attached_at": c.attached_at,
                }
            }
        if kind == "torn":
            return {"recover": "POST /api/weights/load", "retry_after_s": 1}
        if kind == "unsaved":
            return {
                "served_name": c.served_name,
                "unsaved_commits": self.unsaved_commits,
                "ways_forward": [
                    "POST /api/weights/save (re-attach first)",
                    "POST /api/weights/load",
                    "POST /api/models/{id}/load",
                ],
            }
        if kind == "pause":
            return {"pause": s.owner}
        if kind == "busy":
            return {
                "barrier": "serving" if s.barrier == "serving" else "quiesced",
                "pause_owner": None if s.owner == "none" else s.owner,
                "weights_state": s.weights,
            }
        if kind == "catalogue_row":
            return {"model_id": event.model_id, "pause_owner": ref.pause or s.owner}
        if kind == "resident_row":
            return {"model_id": event.model_id, "name": event.name}
        return {}
