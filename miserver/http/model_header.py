"""``X-miLLM-Model``: which parameter set answered (weights page, "Which weights answered").

The value is an RFC 8941 string item with parameters, built and parsed with ``http-sfv``::

    X-miLLM-Model: "<served name>";origin=<model|checkpoint|adapter>;commits=<n>

``commits`` counts the commit-ends since the served name was set; it is omitted when not known
(None), and written as 0 only when 0 is known. Non-streamed ``/v1`` responses and Batch API output
lines carry it as a header; a stream carries the same value as ``millm_model`` on its terminal
chunk. :func:`model_header` is the one place the value is built.

A response held in flight across a commit (contract 4b) spans two or more sets and says so
(contract 4): ``commits`` is the set of its last token and the parameter ``from_commits=<n>``
the set of its first (absent when one set produced every token, or the first set's count is
not known); each choice carries ``millm_weight_spans`` (:func:`weight_spans_json`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import http_sfv

from miserver.serving.engine.provenance import WeightSpan

HEADER = "X-miLLM-Model"
ORIGINS = ("model", "checkpoint", "adapter")


class ServedWeights(Protocol):
    """What the header is built from (``miserver.serving.models.host.Resident`` has these)."""

    served_name: str
    origin: str
    commits: int | None


def model_header(weights: ServedWeights, *, from_commits: int | None = None) -> str:
    """The ``X-miLLM-Model`` value for ``weights``; ``from_commits``: the set of the first
    token when it is not ``weights``' (contract 4), written as the parameter ``from_commits``
    (``None``: absent).

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
    if from_commits is not None:
        if isinstance(from_commits, bool) or not isinstance(from_commits, int) or from_commits < 0:
            raise ValueError(f"from_commits must be a non-negative integer, got {from_commits!r}")
        item.params["from_commits"] = from_commits
    return str(item)


@dataclass(frozen=True)
class _SetOf:
    served_name: str
    origin: str
    commits: int | None


def weight_spans_json(spans: Sequence[WeightSpan]) -> list[dict[str, int]] | None:
    """A choice's ``millm_weight_spans``: ``[{"commits": n, "tokens": k}, ...]`` in order, when
    its tokens span more than one parameter set, else ``None`` (the field is left out).
    ``commits`` is omitted from a span whose set's count is not known (never written as 0)."""
    if len({span.set_id for span in spans}) < 2:
        return None
    out: list[dict[str, int]] = []
    for span in spans:
        entry: dict[str, int] = {} if span.commits is None else {"commits": span.commits}
        entry["tokens"] = span.tokens
        out.append(entry)
    return out


def response_model_header(weights: ServedWeights, choices: Iterable[Sequence[WeightSpan]]) -> str:
    """The ``X-miLLM-Model`` of a whole response (every choice's spans; contract 4): the set of
    its last token (the latest set any choice ended on) with ``from_commits`` naming the set of
    its first (the earliest set any choice began on) when they differ. Choices without spans
    (one set, an engine that records none) leave it :func:`model_header` of ``weights``.
    ``weights`` gives the served name and origin (and ``commits`` when no choice has spans)."""
    spanned = [list(spans) for spans in choices if spans]
    if not spanned:
        return model_header(weights)
    first = min((spans[0] for spans in spanned), key=lambda span: span.set_id)
    last = max((spans[-1] for spans in spanned), key=lambda span: span.set_id)
    at_last = _SetOf(weights.served_name, weights.origin, last.commits)
    if first.set_id == last.set_id:
        return model_header(at_last)
    return model_header(at_last, from_commits=first.commits)


def spans_extra(spans: Sequence[WeightSpan]) -> dict[str, Any]:
    """``{"millm_weight_spans": [...]}`` for a choice that spans sets, else ``{}``."""
    rendered = weight_spans_json(spans)
    return {} if rendered is None else {"millm_weight_spans": rendered}


def parse_from_commits(value: str) -> int | None:
    """The ``from_commits`` parameter of an ``X-miLLM-Model`` value (contract 4), or ``None``
    when absent. Raises ``ValueError`` as :func:`parse_model_header` does, and when it is not an
    integer."""
    parse_model_header(value)
    item = http_sfv.Item()
    item.parse(value.encode("ascii"))
    found = item.params.get("from_commits")
    if found is not None and (isinstance(found, bool) or not isinstance(found, int)):
        raise ValueError(f"from_commits is not an integer: {value!r}")
    return found


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
