"""Issue 16 ("Hardening"), items 8 to 18: wrong answers and wrong errors.

Each test failed on the code before its fix (checked by reverting the fix; see the commit).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import socket
import sqlite3
import stat
import threading
import time
from pathlib import Path

import pytest
import torch

from miserver.http import keys
from miserver.serving.engine.slot import Priority
from tests.unit.test_weights_checkpoints_routes import make_adapter
from tests.unit.test_weights_routes import make_client


@pytest.fixture
async def client(tmp_path, tiny_model_dir):
    c = await make_client(tmp_path, tiny_model_dir)
    yield c
    await c.close()


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


# --- item 8: a queued request naming an adapter removed before it runs ---------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_a_queued_request_for_a_removed_adapter_is_refused_not_served_by_the_base(
    client, tmp_path, tiny_model_dir, stream
):
    lora = make_adapter(tiny_model_dir, tmp_path / "lora")
    resp = await client.post("/api/weights/adapter", json={"name": "tiny-lora", "path": str(lora)})
    assert resp.status == 200, await resp.json()
    scheduler = client.app[keys.SCHEDULER]
    await scheduler.acquire(Priority.INTERACTIVE)  # a running request holds the only slot
    body = {
        "model": "tiny-lora",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": stream,
    }
    request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
    await wait_until(lambda: scheduler.counts().queued == 1)
    removal = asyncio.ensure_future(client.delete("/api/weights/adapter"))
    await wait_until(lambda: scheduler.barrier_draining)
    scheduler.release()  # the running request ends; the removal drains, runs, resumes
    removed = await removal
    assert removed.status == 200, await removed.json()
    resp = await request
    answer = await resp.json()
    assert resp.status == 409, answer
    assert answer["error"]["code"] == "model_busy"
    assert resp.headers["Retry-After"]
    assert "X-miLLM-Model" not in resp.headers
    # The retry is admitted anew: the adapter's name is no model now.
    resp = await client.post("/v1/chat/completions", json={**body, "stream": False})
    assert resp.status == 404, await resp.json()


# --- item 9: every accepted seed is honoured -----------------------------------------------------
SEEDS = [0, 1, 2**32, 2**32 + 1, 2**63, -1, 2**64 - 1, -(2**63), 2**64 - 2**32]


def draws(seed: int, n: int = 12, vocab: int = 1000) -> list[int]:
    from miserver.serving.engine.generation import SamplingParams, SeedStream, pick_token

    stream = SeedStream(seed)
    params = SamplingParams(max_tokens=n, temperature=1.0, seed=seed)
    return [pick_token(torch.zeros(vocab), params, stream) for _ in range(n)]


def test_seeds_differing_only_above_32_bits_or_in_sign_sample_differently():
    samples = {seed: draws(seed) for seed in SEEDS}
    assert len({tuple(s) for s in samples.values()}) == len(SEEDS), samples
    assert all(draws(seed) == samples[seed] for seed in SEEDS)  # and each is reproducible


def test_a_seeded_draw_follows_the_distribution_and_never_picks_a_zero_probability_token():
    from miserver.serving.engine.generation import SamplingParams, SeedStream, pick_token

    logits = torch.full((50,), -float("inf"))
    logits[[3, 7]] = torch.tensor([0.0, float(torch.log(torch.tensor(3.0)))])  # p = 1/4, 3/4
    stream = SeedStream(2**63 + 5)
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=1.0)
    picks = [pick_token(logits, params, stream) for _ in range(4000)]
    assert set(picks) == {3, 7}
    assert 0.70 < picks.count(7) / len(picks) < 0.80
    nucleus = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.5)  # keeps token 7 only
    assert {pick_token(logits, nucleus, stream) for _ in range(200)} == {7}


async def test_v1_seeds_0_2_32_and_2_63_give_different_samples_and_each_repeats(client):
    async def sample(seed: int) -> str:
        resp = await client.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": "a",
                "max_tokens": 8,
                "temperature": 1.0,
                "seed": seed,
            },
        )
        body = await resp.json()
        assert resp.status == 200, body
        return body["choices"][0]["text"]

    texts = {seed: await sample(seed) for seed in (0, 2**32, 2**63)}
    assert len(set(texts.values())) == 3, texts
    assert await sample(2**63) == texts[2**63]


# --- item 10: non-finite logits fail the request, with a log line and a metric -------------------
def poison(client) -> None:
    model = client.app[keys.HOST].resident.model
    with torch.no_grad():
        model.get_output_embeddings().weight[5].fill_(float("nan"))


def failures(text: str, reason: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'miserver_generation_failures_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("temperature", [0, 1.0])
async def test_non_finite_logits_are_a_500_naming_the_cause_logged_and_counted(
    client, caplog, temperature
):
    poison(client)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": temperature,
        "seed": 3,
    }
    with caplog.at_level(logging.ERROR, logger="miserver.v1"):
        resp = await client.post("/v1/chat/completions", json=body)
    answer = await resp.json()
    assert resp.status == 500, answer
    assert answer["error"]["code"] == "generation_failed"
    assert "non-finite logits" in answer["error"]["message"]
    assert "POST /api/weights/load" in answer["error"]["message"]
    assert any("non-finite logits" in r.getMessage() for r in caplog.records)
    metrics = await (await client.get("/metrics")).text()
    assert failures(metrics, "non_finite_logits") == 1


async def test_non_finite_logits_end_a_stream_with_an_error_event(client):
    poison(client)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    resp = await client.post("/v1/chat/completions", json=body)
    text = await resp.text()
    # the first token fails: before the stream opens, a JSON 500 (issue 32, item 13)
    assert resp.status == 500 and "non-finite logits" in text and "data:" not in text
    metrics = await (await client.get("/metrics")).text()
    assert failures(metrics, "non_finite_logits") == 1


def test_pick_token_refuses_nan_inf_and_all_minus_inf_logits():
    from miserver.serving.engine.generation import NonFiniteLogits, SamplingParams, pick_token

    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(10)
        logits[4] = bad
        for t in (0.0, 0.7):
            with pytest.raises(NonFiniteLogits):
                pick_token(logits, SamplingParams(max_tokens=1, temperature=t), None)
    with pytest.raises(NonFiniteLogits):
        pick_token(torch.full((10,), -float("inf")), SamplingParams(max_tokens=1), None)
    logits = torch.zeros(10)
    logits[:9] = -float("inf")  # a masked vocabulary is fine
    assert pick_token(logits, SamplingParams(max_tokens=1, temperature=0.5), None) == 9


# --- item 12: Retry-After on 409 model_busy during a drain; numbers in the quiesce QUEUE_FULL -----
async def test_v1_refused_model_busy_while_an_unload_drains_carries_retry_after(client):
    scheduler = client.app[keys.SCHEDULER]
    row = client.app[keys.HOST].resident.row
    await scheduler.acquire(Priority.INTERACTIVE)  # a running generation the unload waits for
    unload = asyncio.ensure_future(client.post(f"/api/models/{row.id}/unload"))
    try:
        await wait_until(
            lambda: client.app[keys.HOST].resident is not None and (scheduler.barrier_draining)
        )
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        resp = await client.post("/v1/chat/completions", json=body)
        answer = await resp.json()
        assert resp.status == 409, answer
        assert answer["error"]["code"] == "model_busy"
        assert resp.headers.get("Retry-After") == "1"
        resp = await client.post(f"/api/models/{row.id}/load")  # a management load likewise
        assert resp.status == 409 and resp.headers.get("Retry-After") == "1"
    finally:
        scheduler.release()
    assert (await unload).status == 200


async def test_a_quiesce_refused_queue_full_gives_the_numbers_the_v1_refusal_gives(
    tmp_path, tiny_model_dir
):
    from tests.unit.test_weights_checkpoints_routes import attach
    from tests.unit.test_weights_routes import post

    client = await make_client(tmp_path, tiny_model_dir, MAX_QUEUED_REQUESTS="2")
    try:
        scheduler = client.app[keys.SCHEDULER]
        await scheduler.acquire(Priority.INTERACTIVE)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        waiting = [
            asyncio.ensure_future(client.post("/v1/chat/completions", json=body)) for _ in range(2)
        ]
        await wait_until(lambda: scheduler.counts().queued == 2)
        resp = await client.post("/v1/chat/completions", json=body)
        v1_message = (await resp.json())["error"]["message"]
        assert resp.status == 503 and "MAX_QUEUED_REQUESTS (2)" in v1_message
        h = await attach(client)
        st, answer, headers = await post(client, "/api/weights/quiesce", h)
        assert st == 503, answer
        assert answer["error"]["code"] == "QUEUE_FULL"
        assert "MAX_QUEUED_REQUESTS (2)" in answer["error"]["message"]
        assert answer["error"]["details"]["max_queued_requests"] == 2
        assert answer["error"]["details"]["waiting"] == 2
        assert headers["Retry-After"] == "1"
        scheduler.release()
        assert [(await w).status for w in waiting] == [200, 200]
    finally:
        await client.close()


# --- item 11: /v1 requests during the start-up load of DEFAULT_MODEL wait for it, bounded --------
async def slow_start_client(tmp_path, model_dir, gate: threading.Event):
    from aiohttp.test_utils import TestClient, TestServer

    from miserver.http.app import create_app
    from miserver.serving.models import loader as loader_module
    from miserver.serving.models.catalogue import Catalogue
    from miserver.serving.models.host import ModelHost
    from miserver.spec.settings import load_settings

    home = tmp_path / "home"
    Catalogue(str(home)).register(
        name="tiny", format="safetensors", dtype="bfloat16", path=model_dir
    )
    settings = load_settings({"MISERVER_HOME": str(home), "DEFAULT_MODEL": "tiny", "DEVICE": "cpu"})

    def slow_loader(row, settings):
        assert gate.wait(60), "the test never opened the gate"
        return loader_module.load_model(row, settings)

    host = ModelHost(settings, Catalogue(str(home)), loader=slow_loader)
    client = TestClient(TestServer(create_app(settings, host=host)))
    await client.start_server()
    return client


async def test_a_request_during_the_startup_load_waits_for_it_and_is_served(
    tmp_path, tiny_model_dir
):
    gate = threading.Event()
    client = await slow_start_client(tmp_path, tiny_model_dir, gate)
    try:
        await wait_until(lambda: client.app[keys.HOST].busy)  # the start-up load runs
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        plain = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
        stream = asyncio.ensure_future(
            client.post("/v1/chat/completions", json={**body, "stream": True})
        )
        await asyncio.sleep(0.5)
        assert not plain.done() and not stream.done()  # waiting, not refused
        health = await client.get("/api/health")  # the loop still answers meanwhile
        assert health.status == 200
        gate.set()
        resp = await plain
        assert resp.status == 200, await resp.json()
        assert resp.headers["X-miLLM-Model"].startswith('"tiny"')
        resp = await stream
        assert resp.status == 200 and (await resp.text()).rstrip().endswith("data: [DONE]")
    finally:
        gate.set()
        await client.close()


async def test_the_wait_for_the_startup_load_is_bounded(tmp_path, tiny_model_dir, monkeypatch):
    from miserver.http import v1_admission

    monkeypatch.setattr(v1_admission, "STARTUP_LOAD_WAIT_S", 0.3)
    gate = threading.Event()
    client = await slow_start_client(tmp_path, tiny_model_dir, gate)
    try:
        await wait_until(lambda: client.app[keys.HOST].busy)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        resp = await asyncio.wait_for(client.post("/v1/chat/completions", json=body), 10)
        answer = await resp.json()
        assert resp.status == 409, answer
        assert answer["error"]["code"] == "model_busy"
        assert resp.headers["Retry-After"] == "1"
    finally:
        gate.set()
        await client.close()


# --- item 13: lineage after a save starts at what is served ---------------------------------------
async def test_lineage_after_a_save_starts_at_the_checkpoint_served(client):
    from tests.unit.test_weights_checkpoints_routes import attach, bump, commit
    from tests.unit.test_weights_routes import post

    async def chain() -> list[str]:
        resp = await client.get("/api/weights/lineage")
        return [e["name"] for e in (await resp.json())["data"]["chain"]]

    assert await chain() == ["tiny"]
    h = await attach(client)
    await commit(client, h, bump)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "tiny-s1"})
    assert st == 200, body
    assert await chain() == ["tiny-s1", "tiny"]
    await commit(client, h, bump)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "tiny-s2"})
    assert st == 200, body
    entries = (await (await client.get("/api/weights/lineage")).json())["data"]["chain"]
    assert [e["name"] for e in entries] == ["tiny-s2", "tiny"]
    assert entries[0]["checkpoint_sha256"] == body["data"]["checkpoint_sha256"]
    assert entries[0]["steps_since_load"] == 2


# --- item 14: a client that half-closes after a complete request gets its response ---------------
def half_closed_exchange(port: int, request: bytes) -> bytes:
    """Send ``request``, shut the write side (``shutdown(SHUT_WR)``), read until closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
        conn.sendall(request)
        conn.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"GET /api/health HTTP/1.1\r\nHost: x\r\n\r\n", 200),
        (
            b"POST /api/models HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 12\r\n\r\n{"name": 12}',
            400,
        ),
        (b"GET /api/health HTTP/1.0\r\n\r\n", 200),
    ],
    ids=["get", "post-with-body", "http-1.0"],
)
async def test_a_half_closed_client_gets_its_response(tmp_path, request_bytes, status):
    from tests.unit.model_free_app import model_free_settings, served_port

    async with served_port(model_free_settings(tmp_path, "")) as port:
        raw = await asyncio.to_thread(half_closed_exchange, port, request_bytes)
        head, _, body = raw.partition(b"\r\n\r\n")
        assert raw.split(b" ")[1] == b"%d" % status, raw[:200]
        assert json.loads(body)  # a JSON body, whole
        # An incomplete body cannot be answered: the connection is closed, nothing hangs.
        raw = await asyncio.to_thread(
            half_closed_exchange,
            port,
            b'POST /api/models HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{"na',
        )
        assert raw == b"" or raw.startswith(b"HTTP/1.1 4"), raw[:200]


