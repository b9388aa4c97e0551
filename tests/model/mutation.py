"""Mutation testing of the lifecycle table: do the checks catch a wrong table?

Every one-row mutation of the production table (:data:`miserver.fsm.table.TABLE`) of these
kinds is made, one at a time:

- ``drop_when`` / ``drop_unless``: a row loses one of its guards;
- ``drop_set``: a row loses one of the components it changes;
- ``drop_effect``: a row loses one of its effects;
- ``swap``: two consecutive alternatives of one trigger change places;
- ``delete``: a row is deleted.

Each mutant is judged by the exhaustive checker (:func:`miserver.fsm.check.check`, in-process,
reusing the production table's steps for every trigger the mutant leaves alone) and, when it
survives that, by the stateful test against the reference model (tests/model/stateful.py): its
deterministic tour of every barrier stage, then the state machine with a fixed, derandomized
Hypothesis budget (:data:`SWEEP_BUDGET`). A mutant neither rejects is a
survivor, unless it is listed in ``equivalent_mutants.txt`` (one line each: the mutant's id and
why the table still means the same thing; reviewed by hand). Nothing else counts as
equivalent: a listed mutant that a check kills, or an id the table no longer has, is an error.

The full sweep is ``python -m tests.model.mutation --jobs 2`` (about 10 minutes on two cores): it
writes ``docs/state-machine-mutants.json``, whose summary ``miserver docs`` renders into
docs/state-machine.md. ``--ci`` judges only the CI sample (:func:`stratified_sample`, what
tests/model/test_mutation.py runs). ``--propose`` prints a candidate line for every survivor
whose every reachable step is the production table's: a starting point only; the line that
goes into the file names what makes the mutant equivalent (the invariants, the earlier rows).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from miserver.fsm.check import Report, StepCache, alphabet, canonical_context, check
from miserver.fsm.machine import Lifecycle, Snapshot
from miserver.fsm.table import TABLE, Row, fingerprint

HERE = Path(__file__).resolve().parent
EQUIVALENTS_FILE = HERE / "equivalent_mutants.txt"
REPO_ROOT = HERE.parents[1]
RESULT_FILE = REPO_ROOT / "docs" / "state-machine-mutants.json"

KINDS = ("drop_when", "drop_unless", "drop_set", "drop_effect", "swap", "delete")

#: The stateful test's budget per mutant: fixed and derandomized, so a sweep is repeatable.
SWEEP_BUDGET = {"max_examples": 50, "stateful_step_count": 50}


def sweep_profile(max_examples: int, stateful_step_count: int) -> settings:
    """A derandomized Hypothesis profile that stops at the first failure (no shrinking: the
    verdict, not the smallest program, is what the sweep needs)."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=stateful_step_count,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


@dataclass(frozen=True)
class Mutant:
    """One one-row mutation: ``id`` is ``kind:row[:detail]`` (stable while the table is)."""

    id: str
    kind: str
    row: str
    table: tuple[Row, ...]


def _replace_row(table: tuple[Row, ...], i: int, new: Row | None) -> tuple[Row, ...]:
    out = list(table)
    if new is None:
        del out[i]
    else:
        out[i] = new
    return tuple(out)


