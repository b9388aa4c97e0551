"""The process-group transport over HTTP (contract section 10): a real app serving a tiny Llama
attachably on the CPU, and the trainer's :class:`TrainerGroup` (gloo over loopback) in this
process. Attach with the process-group body, commit-begin arms the receive into the arena,
one broadcast writes it in place, commit-end answers once it landed; a receive that never
completes is refused at commit-end and torn by the watchdog, which destroys the group; the
refusals of a bad body; status, audit and metrics name the transport."""

from __future__ import annotations

import asyncio
import socket

import torch

from miserver.http import keys
from miserver.trainer.process_group import TrainerGroup
from tests.unit.test_weights_routes import OPS, TRN, audit_lines, auth, chat, make_client, post
from tests.waiting import eventually


def _arena_bytes(client) -> torch.Tensor:
    arena = client.app[keys.HOST].resident.arena
    (st,) = arena.storages
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))


async def _status(client) -> dict:
    return (await (await client.get("/api/weights/status")).json())["data"]


async def _attach_pg(client, trainer: TrainerGroup, rank: int = 1):
    st, body, _ = await post(client, "/api/weights/attach", auth(TRN), trainer.attach_body(rank))
    assert st == 200, body
    return body["data"]


async def test_a_process_group_commit_writes_the_arena_in_place(tmp_path, tiny_model_dir):
    client = await make_client(tmp_path, tiny_model_dir, WEIGHTS_COMMIT_WATCHDOG_MS="20000")
    trainer = TrainerGroup(2, timeout_s=30)
    try:
        # a process-wide count (other tests in this process export too): compared, not absolute
        exported_before = (await _status(client))["exports_since_start"]
        data = await _attach_pg(client, trainer)
        att = data["attachment_id"]
        assert [s["kind"] for s in data["storages"]] == ["process_group"]
        storage = data["storages"][0]
        assert storage["device_type"] == "cpu" and storage["device_index"] is None
        assert storage["dtypes"] == ["bfloat16"] and "handle" not in storage
        assert data["release"]["pinned_bytes"] == 0
        arena = _arena_bytes(client)
        assert storage["storage_size_bytes"] == arena.numel()
        status = await _status(client)
        assert status["attachment"]["transport"] == "process_group"
        pg = status["attachment"]["process_group"]
        assert pg["backend"] == "gloo" and pg["rank"] == 1 and pg["world_size"] == 2
        assert pg["init_method"] == trainer.init_method
        assert status["exports_since_start"] == exported_before  # nothing was exported

        weights = trainer.layout(data)
        weights.buffers[0].copy_(arena)  # the trainer starts from the served values
        await asyncio.to_thread(trainer.connect)
        status = await eventually(lambda: _ready(client), "the server's side of the group joined")
        _, before, _ = await chat(client)
        ptr = arena.data_ptr()
        h = auth(TRN, att)
        norm = "model.norm.weight"
        with torch.no_grad():
            weights[norm].fill_(0.5)
            weights["model.embed_tokens.weight"].mul_(-1)
        for step in (1, 2):
            assert (await post(client, "/api/weights/quiesce", h))[0] == 200
            st, body, _ = await post(client, "/api/weights/commit-begin", h)
            assert st == 200 and body["data"]["weights_state"] == "writing"
            assert await asyncio.to_thread(trainer.send, weights) == arena.numel()
            st, body, _ = await post(client, "/api/weights/commit-end", h)
            assert st == 200, body
            assert body["data"]["steps_since_load"] == step and not body["data"]["overran"]
            assert (await post(client, "/api/weights/resume", h))[0] == 200
        model = client.app[keys.HOST].resident.model
        assert torch.equal(arena, weights.buffers[0])  # every byte, in place
        assert arena.data_ptr() == ptr
        assert torch.all(model.model.norm.weight == 0.5)
        st, after, headers = await chat(client)
        assert st == 200 and headers["X-miLLM-Model"] == '"tiny";origin=model;commits=2'
        status = await _status(client)
        pg = status["attachment"]["process_group"]
        assert pg["receives"] == 2 and pg["received_bytes"] == 2 * arena.numel()
        text = await (await client.get("/metrics")).text()
        assert 'miserver_attachment_transport{transport="process_group"} 1.0' in text
        assert 'miserver_process_group_receives_total{outcome="ok"} 2.0' in text
        (line,) = [x for x in text.splitlines() if x.startswith("miserver_process_group_rec")
                   and "bytes_total " in x]  # fmt: skip
        assert float(line.split()[-1]) == 2 * arena.numel()
        st, body, _ = await post(client, "/api/weights/detach", h)
        assert st == 200
        status = await _status(client)
        assert status["attachment"] is None
        lines = audit_lines(tmp_path)
        assert {line["transport"] for line in lines[:-1]} == {"process_group"}
        assert lines[-1]["operation"] == "weights_detach" and lines[-1]["transport"] is None
    finally:
        trainer.destroy()
        await client.close()


