"""Strict validation of ``/v1`` bodies: every kind of bad input is a 400 (413 for size) in the
OpenAI error shape, naming the field, before anything is queued; never a 500."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miserver.http import keys
from miserver.http.app import create_app
from miserver.spec.settings import Settings

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[asyncio.AbstractEventLoop, TestClient]]:
    """An app with an empty catalogue and nothing resident (validation needs no model), on a
    private event loop so that Hypothesis (synchronous) can drive it."""
    home = tmp_path_factory.mktemp("v1-validation-home")
    loop = asyncio.new_event_loop()
    app = create_app(
        Settings(
            home=str(home),
            default_model="",
            device="cpu",
            max_request_bytes=4096,
            log_format="text",
        )
    )
    client = TestClient(TestServer(app), loop=loop)
    loop.run_until_complete(client.start_server())
    yield loop, client
    loop.run_until_complete(client.close())
    loop.close()


def call(
    server: Any,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    method: str = "POST",
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    loop, client = server

    async def go() -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        resp = await client.request(
            method, path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
        )
        text = await resp.text()
        assert resp.headers["Content-Type"].startswith("application/json"), text
        return resp.status, json.loads(text)

    return loop.run_until_complete(go())


def assert_openai_error(
    status: int, body: Any, expected_status: int, param: str | None = "any"
) -> dict[str, Any]:
    assert status == expected_status, body
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "any":
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(
    "path, body, param",
    [
        # wrong types
        (CHAT, {"model": "m", "messages": MSG, "max_tokens": "5"}, "max_tokens"),
        (CHAT, {"model": "m", "messages": MSG, "max_tokens": True}, "max_tokens"),
        (CHAT, {"model": "m", "messages": MSG, "max_tokens": 1.5}, "max_tokens"),
        (CHAT, {"model": "m", "messages": MSG, "temperature": "hot"}, "temperature"),
        (CHAT, {"model": "m", "messages": MSG, "temperature": False}, "temperature"),
        (CHAT, {"model": "m", "messages": MSG, "stream": "yes"}, "stream"),
        (CHAT, {"model": "m", "messages": "hi"}, "messages"),
        (CHAT, {"model": "m", "messages": ["hi"]}, "messages[0]"),
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (CHAT, {"model": "m", "messages": MSG, "stop": 5}, "stop"),
        (CHAT, {"model": "m", "messages": MSG, "seed": "1"}, "seed"),
        (CHAT, {"model": 5, "messages": MSG}, "model"),
        (
            CHAT,
            {"model": "m", "messages": MSG, "stream": True, "stream_options": {"x": 1}},
            "stream_options.x",
        ),
        (COMP, {"model": "m", "prompt": 5}, "prompt"),
        (COMP, {"model": "m", "prompt": [1.5, 2]}, "prompt"),
        (COMP, {"model": "m", "prompt": [1, True]}, "prompt"),
        (COMP, {"model": "m", "prompt": [-1]}, "prompt"),
        (COMP, {"model": "m", "prompt": True}, "prompt"),
        (COMP, {"model": "m", "prompt": "x", "echo": 1}, "echo"),
        (COMP, {"model": "m", "prompt": "x", "logprobs": True}, "logprobs"),
        # out of range
        (CHAT, {"model": "m", "messages": MSG, "temperature": 2.5}, "temperature"),
        (CHAT, {"model": "m", "messages": MSG, "temperature": -0.1}, "temperature"),
        (CHAT, {"model": "m", "messages": MSG, "top_p": 0}, "top_p"),
        (CHAT, {"model": "m", "messages": MSG, "top_p": 1.01}, "top_p"),
        (CHAT, {"model": "m", "messages": MSG, "n": 0}, "n"),
        (CHAT, {"model": "m", "messages": MSG, "n": 10_000}, "n"),  # above MAX_BATCH_SIZE
        (COMP, {"model": "m", "prompt": "x", "n": 257}, "n"),
        (CHAT, {"model": "m", "messages": MSG, "max_tokens": 0}, "max_tokens"),
        (
            CHAT,
            {"model": "m", "messages": MSG, "max_completion_tokens": -3},
            "max_completion_tokens",
        ),
        (
            CHAT,
            {"model": "m", "messages": MSG, "max_tokens": 3, "max_completion_tokens": 3},
            "max_completion_tokens",
        ),
        (
            CHAT,
            {"model": "m", "messages": MSG, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (CHAT, {"model": "m", "messages": MSG, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"model": "m", "messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (CHAT, {"model": "m", "messages": MSG, "stop": ""}, "stop"),
        (CHAT, {"model": "m", "messages": MSG, "seed": 2**64}, "seed"),
        (
            CHAT,
            {"model": "m", "messages": MSG, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (CHAT, {"model": " ", "messages": MSG}, "model"),
        (COMP, {"model": "m", "prompt": "x", "logprobs": 6}, "logprobs"),
        (COMP, {"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
        (COMP, {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMP, {"model": "m", "prompt": []}, "prompt"),
        (COMP, {"model": "m", "prompt": ["a", "b"]}, "prompt"),
        # messages
        (CHAT, {"model": "m", "messages": []}, "messages"),
        (
            CHAT,
            {"model": "m", "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
        ),
        (
            CHAT,
            {"model": "m", "messages": [{"role": "function", "content": "x"}]},
            "messages[0].role",
        ),
        # OpenAI fields miserver does not act on, at a value that would change the answer
        (CHAT, {"model": "m", "messages": MSG, "frequency_penalty": 0.1}, "frequency_penalty"),
        (CHAT, {"model": "m", "messages": MSG, "presence_penalty": -1}, "presence_penalty"),
        (CHAT, {"model": "m", "messages": MSG, "logit_bias": {"5": 1.0}}, "logit_bias"),
        (CHAT, {"model": "m", "messages": MSG, "store": True}, "store"),
        (CHAT, {"model": "m", "messages": MSG, "metadata": {"a": "b"}}, "metadata"),
        (CHAT, {"model": "m", "messages": MSG, "service_tier": "flex"}, "service_tier"),
        (CHAT, {"model": "m", "messages": MSG, "modalities": ["text", "audio"]}, "modalities"),
        (CHAT, {"model": "m", "messages": MSG, "functions": [{"name": "f"}]}, "functions"),
        (CHAT, {"model": "m", "messages": MSG, "reasoning_effort": "low"}, "reasoning_effort"),
        (COMP, {"model": "m", "prompt": "x", "suffix": "end"}, "suffix"),
        (
            CHAT,
            {"model": "m", "messages": [{"role": "assistant", "content": "x", "refusal": "no"}]},
            "messages[0].refusal",
        ),
        # structured outputs and tools, checked before admission
        (
            CHAT,
            {"model": "m", "messages": MSG, "response_format": {"type": "yaml"}},
            "response_format.type",
        ),
        (
            COMP,
            {
                "model": "m",
                "prompt": "x",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                },
            },
            "response_format.json_schema.schema.uniqueItems",
        ),
        (CHAT, {"model": "m", "messages": MSG, "tools": []}, "tools"),
        (CHAT, {"model": "m", "messages": MSG, "tool_choice": "required"}, "tool_choice"),
        (CHAT, {"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (CHAT, {"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
        (CHAT, {"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
        (
            CHAT,
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                    }
                ],
            },
            "messages[0].content[0].type",
        ),
        (
            CHAT,
            {"model": "m", "messages": [{"role": "user", "content": "x", "mood": "happy"}]},
            "messages[0].mood",
        ),
        # missing and unknown fields
        (CHAT, {"messages": MSG}, "model"),
        (CHAT, {"model": "m"}, "messages"),
        (COMP, {"model": "m"}, "prompt"),
        (CHAT, {"model": "m", "messages": MSG, "temprature": 0.5}, "temprature"),
        (COMP, {"model": "m", "prompt": "x", "messages": MSG}, "messages"),
    ],
)
def test_bad_field_is_400_naming_it(server, path, body, param) -> None:
    status, resp = call(server, path, body)
    err = assert_openai_error(status, resp, 400, param)
    assert err["code"] == "invalid_request" and err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"   ",
        b"{not json",
        b"[1, 2]",
        b'"text"',
        b"42",
        b"null",
        b'{"model": "m", "messages": [] ,}',
        b"\xff\xfe",
    ],
)
@pytest.mark.parametrize("path", [CHAT, COMP])
def test_body_that_is_not_a_json_object_is_400(server, path, raw) -> None:
    status, resp = call(server, path, raw=raw)
    assert_openai_error(status, resp, 400)


def test_openai_fields_are_accepted_at_values_that_change_nothing(server) -> None:
    # Valid apart from naming no model: admission answers (404), so validation accepted it.
    status, resp = call(
        server,
        CHAT,
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                {"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": None, "tool_calls": []},
            ],
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logit_bias": {},
            "user": "u1",
            "metadata": {},
            "store": False,
            "response_format": {"type": "text"},
            "tool_choice": "none",
            "parallel_tool_calls": False,
            "modalities": ["text"],
            "safety_identifier": "s1",
            "prompt_cache_key": "k",
            "service_tier": "auto",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    err = assert_openai_error(status, resp, 404, "model")
    assert err["code"] == "model_not_found"
    status, resp = call(
        server,
        COMP,
        {
            "model": "m",
            "prompt": ["x"],
            "suffix": None,
            "best_of": 1,
            "logit_bias": {},
            "echo": True,
        },
    )
    assert_openai_error(status, resp, 404, "model")


def test_oversized_body_is_413_json(server) -> None:
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
    status, resp = call(server, CHAT, big)
    err = assert_openai_error(status, resp, 413)
    assert err["code"] == "payload_too_large"

    loop, client = server

    async def chunked() -> tuple[int, Any]:
        async def gen():
            yield b'{"model": "m", "prompt": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}'

        resp = await client.post(COMP, data=gen(), headers={"Content-Type": "application/json"})
        return resp.status, await resp.json()

    status, resp = loop.run_until_complete(chunked())
    assert_openai_error(status, resp, 413)


def test_wrong_method_and_unknown_route_are_json(server) -> None:
    status, resp = call(server, CHAT, method="GET")
    assert_openai_error(status, resp, 405)
    status, resp = call(server, "/v1/embeddings", {"model": "m"})
    assert_openai_error(status, resp, 404)


def test_nothing_resident_is_a_clear_error_not_a_500(server) -> None:
    status, resp = call(server, CHAT, {"model": "smollm2-135m-instruct", "messages": MSG})
    err = assert_openai_error(status, resp, 404, "model")
    assert "smollm2-135m-instruct" in err["message"]


def test_errors_leave_the_scheduler_untouched(server) -> None:
    _, client = server
    call(server, CHAT, {"model": "m", "messages": []})
    counts = client.app[keys.SCHEDULER].counts()
    assert (counts.running, counts.queued) == (0, 0)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
FIELDS = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "top_logprobs",
    "echo",
    "user",
    "best_of",
    "role",
    "content",
]
bodies = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
    st.fixed_dictionaries(
        {
            "model": st.text(max_size=4),
            "messages": st.lists(
                st.dictionaries(
                    st.sampled_from(["role", "content", "name"]),
                    st.sampled_from(["user", "system", "tool", "", 3, None, []]) | json_values,
                    max_size=3,
                ),
                max_size=3,
            ),
        },
        optional={k: json_values for k in FIELDS[3:12]},
    ),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=bodies, path=st.sampled_from([CHAT, COMP]))
def test_never_a_500_for_any_json_body(server, body, path) -> None:
    status, resp = call(server, path, body)
    assert status in (400, 404, 413), (status, resp)
    assert_openai_error(status, resp, status)
