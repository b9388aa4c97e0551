"""``info_line`` (the access and audit lines, issue 15) writes what ``Logger.info`` writes
through miserver's formatters and filters, without looking up the caller."""

from __future__ import annotations

import io
import logging

from miserver.server import JsonFormatter, RedactSecrets
from miserver.serving.audit import info_line


def _capture(level: int = logging.INFO) -> tuple[logging.Logger, io.StringIO, list]:
    logger = logging.getLogger("miserver.test.info_line")
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(level)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RedactSecrets(["s3cret-token-0123456789"]))
    records: list[logging.LogRecord] = []
    handler.addFilter(lambda r: records.append(r) or True)
    logger.addHandler(handler)
    return logger, out, records


def _strip_ts(line: str) -> str:
    return line.split(",", 1)[1]  # the ts field comes first


def test_the_same_lines_as_logger_info_without_the_caller():
    logger, out, records = _capture()
    msg = '%s "%s %s" %d "%s"'
    args = ("127.0.0.1", "POST", "/api/weights/quiesce", 200, "Bearer s3cret-token-0123456789")
    logger.info(msg, *args)
    info_line(logger, msg, *args)
    audit = '{"operation":"weights_quiesce","outcome":"accepted","event":"weights_audit"}'
    logger.info(audit)
    info_line(logger, audit)
    a, b, c, d = out.getvalue().splitlines()
    assert _strip_ts(a) == _strip_ts(b) and "s3cret" not in b and "***" in b
    assert _strip_ts(c) == _strip_ts(d) and '"operation":"weights_quiesce"' in d
    assert records[1].funcName == "(unknown function)" and records[1].lineno == 0
    assert records[0].funcName == "test_the_same_lines_as_logger_info_without_the_caller"


def test_levels_still_apply():
    logger, out, _ = _capture(logging.WARNING)
    info_line(logger, "not written")
    assert out.getvalue() == ""
