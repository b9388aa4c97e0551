"""``miserver check``: breadth-first over every reachable state of the lifecycle table.

The step function is the production machine itself (:class:`~miserver.fsm.machine.Lifecycle`
over the compiled ``transitions.Machine``). Every event of the alphabet (each gated route with
each kind of caller, every internal completion and timer expiry, every parameter value that
changes a decision) is offered in every reachable state. Checked:

- totality and determinism: each ``(state, event)`` has exactly one outcome (one row fires,
  and firing it again from the same snapshot, through the decision lookup the server decides
  with, :meth:`~miserver.fsm.compiled.Compiled.decide`, gives the same row and state);
- the named invariants of :mod:`miserver.fsm.invariants`, in every state and on every edge;
- non-vacuity: every machine state, every component value, every row of the table, and every
  code and reason the table can produce is reached, including every code and reason of the
  weights page (:data:`miserver.spec.codes.WEIGHTS_PAGE_CODES`).

A violation comes with the shortest trace from the start state (breadth-first).
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from miserver.fsm.compiled import TableError, compile_table
from miserver.fsm.context import Context
from miserver.fsm.invariants import EDGE_INVARIANTS, STATE_INVARIANTS
from miserver.fsm.machine import Lifecycle, Snapshot
from miserver.fsm.state import DOMAINS, STATE_FIELDS, Caller, Event, LifecycleState
from miserver.fsm.table import ROUTE_AUTH, TABLE, Row
from miserver.spec import codes

HOLDER_ID = "attachment-A"
HOLDER = Caller("trainer", "t", HOLDER_ID)
CALLERS: tuple[Caller, ...] = (
    Caller("none"),
    Caller("invalid"),
    HOLDER,
    Caller("trainer", "t2"),  # a valid trainer token that is not the holder
    Caller("operator", "op"),  # an operator token (not the holder)
)


def alphabet(triggers: Iterable[str]) -> tuple[Event, ...]:
    """Every event the checker offers: each trigger with each value that changes a decision."""
    events: list[Event] = []
    for trigger in triggers:
        if trigger in ROUTE_AUTH:
            events += [Event(trigger, caller=c) for c in CALLERS]
        if trigger == "attach":
            events += [
                Event(trigger, caller=HOLDER, not_attachable=r)
                for r in ("gguf", "quantized", "dtype", "not_on_gpu", "allocator")
            ]
        elif trigger == "quiesce":
            # contract 4b: the hold variant with each fact that changes its decision
            events += [
                Event(trigger, caller=HOLDER, queue_full=True),
                Event(trigger, caller=HOLDER, running="hold"),
                Event(trigger, caller=HOLDER, running="hold", queue_full=True),
                Event(trigger, caller=HOLDER, running="hold", hold_supported=False),
                Event(trigger, caller=Caller("trainer", "t2"), running="hold"),
            ]
        elif trigger == "commit_end":
            events.append(Event(trigger, caller=HOLDER, received=False))
        elif trigger == "commit_begin":
            events.append(Event(trigger, caller=HOLDER, group_ok=False))
        elif trigger == "weights_load":
            events += [Event(trigger, caller=c, in_place=False) for c in (HOLDER, CALLERS[4])]
            # contract 4a: a GGUF resident, loaded into from a checkpoint or reloaded by row
            events += [
                Event(trigger, caller=c, in_place=False, resident_gguf=True, checkpoint_load=k)
                for c in (HOLDER, CALLERS[4])
                for k in (True, False)
            ]
        elif trigger == "save":
            events += [Event(trigger, caller=c, resident_gguf=True) for c in CALLERS]
        elif trigger == "adapter_change":
            events += [Event(trigger), Event(trigger, resident_gguf=True)]
        elif trigger == "v1":
            # every combination the HTTP layer sends: the target (a request without a
            # catalogue row names "the resident", also while nothing is resident), the refuse
            # policy and a full queue are independent
            events += [
                Event(trigger, target=target, refuse_policy=refuse, queue_full=full)
                for target in ("resident", "other")
                for refuse in (False, True)
                for full in (False, True)
            ]
        elif trigger == "v1_confirm":
            events += [Event(trigger, same_resident=True), Event(trigger, same_resident=False)]
        elif trigger == "model_load":
            events += [Event(trigger, target="resident"), Event(trigger, target="other")]
        elif trigger == "settings_change":
            events += [Event(trigger, avail=a) for a in ("ok", "cbm", "concurrency")]
        elif trigger == "catalogue_delete":
            events += [Event(trigger, loads_checking=c) for c in (False, True)]
        elif trigger == "adapter_done":
            events += [Event(trigger, applied=True), Event(trigger, applied=False)]
        elif trigger == "transition_failed":
            events += [Event(trigger, after_failure=f) for f in ("nothing", "kept", "reloaded")]
        elif trigger not in ROUTE_AUTH:
            events.append(Event(trigger))
    return tuple(events)


def canonical_context(state: LifecycleState) -> Context:
    """The context the checker pairs with an abstract state (the holder is :data:`HOLDER`)."""
    if state.attachment == "none":
        return Context(steps_since_load=0 if state.resident else None)
    return Context(
        attachment_id=HOLDER_ID,
        attachment_label="t",
        attachment_role="trainer",
        attached_at=0.0,
        steps_since_load=0,
    )


@dataclass
class Violation:
    """A broken property with the shortest trace that shows it."""

    invariant: str
    trace: list[str]
    detail: str = ""

    def render(self) -> str:
        lines = [f"VIOLATION {self.invariant}: {self.detail}".rstrip(": ")]
        lines += [f"  {n:2d}. {step}" for n, step in enumerate(self.trace)]
        return "\n".join(lines)


@dataclass
class Report:
    """The checker's result; :attr:`ok` is true when nothing is violated or unreached."""

    states: int = 0
    named_states: int = 0
    named_states_total: int = 0
    edges: int = 0
    transitions: int = 0
    rows: int = 0
    rows_used: int = 0
    events: int = 0
    seconds: float = 0.0
    invariants: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    unreached_states: list[str] = field(default_factory=list)
    unreached_values: list[str] = field(default_factory=list)
    unused_rows: list[str] = field(default_factory=list)
    unreached_codes: list[str] = field(default_factory=list)
    codes_reached: list[str] = field(default_factory=list)
    #: every reachable step ``(before, trigger, row id, after)`` when asked for (diagrams)
    steps: set[tuple[LifecycleState, str, str, LifecycleState]] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return not (
            self.violations
            or self.unreached_states
            or self.unreached_values
            or self.unused_rows
            or self.unreached_codes
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "states": self.states,
            "named_states": self.named_states,
            "named_states_total": self.named_states_total,
            "edges": self.edges,
            "transitions": self.transitions,
            "rows": self.rows,
            "rows_used": self.rows_used,
            "events": self.events,
            "seconds": round(self.seconds, 3),
            "invariants": self.invariants,
            "violations": [
                {"invariant": v.invariant, "detail": v.detail, "trace": v.trace}
                for v in self.violations
            ],
            "unreached_states": self.unreached_states,
            "unreached_values": self.unreached_values,
            "unused_rows": self.unused_rows,
            "unreached_codes": self.unreached_codes,
            "codes_reached": self.codes_reached,
        }

    def render(self) -> str:
        lines = [
            f"miserver check: {'OK' if self.ok else 'FAILED'}",
            f"  states      {self.states} reachable ({self.named_states} of "
            f"{self.named_states_total} machine states)",
            f"  edges       {self.edges} ({self.events} events offered in every state)",
            f"  table       {self.rows} rows ({self.rows_used} used), "
            f"{self.transitions} compiled transitions",
            f"  codes       {len(self.codes_reached)} code/reason pairs reached",
            f"  invariants  {len(self.invariants)} checked, {len(self.violations)} violated",
            f"  time        {self.seconds:.2f} s",
        ]
        for name in self.invariants:
            bad = any(v.invariant == name for v in self.violations)
            lines.append(f"    [{'FAIL' if bad else ' ok '}] {name}")
        for v in self.violations:
            lines.append(v.render())
        for label, items in (
            ("unreached machine states", self.unreached_states),
            ("unreached component values", self.unreached_values),
            ("rows never used", self.unused_rows),
            ("codes never produced", self.unreached_codes),
        ):
            if items:
                lines.append(
                    f"  {label} ({len(items)}): "
                    + ", ".join(items[:20])
                    + (" ..." if len(items) > 20 else "")
                )
        return "\n".join(lines)


