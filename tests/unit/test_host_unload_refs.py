"""Nothing keeps an unloaded model: after an unload or a swap the model, its parameters and its
parameter arena's storages are gone at once, with weights attach on (``WEIGHTS_CPU_ATTACH=1``,
an arena) and off, also after an attach + detach cycle.

The CPU stand-in for tests/gpu/test_model_host_cuda.py (which measures the card's memory): here
weak references show what is still alive. The assertions deliberately run WITHOUT an extra
``gc.collect()``: the host must free the memory itself (an unload returns it to the card).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from miserver.http import keys
from miserver.http.app import create_app
from miserver.serving.models import loader as loader_module
from miserver.serving.models.catalogue import Catalogue, CatalogueRow
from miserver.serving.models.host import ModelHost, run_without_keeping
from miserver.spec.settings import Settings, WeightsToken, load_settings

TOKEN = WeightsToken(label="forge", role="trainer", secret="t" * 24)
TRN = "trainer-secret-0123456789"
OPS = "operator-secret-0123456789"


def host_settings(home: Path, attach: bool) -> Settings:
    if attach:
        return Settings(
            home=str(home), device="cpu", weights_tokens=(TOKEN,), weights_cpu_attach=True
        )
    return Settings(home=str(home), device="cpu")


class Refs:
    """Weak references to one resident's model, a parameter and its arena storages."""

    def __init__(self, resident: Any) -> None:
        self.model = weakref.ref(resident.model)
        self.param = weakref.ref(next(resident.model.parameters()))
        arena = resident.arena
        self.storages = [weakref.ref(st) for st in arena.storages] if arena is not None else []
        self.arena = weakref.ref(arena) if arena is not None else None

    def alive(self) -> list[str]:
        out = [n for n in ("model", "param") if getattr(self, n)() is not None]
        out += [f"storage{i}" for i, r in enumerate(self.storages) if r() is not None]
        if self.arena is not None and self.arena() is not None:
            out.append("arena")
        return out


def make_host(tmp_path: Path, model_dir: str, attach: bool, loader: Any = None) -> ModelHost:
    cat = Catalogue(tmp_path)
    for name in ("a", "b"):
        cat.register(name=name, format="safetensors", dtype="bfloat16", path=model_dir)
    return ModelHost(host_settings(tmp_path, attach), cat, loader=loader)


@pytest.mark.parametrize("attach", [False, True], ids=["attach-off", "attach-on"])
async def test_unload_in_the_same_step_frees_everything(tmp_path, tiny_model_dir, attach):
    # The CUDA failure: load, then unload without the task yielding in between (the failing GPU
    # test does exactly this). The load's futures held the model until the step ended.
    host = make_host(tmp_path, tiny_model_dir, attach)
    refs = Refs(await host.ensure_for_request("a"))
    assert (refs.arena is not None) == attach
    await host.unload()
    assert refs.alive() == []


@pytest.mark.parametrize("attach", [False, True], ids=["attach-off", "attach-on"])
async def test_a_swap_frees_the_previous_model_before_the_next_load(
    tmp_path, tiny_model_dir, attach
):
    seen_alive: list[list[str]] = []
    previous: list[Refs] = []

    def loader(row: CatalogueRow, settings: Settings) -> loader_module.LoadedModel:
        if previous:  # the swap's load starts: the old model must be gone (one copy at a time)
            seen_alive.append(previous[-1].alive())
        return loader_module.load_model(row, settings)

    host = make_host(tmp_path, tiny_model_dir, attach, loader=loader)
    previous.append(Refs(await host.ensure_for_request("a")))
    second = Refs(await host.ensure_for_request("b"))  # a swap in the same task step
    assert seen_alive == [[]]
    assert previous[0].alive() == []
    await host.unload()
    assert second.alive() == []


async def test_a_failed_load_keeps_nothing(tmp_path, tiny_model_dir):
    # A load that fails after building the model (a CUDA OOM while placing it, say): the
    # exception becomes the answer, but its frames must not keep the half-loaded model.
    built: list[weakref.ref] = []

    def loader(row: CatalogueRow, settings: Settings) -> loader_module.LoadedModel:
        loaded = loader_module.load_model(row, settings)
        built.append(weakref.ref(loaded.model))
        raise RuntimeError("out of memory while placing the parameters")

    host = make_host(tmp_path, tiny_model_dir, attach=True, loader=loader)
    with pytest.raises(RuntimeError, match="out of memory") as info:
        await host.ensure_for_request("a")
    assert info.value is not None  # the exception (and its traceback) is still held here
    assert host.resident is None
    assert built and built[0]() is None


async def test_run_without_keeping_returns_the_result_and_raises_the_error():
    class Big:
        pass

    big = Big()
    assert await run_without_keeping(lambda x: x, big) is big
    with pytest.raises(ZeroDivisionError):
        await run_without_keeping(lambda: 1 / 0)


