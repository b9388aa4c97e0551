"""Checkpoints and adapters under the barrier, over HTTP (contract 5, 6; issue 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miserver.http import keys
from tests.unit.test_weights_routes import OPS, TRN, auth, chat, make_client, post
from tests.waiting import eventually


@pytest.fixture
async def client(tmp_path, tiny_model_dir):
    c = await make_client(tmp_path, tiny_model_dir)
    c.app[keys.CATALOGUE].register(
        name="tiny-b", format="safetensors", dtype="bfloat16", path=tiny_model_dir
    )
    yield c
    await c.close()


async def attach(client) -> dict[str, str]:
    st, body, _ = await post(client, "/api/weights/attach", auth(TRN))
    assert st == 200, body
    return auth(TRN, body["data"]["attachment_id"])


async def commit(client, h, write) -> None:
    """One write cycle; ``write(model)`` changes the served parameters in place."""
    assert (await post(client, "/api/weights/quiesce", h))[0] == 200
    assert (await post(client, "/api/weights/commit-begin", h))[0] == 200
    with torch.no_grad():
        write(client.app[keys.HOST].resident.model)
    assert (await post(client, "/api/weights/commit-end", h))[0] == 200
    assert (await post(client, "/api/weights/resume", h))[0] == 200


def bump(model) -> None:
    model.model.norm.weight.add_(0.5)


async def scores(client, model="tiny") -> list[float]:
    resp = await client.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": "The quick brown fox",
            "max_tokens": 1,
            "echo": True,
            "logprobs": 1,
            "temperature": 0,
        },
    )
    body = await resp.json()
    assert resp.status == 200, body
    return [x for x in body["choices"][0]["logprobs"]["token_logprobs"] if x is not None]


async def test_unsaved_commits_refuse_auto_load_until_a_save(client):
    h = await attach(client)
    await commit(client, h, bump)
    assert (await post(client, "/api/weights/detach", h))[0] == 200
    st, body, _ = await chat(client, model="tiny-b")
    assert st == 409 and body["error"]["code"] == "weights_unsaved"
    assert body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]  # /v1 carries the details in the message (contract 2)
    assert "carries 1 unsaved commit;" in message and "POST /api/weights/save" in message
    h = await attach(client)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "tiny-trained"})
    assert st == 200, body
    saved = body["data"]
    assert saved["name"] == "tiny-trained" and saved["steps_since_load"] == 1
    assert len(saved["checkpoint_sha256"]) == 64
    manifest = Path(saved["path"]) / "manifest.json"
    import hashlib

    assert hashlib.sha256(manifest.read_bytes()).hexdigest() == saved["checkpoint_sha256"]
    status = (await (await client.get("/api/weights/status")).json())["data"]
    assert status["last_save"]["checkpoint_sha256"] == saved["checkpoint_sha256"]
    st, _, headers = await chat(client, model="tiny-trained")
    assert st == 200
    assert headers["X-miLLM-Model"] == '"tiny-trained";origin=checkpoint;commits=0'
    await post(client, "/api/weights/detach", h)
    st, _, _ = await chat(client, model="tiny-b")  # saved: the swap is allowed now
    assert st == 200
    chain = (await (await client.get("/api/weights/checkpoints")).json())["data"]
    assert [c["name"] for c in chain["checkpoints"]] == ["tiny-trained"]


async def test_load_in_place_restores_the_checkpoint_and_allocates_nothing(client):
    h = await attach(client)
    before = await scores(client)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "tiny-ckpt"})
    assert st == 200, body
    await commit(client, h, bump)
    changed = await scores(client)
    assert changed != before
    model = client.app[keys.HOST].resident.model
    arena = client.app[keys.HOST].resident.arena
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    st, body, _ = await post(client, "/api/weights/load", h, {"checkpoint": "tiny-ckpt"})
    assert st == 200, body
    assert body["data"]["in_place"] is True and body["data"]["steps_since_load"] == 0
    assert client.app[keys.HOST].resident.model is model
    assert client.app[keys.HOST].resident.arena is arena
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    assert await scores(client, "tiny-ckpt") == before
    st, _, headers = await chat(client, model="tiny-ckpt")
    assert headers["X-miLLM-Model"] == '"tiny-ckpt";origin=checkpoint;commits=0'
    lineage = (await (await client.get("/api/weights/lineage")).json())["data"]["chain"]
    assert [e["name"] for e in lineage] == ["tiny-ckpt", "tiny"]


async def test_a_save_after_an_in_place_load_follows_the_manifest(client):
    """Issue 32, item 1: checkpoint A loaded in place, 2 commits, save B: B is A + 2 steps in
    its row (parent A, steps 2), its default name (A's name) and the lineage [B, A, base], as
    its manifest says; the load's answer names A, the row it loaded."""
    h = await attach(client)
    await commit(client, h, bump)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "tiny-a"})
    assert st == 200, body
    a = body["data"]
    assert a["parent_id"] == 1 and a["steps_since_load"] == 1
    st, body, _ = await post(client, "/api/weights/load", h, {"checkpoint": "tiny-a"})
    assert st == 200 and body["data"]["in_place"] is True, body
    assert body["data"]["model"] == {
        "model_id": a["model_id"],
        "name": "tiny-a",
        "manifest_hash": a["checkpoint_sha256"],
    }
    await commit(client, h, bump)
    await commit(client, h, bump)
    st, body, _ = await post(client, "/api/weights/save", h)
    assert st == 200, body
    b = body["data"]
    manifest = json.loads((Path(b["path"]) / "manifest.json").read_text())
    assert manifest["parent_checkpoint_sha256"] == a["checkpoint_sha256"]
    assert manifest["steps_since_load"] == 2 and manifest["base"]["row_id"] == 1
    assert b["parent_id"] == a["model_id"] and b["steps_since_load"] == 2
    assert b["name"] == f"tiny-a-step2-{b['checkpoint_sha256'][:8]}"
    rows = (await (await client.get("/api/models")).json())["data"]
    rows = rows["models"] if isinstance(rows, dict) else rows
    assert {r["name"]: r["parent_id"] for r in rows}[b["name"]] == a["model_id"]
    chain = (await (await client.get("/api/weights/lineage")).json())["data"]["chain"]
    assert [(e["name"], e["parent_id"], e["steps_since_load"]) for e in chain] == [
        (b["name"], a["model_id"], 2),
        ("tiny-a", 1, 1),
        ("tiny", None, None),
    ]
    status = (await (await client.get("/api/weights/status")).json())["data"]
    assert status["resident_model"]["name"] == "tiny-a"