# --- item 16: a full disk is a 507 naming the cause, nothing half-written, one log line -----------
def enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def disk_full_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "disk is full" in r.getMessage()]


async def test_a_save_on_a_full_disk_is_507_and_leaves_no_partial_checkpoint(
    client, tmp_path, monkeypatch, caplog
):
    from miserver.serving.models import checkpoints
    from tests.unit.test_weights_checkpoints_routes import attach
    from tests.unit.test_weights_routes import post

    def full_disk_save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 1000)  # part of the file made it to disk
        raise enospc()

    monkeypatch.setattr(checkpoints, "save_file", full_disk_save_file)
    root = Path(client.app[keys.SETTINGS].home) / "checkpoints"
    before = sorted(p.name for p in root.iterdir()) if root.exists() else []
    rows = [r.name for r in client.app[keys.CATALOGUE].list()]
    h = await attach(client)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        st, body, _ = await post(client, "/api/weights/save", h, {"name": "tiny-full"})
    assert st == 507, body
    error = body["error"]
    assert error["code"] == "INSUFFICIENT_STORAGE" and error["reason"] == "disk_full"
    assert "disk" in error["message"] and "full" in error["message"]
    assert "Free space" in error["message"]
    assert sorted(p.name for p in root.iterdir()) == before  # no partial folder
    assert [r.name for r in client.app[keys.CATALOGUE].list()] == rows
    records = disk_full_records(caplog)
    assert len(records) == 1 and records[0].exc_info is None, [r.getMessage() for r in records]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    status = (await (await client.get("/api/weights/status")).json())["data"]
    assert status["weights_state"] == "clean" and status["barrier"] == "serving"
    assert status["last_save"] is None


