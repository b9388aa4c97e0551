"""Tool calls (issue 33): ``tools`` / ``tool_choice`` checks, the template's tool format, the
parser (streamed in any pieces = parsed whole), and the enforced call grammar decoding on a tiny
random-weight model (whatever it emits is shaped by the grammar alone)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from miserver.serving.engine.generation import Finished, SamplingParams, TextDelta
from miserver.serving.engine.prompts import chat_prompt_ids, render_chat
from miserver.serving.structured.request import check_for_model, check_request, request_constraint
from miserver.serving.structured.tools import (
    ToolCallParser,
    ToolSpec,
    parse_answer,
    parse_tools,
    template_message,
    tool_format,
)
from miserver.spec.errors import ApiError
from tests.unit.tool_templates import LLAMA31_TEMPLATE, QWEN25_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 10}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


# --- checks --------------------------------------------------------------------------------------
def test_tool_choice_shapes() -> None:
    assert parse_tools(None, None) is None
    assert parse_tools(None, "none") is None
    assert parse_tools([WEATHER], "none") is None  # "none" renders no tools
    auto = parse_tools([WEATHER], None)
    assert auto is not None and auto.choice == "auto" and not auto.enforced
    named = parse_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named is not None and named.choice == "function" and named.enforced
    assert [f["name"] for f in named.allowed()] == ["get_time"]
    assert parse_tools([WEATHER], "required", False).parallel is False  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        (None, "required", "tool_choice"),
        ("x", None, "tools"),
        ([], None, "tools"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([{"type": "function", "function": {"description": "x"}}], None, "tools[0].function.name"),
        ([WEATHER, WEATHER], None, "tools[1].function.name"),
        ([WEATHER], "sometimes", "tool_choice"),
        (
            [WEATHER],
            {"type": "function", "function": {"name": "nope"}},
            "tool_choice.function.name",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
            None,
            "tools[0].function.parameters.not",
        ),
        (
            [{"type": "function", "function": {"name": "f", "extra": 1}}],
            None,
            "tools[0].function.extra",
        ),
    ],
)
def test_malformed_tools_are_a_400_naming_the_field(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_tools(tools, choice)
    assert info.value.status == 400 and info.value.param == param, info.value


class _Tok:
    def __init__(self, template: Any) -> None:
        self.chat_template = template


def test_the_template_decides_the_format_and_one_without_tools_is_a_400_naming_tools() -> None:
    assert tool_format(_Tok(QWEN25_TEMPLATE)) == "hermes"
    assert tool_format(_Tok(LLAMA31_TEMPLATE)) == "json"
    for template in (None, "{% for m in messages %}{{ m.content }}{% endfor %}"):
        with pytest.raises(ApiError) as info:
            tool_format(_Tok(template))
        assert info.value.param == "tools" and "tool" in str(info.value)


# --- the parser ----------------------------------------------------------------------------------
SPEC = ToolSpec((WEATHER, TIME), "auto")
ANSWER = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


def test_a_hermes_answer_parses_into_content_and_calls() -> None:
    content, calls = parse_answer(ANSWER, SPEC, "hermes")
    assert content == "Let me check."  # the whitespace before a call is dropped
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11])
def test_streamed_in_any_pieces_the_parser_gives_what_the_whole_text_gives(size: int) -> None:
    parser = ToolCallParser(SPEC, "hermes")
    items: list[Any] = []
    for i in range(0, len(ANSWER), size):
        items += parser.feed(ANSWER[i : i + size])
    items += parser.finish()
    text = "".join(i for i in items if isinstance(i, str))
    calls = [(i.name, i.arguments) for i in items if not isinstance(i, str)]
    whole_content, whole_calls = parse_answer(ANSWER, SPEC, "hermes")
    assert text == whole_content and calls == [(c.name, c.arguments) for c in whole_calls]


def test_text_without_calls_is_unchanged_and_a_bad_block_stays_text() -> None:
    for text in ("plain answer\n", "a < b and <tool", "<tool_call>\nnot json\n</tool_call>"):
        assert parse_answer(text, SPEC, "hermes") == (text, [])
    unknown = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert parse_answer(unknown, SPEC, "hermes") == (unknown, [])


def test_a_llama_json_answer_is_one_call() -> None:
    content, calls = parse_answer(
        ' {"name": "get_time", "parameters": {"zone": "UTC"}}', SPEC, "json"
    )
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("get_time", '{"zone": "UTC"}')
    ]
    assert parse_answer("It is noon.", SPEC, "json") == ("It is noon.", [])


# --- the template, the grammar and the decode loop over the tiny model ------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_dir: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = QWEN25_TEMPLATE
    return model, tok


def test_history_with_calls_and_tool_results_renders_through_the_template(tiny: Any) -> None:
    _, tok = tiny
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "c"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    rendered = render_chat(tok, [template_message(m) for m in messages], tools=[WEATHER])
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in rendered
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in rendered
    assert '"name": "get_weather"' in rendered.split("\n</tools>")[0]  # the tools were given
    assert rendered.endswith("<|im_start|>assistant\n")
    assert chat_prompt_ids(tok, [template_message(m) for m in messages], tools=[WEATHER])


async def _decode(model: Any, tok: Any, constraint: Any, n: int, seed: int | None) -> list[str]:
    prompt = chat_prompt_ids(tok, [{"role": "user", "content": "Weather?"}], tools=[WEATHER, TIME])
    from tests.unit.v1_fixtures import engine_events

    params = SamplingParams(max_tokens=300, temperature=1.0, seed=seed, constraint=constraint)
    texts = []
    for events in await engine_events(model, tok, [(prompt, params, n)]):
        text, finish = "", None
        for event in events:
            if isinstance(event, TextDelta):
                text += event.text
            elif isinstance(event, Finished):
                finish = event.finish_reason
        assert finish == "stop", (text, finish)
        texts.append(text)
    return texts


@pytest.mark.parametrize(
    ("choice", "names"),
    [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ],
)
async def test_an_enforced_tool_choice_always_yields_valid_calls(
    tiny: Any, choice: Any, names: set[str]
) -> None:
    model, tok = tiny
    structured = check_for_model(check_request(tools=[WEATHER, TIME], tool_choice=choice), tok)
    constraint = request_constraint(structured, model, tok)
    assert constraint is not None
    for text in await _decode(model, tok, constraint, n=3, seed=11):
        assert structured.tools is not None
        content, calls = parse_answer(text, structured.tools, "hermes")
        assert calls and content is None, text
        for call in calls:
            assert call.name in names
            args = json.loads(call.arguments)
            if call.name == "get_weather":
                assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
            else:
                assert set(args) == {"zone"}


async def test_auto_with_a_response_format_allows_a_call_or_the_format(tiny: Any) -> None:
    model, tok = tiny
    structured = check_for_model(
        check_request(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "a",
                    "schema": {
                        "type": "object",
                        "properties": {"answer": {"type": "integer"}},
                        "required": ["answer"],
                        "additionalProperties": False,
                    },
                },
            },
            tools=[WEATHER],
        ),
        tok,
    )
    constraint = request_constraint(structured, model, tok)
    for text in await _decode(model, tok, constraint, n=4, seed=3):
        assert structured.tools is not None
        content, calls = parse_answer(text, structured.tools, "hermes")
        assert calls or set(json.loads(text)) == {"answer"}, text