async def test_corrupt_checkpoint_is_refused_before_any_write(client):
    h = await attach(client)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "tiny-bad"})
    path = Path(body["data"]["path"]) / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(bytes(raw))
    await commit(client, h, bump)
    before = await scores(client)
    st, body, _ = await post(client, "/api/weights/load", h, {"checkpoint": "tiny-bad"})
    assert st == 400 and body["error"]["code"] == "CHECKPOINT_CORRUPT"
    assert await scores(client) == before
    status = (await (await client.get("/api/weights/status")).json())["data"]
    assert status["weights_state"] == "clean" and status["steps_since_load"] == 1


async def test_torn_set_is_recovered_by_a_checkpoint_load(tmp_path, tiny_model_dir):
    client = await make_client(tmp_path, tiny_model_dir, WEIGHTS_COMMIT_WATCHDOG_MS="100")
    try:
        h = await attach(client)
        await post(client, "/api/weights/save", h, {"name": "tiny-good"})
        await post(client, "/api/weights/quiesce", h)
        await post(client, "/api/weights/commit-begin", h)

        async def torn():
            status = (await (await client.get("/api/weights/status")).json())["data"]
            return status["weights_state"] == "torn"

        await eventually(torn, "the watchdog tore the commit")
        st, body, _ = await chat(client)
        assert st == 503 and body["error"]["code"] == "weights_torn"
        st, body, _ = await post(client, "/api/models/1/load")
        assert st == 409 or st == 503
        st, body, _ = await post(
            client, "/api/weights/load", auth(OPS), {"checkpoint": "tiny-good"}
        )
        assert st == 200, body
        assert body["data"]["weights_state"] == "clean"
        assert (await chat(client))[0] == 200
        lines = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
        assert [x["operation"] for x in lines if x["operation"] in ("save", "load")] == [
            "save",
            "load",
        ]
    finally:
        await client.close()


def make_adapter(model_dir: str, out: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(out)
    return out


async def test_adapter_changes_outputs_and_removing_it_restores_them(
    client, tmp_path, tiny_model_dir
):
    adapter = make_adapter(tiny_model_dir, tmp_path / "lora")
    before = await scores(client)
    resp = await client.post(
        "/api/weights/adapter", json={"name": "tiny-lora", "path": str(adapter)}
    )
    body = await resp.json()
    assert resp.status == 200, body
    assert body["data"]["applied"] is True and body["data"]["rank"] == 4
    assert await scores(client, "tiny-lora") != before
    st, _, headers = await chat(client, model="tiny-lora")
    assert headers["X-miLLM-Model"] == '"tiny-lora";origin=adapter;commits=0'
    resp = await client.delete("/api/weights/adapter")
    assert (await resp.json())["data"] == {"applied": False}
    assert await scores(client) == before
    resp = await client.post("/api/weights/adapter", json={"name": "x", "path": "/nonexistent"})
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "ADAPTER_INVALID"


async def test_an_adapter_while_attached_neither_tears_nor_changes_the_export(
    client, tmp_path, tiny_model_dir
):
    adapter = make_adapter(tiny_model_dir, tmp_path / "lora")
    st, body, _ = await post(client, "/api/weights/attach", auth(TRN))
    names = [p["name"] for p in body["data"]["parameters"]]
    h = auth(TRN, body["data"]["attachment_id"])
    resp = await client.post(
        "/api/weights/adapter", json={"name": "tiny-lora", "path": str(adapter)}
    )
    assert resp.status == 200, await resp.text()
    await commit(client, h, bump)  # the per-commit address check looks through the LoRA layers
    assert (await post(client, "/api/weights/detach", h))[0] == 200  # the full walk too
    status = (await (await client.get("/api/weights/status")).json())["data"]
    assert status["weights_state"] == "clean" and status["adapter"]["applied"] is True
    st, body, _ = await post(client, "/api/weights/attach", auth(TRN))
    assert st == 200, body
    assert [p["name"] for p in body["data"]["parameters"]] == names  # base names, no lora_*
