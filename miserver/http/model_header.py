"""``X-miLLM-Model``: which parameter set answered (weights page, "Which weights answered").

The value is an RFC 8941 string item with parameters, built and parsed with ``http-sfv``::

    X-miLLM-Model: "<served name>";origin=<model|checkpoint|adapter>;commits=<n>

``commits`` counts the commit-ends since the served name was set; it is omitted when not known
(None), and written as 0 only when 0 is known. Non-streamed ``/v1`` responses and Batch API output
lines carry it as a header; a stream carries the same value as ``millm_model`` on its terminal
chunk. :func:`model_header` is the one place the value is built.
"""

from __future__ import annotations

from typing import Protocol

import http_sfv

HEADER = "X-miLLM-Model"
ORIGINS = ("model", "checkpoint", "adapter")


class ServedWeights(Protocol):
    """What the header is built from (``miserver.serving.models.host.Resident`` has these)."""

    served_name: str
    origin: str
    commits: int | None


def model_header(weights: ServedWeights) -> str:
    """The ``X-miLLM-Model`` value for ``weights``.

    Raises:
        ValueError: ``origin`` is not model, checkpoint or adapter; ``commits`` is negative or
            not an integer; the served name holds a character an RFC 8941 string cannot carry
            (outside printable ASCII).
    """
    origin = weights.origin
    if origin not in ORIGINS:
        raise ValueError(f"origin must be one of {', '.join(ORIGINS)}, got {origin!r}")
    name = weights.served_name
    if not isinstance(name, str) or any(not 0x20 <= ord(c) <= 0x7E for c in name):
        raise ValueError(f"served name {name!r} is not printable ASCII (RFC 8941 sf-string)")
    item = http_sfv.Item()
    item.value = name
    item.params["origin"] = http_sfv.Token(origin)
    commits = weights.commits
    if commits is not None:
        if isinstance(commits, bool) or not isinstance(commits, int) or commits < 0:
            raise ValueError(f"commits must be a non-negative integer or None, got {commits!r}")
        item.params["commits"] = commits
    return str(item)


def parse_model_header(value: str) -> tuple[str, str, int | None]:
    """``(served_name, origin, commits)`` from an ``X-miLLM-Model`` value (commits None when
    absent). Raises ``ValueError`` when the value is not a string item with a token origin."""
    item = http_sfv.Item()
    try:
        item.parse(value.encode("ascii"))
    except Exception as exc:  # noqa: BLE001 - http-sfv raises ValueError and others
        raise ValueError(f"not an RFC 8941 item: {value!r} ({exc})") from None
    if not isinstance(item.value, str) or isinstance(item.value, http_sfv.Token):
        raise ValueError(f"the item is not a string: {value!r}")
    origin = item.params.get("origin")
    if not isinstance(origin, http_sfv.Token) or str(origin) not in ORIGINS:
        raise ValueError(f"origin is missing or not one of {ORIGINS}: {value!r}")
    commits = item.params.get("commits")
    if commits is not None and (isinstance(commits, bool) or not isinstance(commits, int)):
        raise ValueError(f"commits is not an integer: {value!r}")
    return item.value, str(origin), commits
