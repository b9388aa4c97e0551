"""docs/state-machine.md from the lifecycle table: mermaid diagrams (``GraphMachine`` with the
mermaid engine, no graphviz needed) of each component, projected from the compiled machine, and
the table itself as State | Event | Guard | Target | Refusal rows, plus each route's check order.

Everything here is derived from :mod:`miserver.fsm.table`; nothing is written by hand except
the decisions section (where the spec is silent). The output is deterministic.
"""

from __future__ import annotations

from functools import lru_cache

from transitions.extensions import GraphMachine

from miserver.fsm.compiled import compile_table
from miserver.fsm.guards import GUARDS
from miserver.fsm.invariants import EDGE_INVARIANTS, STATE_INVARIANTS
from miserver.fsm.state import DOMAINS, NAMED
from miserver.fsm.table import ROUTE_AUTH, TABLE, Row, check_order, fingerprint

#: The component views drawn as diagrams: (title, components). Edges are the reachable steps
#: (breadth-first, as ``miserver check`` explores) that change the view's value.
COMPONENT_VIEWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("weights_state", ("weights",)),
    ("resident", ("resident",)),
    ("barrier and pause owner", ("barrier", "owner")),
    ("attachment", ("attachment",)),
    ("commit", ("commit",)),
)

DECISIONS = """\
Where the weights page and the companion contract are silent, the table decides as follows
(each is a row, so the checker and the stateful test hold it to these words):

- **Quiesce is two-phase.** `quiesce` enters *draining* (new requests are held, running ones
  finish); `drained` completes it and the call returns 200; `drain_expired` answers the waiting
  call 409 `MODEL_BUSY` (`drain_timeout`) and holds nothing. Saves, weights loads and adapter
  changes drain the same way. `GET /status` reports a draining barrier as `quiesced`.
- **Detach or clear-stale while the holder's quiesce is still draining** cancels the drain,
  releases the held requests, and answers the waiting quiesce 409 `NOT_ATTACHED`.
- **Resume while a commit is open** is 409 `WEIGHTS_NOT_CLEAN` (commit-end first): resuming
  would serve half-written weights. Resume while torn releases the barrier (requests then get
  503 `WEIGHTS_TORN`).
- **A save, weights load or adapter change while the holder's quiesce drains** is 409
  `MODEL_BUSY` (reason null): retry when quiesce returns.
- **A weights load takes over the holder's hold** like a save or adapter change (contract 5 is
  the recovery from torn, which typically happens while the trainer still holds the barrier).
  It discards a torn commit: a late commit-end afterwards is 409 `NO_OPEN_COMMIT`.
- **A weights load with nothing resident** is 400 `MODEL_NOT_LOADED` (use the model load).
- **commit-end by a new attachment on a commit it did not begin** (torn after its beginner was
  detached or cleared) is 403 `NOT_ATTACHMENT_HOLDER`; only a weights load or unload recovers.
- **A late commit-end** counts the commit (`steps_since_load` + 1) and records the overrun.
- **A parameter's address moved** (seen only while handles are exported) tears the set; a
  commit open at the time can no longer be repaired by a late commit-end. A save or adapter
  change that completes on a torn set is answered as a failure and records nothing.
- **A model load or unload while a cleared holder's commit is still writing** is 409
  `MODEL_BUSY` (reason null) until the watchdog decides.
- **A failed model load or swap** leaves nothing resident.
- **A model load, swap or unload drains first.** Before the host drops or reads a model, the
  generations running on the resident finish (the scheduler takes every slot ahead of the
  queue; requests already waiting for a slot are held, and are then told their model changed),
  so the call answers once nothing runs on the old model and a card never holds two models.
  The drain is bounded by `WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S`, as quiesce's is: past it
  `transition_abandoned` answers 409 `MODEL_BUSY` (`drain_timeout`) and nothing is loaded or
  unloaded.
- **A `/v1` request that waited** (for its auto-load, or for its scheduler slot) is checked
  again before it goes on (`v1_confirm`): when the model it was admitted for was unloaded or
  replaced meanwhile it is 409 `MODEL_BUSY` (`model_transition`) with `Retry-After` (it is not
  auto-loaded again from inside its slot; the retry is admitted anew); otherwise the checks
  for the resident apply (503 `WEIGHTS_TORN`, 409 `MODEL_BUSY` during a transition), and a
  pause that began while it waited lets it go on (the drain waits for a request that holds a
  slot).
- **A `/v1` request during a model load, swap or unload** is 409 `MODEL_BUSY`
  (`model_transition`) whichever model it names, also while the resident carries unsaved
  commits: the running load or unload is the operator's deliberate discard of them, so 409
  `WEIGHTS_UNSAVED` (whose way forward is a save) does not apply. A request naming the model
  being replaced still names the resident until the transition ends.
- **The queue bound** (`MAX_QUEUED_REQUESTS`, 503 `QUEUE_FULL` for `/v1` and quiesce) counts the
  interactive requests that wait, queued or held; Batch API rows neither count nor are refused
  for it (contract 7: rows wait).
- **Timers due at the same instant** fire in the order watchdog, drain, hold, heartbeat.
"""


