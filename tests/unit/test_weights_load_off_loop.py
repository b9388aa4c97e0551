"""POST /api/weights/load checks the checkpoint (reads and hashes every file: seconds for a large
model) off the event loop, so serving goes on meanwhile."""

from __future__ import annotations

import threading

import pytest

from miserver.serving.weights import jobs as weights_jobs
from miserver.spec import codes
from miserver.spec.errors import ApiError
from tests.unit.model_free_app import model_free_client, model_free_settings

OPS = "operator-secret-0123456789"


@pytest.fixture
async def client(tmp_path):
    c = await model_free_client(model_free_settings(tmp_path, f"ops:operator:{OPS}"))
    yield c
    await c.close()


async def test_the_checkpoint_is_checked_off_the_event_loop(client, monkeypatch) -> None:
    seen: list[int] = []

    def checking(host, body):
        seen.append(threading.get_ident())
        raise ApiError(codes.CHECKPOINT_NOT_FOUND, "no such checkpoint")

    monkeypatch.setattr(weights_jobs, "prepare_load", checking)
    resp = await client.post(
        "/api/weights/load",
        headers={"Authorization": f"Bearer {OPS}"},
        json={"checkpoint": "nope"},
    )
    assert resp.status == 404
    assert seen and seen[0] != threading.get_ident()  # not the event loop's thread
