"""The server's fast path through one table row: what a row does from one source state, read
once (:class:`_Plan`), and the helpers that rebuild the frozen, slotted
:class:`~miserver.fsm.context.Context` without re-running its ``__init__``.

:class:`~miserver.fsm.machine.Lifecycle` builds one plan per (source state, row) it meets and
applies it in :meth:`~miserver.fsm.machine.Lifecycle._handle_planned`; the general path
(``via_machine``) derives the same from the row each time. Nothing here decides: every value is
read out of the row the table (:mod:`miserver.fsm.table`) holds.
"""

from __future__ import annotations

from dataclasses import fields, replace
from operator import attrgetter
from typing import Any

from miserver.fsm.context import Context
from miserver.fsm.messages import _MESSAGES, _REASON_MESSAGES
from miserver.fsm.state import NAMED, TIMERS, LifecycleState
from miserver.fsm.table import Row

_CONTEXT_FIELDS = tuple(f.name for f in fields(Context))
_CONTEXT_INDEX = {name: i for i, name in enumerate(_CONTEXT_FIELDS)}
_context_values = attrgetter(*_CONTEXT_FIELDS)
#: Each slot's own setter (the member descriptor's ``__set__``): it writes the slot directly,
#: as ``object.__setattr__`` would, without looking the name up.
_SLOT_SETTERS = tuple(getattr(Context, name).__set__ for name in _CONTEXT_FIELDS)


def _evolve_context(c: Context, changes: dict[str, Any]) -> Context:
    """``dataclasses.replace(c, **changes)`` for the frozen, slotted :class:`Context`, without
    re-running ``__init__`` (about a third of the time; it runs on every accepted event, inside
    the barrier's latency). Raises ``TypeError`` for a name that is not a field, as ``replace``
    does."""
    if not changes:
        return c
    values = list(_context_values(c))
    for name, value in changes.items():
        i = _CONTEXT_INDEX.get(name)
        if i is None:
            raise TypeError(f"not Context fields: {sorted(changes.keys() - _CONTEXT_INDEX.keys())}")
        values[i] = value
    new = object.__new__(Context)
    for setter, value in zip(_SLOT_SETTERS, values, strict=True):
        setter(new, value)
    return new


def _timer_settings(row: Row) -> tuple[tuple[str, str | None], ...]:
    """What ``row.set`` says of the timers, in its order: ``(deadline field, timer)`` for a
    timer it arms, ``(deadline field, None)`` for one it disarms."""
    return tuple(
        (f"{_ARMED[k]}_deadline", _ARMED[k] if v else None) for k, v in row.set if k in _ARMED
    )


_ARMED = {f"{timer}_armed": timer for timer in TIMERS}

_ATTACHMENT_SLOTS = tuple(
    _CONTEXT_INDEX[name]
    for name in (
        "attachment_id",
        "attachment_label",
        "attachment_role",
        "attached_at",
        "last_heartbeat_at",
        "stale_since",
    )
)
_TORN_AT = _CONTEXT_INDEX["commit_torn_at"]
_TIMED_OUT = _CONTEXT_INDEX["commit_timed_out"]
_BEGAN_AT = _CONTEXT_INDEX["commit_began_at"]
_QUIESCED_AT = _CONTEXT_INDEX["quiesced_at"]


class _Plan:
    """What one row does from one source state, read once: the destination, and each test of
    :meth:`Lifecycle._apply_context` and :meth:`Lifecycle._outcome` that depends only on the
    row and the two states (the server's path: :meth:`Lifecycle._handle_planned`).

    Derived from the row the compiled machine's decision names and from the machine's
    destination (``named``), so the table stays the single source of truth. The checker steps
    the machine and the general path (``via_machine``); tests compare the two paths' outcomes
    and snapshots in every state and event the checker reaches, under several contexts.
    """

    __slots__ = (
        "row",
        "before",
        "after",
        "accepted",
        "actions",
        "clears_attachment",
        "tears",
        "commit_none",
        "end_commit",
        "begin_commit",
        "overran",
        "quiesced",
        "timers",
        "attach_id",
        "cleared",
        "message",
        "effects",
        "pending",
        "row_id",
    )

    def __init__(self, row: Row, before: LifecycleState, named: dict) -> None:
        variables = {k: v for k, v in row.set if k not in NAMED}
        a = replace(before, **named, **variables)  # type: ignore[arg-type]
        b = before
        actions = row.actions
        self.row = row
        self.before = b
        self.after = a
        self.accepted = row.kind == "accepted"
        self.actions = actions
        self.clears_attachment = a.attachment == "none" and b.attachment != "none"
        self.tears = a.weights == "torn" and b.weights != "torn" and "watchdog" not in actions
        self.commit_none = a.commit == "none" and "end_commit" not in actions
        self.end_commit = "end_commit" in actions
        self.begin_commit = "begin_commit" in actions
        self.overran = "overrun" in actions
        #: quiesced_at: None (unchanged), False (cleared), True (set to now)
        self.quiesced = (
            False if a.barrier == "serving" else True if b.barrier == "serving" else None
        )
        self.timers = tuple(
            (_CONTEXT_INDEX[deadline], timer) for deadline, timer in _timer_settings(row)
        )
        self.attach_id = row.trigger == "attach"
        self.cleared = row.trigger == "clear_stale"
        pending = row.pending
        message = ""
        if pending is not None and pending.code is not None:
            message = _REASON_MESSAGES.get(
                (pending.code.name, pending.reason or ""), _MESSAGES.get(pending.code.name, "")
            )
        self.message = message
        self.effects = row.effects
        self.pending = pending
        self.row_id = row.id