def _value(comps: dict[str, object], fields: tuple[str, ...]) -> str:
    if fields == ("barrier", "owner"):
        owner = comps["owner"]
        return str(comps["barrier"]) if owner == "none" else f"{comps['barrier']}_{owner}"
    return str(comps[fields[0]])


def _project(steps, fields: tuple[str, ...]) -> tuple[list[str], list[dict[str, str]]]:
    """The values of ``fields`` and the reachable accepted steps that change them."""
    if fields == ("barrier", "owner"):
        values = ["serving"] + [
            f"{b}_{o}" for b in ("draining", "quiesced") for o in DOMAINS["owner"] if o != "none"
        ]
    else:
        values = [str(v) for v in DOMAINS[fields[0]]]
    edges: dict[tuple[str, str], set[str]] = {}
    for before, trigger, _row, after in steps:
        a = _value({f: getattr(before, f) for f in NAMED}, fields)
        b = _value({f: getattr(after, f) for f in NAMED}, fields)
        if a != b:
            edges.setdefault((a, b), set()).add(trigger)
    order = {v: n for n, v in enumerate(values)}
    transitions = [
        {"trigger": " | ".join(sorted(ts)), "source": a, "dest": b}
        for (a, b), ts in sorted(edges.items(), key=lambda kv: (order[kv[0][0]], order[kv[0][1]]))
    ]
    return values, transitions


def mermaid(fields: tuple[str, ...], title: str, steps) -> str:
    """A mermaid state diagram of one component view, drawn by ``GraphMachine`` from the
    reachable steps (``Report.steps`` of :func:`miserver.fsm.check.check`)."""
    values, transitions = _project(steps, fields)

    class _Model:
        pass

    model = _Model()
    # Triggers joined with " | " are labels, not callable names: draw through one
    # transition per edge whose trigger is the label.
    machine = GraphMachine(
        model=model,
        states=values,
        initial=values[0],
        transitions=[],
        auto_transitions=False,
        graph_engine="mermaid",
        title=title,
        show_conditions=False,
    )
    for tr in transitions:
        machine.add_transition(tr["trigger"], tr["source"], tr["dest"])
    text = model.get_graph().draw(None)
    # The engine marks the model's current state; a document shows no current state.
    return text.replace(f"Class {values[0]} s_active", f"Class {values[0]} s_default")


@lru_cache(maxsize=4)
def reachable_steps(table: tuple[Row, ...] = TABLE) -> frozenset:
    """Every reachable step ``(before, trigger, row id, after)`` of ``table`` (cached)."""
    from miserver.fsm.check import check

    return frozenset(check(table, keep_steps=True).steps)


def _guard_text(names: tuple[str, ...], negate: bool) -> list[str]:
    return [("not " if negate else "") + n for n in names]


