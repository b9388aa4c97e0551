"""``miserver serve`` logging: JSON lines, and no configured secret in any line."""

from __future__ import annotations

import io
import json
import logging

import pytest

from miserver.serving.server import JsonFormatter, RedactSecrets, configure_logging
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