async def test_a_save_whose_catalogue_row_hits_a_full_database_is_507_and_keeps_no_folder(
    client, monkeypatch, caplog
):
    from miserver.serving.models.catalogue import Catalogue
    from tests.unit.test_weights_checkpoints_routes import attach
    from tests.unit.test_weights_routes import post

    def full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(Catalogue, "register", full)
    h = await attach(client)
    caplog.clear()
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "tiny-full"})
    assert st == 507, body
    assert body["error"]["code"] == "INSUFFICIENT_STORAGE"
    root = Path(client.app[keys.SETTINGS].home) / "checkpoints"
    assert not (root / "tiny-full").exists()
    assert [p.name for p in root.iterdir()] == []
    assert len(disk_full_records(caplog)) == 1


async def test_an_upload_into_a_full_batch_database_is_a_507_openai_error_with_no_blob(
    tmp_path, caplog
):
    import aiohttp

    from miserver.http.batches import BATCH_STORE
    from tests.unit.model_free_app import model_free_client, model_free_settings

    client = await model_free_client(model_free_settings(tmp_path, ""))
    try:
        store = client.app[BATCH_STORE]
        db = store._db
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count = {pages + 2}")  # SQLite: "database or disk is full"
        n = 0
        for size in (200, 40, 8, 1, 0):  # fill every free page and gap: no row fits after
            with pytest.raises(sqlite3.OperationalError, match="full"):
                for _ in range(100000):
                    n += 1
                    db.execute(
                        "INSERT INTO files (id, filename, purpose, bytes, created_at) "
                        "VALUES (?, ?, 'filler', 0, 0)",
                        (f"{n}", "f" * size),
                    )
        row = {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "x" * 20000}]},
        }
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", (json.dumps(row) + "\n").encode(), filename="in.jsonl")
        caplog.clear()
        resp = await client.post("/v1/files", data=form)
        body = await resp.json()
        assert resp.status == 507, body
        assert body["error"]["code"] == "insufficient_storage"
        assert body["error"]["type"] == "server_error"
        assert "full" in body["error"]["message"]
        assert list(store.files_dir.iterdir()) == []  # no blob without its row
        assert len(disk_full_records(caplog)) == 1
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
        db.execute("DELETE FROM files WHERE purpose = 'filler'")  # space again: still works
        db.execute("PRAGMA max_page_count = 1073741823")
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", (json.dumps(row) + "\n").encode(), filename="in.jsonl")
        resp = await client.post("/v1/files", data=form)
        assert resp.status == 200, await resp.json()
    finally:
        await client.close()


