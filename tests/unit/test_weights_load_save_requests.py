"""Weights load and save requests over HTTP: ids no row can have (contract 3, 5). Finding 2 of
the adversarial trial of 2026-11-30.
"""

from __future__ import annotations

import pytest

from tests.unit.test_weights_routes import OPS, auth, make_client, post


@pytest.fixture
async def client(tmp_path, tiny_model_dir):
    c = await make_client(tmp_path, tiny_model_dir)
    yield c
    await c.close()


# --- finding 2: a model id beyond SQLite's range ------------------------------------------------
@pytest.mark.parametrize("model_id", [2**70, 2**63, -1, 0])
async def test_a_load_of_an_id_no_row_can_have_is_404_like_the_models_route(client, model_id):
    st, body, _ = await post(client, "/api/weights/load", auth(OPS), {"model_id": model_id})
    assert st == 404, body
    assert body["error"]["code"] == "MODEL_NOT_FOUND"
    assert body["error"]["details"] == {"model_id": model_id}
    resp = await client.get(f"/api/models/{model_id}")
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "MODEL_NOT_FOUND"