async def _ready(client):
    status = await _status(client)
    pg = status["attachment"]["process_group"]
    return status if pg["group_state"] == "ready" else None


async def test_ranges_write_only_those_bytes_and_bad_ranges_are_400(tmp_path, tiny_model_dir):
    client = await make_client(tmp_path, tiny_model_dir, WEIGHTS_COMMIT_WATCHDOG_MS="20000")
    trainer = TrainerGroup(2, timeout_s=30)
    try:
        data = await _attach_pg(client, trainer)
        h = auth(TRN, data["attachment_id"])
        arena = _arena_bytes(client)
        weights = trainer.layout(data)
        weights.buffers[0].copy_(arena)
        await asyncio.to_thread(trainer.connect)
        n = arena.numel()
        ranges = [[n - 512, 512], [256, 256]]
        assert (await post(client, "/api/weights/quiesce", h))[0] == 200
        for bad, says in [([[n - 1, 2]], "ends past the arena"), ([[0, 0]], "length >= 1")]:
            st, body, _ = await post(client, "/api/weights/commit-begin", h, {"ranges": bad})
            assert st == 400 and body["error"]["code"] == "INVALID_REQUEST", body
            assert says in body["error"]["message"]
        assert (await _status(client))["weights_state"] == "clean"  # nothing changed
        expected = arena.clone()
        weights.buffers[0].fill_(0)
        expected[n - 512 :] = 0
        expected[256:512] = 0
        st, body, _ = await post(client, "/api/weights/commit-begin", h, {"ranges": ranges})
        assert st == 200, body
        assert await asyncio.to_thread(trainer.send, weights, ranges) == 768
        st, body, _ = await post(client, "/api/weights/commit-end", h)
        assert st == 200, body
        assert torch.equal(arena, expected)
        await post(client, "/api/weights/resume", h)
        await post(client, "/api/weights/detach", h)
        # ranges on an attachment of another transport
        att = (await post(client, "/api/weights/attach", auth(TRN)))[1]["data"]["attachment_id"]
        h = auth(TRN, att)
        await post(client, "/api/weights/quiesce", h)
        st, body, _ = await post(client, "/api/weights/commit-begin", h, {"ranges": [[0, 1]]})
        assert st == 400 and "process_group attachment only" in body["error"]["message"]
        assert (await _status(client))["attachment"]["transport"] == "cpu_shared_memory"
        await post(client, "/api/weights/resume", h)
        await post(client, "/api/weights/detach", h)
    finally:
        trainer.destroy()
        await client.close()


async def test_attach_bodies_that_cannot_work_are_400_and_audited(tmp_path, tiny_model_dir):
    client = await make_client(tmp_path, tiny_model_dir)
    try:
        for body, says in [
            ({"transport": "process_group", "init_method": "tcp://h:1", "world_size": 2}, "rank"),
            (
                {"transport": "process_group", "init_method": "env://", "world_size": 2,
                 "rank": 1},
                "tcp://HOST:PORT",
            ),
            (
                {"transport": "process_group", "init_method": "tcp://h:1", "world_size": 2,
                 "rank": 0},
                "rank 0 is the trainer",
            ),
            ({"transport": "cuda_ipc", "rank": 1}, "process_group transport only"),
            ({"transport": "carrier_pigeon"}, "transport"),
        ]:  # fmt: skip
            st, answer, _ = await post(client, "/api/weights/attach", auth(TRN), body)
            assert st == 400 and answer["error"]["code"] == "INVALID_REQUEST", answer
            assert says in answer["error"]["message"], answer
        status = await _status(client)
        assert status["attached"] is False
        lines = audit_lines(tmp_path)
        assert len(lines) == 5
        assert all(x["operation"] == "weights_attach" and x["outcome"] == "refused" for x in lines)
        # the default attach, with the explicit cuda_ipc body: unchanged
        st, answer, _ = await post(
            client, "/api/weights/attach", auth(TRN), {"transport": "cuda_ipc"}
        )
        assert st == 200 and answer["data"]["storages"][0]["kind"] == "cpu_shared_memory"
        h = auth(TRN, answer["data"]["attachment_id"])
        await post(client, "/api/weights/detach", h)
    finally:
        await client.close()


