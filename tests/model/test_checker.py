"""``miserver check`` on the production table: it passes, prints its counts, and reaches every
machine state, every component value, every row and every code and reason of the weights page."""

from __future__ import annotations

import json

import pytest

from miserver import cli
from miserver.fsm.check import Report, alphabet, check
from miserver.fsm.compiled import compile_table
from miserver.fsm.table import TABLE, TRIGGERS
from miserver.spec import codes


@pytest.fixture(scope="module")
def report() -> Report:
    return check()


def test_production_table_passes(report: Report) -> None:
    assert report.ok, report.render()
    assert report.violations == []
    assert report.states > 100 and report.edges == report.states * report.events


def test_every_machine_state_row_and_value_is_reached(report: Report) -> None:
    compiled = compile_table(TABLE)
    assert report.named_states == report.named_states_total == len(compiled.states)
    assert report.unreached_states == [] and report.unreached_values == []
    assert report.rows_used == report.rows == len(TABLE)


def test_every_code_and_reason_of_the_weights_page_is_reached(report: Report) -> None:
    reached = set(report.codes_reached)
    for name in codes.WEIGHTS_PAGE_CODES:
        code = codes.lookup(name)
        wanted = [f"{name}:{r}" for r in code.reasons] or [f"{name}:-"]
        for pair in wanted:
            assert pair in reached, f"{pair} is never produced"


def test_every_trigger_is_offered_with_each_caller_kind() -> None:
    events = alphabet(TRIGGERS)
    assert {e.trigger for e in events} == set(TRIGGERS)
    quiesce_tokens = {e.caller.token for e in events if e.trigger == "quiesce" and e.caller}
    assert quiesce_tokens == {"none", "invalid", "trainer", "operator"}


@pytest.mark.full  # tens of seconds: left out of make quick
def test_cli_check_prints_counts_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("miserver check: OK")
    for word in ("states", "edges", "invariants", "time"):
        assert word in out
    assert "[ ok ] one_attachment_at_most" in out


def test_cli_check_json(
    report: Report, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import miserver.fsm.check as check_module

    monkeypatch.setattr(check_module, "check", lambda: report)  # the same run, printed as JSON
    assert cli.main(["check", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True and data["violations"] == []
    assert data["states"] > 100 and data["edges"] > 10_000
    assert "totality" in data["invariants"] and "determinism" in data["invariants"]


@pytest.mark.full  # seconds to tens of seconds: left out of make quick
def test_check_reusing_memoised_steps_reports_exactly_what_a_plain_check_does(
    report: Report,
) -> None:
    """The mutation tester's fast path (check(reuse=StepCache)) is the same checker."""
    from miserver.fsm.check import StepCache
    from tests.model.test_planted_bugs import bug_missing_guard

    cache = StepCache()
    assert check(reuse=cache).as_dict() | {"seconds": 0} == report.as_dict() | {"seconds": 0}
    table = bug_missing_guard()
    plain, fast = check(table).as_dict(), check(table, reuse=cache).as_dict()
    assert not plain["ok"]
    assert fast | {"seconds": 0} == plain | {"seconds": 0}
