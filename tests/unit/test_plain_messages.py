"""Issue 32, item 6: a 400 for a body of the wrong shape says what is wrong in plain words,
naming the field, not msgspec's wording (``Object missing required field `messages` at
messages``, ``Expected `int | null`, got `str```)."""

from __future__ import annotations

import pytest

from miserver.http import openai_schema as schema
from miserver.http.management import RegisterModel, decode_body
from miserver.spec.errors import ApiError
from miserver.spec.json_syntax import plain_validation_message

MSG = b'"messages":[{"role":"user","content":"x"}]'

CASES = [
    (b'{"model":"m"}', "messages", "messages is required"),
    (b'{"model":"m","messages":"hi"}', "messages", "messages must be an array, not a string"),
    (
        b'{"model":"m",' + MSG + b',"max_tokens":"5"}',
        "max_tokens",
        "max_tokens must be an integer, not a string",
    ),
    (
        b'{"model":"m",' + MSG + b',"max_tokens":1.5}',
        "max_tokens",
        "max_tokens must be an integer, not a number with a fraction",
    ),
    (b'{"model":"m",' + MSG + b',"stream":1}', "stream", "stream must be true or false"),
    (b'{"model":"m",' + MSG + b',"n":true}', "n", "n must be an integer, not a boolean"),
    (b'{"model":5,' + MSG + b"}", "model", "model must be a string, not an integer"),
    (b'{"model":"m","messages":[{"content":"x"}]}', "messages[0].role", "is required"),
    (
        b'{"model":"m","messages":[{"role":"user","content":5}]}',
        "messages[0].content",
        "must be a string or an array, not an integer",
    ),
]


def _no_library_wording(message: str) -> None:
    for words in ("Expected `", "Object missing", "`$", "| null"):
        assert words not in message, message


@pytest.mark.parametrize(("body", "param", "words"), CASES)
def test_v1_schema_refusals_are_plain_words(body: bytes, param: str, words: str) -> None:
    with pytest.raises(ApiError) as exc:
        schema.decode(body, schema.ChatCompletionRequest)
    assert exc.value.param == param
    assert words in exc.value.message, exc.value.message
    _no_library_wording(exc.value.message)


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        (b'{"name":"x"}', "path", "path is required"),
        (b'{"name":5,"path":"/x"}', "name", "name must be a string, not an integer"),
        (b'{"name":"x","path":"/x","dtype":5}', "dtype", "dtype must be a string"),
    ],
)
def test_management_refusals_are_plain_words(body: bytes, field: str, words: str) -> None:
    with pytest.raises(ApiError) as exc:
        decode_body(body, RegisterModel)
    assert exc.value.param == field and words in exc.value.message, exc.value.message
    _no_library_wording(exc.value.message)


def test_bounds_and_unknown_forms() -> None:
    assert plain_validation_message("Expected `int` >= 1, got `int`", "n") == (
        "n must be an integer at least 1, not an integer"
    )
    assert plain_validation_message("Expected `array` of length <= 4", "stop") == (
        "stop must be an array of at most 4 items"
    )
    assert plain_validation_message("Something else", "x") == "Something else at x"
