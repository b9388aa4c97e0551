"""The Batch API's input file and its validation (contract 7): the limits, the endpoints a batch may
target, one validated line (:class:`InputRow`), and :class:`BatchRequestError`, the refusal the
store raises (the HTTP layer renders it in OpenAI's shape).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from miserver.spec import codes
from miserver.spec.codes import ErrorCode

#: The endpoints a batch may target (contract 7: the two /v1 generation routes).
ENDPOINTS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions")
#: The only completion window OpenAI defines.
COMPLETION_WINDOWS: dict[str, int] = {"24h": 24 * 3600}
#: OpenAI's limit on requests per batch file.
MAX_ROWS = 50_000
MAX_CUSTOM_ID_CHARS = 512
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
#: How many line errors one 400 lists before it says "and N more".
MAX_REPORTED_ERRORS = 5
_ROW_KEYS = frozenset({"custom_id", "method", "url", "body"})

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.decode

#: ``(url, body) -> problem or None``: what the route ``url`` would refuse in ``body`` before
#: it looks at a model (the HTTP layer's :func:`miserver.http.openai_schema.check_body`).
BodyCheck = Callable[[str, dict[str, Any]], str | None]


class BatchRequestError(Exception):
    """A request to the store was refused; nothing was changed.

    ``code`` is one of :mod:`miserver.spec.codes` (the HTTP layer renders it in OpenAI's shape),
    ``param`` the request field at fault, when there is one.
    """

    def __init__(self, code: ErrorCode, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


@dataclass(frozen=True)
class InputRow:
    """One validated line of a batch input file (``line`` is 1-based)."""

    line: int
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]

    @property
    def model(self) -> str:
        return self.body["model"]


# --------------------------------------------------------------------------------------------
# Validation of the input file (contract 7)
# --------------------------------------------------------------------------------------------


def _line_error(row: dict[str, Any] | Any, body_check: BodyCheck | None = None) -> str | None:
    if not isinstance(row, dict):
        return "must be a JSON object"
    missing = sorted(_ROW_KEYS - row.keys())
    if missing:
        return "missing " + ", ".join(missing)
    unknown = sorted(row.keys() - _ROW_KEYS)
    if unknown:
        return "unknown field " + ", ".join(unknown)
    cid = row["custom_id"]
    if not isinstance(cid, str) or not cid:
        return "custom_id must be a non-empty string"
    if len(cid) > MAX_CUSTOM_ID_CHARS:
        return f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters"
    if row["method"] != "POST":
        return f'method must be "POST", got {short(row["method"])}'
    if row["url"] not in ENDPOINTS:
        return f"url must be one of {', '.join(ENDPOINTS)}, got {short(row['url'])}"
    body = row["body"]
    if not isinstance(body, dict):
        return "body must be a JSON object"
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return "body.model must be a non-empty string"
    if body.get("stream") not in (None, False):
        return "body.stream must be false or absent: batch rows are not streamed"
    return body_check(row["url"], body) if body_check is not None else None


def short(value: Any) -> str:
    text = _json_encode(value).decode("utf-8", "replace")
    return text if len(text) <= 60 else text[:57] + "..."


def parse_batch_input(data: bytes, body_check: BodyCheck | None = None) -> list[InputRow]:
    """Validate a batch input file (JSONL) line by line and return its rows in order.

    Each non-blank line must be ``{"custom_id": str, "method": "POST", "url":
    "/v1/chat/completions" | "/v1/completions", "body": {"model": str, ...}}``, custom_ids unique,
    at most :data:`MAX_ROWS` rows. ``body_check`` checks each body as its route would before it
    looks at a model (the server passes the ``/v1`` schema's; issue 32, item 13); what needs the
    model (the context window, the model's name) is checked when the row runs (a refusal is that
    row's error line).

    Raises :class:`BatchRequestError` (``INVALID_REQUEST``, param ``file``) naming the first
    :data:`MAX_REPORTED_ERRORS` bad lines by number.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchRequestError(
            codes.INVALID_REQUEST, f"the file is not UTF-8 (byte {exc.start})", param="file"
        ) from None
    rows: list[InputRow] = []
    errors: list[str] = []
    n_errors = 0
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        problem: str | None
        try:
            obj = _json_decode(raw)
        except msgspec.DecodeError as exc:
            problem = f"is not valid JSON ({exc})"
        except RecursionError:
            problem = "nests arrays or objects too deeply to decode"
        else:
            problem = _line_error(obj, body_check)
            if problem is None:
                first = seen.get(obj["custom_id"])
                if first is not None:
                    problem = f"custom_id {short(obj['custom_id'])} repeats line {first}"
                else:
                    seen[obj["custom_id"]] = number
                    rows.append(
                        InputRow(number, obj["custom_id"], obj["method"], obj["url"], obj["body"])
                    )
        if problem is not None:
            n_errors += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(f"line {number}: {problem}")
    if n_errors:
        more = f" (and {n_errors - len(errors)} more)" if n_errors > len(errors) else ""
        raise BatchRequestError(
            codes.INVALID_REQUEST,
            "invalid batch input file: " + "; ".join(errors) + more,
            param="file",
        )
    if not rows:
        raise BatchRequestError(
            codes.INVALID_REQUEST, "the batch input file has no requests", param="file"
        )
    if len(rows) > MAX_ROWS:
        raise BatchRequestError(
            codes.INVALID_REQUEST,
            f"the batch input file has {len(rows)} requests; at most {MAX_ROWS} are allowed",
            param="file",
        )
    return rows


def check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise BatchRequestError(
            codes.INVALID_REQUEST, "metadata must be an object of strings", param="metadata"
        )
    if len(metadata) > MAX_METADATA_PAIRS:
        raise BatchRequestError(
            codes.INVALID_REQUEST,
            f"metadata has {len(metadata)} keys; at most {MAX_METADATA_PAIRS}",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise BatchRequestError(
                codes.INVALID_REQUEST,
                f"metadata key longer than {MAX_METADATA_KEY_CHARS} characters",
                param="metadata",
            )
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise BatchRequestError(
                codes.INVALID_REQUEST,
                f"metadata[{short(key)}] must be a "
                f"string of at most {MAX_METADATA_VALUE_CHARS} characters",
                param="metadata",
            )
    return dict(metadata)
