"""The ``weights_audit`` line written with one encoding (``LineHandler.emit_stamped_object``,
issue 15: the record's JSON spliced behind the formatter's ``ts``, ``level`` and ``logger``
instead of decoded, merged and encoded again) is byte for byte the line of the general path
(``emit_line``, and the stdlib record path), in both ``LOG_FORMAT`` formats, with secrets and
``Bearer`` credentials redacted as before, and the ``WEIGHTS_AUDIT_LOG`` file unchanged."""

from __future__ import annotations

import io
import logging
import time

import msgspec
import pytest

from miserver.server import JsonFormatter, LineHandler, RedactSecrets, TextFormatter
from miserver.serving import audit as audit_module
from miserver.serving.audit import AuditLog, AuditRecord

SECRET = "s3cret-token-0123456789"
NOW_NS = 1_700_000_000_250_000_000
NOW = NOW_NS / 1e9


def _records() -> list[AuditRecord]:
    base = dict(
        operation="weights_commit_end",
        outcome="accepted",
        code=None,
        reason=None,
        role="trainer",
        label="trn",
        attachment_ref="abcd1234",
        model="tiny",
        weights_state="clean",
        weights_state_before="writing",
    )
    odd = 'q"uo\\te ,"ts":"x", \n\t\x01 \u2028 é 漢 /</script> 🙂'
    return [
        AuditRecord(**base, elapsed_ms=1.234, steps=5, transport="cpu_shared_memory"),
        AuditRecord(**{**base, "operation": "weights_quiesce", "weights_state": "clean"}),
        AuditRecord(
            **{
                **base,
                "outcome": "refused",
                "code": "WEIGHTS_UNAUTHORIZED",
                "role": None,
                "label": None,
                "attachment_ref": None,
                "model": None,
            }
        ),
        AuditRecord(**{**base, "label": odd, "model": odd, "reason": odd}),
        AuditRecord(**base, elapsed_ms=float("nan"), steps=2**62),
        AuditRecord(**base, elapsed_ms=1e-7, steps=0),
        AuditRecord(**base, elapsed_ms=123456789.123456789),
        AuditRecord(**{**base, "label": f"has {SECRET} inside"}),  # redacted: general path
        AuditRecord(**{**base, "label": "Bearer abc.def"}),  # a credential: general path
        AuditRecord(**{**base, "label": "bearer-free"}),  # "bearer" but nothing to redact
        AuditRecord(**{**base, "label": '"level":"x","logger":"y"'}),
        AuditRecord(**base, ts="2026-12-02T18:15:43.123Z"),  # its own stamp
    ]


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: NOW)
    monkeypatch.setattr(time, "time_ns", lambda: NOW_NS)


def _handler(fmt: logging.Formatter, stream: io.StringIO, cls=LineHandler) -> logging.Handler:
    handler = cls(stream)
    handler.setFormatter(fmt)
    handler.addFilter(RedactSecrets([SECRET]))
    return handler


