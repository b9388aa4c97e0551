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
