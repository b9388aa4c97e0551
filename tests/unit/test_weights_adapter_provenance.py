"""X-miLLM-Model provenance across adapter changes (weights page: Which weights answered;
contract 6): finding 5 of the adversarial trial of 2026-11-30.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miserver.http import keys
from tests.unit.test_weights_adapter_requests import (
    apply,
    assert_untouched,
    header,
    remove,
    status,
)
from tests.unit.test_weights_checkpoints_routes import attach, bump, commit, make_adapter, scores
from tests.unit.test_weights_routes import OPS, auth, make_client, post


@pytest.fixture
async def client(tmp_path, tiny_model_dir):
    c = await make_client(tmp_path, tiny_model_dir)
    yield c
    await c.close()


@pytest.fixture(scope="module")
def lora(tiny_model_dir, tmp_path_factory) -> Path:
    """A LoRA adapter (q_proj, v_proj) for the tiny model."""
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "lora")


# --- finding 5: provenance across adapter changes ------------------------------------------------
async def test_provenance_survives_a_no_op_remove_and_an_adapter_round_trip(client, lora):
    h = await attach(client)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "ck"})
    assert st == 200, body
    st, body, _ = await post(client, "/api/weights/load", h, {"checkpoint": "ck"})
    assert st == 200 and body["data"]["in_place"] is True, body
    await commit(client, h, bump)
    assert (await post(client, "/api/weights/detach", h))[0] == 200
    assert await header(client) == '"ck";origin=checkpoint;commits=1'

    st, body = await remove(client)  # nothing applied: a 200 no-op
    assert st == 200 and body["data"] == {"applied": False}
    assert await header(client) == '"ck";origin=checkpoint;commits=1'

    assert (await apply(client, "ck-lora", lora))[0] == 200
    assert await header(client) == '"ck-lora";origin=adapter;commits=0'
    h = await attach(client)
    await commit(client, h, bump)  # a commit to the base tensors while the adapter is applied
    assert (await post(client, "/api/weights/detach", h))[0] == 200
    assert await header(client) == '"ck-lora";origin=adapter;commits=1'

    assert (await remove(client))[0] == 200
    assert await header(client) == '"ck";origin=checkpoint;commits=2'  # 1 before, 1 under it
    assert (await remove(client))[0] == 200
    assert await header(client) == '"ck";origin=checkpoint;commits=2'


async def test_replacing_an_adapter_restores_the_name_from_before_the_first(client, lora, tmp_path):
    other = make_adapter(client.app[keys.HOST].resident.row.path, tmp_path / "other")
    assert (await apply(client, "one", lora))[0] == 200
    assert (await apply(client, "two", other))[0] == 200
    assert await header(client) == '"two";origin=adapter;commits=0'
    assert (await remove(client))[0] == 200
    assert await header(client) == '"tiny";origin=model;commits=0'


async def test_an_in_place_load_under_an_adapter_serves_exactly_the_checkpoint(client, lora):
    h = await attach(client)
    saved = await scores(client)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "ck"})
    assert st == 200, body
    assert (await post(client, "/api/weights/detach", h))[0] == 200
    assert (await apply(client, "ck-lora", lora))[0] == 200
    assert await scores(client, "ck-lora") != saved
    st, body, _ = await post(client, "/api/weights/load", auth(OPS), {"checkpoint": "ck"})
    assert st == 200 and body["data"]["in_place"] is True, body
    assert await scores(client, "ck") == saved
    assert await header(client) == '"ck";origin=checkpoint;commits=0'
    assert_untouched(client, await status(client))


async def test_a_save_while_an_adapter_is_applied_keeps_its_name_after_the_removal(client, lora):
    # The save stores the base tensors and renames the served set (contract 5); removing the
    # adapter afterwards must not bring back the name from before the save.
    assert (await apply(client, "lora", lora))[0] == 200
    h = await attach(client)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "ck"})
    assert st == 200, body
    await commit(client, h, bump)
    assert (await post(client, "/api/weights/detach", h))[0] == 200
    assert (await remove(client))[0] == 200
    assert await header(client) == '"ck";origin=checkpoint;commits=1'
