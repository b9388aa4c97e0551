"""Issue 32, item 5: ``MAX_CONCURRENT_REQUESTS`` above 1 with a trainer token configured turns
the step barrier off; the server says so in one warning line at start and in
``GET /api/health/detailed`` (``warnings``), also after a ``PATCH /api/settings``."""

from __future__ import annotations

import logging

import pytest

from tests.unit.model_free_app import model_free_client, model_free_settings

TRN = "trainer-secret-0123456789"
OPS = "operator-secret-0123456789"


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "MAX_CONCURRENT_REQUESTS" in r.getMessage()
    ]


async def _detailed(client) -> list[str]:
    body = await (await client.get("/api/health/detailed")).json()
    return body["data"]["warnings"]


async def test_concurrency_with_a_trainer_token_warns_once_and_in_health(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    settings = model_free_settings(tmp_path, f"trn:trainer:{TRN}", MAX_CONCURRENT_REQUESTS="4")
    client = await model_free_client(settings)
    try:
        started = _warnings(caplog)
        assert len(started) == 1, started
        assert "MAX_CONCURRENT_REQUESTS is 4" in started[0] and "BARRIER_UNAVAILABLE" in started[0]
        assert TRN not in started[0]
        listed = await _detailed(client)
        assert listed == started
        await _detailed(client)
        assert len(_warnings(caplog)) == 1  # a read logs nothing more
        resp = await client.patch("/api/settings", json={"max_concurrent_requests": 1})
        assert resp.status == 200, await resp.text()
        assert await _detailed(client) == []
        resp = await client.patch("/api/settings", json={"max_concurrent_requests": 2})
        assert resp.status == 200, await resp.text()
        listed = await _detailed(client)
        assert len(listed) == 1 and "MAX_CONCURRENT_REQUESTS is 2" in listed[0]
        assert len(_warnings(caplog)) == 2  # the barrier went off again: said again
    finally:
        await client.close()


@pytest.mark.parametrize(
    "tokens, concurrency", [(f"trn:trainer:{TRN}", "1"), (f"ops:operator:{OPS}", "4"), ("", "4")]
)
async def test_no_warning_without_a_trainer_token_or_at_one(tmp_path, caplog, tokens, concurrency):
    caplog.set_level(logging.WARNING)
    settings = model_free_settings(tmp_path, tokens, MAX_CONCURRENT_REQUESTS=concurrency)
    client = await model_free_client(settings)
    try:
        assert await _detailed(client) == []
        assert _warnings(caplog) == []
    finally:
        await client.close()