def _required_codes(table: tuple[Row, ...]) -> set[str]:
    """Every code/reason pair the table can produce, plus every one of the weights page."""
    need: set[str] = set()
    for row in table:
        for ans in (row.refuse, row.pending):
            if ans is not None and ans.code is not None:
                need.add(f"{ans.code.name}:{ans.reason or '-'}")
    for name in codes.WEIGHTS_PAGE_CODES:
        code = codes.lookup(name)
        if code.reasons:
            need |= {f"{name}:{r}" for r in code.reasons}
        elif not any(k.startswith(name + ":") for k in need):
            need.add(f"{name}:-")
    return need


@dataclass(frozen=True)
class Step:
    """What the checker records for one ``(state, event)``: the row that fired (``None``: no
    row fired, ``error`` says why), the state after, the code/reason pairs produced, whether
    firing it again gave the same, and the edge invariants it breaks."""

    row: str | None
    after: LifecycleState | None
    codes: tuple[str, ...] = ()
    deterministic: bool = True
    broken: tuple[str, ...] = ()
    error: str = ""
    again: str = ""


def _take_step(
    core: Lifecycle,
    by_id: dict[str, Row],
    state: LifecycleState,
    snap: Snapshot,
    event: Event,
    again_core: Lifecycle | None = None,
) -> Step:
    """Fire ``event`` from ``snap`` through ``core`` (the compiled machine, stepped), then
    again through ``again_core`` (the decision lookup the server decides with; ``core`` when
    None): the two must agree."""
    core.restore(snap)
    try:
        out = core.handle(event, 10.0)
    except TableError as exc:
        return Step(None, None, error=str(exc))
    found: list[str] = []
    if out.code is not None:
        found.append(f"{out.code.name}:{out.reason or '-'}")
    if out.pending is not None and out.pending.code is not None:
        found.append(f"{out.pending.code.name}:{out.pending.reason or '-'}")
    second = again_core or core
    second.restore(snap)
    try:
        again = second.handle(event, 10.0)
    except TableError as exc:
        same, again_row = False, f"no row ({exc})"
    else:
        same, again_row = (again.row, again.after) == (out.row, out.after), again.row
    if not same and again_core is not None:
        again_row = f"{again_row} through the decision lookup"
    row = by_id[out.row]
    broken = tuple(name for name, inv in EDGE_INVARIANTS if not inv(state, event, row, out.after))
    return Step(out.row, out.after, tuple(found), same, broken, again=again_row)