def mutants(table: tuple[Row, ...] = TABLE) -> list[Mutant]:
    """Every one-row mutant of ``table`` of the :data:`KINDS`, in table order."""
    out: list[Mutant] = []
    last_of: dict[str, int] = {}
    for i, row in enumerate(table):
        for g in row.when:
            new = replace(row, when=tuple(x for x in row.when if x != g))
            out.append(
                Mutant(f"drop_when:{row.id}:{g}", "drop_when", row.id, _replace_row(table, i, new))
            )
        for g in row.unless:
            new = replace(row, unless=tuple(x for x in row.unless if x != g))
            out.append(
                Mutant(
                    f"drop_unless:{row.id}:{g}", "drop_unless", row.id, _replace_row(table, i, new)
                )
            )
        for k, v in row.set:
            new = replace(row, set=tuple(kv for kv in row.set if kv[0] != k))
            out.append(
                Mutant(
                    f"drop_set:{row.id}:{k}={v}", "drop_set", row.id, _replace_row(table, i, new)
                )
            )
        for n, e in enumerate(row.effects):
            new = replace(row, effects=row.effects[:n] + row.effects[n + 1 :])
            detail = e.name if row.effects.count(e) == 1 else f"{e.name}@{n}"
            out.append(
                Mutant(
                    f"drop_effect:{row.id}:{detail}",
                    "drop_effect",
                    row.id,
                    _replace_row(table, i, new),
                )
            )
        if row.trigger in last_of:  # swap with the trigger's previous alternative
            j = last_of[row.trigger]
            prev = table[j]
            swapped = list(table)
            swapped[i], swapped[j] = swapped[j], swapped[i]
            out.append(Mutant(f"swap:{prev.id}:{row.id}", "swap", prev.id, tuple(swapped)))
        last_of[row.trigger] = i
        out.append(Mutant(f"delete:{row.id}", "delete", row.id, _replace_row(table, i, None)))
    return out


# ----------------------------------------------------------------------------------------------
# The equivalents file


def read_equivalents(path: Path = EQUIVALENTS_FILE) -> dict[str, str]:
    """``{mutant id: why}`` from the file: one ``id  why`` per line (``#`` comments).

    Raises ``ValueError`` for a line without a reason or an id listed twice."""
    out: dict[str, str] = {}
    if not path.exists():
        return out
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        mid, _, why = line.partition(" ")
        why = why.strip()
        if not why:
            raise ValueError(f"{path.name}:{n}: {mid} has no reason")
        if mid in out:
            raise ValueError(f"{path.name}:{n}: {mid} is listed twice")
        out[mid] = why
    return out


# ----------------------------------------------------------------------------------------------
# Judging


def _behaviour(row: Row, after: object) -> tuple[object, ...]:
    """What a step does, whichever row does it: its kind, answer, effects, context actions,
    the timers it (re)starts (setting ``*_armed=True`` restarts a running timer in full) and
    the state after."""
    started = tuple(sorted(k for k, v in row.set if k.endswith("_armed") and v))
    return (row.kind, row.refuse, row.pending, row.effects, row.actions, started, after)


@dataclass
class Verdict:
    """``killed`` (by ``checker`` or ``stateful``), ``survived`` or ``equivalent``."""

    id: str
    kind: str
    verdict: str
    by: str | None = None
    detail: str = ""
    same_steps: bool = False  # every reachable step is the production table's
    seconds: float = 0.0


def _checker_detail(report: Report) -> str:
    if report.violations:
        return "violated " + ", ".join(v.invariant for v in report.violations)
    parts = []
    for label, items in (
        ("unreached state", report.unreached_states),
        ("unreached value", report.unreached_values),
        ("unused row", report.unused_rows),
        ("unreached code", report.unreached_codes),
    ):
        if items:
            parts.append(
                f"{label} {items[0]}" + (f" (+{len(items) - 1})" if len(items) > 1 else "")
            )
    return "; ".join(parts)


