"""docs/operations.md shows weights_audit lines exactly as the code writes them (finding 16).

The example lines must decode as :class:`~miserver.serving.audit.AuditRecord` (the same fields, in
the same order, with the same types) and carry a ``ts`` in the form :class:`AuditLog` stamps.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec

from miserver.serving.audit import AuditLog, AuditRecord

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def example_lines() -> list[str]:
    text = DOC.read_text()
    section = text[text.index("## Reading the audit log") :]
    block = re.search(r"```json\n(.*?)```", section, re.S)
    assert block, "the audit section has no json example"
    return [line for line in block.group(1).splitlines() if line.strip()]


def a_real_line(tmp_path: Path) -> dict:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path))
    audit.write(
        AuditRecord(
            operation="weights_commit_end",
            outcome="accepted",
            code=None,
            reason=None,
            role="trainer",
            label="trainer",
            attachment_ref="0123abcd",
            model="m",
            weights_state="clean",
            weights_state_before="writing",
            elapsed_ms=1.5,
            steps=1,
        )
    )
    audit.close()
    return json.loads(path.read_text())


def test_the_audit_examples_are_lines_the_code_writes(tmp_path: Path) -> None:
    real = a_real_line(tmp_path)
    stamp = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
    assert stamp.match(real["ts"])
    lines = example_lines()
    assert lines
    for line in lines:
        shown = json.loads(line)  # one JSON object a line, as in the file
        assert list(shown) == list(real), line  # the fields, in the written order
        msgspec.json.decode(line, type=AuditRecord)  # the types (ts a string, ...)
        assert stamp.match(shown["ts"]), shown["ts"]
        assert shown["event"] == "weights_audit"
