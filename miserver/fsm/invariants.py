"""Named invariants of the weights lifecycle, each with the spec sentence it protects.

``STRUCTURE`` holds the rules over the named components only; they also decide which product
states the compiled machine has. ``STATE_INVARIANTS`` must hold in every reachable state;
``EDGE_INVARIANTS`` must hold for every step ``(before, event, row, after)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from miserver.fsm.state import PAUSE_OWNERS, Event, LifecycleState
from miserver.fsm.table import Effect, Row

Named = Mapping[str, object]


def _barrier_owner(n: Named) -> bool:
    return (n["barrier"] == "serving") == (n["owner"] == "none")


def _empty_is_clean(n: Named) -> bool:
    return bool(n["resident"]) or (
        n["weights"] == "clean"
        and n["attachment"] == "none"
        and n["commit"] == "none"
        and n["owner"] == "none"
    )


def _writing_has_writer(n: Named) -> bool:
    if n["weights"] != "writing":
        return True
    by_commit = n["owner"] == "holder" and n["commit"] != "none"
    by_load = n["owner"] == "weights_load" and n["commit"] == "none"
    return n["barrier"] == "quiesced" and (by_commit or by_load)


def _commit_shape(n: Named) -> bool:
    if n["commit"] == "mine":
        return n["attachment"] != "none" and n["weights"] != "clean"
    if n["commit"] == "orphan":
        return n["weights"] != "clean" and (n["attachment"] == "none" or n["weights"] == "torn")
    return True


def _holder_exists(n: Named) -> bool:
    if n["owner"] != "holder":
        return True
    return n["attachment"] != "none" or (n["weights"] == "writing" and n["commit"] == "orphan")


def _pause_has_no_commit(n: Named) -> bool:
    """A save or adapter change needs clean weights; a weights load supersedes the commit;
    a drain starts from clean (quiesce) or from a weights load."""
    return (n["owner"] not in PAUSE_OWNERS and n["barrier"] != "draining") or n["commit"] == "none"


#: Rules over the named components (also the machine's state space).
STRUCTURE: tuple[tuple[str, Callable[[Named], bool]], ...] = (
    ("barrier_has_owner", _barrier_owner),
    ("nothing_resident_is_clean", _empty_is_clean),
    ("writing_implies_open_commit_or_weights_load", _writing_has_writer),
    ("commit_has_beginner", _commit_shape),
    ("holder_quiesce_has_holder", _holder_exists),
    ("no_commit_during_a_pause_or_drain", _pause_has_no_commit),
)


def _fields(s: LifecycleState) -> dict[str, object]:
    return {
        "resident": s.resident,
        "weights": s.weights,
        "barrier": s.barrier,
        "owner": s.owner,
        "attachment": s.attachment,
        "commit": s.commit,
    }


def _hold_exact(s: LifecycleState) -> bool:
    """Weights page: Timers (WEIGHTS_HOLD_TIMEOUT_S)."""
    want = (
        s.weights == "clean"
        and s.barrier == "quiesced"
        and s.owner == "holder"
        and s.commit == "none"
        and not s.takeover
    )
    return s.hold_armed == want


def _watchdog_exact(s: LifecycleState) -> bool:
    return s.watchdog_armed == (s.weights == "writing" and s.commit != "none")


def _heartbeat_exact(s: LifecycleState) -> bool:
    return s.heartbeat_armed == (s.attachment == "active")


def _drain_exact(s: LifecycleState) -> bool:
    return s.drain_armed == (s.barrier == "draining")


def _takeover_shape(s: LifecycleState) -> bool:
    if not s.takeover:
        return True
    return s.owner in PAUSE_OWNERS and s.barrier == "quiesced" and s.attachment != "none"


def _attached_no_transition(s: LifecycleState) -> bool:
    return s.attachment == "none" or s.transition == "none"


def _empty_carries_nothing(s: LifecycleState) -> bool:
    return s.resident or not (s.unsaved or s.adapter)


def _transition_unheld(s: LifecycleState) -> bool:
    return s.transition == "none" or (s.owner == "none" and s.weights != "writing")


STATE_INVARIANTS: tuple[tuple[str, Callable[[LifecycleState], bool]], ...] = (
    *((name, (lambda f: lambda s: f(_fields(s)))(fn)) for name, fn in STRUCTURE),
    ("hold_timer_armed_exactly_when_clean_holder_quiesce_without_commit_or_takeover", _hold_exact),
    ("watchdog_armed_exactly_while_a_commit_writes", _watchdog_exact),
    ("heartbeat_timer_armed_exactly_while_active", _heartbeat_exact),
    ("drain_timer_armed_exactly_while_draining", _drain_exact),
    ("takeover_only_by_a_pause_over_a_holder", _takeover_shape),
    ("no_model_transition_while_attached", _attached_no_transition),
    ("nothing_resident_carries_no_commits_or_adapter", _empty_carries_nothing),
    ("model_transition_runs_unheld", _transition_unheld),
)


Edge = tuple[LifecycleState, Event, Row, LifecycleState]


def _served_clean_unheld(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """Nothing is served unless clean and not held (weights page: States)."""
    if Effect.ADMIT not in row.effects:
        return True
    return b.weights == "clean" and b.barrier == "serving" and b.transition == "none" and b.resident


def _torn_exits(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """Torn is left only by the beginner's late commit-end, a weights load or an unload."""
    if b.weights != "torn" or a.weights == "torn":
        return True
    if e.trigger == "commit_end":
        return b.commit == "mine"
    if e.trigger in ("weights_load_write", "weights_load_done"):
        return b.owner == "weights_load"
    if e.trigger == "transition_done":
        return b.transition == "unload"
    return False


def _one_attachment(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """One attachment at a time (The write cycle 1)."""
    if b.attachment != "none" and a.attachment != "none" and Effect.EXPORT_HANDLES in row.effects:
        return False
    return not (e.trigger == "attach" and row.kind == "accepted" and b.attachment != "none")


def _attached_no_model_change(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """While attached, no load, unload or swap succeeds, stale or not (The write cycle 1)."""
    if b.attachment == "none":
        return True
    starts = {Effect.START_MODEL_LOAD, Effect.START_MODEL_UNLOAD}
    return not (starts & set(row.effects)) and a.transition == "none" and a.resident


def _refusal_changes_nothing(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """A refusal changes nothing (design notes: Refusals)."""
    if row.kind == "accepted":
        return True
    return a == b and not row.effects


def _refusal_code_legal(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """Every refusal's (status, reason) is one its code allows (spec/codes.py)."""
    if row.refuse is not None:
        return row.refuse.code.allows(row.refuse.http_status, row.refuse.reason)
    if row.pending is not None and row.pending.code is not None:
        return row.pending.code.allows(row.pending.status, row.pending.reason)
    return True


def _no_admit_on_writing(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """Held requests are never released onto writing weights."""
    return not (Effect.RELEASE_HELD in row.effects and a.weights == "writing")


EDGE_INVARIANTS: tuple[tuple[str, Callable[..., bool]], ...] = (
    ("nothing_served_unless_clean_and_not_held", _served_clean_unheld),
    ("torn_left_only_by_late_commit_end_weights_load_or_unload", _torn_exits),
    ("one_attachment_at_most", _one_attachment),
    ("while_attached_no_load_unload_or_swap", _attached_no_model_change),
    ("refusal_changes_nothing", _refusal_changes_nothing),
    ("refusal_code_and_reason_legal", _refusal_code_legal),
    ("held_requests_never_released_onto_writing_weights", _no_admit_on_writing),
)
