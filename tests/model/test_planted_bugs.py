"""Plant bugs in a copy of the production table and show each one is caught, with a readable
trace: by ``miserver check`` (invariants, totality, non-vacuity) or, for a bug no invariant
sees (a swapped refusal order), by the stateful test against the reference model.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from miserver.fsm.check import check
from miserver.fsm.table import TABLE, Refusal, Row
from miserver.spec import codes
from tests.model.stateful import make_machine

#: Each planted bug runs a stateful test or the checker: minutes in all, left out of make quick.
pytestmark = pytest.mark.full


def _find(
    trigger: str,
    *,
    kind: str | None = None,
    when: tuple[str, ...] | None = None,
    code: str | None = None,
) -> Row:
    for row in TABLE:
        if row.trigger != trigger:
            continue
        if kind is not None and row.kind != kind:
            continue
        if when is not None and row.when != when:
            continue
        if code is not None and (row.refuse is None or row.refuse.code.name != code):
            continue
        return row
    raise LookupError(f"no row {trigger} {kind} {when} {code}")


def _swap(table: tuple[Row, ...], old: Row, new: Row) -> tuple[Row, ...]:
    assert old in table
    return tuple(new if r is old else r for r in table)


def _drop(table: tuple[Row, ...], old: Row) -> tuple[Row, ...]:
    assert old in table
    return tuple(r for r in table if r is not old)


def _set(row: Row, **changes: object) -> Row:
    merged = dict(row.set)
    merged.update(changes)
    return replace(row, set=tuple(merged.items()))


def _unset(row: Row, key: str) -> Row:
    return replace(row, set=tuple((k, v) for k, v in row.set if k != key))


def bug_missing_guard() -> tuple[Row, ...]:
    """The watchdog's first row loses ``commit_mine``: an orphaned commit tears but keeps a
    hold nobody owns."""
    row = _find("watchdog_expired", when=("watchdog_armed", "commit_mine"))
    return _swap(TABLE, row, replace(row, when=("watchdog_armed",)))


def bug_wrong_destination() -> tuple[Row, ...]:
    """commit-end leaves the weights writing instead of clean."""
    row = _find("commit_end", when=("writing",))
    return _swap(TABLE, row, _set(row, weights="writing"))


def bug_timer_left_armed() -> tuple[Row, ...]:
    """resume releases the hold but forgets to cancel the hold timer."""
    row = _find("resume", kind="accepted", when=("held_by_holder",))
    return _swap(TABLE, row, _unset(row, "hold_armed"))


def bug_missing_hold_row() -> tuple[Row, ...]:
    """/v1 loses its "hold while the barrier is held" row: requests run on held weights."""
    row = _find("v1", kind="accepted", when=("resident", "targets_resident"))
    assert row.unless == ("serving",)
    return _drop(TABLE, row)


def bug_confirm_ignores_a_changed_resident() -> tuple[Row, ...]:
    """A /v1 request that waited goes on although the model it was admitted for was unloaded
    meanwhile (the v1_confirm refusal is lost): a request runs with nothing resident."""
    return _drop(TABLE, _find("v1_confirm", code="MODEL_BUSY"))


def bug_confirm_order() -> tuple[Row, ...]:
    """v1_confirm checks torn before "the model changed while it waited"."""
    a = _find("v1_confirm", code="MODEL_BUSY")
    b = _find("v1_confirm", code="WEIGHTS_TORN")
    out = list(TABLE)
    i, j = out.index(a), out.index(b)
    out[i], out[j] = out[j], out[i]
    return tuple(out)


def bug_second_attachment() -> tuple[Row, ...]:
    """attach loses its ALREADY_ATTACHED refusal."""
    return _drop(TABLE, _find("attach", code="ALREADY_ATTACHED"))


def bug_load_while_attached() -> tuple[Row, ...]:
    """a management load no longer checks the attachment."""
    return _drop(TABLE, _find("model_load", code="ALREADY_ATTACHED"))


def bug_resume_cleans_torn() -> tuple[Row, ...]:
    """resume "repairs" a torn set."""
    row = _find("resume", kind="accepted", when=("held_by_holder",))
    return _swap(TABLE, row, _set(row, weights="clean"))


def bug_no_late_timer_row() -> tuple[Row, ...]:
    """hold_expired has no row for a timer that fires after it was cancelled."""
    return _drop(TABLE, _find("hold_expired", kind="ignored"))


def bug_unreachable_code() -> tuple[Row, ...]:
    """clear-stale forgets ATTACHMENT_NOT_STALE (and clears active attachments)."""
    return _drop(TABLE, _find("clear_stale", code="ATTACHMENT_NOT_STALE"))


def bug_illegal_reason() -> tuple[Row, ...]:
    """quiesce answers PAUSE_IN_PROGRESS with a reason the code does not allow."""
    row = _find("quiesce", code="PAUSE_IN_PROGRESS")
    return _swap(TABLE, row, replace(row, refuse=Refusal(codes.PAUSE_IN_PROGRESS, "holder")))


def bug_refusal_with_effect() -> tuple[Row, ...]:
    """a refusal that still changes state: NO_OPEN_COMMIT marks the set torn."""
    row = _find("commit_end", code="NO_OPEN_COMMIT")
    return _swap(TABLE, row, _set(row, weights="torn"))


def bug_swapped_refusal_order() -> tuple[Row, ...]:
    """quiesce checks ALREADY_QUIESCED before WEIGHTS_NOT_CLEAN (the spec's order is the
    other way round)."""
    a = _find("quiesce", code="WEIGHTS_NOT_CLEAN")
    b = _find("quiesce", code="ALREADY_QUIESCED")
    out = list(TABLE)
    i, j = out.index(a), out.index(b)
    out[i], out[j] = out[j], out[i]
    return tuple(out)


CHECKER_BUGS = {
    bug_missing_guard: "holder_quiesce_has_holder",
    bug_wrong_destination: "writing_implies_open_commit_or_weights_load",
    bug_timer_left_armed: "hold_timer_armed_exactly_when_clean_holder_quiesce_without_commit_or_takeover",
    bug_missing_hold_row: "nothing_served_unless_clean_and_not_held",
    bug_confirm_ignores_a_changed_resident: "nothing_served_unless_clean_and_not_held",
    bug_second_attachment: "one_attachment_at_most",
    bug_load_while_attached: "while_attached_no_load_unload_or_swap",
    bug_resume_cleans_torn: "torn_left_only_by_late_commit_end_weights_load_or_unload",
    bug_no_late_timer_row: "totality",
    bug_illegal_reason: "refusal_code_and_reason_legal",
    bug_refusal_with_effect: "refusal_changes_nothing",
}


@pytest.mark.parametrize("plant", list(CHECKER_BUGS), ids=lambda f: f.__name__)
def test_checker_catches_planted_bug(plant) -> None:
    report = check(plant(), stop_at_first=True)
    assert not report.ok
    names = [v.invariant for v in report.violations]
    assert CHECKER_BUGS[plant] in names, report.render()
    violation = next(v for v in report.violations if v.invariant == CHECKER_BUGS[plant])
    text = violation.render()
    # a readable trace: starts at the start state, one numbered step per event, ends in a row
    assert text.splitlines()[1].strip().startswith("0. start ")
    assert "#" in text.splitlines()[-1] or "no row fires" in text.splitlines()[-1]
    assert len(violation.trace) >= 2


def test_checker_reports_unreached_code_of_the_weights_page() -> None:
    report = check(bug_unreachable_code())
    assert not report.ok
    assert "ATTACHMENT_NOT_STALE:-" in report.unreached_codes
    assert "codes never produced" in report.render()


def test_swapped_refusal_order_passes_the_invariants_but_fails_the_stateful_test() -> None:
    table = bug_swapped_refusal_order()
    # no invariant is about the order of two refusals ...
    assert check(table).violations == []
    # ... but the reference model, written from the spec's sentences, disagrees.
    machine = make_machine(table)
    profile = settings(  # stops at the first failure: a large budget costs only a miss
        max_examples=1000,
        stateful_step_count=50,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=[HealthCheck.too_slow],
    )
    with pytest.raises(AssertionError) as err:
        run_state_machine_as_test(machine, settings=profile)
    assert "WEIGHTS_NOT_CLEAN" in str(err.value) and "ALREADY_QUIESCED" in str(err.value)


def test_v1_confirm_order_passes_the_invariants_but_fails_the_stateful_test() -> None:
    """The reference model holds v1_confirm to its order: the changed-resident refusal comes
    before the torn one (a request for a model that is gone is told to retry)."""
    table = bug_confirm_order()
    assert check(table).violations == []
    profile = settings(  # stops at the first failure: a large budget costs only a miss
        max_examples=1000,
        stateful_step_count=50,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=[HealthCheck.too_slow],
    )
    with pytest.raises(AssertionError) as err:
        run_state_machine_as_test(make_machine(table), settings=profile)
    assert "v1_confirm" in str(err.value) and "WEIGHTS_TORN" in str(err.value)


def bug_unsaved_before_transition() -> tuple[Row, ...]:
    """/v1 naming another model checks unsaved commits before a transition in progress (the
    order before finding 8: 409 WEIGHTS_UNSAVED, "save first", during the operator's swap)."""
    a = _find("v1", code="MODEL_BUSY", when=("in_transition",))
    b = _find("v1", code="WEIGHTS_UNSAVED")
    out = list(TABLE)
    i, j = out.index(a), out.index(b)
    out[i], out[j] = out[j], out[i]
    return tuple(out)


def bug_abandoned_transition_keeps_running() -> tuple[Row, ...]:
    """A transition abandoned at the drain timeout is still counted as running."""
    row = _find("transition_abandoned", kind="accepted")
    return _swap(TABLE, row, _unset(row, "transition"))


def test_abandoned_transition_bug_fails_the_checker_and_the_stateful_test() -> None:
    """The invariant that a transition's end leaves no transition running (issue 19) catches
    it; the reference model (recorded decision: an abandoned transition changes nothing and
    ends) disagrees too."""
    table = bug_abandoned_transition_keeps_running()
    violated = [v.invariant for v in check(table).violations]
    assert violated == ["a_model_transition_ends_with_the_resident_its_end_says"]
    profile = settings(  # stops at the first failure: a large budget costs only a miss
        max_examples=1000,
        stateful_step_count=50,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=[HealthCheck.too_slow],
    )
    with pytest.raises(AssertionError) as err:
        run_state_machine_as_test(make_machine(table), settings=profile)
    assert "model_transition" in str(err.value)


def test_unsaved_before_transition_bug_disagrees_with_the_reference() -> None:
    """The program that shows it is too deep for the stateful test's budget (unsaved commits,
    detach, a swap, then /v1), so it is run as a script: the production table and the
    reference agree on every step; the planted table does not on the last."""
    from miserver.fsm.machine import Lifecycle
    from miserver.fsm.state import Caller, Event
    from tests.model.reference import Reference
    from tests.model.stateful import _same

    trainer = Caller("trainer", "t")

    def program(core: Lifecycle, ref: Reference) -> None:
        holder = Caller("trainer", "t", "att-1")
        steps = [
            (Event("model_load", target="other"), lambda: ref.model_load(0.0, "other")),
            (Event("transition_done"), lambda: ref.transition_done(0.0)),
            (Event("attach", caller=trainer), lambda: ref.attach(trainer, 0.0)),
            (Event("quiesce", caller=holder), lambda: ref.quiesce(holder, 0.0)),
            (Event("drained"), lambda: ref.drained(0.0)),
            (Event("commit_begin", caller=holder), lambda: ref.commit_begin(holder, 0.0)),
            (Event("commit_end", caller=holder), lambda: ref.commit_end(holder, 0.0)),
            (Event("detach", caller=holder), lambda: ref.detach(holder, 0.0)),
            (Event("model_load", target="other"), lambda: ref.model_load(0.0, "other")),
            (Event("v1", target="other"), lambda: ref.v1(0.0, "other", False, False)),
        ]
        for event, call in steps:
            _same(core.handle(event, 0.0), call(), event.short())

    def run(table: tuple[Row, ...]) -> None:
        ref = Reference()
        program(Lifecycle(table=table, id_factory=lambda: "att-1"), ref)

    run(TABLE)
    with pytest.raises(AssertionError) as err:
        run(bug_unsaved_before_transition())
    assert "v1" in str(err.value) and "WEIGHTS_UNSAVED" in str(err.value)


# --- contract 4b: a quiesce that holds running work (issue 30) ------------------------------
def bug_resume_forgets_the_parked() -> tuple[Row, ...]:
    """resume after a hold releases the held requests but never continues the parked
    sequences (its parked variant loses RESUME_PARKED): they would wait for ever."""
    row = next(r for r in TABLE if r.trigger == "resume" and "parked" in r.when)
    effects = tuple(e for e in row.effects if e.name != "RESUME_PARKED")
    return _swap(TABLE, row, replace(row, effects=effects))


def bug_tear_keeps_the_parked() -> tuple[Row, ...]:
    """the watchdog tears the holder's commit but leaves the parked sequences parked (its
    parked variant loses ``parked=False``): they would continue on a torn set."""
    row = next(
        r
        for r in TABLE
        if r.trigger == "watchdog_expired" and r.when == ("watchdog_armed", "commit_mine", "parked")
    )
    return _swap(TABLE, row, _unset(row, "parked"))


def bug_hold_made_a_drain() -> tuple[Row, ...]:
    """quiesce's finish row loses ``unless running_hold``: a hold is answered as a drain (the
    running sequences finish instead of being parked: a fake hold)."""
    row = next(r for r in TABLE if r.trigger == "quiesce" and r.unless == ("running_hold",))
    return _swap(TABLE, row, replace(row, unless=()))


HOLD_BUGS = {
    bug_resume_forgets_the_parked: "parked_sequences_parked_by_a_hold_and_continued_or_ended_torn",
    bug_tear_keeps_the_parked: "parked_sequences_only_while_held_and_not_torn",
    bug_hold_made_a_drain: "parked_sequences_parked_by_a_hold_and_continued_or_ended_torn",
}


@pytest.mark.parametrize("plant", list(HOLD_BUGS), ids=lambda f: f.__name__)
def test_checker_catches_planted_hold_bug(plant) -> None:
    report = check(plant(), stop_at_first=True)
    assert not report.ok
    names = [v.invariant for v in report.violations]
    assert HOLD_BUGS[plant] in names, report.render()