def test_an_audit_log_on_a_full_disk_warns_once_and_never_raises(tmp_path, caplog):
    from miserver.serving.audit import AuditLog, AuditRecord

    def record() -> AuditRecord:
        return AuditRecord(
            operation="weights_attach",
            outcome="accepted",
            code=None,
            reason=None,
            role="trainer",
            label="t",
            attachment_ref=None,
            model=None,
            weights_state="clean",
            weights_state_before="clean",
        )

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this machine")
    audit = AuditLog("/dev/full")  # every write: ENOSPC
    try:
        with caplog.at_level(logging.INFO, logger="miserver.audit"):
            for _ in range(3):
                audit.write(record())
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "cannot be written" in warnings[0].getMessage()
        assert warnings[0].exc_info is None
        assert audit.file_failures == 3
        assert sum('"weights_audit"' in r.getMessage() for r in caplog.records) == 3
    finally:
        audit.close()


def test_a_half_written_audit_line_is_cut_back(tmp_path, monkeypatch):
    from miserver.serving import audit as audit_module
    from miserver.serving.audit import AuditLog

    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path))
    try:
        os.write(audit._fd, b'{"whole": 1}\n')
        real_write = os.write

        def short_write(fd, data):
            return real_write(fd, data[:5])  # the disk filled mid-line

        monkeypatch.setattr(audit_module.os, "write", short_write)
        audit._append(b'{"half": 2}\n')
        monkeypatch.setattr(audit_module.os, "write", real_write)
        assert path.read_bytes() == b'{"whole": 1}\n'
        audit._append(b'{"next": 3}\n')
        assert path.read_bytes() == b'{"whole": 1}\n{"next": 3}\n'
    finally:
        audit.close()


