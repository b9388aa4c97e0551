"""A checkpoint folder whose save finished (renamed into place) but whose catalogue row was never
written, because the server was killed between the two, is registered at the next start after a
full verification (issue 16, item 3). A folder that does not verify is left, unregistered."""

from __future__ import annotations

from pathlib import Path

import pytest

from miserver.serving.models import checkpoints as ck
from miserver.serving.models.catalogue import CHECKPOINTS_DIR, Catalogue
from tests.unit.model_free_app import model_free_client, model_free_settings
from tests.unit.test_checkpoints import flip_byte_of, tiny_model, tiny_tokenizer

OPS = "operator-secret-0123456789"


def _killed_save(
    home: Path, name: str, base_id: int, parent_sha256: str | None = None
) -> ck.SavedCheckpoint:
    """What a save leaves when the server dies right after the folder's rename."""
    return ck.save_checkpoint(
        tiny_model(),
        tiny_tokenizer(),
        root=home / CHECKPOINTS_DIR,
        name=name,
        base_row_id=base_id,
        base_name="tiny-base",
        parent_sha256=parent_sha256,
        steps_since_load=3,
        now=1_800_000_000.0,
    )


@pytest.fixture
def home(tmp_path) -> Path:
    return tmp_path / "home"


async def _start(tmp_path):
    return await model_free_client(model_free_settings(tmp_path, f"ops:operator:{OPS}"))


async def test_a_complete_unregistered_checkpoint_is_registered_at_start(tmp_path, home) -> None:
    cat = Catalogue(home)
    base = cat.register(
        name="tiny-base", format="safetensors", dtype="bfloat16", path=str(tmp_path)
    )
    saved = _killed_save(home, "run-7-step3", base.id)
    assert cat.get_by_name("run-7-step3") is None  # the row the kill prevented

    client = await _start(tmp_path)
    try:
        rows = (await (await client.get("/api/models")).json())["data"]
        row = next((r for r in rows if r["name"] == "run-7-step3"), None)
        assert row is not None, [r["name"] for r in rows]
        assert row["origin"] == "checkpoint" and row["parent_id"] == base.id
        assert row["checkpoint_sha256"] == saved.checkpoint_sha256
        assert Path(row["path"]) == saved.path.resolve()
        listed = await (await client.get("/api/weights/checkpoints")).json()
        shas = [c["checkpoint_sha256"] for c in listed["data"]["checkpoints"]]
        assert saved.checkpoint_sha256 in shas
    finally:
        await client.close()

    client = await _start(tmp_path)  # a second start registers nothing twice
    try:
        rows = (await (await client.get("/api/models")).json())["data"]
        assert [r["name"] for r in rows].count("run-7-step3") == 1
    finally:
        await client.close()


async def test_an_unregistered_checkpoint_gets_its_manifests_parent(tmp_path, home) -> None:
    """Issue 32, item 1: the row registered at start names the manifest's parent checkpoint
    (trained on top of a loaded checkpoint), as the save would have, not the base row."""
    cat = Catalogue(home)
    base = cat.register(
        name="tiny-base", format="safetensors", dtype="bfloat16", path=str(tmp_path)
    )
    first = _killed_save(home, "run-a", base.id)
    parent = cat.register(
        name="run-a",
        format="safetensors",
        dtype=first.dtype,
        path=str(first.path),
        origin="checkpoint",
        parent_id=base.id,
        checkpoint_sha256=first.checkpoint_sha256,
    )
    _killed_save(home, "run-b", base.id, parent_sha256=first.checkpoint_sha256)
    client = await _start(tmp_path)
    try:
        rows = (await (await client.get("/api/models")).json())["data"]
        assert {r["name"]: r["parent_id"] for r in rows}["run-b"] == parent.id
    finally:
        await client.close()


async def test_a_checkpoint_that_does_not_verify_is_left_unregistered(tmp_path, home) -> None:
    cat = Catalogue(home)
    base = cat.register(
        name="tiny-base", format="safetensors", dtype="bfloat16", path=str(tmp_path)
    )
    saved = _killed_save(home, "damaged", base.id)
    flip_byte_of(saved.path / "model.safetensors", "model.norm.weight")
    client = await _start(tmp_path)
    try:
        rows = (await (await client.get("/api/models")).json())["data"]
        assert "damaged" not in [r["name"] for r in rows]
        assert saved.path.is_dir()  # left for the operator, never deleted
    finally:
        await client.close()
