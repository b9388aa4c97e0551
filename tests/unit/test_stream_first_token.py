"""Issue 32, item 13: a stream whose first token fails is the JSON 500 ``generation_failed`` the
docs promise (docs/openai-compatibility.md: "The stream opens only after ..."), not a 200 whose
only event is an error; a failure after the stream opened still ends it with one error event."""

from __future__ import annotations

import asyncio

import torch

from miserver.serving.engine import sampler as sampler_module
from tests.unit.test_hardening_answers import client, failures, poison  # noqa: F401

BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 6,
    "temperature": 0,
    "stream": True,
}


async def test_a_stream_failing_at_its_first_token_is_a_json_500(client):  # noqa: F811
    poison(client)
    resp = await client.post("/v1/chat/completions", json=BODY)
    text = await resp.text()
    assert resp.status == 500, text
    assert resp.content_type == "application/json" and "data:" not in text
    err = (await resp.json())["error"]
    assert err["code"] == "generation_failed" and "non-finite logits" in err["message"]
    metrics = await (await client.get("/metrics")).text()
    assert failures(metrics, "non_finite_logits") == 1
    again = await asyncio.wait_for(client.post("/v1/chat/completions", json=BODY), 60)
    assert again.status == 500  # the slot was given back: the next request ran


async def test_a_failure_after_the_first_token_ends_the_open_stream(client, monkeypatch):  # noqa: F811
    real = sampler_module.pick_token
    calls = [0]

    def fail_third(logits: torch.Tensor, *args, **kwargs):
        calls[0] += 1
        if calls[0] >= 3:  # from the third token on, as non-finite weights would
            logits = torch.full_like(logits, float("nan"))
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(sampler_module, "pick_token", fail_third)  # the continuous engine's
    resp = await client.post("/v1/chat/completions", json=BODY)
    text = await resp.text()
    assert resp.status == 200 and resp.content_type == "text/event-stream", text
    assert "non-finite logits" in text.splitlines()[-2] and "[DONE]" not in text
