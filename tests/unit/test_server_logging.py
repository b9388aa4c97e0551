"""``miserver serve`` logging: JSON lines, and no configured secret in any line."""

from __future__ import annotations

import io
import json
import logging

import pytest

from miserver.server import JsonFormatter, RedactSecrets, configure_logging
from miserver.spec.settings import Settings, WeightsToken

SECRET = "s3cret-s3cret-s3cret-0001"


def _capture(fmt: logging.Formatter, secrets: list[str]) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(fmt)
    handler.addFilter(RedactSecrets(secrets))
    logger = logging.getLogger(f"test.redact.{id(stream)}")
    logger.propagate = False
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return logger, stream


def test_secrets_and_bearer_credentials_are_redacted() -> None:
    logger, stream = _capture(logging.Formatter("%(message)s"), [SECRET])
    logger.info("token %s in args", SECRET)
    logger.info("header Authorization: Bearer abc.def-ghi, next")
    try:
        raise ValueError(f"boom {SECRET}")
    except ValueError:
        logger.exception("failed")
    text = stream.getvalue()
    assert SECRET not in text
    assert "abc.def-ghi" not in text
    assert text.count("***") == 3
    assert "Bearer ***" in text and "ValueError: boom ***" in text


def test_json_lines_merge_audit_objects() -> None:
    logger, stream = _capture(JsonFormatter(), [SECRET])
    logger.info("plain %d", 7)
    logger.info(
        json.dumps(
            {"event": "weights_audit", "operation": "weights_attach", "label": "lab", "ts": 1.5}
        )
    )
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "plain 7" and first["level"] == "info"
    assert first["ts"].endswith("Z") and first["logger"].startswith("test.redact")
    assert "message" not in second
    assert (second["event"], second["operation"], second["ts"]) == (
        "weights_audit",
        "weights_attach",
        1.5,
    )


def test_configure_logging_follows_settings(tmp_path, capsys: pytest.CaptureFixture) -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        settings = Settings(
            home=str(tmp_path),
            log_level="warning",
            log_format="json",
            weights_tokens=(WeightsToken(label="a", role="trainer", secret=SECRET),),
        )
        configure_logging(settings)
        logging.getLogger("miserver.x").info("hidden")
        logging.getLogger("miserver.x").warning("shown %s", SECRET)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1
        assert json.loads(err[0])["message"] == "shown ***"
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_access_line_names_the_call_and_never_a_credential() -> None:
    from types import SimpleNamespace

    from miserver.server import AccessLogger

    logger, stream = _capture(JsonFormatter(), [SECRET])
    request = SimpleNamespace(
        remote="127.0.0.1",
        method="POST",
        path_qs="/api/weights/commit-end",
        version=SimpleNamespace(major=1, minor=1),
        headers={"User-Agent": "miserver-trainer", "Authorization": f"Bearer {SECRET}"},
    )
    response = SimpleNamespace(status=200, body_length=231)
    access = AccessLogger(logger, "")
    assert access.enabled
    access.log(request, response, 0.000412)
    line = json.loads(stream.getvalue())
    assert line["message"] == (
        '127.0.0.1 "POST /api/weights/commit-end HTTP/1.1" 200 231 0.412ms "miserver-trainer"'
    )
    assert SECRET not in stream.getvalue()
    logger.setLevel(logging.WARNING)
    assert not access.enabled  # aiohttp then skips the call entirely


def test_json_timestamps_follow_each_record_across_seconds() -> None:
    fmt = JsonFormatter()
    stamps = []
    for created in (1_700_000_000.25, 1_700_000_000.75, 1_700_000_001.5, 1_700_000_000.0):
        record = logging.LogRecord("miserver.x", logging.INFO, "x", 1, "m", None, None)
        record.created, record.msecs = created, (created % 1) * 1000
        stamps.append(json.loads(fmt.format(record))["ts"])
    assert stamps == [
        "2023-11-14T22:13:20.250Z",
        "2023-11-14T22:13:20.750Z",
        "2023-11-14T22:13:21.500Z",
        "2023-11-14T22:13:20.000Z",
    ]
