"""The server's decision path (``Lifecycle`` without ``via_machine``: the decision lookup plus a
per-(state, row) ``_Plan``) gives exactly the outcomes and snapshots of the general path that
``miserver check`` steps (``via_machine=True``: the compiled ``transitions`` machine, then
``_apply_context`` and ``_outcome``), in every state and for every event the checker reaches,
under contexts that exercise each context-dependent branch (issue 15)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from miserver.fsm import machine as machine_module
from miserver.fsm.check import HOLDER_ID, alphabet, canonical_context, check
from miserver.fsm.compiled import TableError
from miserver.fsm.context import Provenance
from miserver.fsm.machine import Lifecycle, Snapshot
from miserver.fsm.state import Caller, Event, LifecycleState
from miserver.fsm.table import TABLE


def _contexts(state: LifecycleState):
    base = canonical_context(state)
    yield base
    # an open (or torn) commit, a hold, armed timers, an overrun on record
    yield replace(
        base,
        commit_began_at=3.0,
        quiesced_at=2.0,
        hold_deadline=12.0,
        watchdog_deadline=11.0,
        heartbeat_deadline=30.0,
        drain_deadline=9.0,
        last_overrun=(1.0, 5.0),
        stale_since=4.0 if state.attachment == "stale" else None,
    )
    # a commit the watchdog tore, still open; counters and an adapter's provenance
    yield replace(
        base,
        commit_began_at=3.0,
        commit_torn_at=4.0,
        commit_timed_out=True,
        commit_overran=4.0,
        steps_since_load=7 if state.resident else None,
        saved_steps=2,
        commits_since_name=5 if state.resident else None,
        served_name="m" if state.resident else None,
        served_origin="adapter" if state.adapter else "checkpoint",
        before_adapter=Provenance("base", "model", 1, 2) if state.adapter else None,
        saves=3,
        exports=4,
    )
    # a torn commit that is over (no began_at), a detach-torn one (not timed out)
    yield replace(base, commit_torn_at=4.0, commit_timed_out=False)
    yield replace(base, commit_began_at=None, commit_timed_out=True)


def _run(core: Lifecycle, snap: Snapshot, event: Event):
    core.restore(snap)
    try:
        out = core.handle(event, 10.0)
    except TableError as exc:
        return ("TableError", str(exc)), None
    return out, core.snapshot()


def _reachable() -> list[LifecycleState]:
    report = check(TABLE, keep_steps=True)
    states = {LifecycleState()} | {s for s, *_ in report.steps} | {a for *_, a in report.steps}
    return sorted(states, key=lambda s: s.short())


@pytest.mark.full  # 9 s on two cores: in `make test`; the quick suite keeps the other plan tests
def test_the_plan_path_equals_the_machine_path_in_every_reachable_state_event_and_context():
    fast = Lifecycle(table=TABLE, id_factory=lambda: HOLDER_ID)
    slow = Lifecycle(table=TABLE, id_factory=lambda: HOLDER_ID, via_machine=True)
    events = alphabet(dict.fromkeys(r.trigger for r in TABLE))
    # the checker's events, plus named completions (the served name a load or adapter sets)
    events += tuple(
        Event(t, name="named", origin=origin, commits=3, applied=applied)
        for origin in ("checkpoint", None)
        for applied in (True, False)
        for t in ("transition_done", "weights_load_done", "save_done", "adapter_done")
        if t in {r.trigger for r in TABLE}
    )
    n = accepted = 0
    for state in _reachable():
        for ctx in _contexts(state):
            snap = Snapshot(state, ctx)
            for event in events:
                a, snap_a = _run(fast, snap, event)
                b, snap_b = _run(slow, snap, event)
                assert a == b, (state.short(), event.short(), ctx)
                assert snap_a == snap_b, (state.short(), event.short(), ctx)
                if snap_a is not None:
                    assert vars(a) == vars(b)  # every field, details in the same order
                    assert list(a.details) == list(b.details)
                    accepted += a.kind == "accepted"
                n += 1
    assert n > 50_000 and accepted > 5_000


def test_the_server_path_uses_plans_and_the_checker_path_does_not(monkeypatch):
    calls = []
    real = Lifecycle._handle_planned

    def counting(self, *args):
        calls.append(self.via_machine)
        return real(self, *args)

    monkeypatch.setattr(Lifecycle, "_handle_planned", counting)
    holder = Caller(token="trainer", label="trn", attachment_id=HOLDER_ID)
    for via in (False, True):
        core = Lifecycle(resident=True, id_factory=lambda: HOLDER_ID, via_machine=via)
        core.handle(Event("attach", caller=Caller(token="trainer", label="trn")), 1.0)
        core.handle(Event("quiesce", caller=holder), 2.0)
        core.handle(Event("resume", caller=Caller("none")), 3.0)  # refused: no plan call
    assert calls == [False, False]


def test_a_plan_is_read_once_per_source_state_and_row_and_follows_a_new_row_object():
    holder = Caller(token="trainer", label="trn", attachment_id=HOLDER_ID)
    core = Lifecycle(resident=True, id_factory=lambda: HOLDER_ID)
    core.handle(Event("attach", caller=Caller(token="trainer", label="trn")), 1.0)
    sizes = []
    for i in range(4):
        for t in ("quiesce", "drained", "commit_begin", "commit_end", "resume"):
            core.handle(Event(t, caller=holder) if t != "drained" else Event(t), 2.0 + i)
        sizes.append(len(core._plans))
    assert sizes[1] == sizes[2] == sizes[3] <= 11  # once the states repeat, no new plan
    assert core.context.steps_since_load == 4
    # a plan cached for a row object that is not the deciding one is rebuilt
    key, plan = next((k, p) for k, p in core._plans.items() if p.row.trigger == "quiesce")
    stale = machine_module._Plan(replace(plan.row, effects=()), plan.before, {})
    core._plans[key] = stale
    core.restore(Snapshot(plan.before, core.context))
    out = core.handle(Event("quiesce", caller=holder), 9.0)
    assert out.effects == plan.row.effects and core._plans[key].row is plan.row


def test_the_plan_reads_the_timer_durations_when_it_runs():
    holder = Caller(token="trainer", label="trn", attachment_id=HOLDER_ID)
    core = Lifecycle(resident=True, id_factory=lambda: HOLDER_ID, hold_timeout_s=5.0)
    core.handle(Event("attach", caller=Caller(token="trainer", label="trn")), 1.0)
    core.handle(Event("quiesce", caller=holder), 2.0)
    core.handle(Event("drained"), 2.0)
    assert core.context.hold_deadline == pytest.approx(7.0)
    core.handle(Event("resume", caller=holder), 3.0)
    core.durations["hold"] = 1.0
    core.handle(Event("quiesce", caller=holder), 4.0)
    core.handle(Event("drained"), 4.0)
    assert core.context.hold_deadline == pytest.approx(5.0)