# --- item 17: no progress bar in a JSON log; model.safetensors as readable as its folder ---------
@pytest.fixture
def bars_restored():
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as hf_logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    hf_was, hub_was = hf_logging.is_progress_bar_enabled(), not are_progress_bars_disabled()
    hf_logging.enable_progress_bar()
    enable_progress_bars()
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    hf_logging.enable_progress_bar() if hf_was else hf_logging.disable_progress_bar()
    if hub_was:
        enable_progress_bars()


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_a_json_log_turns_off_the_progress_bars_a_text_log_keeps_them(
    tmp_path, bars_restored, log_format
):
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    from miserver.server import configure_logging
    from miserver.spec.settings import Settings

    configure_logging(Settings(home=str(tmp_path), log_format=log_format))
    assert hf_logging.is_progress_bar_enabled() is (log_format == "text")
    assert are_progress_bars_disabled() is (log_format == "json")


def test_the_gguf_dequantization_bar_is_silent_when_progress_is_off():
    import io

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from miserver.serving.models.default_model import _no_gguf_bar

    shown = io.StringIO()
    list(gguf_utils.tqdm(range(3), desc="Converting", file=shown))
    assert "Converting" in shown.getvalue()  # the bar this is about draws to its file
    quiet = io.StringIO()
    with _no_gguf_bar():
        assert list(gguf_utils.tqdm(range(3), desc="Converting", file=quiet)) == [0, 1, 2]
    assert quiet.getvalue() == ""
    assert "partial" not in repr(gguf_utils.tqdm)  # put back


