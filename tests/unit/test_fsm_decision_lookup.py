"""The decision lookup (``Compiled.decide``) the server decides through makes exactly the
decisions of the compiled ``transitions`` machine (``Compiled.fire``), which ``miserver check``
steps; the checker reports a lookup that disagrees (issue 15)."""

from __future__ import annotations

import pytest

from miserver.fsm import check as check_module
from miserver.fsm.check import HOLDER_ID, alphabet, canonical_context, check
from miserver.fsm.compiled import Alternative, TableError, compile_table
from miserver.fsm.machine import Lifecycle
from miserver.fsm.state import Caller, Event, LifecycleState
from miserver.fsm.table import TABLE, Row


def _outcome(compiled, how: str, state: LifecycleState, event: Event):
    try:
        row, named = getattr(compiled, how)(state, canonical_context(state), event)
    except TableError as exc:
        return ("TableError", str(exc))
    return (row.id, dict(named))


def _reachable(table: tuple[Row, ...]) -> list[LifecycleState]:
    report = check(table, keep_steps=True)
    states = {LifecycleState()} | {s for s, *_ in report.steps} | {a for *_, a in report.steps}
    return sorted(states, key=lambda s: s.short())


def _compare(table: tuple[Row, ...]) -> int:
    compiled = compile_table(table)
    events = alphabet(dict.fromkeys(r.trigger for r in table))
    n = 0
    for state in _reachable(table):
        for event in events:
            assert _outcome(compiled, "decide", state, event) == _outcome(
                compiled, "fire", state, event
            ), (state.short(), event.short())
            n += 1
    return n


def test_the_lookup_decides_as_the_machine_in_every_reachable_state_and_event():
    assert _compare(TABLE) > 10_000


@pytest.mark.full  # seconds to tens of seconds: left out of make quick
def test_the_lookup_follows_a_changed_table_row_order_and_a_dropped_row():
    # a mutated table (issue 19 mutates it): the lookup is read out of its own machine
    quiesce = [i for i, r in enumerate(TABLE) if r.trigger == "quiesce"]
    a, b = quiesce[-2], quiesce[-3]  # swap two refusals of quiesce
    swapped = list(TABLE)
    swapped[a], swapped[b] = swapped[b], swapped[a]
    _compare(tuple(swapped))
    dropped = tuple(r for r in TABLE if not (r.trigger == "resume" and r.kind == "accepted"))
    _compare(dropped)  # some events then have no row: both raise the same TableError


def test_unknown_triggers_and_missing_rows_raise_as_the_machine_does():
    compiled = compile_table(TABLE)
    state = LifecycleState()
    for how in ("fire", "decide"):
        with pytest.raises(TableError, match="unknown trigger 'nope'"):
            getattr(compiled, how)(state, canonical_context(state), Event("nope"))
    no_resume = tuple(r for r in TABLE if r.trigger != "drained" or r.kind == "accepted")
    c2 = compile_table(no_resume)
    msgs = {
        how: _outcome(c2, how, state, Event("drained")) for how in ("fire", "decide")
    }  # the ignore row of drained is gone: in the start state no alternative fires
    assert msgs["fire"] == msgs["decide"] and msgs["fire"][0] == "TableError"


def test_the_server_decides_through_the_lookup_and_the_checker_through_the_machine(monkeypatch):
    compiled = compile_table(TABLE)
    calls = {"fire": 0, "decide": 0}
    for how in calls:
        real = getattr(compiled, how)

        def counting(*args, _real=real, _how=how):
            calls[_how] += 1
            return _real(*args)

        monkeypatch.setattr(compiled, how, counting)
    Lifecycle(resident=True).handle(Event("attach"), 1.0)
    assert calls == {"fire": 0, "decide": 1}
    Lifecycle(resident=True, via_machine=True).handle(Event("attach"), 1.0)
    assert calls == {"fire": 1, "decide": 1}


@pytest.mark.full  # seconds to tens of seconds: left out of make quick
def test_the_checker_reports_a_lookup_that_disagrees_with_the_machine(monkeypatch):
    table = TABLE
    compiled = compile_table(table)
    key = next(k for k in compiled.lookup if k[1] == "resume" and len(compiled.lookup[k]) > 1)
    alts = compiled.lookup[key]
    wrong = Alternative(alts[-1].row, (), alts[-1].named)  # always fires the last row there
    monkeypatch.setitem(compiled.lookup, key, (wrong,))
    report = check_module.check(table)
    found = [v for v in report.violations if v.invariant == "determinism"]
    assert found and "the decision lookup" in found[0].detail
    monkeypatch.undo()
    assert not check_module.check(table).violations


def test_a_write_cycle_decided_by_both_paths_gives_the_same_outcomes_and_snapshots():
    holder = Caller(token="trainer", label="trn", attachment_id=HOLDER_ID)
    events = [Event("attach", caller=Caller(token="trainer", label="trn"))] + [
        Event(t, caller=holder) if t != "drained" else Event(t)
        for t in ("quiesce", "drained", "commit_begin", "commit_end", "resume", "detach")
    ]
    fast = Lifecycle(resident=True, id_factory=lambda: HOLDER_ID)
    slow = Lifecycle(resident=True, id_factory=lambda: HOLDER_ID, via_machine=True)
    for i, event in enumerate(events):
        a, b = fast.handle(event, 1.0 + i), slow.handle(event, 1.0 + i)
        assert a == b and a.kind == "accepted", (event.short(), a.row, b.row)
        assert fast.snapshot() == slow.snapshot()
    assert fast.context.steps_since_load == 1
