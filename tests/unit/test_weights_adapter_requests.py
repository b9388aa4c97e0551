"""Adapter requests over HTTP: refusals before the pause, and one adapter block (contract 6;
weights page: Status).

Findings 3, 11 and 12 of the adversarial trial of 2026-11-30, each a test that failed on the code
before its fix.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from miserver.http import keys
from miserver.serving.models import adapters
from tests.unit.test_weights_checkpoints_routes import attach, make_adapter, scores
from tests.unit.test_weights_routes import chat, make_client, post


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


# --- finding 3: adapter name and target modules checked before the pause -------------------------
@pytest.mark.parametrize("name", ["", 'x y/../z"', "../up", "-lead", "a" * 129])
async def test_a_bad_adapter_name_is_400_before_anything_changes(client, lora, name):
    before = await scores(client)
    st, body = await apply(client, name, lora)
    assert st == 400, body
    assert body["error"]["code"] == "INVALID_REQUEST"
    assert body["error"]["details"] == {"field": "name"}
    assert_untouched(client, await status(client))
    assert await scores(client) == before


@pytest.mark.parametrize("name", ["tiny", "tiny-b"])
async def test_an_adapter_named_as_a_catalogue_row_is_400(client, lora, name):
    client.app[keys.CATALOGUE].register(
        name="tiny-b", format="safetensors", dtype="bfloat16", path=lora.parent
    )
    row = client.app[keys.CATALOGUE].get_by_name(name)
    st, body = await apply(client, name, lora)
    assert st == 400, body
    assert body["error"]["code"] == "INVALID_REQUEST"
    assert body["error"]["details"] == {"field": "name", "model_id": row.id}
    assert "choose another name" in body["error"]["message"]
    assert_untouched(client, await status(client))


@pytest.mark.parametrize(
    "config, module",
    [
        ({"target_modules": ["nonexistent_proj"]}, None),
        ({"target_modules": ["q_proj"]}, "v_proj"),  # the file's v_proj tensors would be dropped
        ({"target_modules": ["mlp"]}, "mlp"),  # a LlamaMLP block, which LoRA cannot wrap
        ({"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [7]}, None),
    ],
)
async def test_target_modules_the_model_cannot_take_are_400_adapter_invalid(
    client, lora, tmp_path, config, module
):
    folder = edited_adapter(lora, tmp_path / "edited", **config)
    before = await scores(client)
    st, body = await apply(client, "w", folder)
    assert st == 400, body
    error = body["error"]
    assert (error["code"], error["reason"]) == ("ADAPTER_INVALID", "incompatible")
    assert "target_modules" in error["message"]
    assert error["details"]["path"] == str(folder)
    if module is not None:
        assert error["details"]["module"].endswith(module)
    assert_untouched(client, await status(client))
    assert await scores(client) == before


async def test_adapter_input_is_refused_before_the_table_is_asked(client, lora, tmp_path):
    # A commit is open (writing): the table would answer 409 WEIGHTS_NOT_CLEAN. A request the
    # client got wrong is answered for what it is, first, as a save's bad name is.
    h = await attach(client)
    assert (await post(client, "/api/weights/quiesce", h))[0] == 200
    assert (await post(client, "/api/weights/commit-begin", h))[0] == 200
    st, body = await apply(client, "", lora)
    assert (st, body["error"]["code"]) == (400, "INVALID_REQUEST")
    folder = edited_adapter(lora, tmp_path / "edited", target_modules=["nonexistent_proj"])
    st, body = await apply(client, "w", folder)
    assert (st, body["error"]["code"]) == (400, "ADAPTER_INVALID")
    st, body = await apply(client, "w", lora)  # a good request reaches the table
    assert (st, body["error"]["code"]) == (409, "WEIGHTS_NOT_CLEAN")
    assert (await post(client, "/api/weights/commit-end", h))[0] == 200


async def test_an_adapter_peft_refuses_inside_the_pause_is_400_and_changes_nothing(
    client, lora, monkeypatch
):
    from peft import PeftModel

    def refuse(*args, **kwargs):
        raise ValueError("Target module Dropout() is not supported")

    monkeypatch.setattr(PeftModel, "from_pretrained", refuse)
    before = await scores(client)
    st, body = await apply(client, "w", lora)
    assert st == 400, body
    assert (body["error"]["code"], body["error"]["reason"]) == ("ADAPTER_INVALID", "incompatible")
    assert "PEFT could not apply the adapter" in body["error"]["message"]
    assert_untouched(client, await status(client))
    assert await scores(client) == before


# --- finding 12: relative adapter paths --------------------------------------------------------
@pytest.mark.parametrize("path", ["lora", "./lora", "~/lora", ""])
async def test_a_relative_adapter_path_is_refused_as_post_models_refuses_it(client, path):
    st, body = await apply(client, "w", path)
    assert st == 400, body
    error = body["error"]
    assert error["code"] == "INVALID_REQUEST" and error["details"] == {"field": "path"}
    assert "absolute" in error["message"]
    if path:
        assert "the server's working directory is not yours" in error["message"]
        resp = await client.post("/api/models", json={"name": "m", "path": path})
        theirs = (await resp.json())["error"]
        assert (resp.status, theirs["code"]) == (400, "INVALID_REQUEST")
        assert theirs["message"] == error["message"]  # one wording for one rule
    assert_untouched(client, await status(client))
