"""Readiness (``GET /api/health/ready``) and a DEVICE this machine does not have (issue 16
trial, finding 14): the Kubernetes readiness probe said ready with nothing resident or with
torn weights, and ``DEVICE=cuda:0`` on a CPU-only machine started a server whose every chat
was a 500."""

from __future__ import annotations

import pytest
import torch

from miserver.server import device_problem
from tests.unit.test_error_wording import make_client as make_empty_client
from tests.unit.test_weights_checkpoints_routes import attach
from tests.unit.test_weights_routes import OPS, auth, make_client, post
from tests.waiting import eventually


async def ready(client) -> tuple[int, dict]:
    resp = await client.get("/api/health/ready")
    return resp.status, await resp.json()


async def test_ready_with_a_resident_model_then_not_when_torn_then_ready_again(
    tmp_path, tiny_model_dir
) -> None:
    client = await make_client(tmp_path, tiny_model_dir, WEIGHTS_COMMIT_WATCHDOG_MS="100")
    try:
        st, body = await ready(client)
        assert st == 200 and body["data"]["status"] == "ready", body
        h = await attach(client)
        await post(client, "/api/weights/save", h, {"name": "tiny-good"})
        await post(client, "/api/weights/quiesce", h)
        st, _ = await ready(client)
        assert st == 200  # a hold is milliseconds: still ready
        await post(client, "/api/weights/commit-begin", h)

        async def torn():
            return (await ready(client))[0] == 503

        await eventually(torn, "the watchdog tore the commit")
        st, body = await ready(client)
        assert body["error"]["code"] == "NOT_READY" and body["error"]["reason"] == "weights_torn"
        assert "POST /api/weights/load" in body["error"]["message"]
        assert (await (await client.get("/api/health")).json())["data"]["status"] == "ok"
        st, body, _ = await post(
            client, "/api/weights/load", auth(OPS), {"checkpoint": "tiny-good"}
        )
        assert st == 200, body
        assert (await ready(client))[0] == 200
    finally:
        await client.close()


async def test_not_ready_with_nothing_resident(tmp_path) -> None:
    client = await make_empty_client(tmp_path)
    try:
        st, body = await ready(client)
        assert st == 503, body
        assert body["error"]["reason"] == "no_model" and "DEFAULT_MODEL" in body["error"]["message"]
        assert (await client.get("/api/health")).status == 200  # liveness is unchanged
    finally:
        await client.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_a_cuda_device_without_cuda_is_a_configuration_error(device) -> None:
    problem = device_problem(device)
    assert problem is not None and f"DEVICE={device}" in problem and "DEVICE=cpu" in problem


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_cpu_and_auto_always_do(device) -> None:
    assert device_problem(device) is None


def test_miserver_serve_with_a_missing_gpu_exits_2_with_one_line(tmp_path, monkeypatch) -> None:
    from miserver import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("MISERVER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DEFAULT_MODEL", "")
    monkeypatch.setenv("DEVICE", "cuda:1")
    assert cli.main(["serve"]) == 2