class Judge:
    """Judges mutants of one base table, sharing the checker's steps between them."""

    def __init__(self, base: tuple[Row, ...] = TABLE) -> None:
        self.base = base
        self.cache = StepCache(base)
        self.base_report = check(base, reuse=self.cache, keep_steps=True)
        if not self.base_report.ok:
            raise RuntimeError("the base table fails the checker:\n" + self.base_report.render())
        self.reachable = sorted({s for s, *_ in self.base_report.steps}, key=repr)

    def checker(self, m: Mutant) -> Report:
        return check(m.table, reuse=self.cache)

    def same_steps(self, m: Mutant) -> bool:
        """Whether ``m`` does what the base does in every (state, event) the base reaches:
        the same answer, effects, context actions, timers (re)started and state after. Then
        the mutant explores the same state space and behaves identically there (equivalent at
        the checker's abstraction)."""
        return self.compare(m)[0]

    def compare(self, m: Mutant) -> tuple[bool, list[tuple[str, str]]]:
        """``(same behaviour everywhere, [(mutant's row, base's row)]`` where another row
        decides, each pair once)."""
        fresh = self.cache.changed(m.table)
        mine = tuple(r for r in m.table if r.trigger in fresh)
        core = Lifecycle(table=mine, id_factory=lambda: "attachment-A")
        base_core = self.cache.core
        rows = {r.id: r for r in m.table}
        events = [e for e in alphabet(fresh) if e.trigger in fresh]
        other: dict[tuple[str, str], None] = {}
        for state in self.reachable:
            snap = Snapshot(state, canonical_context(state))
            for event in events:
                try:
                    core.restore(snap)
                    got = core.handle(event, 10.0)
                except Exception:  # noqa: BLE001 - any failure differs from the base
                    return False, list(other)
                base_core.restore(snap)
                want = base_core.handle(event, 10.0)
                if _behaviour(rows[got.row], got.after) != _behaviour(
                    self.cache.by_id[want.row], want.after
                ):
                    return False, list(other)
                if got.row != want.row:
                    other[(got.row, want.row)] = None
        return True, list(other)

    def explain(self, m: Mutant) -> str:
        """A one-line reason for a mutant that takes every reachable step as the base does (a
        candidate line of the equivalents file, to review)."""
        same, other = self.compare(m)
        assert same, m.id
        kind, _, rest = m.id.partition(":")
        row_id, _, detail = rest.partition(":")
        pairs = ", ".join(f"{a} for {b}" for a, b in other[:3]) + (" ..." if len(other) > 3 else "")
        if kind == "drop_set":
            k, _, v = detail.partition("=")
            return f"{k} is already {v} wherever {row_id} fires"
        if kind == "swap":
            if not other:
                return f"{row_id} and {detail} never both apply in a reachable state"
            return f"where both apply they answer and change alike ({pairs})"
        if kind in ("drop_when", "drop_unless"):
            holds = "holding" if kind == "drop_when" else "false"
            if not other:
                return f"{row_id} is never reached without `{detail}` {holds}"
            return f"where {row_id} now fires without `{detail}` it does what the row it displaces does ({pairs})"
        if kind == "delete":
            return f"where {row_id} fired, the next alternative does the same ({pairs})"
        return "every reachable step is the production table's (same answer, effects and state)"

    def stateful(self, m: Mutant, budget: dict[str, int] = SWEEP_BUDGET) -> str | None:
        """Run the stateful test on ``m``: its deterministic tour of every barrier stage, then
        the Hypothesis state machine with ``budget``. The first failure's first line, or
        ``None`` when both pass."""
        from tests.model.stateful import make_machine, tour

        sink = io.StringIO()
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                tour(m.table)
                run_state_machine_as_test(make_machine(m.table), settings=sweep_profile(**budget))
        except Exception as exc:  # noqa: BLE001 - any failure kills the mutant
            text = str(exc).strip().splitlines()
            return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
        return None

    def judge(
        self,
        m: Mutant,
        equivalents: dict[str, str],
        budget: dict[str, int] = SWEEP_BUDGET,
        *,
        run_stateful: bool = True,
    ) -> Verdict:
        """The verdict on ``m``. A listed equivalent is still checked: killed is killed."""
        t0 = time.perf_counter()
        report = self.checker(m)
        v = Verdict(m.id, m.kind, "survived")
        if not report.ok:
            v.verdict, v.by, v.detail = "killed", "checker", _checker_detail(report)
        else:
            v.same_steps = self.same_steps(m)
            # A mutant that takes every reachable step as the base does is equivalent at the
            # checker's abstraction; the stateful test runs on every other survivor.
            if run_stateful and not v.same_steps:
                failure = self.stateful(m, budget)
                if failure is not None:
                    v.verdict, v.by, v.detail = "killed", "stateful", failure
        if v.verdict == "survived" and m.id in equivalents:
            v.verdict, v.detail = "equivalent", equivalents[m.id]
        v.seconds = round(time.perf_counter() - t0, 3)
        return v


