"""Catalogue ids a client can send: finding 2 of the adversarial trial of 2026-11-30 (a model
id beyond SQLite's 64-bit range was a 500 from the driver's OverflowError)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miserver.serving.models.catalogue import MAX_ROW_ID, Catalogue, CatalogueError


@pytest.fixture
def catalogue(tmp_path: Path) -> Catalogue:
    cat = Catalogue(tmp_path / "home")
    cat.register(name="base", format="safetensors", dtype="bfloat16", path=tmp_path / "base")
    return cat


@pytest.mark.parametrize("row_id", [2**70, MAX_ROW_ID + 1, -(2**70), 0, -1, True])
def test_an_id_no_row_can_have_finds_no_row_instead_of_raising(catalogue, row_id):
    assert catalogue.get(row_id) is None
    assert catalogue.delete(row_id) is False
    assert catalogue.set_path(row_id, "/elsewhere") is False
    with pytest.raises(CatalogueError, match="names no catalogue row"):
        catalogue.register(
            name="child", format="safetensors", dtype="bfloat16", path="/c", parent_id=row_id
        )
    assert [r.name for r in catalogue.list()] == ["base"]


def test_the_largest_id_is_still_looked_up(catalogue):
    assert catalogue.get(MAX_ROW_ID) is None
    assert catalogue.get(1).name == "base"


# --- row ids are ASCII digits only (breaker finding F8) ----------------------------------------
@pytest.mark.parametrize(
    "raw", ["%D9%A1", "%EF%BC%91", "%E0%A5%A7", "%F0%9D%9F%8F", "1%EF%BC%91"]
)  # Arabic-Indic 1, full-width 1, Devanagari 1, mathematical bold 1, "1" + full-width 1
async def test_a_non_ascii_digit_is_not_a_row_id(tmp_path, raw):
    from miserver.http import keys
    from tests.unit.model_free_app import model_free_client, model_free_settings

    client = await model_free_client(model_free_settings(tmp_path, ""))
    try:
        client.app[keys.CATALOGUE].register(
            name="base", format="safetensors", dtype="bfloat16", path=tmp_path / "base"
        )
        assert (await client.get("/api/models/1")).status == 200  # the row is there
        for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/load"), ("POST", "/unload")):
            resp = await client.request(method, f"/api/models/{raw}{path}")
            body = await resp.json()
            assert resp.status == 404, (method, path, body)
            assert "it is not a row id" in body["error"]["message"], body
        assert (await client.get("/api/models/1")).status == 200  # nothing was deleted
    finally:
        await client.close()
