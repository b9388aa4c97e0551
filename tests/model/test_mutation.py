"""Mutation testing of the lifecycle table (tests/model/mutation.py): a fixed sample of one-row
mutants must all be killed unless listed as equivalent; the equivalents file is well formed;
the recorded full sweep (docs/state-machine-mutants.json) is for today's table and kills at
least 95% of its non-equivalent mutants."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from miserver.fsm.table import TABLE, TRIGGERS, fingerprint, rows_for
from tests.model.mutation import (
    CI_PER_KIND,
    CI_SEED,
    KINDS,
    RESULT_FILE,
    Judge,
    mutants,
    read_equivalents,
    retally,
    run_sweep,
    stratified_sample,
)


@pytest.fixture(scope="module")
def everything():
    return mutants()


def test_every_one_row_mutant_of_each_kind_is_made(everything) -> None:
    counts = Counter(m.kind for m in everything)
    assert counts["drop_when"] == sum(len(r.when) for r in TABLE)
    assert counts["drop_unless"] == sum(len(r.unless) for r in TABLE)
    assert counts["drop_set"] == sum(len(r.set) for r in TABLE)
    assert counts["drop_effect"] == sum(len(r.effects) for r in TABLE)
    assert counts["delete"] == len(TABLE)
    assert counts["swap"] == sum(max(0, len(rows_for(t)) - 1) for t in TRIGGERS)
    assert set(counts) == set(KINDS)
    assert len({m.id for m in everything}) == len(everything)
    # each mutant differs from the table in exactly one row (or one pair, for a swap)
    for m in everything[::37]:
        assert m.table != TABLE
        changed = [i for i, (a, b) in enumerate(zip(m.table, TABLE, strict=False)) if a != b]
        assert m.kind == "delete" or len(m.table) == len(TABLE)
        assert m.kind in ("delete", "swap") or len(changed) == 1


def test_equivalents_file_lists_mutants_of_the_table_each_with_a_reason(everything) -> None:
    listed = read_equivalents()
    ids = {m.id for m in everything}
    assert listed, "the equivalents file is empty"
    for mid, why in listed.items():
        assert mid in ids, f"{mid} is no mutant of today's table"
        assert len(why.split()) >= 4, f"{mid}: the reason is too short: {why!r}"


#: Listed equivalents that do not take every reachable step as the production table does
#: (at the checker's abstraction they differ; their line in the file says why they mean the
#: same): a DROP_CACHE where the cache is provably empty is a different effect list.
NOT_SAME_STEPS = {"drop_effect:save#106:DROP_CACHE"}


@pytest.mark.full  # seconds to tens of seconds: left out of make quick
def test_listed_equivalents_take_every_reachable_step_as_the_table_does(everything) -> None:
    """The reasons of the equivalents file are claims about the reachable states; the tester
    checks the claim they come to: in every reachable (state, event) of the checker, the
    mutant decides as the production table does (same answer, effects, actions, timers
    restarted, state after). Only :data:`NOT_SAME_STEPS` are exempt."""
    judge = Judge()
    by_id = {m.id: m for m in everything}
    listed = read_equivalents()
    assert set(listed) >= NOT_SAME_STEPS
    differ = sorted(
        mid for mid in listed if mid not in NOT_SAME_STEPS and not judge.same_steps(by_id[mid])
    )
    assert differ == [], f"listed as equivalent, but some reachable step differs: {differ}"
    assert all(not judge.same_steps(by_id[mid]) for mid in NOT_SAME_STEPS)


def test_ci_sample_is_a_seeded_draw_of_each_kind(everything) -> None:
    chosen = stratified_sample(everything)
    counts = Counter(m.kind for m in chosen)
    assert counts == {k: CI_PER_KIND for k in KINDS}, counts
    assert chosen == stratified_sample(everything), "the draw must be the same every run"
    assert stratified_sample(everything, seed=CI_SEED + 1) != chosen  # it is a draw


@pytest.mark.full  # seconds to tens of seconds: left out of make quick
def test_ci_sample_kills_every_non_equivalent_mutant(everything) -> None:
    """The CI sample (:func:`stratified_sample`: CI_PER_KIND of each kind, seed CI_SEED):
    every mutant in it is killed, by the checker or the stateful test, unless the equivalents
    file lists it."""
    chosen = stratified_sample(everything)
    sweep = run_sweep(chosen, judge=Judge())
    survivors = [v.id for v in sweep.verdicts if v.verdict == "survived"]
    assert not sweep.errors, sweep.errors
    assert survivors == [], f"survived the checker and the stateful test: {survivors}"
    assert sweep.count("killed") > 0 and sweep.kill_rate == 1.0


def test_recorded_full_sweep_is_for_this_table_and_kills_95_percent() -> None:
    data = json.loads(RESULT_FILE.read_text(encoding="utf-8"))
    assert data["table"] == fingerprint(TABLE), (
        "docs/state-machine-mutants.json is for another table: run "
        "`python -m tests.model.mutation`, then `miserver docs`"
    )
    assert len(data["verdicts"]) == len(mutants())
    # the equivalents file as it is now, applied to the recorded verdicts, gives the record
    assert retally(data) == data, "run `python -m tests.model.mutation --retally`"
    summary = data["summary"]
    assert summary["kill_rate"] >= 0.95, summary
    assert summary["killed"] + summary["equivalent"] + summary["survived"] == summary["mutants"]


def test_retally_refuses_an_equivalent_that_was_killed() -> None:
    data = {
        "table": "x",
        "rows": 1,
        "budget": {},
        "seconds": 0,
        "verdicts": [
            {
                "id": "delete:a#0",
                "kind": "delete",
                "verdict": "killed",
                "by": "checker",
                "same_steps": False,
                "detail": "violated totality",
            }
        ],
    }
    with pytest.raises(ValueError, match="killed"):
        retally(data, {"delete:a#0": "it is fine really"})
    with pytest.raises(ValueError, match="no mutant"):
        retally(data, {"delete:b#1": "no such mutant at all"})
    assert retally(data, {})["summary"]["killed"] == 1