# ----------------------------------------------------------------------------------------------
# Sweeps


@dataclass
class Sweep:
    verdicts: list[Verdict]
    errors: list[str]
    seconds: float

    def count(self, verdict: str, by: str | None = None) -> int:
        return sum(1 for v in self.verdicts if v.verdict == verdict and (by is None or v.by == by))

    @property
    def non_equivalent(self) -> int:
        return len(self.verdicts) - self.count("equivalent")

    @property
    def kill_rate(self) -> float:
        n = self.non_equivalent
        return 1.0 if n == 0 else self.count("killed") / n

    def summary(self) -> dict[str, object]:
        by_kind: dict[str, dict[str, int]] = {}
        for v in self.verdicts:
            k = by_kind.setdefault(
                v.kind,
                {
                    "mutants": 0,
                    "killed": 0,
                    "killed_by_checker": 0,
                    "killed_by_stateful": 0,
                    "survived": 0,
                    "equivalent": 0,
                },
            )
            k["mutants"] += 1
            k[v.verdict] += 1
            if v.by:
                k[f"killed_by_{v.by}"] += 1
        return {
            "mutants": len(self.verdicts),
            "killed": self.count("killed"),
            "killed_by_checker": self.count("killed", "checker"),
            "killed_by_stateful": self.count("killed", "stateful"),
            "survived": self.count("survived"),
            "equivalent": self.count("equivalent"),
            "kill_rate": round(self.kill_rate, 4),
            "by_kind": {k: by_kind[k] for k in KINDS if k in by_kind},
        }


def run_sweep(
    selected: Iterable[Mutant],
    *,
    judge: Judge | None = None,
    equivalents: dict[str, str] | None = None,
    budget: dict[str, int] = SWEEP_BUDGET,
    progress: bool = False,
    all_ids: set[str] | None = None,
) -> Sweep:
    """Judge every mutant of ``selected``; errors: listed equivalents that were killed, and
    listed ids that are no mutant of the table (``all_ids``: every mutant id, when given)."""
    t0 = time.perf_counter()
    judge = judge or Judge()
    equivalents = read_equivalents() if equivalents is None else equivalents
    verdicts: list[Verdict] = []
    errors: list[str] = []
    selected = list(selected)
    for n, m in enumerate(selected, 1):
        v = judge.judge(m, equivalents, budget)
        verdicts.append(v)
        if v.verdict == "killed" and m.id in equivalents:
            errors.append(f"{m.id} is listed as equivalent but {v.by} killed it: {v.detail}")
        if progress:
            print(
                f"[{n}/{len(selected)} {time.perf_counter() - t0:6.0f}s] {v.verdict:10s} "
                f"{v.by or '':8s} {m.id}  {v.detail[:100]}",
                flush=True,
            )
    if all_ids is not None:
        errors += [
            f"{mid} is listed as equivalent but is no mutant of the table"
            for mid in equivalents
            if mid not in all_ids
        ]
    return Sweep(verdicts, errors, time.perf_counter() - t0)


_WORKER: dict[str, object] = {}


def _work(chunk: list[int]) -> list[Verdict]:
    """A worker process: judge the mutants at these indices (one Judge per process)."""
    if "judge" not in _WORKER:
        _WORKER["judge"] = Judge()
        _WORKER["mutants"] = mutants()
        _WORKER["equivalents"] = read_equivalents()
    judge: Judge = _WORKER["judge"]  # type: ignore[assignment]
    everything: list[Mutant] = _WORKER["mutants"]  # type: ignore[assignment]
    out = []
    for i in chunk:
        v = judge.judge(everything[i], _WORKER["equivalents"])  # type: ignore[arg-type]
        print(f"[{i}] {v.verdict:10s} {v.by or '':8s} {v.id}  {v.detail[:100]}", flush=True)
        out.append(v)
    return out


