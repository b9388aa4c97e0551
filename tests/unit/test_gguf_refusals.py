"""What a GGUF resident cannot do is refused by the lifecycle table (contract 4a): a save, a
weights load of a checkpoint and an adapter change are 400 GGUF_UNSUPPORTED, in the order the
table checks them, through the live weights routes.

The resident is the tiny transformers model whose row says ``format: gguf`` (the routes read
the resident's row, as for the embedded Q4 file; tests/e2e/test_gguf.py does the same against
llama.cpp for real), so these run in seconds.
"""

from __future__ import annotations

import msgspec
import pytest

from miserver.fsm.table import check_order, rows_for
from miserver.http import keys
from tests.unit.test_weights_routes import OPS, TRN, audit_lines, auth, make_client, post


@pytest.fixture
async def gguf(tmp_path, tiny_model_dir):
    client = await make_client(tmp_path, tiny_model_dir)
    resident = client.app[keys.HOST].resident
    real = resident.row
    resident.row = msgspec.structs.replace(real, format="gguf", quantization="gguf")
    yield client
    resident.row = real
    await client.close()


async def _status(client) -> dict:
    return (await (await client.get("/api/weights/status")).json())["data"]


def _refusal(st: int, body: dict) -> tuple[int, str, str | None]:
    err = body["error"]
    return st, err["code"], err.get("reason")


async def test_save_is_gguf_unsupported_after_the_token_and_before_the_attachment(gguf, tmp_path):
    row = gguf.app[keys.HOST].resident.row
    st, body, _ = await post(gguf, "/api/weights/save", {}, {"name": "ckpt"})
    assert _refusal(st, body) == (401, "WEIGHTS_UNAUTHORIZED", None)
    # nothing is attached (nothing can be, on a GGUF resident), and the name would be refused:
    # the table's GGUF row comes first, so the answer names what no attachment can change
    for name in ("ckpt", "../bad name"):
        st, body, _ = await post(gguf, "/api/weights/save", auth(TRN), {"name": name})
        assert _refusal(st, body) == (400, "GGUF_UNSUPPORTED", "save"), body
    err = body["error"]
    assert err["details"] == {"model_id": row.id, "name": row.name}
    assert "llama.cpp" in err["message"] and repr(row.name) in err["message"]
    assert "POST /api/models/{id}/load" in err["message"]
    status = await _status(gguf)
    assert (status["barrier"], status["weights_state"], status["attached"]) == (
        "serving",
        "clean",
        False,
    )
    line = audit_lines(tmp_path)[-1]
    assert (line["operation"], line["outcome"], line["code"]) == (
        "save",
        "refused",
        "GGUF_UNSUPPORTED",
    )


async def test_a_checkpoint_load_is_gguf_unsupported_before_the_checkpoint_is_looked_up(gguf):
    st, body, _ = await post(gguf, "/api/weights/load", auth(OPS), {"checkpoint": "nowhere"})
    assert _refusal(st, body) == (400, "GGUF_UNSUPPORTED", "weights_load"), body
    # a row reload is the way off a GGUF resident: not refused for it
    row = gguf.app[keys.HOST].resident.row.id
    st, body, _ = await post(gguf, "/api/weights/load", auth(OPS), {"model_id": row})
    assert st == 200, body
    assert gguf.app[keys.HOST].resident.row.format == "safetensors"


@pytest.mark.parametrize("method", ["POST", "DELETE"])
async def test_an_adapter_change_is_gguf_unsupported(gguf, method):
    body = {"name": "lora-a", "path": "/nonexistent/adapter"} if method == "POST" else None
    resp = await gguf.request(method, "/api/weights/adapter", json=body)
    assert _refusal(resp.status, await resp.json()) == (400, "GGUF_UNSUPPORTED", "adapter")
    assert (await (await gguf.get("/api/weights/adapter")).json())["data"]["applied"] is False


async def test_gguf_is_refused_before_continuous_batching_as_attach_orders_them(gguf):
    resp = await gguf.patch("/api/settings", json={"continuous_batching": True})
    assert resp.status == 200, await resp.text()
    assert (await _status(gguf))["pause_unavailable"] == "cbm"
    st, body, _ = await post(gguf, "/api/weights/attach", auth(TRN))
    assert _refusal(st, body) == (400, "NOT_ATTACHABLE", "gguf")
    st, body, _ = await post(gguf, "/api/weights/load", auth(OPS), {"checkpoint": "x"})
    assert _refusal(st, body) == (400, "GGUF_UNSUPPORTED", "weights_load")
    resp = await gguf.post("/api/weights/adapter", json={"name": "a", "path": "/nonexistent"})
    assert _refusal(resp.status, await resp.json()) == (400, "GGUF_UNSUPPORTED", "adapter")
    # the row reload is refused cbm, as on any resident
    row = gguf.app[keys.HOST].resident.row.id
    st, body, _ = await post(gguf, "/api/weights/load", auth(OPS), {"model_id": row})
    assert _refusal(st, body) == (409, "BARRIER_UNAVAILABLE", "cbm")


def test_the_table_orders_the_gguf_refusals_as_the_routes_answer_them() -> None:
    save = check_order("save")
    assert save[:3] == (
        ("WEIGHTS_UNAUTHORIZED", None),
        ("GGUF_UNSUPPORTED", "save"),
        ("NOT_ATTACHED", None),
    )
    for trigger, reason in (("weights_load", "weights_load"), ("adapter_change", "adapter")):
        order = check_order(trigger)
        at = order.index(("GGUF_UNSUPPORTED", reason))
        assert order[at - 1] == ("MODEL_NOT_LOADED", None)
        assert order.index(("BARRIER_UNAVAILABLE", "cbm")) > at
    (load,) = [
        r for r in rows_for("weights_load") if r.refuse and r.refuse.code.name == "GGUF_UNSUPPORTED"
    ]
    assert load.when == ("resident_gguf", "checkpoint_load")