def _audit_logger(handler: logging.Handler, monkeypatch: pytest.MonkeyPatch) -> None:
    logger = logging.getLogger(f"miserver.test.audit_one.{id(handler)}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    monkeypatch.setattr(logger, "name", "miserver.audit")
    monkeypatch.setattr(audit_module, "log", logger)


def _write_all(monkeypatch, handler, records, path=None) -> None:
    _audit_logger(handler, monkeypatch)
    log = AuditLog(path)
    for r in records:
        log.write(msgspec.structs.replace(r))
    log.close()


@pytest.mark.parametrize("fmt", [JsonFormatter, TextFormatter], ids=["json", "text"])
def test_the_spliced_audit_line_is_the_decoded_line(fmt, frozen_clock, monkeypatch, tmp_path):
    records = _records()
    for r in records:
        AuditLog._check_and_stamp(r)
    # the stdlib record path (a plain StreamHandler: a LogRecord, the filter, the formatter)
    stdlib = io.StringIO()
    _write_all(monkeypatch, _handler(fmt(), stdlib, logging.StreamHandler), records)
    # the previous path exactly: AuditLog.write through info_line and emit_line (decode,
    # merge, encode)
    old = io.StringIO()
    with monkeypatch.context() as m:
        m.setattr(LineHandler, "emit_stamped_object", None)
        _write_all(m, _handler(fmt(), old), records, tmp_path / "old.log")
    spliced = []
    real = JsonFormatter.format_stamped_object

    def counting(self, *args):
        out = real(self, *args)
        spliced.append(out is not None)
        return out

    monkeypatch.setattr(JsonFormatter, "format_stamped_object", counting)
    new = io.StringIO()
    _write_all(monkeypatch, _handler(fmt(), new), records, tmp_path / "new.log")
    assert new.getvalue() == old.getvalue() == stdlib.getvalue()
    assert new.getvalue().count("\n") == len(records) and SECRET not in new.getvalue()
    assert "abc.def" not in new.getvalue()
    assert (tmp_path / "new.log").read_bytes() == (tmp_path / "old.log").read_bytes()
    if fmt is JsonFormatter:
        # every record but the two the filter changes took the one-encoding path
        assert spliced.count(True) == len(records) - 2
        for line in new.getvalue().split("\n")[:-1]:  # not splitlines: U+2028 is in one
            fields = msgspec.json.decode(line)
            assert list(fields)[:3] == ["ts", "level", "logger"]
            assert fields["logger"] == "miserver.audit" and fields["event"] == "weights_audit"
    else:
        assert spliced == []


def test_a_line_of_another_shape_takes_the_general_path() -> None:
    fmt = JsonFormatter()
    ts = "2026-12-02T18:15:43.123Z"
    assert fmt.format_stamped_object("INFO", "n", '{"a":1,"event":"e"}', ts) is None  # no ts
    assert fmt.format_stamped_object("INFO", "n", f'{{"a":1,"ts":"{ts}"}}', ts) is None  # last
    assert fmt.format_stamped_object("INFO", "n", f'["ts":"{ts}",1]', ts) is None
    twice = f'{{"a":1,"ts":"{ts}","b":2,"ts":"{ts}","c":3}}'
    assert fmt.format_stamped_object("INFO", "n", twice, ts) is None
    assert fmt.format_stamped_object("INFO", "n", f'{{"a":1,"ts":"{ts}","b":2}}', ts) == (
        f'{{"ts":"{ts}","level":"info","logger":"n","a":1,"b":2}}'
    )


def test_handler_levels_unknown_filters_and_formatters_still_apply(monkeypatch) -> None:
    record = _records()[0]
    AuditLog._check_and_stamp(record)
    line = msgspec.json.encode(record).decode()

    class Other(logging.Filter):
        pass

    for setup in ("level", "filter", "formatter"):
        stream = io.StringIO()
        handler = _handler(JsonFormatter(), stream)
        if setup == "level":
            handler.setLevel(logging.WARNING)
            assert handler.emit_stamped_object("miserver.audit", logging.INFO, line, record.ts)
            assert stream.getvalue() == ""
        elif setup == "filter":
            handler.addFilter(Other())
            assert not handler.emit_stamped_object("miserver.audit", logging.INFO, line, record.ts)
        else:
            handler.setFormatter(logging.Formatter())
            assert not handler.emit_stamped_object("miserver.audit", logging.INFO, line, record.ts)
    # through AuditLog: an unknown filter takes the record path (and the filter runs)
    stream = io.StringIO()
    handler = _handler(JsonFormatter(), stream)
    seen = []

    class Seeing(logging.Filter):
        def filter(self, rec):
            seen.append(rec.getMessage())
            return True

    handler.addFilter(Seeing())
    _write_all(monkeypatch, handler, [record])
    assert seen == [line] and stream.getvalue().startswith(f'{{"ts":"{record.ts}"')