async def test_a_receive_never_sent_is_refused_at_commit_end_torn_and_the_group_destroyed(
    tmp_path, tiny_model_dir
):
    client = await make_client(tmp_path, tiny_model_dir, WEIGHTS_COMMIT_WATCHDOG_MS="400")
    trainer = TrainerGroup(2, timeout_s=30)
    try:
        data = await _attach_pg(client, trainer)
        h = auth(TRN, data["attachment_id"])
        arena = _arena_bytes(client)
        served = arena.clone()
        await asyncio.to_thread(trainer.connect)
        await eventually(lambda: _ready(client), "joined")
        st, saved, _ = await post(client, "/api/weights/save", h, {})
        assert st == 200, saved
        assert (await post(client, "/api/weights/quiesce", h))[0] == 200
        assert (await post(client, "/api/weights/commit-begin", h))[0] == 200
        # the trainer sends nothing: commit-end waits for the receive up to the watchdog
        st, body, _ = await post(client, "/api/weights/commit-end", h)
        assert st == 409, body
        assert (body["error"]["code"], body["error"]["reason"]) == (
            "WEIGHTS_NOT_CLEAN",
            "receive_incomplete",
        )
        assert "POST /api/weights/load" in body["error"]["message"]
        status = await eventually(lambda: _torn(client), "the watchdog tore the set")
        assert status["attachment"]["process_group"]["group_state"] == "destroyed"
        assert torch.equal(arena, served)  # nothing landed
        st, again, _ = await post(client, "/api/weights/commit-end", h)
        assert st == 409 and again["error"]["reason"] == "receive_incomplete"  # stays torn
        st, answer, _ = await chat(client)
        assert st == 503
        # recover, then the destroyed group refuses the next commit-begin
        sha = saved["data"]["checkpoint_sha256"]
        st, body, _ = await post(client, "/api/weights/load", h, {"checkpoint": sha})
        assert st == 200 and body["data"]["weights_state"] == "clean", body
        assert body["data"]["in_place"] is True
        assert arena.data_ptr() == _arena_bytes(client).data_ptr()
        assert (await _status(client))["barrier"] == "quiesced"  # the holder's hold came back
        st, body, _ = await post(client, "/api/weights/commit-begin", h)
        assert st == 409 and body["error"]["code"] == "GROUP_UNAVAILABLE", body
        assert body["error"]["details"]["group_state"] == "destroyed"
        assert "attach again" in body["error"]["message"]
        assert (await _status(client))["weights_state"] == "clean"
        await post(client, "/api/weights/resume", h)
        assert (await post(client, "/api/weights/detach", h))[0] == 200
        text = await (await client.get("/metrics")).text()
        assert 'miserver_process_group_receives_total{outcome="failed"} 1.0' in text
        assert "miserver_attachment_transport{" not in text  # nothing attached
    finally:
        trainer.destroy()
        await client.close()


async def _torn(client):
    status = await _status(client)
    return status if status["weights_state"] == "torn" else None


async def test_a_group_that_never_forms_refuses_commit_begin_naming_the_error(
    tmp_path, tiny_model_dir
):
    client = await make_client(
        tmp_path,
        tiny_model_dir,
        WEIGHTS_HEARTBEAT_TIMEOUT_S="1",
        WEIGHTS_HEARTBEAT_INTERVAL_HINT_S="0.5",
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody serves the rendezvous there
    try:
        body = {
            "transport": "process_group",
            "init_method": f"tcp://127.0.0.1:{port}",
            "world_size": 2,
            "rank": 1,
        }
        st, answer, _ = await post(client, "/api/weights/attach", auth(TRN), body)
        assert st == 200, answer
        h = auth(TRN, answer["data"]["attachment_id"])

        async def failed():
            pg = (await _status(client))["attachment"]["process_group"]
            return pg if pg["group_state"] == "failed" else None

        pg = await eventually(failed, "the join failed")
        assert f"tcp://127.0.0.1:{port}" in pg["error"]
        assert (await post(client, "/api/weights/quiesce", h))[0] == 200
        st, answer, _ = await post(client, "/api/weights/commit-begin", h)
        assert st == 409 and answer["error"]["code"] == "GROUP_UNAVAILABLE"
        assert f"127.0.0.1:{port}" in answer["error"]["message"]
        await post(client, "/api/weights/resume", h)
        # an operator clears the (by now stale) attachment: the group goes with it
        await post(client, "/api/weights/heartbeat", h)
        st, _, _ = await post(client, "/api/weights/detach", h)
        assert st == 200
        assert (await _status(client))["attachment"] is None
        assert OPS  # the operator token exists for the routes' other tests
    finally:
        await client.close()
