"""Compile a lifecycle table into one plain ``transitions.Machine`` over product states.

The machine's states are the ``NAMED`` component products that satisfy the structural rules
(:data:`miserver.fsm.invariants.STRUCTURE`). For each state and trigger the table's rows are
added in order as guarded alternatives; a row whose *static* guards (those that read only named
components) are false in that state is left out, and rows after one that always fires there are
unreachable and left out too. Guards stay named conditions (``g_<guard>``), so
``machine.get_transitions(trigger, source=state)`` shows them.

``MachineError`` from a trigger means "no row for this state"; a ``False`` return means "no
alternative's guards held": both are totality violations of the table, reported by the checker.

**The decision lookup.** Stepping the ``transitions`` machine costs tens of microseconds an event
(trigger resolution, event data, condition objects, callbacks, a lock), inside the barrier's
latency. :meth:`Compiled.decide` makes the same decision from a lookup read out of the compiled
machine itself (:func:`decision_lookup`: per source state and trigger, the machine's transitions
in order, each with its condition functions and wanted values, its row and its destination), so
the table stays the single source of truth and nothing is compiled twice. The server decides
through it; ``miserver check`` steps the machine (:meth:`Compiled.fire`) and checks that the
lookup agrees on every reachable state and event (its ``determinism`` invariant).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from transitions import Machine, Transition

from miserver.fsm.context import Context
from miserver.fsm.guards import GUARDS, Guard
from miserver.fsm.state import DOMAINS, NAMED, Event, LifecycleState, parse_state_name, state_name
from miserver.fsm.table import Row


class RowTransition(Transition):
    """A ``transitions.Transition`` that remembers the table row it was compiled from."""

    def __init__(
        self,
        source: str,
        dest: str | None,
        conditions=None,
        unless=None,
        before=None,
        after=None,
        prepare=None,
        row: Row | None = None,
    ) -> None:
        super().__init__(source, dest, conditions, unless, before, after, prepare)
        self.row = row


class RowMachine(Machine):
    transition_cls = RowTransition


class Runner:
    """The model object the compiled machine drives: it holds the state under evaluation.

    One runner per compiled table, shared by every :class:`~miserver.fsm.machine.Lifecycle`
    using that table; :meth:`fire` serialises use with a lock.
    """

    state: str

    def __init__(self) -> None:
        self.cur: LifecycleState = LifecycleState()
        self.ctx: Context = Context()
        self.fired: Row | None = None

    def _record(self, event_data) -> None:
        self.fired = event_data.transition.row


def _guard_method(guard: Guard) -> Callable:
    fn = guard.fn

    def method(self: Runner, event_data) -> bool:
        return fn(self.cur, self.ctx, event_data.kwargs["event"])

    method.__name__ = f"g_{guard.name}"
    method.__doc__ = guard.doc
    return method


for _guard in GUARDS.values():
    setattr(Runner, f"g_{_guard.name}", _guard_method(_guard))


def structural_ok(named: dict[str, object]) -> bool:
    """Whether the named components may occur together (see :mod:`miserver.fsm.invariants`)."""
    from miserver.fsm.invariants import STRUCTURE

    return all(check(named) for _name, check in STRUCTURE)


def named_states() -> list[str]:
    """Every machine state name: the named products that satisfy the structural rules."""
    names = []
    for values in itertools.product(*(DOMAINS[f] for f in NAMED)):
        comps = dict(zip(NAMED, values, strict=True))
        if structural_ok(comps):
            names.append(state_name(*values))
    return names


class TableError(RuntimeError):
    """The table has no row (or no alternative whose guards hold) for a state and event."""


@dataclass(frozen=True, slots=True)
class Alternative:
    """One transition of the compiled machine, as :meth:`Compiled.decide` evaluates it.

    Attributes:
        row: the table row it was compiled from.
        checks: ``(guard function, wanted value)`` per condition, in the machine's order
            (``conditions`` want True, ``unless`` want False).
        named: the ``NAMED`` components of the destination state.
    """

    row: Row
    checks: tuple[tuple[Callable[[LifecycleState, Context, Event], bool], bool], ...]
    named: dict


def decision_lookup(
    machine: Machine, parsed: dict[str, dict[str, object]]
) -> dict[tuple[str, str], tuple[Alternative, ...]]:
    """Read the decision lookup out of a compiled machine: for each ``(source state name,
    trigger)`` the machine's transitions from that source, in order, as :class:`Alternative`.

    Raises ``KeyError`` for a condition that is not a ``g_<guard>`` of :data:`GUARDS` (the
    compiler makes only those).
    """
    out: dict[tuple[str, str], tuple[Alternative, ...]] = {}
    for trigger, event in machine.events.items():
        for source, transitions in event.transitions.items():
            alternatives = []
            for t in transitions:
                checks = tuple(
                    (GUARDS[c.func.removeprefix("g_")].fn, bool(c.target)) for c in t.conditions
                )
                dest = source if t.dest is None else t.dest
                alternatives.append(Alternative(t.row, checks, parsed[dest]))
            out[(source, trigger)] = tuple(alternatives)
    return out


@dataclass
class Compiled:
    """A compiled table: the machine, its runner, its states and rows."""

    table: tuple[Row, ...]
    machine: RowMachine
    runner: Runner
    states: tuple[str, ...]
    initial: str
    lock: threading.Lock
    parsed: dict[str, dict[str, object]]
    transitions_count: int
    #: ``(source state name, trigger)`` -> the machine's alternatives there (:func:`decision_lookup`).
    lookup: dict[tuple[str, str], tuple[Alternative, ...]]
    triggers: frozenset[str]

    def fire(self, state: LifecycleState, ctx: Context, event: Event) -> tuple[Row, dict]:
        """Run ``event`` from ``state`` through the machine; the row that fired and the named
        components of the destination. Raises :class:`TableError` when no row fires."""
        runner = self.runner
        with self.lock:
            runner.cur = state
            runner.ctx = ctx
            runner.fired = None
            runner.state = state.named()
            try:
                ok = runner.trigger(event.trigger, event=event)
            except AttributeError as exc:
                raise TableError(f"unknown trigger {event.trigger!r}") from exc
            except Exception as exc:  # transitions.MachineError and friends
                if type(exc).__name__ == "MachineError":
                    raise TableError(f"no row for {event.short()} in {state.short()}") from None
                raise
            if not ok or runner.fired is None:
                raise TableError(f"no alternative fired for {event.short()} in {state.short()}")
            return runner.fired, self.parsed[runner.state]

    def decide(self, state: LifecycleState, ctx: Context, event: Event) -> tuple[Row, dict]:
        """The decision :meth:`fire` makes, from :attr:`lookup` instead of stepping the machine:
        the first alternative whose conditions all have their wanted values fires (the
        machine's own rule). Same answers, same :class:`TableError` cases; no lock needed."""
        name = state.named()
        alternatives = self.lookup.get((name, event.trigger))
        if alternatives is None:
            if event.trigger not in self.triggers:
                raise TableError(f"unknown trigger {event.trigger!r}")
            if name not in self.parsed:  # as transitions does for a state it does not have
                raise ValueError(f"State '{name}' is not a registered state.")
            raise TableError(f"no row for {event.short()} in {state.short()}")
        for alt in alternatives:
            for fn, wanted in alt.checks:
                if fn(state, ctx, event) != wanted:  # transitions: ``predicate(...) == target``
                    break
            else:
                return alt.row, alt.named
        raise TableError(f"no alternative fired for {event.short()} in {state.short()}")


def _static_value(guard_name: str, comps: dict[str, object]) -> bool | None:
    guard = GUARDS[guard_name]
    if not guard.static:
        return None
    probe = LifecycleState(**comps)  # type: ignore[arg-type]
    return guard.fn(probe, Context(), Event("probe"))


@lru_cache(maxsize=32)
def compile_table(table: tuple[Row, ...]) -> Compiled:
    """Compile ``table`` (cached per table value). Raises ``KeyError`` for an unknown guard."""
    for row in table:
        for g in (*row.when, *row.unless):
            if g not in GUARDS:
                raise KeyError(f"row {row.id}: unknown guard {g!r}")
    states = named_states()
    parsed = {name: parse_state_name(name) for name in states}
    initial = LifecycleState().named()
    runner = Runner()
    machine = RowMachine(
        model=runner,
        states=states,
        initial=initial,
        auto_transitions=False,
        send_event=True,
        before_state_change="_record",
    )
    triggers = list(dict.fromkeys(row.trigger for row in table))
    count = 0
    for name in states:
        comps = parsed[name]
        for trigger in triggers:
            for row in (r for r in table if r.trigger == trigger):
                when = [_static_value(g, comps) for g in row.when]
                unless = [_static_value(g, comps) for g in row.unless]
                if any(v is False for v in when) or any(v is True for v in unless):
                    continue
                dest_comps = {**comps, **{k: v for k, v in row.set if k in NAMED}}
                dest = state_name(*(dest_comps[f] for f in NAMED))
                if dest == name:
                    dest = None  # internal: the named part does not change
                elif dest not in parsed:
                    # A row that breaks the structure: keep it reachable so the checker
                    # reports it with a trace instead of the compiler hiding it.
                    machine.add_state(dest)
                    parsed[dest] = parse_state_name(dest)
                machine.add_transition(
                    trigger,
                    name,
                    dest,
                    conditions=[f"g_{g}" for g in row.when] or None,
                    unless=[f"g_{g}" for g in row.unless] or None,
                    row=row,
                )
                count += 1
                if all(v is True for v in when) and all(v is False for v in unless):
                    break  # always fires here: later rows are unreachable
    return Compiled(
        table,
        machine,
        runner,
        tuple(states),
        initial,
        threading.Lock(),
        parsed,
        count,
        decision_lookup(machine, parsed),
        frozenset(machine.events),
    )