def _row_cells(row: Row) -> tuple[str, str, str, str, str]:
    static = [g for g in (*row.when, *row.unless) if GUARDS[g].static]
    state = (
        ", ".join(
            _guard_text(tuple(g for g in row.when if g in static), False)
            + _guard_text(tuple(g for g in row.unless if g in static), True)
        )
        or "any"
    )
    dynamic = ", ".join(
        _guard_text(tuple(g for g in row.when if g not in static), False)
        + _guard_text(tuple(g for g in row.unless if g not in static), True)
    )
    if row.refuse is not None:
        target = "unchanged"
        ref = row.refuse
        refusal = f"{ref.http_status} {ref.code.name}" + (f" ({ref.reason})" if ref.reason else "")
        if ref.sends_retry_after:
            refusal += ", Retry-After"
        if ref.message:
            refusal += f': "{ref.message}"'
        if row.note:
            target += f" — {row.note}"
    elif row.ignore:
        target, refusal = f"unchanged ({row.note})", ""
    else:
        parts = [f"{k}={v}" for k, v in row.set]
        if row.effects:
            parts.append("effects: " + ", ".join(e.value for e in row.effects))
        if row.pending is not None and row.pending.code is not None:
            parts.append(
                f"pending call: {row.pending.status} {row.pending.code.name}"
                + (f" ({row.pending.reason})" if row.pending.reason else "")
            )
        elif row.pending is not None:
            parts.append("pending call: 200")
        target = "; ".join(parts) or "unchanged"
        if row.note:
            target += f" — {row.note}"
        refusal = ""
    return state, row.trigger, dynamic or "—", target, refusal


MUTATION_KINDS = (
    ("drop_when", "a `when` guard dropped"),
    ("drop_unless", "an `unless` guard dropped"),
    ("drop_set", "one `set` change dropped"),
    ("drop_effect", "one effect dropped"),
    ("swap", "two consecutive alternatives of one trigger swapped"),
    ("delete", "the row deleted"),
)


def mutation_section(result: dict | None, table: tuple[Row, ...] = TABLE) -> list[str]:
    """The page's account of the last mutation sweep (``docs/state-machine-mutants.json``,
    written by ``python -m tests.model.mutation``)."""
    out = ["## Do the checks catch a wrong table? (mutation testing)", ""]
    out.append(
        "Every one-row mutant of the table is judged: first by `miserver check` (in-process), "
        "then, if it survives, by the stateful test against the independent reference model "
        "(tests/model/stateful.py: its deterministic tour, every route by every kind of caller "
        "and every internal event in every stage of every pause and in every prelude, then the "
        "Hypothesis state machine with a fixed, derandomized budget). A mutant neither rejects "
        "is a survivor unless tests/model/equivalent_mutants.txt lists it with the reason the "
        "table still means the same thing (reviewed by hand); nothing else counts as "
        "equivalent. The full sweep: `python -m tests.model.mutation` (it rewrites the result "
        "file; then `miserver docs`). CI judges a fixed sample, a seeded draw of the same "
        "number of mutants of each kind (tests/model/test_mutation.py), and checks that every "
        "listed equivalent takes every reachable step as the table does (one exception, "
        "named there with its reason)."
    )
    out.append("")
    if result is None:
        return [*out, "No sweep has been recorded.", ""]
    if result.get("table") != fingerprint(table):
        out += [
            "**The recorded sweep is stale**: the table changed since it ran. Run "
            "`python -m tests.model.mutation`, then `miserver docs`.",
            "",
        ]
    s = result["summary"]
    budget = result.get("budget", {})
    out += [
        f"Last sweep: {s['mutants']} mutants of the {result['rows']}-row table; stateful budget "
        f"{budget.get('max_examples')} programs of up to {budget.get('stateful_step_count')} "
        f"steps after the tour; {result.get('seconds', 0) // 60} min wall-clock.",
        "",
        "| Mutation | Mutants | Killed by the checker | Killed by the stateful test | "
        "Equivalent | Survived |",
        "|---|---|---|---|---|---|",
    ]
    for kind, text in MUTATION_KINDS:
        k = s["by_kind"].get(kind)
        if k:
            out.append(
                f"| {text} | {k['mutants']} | {k.get('killed_by_checker', '')} | "
                f"{k.get('killed_by_stateful', '')} | {k['equivalent']} | {k['survived']} |"
            )
    out += [
        f"| **all** | {s['mutants']} | {s['killed_by_checker']} | {s['killed_by_stateful']} | "
        f"{s['equivalent']} | {s['survived']} |",
        "",
        f"Killed by the checker: {s['killed_by_checker']}; by the stateful test: "
        f"{s['killed_by_stateful']}. Non-equivalent mutants killed: "
        f"{s['killed']} of {s['mutants'] - s['equivalent']} ({100 * s['kill_rate']:.1f}%).",
        "",
    ]
    if result.get("survivors"):
        out += ["Survivors (neither check rejects them; not shown equivalent):", ""]
        out += [f"- `{mid}`" for mid in result["survivors"]]
        out.append("")
    return out