def parallel_sweep(jobs: int, judge: Judge | None = None) -> Sweep:
    """The full sweep over ``jobs`` processes (every mutant, judged as by :func:`run_sweep`;
    the workers are forked from this process, so they share ``judge``'s memoised steps)."""
    import multiprocessing

    t0 = time.perf_counter()
    everything = mutants()
    equivalents = read_equivalents()
    _WORKER.update(judge=judge or Judge(), mutants=everything, equivalents=equivalents)
    chunks = [list(range(j, len(everything), jobs)) for j in range(jobs)]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        parts = pool.map(_work, chunks)
    by_id = {v.id: v for part in parts for v in part}
    verdicts = [by_id[m.id] for m in everything]
    errors = [
        f"{v.id} is listed as equivalent but {v.by} killed it: {v.detail}"
        for v in verdicts
        if v.verdict == "killed" and v.id in equivalents
    ]
    ids = {m.id for m in everything}
    errors += [
        f"{mid} is listed as equivalent but is no mutant of the table"
        for mid in equivalents
        if mid not in ids
    ]
    return Sweep(verdicts, errors, time.perf_counter() - t0)


def sample(all_mutants: list[Mutant], every: int = 10, offset: int = 0) -> list[Mutant]:
    """A fixed sample: every ``every``-th mutant from ``offset`` (spreads over kinds and
    triggers, in table order)."""
    return all_mutants[offset::every]


#: The CI sample: this many mutants of each kind, drawn with this seed (fixed, so CI judges
#: the same mutants every run; the seed is the issue's number, not one picked for its draw).
CI_PER_KIND, CI_SEED = 15, 19


def stratified_sample(
    all_mutants: list[Mutant], per_kind: int = CI_PER_KIND, seed: int = CI_SEED
) -> list[Mutant]:
    """A seeded draw of ``per_kind`` mutants of each of the :data:`KINDS` (all of a kind that
    has fewer), in table order: every kind of mistake is judged, none favoured by position."""
    import random

    rng = random.Random(seed)
    chosen: set[str] = set()
    for kind in KINDS:
        of_kind = [m.id for m in all_mutants if m.kind == kind]
        chosen.update(rng.sample(of_kind, min(per_kind, len(of_kind))))
    return [m for m in all_mutants if m.id in chosen]


def write_result(sweep: Sweep, path: Path = RESULT_FILE) -> None:
    """Write the sweep's raw verdicts (killed or survived, before the equivalents file is
    applied) and its summary with the equivalents file applied."""
    raw = []
    for v in sweep.verdicts:
        verdict = "survived" if v.verdict == "equivalent" else v.verdict
        raw.append(
            {
                "id": v.id,
                "kind": v.kind,
                "verdict": verdict,
                "by": v.by,
                "same_steps": v.same_steps,
                "detail": "" if verdict == "survived" else v.detail,
            }
        )
    data = {
        "table": fingerprint(),
        "rows": len(TABLE),
        "budget": {**SWEEP_BUDGET, "tour": True},
        "seconds": round(sweep.seconds),
        "summary": {},
        "verdicts": raw,
    }
    path.write_text(json.dumps(retally(data), indent=1) + "\n", encoding="utf-8")


