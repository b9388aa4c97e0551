"""Why a request body is not JSON, in words a client can act on (contract 2: every error
names what to fix and never repeats the body).

msgspec's decoder says "Input data was truncated" for a lone UTF-16 surrogate escape, and a
decoder recursing into a body nested thousands of levels deep raises :class:`RecursionError`
(which would otherwise reach the last line of defence as a 500). :func:`decode_error_message`
turns either, and every other decode error, into one sentence.
"""

from __future__ import annotations

import json
import re

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def decode_error_message(raw: bytes, exc: BaseException, what: str = "the request body") -> str:
    """One sentence saying why ``raw`` could not be decoded as JSON.

    Args:
        raw: the bytes that failed to decode.
        exc: what the decoder raised (``msgspec.DecodeError``, ``RecursionError``, ...).
        what: how the message names the document ("the request body", "line 3").

    Returns:
        For nesting too deep: that, and the fix; for a lone surrogate escape (valid JSON
        syntax, but not a Unicode string): that; otherwise "``what`` is not valid JSON: " and
        the decoder's own reason (which names a byte offset, never the content).
    """
    if isinstance(exc, RecursionError):
        return f"{what} nests arrays or objects too deeply to decode; flatten it"
    if not raw.strip():
        return f"{what} is empty; send a JSON object"
    if _holds_lone_surrogate(raw):
        return (
            f"{what} holds a lone UTF-16 surrogate escape (\\ud800-\\udfff not in a high-low "
            "pair), which is not a Unicode character; send the character itself or its pair"
        )
    reason = str(exc).strip()
    if reason == "Input data was truncated":
        reason = "it ends before the JSON value does"
    return f"{what} is not valid JSON: {reason}" if reason else f"{what} is not valid JSON"


def _holds_lone_surrogate(raw: bytes) -> bool:
    """Whether ``raw`` is JSON to Python's own decoder (which keeps a lone surrogate escape as
    that code point, and joins a pair into one character) with such a code point in a key or
    a string."""
    if b"\\u" not in raw:
        return False
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    stack = [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


# --- msgspec's validation messages in plain words (issue 32, item 6) --------------------------

_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "array": "an array",
    "object": "an object",
    "null": "null",
    "bytes": "a string",
}
_GOT_WORDS = {
    "int": "an integer",
    "float": "a number with a fraction",
    "str": "a string",
    "bool": "a boolean",
    "array": "an array",
    "object": "an object",
    "null": "null",
}
_EXPECTED = re.compile(r"^Expected `(?P<want>[^`]+)`(?P<rest>[^,]*)(?:, got `(?P<got>[^`]+)`)?$")
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_CONSTRAINT = re.compile(r"^\s*(?P<op>>=|<=|>|<)\s*(?P<n>-?[\d.]+)$")
_LENGTH = re.compile(r"^\s*of length (?P<op>>=|<=)\s*(?P<n>\d+)$")


def _type_words(spec: str) -> str:
    kinds = [k.strip() for k in spec.split("|")]
    words = [_TYPE_WORDS.get(k, k) for k in kinds if k != "null"] or ["null"]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def plain_validation_message(detail: str, field: str | None) -> str:
    """msgspec's validation ``detail`` (the message without its `` - at `$...` `` suffix) in
    plain words naming ``field``: ``Object missing required field `messages``` is
    ``messages is required``; ``Expected `int | null`, got `str``` for ``max_tokens`` is
    ``max_tokens must be an integer, not a string``. A message of another form is returned
    as it is (with `` at field``)."""
    name = field or "the value"
    missing = _MISSING_FIELD.match(detail)
    if missing:
        return f"{field or missing.group('field')} is required"
    expected = _EXPECTED.match(detail)
    if expected:
        want = _type_words(expected.group("want"))
        rest = expected.group("rest").strip()
        bound = _CONSTRAINT.match(rest)
        length = _LENGTH.match(rest)
        if bound:
            op = {">=": "at least", "<=": "at most", ">": "greater than", "<": "less than"}
            want += f" {op[bound.group('op')]} {bound.group('n')}"
        elif length:
            want += f" of {'at least' if length.group('op') == '>=' else 'at most'} "
            want += f"{length.group('n')} items"
        elif rest:
            return f"{detail} at {field}" if field else detail
        got = expected.group("got")
        if got is None:
            return f"{name} must be {want}"
        return f"{name} must be {want}, not {_GOT_WORDS.get(got, got)}"
    return f"{detail} at {field}" if field else detail
