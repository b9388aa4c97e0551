"""Breaker finding F16: a load (or a /v1 auto-load) of a row whose folder cannot be loaded left
nothing resident. Now what can be checked is checked while the resident still serves (400
MODEL_LOAD_FAILED, nothing unloaded), registration refuses an unreadable weight file, and a
load that fails once the previous model is gone loads that row back (the table's
``transition_failed`` row ``reloaded_previous``) and says so."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from miserver.http import keys
from miserver.serving.models import loader as loader_module
from miserver.serving.models.catalogue import Catalogue
from miserver.spec.errors import ApiError
from tests.unit.test_weights_routes import OPS, make_client

CHAT = "/v1/chat/completions"


def chat(model: str) -> dict:
    return {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}


def garbage_folder(tmp_path: Path, model_dir: str) -> Path:
    """The breaker's folder: the model's config.json and a model.safetensors of garbage."""
    folder = tmp_path / "badmodel"
    folder.mkdir()
    shutil.copy(Path(model_dir) / "config.json", folder / "config.json")
    (folder / "model.safetensors").write_text("garbage\n")
    return folder


async def resident_name(c) -> str | None:
    data = (await (await c.get("/api/health/detailed")).json())["data"]
    resident = data["resident"]
    return resident["name"] if resident else None


async def test_a_load_of_a_garbage_folder_is_400_and_the_resident_keeps_serving(
    tmp_path, tiny_model_dir
) -> None:
    bad = garbage_folder(tmp_path, tiny_model_dir)
    c = await make_client(tmp_path, tiny_model_dir)
    try:
        # registered before registration checked the weights (or damaged since)
        row = c.app[keys.CATALOGUE].register(
            name="badmodel", format="safetensors", dtype="bfloat16", path=str(bad)
        )
        resp = await c.post(f"/api/models/{row.id}/load")
        err = (await resp.json())["error"]
        assert resp.status == 400, err
        assert err["code"] == "MODEL_LOAD_FAILED"
        assert "badmodel" in err["message"] and "nothing was unloaded" in err["message"]
        assert await resident_name(c) == "tiny"
        assert c.app[keys.WEIGHTS].lifecycle.state.resident

        resp = await c.post(CHAT, json=chat("badmodel"))  # the anonymous /v1 path
        body = await resp.json()
        assert resp.status == 400, body
        assert body["error"]["code"] == "model_load_failed"
        assert await resident_name(c) == "tiny"
        resp = await c.post(CHAT, json=chat("tiny"))
        assert resp.status == 200, await resp.text()
    finally:
        await c.close()


async def test_registration_refuses_a_folder_whose_safetensors_header_is_unreadable(
    tmp_path, tiny_model_dir
) -> None:
    bad = garbage_folder(tmp_path, tiny_model_dir)
    c = await make_client(tmp_path, tiny_model_dir)
    try:
        resp = await c.post(
            "/api/models",
            json={"name": "badmodel", "path": str(bad)},
            headers={"Authorization": f"Bearer {OPS}"},  # an anonymous caller is told less
        )
        err = (await resp.json())["error"]
        assert resp.status == 400, err
        assert err["code"] == "INVALID_REQUEST" and err["details"]["field"] == "path"
        assert "model.safetensors" in err["message"] and "safetensors" in err["message"]
        assert c.app[keys.CATALOGUE].get_by_name("badmodel") is None
        good = await c.post("/api/models", json={"name": "copy", "path": tiny_model_dir})
        assert good.status == 201, await good.text()  # a real folder still registers
    finally:
        await c.close()


async def test_a_load_that_fails_after_the_drop_loads_the_previous_row_back(
    tmp_path, tiny_model_dir, caplog
) -> None:
    c = await make_client(tmp_path, tiny_model_dir)
    try:
        host = c.app[keys.HOST]
        copy = c.app[keys.CATALOGUE].register(
            name="copy", format="safetensors", dtype="bfloat16", path=tiny_model_dir
        )
        real = host._loader

        def failing(row, settings):  # passes every check, fails with the resident gone
            if row.name == "copy":
                raise ApiError(loader_module.codes.MODEL_LOAD_FAILED, "out of memory, say")
            return real(row, settings)

        host._loader = failing
        before = host.resident
        resp = await c.post(f"/api/models/{copy.id}/load")
        err = (await resp.json())["error"]
        assert resp.status == 500, err
        assert err["code"] == "MODEL_LOAD_FAILED"
        assert "'tiny' was loaded back" in err["message"]
        assert err["details"]["restored"] == "tiny"
        assert host.resident is not None and host.resident is not before
        assert await resident_name(c) == "tiny"
        runtime = c.app[keys.WEIGHTS]
        state = runtime.lifecycle.state
        assert state.resident and state.transition == "none" and state.weights == "clean"
        status = (await (await c.get("/api/weights/status")).json())["data"]
        assert status["resident_model"]["name"] == "tiny"
        assert "loading the previous model tiny (id 1) back" in caplog.text
        resp = await c.post(CHAT, json=chat("tiny"))
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-miLLM-Model"].startswith('"tiny";origin=model;commits=0')
    finally:
        await c.close()


def _shapes_off(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))


def _cut_short(folder: Path) -> None:
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])


def _no_tokenizer(folder: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (_shapes_off, "config.json describes"),
        (_cut_short, "cut short"),
        (_no_tokenizer, "the tokenizer"),
        (lambda f: (f / "config.json").write_text("{}"), "config.json"),
    ],
)
def test_preflight_refuses_what_the_load_would_fail_on(
    tmp_path, tiny_model_dir, damage, words
) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    damage(folder)
    catalogue = Catalogue(str(tmp_path / "home"))
    row = catalogue.register(name="m", format="safetensors", dtype="bfloat16", path=str(folder))
    with pytest.raises(ApiError) as exc:
        loader_module.preflight(row)
    assert (exc.value.status, exc.value.code.name) == (400, "MODEL_LOAD_FAILED")
    assert words in exc.value.message, exc.value.message
    loader_module.preflight(
        catalogue.register(name="ok", format="safetensors", dtype="bfloat16", path=tiny_model_dir)
    )


def test_a_header_length_past_the_end_is_named(tmp_path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(ValueError, match="does not fit the file"):
        loader_module.read_safetensors_header(f)


async def test_a_model_the_engine_cannot_hold_fails_its_load_and_the_previous_comes_back(
    tmp_path, tiny_model_dir, monkeypatch
) -> None:
    """The continuous engine serves every sequence (the static batch it fell back to is gone):
    a model it cannot be built for fails its load, 500 MODEL_LOAD_FAILED naming the engine's
    error, and the previous row is loaded back and serves."""
    from miserver.serving.engine import continuous

    c = await make_client(tmp_path, tiny_model_dir)
    try:
        copy = c.app[keys.CATALOGUE].register(
            name="copy", format="safetensors", dtype="bfloat16", path=tiny_model_dir
        )
        real = continuous.ContinuousEngine
        fails = [1]

        def engine(model, *args, **kwargs):  # the first build fails: the copy's
            if fails:
                fails.pop()
                raise ValueError("an attention layout the engine does not hold, say")
            return real(model, *args, **kwargs)

        monkeypatch.setattr(continuous, "ContinuousEngine", engine)
        resp = await c.post(f"/api/models/{copy.id}/load")
        err = (await resp.json())["error"]
        assert resp.status == 500, err
        assert err["code"] == "MODEL_LOAD_FAILED"
        assert (
            "the continuous engine cannot serve copy: ValueError: an attention layout"
            in (err["message"])
        )
        assert err["details"]["restored"] == "tiny"
        assert await resident_name(c) == "tiny"
        assert c.app[keys.HOST].resident.engine_loop is not None
        resp = await c.post(CHAT, json=chat("tiny"))
        assert resp.status == 200, await resp.text()
    finally:
        await c.close()