# --- through the app: attach + detach, swap and unload over HTTP ----------------------------------
async def make_client(tmp_path: Path, model_dir: str, attach: bool) -> TestClient:
    home = tmp_path / "home"
    cat = Catalogue(str(home))
    for name in ("tiny-a", "tiny-b"):
        cat.register(name=name, format="safetensors", dtype="bfloat16", path=model_dir)
    env = {
        "MISERVER_HOME": str(home),
        "DEFAULT_MODEL": "tiny-a",
        "DEVICE": "cpu",
        "WEIGHTS_TOKENS": f"trn:trainer:{TRN},ops:operator:{OPS}",
        "WEIGHTS_AUDIT_LOG": str(tmp_path / "audit.jsonl"),
    }
    if attach:
        env["WEIGHTS_CPU_ATTACH"] = "1"
    app = create_app(load_settings(env))
    client = TestClient(TestServer(app))
    await client.start_server()
    await app[keys.STARTUP_LOAD]
    return client


async def post(
    client: TestClient, path: str, headers: dict | None = None, body: Any = None
) -> tuple[int, dict]:
    resp = await client.post(path, headers=headers or {}, json=body)
    return resp.status, await resp.json()


async def attach_detach(client: TestClient, attach: bool) -> None:
    auth = {"Authorization": f"Bearer {TRN}"}
    status, body = await post(client, "/api/weights/attach", auth)
    if not attach:
        assert status == 400 and body["error"]["code"] == "NOT_ATTACHABLE", body
        return
    assert status == 200, body
    auth["X-miLLM-Attachment"] = body["data"]["attachment_id"]
    del body
    for step in ("quiesce", "commit-begin", "commit-end", "resume", "detach"):
        status, answer = await post(client, f"/api/weights/{step}", auth)
        assert status == 200, (step, answer)


@pytest.mark.parametrize("attach", [False, True], ids=["attach-off", "attach-on"])
async def test_attach_detach_swap_unload_over_http_frees_everything(
    tmp_path, tiny_model_dir, attach
):
    client = await make_client(tmp_path, tiny_model_dir, attach)
    try:
        host = client.app[keys.HOST]
        ids = {r.name: r.id for r in host.catalogue.list()}
        first = Refs(host.resident)
        assert (first.arena is not None) == attach
        await attach_detach(client, attach)
        chat = {"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}]}
        resp = await client.post("/v1/chat/completions", json={**chat, "max_tokens": 2})
        assert resp.status == 200, await resp.text()
        del resp

        status, body = await post(client, f"/api/models/{ids['tiny-b']}/load")
        assert status == 200, body
        assert first.alive() == []
        second = Refs(host.resident)
        await attach_detach(client, attach)

        status, body = await post(client, f"/api/models/{ids['tiny-b']}/unload")
        assert status == 200, body
        assert host.resident is None
        assert second.alive() == []
    finally:
        await client.close()


def make_adapter(model_dir: str, out: Path) -> Path:
    """A LoRA adapter (q_proj, v_proj) for the tiny model, saved as PEFT does."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    peft_model.save_pretrained(out)
    return out


@pytest.mark.parametrize("then", ["unload", "swap"])
async def test_an_adapter_applied_at_unload_or_swap_keeps_nothing(tmp_path, tiny_model_dir, then):
    adapter = make_adapter(tiny_model_dir, tmp_path / "lora")
    client = await make_client(tmp_path, tiny_model_dir, attach=True)
    try:
        host = client.app[keys.HOST]
        ids = {r.name: r.id for r in host.catalogue.list()}
        resp = await client.post(
            "/api/weights/adapter", json={"name": "tiny-lora", "path": str(adapter)}
        )
        assert resp.status == 200, await resp.text()
        del resp
        refs = Refs(host.resident)
        if then == "unload":
            status, body = await post(client, f"/api/models/{ids['tiny-a']}/unload")
        else:
            status, body = await post(client, f"/api/models/{ids['tiny-b']}/load")
        assert status == 200, body
        assert refs.alive() == []
        resp = await client.get("/api/weights/adapter")
        assert (await resp.json())["data"] == {"applied": False}
        if then == "swap":  # the dropped model's adapter is not removed from the new one
            resp = await client.delete("/api/weights/adapter")
            assert resp.status == 200 and (await resp.json())["data"] == {"applied": False}
            resp = await client.post(
                "/api/weights/adapter", json={"name": "tiny-lora", "path": str(adapter)}
            )
            assert resp.status == 200, await resp.text()
    finally:
        await client.close()


@pytest.mark.parametrize("attach", [False, True], ids=["attach-off", "attach-on"])
async def test_a_weights_load_of_another_model_frees_the_old_one_before_loading(
    tmp_path, tiny_model_dir, attach
):
    # POST /api/weights/load {"model_id"} (contract 5) reloads through the host inside the
    # barrier: the old model must be gone before the new one is read (one copy on the card).
    client = await make_client(tmp_path, tiny_model_dir, attach)
    try:
        host = client.app[keys.HOST]
        ids = {r.name: r.id for r in host.catalogue.list()}
        old = Refs(host.resident)
        alive_at_load: list[list[str]] = []
        real_loader = host._loader

        def loader(row: CatalogueRow, settings: Settings) -> loader_module.LoadedModel:
            alive_at_load.append(old.alive())
            return real_loader(row, settings)

        host._loader = loader
        status, body = await post(
            client,
            "/api/weights/load",
            {"Authorization": f"Bearer {OPS}"},
            {"model_id": ids["tiny-b"]},
        )
        assert status == 200, body
        assert host.resident.row.name == "tiny-b"
        assert alive_at_load == [[]]
        assert old.alive() == []
    finally:
        await client.close()
