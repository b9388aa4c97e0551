"""End to end (issue 33): structured outputs and tool calls through a live ``miserver serve``
driven by the official ``openai`` package.

The default model (SmolLM2-135M-Instruct) answers the ``response_format`` tests; its chat
template takes no tools (a 400 naming ``tools``). The tool tests then load ``tiny-tools``: the
tiny random-weight Llama with SmolLM2's tokenizer and Qwen2.5's real chat template
(tests/unit/tool_templates.py), whose output is noise: the shape of every call comes from the
grammar alone. The tests run in file order (the tool tests swap the resident last).
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Iterator

import openai
import pytest
from pydantic import BaseModel, Field

from tests.served import ServedProcess, start_serve

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TOOLS_MODEL = "tiny-tools"


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)
    coastal: bool


#: City's schema as the SDK's ``parse`` sends it (strict: no properties beyond the four).
CITY_SCHEMA = {**City.model_json_schema(), "additionalProperties": False}
PROMPTS = [
    f"Describe the city of {city} as JSON."
    for city in (
        "Paris",
        "Tokyo",
        "Lagos",
        "Lima",
        "Oslo",
        "Cairo",
        "Delhi",
        "Rome",
        "Sydney",
        "Toronto",
        "Nairobi",
        "Berlin",
        "Madrid",
        "Seoul",
        "Hanoi",
        "Quito",
        "Dublin",
        "Athens",
        "Vienna",
        "Manila",
    )
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def home(default_home: str, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    from miserver.serving.models.catalogue import Catalogue
    from tests.conftest import copy_default_rows
    from tests.unit.tool_templates import tool_model_folder

    path = tmp_path_factory.mktemp("e2e-structured-home")
    catalogue = Catalogue(copy_default_rows(default_home, path))
    folder = tool_model_folder(tiny_model_dir, path / "tiny-tools")
    catalogue.register(name=TOOLS_MODEL, format="safetensors", dtype="bfloat16", path=folder)
    return str(path)


@pytest.fixture(scope="module")
def base(home: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("e2e-structured") / "server.log"
    srv = start_serve(
        ServedProcess,
        log,
        lambda srv: MODEL in srv.resident_models(),
        MISERVER_HOME=home,
        DEVICE="cpu",
        DEFAULT_MODEL=MODEL,
        LOG_FORMAT="text",
        LOG_LEVEL="info",
        MAX_CONCURRENT_REQUESTS="1",
    )
    try:
        yield srv.base
    finally:
        srv.stop()


@pytest.fixture
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


# --- response_format on the default model ---------------------------------------------------------
def test_parse_with_a_pydantic_model_validates_over_20_prompts_with_n_4(
    client: openai.OpenAI,
) -> None:
    for prompt in PROMPTS:
        completion = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            response_format=City,
            n=4,
            max_completion_tokens=200,
            seed=1,
        )
        assert len(completion.choices) == 4
        for choice in completion.choices:
            assert choice.finish_reason == "stop", choice.message.content
            city = choice.message.parsed
            assert isinstance(city, City)  # the SDK validated it against the model
            City.model_validate_json(choice.message.content or "")


def test_json_object_output_always_parses(client: openai.OpenAI) -> None:
    for prompt in PROMPTS[:3]:
        completion = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
            response_format={"type": "json_object"},
            n=2,
            max_tokens=120,
            seed=5,
        )
        for choice in completion.choices:
            if choice.finish_reason == "stop":
                assert isinstance(json.loads(choice.message.content or ""), dict)
            else:  # cut by max_tokens: still a prefix of an object
                assert (choice.message.content or "").lstrip().startswith("{")


def test_completions_route_takes_response_format_too(client: openai.OpenAI) -> None:
    schema = CITY_SCHEMA
    completion = client.completions.create(
        model=MODEL,
        prompt="A city as JSON: ",
        max_tokens=200,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": schema, "strict": True},
            }
        },
    )
    assert completion.choices[0].finish_reason == "stop"
    City.model_validate_json(completion.choices[0].text)


def test_a_streamed_constrained_answer_equals_the_non_streamed_one(client: openai.OpenAI) -> None:
    kwargs = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "temperature": 0,
        "max_tokens": 200,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True},
        },
    }
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True)
    pieces, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason == "stop"
    City.model_validate_json(whole.choices[0].message.content or "")


async def test_constrained_and_free_requests_decoding_together_each_get_theirs(
    base: str, client: openai.OpenAI
) -> None:
    free_alone = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        temperature=0,
        max_tokens=24,
    )
    aclient = openai.AsyncOpenAI(
        base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300
    )
    constrained = aclient.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[1]}],
        response_format=City,
        temperature=0,
        max_tokens=200,
    )
    free = aclient.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        temperature=0,
        max_tokens=24,
    )
    # a third request holds the slot while the two queue: they are granted as one batch
    holder = aclient.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count."}], temperature=0, max_tokens=8
    )
    first = asyncio.ensure_future(holder)
    await asyncio.sleep(0.3)
    done = await asyncio.gather(constrained, free)
    await first
    await aclient.close()
    assert isinstance(done[0].choices[0].message.parsed, City)
    # greedy: the free answer is the one it gives alone (the grammar never touched its row)
    assert done[1].choices[0].message.content == free_alone.choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(free_alone.choices[0].message.content or "")


def test_an_unsupported_schema_feature_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            stream=True,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}},
            },
        )
    assert info.value.body["param"] == "response_format.json_schema.schema.not"  # type: ignore[index]


def test_a_model_whose_template_takes_no_tools_answers_400_naming_tools(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[WEATHER]
        )
    assert info.value.body["param"] == "tools"  # type: ignore[index]


def test_batch_rows_take_the_same_fields(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}
    rows = [
        {
            "custom_id": "json",
            "messages": [{"role": "user", "content": PROMPTS[2]}],
            "response_format": fmt,
            "max_tokens": 200,
        },
        {
            "custom_id": "not",
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"not": {}}},
            },
        },
        {"custom_id": "tools", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]},
    ]
    data = b"".join(
        json.dumps(
            {
                "custom_id": row.pop("custom_id"),
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": MODEL, **row},
            }
        ).encode()
        + b"\n"
        for row in rows
    )
    upload = client.files.create(file=("rows.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 600
    while (now := client.batches.retrieve(batch.id)).status != "completed":
        assert now.status in ("in_progress", "finalizing"), now
        assert time.monotonic() < deadline, now
        time.sleep(0.5)
    lines = []
    for file_id in (now.output_file_id, now.error_file_id):
        if file_id:
            lines += [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    by_id = {line["custom_id"]: line["response"] for line in lines}
    assert by_id["json"]["status_code"] == 200
    City.model_validate_json(by_id["json"]["body"]["choices"][0]["message"]["content"])
    assert by_id["not"]["status_code"] == 400
    assert by_id["not"]["body"]["error"]["param"] == "response_format.json_schema.schema.not"
    assert by_id["tools"]["status_code"] == 400
    assert by_id["tools"]["body"]["error"]["param"] == "tools"


# --- tools on the tiny model with Qwen2.5's template (loads it: last) ------------------------------
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_required_tool_choice_returns_parsed_tool_calls(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=TOOLS_MODEL,
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=200,
        n=3,
        seed=4,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
        assert calls and choice.message.content is None
        for call in calls:
            assert call.type == "function" and call.function.name == "get_weather"
            assert call.id.startswith("call_")
            args = json.loads(call.function.arguments)
            assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")


def test_streamed_tool_call_deltas_are_assembled_by_the_sdk(client: openai.OpenAI) -> None:
    kwargs = {
        "model": TOOLS_MODEL,
        "messages": QUESTION,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 200,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        for _event in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    want = [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []
    ]
    assert got == want and got


def test_a_tool_reply_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=TOOLS_MODEL,
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=200,
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    history = [
        *QUESTION,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    second = client.chat.completions.create(
        model=TOOLS_MODEL, messages=history, tools=[WEATHER], max_tokens=8
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the prompt holds the first prompt, the call and the tool's answer
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    # tool_choice "none" renders no tools (the template's tool section is gone)
    bare = client.chat.completions.create(
        model=TOOLS_MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert bare.choices[0].message.tool_calls is None
    assert bare.usage is not None and bare.usage.prompt_tokens < second.usage.prompt_tokens
