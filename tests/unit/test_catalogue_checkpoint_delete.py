"""What deleting a checkpoint row does to its folder (contract 5; docs/decisions.md): finding 15
of the adversarial trial of 2026-11-30 (a deleted checkpoint's name stayed blocked by its folder).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miserver.serving.models import checkpoints
from miserver.serving.models.catalogue import (
    CHECKPOINTS_DIR,
    DELETING_PREFIX,
    Catalogue,
    CatalogueError,
)


@pytest.fixture
def catalogue(tmp_path: Path) -> Catalogue:
    cat = Catalogue(tmp_path / "home")
    cat.register(name="base", format="safetensors", dtype="bfloat16", path=tmp_path / "base")
    return cat


def checkpoint_folder(cat: Catalogue, name: str) -> Path:
    folder = cat.home / CHECKPOINTS_DIR / name
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"x" * 64)
    (folder / "manifest.json").write_text("{}")
    return folder


def register_checkpoint(cat: Catalogue, name: str, path: Path) -> int:
    row = cat.register(
        name=name,
        format="safetensors",
        dtype="bfloat16",
        path=path,
        origin="checkpoint",
        parent_id=1,
        checkpoint_sha256="0" * 64,
    )
    return row.id


def test_deleting_a_checkpoint_row_removes_its_folder(catalogue):
    folder = checkpoint_folder(catalogue, "ck")
    row_id = register_checkpoint(catalogue, "ck", folder)

    assert catalogue.delete(row_id) is True

    assert not folder.exists()
    assert list((catalogue.home / CHECKPOINTS_DIR).iterdir()) == []  # no .deleting-* left
    assert catalogue.get_by_name("ck") is None


def test_deleting_a_model_row_keeps_its_files(catalogue, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    row = catalogue.register(name="mine", format="safetensors", dtype="bfloat16", path=folder)
    assert catalogue.delete(row.id) is True
    assert (folder / "config.json").is_file()


def test_a_checkpoint_row_outside_the_checkpoints_folder_keeps_its_files(catalogue, tmp_path):
    folder = tmp_path / "elsewhere" / "ck"
    folder.mkdir(parents=True)
    row_id = register_checkpoint(catalogue, "ck", folder)
    assert catalogue.delete(row_id) is True
    assert folder.is_dir()


def test_a_checkpoint_folder_another_row_names_is_kept(catalogue):
    folder = checkpoint_folder(catalogue, "ck")
    row_id = register_checkpoint(catalogue, "ck", folder)
    catalogue.register(name="ck-as-model", format="safetensors", dtype="bfloat16", path=folder)
    assert catalogue.delete(row_id) is True
    assert (folder / "model.safetensors").is_file()


def test_a_resident_checkpoint_row_and_its_folder_stay(catalogue):
    folder = checkpoint_folder(catalogue, "ck")
    row_id = register_checkpoint(catalogue, "ck", folder)
    catalogue.set_resident(row_id)
    with pytest.raises(CatalogueError):
        catalogue.delete(row_id)
    assert folder.is_dir() and catalogue.get(row_id) is not None


def test_start_up_removes_a_deleted_checkpoints_leftover(catalogue):
    root = catalogue.home / CHECKPOINTS_DIR
    leftover = root / f"{DELETING_PREFIX}ck-0a1b2c3d"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"x")
    kept = checkpoint_folder(catalogue, "kept")
    assert checkpoints.remove_partial_saves(root) == [leftover]
    assert not leftover.exists() and kept.is_dir()
