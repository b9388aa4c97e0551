"""The conformance tour: the lifecycle table's outcomes, state by state, over real HTTP (issue 5).

The tour explores the production table breadth-first, like ``miserver check``, but offering
only what a client can do over HTTP here (:data:`ACTIONS`): the eight gated weights routes,
each with nine callers (no token, an unknown token, trainer A, trainer B, the operator; with
the current attachment ID, a wrong one or none); ``/v1/chat/completions`` naming the resident,
another catalogue row, or another row with ``X-miLLM-Load-Policy: refuse``; management loads
and unloads; ``PATCH /api/settings`` (``max_concurrent_requests`` 1 or 2); and a fake-clock jump
to the next timer's deadline (hold, watchdog, heartbeat). A quiesce over HTTP returns once its
drain ends, so it is the table's ``quiesce`` then ``drained``; a load is the load then
``transition_done``.

Covered, each compared with the table's status, code and reason, and each followed by a
``GET /api/weights/status`` that must agree with the table:

- ``test_probes_along_the_tree``: every reachable state (48 with these actions today, all of
  them states the checker reaches) is driven to over HTTP by its shortest path (each step checked),
  and there every action that leaves the lifecycle unchanged (refusals, no-ops, held
  requests: about 75 per state) is sent;
- ``test_every_transition_is_walked``: every (state, action) pair that changes the state is
  taken at least once, on one server per timer setting, by a walk that moves to the nearest
  state with an untaken transition;
- ``test_the_tour_is_inside_the_checkers_graph``: every state and every (state, trigger, row)
  step of the tour is one the checker reaches.

Not covered here (they need a pause or a load in progress, a forward pass still running, or
another kind of model; the core-level tests in tests/model cover them against the table):
states while a quiesce drains (``draining``), while a save, weights load or adapter change
holds the barrier, while a model load or unload runs, with continuous batching (not
implemented), and the NOT_ATTACHABLE reasons of other models (gguf, quantized, dtype,
not_on_gpu, allocator). Of the checker's 458 states, the 48 without those are covered.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import pytest

from miserver.fsm.machine import Lifecycle, Outcome, Snapshot
from miserver.fsm.state import Caller, Event, LifecycleState
from miserver.fsm.table import TABLE, Effect
from tests.model.test_http_stateful import (
    CALLERS,
    ROUTES,
    START,
    TIMINGS,
    TOKENS,
    WRONG_ID,
    HttpDriver,
)

Action = tuple[str, ...]

#: Everything the tour can do over HTTP (see the module docstring).
ACTIONS: tuple[Action, ...] = (
    *[("gated", trigger, who) for trigger in ROUTES for who in CALLERS],
    ("advance",),
    ("v1", "resident"),
    ("v1", "other"),
    ("v1", "other_refuse"),
    *[
        ("mgmt", kind)
        for kind in ("load_other", "load_resident", "unload", "settings_ok", "settings_concurrency")
    ],
)
#: The tour's timer settings: the defaults, and a heartbeat shorter than the watchdog.
TOUR_TIMINGS = (TIMINGS[0], TIMINGS[1])


def _caller(lc: Lifecycle, who: str) -> Caller:
    label, _, att = who.partition("+")
    att_id = {"att": lc.context.attachment_id or WRONG_ID, "wrong": WRONG_ID, "": None}[att]
    if label in ("none", "invalid"):
        return Caller(label, None, att_id)  # type: ignore[arg-type]
    return Caller(TOKENS[label][0], label, att_id)  # type: ignore[arg-type]


def step(lc: Lifecycle, action: Action, now: float) -> tuple[float, list[Outcome]]:
    """What ``action`` does to the lifecycle at ``now`` (the same events
    :class:`~tests.model.test_http_stateful.HttpDriver` feeds its shadow); returns the new clock
    and the outcomes."""
    outs: list[Outcome] = []
    kind = action[0]
    if kind == "gated":
        trigger, who = action[1], action[2]
        out = lc.handle(Event(trigger, caller=_caller(lc, who)), now)
        outs.append(out)
        if out.kind == "accepted" and trigger == "quiesce":
            outs.append(lc.handle(Event("drained"), now))
    elif kind == "advance":
        deadline = lc.next_deadline()
        if deadline is not None:
            now = max(now, deadline)
        outs += lc.fire_due(now)
    elif kind == "v1":
        target = "resident" if action[1] == "resident" and lc.state.resident else "other"
        out = lc.handle(
            Event("v1", target=target, refuse_policy=action[1] == "other_refuse"),  # type: ignore[arg-type]
            now,
        )
        outs.append(out)
        if Effect.START_MODEL_LOAD in out.effects:
            outs.append(lc.handle(Event("transition_done"), now))
        if Effect.START_MODEL_LOAD in out.effects or Effect.ADMIT in out.effects:
            # the server confirms it after its auto-load and inside its slot (v1_confirm; it
            # changes nothing, so the tour's states are the same with or without it)
            outs.append(lc.handle(Event("v1_confirm"), now))
    else:
        what = action[1]
        if what.startswith("settings_"):
            out = lc.handle(Event("settings_change", avail=what.removeprefix("settings_")), now)  # type: ignore[arg-type]
        elif what == "unload":
            out = lc.handle(Event("model_unload"), now)
        else:
            target = "resident" if what == "load_resident" and lc.state.resident else "other"
            out = lc.handle(Event("model_load", target=target), now)  # type: ignore[arg-type]
        outs.append(out)
        if out.kind == "accepted" and (
            Effect.START_MODEL_LOAD in out.effects or Effect.START_MODEL_UNLOAD in out.effects
        ):
            outs.append(lc.handle(Event("transition_done"), now))
    return now, outs


def _lifecycle(timing: tuple[float, float, float, float]) -> Lifecycle:
    hold, watchdog_ms, heartbeat, drain = timing
    counter = iter(range(1, 10**9))
    return Lifecycle(
        hold_timeout_s=hold,
        watchdog_ms=watchdog_ms,
        heartbeat_timeout_s=heartbeat,
        drain_timeout_s=drain,
        id_factory=lambda: f"tour-{next(counter)}",
    )


def _cost(action: Action, before: LifecycleState, after: LifecycleState) -> int:
    """Loads and unloads take a real model load (about half a second), and only a load leaves
    the unsaved states a commit-end enters: the walk avoids both while it can."""
    slow = action[0] == "v1" or (action[0] == "mgmt" and not action[1].startswith("settings"))
    return 25 if slow or (after.unsaved and not before.unsaved) else 1


def changes(lc: Lifecycle, action: Action, now: float) -> bool:
    """Whether ``action`` changes the lifecycle (its snapshot or the clock); ``lc`` is left as
    it was."""
    snap = lc.snapshot()
    after_now, _ = step(lc, action, now)
    changed = lc.snapshot() != snap or after_now != now
    lc.restore(snap)
    return changed


@dataclass
class Tour:
    """The breadth-first exploration over :data:`ACTIONS` from the state after start-up."""

    timing: tuple[float, float, float, float]
    paths: dict[LifecycleState, list[Action]] = field(default_factory=dict)
    edges: set[tuple[LifecycleState, Action]] = field(default_factory=set)
    steps: set[tuple[LifecycleState, str, str]] = field(default_factory=set)
    children: dict[LifecycleState, list[LifecycleState]] = field(default_factory=dict)
    #: each transition's :func:`_cost` where the exploration first took it
    edge_cost: dict[tuple[LifecycleState, Action], int] = field(default_factory=dict)


def start_snapshot(timing: tuple[float, float, float, float]) -> Snapshot:
    """The lifecycle once the default row is resident (what start-up does)."""
    lc = _lifecycle(timing)
    lc.handle(Event("model_load", target="other"), START)
    lc.handle(Event("transition_done"), START)
    return lc.snapshot()


@cache
def explore(timing: tuple[float, float, float, float]) -> Tour:
    """Every state reachable over HTTP, its shortest path, every transition and every step."""
    tour = Tour(timing)
    lc = _lifecycle(timing)
    first = start_snapshot(timing)
    tour.paths[first.state] = []
    queue: deque[tuple[Snapshot, float, list[Action]]] = deque([(first, START, [])])
    while queue:
        snap, now, path = queue.popleft()
        for action in ACTIONS:
            lc.restore(snap)
            after_now, outs = step(lc, action, now)
            for out in outs:
                if out.before is not None:
                    tour.steps.add((out.before, out.trigger, out.row))
            after = lc.snapshot()
            if after == snap and after_now == now:
                continue
            tour.edges.add((snap.state, action))
            tour.edge_cost.setdefault((snap.state, action), _cost(action, snap.state, lc.state))
            if lc.state in tour.paths:
                continue
            tour.paths[lc.state] = [*path, action]
            tour.children.setdefault(snap.state, []).append(lc.state)
            queue.append((after, after_now, [*path, action]))
    return tour


def leaves(tour: Tour) -> list[LifecycleState]:
    """The states no shortest path passes through, in breadth-first order."""
    return [s for s in tour.paths if s not in tour.children]


def probe_plan(tour: Tour) -> dict[LifecycleState, list[LifecycleState]]:
    """For each leaf, the states on its path whose probes it sends (each state once)."""
    done: set[LifecycleState] = set()
    plan: dict[LifecycleState, list[LifecycleState]] = {}
    for leaf in leaves(tour):
        on_path = _states_on_path(tour, leaf)
        plan[leaf] = [s for s in on_path if s not in done]
        done.update(on_path)
    return plan


def _states_on_path(tour: Tour, state: LifecycleState) -> list[LifecycleState]:
    lc = _lifecycle(tour.timing)
    lc.restore(start_snapshot(tour.timing))
    now, seen = START, [lc.state]
    for action in tour.paths[state]:
        now, _ = step(lc, action, now)
        seen.append(lc.state)
    assert seen[-1] == state
    return seen


# ----------------------------------------------------------------------------------------------
# Driving the server


async def perform(d: HttpDriver, action: Action) -> None:
    """Send ``action`` over HTTP through the driver (which compares the answer with the table)
    and check GET /api/weights/status."""
    kind = action[0]
    if kind == "gated":
        await d.gated(action[1], action[2])
    elif kind == "advance":
        await d.advance("at", 0.0)
    elif kind == "v1":
        await d.v1(
            "resident" if action[1] == "resident" else "other", 1, action[1] == "other_refuse"
        )
    else:
        await d.management(action[1])
    await d.check_status()


def _shadow_copy(d: HttpDriver) -> Lifecycle:
    lc = _lifecycle(d.timing)
    lc.restore(d.shadow.snapshot())
    return lc


def _run(coro: Any) -> Any:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


PLAN = probe_plan(explore(TOUR_TIMINGS[0]))


@pytest.mark.slow
@pytest.mark.parametrize("leaf", list(PLAN), ids=[leaf.short().replace(" ", "_") for leaf in PLAN])
def test_probes_along_the_tree(leaf: LifecycleState, tiny_model_dir: str) -> None:
    """Drive the server along the shortest path to ``leaf``; in each state of the path that
    this case owns, send every action that leaves the lifecycle unchanged."""
    tour = explore(TOUR_TIMINGS[0])
    own = set(PLAN[leaf])

    async def go() -> int:
        d = HttpDriver(tiny_model_dir, timing=tour.timing, max_queued=64)
        await d.open()
        sent = 0
        try:
            path = tour.paths[leaf]
            for n in range(len(path) + 1):
                state = d.shadow.state
                if state in own:
                    own.discard(state)
                    for action in ACTIONS:
                        if not changes(_shadow_copy(d), action, d.now):
                            await perform(d, action)
                            sent += 1
                            assert d.shadow.state == state, f"probe {action} moved the state"
                if n < len(path):
                    await perform(d, path[n])
            assert d.shadow.state == leaf, f"reached {d.shadow.state.short()}"
        finally:
            await d.close()
        return sent

    sent = _run(go())
    assert not own, f"states never probed: {[s.short() for s in own]}"
    assert sent >= 30 * len(PLAN[leaf])


def _nearest(d: HttpDriver, todo: set[tuple[LifecycleState, Action]]) -> list[Action] | None:
    """The cheapest action path (:func:`_cost`) from the driver's state to a state with an
    untaken transition, or None."""
    wanted = {s for s, _ in todo}
    lc = _lifecycle(d.timing)
    first = d.shadow.snapshot()
    done: set[LifecycleState] = set()
    tie = itertools.count()
    heap: list[tuple[int, int, Snapshot, float, list[Action]]] = [(0, 0, first, d.now, [])]
    while heap:
        cost, _, snap, now, path = heapq.heappop(heap)
        if snap.state in done:
            continue
        if path and snap.state in wanted:
            return path
        done.add(snap.state)
        for action in ACTIONS:
            lc.restore(snap)
            after_now, _ = step(lc, action, now)
            after = lc.snapshot()
            if (after == snap and after_now == now) or lc.state in done:
                continue
            heapq.heappush(
                heap,
                (
                    cost + _cost(action, snap.state, lc.state),
                    next(tie),
                    after,
                    after_now,
                    [*path, action],
                ),
            )
    return None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("timing", "which"),
    [(TOUR_TIMINGS[0], "all"), (TOUR_TIMINGS[1], "timers")],
    ids=["default-timers", "heartbeat-first"],
)
def test_every_transition_is_walked(
    timing: tuple[float, float, float, float], which: str, tiny_model_dir: str
) -> None:
    """Take every (state, action) transition of the tour at least once over HTTP; with the
    heartbeat shorter than the watchdog, every timer transition (the other actions decide the
    same rows under either timing)."""
    tour = explore(timing)
    todo = {e for e in tour.edges if which == "all" or e[1] == ("advance",)}
    total = len(todo)

    async def walk() -> int:
        taken = 0
        for _ in range(6):  # a fresh server when the walk is stuck in a region
            d = HttpDriver(tiny_model_dir, timing=timing, max_queued=64)
            await d.open()
            try:
                while todo:
                    # cheap transitions first; a load or a step into the unsaved half last
                    cheap = {e for e in todo if tour.edge_cost[e] == 1}
                    targets = cheap or todo
                    here = sorted((a for s, a in targets if s == d.shadow.state), key=ACTIONS.index)
                    if here:
                        todo.discard((d.shadow.state, here[0]))
                        await perform(d, here[0])
                        taken += 1
                        continue
                    path = _nearest(d, targets) or (_nearest(d, todo) if cheap else None)
                    if path is None:
                        break
                    for action in path:
                        todo.discard((d.shadow.state, action))
                        await perform(d, action)
                        taken += 1
            finally:
                await d.close()
            if not todo:
                break
        return taken

    taken = _run(walk())
    assert not todo, f"transitions never taken: {[(s.short(), a) for s, a in todo][:10]}"
    assert taken >= total


@pytest.mark.full  # tens of seconds: left out of make quick
def test_the_tour_is_inside_the_checkers_graph() -> None:
    """Every state and (state, trigger, row) step of the tour is one the checker reaches, and
    the tour reaches every state it can over HTTP (48) and produces refusals of each route."""
    from miserver.fsm.check import check

    report = check(keep_steps=True)
    checker_states = {s for s, _, _, _ in report.steps} | {a for _, _, _, a in report.steps}
    checker_steps = {(s, trigger, row) for s, trigger, row, _ in report.steps}
    by_id = {row.id: row for row in TABLE}
    for timing in TOUR_TIMINGS:
        tour = explore(timing)
        assert set(tour.paths) <= checker_states
        outside = tour.steps - checker_steps
        assert not outside, sorted((s.short(), t, r) for s, t, r in outside)[:5]
        assert len(tour.paths) >= 40, "the HTTP-reachable part of the table shrank"
        assert sum(len(v) for v in probe_plan(tour).values()) == len(tour.paths)
        refused = {by_id[r].trigger for _, _, r in tour.steps if by_id[r].kind == "refused"}
        assert set(ROUTES) | {"v1", "model_load", "model_unload", "settings_change"} <= refused


def test_a_planted_bug_fails_the_tour(tiny_model_dir: str) -> None:
    """The tour can fail: with a shadow table that checks ALREADY_QUIESCED before
    WEIGHTS_NOT_CLEAN, the probe of quiesce in a writing state disagrees with the server."""
    from tests.model.test_planted_bugs import bug_swapped_refusal_order

    tour = explore(TOUR_TIMINGS[0])
    writing = next(
        s
        for s in tour.paths
        if s.weights == "writing" and s.owner == "holder" and s.attachment == "active"
    )

    async def go() -> None:
        d = HttpDriver(tiny_model_dir, timing=tour.timing, table=bug_swapped_refusal_order())
        await d.open()
        try:
            for action in tour.paths[writing]:
                await perform(d, action)
            await perform(d, ("gated", "quiesce", f"{d.shadow.context.attachment_label}+att"))
        finally:
            await d.close()

    with pytest.raises(AssertionError) as err:
        _run(go())
    assert "server 409 WEIGHTS_NOT_CLEAN, table 409 ALREADY_QUIESCED" in str(err.value)
