"""The weights_audit line: exactly the weights page's fields, to the log and the file."""

import json
import logging

import pytest

from miserver.serving.audit import AuditLog, AuditRecord

FIELDS = {
    "operation",
    "outcome",
    "code",
    "reason",
    "role",
    "label",
    "attachment_ref",
    "model",
    "weights_state",
    "weights_state_before",
    "elapsed_ms",
    "steps",
    "transport",  # contract 10: the attachment's transport
    "ts",
    "event",
}


def _record(**kw):
    base = dict(
        operation="weights_commit_end",
        outcome="accepted",
        code=None,
        reason=None,
        role="trainer",
        label="trn",
        attachment_ref="abcd1234",
        model="m",
        weights_state="clean",
        weights_state_before="writing",
        elapsed_ms=12.5,
        steps=3,
    )
    base.update(kw)
    return AuditRecord(**base)


def test_file_gets_one_json_line_per_call(tmp_path, caplog):
    path = tmp_path / "audit" / "weights.jsonl"
    audit = AuditLog(str(path))
    with caplog.at_level(logging.INFO, logger="miserver.audit"):
        audit.write(_record())
        audit.write(
            _record(
                operation="weights_attach",
                outcome="refused",
                code="WEIGHTS_UNAUTHORIZED",
                role=None,
                label=None,
                elapsed_ms=None,
                steps=None,
            )
        )
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and audit.count == 2
    first = json.loads(lines[0])
    assert set(first) == FIELDS and first["event"] == "weights_audit"
    assert first["steps"] == 3 and first["weights_state_before"] == "writing"
    assert json.loads(lines[1])["code"] == "WEIGHTS_UNAUTHORIZED"
    assert sum("weights_audit" in r.getMessage() for r in caplog.records) == 2


def test_unknown_operation_is_refused():
    with pytest.raises(ValueError):
        AuditLog().write(_record(operation="weights_bogus"))


async def test_write_soon_writes_after_the_current_turn_in_call_order(tmp_path):
    import asyncio

    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path))
    audit.write_soon(_record(operation="weights_quiesce"))
    audit.write_soon(_record(operation="weights_commit_begin"))
    assert audit.count == 0  # nothing written inside the deciding turn
    with pytest.raises(ValueError):
        audit.write_soon(_record(operation="bogus"))  # refused at once, not later
    await asyncio.sleep(0)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [x["operation"] for x in lines] == ["weights_quiesce", "weights_commit_begin"]
    assert all(x["ts"].endswith("Z") for x in lines)
    audit.close()


def test_write_soon_outside_a_loop_writes_at_once(tmp_path):
    audit = AuditLog(str(tmp_path / "audit.jsonl"))
    audit.write_soon(_record())
    assert audit.count == 1
    audit.close()
