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


def _unavailable_serves(s: LifecycleState) -> bool:
    """While pauses are unavailable (continuous batching, or MAX_CONCURRENT_REQUESTS not 1:
    status pause_unavailable) nothing holds the barrier: quiesce, save, weights load and
    adapter change are refused 409 BARRIER_UNAVAILABLE, and a settings change that makes them
    unavailable is accepted only while serving (weights page: Status; contract 1)."""
    return s.avail == "ok" or (s.barrier == "serving" and s.owner == "none")


def _parked_only_while_held(s: LifecycleState) -> bool:
    """Parked sequences exist only while the barrier is held and the set is not torn: they
    continue when the hold ends and a tear ends them (contract 4b)."""
    return not s.parked or (s.barrier != "serving" and s.weights != "torn")


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
    ("nothing_holds_the_barrier_while_pauses_are_unavailable", _unavailable_serves),
    ("parked_sequences_only_while_held_and_not_torn", _parked_only_while_held),
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


# --- effects that must accompany changes ------------------------------------------------------
# Each rule ties an effect to the change of state it performs, so that a row that changes the
# state without its effect (or performs an effect without the change) is caught.


def _iff(effect: Effect, row: Row, change: bool) -> bool:
    return row.kind != "accepted" or (effect in row.effects) == change


