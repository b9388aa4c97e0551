"""A body that is not JSON gets a 400 that says why, on every route that reads one: a lone
UTF-16 surrogate escape is named as such (msgspec alone says "Input data was truncated"), a
body nested too deeply to decode is a 400 (not a RecursionError answered 500), and every other
syntax error carries the decoder's reason with its byte offset. Contract 2; issue 16 trial."""

from __future__ import annotations

import msgspec
import pytest

from miserver.spec.json_syntax import decode_error_message
from tests.unit.test_error_wording import TRN, make_client

DEEP = b"[" * 100_000 + b"]" * 100_000
AUTH = {"Authorization": f"Bearer {TRN}"}


def message_for(raw: bytes) -> str:
    try:
        msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        return decode_error_message(raw, exc)
    raise AssertionError(f"{raw!r} decoded")


@pytest.mark.parametrize("raw", [b'{"a": "\\ud800"}', b'["x\\udfffy"]', b'{"\\udbff": 1}'])
def test_a_lone_surrogate_escape_is_named(raw: bytes) -> None:
    assert "lone UTF-16 surrogate" in message_for(raw)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (
            b'{"a": "\\ud83d\\ude00", "b": NaN}',
            "invalid character (byte",
        ),  # a real pair, and a real error
        (b'{"a": 1,}', "trailing comma"),
        (b'{"a": ', "ends before the JSON value does"),
        (b"   ", "is empty"),
    ],
)
def test_other_syntax_errors_keep_the_decoders_reason(raw: bytes, says: str) -> None:
    message = message_for(raw)
    assert says in message and "surrogate" not in message


def test_nesting_too_deep_is_named() -> None:
    assert "too deeply" in message_for(DEEP)


@pytest.fixture
async def client(tmp_path):
    c = await make_client(tmp_path)
    yield c
    await c.close()


ROUTES = [
    ("POST", "/v1/chat/completions", {}),
    ("POST", "/v1/completions", {}),
    ("POST", "/v1/batches", {}),
    ("PATCH", "/api/settings", AUTH),
    ("POST", "/api/models", AUTH),
    ("POST", "/api/weights/load", AUTH),
]


@pytest.mark.parametrize(("method", "path", "headers"), ROUTES)
@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"\\ud800": 1}', "lone UTF-16 surrogate"),
        (b'{"model": ' + DEEP + b"}", None),
        (b'{"metadata": ' + DEEP + b"}", None),
        (b'{"model" "x"}', "not valid JSON: JSON is malformed"),
    ],
)
async def test_every_route_answers_a_bad_body_400_with_a_json_error(
    client, method, path, headers, body, says
) -> None:
    resp = await client.request(
        method, path, data=body, headers={**headers, "Content-Type": "application/json"}
    )
    assert resp.status == 400, (resp.status, await resp.text())
    error = (await resp.json())["error"]
    assert error["code"].upper() == "INVALID_REQUEST", error
    if says is not None:
        assert says in error["message"], error


async def test_a_batch_with_a_number_beyond_a_float_is_a_400(client) -> None:
    resp = await client.post(
        "/v1/batches",
        data=b'{"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "x": 1e999}',
        headers={"Content-Type": "application/json"},
    )
    assert resp.status == 400, await resp.text()
    assert "out of range" in (await resp.json())["error"]["message"]
