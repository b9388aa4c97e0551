"""Which parameter set produced each token of a choice (contract 4; issue 30).

A sequence held in flight across a commit (contract 4b, ``{"running": "hold"}``) produces its
first tokens on one parameter set and the rest on the next. The engine records, per choice, the
runs of tokens each set produced as :class:`WeightSpan` values, in order, and hands them to
``/v1`` on the choice's :class:`~miserver.serving.engine.generation.Finished`
(``weight_spans``). ``/v1`` renders them (``millm_weight_spans``, and ``X-miLLM-Model``'s
``from_commits``: :mod:`miserver.http.model_header`). A choice made on one set records one span
or none; none is what an engine that does not record spans gives, and means one set.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WeightSpan:
    """``tokens`` consecutive tokens of one choice, produced by one parameter set.

    Attributes:
        set_id: which parameter set, as a number that grows with every change of the served
            parameters in this process (a commit-end, a load): two spans of one set have the
            same ``set_id``, and a later set a larger one. Never sent to a client.
        commits: that set's ``X-miLLM-Model`` ``commits`` (weights page: Which weights
            answered), or ``None`` where it is not known (then a client is told no number;
            never 0 for unknown).
        tokens: how many tokens (at least 1).
    """

    set_id: int
    commits: int | None
    tokens: int


def add_tokens(
    spans: list[WeightSpan], set_id: int, commits: int | None, tokens: int = 1
) -> list[WeightSpan]:
    """Count ``tokens`` more tokens produced by set ``set_id`` at the end of ``spans`` (in
    place: the last span grows when it is the same set, else a new span starts); returns
    ``spans``. Raises ``ValueError`` for ``tokens`` < 1 or a ``set_id`` older than the last
    span's (a choice's sets only move forward)."""
    if tokens < 1:
        raise ValueError(f"tokens must be at least 1, got {tokens}")
    if spans and set_id < spans[-1].set_id:
        raise ValueError(f"set {set_id} is older than the last span's ({spans[-1].set_id})")
    if spans and spans[-1].set_id == set_id:
        last = spans[-1]
        spans[-1] = WeightSpan(set_id, last.commits, last.tokens + tokens)
    else:
        spans.append(WeightSpan(set_id, commits, tokens))
    return spans
