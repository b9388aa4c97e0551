"""Issue 32, item 13: a Batch upload checks every line's body as its route would, before it
looks at a model, and refuses the file naming the bad lines (docs/openai-compatibility.md: "every
line is checked first"); what needs the model (the context window, the model's name) is still
the row's error line when it runs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from miserver.http.batches import body_problem
from tests.unit.test_batches import _form, client, jsonl, line  # noqa: F401 - the fixture

BAD_BODIES = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"frequency_boost": 1}, "frequency_boost"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"n": 0}, "n"),
]


@pytest.mark.parametrize(("change", "field"), BAD_BODIES)
async def test_an_upload_with_an_invalid_body_is_refused_naming_line_and_field(
    client,  # noqa: F811 - the fixture
    change: dict[str, Any],
    field: str,
):
    bad = line("b")
    bad["body"].update(change)
    r = await client.post("/v1/files", data=_form(jsonl([line("a"), bad, line("c")])))
    err = (await r.json())["error"]
    assert r.status == 400, err
    assert err["code"] == "invalid_request" and err["param"] == "file"
    assert "line 2: body" in err["message"] and field in err["message"], err["message"]
    assert "line 1" not in err["message"] and "line 3" not in err["message"]
    assert (await (await client.get("/v1/files")).json())["data"] == []  # nothing stored


async def test_a_completions_line_is_checked_as_completions(client):  # noqa: F811
    row = {
        "custom_id": "p",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "x", "best_of": 3},
    }
    chat_only = {
        "custom_id": "q",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "x"}]},
    }
    r = await client.post("/v1/files", data=_form(jsonl([row, chat_only])))
    message = (await r.json())["error"]["message"]
    assert r.status == 400 and "line 1: body.best_of" in message and "line 2: body" in message
    row["body"]["best_of"] = 1
    r = await client.post("/v1/files", data=_form(jsonl([row])))
    assert r.status == 200, await r.text()


async def test_valid_bodies_with_openai_fields_are_accepted(client):  # noqa: F811
    ok = line("a", temperature=0, max_tokens=5, stop=["\n"], seed=1, user="u", store=False)
    r = await client.post("/v1/files", data=_form(jsonl([ok])))
    assert r.status == 200, await r.text()
    assert (
        json.loads(await (await client.get(f"/v1/files/{(await r.json())['id']}/content")).read())[
            "body"
        ]["max_tokens"]
        == 5
    )


def test_body_problem_names_the_field():
    assert body_problem("/v1/chat/completions", line("a")["body"]) is None
    problem = body_problem("/v1/chat/completions", {**line("a")["body"], "max_tokens": -1})
    assert problem is not None and problem.startswith("body.max_tokens: ")
