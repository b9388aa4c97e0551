"""docs/state-machine.md is generated from the table: the committed file must be fresh, and
the generated text must show what the table says."""

from __future__ import annotations

import pytest

from miserver import docs_gen
from miserver.fsm.table import TABLE


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    return docs_gen.render_all()


def test_committed_state_machine_doc_is_fresh(rendered: dict[str, str]) -> None:
    committed = (docs_gen.REPO_ROOT / "docs/state-machine.md").read_text(encoding="utf-8")
    assert committed == rendered["docs/state-machine.md"], (
        "docs/state-machine.md is stale: run `miserver docs` and commit the result"
    )


def test_doc_has_diagrams_and_one_table_line_per_row(rendered: dict[str, str]) -> None:
    text = rendered["docs/state-machine.md"]
    assert text.count("```mermaid") >= 4 and "stateDiagram-v2" in text
    assert "s_active" not in text.replace("classDef s_active", "")  # no current state marked
    assert "| State | Event | Guard | Target | Refusal |" in text
    table_lines = [ln for ln in text.splitlines() if ln.startswith("| ") and " | " in ln]
    body = [ln for ln in table_lines if not ln.startswith(("| State ", "| Guard "))]
    assert len([ln for ln in body if ln.count(" | ") == 4]) == len(TABLE)
    assert "writing --> torn: address_moved | detach | watchdog_expired" in text
    assert "409 ALREADY_QUIESCED" in text


def test_main_writes_then_reports_up_to_date(tmp_path, capsys) -> None:
    assert docs_gen.main(root=tmp_path) == 0
    assert "wrote docs/state-machine.md" in capsys.readouterr().out
    assert docs_gen.stale(tmp_path) == []
    assert docs_gen.main(root=tmp_path) == 0
    assert "up to date" in capsys.readouterr().out
    (tmp_path / "docs/state-machine.md").write_text("old", encoding="utf-8")
    assert docs_gen.stale(tmp_path) == ["docs/state-machine.md"]
