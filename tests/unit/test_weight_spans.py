"""Provenance of a response that spans parameter sets (contract 4; issue 30): the spans an
engine records per choice, ``millm_weight_spans``, and ``X-miLLM-Model``'s ``from_commits``,
for non-streamed and streamed, ``n`` > 1 and completions output (the Batch API's output line is
the non-streamed body and header).

The choices' events here are made by hand (what an engine that holds sequences across a commit
hands ``/v1``): this pins the rendering, not an engine.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from miserver.http.model_header import (
    model_header,
    parse_from_commits,
    parse_model_header,
    response_model_header,
    weight_spans_json,
)
from miserver.http.v1_rendering import collect_with_header, stream_response
from miserver.serving.engine.generation import Finished, Started, TextDelta
from miserver.serving.engine.provenance import WeightSpan, add_tokens


def served(commits: int | None = 3) -> SimpleNamespace:
    return SimpleNamespace(served_name="tiny", origin="model", commits=commits, tokenizer=None)


def test_add_tokens_merges_a_set_and_starts_a_span_at_the_next() -> None:
    spans: list[WeightSpan] = []
    for set_id, commits in ((7, 2), (7, 2), (8, 3), (8, 3), (8, 3)):
        add_tokens(spans, set_id, commits)
    assert spans == [WeightSpan(7, 2, 2), WeightSpan(8, 3, 3)]
    with pytest.raises(ValueError, match="older"):
        add_tokens(spans, 7, 2)
    with pytest.raises(ValueError, match="at least 1"):
        add_tokens(spans, 9, 4, tokens=0)


def test_spans_are_rendered_only_when_a_choice_spans_sets_and_unknown_commits_are_omitted() -> None:
    assert weight_spans_json([]) is None
    assert weight_spans_json([WeightSpan(1, 4, 10)]) is None
    assert weight_spans_json([WeightSpan(1, 4, 10), WeightSpan(2, 5, 3)]) == [
        {"commits": 4, "tokens": 10},
        {"commits": 5, "tokens": 3},
    ]
    # a set whose count is not known: no commits field, never 0
    assert weight_spans_json([WeightSpan(1, None, 2), WeightSpan(2, 1, 1)]) == [
        {"tokens": 2},
        {"commits": 1, "tokens": 1},
    ]


def test_the_header_names_the_last_set_and_from_commits_the_first() -> None:
    plain = model_header(served(3))
    assert plain == '"tiny";origin=model;commits=3' and parse_from_commits(plain) is None
    one = [WeightSpan(5, 3, 8)]
    assert response_model_header(served(3), [one]) == plain
    two = [WeightSpan(5, 3, 8), WeightSpan(6, 4, 2)]
    header = response_model_header(served(9), [two])
    assert header == '"tiny";origin=model;commits=4;from_commits=3'
    assert parse_model_header(header) == ("tiny", "model", 4)
    assert parse_from_commits(header) == 3
    # n > 1: the earliest first set of any choice, the latest last set of any choice
    a = [WeightSpan(5, 3, 4)]
    b = [WeightSpan(5, 3, 1), WeightSpan(6, 4, 2), WeightSpan(7, 5, 1)]
    assert parse_from_commits(response_model_header(served(), [a, b])) == 3
    assert parse_model_header(response_model_header(served(), [a, b]))[2] == 5
    # the first set's count unknown: no from_commits (never 0); the last's unknown: no commits
    header = response_model_header(served(), [[WeightSpan(1, None, 1), WeightSpan(2, 1, 1)]])
    assert header == '"tiny";origin=model;commits=1'
    header = response_model_header(served(), [[WeightSpan(1, 2, 1), WeightSpan(2, None, 1)]])
    assert header == '"tiny";origin=model;from_commits=2'
    # no choice recorded spans (one set): the resident's header
    assert response_model_header(served(3), [(), ()]) == plain
    with pytest.raises(ValueError):
        model_header(served(), from_commits=-1)


async def _events(*events: Any):
    for ev in events:
        yield ev


def job(kind: str, n: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        kind=kind,
        resident=served(4),
        want_logprobs=False,
        echo_text=None,
        include_usage=True,
        n=n,
        structured=None,
    )


SPANNED = (WeightSpan(10, 3, 2), WeightSpan(11, 4, 1))


def _choice_events(spans: tuple[WeightSpan, ...]) -> list[Any]:
    return [TextDelta("a"), TextDelta("b"), TextDelta("c"), Finished("length", 5, 3, spans)]


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_non_streamed_choices_carry_their_spans_and_the_header_spans_the_response(
    kind,
) -> None:
    events = [_events(*_choice_events(SPANNED)), _events(*_choice_events(()))]
    firsts = [Started(5), Started(5)]
    body, header = await collect_with_header(
        None, job(kind, 2), events, firsts, '"tiny";origin=model;commits=3'
    )
    spanned, single = body["choices"]
    assert spanned["millm_weight_spans"] == [
        {"commits": 3, "tokens": 2},
        {"commits": 4, "tokens": 1},
    ]
    assert "millm_weight_spans" not in single
    assert parse_model_header(header)[2] == 4 and parse_from_commits(header) == 3
    # one set: the header it was admitted with, and no spans field
    body, header = await collect_with_header(
        None, job(kind), [_events(*_choice_events(()))], [Started(5)], "H"
    )
    assert header == "H" and "millm_weight_spans" not in body["choices"][0]


async def test_a_stream_s_terminal_chunks_carry_spans_and_from_commits() -> None:
    class Running:
        header = '"tiny";origin=model;commits=3'
        firsts = [Started(5), Started(5)]
        events = [_events(*_choice_events(SPANNED)), _events(*_choice_events(()))]

        async def wait(self) -> None:
            return None

        def cancel(self) -> None:
            return None

    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream_response(request, job("chat", 2), Running())

    app = web.Application()
    app.router.add_get("/s", handler)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        resp = await client.get("/s")
        assert resp.headers["X-miLLM-Model"] == Running.header  # sent before any token
        text = await resp.text()
    finally:
        await client.close()
    chunks = [
        json.loads(line.removeprefix("data: "))
        for line in text.splitlines()
        if line.startswith("data: {")
    ]
    finals = {
        c["choices"][0]["index"]: c
        for c in chunks
        if c["choices"] and c["choices"][0]["finish_reason"] is not None
    }
    assert finals[0]["choices"][0]["millm_weight_spans"] == [
        {"commits": 3, "tokens": 2},
        {"commits": 4, "tokens": 1},
    ]
    assert parse_from_commits(finals[0]["millm_model"]) == 3
    assert parse_model_header(finals[0]["millm_model"])[2] == 4
    assert "millm_weight_spans" not in finals[1]["choices"][0]
    assert finals[1]["millm_model"] == Running.header
    usage = next(c for c in chunks if c.get("usage"))
    assert parse_from_commits(usage["millm_model"]) == 3


def test_rendered_spans_match_the_published_schema_struct() -> None:
    import msgspec

    from miserver.spec.weights import WeightSpan as SpanBody

    rendered = weight_spans_json([WeightSpan(1, None, 2), WeightSpan(2, 7, 5)])
    decoded = msgspec.convert(rendered, list[SpanBody])
    assert [(s.commits, s.tokens) for s in decoded] == [(msgspec.UNSET, 2), (7, 5)]
    assert msgspec.to_builtins(decoded) == rendered
