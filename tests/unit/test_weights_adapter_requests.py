"""Adapter requests over HTTP: one adapter block (contract 6; weights page: Status).

Finding 11 of the adversarial trial of 2026-11-30: a test that failed on the code before its fix.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from miserver.http import keys
from miserver.serving import adapters
from tests.unit.test_weights_checkpoints_routes import make_adapter
from tests.unit.test_weights_routes import chat, make_client


@pytest.fixture
async def client(tmp_path, tiny_model_dir):
    c = await make_client(tmp_path, tiny_model_dir)
    yield c
    await c.close()


@pytest.fixture(scope="module")
def lora(tiny_model_dir, tmp_path_factory) -> Path:
    """A LoRA adapter (q_proj, v_proj) for the tiny model; copy it before changing it."""
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "lora")


def edited_adapter(lora: Path, folder: Path, **config) -> Path:
    shutil.copytree(lora, folder)
    cfg = json.loads((folder / adapters.CONFIG_NAME).read_text())
    cfg.update(config)
    (folder / adapters.CONFIG_NAME).write_text(json.dumps(cfg))
    return folder


async def status(client) -> dict:
    return (await (await client.get("/api/weights/status")).json())["data"]


async def header(client, model: str = "tiny") -> str:
    st, body, headers = await chat(client, model=model)
    assert st == 200, body
    return headers["X-miLLM-Model"]


async def apply(client, name: str, path) -> tuple[int, dict]:
    resp = await client.post("/api/weights/adapter", json={"name": name, "path": str(path)})
    return resp.status, await resp.json()


async def remove(client) -> tuple[int, dict]:
    resp = await client.delete("/api/weights/adapter")
    return resp.status, await resp.json()


def assert_untouched(client, state: dict) -> None:
    assert not adapters.has_adapter(client.app[keys.HOST].resident.model)
    assert state["barrier"] == "serving" and state["weights_state"] == "clean"
    assert state["adapter"] == {"applied": False}


# --- finding 11: one adapter block ---------------------------------------------------------------
async def test_the_adapter_route_and_status_give_the_same_adapter_object(client, lora):
    resp = await client.get("/api/weights/adapter")
    block = (await resp.json())["data"]
    assert block == {"applied": False}
    assert (await status(client))["adapter"] == block
    st, body = await apply(client, "tiny-lora", lora)
    assert st == 200, body
    block = (await (await client.get("/api/weights/adapter")).json())["data"]
    assert block == body["data"]
    assert set(block) == {
        "applied",
        "name",
        "path",
        "rank",
        "alpha",
        "target_modules",
        "applied_at",
    }
    assert (await status(client))["adapter"] == block
    st, body = await remove(client)
    assert body["data"] == {"applied": False} == (await status(client))["adapter"]