class StepCache:
    """The checker's steps over one base table, memoised so that checking many tables that
    differ from it in the rows of a few triggers (the mutation tester's one-row mutants) runs
    only those triggers' events through the machine.

    A step of an event whose trigger has the same rows (same ids, same order) in both tables
    is the same step: the compiled alternatives of a trigger are built from its rows alone.
    """

    def __init__(self, base: tuple[Row, ...] = TABLE) -> None:
        self.base = base
        self.core = Lifecycle(table=base, id_factory=lambda: HOLDER_ID, via_machine=True)
        self.fast = Lifecycle(table=base, id_factory=lambda: HOLDER_ID)
        self.by_id = {r.id: r for r in base}
        self.transitions = compile_table(base).transitions_count
        self.steps: dict[tuple[LifecycleState, Event], Step] = {}
        self._rows = _rows_by_trigger(base)

    def changed(self, table: tuple[Row, ...]) -> set[str]:
        """The triggers whose rows differ between ``table`` and the base table."""
        rows = _rows_by_trigger(table)
        return {t for t in rows.keys() | self._rows.keys() if rows.get(t) != self._rows.get(t)}

    def step(self, state: LifecycleState, snap: Snapshot, event: Event) -> Step:
        key = (state, event)
        got = self.steps.get(key)
        if got is None:
            got = self.steps[key] = _take_step(self.core, self.by_id, state, snap, event, self.fast)
        return got


def _rows_by_trigger(table: tuple[Row, ...]) -> dict[str, tuple[tuple[str, Row], ...]]:
    out: dict[str, list[tuple[str, Row]]] = {}
    for row in table:
        out.setdefault(row.trigger, []).append((row.id, row))
    return {t: tuple(rows) for t, rows in out.items()}


