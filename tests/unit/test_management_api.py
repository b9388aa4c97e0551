"""The Management API over real HTTP (contract 2 and 3): every route, bad input, loads and swaps.

Models are real transformers loads of a tiny Llama folder (``tiny_model_dir``), registered twice
under two names so a swap is a real unload + load.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import weakref
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from miserver.http import keys
from miserver.http.app import create_app
from miserver.http.path_privacy import NOT_A_MODEL_FOLDER
from miserver.serving.models.catalogue import Catalogue
from miserver.serving.models.default_model import gguf_path
from miserver.spec.settings import Settings
from tests.waiting import eventually

MAX_BYTES = 4096


@pytest.fixture
def home(tmp_path: Path, tiny_model_dir: str) -> str:
    cat = Catalogue(tmp_path / "home")
    for name in ("tiny-a", "tiny-b"):
        cat.register(name=name, format="safetensors", dtype="bfloat16", path=tiny_model_dir)
    cat.register(
        name="tiny-q4", format="gguf", dtype="float32", quantization="gguf", path=str(gguf_path())
    )
    return str(tmp_path / "home")


def make_app(home: str, **settings: Any) -> web.Application:
    values = {
        "home": home,
        "default_model": "",
        "max_request_bytes": MAX_BYTES,
        "log_format": "text",
    } | settings
    return create_app(Settings(**values))


@pytest.fixture
async def client(home: str):
    app = make_app(home)
    async with TestClient(TestServer(app)) as c:
        yield c


async def call(
    client: TestClient,
    method: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    status: int = 200,
) -> dict:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    resp = await client.request(method, path, data=data)
    assert resp.content_type == "application/json", (resp.status, await resp.text())
    payload = await resp.json()
    assert resp.status == status, payload
    assert set(payload) == {"success", "data", "error"}
    assert payload["success"] is (status < 400)
    return payload


def error(payload: dict) -> dict:
    assert payload["data"] is None
    return payload["error"]


def catalogue_of(client: TestClient) -> Catalogue:
    return client.app[keys.CATALOGUE]


def rows_by_name(client: TestClient) -> dict[str, int]:
    return {r.name: r.id for r in catalogue_of(client).list()}


# --- catalogue routes --------------------------------------------------------------------------
async def test_list_and_get(client: TestClient) -> None:
    listed = (await call(client, "GET", "/api/models"))["data"]
    assert [r["name"] for r in listed] == ["tiny-a", "tiny-b", "tiny-q4"]
    assert all(r["resident"] is False for r in listed)
    one = (await call(client, "GET", f"/api/models/{listed[2]['id']}"))["data"]
    assert one == listed[2]
    assert (one["format"], one["quantization"]) == ("gguf", "gguf")


@pytest.mark.parametrize(
    "path",
    [
        "/api/models/999",
        "/api/models/abc",
        "/api/models/-1",
        "/api/models/999/load",
        "/api/models/999/unload",
    ],
)
async def test_unknown_id_is_404_model_not_found(client: TestClient, path: str) -> None:
    method = "POST" if path.endswith(("load", "unload")) else "GET"
    err = error(await call(client, method, path, status=404))
    assert err["code"] == "MODEL_NOT_FOUND"


async def test_delete_unknown_id_is_404(client: TestClient) -> None:
    assert (
        error(await call(client, "DELETE", "/api/models/999", status=404))["code"]
        == "MODEL_NOT_FOUND"
    )


async def test_register_a_folder_detects_dtype(client: TestClient, tiny_model_dir: str) -> None:
    row = (
        await call(
            client, "POST", "/api/models", {"name": "mine", "path": tiny_model_dir}, status=201
        )
    )["data"]
    assert (row["name"], row["format"], row["dtype"], row["quantization"], row["origin"]) == (
        "mine",
        "safetensors",
        "bfloat16",
        "none",
        "model",
    )
    assert row["path"] == str(Path(tiny_model_dir).resolve())
    assert (await call(client, "GET", f"/api/models/{row['id']}"))["data"] == row


async def test_register_a_folder_with_explicit_dtype(
    client: TestClient, tiny_model_dir: str
) -> None:
    row = (
        await call(
            client,
            "POST",
            "/api/models",
            {"name": "as-fp32", "path": tiny_model_dir, "dtype": "float32", "quantization": "none"},
            status=201,
        )
    )["data"]
    assert row["dtype"] == "float32"


async def test_register_a_gguf_file(client: TestClient) -> None:
    row = (
        await call(
            client,
            "POST",
            "/api/models",
            {"name": "q4-again", "path": str(gguf_path())},
            status=201,
        )
    )["data"]
    assert (row["format"], row["quantization"]) == ("gguf", "gguf")


async def test_register_duplicate_name_is_409(client: TestClient, tiny_model_dir: str) -> None:
    before = rows_by_name(client)
    err = error(
        await call(
            client, "POST", "/api/models", {"name": "tiny-a", "path": tiny_model_dir}, status=409
        )
    )
    assert err["code"] == "MODEL_EXISTS"
    assert err["details"]["model_id"] == before["tiny-a"]
    assert rows_by_name(client) == before


def _bad_paths(tmp: Path, tiny: str) -> dict[str, tuple[str, str]]:
    no_config = tmp / "no-config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes(b"x")
    no_weights = tmp / "no-weights"
    no_weights.mkdir()
    shutil.copy(Path(tiny) / "config.json", no_weights / "config.json")
    not_gguf = tmp / "weights.bin"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    bad_config = tmp / "bad-config"
    bad_config.mkdir()
    (bad_config / "config.json").write_text("[1, 2")
    (bad_config / "model.safetensors").write_bytes(b"x")
    return {
        "missing": (str(tmp / "does-not-exist"), "does not exist"),
        "relative": ("models/x", "absolute"),
        "empty": ("", "non-empty"),
        "no config.json": (str(no_config), "config.json"),
        "no safetensors": (str(no_weights), "safetensors"),
        "not a gguf file": (str(not_gguf), "GGUF"),
        "broken config": (str(bad_config), "JSON"),
    }


async def test_register_bad_paths_are_400_naming_path(
    client: TestClient, tmp_path: Path, tiny_model_dir: str
) -> None:
    before = rows_by_name(client)
    for label, (path, words) in _bad_paths(tmp_path, tiny_model_dir).items():
        err = error(
            await call(client, "POST", "/api/models", {"name": "x", "path": path}, status=400)
        )
        assert err["code"] == "INVALID_REQUEST", label
        assert err["details"] == {"field": "path"}, label
        if label in ("relative", "empty"):  # the string alone: told to anyone
            assert words in err["message"], (label, err["message"])
        else:  # issue 32, item 13: an anonymous caller learns nothing of the server's files
            assert err["message"] == NOT_A_MODEL_FOLDER, (label, err["message"])
    assert rows_by_name(client) == before


@pytest.mark.parametrize(
    "body,field",
    [
        ({"name": 1, "path": "/x"}, "name"),
        ({"name": "x", "path": ["/x"]}, "path"),
        ({"name": "x"}, "path"),
        ({"path": "/x"}, "name"),
        ({"name": "x", "path": "/x", "dtype": "int4"}, "dtype"),
        ({"name": "x", "path": "/x", "quantization": "fp8"}, "quantization"),
        ({"name": "x", "path": "/x", "dtype": True}, "dtype"),
        ({"name": "x", "path": "/x", "revision": "main"}, "revision"),
        ({"name": "bad name!", "path": "/x"}, "name"),
    ],
)
async def test_register_invalid_fields_are_400_naming_the_field(
    client: TestClient, body: dict, field: str
) -> None:
    before = rows_by_name(client)
    err = error(await call(client, "POST", "/api/models", body, status=400))
    assert err["code"] == "INVALID_REQUEST"
    assert err["details"] == {"field": field}
    assert field in err["message"]
    assert rows_by_name(client) == before


async def test_register_quantization_must_match_the_folder(
    client: TestClient, tiny_model_dir: str
) -> None:
    err = error(
        await call(
            client,
            "POST",
            "/api/models",
            {"name": "x", "path": tiny_model_dir, "quantization": "gptq"},
            status=400,
        )
    )
    assert err["details"] == {"field": "quantization"}
    err = error(
        await call(
            client,
            "POST",
            "/api/models",
            {"name": "x", "path": str(gguf_path()), "quantization": "none"},
            status=400,
        )
    )
    assert err["details"] == {"field": "quantization"}


@pytest.mark.parametrize("raw", [b"[]", b'"text"', b"42", b"null", b"{not json", b"", b"   "])
async def test_body_that_is_not_a_json_object_is_400(client: TestClient, raw: bytes) -> None:
    err = error(await call(client, "POST", "/api/models", raw=raw, status=400))
    assert err["code"] == "INVALID_REQUEST"
    assert "JSON" in err["message"]
    assert "not json" not in err["message"]  # the message never repeats the body


async def test_delete_a_row(client: TestClient) -> None:
    ids = rows_by_name(client)
    data = (await call(client, "DELETE", f"/api/models/{ids['tiny-b']}"))["data"]
    assert data == {"id": ids["tiny-b"], "name": "tiny-b", "deleted": True}
    assert "tiny-b" not in rows_by_name(client)
    await call(client, "GET", f"/api/models/{ids['tiny-b']}", status=404)


# --- loads, unloads, swaps ---------------------------------------------------------------------
async def test_load_unload_cycle(client: TestClient) -> None:
    ids = rows_by_name(client)
    data = (await call(client, "POST", f"/api/models/{ids['tiny-a']}/load"))["data"]
    assert data["already_resident"] is False
    assert data["model"]["resident"] is True
    assert data["resident"]["name"] == "tiny-a" and data["resident"]["device"] == "cpu"
    listed = (await call(client, "GET", "/api/models"))["data"]
    assert [r["resident"] for r in listed] == [True, False, False]
    host = client.app[keys.HOST]
    model = host.resident.model
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {__import__("torch").bfloat16}

    again = (await call(client, "POST", f"/api/models/{ids['tiny-a']}/load"))["data"]
    assert again["already_resident"] is True
    assert host.resident.model is model  # a no-op: nothing reloaded

    err = error(await call(client, "DELETE", f"/api/models/{ids['tiny-a']}", status=409))
    assert err["code"] == "MODEL_RESIDENT"
    assert "tiny-a" in rows_by_name(client)

    err = error(await call(client, "POST", f"/api/models/{ids['tiny-b']}/unload", status=409))
    assert err["code"] == "MODEL_NOT_LOADED"
    assert host.resident is not None

    data = (await call(client, "POST", f"/api/models/{ids['tiny-a']}/unload"))["data"]
    assert data["model"]["resident"] is False and data["resident"] is None
    assert host.resident is None
    err = error(await call(client, "POST", f"/api/models/{ids['tiny-a']}/unload", status=409))
    assert err["code"] == "MODEL_NOT_LOADED"
    await call(client, "DELETE", f"/api/models/{ids['tiny-a']}")


async def test_swap_frees_the_previous_model(client: TestClient) -> None:
    ids = rows_by_name(client)
    host = client.app[keys.HOST]
    await call(client, "POST", f"/api/models/{ids['tiny-a']}/load")
    old = weakref.ref(host.resident.model)
    old_param = weakref.ref(next(host.resident.model.parameters()))
    data = (await call(client, "POST", f"/api/models/{ids['tiny-b']}/load"))["data"]
    assert data["resident"]["name"] == "tiny-b"
    gc.collect()
    assert old() is None and old_param() is None
    listed = (await call(client, "GET", "/api/models"))["data"]
    assert [r["resident"] for r in listed] == [False, True, False]


async def test_two_concurrent_loads_one_is_model_busy(client: TestClient) -> None:
    ids = rows_by_name(client)
    results = await asyncio.gather(
        client.post(f"/api/models/{ids['tiny-a']}/load"),
        client.post(f"/api/models/{ids['tiny-b']}/load"),
    )
    statuses = sorted(r.status for r in results)
    assert statuses == [200, 409]
    refused = next(r for r in results if r.status == 409)
    body = await refused.json()
    assert (body["error"]["code"], body["error"]["reason"]) == ("MODEL_BUSY", "model_transition")
    winner = next(r for r in results if r.status == 200)
    name = (await winner.json())["data"]["resident"]["name"]
    assert client.app[keys.HOST].resident.row.name == name


async def test_delete_and_unload_while_loading_are_model_busy(client: TestClient) -> None:
    ids = rows_by_name(client)
    load = asyncio.ensure_future(client.post(f"/api/models/{ids['tiny-a']}/load"))
    host = client.app[keys.HOST]
    await eventually(lambda: host.busy, "the load began")
    err = error(await call(client, "DELETE", f"/api/models/{ids['tiny-b']}", status=409))
    assert (err["code"], err["reason"]) == ("MODEL_BUSY", "model_transition")
    detailed = (await call(client, "GET", "/api/health/detailed"))["data"]
    assert detailed["transition"] == "load"
    assert (await load).status == 200
    assert not host.busy


async def test_gguf_load_without_the_binding_is_backend_unavailable_and_keeps_the_resident(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from miserver.serving.models import gguf

    ids = rows_by_name(client)
    await call(client, "POST", f"/api/models/{ids['tiny-a']}/load")
    monkeypatch.setattr(gguf, "binding_available", lambda: False)
    err = error(await call(client, "POST", f"/api/models/{ids['tiny-q4']}/load", status=400))
    assert (err["code"], err["reason"]) == ("BACKEND_UNAVAILABLE", "gguf")
    assert "-m pip install xllamacpp" in err["message"]
    assert client.app[keys.HOST].resident.row.name == "tiny-a"


async def test_a_damaged_gguf_file_is_model_load_failed_and_keeps_the_resident(
    client: TestClient, tmp_path: Path
) -> None:
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(Path(gguf_path()).read_bytes()[:300_000])  # cut short
    row = client.app[keys.CATALOGUE].register(
        name="damaged-q4", format="gguf", dtype="float32", quantization="gguf", path=str(damaged)
    )
    ids = rows_by_name(client)
    await call(client, "POST", f"/api/models/{ids['tiny-a']}/load")
    err = error(await call(client, "POST", f"/api/models/{row.id}/load", status=400))
    assert err["code"] == "MODEL_LOAD_FAILED"
    assert "not a readable GGUF file" in err["message"] and "nothing was unloaded" in err["message"]
    assert client.app[keys.HOST].resident.row.name == "tiny-a"
    served = await client.post(
        "/v1/completions", json={"model": "tiny-a", "prompt": "a", "max_tokens": 2}
    )
    assert served.status == 200, await served.text()


async def test_load_of_vanished_files_is_a_json_error_and_keeps_the_resident(
    client: TestClient, tmp_path: Path, tiny_model_dir: str
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    row = (
        await call(client, "POST", "/api/models", {"name": "gone", "path": str(copy)}, status=201)
    )["data"]
    ids = rows_by_name(client)
    await call(client, "POST", f"/api/models/{ids['tiny-a']}/load")
    shutil.rmtree(copy)
    err = error(await call(client, "POST", f"/api/models/{row['id']}/load", status=500))
    assert err["code"] == "MODEL_LOAD_FAILED"
    assert client.app[keys.HOST].resident.row.name == "tiny-a"


async def test_load_of_corrupt_weights_is_a_json_error(
    client: TestClient, tmp_path: Path, tiny_model_dir: str
) -> None:
    copy = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, copy)
    (copy / "model.safetensors").write_bytes(b"\x00" * 64)
    # Registration refuses it now (breaker finding F16) ...
    err = error(
        await call(
            client, "POST", "/api/models", {"name": "corrupt", "path": str(copy)}, status=400
        )
    )
    # (an anonymous caller is told only that it is not a model folder: issue 32, item 13)
    assert err["code"] == "INVALID_REQUEST" and err["message"] == NOT_A_MODEL_FOLDER
    # ... and a row whose folder was damaged after it was registered is refused at its load,
    # before the resident is dropped
    host = client.app[keys.HOST]
    await call(client, "POST", f"/api/models/{rows_by_name(client)['tiny-a']}/load")
    resident = host.resident
    assert resident is not None
    row = client.app[keys.CATALOGUE].register(
        name="corrupt", format="safetensors", dtype="bfloat16", path=str(copy)
    )
    err = error(await call(client, "POST", f"/api/models/{row.id}/load", status=400))
    assert err["code"] == "MODEL_LOAD_FAILED"
    assert "corrupt" in err["message"]
    assert host.resident is resident and not host.busy
    # the server still loads other rows afterwards
    await call(client, "POST", f"/api/models/{rows_by_name(client)['tiny-b']}/load")


# --- settings -----------------------------------------------------------------------------------
async def test_settings_get_and_patch(client: TestClient) -> None:
    data = (await call(client, "GET", "/api/settings"))["data"]
    assert data == {
        "max_concurrent_requests": 1,
        "continuous_batching": False,
        "max_queued_requests": 64,
    }
    data = (
        await call(
            client,
            "PATCH",
            "/api/settings",
            {"max_concurrent_requests": 3, "max_queued_requests": 5},
        )
    )["data"]
    assert (data["max_concurrent_requests"], data["max_queued_requests"]) == (3, 5)
    scheduler = client.app[keys.SCHEDULER]
    assert (scheduler.max_concurrent, scheduler.max_queued) == (3, 5)
    data = (await call(client, "PATCH", "/api/settings", {"continuous_batching": False}))["data"]
    assert data["max_concurrent_requests"] == 3
    assert (await call(client, "GET", "/api/settings"))["data"] == data


@pytest.mark.parametrize(
    "body,field",
    [
        ({"max_concurrent_requests": True}, "max_concurrent_requests"),
        ({"max_concurrent_requests": "2"}, "max_concurrent_requests"),
        ({"max_concurrent_requests": 0}, "max_concurrent_requests"),
        ({"max_concurrent_requests": 1.5}, "max_concurrent_requests"),
        ({"max_queued_requests": -1}, "max_queued_requests"),
        ({"continuous_batching": 1}, "continuous_batching"),
        ({"continuous_batching": None}, "continuous_batching"),
        ({"MAX_CONCURRENT_REQUESTS": 2}, "MAX_CONCURRENT_REQUESTS"),
        ({"max_concurrent_requests": 2, "turbo": True}, "turbo"),
    ],
)
async def test_settings_patch_refusals_change_nothing(
    client: TestClient, body: dict, field: str
) -> None:
    err = error(await call(client, "PATCH", "/api/settings", body, status=400))
    assert err["code"] == "INVALID_REQUEST"
    assert err["details"] == {"field": field}
    assert (await call(client, "GET", "/api/settings"))["data"]["max_concurrent_requests"] == 1


async def test_settings_patch_hint_for_upper_case_names(client: TestClient) -> None:
    err = error(
        await call(client, "PATCH", "/api/settings", {"MAX_QUEUED_REQUESTS": 2}, status=400)
    )
    assert "max_queued_requests" in err["message"]


async def test_continuous_batching_by_patch_is_the_weights_pages_cbm(client: TestClient) -> None:
    data = (await call(client, "PATCH", "/api/settings", {"continuous_batching": True}))["data"]
    assert data["continuous_batching"] is True
    assert (await call(client, "GET", "/api/settings"))["data"]["continuous_batching"] is True
    status = (await call(client, "GET", "/api/weights/status"))["data"]
    assert status["pause_unavailable"] == "cbm"
    # cbm wins over concurrency while both are set (the lifecycle's one record)
    data = (await call(client, "PATCH", "/api/settings", {"max_concurrent_requests": 2}))["data"]
    assert (data["continuous_batching"], data["max_concurrent_requests"]) == (True, 2)
    assert (await call(client, "GET", "/api/weights/status"))["data"]["pause_unavailable"] == "cbm"
    data = (await call(client, "PATCH", "/api/settings", {"continuous_batching": False}))["data"]
    assert data["continuous_batching"] is False
    status = (await call(client, "GET", "/api/weights/status"))["data"]
    assert status["pause_unavailable"] == "concurrency"
    await call(client, "PATCH", "/api/settings", {"max_concurrent_requests": 1})
    assert (await call(client, "GET", "/api/weights/status"))["data"]["pause_unavailable"] is None


# --- health, metrics ---------------------------------------------------------------------------
async def test_health(client: TestClient) -> None:
    assert (await call(client, "GET", "/api/health"))["data"] == {"status": "ok"}


async def test_health_detailed(client: TestClient) -> None:
    data = (await call(client, "GET", "/api/health/detailed"))["data"]
    assert data["resident"] is None and data["transition"] is None
    assert data["device"] == "cpu"
    assert data["queue"] == {
        "running": 0,
        "queued": 0,
        "held_requests": 0,
        "held_batch_chunks": 0,
        "max_concurrent_requests": 1,
        "max_queued_requests": 64,
    }
    assert data["weights"] == {
        "weights_state": "clean",
        "barrier": "serving",
        "attached": False,
        "attachment_state": None,
    }
    await call(client, "POST", f"/api/models/{rows_by_name(client)['tiny-b']}/load")
    data = (await call(client, "GET", "/api/health/detailed"))["data"]
    assert data["resident"]["name"] == "tiny-b"
    assert data["resident"]["served_name"] == "tiny-b"
    assert data["resident"]["origin"] == "model"


async def test_health_detailed_weights_block(home: str) -> None:
    summary = {
        "weights_state": "clean",
        "barrier": "serving",
        "attached": False,
        "attachment_state": None,
    }

    def broken() -> dict:
        raise RuntimeError("lifecycle unavailable")

    for provider, expected in (
        (lambda: summary, summary),
        (broken, {"error": "RuntimeError: lifecycle unavailable"}),
    ):
        app = make_app(home)
        app[keys.WEIGHTS_SUMMARY] = provider
        async with TestClient(TestServer(app)) as c:
            data = (await call(c, "GET", "/api/health/detailed"))["data"]
            assert data["weights"] == expected


async def test_metrics_prometheus_text(client: TestClient) -> None:
    await call(client, "POST", f"/api/models/{rows_by_name(client)['tiny-a']}/load")
    await call(client, "POST", "/api/models/999/load", status=404)
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    text = await resp.text()
    assert 'miserver_model_loads_total{outcome="ok"} 1.0' in text
    assert 'miserver_model_resident{name="tiny-a"} 1.0' in text
    assert "miserver_queue_depth 0.0" in text
    assert "miserver_request_latency_seconds" in text


async def test_each_app_has_its_own_registry(home: str) -> None:
    a, b = make_app(home), make_app(home)
    a[keys.METRICS].model_unloads.inc()
    assert b[keys.METRICS].model_unloads._value.get() == 0


# --- the app: JSON errors and body limits --------------------------------------------------------
async def test_oversized_body_is_413_json_before_reading(client: TestClient) -> None:
    before = rows_by_name(client)
    err = error(
        await call(
            client, "POST", "/api/models", raw=b'{"name": "' + b"x" * MAX_BYTES + b'"}', status=413
        )
    )
    assert err["code"] == "PAYLOAD_TOO_LARGE"
    assert err["details"]["max_request_bytes"] == MAX_BYTES
    assert rows_by_name(client) == before


async def test_oversized_chunked_body_is_413_json(client: TestClient) -> None:
    async def chunks():
        for _ in range(4):
            yield b"x" * MAX_BYTES

    resp = await client.post("/api/models", data=chunks())
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == "PAYLOAD_TOO_LARGE"


async def test_unknown_route_and_wrong_method_are_json(client: TestClient) -> None:
    err = error(await call(client, "GET", "/api/nothing-here", status=404))
    assert err["code"] == "NOT_FOUND"
    resp = await client.put("/api/models")
    assert resp.status == 405
    assert "GET" in resp.headers["Allow"] and "POST" in resp.headers["Allow"]
    assert (await resp.json())["error"]["code"] == "METHOD_NOT_ALLOWED"
    err = error(await call(client, "PUT", "/api/settings", {}, status=405))
    assert err["code"] == "METHOD_NOT_ALLOWED"


# --- start-up -----------------------------------------------------------------------------------
async def test_startup_loads_default_model(home: str) -> None:
    app = make_app(home, default_model="tiny-b")
    async with TestClient(TestServer(app)) as c:
        assert (await call(c, "GET", "/api/health"))["data"]["status"] == "ok"
        await app[keys.STARTUP_LOAD]
        assert app[keys.HOST].resident.row.name == "tiny-b"
    assert app[keys.HOST].resident is None  # cleanup unloads


async def test_startup_with_an_unknown_default_serves_nothing(
    home: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(home, default_model="no-such-model")
    async with TestClient(TestServer(app)) as c:
        await app[keys.STARTUP_LOAD]
        assert app[keys.HOST].resident is None
        assert (await call(c, "GET", "/api/health/detailed"))["data"]["resident"] is None
    assert "no-such-model" in caplog.text
