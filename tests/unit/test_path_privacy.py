"""Issue 32, item 13: in the open mode, ``POST /api/models`` and ``POST /api/weights/adapter``
tell a caller without an operator token only that a path is not a model folder, never which
server paths exist, are files, folders, unreadable or symlink loops; an operator token (and
every caller with ``MANAGEMENT_AUTH=operator``, where only operators get through) is told why.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from miserver.http.path_privacy import NOT_A_MODEL_FOLDER
from tests.unit.model_free_app import model_free_client, model_free_settings
from tests.unit.test_weights_routes import OPS, TRN, make_client

OPS_FREE = "operator-secret-0123456789"
TRN_FREE = "trainer-secret-0123456789"
TOKENS = f"trn:trainer:{TRN_FREE},ops:operator:{OPS_FREE}"


def server_paths(tmp: Path) -> dict[str, str]:
    """Paths that differ on the server: what an anonymous caller must not tell apart."""
    folder = tmp / "a-folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("x")
    afile = tmp / "a-file.bin"
    afile.write_bytes(b"PK\x03\x04")
    loop = tmp / "loop"
    os.symlink(loop, loop)
    return {
        "missing": str(tmp / "nothing-here"),
        "folder": str(folder),
        "file": str(afile),
        "loop": str(loop),
        "root": "/",
    }


@pytest.fixture
async def open_client(tmp_path):
    c = await model_free_client(model_free_settings(tmp_path, TOKENS))
    yield c
    await c.close()


async def _register(client, path: str, headers=None) -> tuple[int, str]:
    resp = await client.post("/api/models", json={"name": "m", "path": path}, headers=headers)
    return resp.status, await resp.text()


async def test_an_anonymous_caller_cannot_tell_server_paths_apart(open_client, tmp_path):
    paths = server_paths(tmp_path)
    bodies = set()
    for label, path in paths.items():
        for headers in (None, {"Authorization": f"Bearer {TRN_FREE}"}):
            status, text = await _register(open_client, path, headers)
            assert status == 400, (label, text)
            err = json.loads(text)["error"]
            assert err["code"] == "INVALID_REQUEST" and err["message"] == NOT_A_MODEL_FOLDER
            assert str(tmp_path) not in text, (label, text)
            bodies.add(json.dumps(err, sort_keys=True))
    assert len(bodies) == 1  # one answer for every path
    status, text = await _register(open_client, "relative/path")
    assert status == 400 and "absolute" in text  # the string alone: told to anyone


async def test_an_operator_token_is_told_why(open_client, tmp_path):
    paths = server_paths(tmp_path)
    ops = {"Authorization": f"Bearer {OPS_FREE}"}
    words = {
        "missing": "does not exist",
        "folder": "config.json",
        "file": "GGUF",
        "loop": "symlink loop",
        "root": "config.json",
    }
    for label, path in paths.items():
        status, text = await _register(open_client, path, ops)
        assert status == 400 and words[label] in text, (label, text)


async def test_operator_mode_tells_the_operator_why(tmp_path):
    c = await model_free_client(model_free_settings(tmp_path, TOKENS, MANAGEMENT_AUTH="operator"))
    try:
        missing = str(tmp_path / "nothing-here")
        status, text = await _register(c, missing, {"Authorization": f"Bearer {OPS_FREE}"})
        assert status == 400 and "does not exist" in text
    finally:
        await c.close()


async def test_the_adapter_route_without_a_resident_hides_a_symlink_loop(open_client, tmp_path):
    loop = server_paths(tmp_path)["loop"]
    resp = await open_client.post("/api/weights/adapter", json={"name": "a", "path": loop})
    text = await resp.text()
    assert resp.status == 400 and NOT_A_MODEL_FOLDER in text and "loop" not in text.lower()
    resp = await open_client.post(
        "/api/weights/adapter",
        json={"name": "a", "path": loop},
        headers={"Authorization": f"Bearer {OPS_FREE}"},
    )
    assert resp.status == 400 and "symlink loop" in await resp.text()


async def test_the_adapter_route_hides_what_a_folder_holds(tmp_path, tiny_model_dir):
    client = await make_client(tmp_path, tiny_model_dir)
    try:
        (tmp_path / "paths").mkdir()
        paths = server_paths(tmp_path / "paths")
        paths["a model, not an adapter"] = tiny_model_dir
        seen = set()
        for label, path in paths.items():
            for headers in (None, {"Authorization": f"Bearer {TRN}"}):
                resp = await client.post(
                    "/api/weights/adapter", json={"name": "a", "path": path}, headers=headers
                )
                text = await resp.text()
                assert resp.status == 400, (label, text)
                err = json.loads(text)["error"]
                assert err["message"] == NOT_A_MODEL_FOLDER, (label, err)
                assert path not in text or path == "/", (label, text)
                seen.add((err["code"], err.get("reason")))
        # two answers only: a path the server may not look at (a loop) and "no adapter there"
        assert seen <= {("INVALID_REQUEST", None), ("ADAPTER_INVALID", "not_found")}, seen
        resp = await client.post(
            "/api/weights/adapter",
            json={"name": "a", "path": paths["folder"]},
            headers={"Authorization": f"Bearer {OPS}"},
        )
        err = (await resp.json())["error"]
        assert resp.status == 400 and err["reason"] == "no_config", err
    finally:
        await client.close()
