"""Constrained decoding (issue 33): the grammar side of the sampler's constraint hook
(:mod:`miserver.serving.engine.constraints`) and its wiring into the continuous engine's
sampler (:mod:`miserver.serving.engine.sampler`), on the tiny random-weight Llama (its output is
noise, so whatever it emits was shaped by the grammar alone), and the backend-independent
``response_format`` checks.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from miserver.serving.engine.constraints import (
    ConstraintError,
    json_schema_constraint,
    lark_constraint,
)
from miserver.serving.engine.generation import (
    Finished,
    SamplingParams,
    TextDelta,
)
from miserver.serving.structured.response_format import (
    parse_response_format,
    unsupported_features,
)
from miserver.spec.errors import ApiError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


# --- the request side, no model ----------------------------------------------------------------
def test_text_and_absent_enforce_nothing_and_json_object_is_any_object() -> None:
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "text"}) is None
    fmt = parse_response_format({"type": "json_object"})
    assert fmt is not None and fmt.schema == {"type": "object"}


def test_a_json_schema_keeps_name_schema_and_strict() -> None:
    fmt = parse_response_format(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    )
    assert fmt is not None and (fmt.name, fmt.schema, fmt.strict) == ("person", PERSON, True)


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ("json", "response_format"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": {}}},
            "response_format.json_schema.name",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
            "response_format.json_schema.name",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}},
            "response_format.json_schema.strict",
        ),
        ({"type": "json_object", "extra": 1}, "response_format.extra"),
    ],
)
def test_a_malformed_response_format_is_a_400_naming_the_field(value: Any, param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_response_format(value)
    assert info.value.status == 400 and info.value.param == param, info.value


def test_an_unsupported_schema_feature_is_named_with_its_place() -> None:
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "uniqueItems": True}},
        "not": {"required": ["x"]},
    }
    assert unsupported_features(schema) == ["schema.properties.tags.uniqueItems", "schema.not"]
    with pytest.raises(ApiError) as info:
        parse_response_format(
            {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        )
    assert info.value.param == "response_format.json_schema.schema.properties.tags.uniqueItems"
    assert "uniqueItems" in str(info.value) and "1 more" in str(info.value)


def test_nested_subschemas_are_walked() -> None:
    schema = {
        "$defs": {"n": {"anyOf": [{"type": "string", "contains": 1}, {"type": "null"}]}},
        "items": {"if": {}},
    }
    assert unsupported_features(schema) == [
        "schema.$defs.n.anyOf[0].contains",
        "schema.items.if",
    ]
    assert unsupported_features(PERSON) == []


# --- the matcher over the real tokenizer ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_dir: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def test_the_mask_allows_a_valid_answer_token_by_token_and_ends_there(tiny: Any) -> None:
    model, tok = tiny
    constraint = json_schema_constraint(PERSON, tok, model.config.vocab_size)
    matcher = constraint.new_matcher()
    answer = json.dumps({"name": "Ada", "age": 36, "role": "admin", "tags": ["x"]})
    for i, token in enumerate(tok.encode(answer, add_special_tokens=False)):
        row = torch.zeros(model.config.vocab_size)
        matcher.fill_mask(row)
        assert row[token] == 0, tok.decode([token])
        masked = int((row == float("-inf")).sum())
        assert masked > (model.config.vocab_size - 100 if i == 0 else 0)  # first: only '{'...
        matcher.accept(token)
    row = torch.zeros(model.config.vocab_size)
    matcher.fill_mask(row)  # the object is complete: only the end token remains
    assert torch.nonzero(row == 0).flatten().tolist() == [tok.eos_token_id]
    matcher.accept(tok.eos_token_id)
    assert matcher.is_terminated()


def test_a_token_outside_the_grammar_is_refused(tiny: Any) -> None:
    model, tok = tiny
    matcher = json_schema_constraint(PERSON, tok, model.config.vocab_size).new_matcher()
    with pytest.raises(ConstraintError):
        matcher.accept(tok.encode("hello", add_special_tokens=False)[0])


def test_a_schema_the_library_refuses_raises_constraint_error(tiny: Any) -> None:
    model, tok = tiny
    with pytest.raises(ConstraintError, match="foo"):
        json_schema_constraint({"type": "string", "format": "foo"}, tok, model.config.vocab_size)
    with pytest.raises(ConstraintError):
        lark_constraint("start: (", tok, model.config.vocab_size)


# --- the decode loop ------------------------------------------------------------------------------
async def _run(model: Any, tok: Any, requests: list[tuple[SamplingParams, int]]) -> list[Any]:
    from tests.unit.v1_fixtures import engine_events

    prompt = tok.encode("Describe a person as JSON:", add_special_tokens=False)
    choices = await engine_events(model, tok, [(prompt, params, n) for params, n in requests])
    out = []
    for events in choices:
        text, finish, lps = "", None, []
        for event in events:
            if isinstance(event, TextDelta):
                text += event.text
                lps.extend(event.logprobs)
            elif isinstance(event, Finished):
                finish = event.finish_reason
        out.append((text, finish, lps))
    return out


async def test_constrained_and_free_sequences_in_one_batch_each_get_what_they_asked(
    tiny: Any,
) -> None:
    model, tok = tiny
    constraint = json_schema_constraint(PERSON, tok, model.config.vocab_size)
    constrained = SamplingParams(max_tokens=200, temperature=1.0, seed=7, constraint=constraint)
    free = SamplingParams(max_tokens=20, temperature=0)
    results = await _run(model, tok, [(constrained, 3), (free, 1)])
    for text, finish, _ in results[:3]:
        assert finish == "stop", (text, finish)
        value = json.loads(text)
        assert set(value) == {"name", "age", "role", "tags"} and value["role"] in ("admin", "user")
        assert 0 <= value["age"] <= 130
    # the free row is what it is alone: the grammar never touched it
    (alone,) = await _run(model, tok, [(free, 1)])
    assert results[3][:2] == alone[:2]
    with pytest.raises(json.JSONDecodeError):
        json.loads(alone[0])


async def test_greedy_constrained_is_reproducible_and_logprobs_are_the_models_own(
    tiny: Any,
) -> None:
    model, tok = tiny
    constraint = json_schema_constraint(PERSON, tok, model.config.vocab_size)
    params = SamplingParams(max_tokens=200, temperature=0, logprobs=2, constraint=constraint)
    (a,), (b,) = await _run(model, tok, [(params, 1)]), await _run(model, tok, [(params, 1)])
    assert a[0] == b[0] and a[1] == "stop"
    json.loads(a[0])
    # unmasked logprobs: the model's own best alternative is often outside the grammar
    assert any(lp.top[0][0] != lp.token_id for lp in a[2])
    assert all(lp.logprob is not None and lp.logprob <= 0 for lp in a[2])


def test_what_the_library_still_refuses_is_a_400_at_response_format(tiny: Any) -> None:
    from miserver.serving.structured.response_format import compile_constraint

    model, tok = tiny
    fmt = parse_response_format(
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "string", "format": "zip-code"}},
        }
    )
    assert fmt is not None  # "format" is an enforced keyword: the library judges the value
    with pytest.raises(ApiError) as info:
        compile_constraint(fmt, model, tok, "response_format")
    assert info.value.status == 400 and info.value.param == "response_format"
    assert "zip-code" in str(info.value)


class _Script:
    """A fake :class:`Constraint`: its matchers allow exactly ``tokens``, in order, and record
    the calls the sampler makes (the hook's protocol, ENGINE_API "Constraint hook")."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.calls: list[tuple[str, int]] = []

    def new_matcher(self) -> Any:
        script = self

        class _M:
            at = 0

            def fill_mask(self, logits: torch.Tensor) -> None:
                script.calls.append(("mask", self.at))
                keep = logits[script.tokens[self.at]].clone()
                logits.fill_(float("-inf"))
                logits[script.tokens[self.at]] = keep

            def accept(self, token_id: int) -> None:
                script.calls.append(("accept", token_id))
                assert token_id == script.tokens[self.at]
                self.at += 1

            def is_terminated(self) -> bool:
                return self.at == len(script.tokens)

        return _M()


async def test_the_hook_masks_before_the_choice_accepts_after_and_ends_as_stop(tiny: Any) -> None:
    model, tok = tiny
    tokens = tok.encode(" forced words here", add_special_tokens=False)
    script = _Script(tokens)
    params = SamplingParams(max_tokens=50, temperature=1.0, seed=3, constraint=script, logprobs=0)
    free = SamplingParams(max_tokens=6, temperature=0)
    results = await _run(model, tok, [(params, 2), (free, 1)])
    for text, finish, lps in results[:2]:
        assert (text, finish) == (" forced words here", "stop")
        assert [lp.token_id for lp in lps] == tokens
    # per choice: mask i, accept token i, in order (two matchers interleaved by the batch)
    masks = [c for c in script.calls if c[0] == "mask"]
    accepts = [c for c in script.calls if c[0] == "accept"]
    assert sorted(accepts) == sorted(("accept", t) for t in tokens * 2)
    assert len(masks) == len(accepts)
    (alone,) = await _run(model, tok, [(free, 1)])
    assert results[2][:2] == alone[:2]
