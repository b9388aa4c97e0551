"""The access and audit lines written from their parts (``LineHandler.emit_line``, issue 15) are
byte for byte the lines the stdlib record path writes, in both ``LOG_FORMAT`` formats; any
set-up the fast path does not know takes the record path."""

from __future__ import annotations

import io
import logging
import time

import pytest

from miserver.server import JsonFormatter, LineHandler, RedactSecrets, TextFormatter
from miserver.serving.audit import info_line

SECRET = "s3cret-token-0123456789"
NOW_NS = 1_700_000_000_250_000_000
NOW = NOW_NS / 1e9  # 1_700_000_000.25 exactly: the same milliseconds on both paths

ACCESS = (
    '%s "%s %s HTTP/%d.%d" %d %d %.3fms "%s"',
    "127.0.0.1",
    "POST",
    "/api/weights/quiesce",
    1,
    1,
    200,
    231,
    0.412,
    f"Bearer {SECRET}",
)
AUDIT = (
    '{"operation":"weights_quiesce","outcome":"accepted","code":null,"label":"lab",'
    '"ts":"2023-11-14T22:13:20.250Z","event":"weights_audit"}',
)
PLAIN = ("plain %d and %s", 7, "text with a secret " + SECRET)


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: NOW)
    monkeypatch.setattr(time, "time_ns", lambda: NOW_NS)


def _logger(fmt: logging.Formatter, *filters: logging.Filter) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = LineHandler(stream)
    handler.setFormatter(fmt)
    for f in filters:
        handler.addFilter(f)
    logger = logging.getLogger(f"miserver.test.fast_line.{id(stream)}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, stream


def _no_record(logger: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fast path built a LogRecord")

    monkeypatch.setattr(logger, "makeRecord", refuse)


@pytest.mark.parametrize("fmt", [JsonFormatter, TextFormatter])
@pytest.mark.parametrize("call", [ACCESS, AUDIT, PLAIN], ids=["access", "audit", "plain"])
def test_the_fast_line_is_the_record_line(fmt, call, frozen_clock, monkeypatch) -> None:
    logger, stream = _logger(fmt(), RedactSecrets([SECRET]))
    logger.info(*call)  # the stdlib path: a record, the filter, the formatter
    slow = stream.getvalue()
    stream.seek(0)
    stream.truncate()
    _no_record(logger, monkeypatch)
    info_line(logger, *call)
    fast = stream.getvalue()
    assert fast == slow
    assert SECRET not in fast and fast.endswith("\n") and fast.count("\n") == 1


def test_text_format_line_equals_format_across_seconds() -> None:
    fmt = TextFormatter()
    for created in (1_700_000_000.25, 1_700_000_000.999, 1_700_000_001.0, 1_699_999_999.5):
        record = logging.LogRecord("miserver.x", logging.INFO, "x", 1, "m %s", ("a",), None)
        record.created, record.msecs = created, (created % 1) * 1000
        line = fmt.format_line(created, record.msecs, "INFO", "miserver.x", "m a")
        assert line == fmt.format(record)


def test_levels_of_the_handler_still_apply(monkeypatch) -> None:
    logger, stream = _logger(JsonFormatter())
    logger.handlers[0].setLevel(logging.WARNING)
    _no_record(logger, monkeypatch)
    info_line(logger, "dropped by the handler's level")
    assert stream.getvalue() == ""


def test_an_unknown_filter_or_formatter_takes_the_record_path() -> None:
    seen: list[logging.LogRecord] = []
    logger, stream = _logger(JsonFormatter(), RedactSecrets([SECRET]))
    logger.handlers[0].addFilter(lambda r: seen.append(r) or True)
    info_line(logger, "with a filter of %s", SECRET)
    assert len(seen) == 1 and SECRET not in stream.getvalue()

    logger, stream = _logger(logging.Formatter("custom %(message)s"))
    info_line(logger, "line %d", 1)
    assert stream.getvalue() == "custom line 1\n"


def test_a_second_handler_gets_the_line_too() -> None:
    logger, stream = _logger(JsonFormatter())
    other = io.StringIO()
    parent = logging.getLogger("miserver.test.fast_line.parent")
    logger.propagate = True
    logger.parent = parent
    capture = logging.StreamHandler(other)
    parent.addHandler(capture)
    try:
        info_line(logger, "to both")
    finally:
        parent.removeHandler(capture)
    assert "to both" in stream.getvalue() and other.getvalue() == "to both\n"


def test_a_bad_format_is_reported_as_logging_reports_it(capsys) -> None:
    logger, stream = _logger(JsonFormatter())
    info_line(logger, "two %s %s", "one")  # logging prints "--- Logging error ---", no raise
    assert stream.getvalue() == ""
    assert "Logging error" in capsys.readouterr().err
