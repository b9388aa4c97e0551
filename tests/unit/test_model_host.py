"""The model host: auto-load (contract 4), load policy, the one refusal method, residency."""

from __future__ import annotations

from pathlib import Path

import pytest

from miserver.serving.metrics import Metrics
from miserver.serving.models.catalogue import Catalogue
from miserver.serving.models.host import ModelHost, normalize_load_policy
from miserver.spec import codes
from miserver.spec.errors import ApiError
from miserver.spec.settings import Settings


@pytest.fixture
def host(tmp_path: Path, tiny_model_dir: str) -> ModelHost:
    cat = Catalogue(tmp_path)
    base = cat.register(name="base", format="safetensors", dtype="bfloat16", path=tiny_model_dir)
    cat.register(name="other", format="safetensors", dtype="bfloat16", path=tiny_model_dir)
    cat.register(
        name="base-step2-0123abcd",
        format="safetensors",
        dtype="bfloat16",
        path=tiny_model_dir,
        origin="checkpoint",
        parent_id=base.id,
        checkpoint_sha256="0" * 64,
    )
    return ModelHost(Settings(home=str(tmp_path)), cat, metrics=Metrics())


async def test_auto_load_and_serve_by_name(host: ModelHost) -> None:
    assert host.resident is None and not host.serves("base")
    resident = await host.ensure_for_request("base")
    assert (resident.served_name, resident.base_name, resident.origin, resident.commits) == (
        "base",
        "base",
        "model",
        0,
    )
    assert host.serves("base") and not host.serves("other")
    assert await host.ensure_for_request("base") is resident  # no reload
    swapped = await host.ensure_for_request("other")
    assert swapped.row.name == "other" and host.resident is swapped


async def test_checkpoint_row_reports_its_base_name(host: ModelHost) -> None:
    resident = await host.ensure_for_request("base-step2-0123abcd")
    assert (resident.origin, resident.served_name, resident.base_name) == (
        "checkpoint",
        "base-step2-0123abcd",
        "base",
    )
    # both names are served by the resident, without a reload
    assert await host.ensure_for_request("base") is resident


async def test_unknown_name_is_404(host: ModelHost) -> None:
    with pytest.raises(ApiError) as info:
        await host.ensure_for_request("nope")
    assert info.value.code is codes.MODEL_NOT_FOUND and info.value.status == 404
    assert "base" in info.value.details["available"]


async def test_refuse_policy_is_409_and_loads_nothing(host: ModelHost) -> None:
    await host.ensure_for_request("base")
    with pytest.raises(ApiError) as info:
        await host.ensure_for_request("other", "refuse")
    assert info.value.code is codes.MODEL_NOT_LOADED and info.value.status == 409
    assert info.value.details["resident"] == "base"
    assert host.resident.row.name == "base"
    # refuse does not stop serving the resident itself
    assert (await host.ensure_for_request("base", "Refuse")).row.name == "base"


@pytest.mark.parametrize("value", ["never", "", "  "])
def test_load_policy_values(value: str) -> None:
    if value.strip():
        with pytest.raises(ApiError) as info:
            normalize_load_policy(value)
        assert info.value.code is codes.INVALID_REQUEST
        assert info.value.param == "X-miLLM-Load-Policy"
    else:
        assert normalize_load_policy(value) == "auto"
    assert normalize_load_policy(None) == "auto"
    assert normalize_load_policy(" REFUSE ") == "refuse"


async def test_load_metrics_and_unload(host: ModelHost) -> None:
    await host.load(host.resolve("base").id)
    await host.load(host.resolve("other").id)
    row = await host.unload()
    assert row.name == "other" and host.resident is None
    m = host.metrics
    assert m.model_loads.labels(outcome="ok")._value.get() == 2
    assert m.model_unloads._value.get() == 2
    with pytest.raises(ApiError) as info:
        await host.unload()
    assert info.value.code is codes.MODEL_NOT_LOADED


async def test_a_transition_while_one_runs_is_refused_and_changes_nothing(
    tmp_path: Path, tiny_model_dir: str
) -> None:
    import asyncio
    import threading

    from miserver.serving.models.loader import load_model

    cat = Catalogue(tmp_path)
    for name in ("base", "other"):
        cat.register(name=name, format="safetensors", dtype="bfloat16", path=tiny_model_dir)
    release = threading.Event()

    def slow_loader(row, settings):
        if row.name == "other":
            release.wait(30)
        return load_model(row, settings)

    host = ModelHost(Settings(home=str(tmp_path)), cat, loader=slow_loader)
    await host.load(host.resolve("base").id)
    swap = asyncio.create_task(host.load(host.resolve("other").id))
    while not host.busy:
        await asyncio.sleep(0.01)
    for action in (lambda: host.load(host.resolve("base").id), host.unload):
        with pytest.raises(ApiError) as info:
            await action()
        assert info.value.code is codes.MODEL_BUSY and info.value.reason == "model_transition"
    release.set()
    await swap
    assert host.resident.row.name == "other" and not host.busy
