"""The SQLite catalogue (contract 3): rows, validation, residency, persistence, threads."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import msgspec
import pytest

from miserver.serving.models.catalogue import (
    Catalogue,
    CatalogueError,
    CatalogueRow,
    DuplicateName,
)


@pytest.fixture
def cat(tmp_path: Path) -> Catalogue:
    return Catalogue(tmp_path / "home")


def _model(cat: Catalogue, name: str = "m", **kw) -> CatalogueRow:
    args = {"format": "safetensors", "dtype": "bfloat16", "path": "/models/m"} | kw
    return cat.register(name=name, **args)


def test_database_lives_in_home(tmp_path: Path) -> None:
    Catalogue(tmp_path / "h")
    assert (tmp_path / "h" / "catalogue.sqlite3").is_file()


def test_register_returns_the_full_row(cat: Catalogue) -> None:
    row = _model(cat, "llama", path="/models/llama")
    assert row.id >= 1
    assert (row.name, row.format, row.dtype, row.quantization, row.path, row.origin) == (
        "llama",
        "safetensors",
        "bfloat16",
        "none",
        "/models/llama",
        "model",
    )
    assert row.parent_id is None and row.checkpoint_sha256 is None and row.resident is False
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", row.created_at)
    assert cat.get(row.id) == row
    assert cat.get_by_name("llama") == row


def test_row_wire_shape_is_the_contracts(cat: Catalogue) -> None:
    row = _model(cat)
    assert list(msgspec.to_builtins(row)) == [
        "id",
        "name",
        "format",
        "dtype",
        "quantization",
        "path",
        "origin",
        "parent_id",
        "checkpoint_sha256",
        "created_at",
        "resident",
    ]


def test_list_is_ordered_by_id(cat: Catalogue) -> None:
    ids = [_model(cat, f"m{i}").id for i in range(5)]
    assert [r.id for r in cat.list()] == sorted(ids)
    assert not cat.is_empty()


def test_unknown_id_and_name_are_none(cat: Catalogue) -> None:
    assert cat.get(12345) is None
    assert cat.get_by_name("nope") is None
    assert cat.is_empty()


def test_duplicate_name_is_refused_and_changes_nothing(cat: Catalogue) -> None:
    first = _model(cat, "dup")
    with pytest.raises(DuplicateName) as info:
        _model(cat, "dup", path="/elsewhere")
    assert info.value.existing_id == first.id
    assert cat.list() == [first]


@pytest.mark.parametrize(
    "field,value",
    [
        ("format", "pickle"),
        ("dtype", "int8"),
        ("quantization", "fp8"),
        ("origin", "adapter"),
    ],
)
def test_values_outside_the_contract_are_refused(cat: Catalogue, field: str, value: str) -> None:
    with pytest.raises(CatalogueError, match=field):
        _model(cat, "bad", **{field: value})
    assert cat.is_empty()


@pytest.mark.parametrize("name", ["", " padded", "padded "])
def test_bad_names_are_refused(cat: Catalogue, name: str) -> None:
    with pytest.raises(CatalogueError):
        _model(cat, name)
    assert cat.is_empty()


def test_checkpoint_rows_name_an_existing_parent(cat: Catalogue) -> None:
    base = _model(cat, "base")
    ckpt = cat.register(
        name="base-step3-abcdef01",
        format="safetensors",
        dtype="bfloat16",
        path="/ck",
        origin="checkpoint",
        parent_id=base.id,
        checkpoint_sha256="ab" * 32,
    )
    assert (ckpt.origin, ckpt.parent_id, ckpt.checkpoint_sha256) == (
        "checkpoint",
        base.id,
        "ab" * 32,
    )
    with pytest.raises(CatalogueError, match="parent_id"):
        cat.register(
            name="orphan",
            format="safetensors",
            dtype="bfloat16",
            path="/x",
            origin="checkpoint",
            parent_id=999,
        )
    assert cat.get_by_name("orphan") is None


def test_delete(cat: Catalogue) -> None:
    row = _model(cat)
    assert cat.delete(row.id) is True
    assert cat.get(row.id) is None
    assert cat.delete(row.id) is False


def test_resident_is_reflected_and_blocks_delete(cat: Catalogue) -> None:
    a, b = _model(cat, "a"), _model(cat, "b")
    cat.set_resident(b.id)
    assert cat.resident_id == b.id
    assert [r.resident for r in cat.list()] == [False, True]
    assert cat.get(b.id).resident and cat.get_by_name("b").resident
    with pytest.raises(CatalogueError, match="resident"):
        cat.delete(b.id)
    assert cat.get(b.id) is not None
    cat.set_resident(None)
    assert not any(r.resident for r in cat.list())
    assert cat.delete(a.id)


def test_rows_persist_and_residency_does_not(tmp_path: Path) -> None:
    first = Catalogue(tmp_path)
    row = _model(first, "kept")
    first.set_resident(row.id)
    second = Catalogue(tmp_path)  # a restart: same rows, nothing resident
    assert [r.name for r in second.list()] == ["kept"]
    assert second.get(row.id).resident is False


def test_ids_are_not_reused_after_delete(cat: Catalogue) -> None:
    a = _model(cat, "a")
    cat.delete(a.id)
    assert _model(cat, "b").id > a.id


def test_concurrent_registers_from_threads(cat: Catalogue) -> None:
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(15):
                _model(cat, f"t{t}-{i}")
                cat.list()
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    rows = cat.list()
    assert len(rows) == 90
    assert len({r.id for r in rows}) == 90