def render(table: tuple[Row, ...] = TABLE, mutants: dict | None = None) -> str:
    """The whole of docs/state-machine.md; ``mutants``: the last mutation sweep's result."""
    compiled = compile_table(table)
    steps = reachable_steps(table)
    out: list[str] = [
        "# The weights lifecycle state machine",
        "",
        "<!-- Generated by `miserver docs` from miserver/fsm/table.py. Do not edit. -->",
        "",
        "One flat `transitions.Machine` over product states is the single source of truth for "
        "weights, the barrier, the attachment and every refusal. Its states are the products of "
        f"the components {', '.join(f'`{f}`' for f in NAMED)} that satisfy the structural rules "
        f"({len(compiled.states)} states, {compiled.transitions_count} compiled transitions from "
        f"{len(table)} rows); the other components (pause availability, model transition, "
        "takeover, unsaved commits, adapter, armed timers, sequences parked by a hold) are variables tested by guards. "
        "`miserver check` explores every reachable state; this page is regenerated by "
        "`miserver docs`.",
        "",
        "Component values: "
        + "; ".join(f"`{f}` {' / '.join(str(v) for v in vals)}" for f, vals in DOMAINS.items())
        + ".",
        "",
    ]
    for title, fields in COMPONENT_VIEWS:
        out += [f"## {title}", "", "```mermaid", mermaid(fields, title, steps).rstrip(), "```", ""]
    out += [
        "## Check order of each route",
        "",
        "Auth first (weights page: Authentication and headers), then the state checks in the "
        "order below. The first that applies answers.",
        "",
    ]
    for trigger in dict.fromkeys(r.trigger for r in table):
        order = check_order(trigger, table)
        if not order:
            continue
        auth = " (auth: " + ", ".join(ROUTE_AUTH[trigger]) + ")" if trigger in ROUTE_AUTH else ""
        steps = " → ".join(f"{c}" + (f"({r})" if r else "") for c, r in order)
        out.append(f"- `{trigger}`{auth}: {steps}")
    out += [
        "",
        "## The table",
        "",
        "Rows of one event are ordered alternatives: the first whose guards hold decides. "
        "*State* lists the guards on the machine state, *Guard* those on the event and the "
        "variables.",
        "",
        "| State | Event | Guard | Target | Refusal |",
        "|---|---|---|---|---|",
    ]
    for row in table:
        cells = [c.replace("|", "\\|") for c in _row_cells(row)]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "## Guards", "", "| Guard | Reads | Meaning |", "|---|---|---|"]
    for g in sorted(GUARDS.values(), key=lambda g: g.name):
        out.append(f"| `{g.name}` | {', '.join(sorted(g.reads))} | {g.doc} |")
    out += ["", "## Invariants (checked by `miserver check`)", ""]
    out += [f"- `{name}`" for name, _ in STATE_INVARIANTS]
    out += [f"- `{name}` (on every step)" for name, _ in EDGE_INVARIANTS]
    out += [
        "- `totality`, `determinism`: every (state, event) has exactly one outcome",
        "- non-vacuity: every machine state, component value, row, and every code and reason "
        "of the weights page is reached",
        "",
    ]
    out += mutation_section(mutants, table)
    out += ["## Decisions where the spec is silent", "", DECISIONS]
    return "\n".join(out)