@pytest.mark.parametrize("log_format, progress", [("json", False), ("text", True)])
def test_the_first_start_imports_the_default_without_bars_under_a_json_log(
    tmp_path, monkeypatch, log_format, progress
):
    from miserver.server import prepare_home
    from miserver.serving.models import default_model
    from miserver.spec.settings import Settings

    calls = []

    def fake_import(home, progress=True):
        calls.append(progress)
        raise default_model.DefaultModelError("stopped by the test")

    monkeypatch.setattr(default_model, "import_default", fake_import)
    problem = prepare_home(Settings(home=str(tmp_path / "home"), log_format=log_format))
    assert "stopped by the test" in problem
    assert calls == [progress]


async def test_a_checkpoints_model_safetensors_is_as_readable_as_its_other_files(client):
    from tests.unit.test_weights_checkpoints_routes import attach
    from tests.unit.test_weights_routes import post

    h = await attach(client)
    st, body, _ = await post(client, "/api/weights/save", h, {"name": "tiny-perm"})
    assert st == 200, body
    folder = Path(body["data"]["path"])
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == modes["manifest.json"], modes
    assert len(set(modes.values())) == 1, modes


def test_the_imported_defaults_model_safetensors_is_as_readable_as_its_config(default_home):
    from miserver.serving.models.default_model import model_dir

    folder = model_dir(default_home)
    weights = stat.S_IMODE((folder / "model.safetensors").stat().st_mode)
    assert weights == stat.S_IMODE((folder / "config.json").stat().st_mode)


# --- item 18: the trainer guide's torn-recovery code, run as written -----------------------------
def guide_block(marker: str) -> str:
    """The python block that follows ``<!-- torn-recovery: marker -->`` in the trainer guide."""
    text = (Path(__file__).parents[2] / "docs" / "trainer-guide.md").read_text()
    after = text.split(f"<!-- torn-recovery: {marker} -->", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def tear_by_the_watchdog(client) -> None:
    client.attach()
    client.quiesce()
    client.commit_begin()  # ... and the step never ends: the watchdog tears the set
    deadline = time.monotonic() + 10
    while client.status()["weights_state"] != "torn":
        assert time.monotonic() < deadline, "the watchdog never tore the set"
        time.sleep(0.05)


@pytest.mark.parametrize("way", ["checkpoint", "model_id"])
def test_the_trainer_guides_torn_recovery_code_recovers(tmp_path, tiny_model_dir, way):
    from miserver.trainer import WeightsClient
    from tests.unit.test_trainer_client import TRN, ThreadServer

    server = ThreadServer(tmp_path, tiny_model_dir, WEIGHTS_COMMIT_WATCHDOG_MS="200")
    try:
        with WeightsClient(server.url, TRN, timeout=30) as client:
            client.attach()
            saved = client.save("tiny-good")
            client.detach()
            tear_by_the_watchdog(client)
            assert server.chat()[1]["error"]["code"] == "weights_torn"
            namespace = {
                "client": client,
                "checkpoint": saved["name"],
                "model_id": server.app[keys.HOST].resident.row.id,
            }
            exec(compile(guide_block(way), f"trainer-guide.md ({way})", "exec"), namespace)
            status = client.status()
            assert status["weights_state"] == "clean" and status["barrier"] == "serving"
            assert status["steps_since_load"] == 0
            assert server.chat()[0] == 200
            if way == "model_id":  # attached again, to the reloaded tensors
                assert status["attached"] and namespace["model"] is not None
            with client.commit():  # and training goes on
                pass
            assert client.status()["steps_since_load"] == 1
    finally:
        server.stop()


async def test_a_routes_own_409_model_busy_carries_retry_after_too(client, tiny_model_dir):
    other = client.app[keys.CATALOGUE].register(
        name="tiny-other", format="safetensors", dtype="bfloat16", path=tiny_model_dir
    )
    host = client.app[keys.HOST]
    host._busy = "load"  # a model load runs (the catalogue DELETE's own refusal)
    try:
        resp = await client.delete(f"/api/models/{other.id}")
        body = await resp.json()
    finally:
        host._busy = None
    assert resp.status == 409 and body["error"]["code"] == "MODEL_BUSY", body
    assert resp.headers.get("Retry-After") == "1"