def check(
    table: tuple[Row, ...] = TABLE,
    *,
    max_states: int = 200_000,
    stop_at_first: bool = False,
    keep_steps: bool = False,
    reuse: StepCache | None = None,
) -> Report:
    """Explore ``table`` breadth-first and return the :class:`Report`.

    ``stop_at_first``: stop after the first state whose events show a violation (planted-bug
    tests); ``keep_steps``: record every reachable step in :attr:`Report.steps`; ``reuse``:
    take the steps of every trigger whose rows are those of ``reuse.base`` from that cache
    (the same result, faster, for tables that differ from the base in a few triggers).
    """
    t0 = time.perf_counter()
    by_id = {r.id: r for r in table}
    if reuse is not None:
        fresh = reuse.changed(table)
        mine = tuple(r for r in table if r.trigger in fresh)
        core = Lifecycle(table=mine, id_factory=lambda: HOLDER_ID, via_machine=True)
        fast = Lifecycle(table=mine, id_factory=lambda: HOLDER_ID)
        # a trigger's compiled transitions are built from its rows alone: count only the
        # changed ones anew
        theirs = tuple(r for r in reuse.base if r.trigger in fresh)
        sub = compile_table(mine)
        states = sub.states
        transitions = reuse.transitions - compile_table(theirs).transitions_count
        transitions += sub.transitions_count
    else:
        fresh = None
        # The checker steps the machine; the server decides through the lookup read out of
        # the same machine: each step is fired through both, and they must agree.
        core = Lifecycle(table=table, id_factory=lambda: HOLDER_ID, via_machine=True)
        fast = Lifecycle(table=table, id_factory=lambda: HOLDER_ID)
        compiled = compile_table(table)
        states, transitions = compiled.states, compiled.transitions_count
    triggers = list(dict.fromkeys(row.trigger for row in table))
    events = alphabet(triggers)
    report = Report(
        invariants=[n for n, _ in STATE_INVARIANTS]
        + [n for n, _ in EDGE_INVARIANTS]
        + ["totality", "determinism"]
    )
    report.rows = len(table)
    report.transitions = transitions
    report.events = len(events)
    start = LifecycleState()
    parent: dict[LifecycleState, tuple[LifecycleState, Event, str] | None] = {start: None}
    queue: deque[LifecycleState] = deque([start])
    used_rows: set[str] = set()
    reached_codes: set[str] = set()
    violated: set[str] = set()

    def trace(
        state: LifecycleState, last: tuple[Event, str, LifecycleState] | None = None
    ) -> list[str]:
        steps: list[str] = []
        cur: LifecycleState | None = state
        while cur is not None and parent[cur] is not None:
            prev, ev, row_id = parent[cur]  # type: ignore[misc]
            steps.append(f"{ev.short()} -> [{row_id}] {cur.short()}")
            cur = prev
        steps.append(f"start {start.short()}")
        steps.reverse()
        if last is not None:
            ev, row_id, after = last
            steps.append(f"{ev.short()} -> [{row_id}] {after.short()}")
        return steps

    def violate(
        name: str,
        state: LifecycleState,
        detail: str,
        last: tuple[Event, str, LifecycleState] | None = None,
    ) -> None:
        if name in violated:
            return
        violated.add(name)
        report.violations.append(Violation(name, trace(state, last), detail))

    for name, inv in STATE_INVARIANTS:
        if not inv(start):
            violate(name, start, "the start state")

    while queue:
        state = queue.popleft()
        snap = Snapshot(state, canonical_context(state))
        for event in events:
            if fresh is None or event.trigger in fresh:
                step = _take_step(core, by_id, state, snap, event, fast)
            else:
                step = reuse.step(state, snap, event)  # type: ignore[union-attr]
            if step.row is None:
                violate("totality", state, step.error, (event, "no row fires", state))
                continue
            row_id = step.row
            after = step.after
            assert after is not None
            report.edges += 1
            used_rows.add(row_id)
            if keep_steps:
                report.steps.add((state, event.trigger, row_id, after))
            reached_codes.update(step.codes)
            if not step.deterministic:
                violate(
                    "determinism",
                    state,
                    f"{event.short()} gave {row_id} then {step.again}",
                    (event, row_id, after),
                )
            for name in step.broken:
                violate(name, state, f"on {event.short()}", (event, row_id, after))
            if after in parent:
                continue
            parent[after] = (state, event, row_id)
            bad = [name for name, inv in STATE_INVARIANTS if not inv(after)]
            for name in bad:
                violate(name, after, after.short())
            if bad:
                continue  # do not explore past a broken state
            if len(parent) > max_states:
                violate("state_space_bounded", after, f"more than {max_states} states")
                queue.clear()
                break
            queue.append(after)
        if stop_at_first and report.violations:
            break

    report.states = len(parent)
    named_reached = {s.named() for s in parent}
    report.named_states_total = len(states)
    report.named_states = len(named_reached & set(states))
    if not stop_at_first:
        report.unreached_states = sorted(set(states) - named_reached)
        for f in STATE_FIELDS:
            seen = {getattr(s, f) for s in parent}
            report.unreached_values += [f"{f}={v}" for v in DOMAINS[f] if v not in seen]
        report.unused_rows = [r.id for r in table if r.id not in used_rows]
        report.unreached_codes = sorted(_required_codes(table) - reached_codes)
    report.rows_used = len(used_rows)
    report.codes_reached = sorted(reached_codes)
    report.seconds = time.perf_counter() - t0
    return report


def main(json_output: bool = False) -> int:
    """``miserver check [--json]``: exit 0 when the production table passes, else 1."""
    report = check()
    if json_output:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main("--json" in sys.argv))