def retally(data: dict, equivalents: dict[str, str] | None = None) -> dict:
    """``data`` (a result file's content) with its summary and survivors recomputed from its
    raw verdicts and the equivalents file: a survivor listed there is equivalent. Raises
    ``ValueError`` when a listed mutant was killed or is no mutant of the table."""
    equivalents = read_equivalents() if equivalents is None else equivalents
    verdicts = []
    known = set()
    for raw in data["verdicts"]:
        known.add(raw["id"])
        v = Verdict(raw["id"], raw["kind"], raw["verdict"], raw["by"], raw["detail"])
        v.same_steps = raw["same_steps"]
        if raw["id"] in equivalents:
            if v.verdict == "killed":
                raise ValueError(f"{v.id} is listed as equivalent but {v.by} killed it: {v.detail}")
            v.verdict, v.detail = "equivalent", equivalents[v.id]
        verdicts.append(v)
    unknown = sorted(set(equivalents) - known)
    if unknown:
        raise ValueError(f"listed as equivalent but no mutant of the table: {unknown}")
    sweep = Sweep(verdicts, [], data.get("seconds", 0))
    out = dict(data)
    out["summary"] = sweep.summary()
    out["survivors"] = [v.id for v in verdicts if v.verdict == "survived"]
    out = {
        k: out[k]
        for k in ("table", "rows", "budget", "seconds", "summary", "survivors", "verdicts")
    }
    return out


def _propose(judge: Judge, verdicts: Iterator[Verdict] | list[Verdict]) -> list[str]:
    by_id = {m.id: m for m in mutants(judge.base)}
    return [
        f"{v.id}  {judge.explain(by_id[v.id])}"
        for v in verdicts
        if v.verdict == "survived" and v.same_steps
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.model.mutation", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--sample", type=int, default=0, help="judge every N-th mutant only")
    parser.add_argument(
        "--ci", action="store_true", help="judge the CI sample only (tests/model/test_mutation.py)"
    )
    parser.add_argument("--only", default="", help="judge the mutants whose id contains this")
    parser.add_argument("--no-write", action="store_true", help="do not write the result file")
    parser.add_argument("--propose", action="store_true", help="print candidate equivalents")
    parser.add_argument("--checker-only", action="store_true", help="skip the stateful test")
    parser.add_argument("--jobs", type=int, default=1, help="processes for the full sweep")
    parser.add_argument(
        "--retally",
        action="store_true",
        help="apply the equivalents file to the last sweep's verdicts (no mutant is run again)",
    )
    args = parser.parse_args(argv)
    if args.retally:
        data = retally(json.loads(RESULT_FILE.read_text(encoding="utf-8")))
        RESULT_FILE.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(json.dumps(data["summary"], indent=1))
        return 0
    everything = mutants()
    selected = everything
    if args.sample:
        selected = sample(everything, args.sample)
    if args.ci:
        selected = stratified_sample(everything)
    if args.only:
        selected = [m for m in selected if args.only in m.id]
    budget = SWEEP_BUDGET
    judge = Judge()
    equivalents = read_equivalents()
    if args.jobs > 1 and not (args.sample or args.ci or args.only or args.checker_only):
        sweep = parallel_sweep(args.jobs, judge)
    elif args.checker_only:
        t0 = time.perf_counter()
        verdicts = [judge.judge(m, equivalents, run_stateful=False) for m in selected]
        sweep = Sweep(verdicts, [], time.perf_counter() - t0)
    else:
        sweep = run_sweep(
            selected,
            judge=judge,
            equivalents=equivalents,
            budget=budget,
            progress=True,
            all_ids={m.id for m in everything},
        )
    print(json.dumps(sweep.summary(), indent=1))
    for v in sweep.verdicts:
        if v.verdict == "survived":
            print(f"SURVIVED {v.id}{'  (same steps)' if v.same_steps else ''}")
    for e in sweep.errors:
        print(f"ERROR {e}")
    if args.propose:
        print("\n".join(_propose(judge, sweep.verdicts)))
    full = selected is everything and not args.checker_only
    if full and not args.no_write:
        write_result(sweep)
        print(f"wrote {RESULT_FILE.relative_to(REPO_ROOT)}")
    return 1 if sweep.errors else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