def _exports_follow_attachment(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """Handles are exported by the attach and released by what ends the attachment (detach,
    clear-stale): weights page, The write cycle 1; Timers."""
    gained = b.attachment == "none" and a.attachment != "none"
    lost = b.attachment != "none" and a.attachment == "none"
    return _iff(Effect.EXPORT_HANDLES, row, gained) and _iff(Effect.RELEASE_EXPORTS, row, lost)


def _group_follows_commit(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """The process-group receive is armed by the row that opens an attachment's commit, and the
    group is destroyed by every row that ends the attachment or tears the set (contract 10)."""
    opens = b.commit != "mine" and a.commit == "mine"
    lost = b.attachment != "none" and a.attachment == "none"
    tears = row.changes.get("weights") == "torn"
    return _iff(Effect.ARM_RECEIVE, row, opens) and _iff(Effect.DESTROY_GROUP, row, lost or tears)


def _removed_holder_fenced(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """A holder removed without its own detach (clear-stale) is fenced out: the row that removes
    it moves the served set to fresh storages (``FENCE_ARENA``), and no other row does; a move
    that could not allocate (``fence_failed``) tears the set wherever a clear-stale can leave
    it (a model resident, nobody attached, no commit open, no model transition), and is ignored
    elsewhere (issue 32 item 8)."""
    lost = b.attachment != "none" and a.attachment == "none"
    if not _iff(Effect.FENCE_ARENA, row, lost and e.trigger == "clear_stale"):
        return False
    if e.trigger != "fence_failed":
        return True
    reachable = (
        b.resident and b.attachment == "none" and b.weights != "writing" and b.transition == "none"
    )
    return (row.kind == "accepted") == reachable and (not reachable or a.weights == "torn")


def _incomplete_receive_never_clean(
    b: LifecycleState, e: Event, row: Row, a: LifecycleState
) -> bool:
    """A commit whose broadcast did not complete is never made clean by its commit-end: the
    arena may be half-written (contract 10)."""
    return e.received or e.trigger != "commit_end" or row.kind != "accepted"


def _unusable_group_never_begins(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """A commit-begin whose process group failed or was destroyed opens no commit, and is
    refused so only where the holder could otherwise begin: quiesced by it, clean, no pause
    holding (contract 10; GROUP_UNAVAILABLE is the last check)."""
    if e.trigger != "commit_begin" or e.group_ok:
        return True
    if row.kind == "accepted":
        return False
    refuse = row.refuse
    if refuse is None or refuse.code.name != "GROUP_UNAVAILABLE":
        return True
    return (
        b.owner == "holder" and b.barrier == "quiesced" and b.weights == "clean" and not b.takeover
    )


def _receive_refusal_only_to_the_beginner(
    b: LifecycleState, e: Event, row: Row, a: LifecycleState
) -> bool:
    """Only the commit's own attachment is told its receive did not complete; any other caller
    is refused as not the holder first (contract 10; the weights page's check order)."""
    refuse = row.refuse
    return refuse is None or refuse.reason != "receive_incomplete" or b.commit == "mine"


def _held_follow_barrier(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """New requests are held from the moment the barrier leaves serving and released when it
    serves again (weights page: The write cycle 2, 5; contract 4)."""
    holds = b.barrier == "serving" and a.barrier != "serving"
    releases = b.barrier != "serving" and a.barrier == "serving"
    return _iff(Effect.HOLD_ADMISSIONS, row, holds) and _iff(Effect.RELEASE_HELD, row, releases)


def _drain_follows_barrier(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """A drain starts when the barrier starts draining and is cancelled when it is given up
    before it completes (The write cycle 2)."""
    starts = b.barrier != "draining" and a.barrier == "draining"
    cancels = b.barrier == "draining" and a.barrier == "serving"
    return _iff(Effect.START_DRAIN, row, starts) and _iff(Effect.CANCEL_DRAIN, row, cancels)


def _tear_refuses_held(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """The row that tears the set answers every held request 503 WEIGHTS_TORN (weights page:
    States, every /v1 call is 503 while torn); only a torn set refuses them."""
    if row.kind != "accepted":
        return True
    tears = b.weights != "torn" and a.weights == "torn"
    refuses = Effect.REFUSE_HELD_TORN in row.effects
    return (not tears or refuses) and (not refuses or a.weights == "torn")


def _records(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """Every timer expiry that applies and every late commit-end is recorded (Status:
    commit_overran, last_hold_timeout_at, last_overrun; the attachment's stale_since)."""
    return (
        _iff(
            Effect.RECORD_WATCHDOG,
            row,
            e.trigger == "watchdog_expired" and b.weights == "writing" and a.weights == "torn",
        )
        and _iff(
            Effect.RECORD_HOLD_TIMEOUT,
            row,
            e.trigger == "hold_expired" and b.barrier != "serving" and a.barrier == "serving",
        )
        and _iff(Effect.RECORD_STALE, row, b.attachment == "active" and a.attachment == "stale")
        and _iff(
            Effect.RECORD_OVERRUN,
            row,
            e.trigger == "commit_end" and b.weights == "torn" and a.weights == "clean",
        )
    )


def _waits(s: LifecycleState) -> bool:
    """A call waits on the barrier: a quiesce (or pause) still draining, or a pause's job."""
    return s.barrier == "draining" or s.owner in PAUSE_OWNERS


def _waiting_call_answered(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """The call waiting on a drain or a pause is answered exactly once, by the row that ends
    its wait (The write cycle 2; contract 5, 6)."""
    if row.kind != "accepted":
        return True
    answers = sum(1 for x in row.effects if x in (Effect.ANSWER_PENDING, Effect.FAIL_PENDING))
    return answers == (1 if _waits(b) and not _waits(a) else 0)


_BEGIN = {
    "save": Effect.BEGIN_SAVE,
    "weights_load": Effect.BEGIN_WEIGHTS_LOAD,
    "adapter": Effect.BEGIN_ADAPTER_CHANGE,
}


def _pause_job_begins(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """A save, weights load or adapter change does its work once it holds the barrier (drained,
    or taking over the holder's hold): contract 5, 6."""
    for owner, begin in _BEGIN.items():
        held_before = b.barrier == "quiesced" and b.owner == owner
        held_after = a.barrier == "quiesced" and a.owner == owner
        if not _iff(begin, row, held_after and not held_before):
            return False
    return True


def _transition_starts(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """A model load (or swap) or unload that is accepted is started (contract 3, 4)."""
    return _iff(
        Effect.START_MODEL_LOAD, row, b.transition != "load" and a.transition == "load"
    ) and _iff(
        Effect.START_MODEL_UNLOAD, row, b.transition != "unload" and a.transition == "unload"
    )


def _cache_dropped(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """The cross-request cache is dropped when the barrier is taken for what may change the
    weights (a holder's quiesce, a weights load, an adapter change: weights page, The write
    cycle 2; contract 5, 6) and when the served parameters change (a weights load or adapter
    change completes, a model load or swap completes, a cleared holder's fence moves the set
    to fresh storages), so nothing computed on other weights or storages is reused. A save
    changes no weight."""
    if row.kind != "accepted":
        return True
    changers = ("holder", "weights_load", "adapter")
    takes = (b.barrier == "draining" and a.barrier == "quiesced" and a.owner in changers) or (
        b.owner == "holder" and a.owner in ("weights_load", "adapter")
    )
    changes = (
        (e.trigger == "weights_load_done" and b.weights == "writing" and a.weights == "clean")
        or (
            e.trigger == "adapter_done"
            and b.owner == "adapter"
            and b.barrier == "quiesced"
            and b.weights != "torn"
        )
        or (e.trigger == "transition_done" and b.transition == "load" and a.resident)
        or (
            e.trigger == "transition_failed"
            and b.transition == "load"
            and a.resident
            and "load" in row.actions
        )
    )
    moves = Effect.FENCE_ARENA in row.effects  # the served storages change (issue 32 item 8)
    return not (takes or changes or moves) or Effect.DROP_CACHE in row.effects


_TIMER_EVENTS = {
    "hold_expired": "hold_armed",
    "watchdog_expired": "watchdog_armed",
    "heartbeat_lapsed": "heartbeat_armed",
    "drain_expired": "drain_armed",
}


def _late_timer_ignored(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """A timer that fires after it was cancelled (or restarted) does not apply (weights page:
    Timers; the core fires a timer only while it is armed)."""
    armed = _TIMER_EVENTS.get(e.trigger)
    return armed is None or getattr(b, armed) or row.kind == "ignored"


def _job_of(trigger: str, b: LifecycleState) -> bool | None:
    """Whether the internal event ``trigger`` has something to end or report in ``b`` (the
    job it completes is running, the timer it expires is armed), ``None`` for a request."""
    held = b.barrier == "quiesced"
    if trigger in _TIMER_EVENTS:
        return getattr(b, _TIMER_EVENTS[trigger])
    if trigger == "drained":
        return b.barrier == "draining"
    if trigger in ("save_done", "save_failed"):
        return held and b.owner == "save"
    if trigger in ("adapter_done", "adapter_failed"):
        return held and b.owner == "adapter"
    if trigger == "weights_load_write":
        return held and b.owner == "weights_load" and b.weights != "writing"
    if trigger == "weights_load_done":
        return held and b.owner == "weights_load" and b.weights == "writing"
    if trigger == "weights_load_failed":
        return held and b.owner == "weights_load"
    if trigger in ("transition_done", "transition_failed", "transition_abandoned"):
        return b.transition != "none"
    if trigger == "address_moved":
        return b.attachment != "none"  # only exported handles can see a storage move
    return None


def _completion_applies(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """An internal event applies exactly when what it reports is running: a drain's end while
    the barrier drains, a pause's end (save, weights load, adapter change) only to that pause
    once it holds the barrier, a model transition's end while one runs, a timer's expiry
    while it is armed, a moved address while handles are exported. Otherwise it is ignored
    (a late or stray event), and what is running is never left waiting for an end that was
    ignored (weights page: The write cycle 2, Timers; contract 3, 5, 6)."""
    applies = _job_of(e.trigger, b)
    return applies is None or applies == (row.kind == "accepted")


def _torn_pause_fails(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """A save or adapter change that completes on a torn set (a parameter's address moved
    during the pause) is answered as a failure and records nothing (docs/state-machine.md,
    decisions: a parameter's address moved)."""
    if e.trigger not in ("save_done", "adapter_done") or b.weights != "torn":
        return True
    if row.kind != "accepted":
        return True
    return (
        Effect.ANSWER_PENDING not in row.effects
        and not {"save", "adapter"} & set(row.actions)
        and a.unsaved == b.unsaved
        and a.adapter == b.adapter
    )


def _transition_ends(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """A model transition's end leaves no transition running and the resident as the end says:
    a completed load or swap leaves its model resident, a completed unload or a failed load
    leaves nothing resident (unless the host refused before it dropped anything: the resident
    is unchanged; or it loaded the previous row back: resident), a failed unload or an abandoned transition (its drain timed out)
    leaves the resident as it was (contract 3; decisions: a failed load leaves nothing
    resident; a model load, swap or unload drains first)."""
    ends = ("transition_done", "transition_failed", "transition_abandoned")
    if e.trigger not in ends or b.transition == "none" or row.kind != "accepted":
        return True
    if a.transition != "none":
        return False
    if e.trigger == "transition_done":
        return a.resident == (b.transition == "load")
    if e.trigger == "transition_failed" and b.transition == "load":
        if e.after_failure == "kept":  # refused before anything was dropped
            return a.resident == b.resident
        return a.resident == (e.after_failure == "reloaded")  # the previous row, loaded back
    return a.resident == b.resident


def _full_queue_refuses_waiting(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """A full interactive queue (MAX_QUEUED_REQUESTS) refuses what would wait in it: a quiesce,
    and a /v1 request that would be held (contract 1: 503 QUEUE_FULL for /v1 and quiesce;
    decisions: the queue bound counts the interactive requests that wait, queued or held)."""
    if not e.queue_full or row.kind != "accepted":
        return True
    if e.trigger == "quiesce":
        return False
    held = Effect.HOLD_REQUEST in row.effects and Effect.START_MODEL_LOAD not in row.effects
    return not (e.trigger == "v1" and held)


def _settings_applied(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """An accepted settings change takes effect (contract 1: PATCH /api/settings)."""
    return _iff(Effect.APPLY_SETTINGS, row, e.trigger == "settings_change")


def _admission_decided(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """An accepted /v1 request is run now, held, or held for its auto-load; a request that
    waited runs now when serving and otherwise goes on in its slot (contract 4)."""
    if row.kind != "accepted":
        return True
    admit, hold = Effect.ADMIT in row.effects, Effect.HOLD_REQUEST in row.effects
    if e.trigger == "v1":
        if Effect.START_MODEL_LOAD in row.effects:
            return hold and not admit
        return admit != hold and admit == (b.barrier == "serving")
    if e.trigger == "v1_confirm":
        return not hold and admit == (b.barrier == "serving")
    return not (admit or hold)


def _counters_follow(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """The abstract unsaved and adapter flags follow the context's counters: a counted commit
    is unsaved, a save saves it, a load or unload starts afresh, an adapter change applies or
    removes the adapter; nothing else changes them (weights page: Unsaved commits; contract
    5, 6)."""
    acts = set(row.actions)
    if "end_commit" in acts and not a.unsaved:
        return False
    if acts & {"save", "load", "unload"} and a.unsaved:
        return False
    if acts & {"load", "unload"} and a.adapter:
        return False
    if "adapter" in acts and a.adapter != e.applied:
        return False
    if a.unsaved != b.unsaved and not acts & {"end_commit", "save", "load", "unload"}:
        return False
    if a.adapter != b.adapter and not acts & {"adapter", "load", "unload"}:
        return False
    return a.resident == b.resident or bool(acts & {"load", "unload"})


#: The pauses during which no catalogue row is deleted (contract 3: ``409 MODEL_BUSY`` while a
#: weights load or a save runs): a weights load reads its checkpoint's folder, a save registers
#: a row whose parent is the base row.
_DELETE_BLOCKING = ("weights_load", "save")


def _catalogue_delete_blocked(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """A catalogue DELETE is refused exactly while a weights load or a save holds the barrier
    (its drain included) or a weights load's checkpoint is being checked before its pause, 409
    MODEL_BUSY ``model_transition`` naming that pause (the barrier's, else the checked load's);
    accepted it changes nothing and the serving layer does nothing (contract 3)."""
    if e.trigger != "catalogue_delete":
        return True
    blocked = b.owner in _DELETE_BLOCKING or e.loads_checking
    if row.refuse is None:
        return not blocked and row.kind == "accepted" and not row.effects and a == b
    named = b.owner if b.owner in _DELETE_BLOCKING else "weights_load"
    return (
        blocked
        and (row.refuse.code.name, row.refuse.reason) == ("MODEL_BUSY", "model_transition")
        and row.refuse.pause == named
    )


def _parking_follows_hold(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """Contract 4b: an accepted quiesce parks the running sequences exactly when it asks
    ``{"running": "hold"}`` (``PARK_RUNNING`` exactly when parking starts); parked sequences
    leave only by being continued (``RESUME_PARKED``, the set not torn) or ended with the torn
    error (``END_PARKED_TORN``, the set torn), never onto weights being written."""
    parks = not b.parked and a.parked
    if e.trigger == "quiesce" and row.kind == "accepted" and parks != (e.running == "hold"):
        return False
    if not _iff(Effect.PARK_RUNNING, row, parks):
        return False
    if Effect.RESUME_PARKED in row.effects and a.weights == "writing":
        return False
    leaves = b.parked and not a.parked
    torn = a.weights == "torn"
    return _iff(Effect.RESUME_PARKED, row, leaves and not torn) and _iff(
        Effect.END_PARKED_TORN, row, leaves and torn
    )


#: What a GGUF resident cannot do, by trigger, and the reason it is refused with (contract 4a).
_GGUF_REFUSED = {"save": "save", "weights_load": "weights_load", "adapter_change": "adapter"}


def _gguf_never_paused(b: LifecycleState, e: Event, row: Row, a: LifecycleState) -> bool:
    """Contract 4a: a save, a weights load of a checkpoint and an adapter change are never
    accepted on a GGUF resident (llama.cpp holds its weights), and 400 GGUF_UNSUPPORTED (its
    reason the operation) answers only such a call, only on a GGUF resident; a
    ``{"model_id": N}`` reload of a GGUF resident is not refused for it."""
    reason = _GGUF_REFUSED.get(e.trigger)
    gguf = (
        reason is not None
        and b.resident
        and e.resident_gguf
        and (e.trigger != "weights_load" or e.checkpoint_load)
    )
    refused_gguf = row.refuse is not None and row.refuse.code.name == "GGUF_UNSUPPORTED"
    if refused_gguf and (not gguf or row.refuse.reason != reason):
        return False
    return not (gguf and row.kind == "accepted")


EDGE_INVARIANTS: tuple[tuple[str, Callable[..., bool]], ...] = (
    ("nothing_served_unless_clean_and_not_held", _served_clean_unheld),
    ("torn_left_only_by_late_commit_end_weights_load_or_unload", _torn_exits),
    ("one_attachment_at_most", _one_attachment),
    ("while_attached_no_load_unload_or_swap", _attached_no_model_change),
    ("refusal_changes_nothing", _refusal_changes_nothing),
    ("refusal_code_and_reason_legal", _refusal_code_legal),
    ("held_requests_never_released_onto_writing_weights", _no_admit_on_writing),
    ("exports_made_by_attach_and_released_when_the_attachment_ends", _exports_follow_attachment),
    (
        "receive_armed_by_commit_begin_group_destroyed_by_detach_clear_stale_or_tear",
        _group_follows_commit,
    ),
    ("a_holder_removed_without_its_own_detach_is_fenced_out", _removed_holder_fenced),
    (
        "a_commit_whose_receive_did_not_complete_is_never_made_clean",
        _incomplete_receive_never_clean,
    ),
    (
        "only_the_commits_beginner_is_refused_receive_incomplete",
        _receive_refusal_only_to_the_beginner,
    ),
    (
        "an_unusable_group_never_opens_a_commit_and_is_checked_last",
        _unusable_group_never_begins,
    ),
    ("requests_held_exactly_while_the_barrier_is_not_serving", _held_follow_barrier),
    ("drain_started_and_cancelled_with_the_barrier", _drain_follows_barrier),
    ("the_row_that_tears_refuses_the_held_requests", _tear_refuses_held),
    ("timer_expiries_and_late_commit_ends_are_recorded", _records),
    ("the_waiting_call_is_answered_exactly_once_when_its_wait_ends", _waiting_call_answered),
    ("a_pause_begins_its_job_once_it_holds_the_barrier", _pause_job_begins),
    ("an_accepted_model_transition_is_started", _transition_starts),
    ("cache_dropped_when_the_barrier_is_taken_or_the_served_parameters_change", _cache_dropped),
    ("a_timer_that_is_not_armed_changes_nothing", _late_timer_ignored),
    ("an_internal_event_applies_exactly_while_what_it_ends_runs", _completion_applies),
    ("a_pause_that_completes_on_a_torn_set_fails_and_records_nothing", _torn_pause_fails),
    ("a_model_transition_ends_with_the_resident_its_end_says", _transition_ends),
    (
        "a_full_queue_refuses_a_quiesce_and_a_request_that_would_be_held",
        _full_queue_refuses_waiting,
    ),
    ("an_accepted_settings_change_takes_effect", _settings_applied),
    ("every_accepted_v1_request_is_run_held_or_auto_loaded", _admission_decided),
    ("unsaved_adapter_and_resident_follow_commits_saves_and_loads", _counters_follow),
    (
        "a_catalogue_delete_is_refused_exactly_while_a_load_or_save_needs_the_rows",
        _catalogue_delete_blocked,
    ),
    ("parked_sequences_parked_by_a_hold_and_continued_or_ended_torn", _parking_follows_hold),
    (
        "nothing_llama_cpp_serves_is_saved_loaded_into_or_given_an_adapter",
        _gguf_never_paused,
    ),
)
