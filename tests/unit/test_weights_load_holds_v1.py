"""Issue 32, item 2: a weights load that reloads the model (``{"model_id": N}``) holds the
``/v1`` requests for the resident and answers them after the load, as a quiesce does, instead
of refusing them 409 ``model_busy`` (typed ``invalid_request_error``, which clients take as
permanent). Requests already waiting for the slot when the load began go on on the reloaded
model; a request held past its deadline gets 503 with ``Retry-After``."""

from __future__ import annotations

import asyncio
import time

from miserver.http import keys
from tests.unit.test_weights_routes import OPS, auth, make_client


def body(max_tokens: int = 2) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def slow_loader(host, seconds: float) -> None:
    """The host's reads take ``seconds`` longer: the reload is long enough to send into."""
    real = host._loader

    def load(row, settings):
        time.sleep(seconds)
        return real(row, settings)

    host._loader = load


async def _reloading(host) -> None:
    while not (host.busy and host.resident is None):
        await asyncio.sleep(0.005)


async def _answer(client, max_tokens: int = 2):
    resp = await client.post("/v1/chat/completions", json=body(max_tokens))
    return resp.status, await resp.json(), resp.headers


async def test_a_model_id_load_holds_the_chats_and_answers_them_after(tmp_path, tiny_model_dir):
    client = await make_client(tmp_path, tiny_model_dir)
    try:
        host = client.app[keys.HOST]
        before = host.resident
        slow_loader(host, 0.4)
        # Waiting for the slot when the load begins: admitted for the model it drops.
        early = [asyncio.create_task(_answer(client, 8)) for _ in range(3)]
        await asyncio.sleep(0.05)
        load = asyncio.create_task(
            client.post("/api/weights/load", headers=auth(OPS), json={"model_id": 1})
        )
        await asyncio.wait_for(_reloading(host), 30)
        during = [asyncio.create_task(_answer(client)) for _ in range(4)]  # the model is gone
        resp = await load
        assert resp.status == 200, await resp.text()
        answers = await asyncio.gather(*early, *during)
        for status, data, headers in answers:
            assert status == 200, data
            assert headers["X-miLLM-Model"].startswith('"tiny";origin=model')
        assert host.resident is not before  # it was a reload, and every chat was answered
    finally:
        await client.close()


async def test_a_request_held_past_its_deadline_gets_503_with_retry_after(
    tmp_path, tiny_model_dir, monkeypatch
):
    monkeypatch.setattr("miserver.http.v1_admission.RELOAD_WAIT_S", 0.1, raising=False)
    client = await make_client(tmp_path, tiny_model_dir)
    try:
        host = client.app[keys.HOST]
        slow_loader(host, 1.0)
        load = asyncio.create_task(
            client.post("/api/weights/load", headers=auth(OPS), json={"model_id": 1})
        )
        await asyncio.wait_for(_reloading(host), 30)
        status, data, headers = await _answer(client)
        assert status == 503, data
        assert data["error"]["type"] == "server_error" and headers["Retry-After"] == "1"
        assert data["error"]["code"] == "not_ready"
        assert (await load).status == 200
        status, data, _ = await _answer(client)  # the retry is served
        assert status == 200, data
    finally:
        await client.close()


async def test_the_trainer_guide_and_the_server_agree_on_which_loads_are_in_place(
    tmp_path, tiny_model_dir
):
    """Issue 32, item 2: the guide said a ``{"model_id"}`` load was in place while the server
    refuses it ``ALREADY_ATTACHED`` while attached (a full reload); now the guide's table says
    which loads are in place, and the server does what it says."""
    from pathlib import Path

    from tests.unit.test_weights_routes import TRN, post

    guide = (Path(__file__).parents[2] / "docs" / "trainer-guide.md").read_text()
    assert "reads the base model's files into the served storages in place" not in guide
    rows = {
        line.split("|")[1].strip(): line for line in guide.splitlines() if line.startswith("| `{")
    }
    model_id = rows['`{"model_id": N}`']
    assert "full reload" in model_id and "409 `ALREADY_ATTACHED`" in model_id
    matching = next(v for k, v in rows.items() if "matches the resident" in k)
    assert "**in place**" in matching and '`"in_place": true`' in matching
    client = await make_client(tmp_path, tiny_model_dir)
    try:
        st, data, _ = await post(client, "/api/weights/attach", auth(TRN))
        assert st == 200, data
        h = auth(TRN, data["data"]["attachment_id"])
        st, data, _ = await post(client, "/api/weights/save", h, {"name": "base-start"})
        assert st == 200, data
        st, data, _ = await post(client, "/api/weights/load", h, {"model_id": 1})
        assert st == 409 and data["error"]["code"] == "ALREADY_ATTACHED", data
        st, data, _ = await post(client, "/api/weights/load", h, {"checkpoint": "base-start"})
        assert st == 200 and data["data"]["in_place"] is True, data
    finally:
        await client.close()


async def test_a_checkpoint_load_a_save_and_an_adapter_change_hold_the_chats(
    tmp_path, tiny_model_dir
):
    """The other pauses of issue 32, item 2: chats sent during an in-place checkpoint load, a
    save and an adapter change (apply, remove) are all answered 200, held while the pause
    runs (three clients send one after another before, during and after each pause)."""
    from tests.unit.test_weights_checkpoints_routes import make_adapter
    from tests.unit.test_weights_routes import TRN, post

    client = await make_client(tmp_path, tiny_model_dir)
    try:
        st, data, _ = await post(client, "/api/weights/attach", auth(TRN))
        h = auth(TRN, data["data"]["attachment_id"])
        assert (await post(client, "/api/weights/save", h, {"name": "ck"}))[0] == 200
        adapter = make_adapter(tiny_model_dir, tmp_path / "adapter")
        for path, payload, method in (
            ("/api/weights/load", {"checkpoint": "ck"}, "post"),
            ("/api/weights/save", {}, "post"),
            ("/api/weights/adapter", {"name": "ad1", "path": str(adapter)}, "post"),
            ("/api/weights/adapter", None, "delete"),
        ):
            gate = asyncio.Event()

            async def storm(gate: asyncio.Event = gate) -> list:
                out = []
                while not gate.is_set():
                    out.append(await _answer(client))
                return out

            tasks = [asyncio.create_task(storm()) for _ in range(3)]
            await asyncio.sleep(0.1)
            resp = await getattr(client, method)(path, headers=h, json=payload)
            assert resp.status == 200, await resp.text()
            await asyncio.sleep(0.05)
            gate.set()
            answers = [a for t in tasks for a in await t]
            assert answers and all(status == 200 for status, _, _ in answers), [
                (s, d.get("error")) for s, d, _ in answers if s != 200
            ]
    finally:
        await client.close()
