"""The trainer's HTTP client (``miserver.trainer.WeightsClient``) against a real server.

The server is the real app (``create_app``) serving a tiny real Llama attachably on the CPU
(``WEIGHTS_CPU_ATTACH=1``) on a loopback port, its event loop in a background thread; the client
is synchronous and runs in the test's thread, as it would in a trainer.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from miserver import trainer
from miserver.spec import codes
from miserver.trainer import (
    AlreadyAttached,
    NoOpenCommit,
    NotAttached,
    TransportError,
    WeightsClient,
    WeightsError,
    WeightsForbidden,
    WeightsUnauthorized,
)
from miserver.trainer import transport as trainer_transport
from tests.waiting import wait_until

TRN = "trainer-secret-0123456789"
TRN2 = "trainer2-secret-0123456789"
OPS = "operator-secret-0123456789"
REPO = Path(__file__).resolve().parents[2]


class ThreadServer:
    """The real app on 127.0.0.1:<free port>, its loop in a daemon thread."""

    def __init__(self, tmp_path: Path, model_dir: str, **env: str) -> None:
        from miserver.serving.models.catalogue import Catalogue
        from miserver.spec.settings import load_settings

        home = tmp_path / "home"
        Catalogue(str(home)).register(
            name="tiny", format="safetensors", dtype="bfloat16", path=model_dir
        )
        self.audit = tmp_path / "audit.jsonl"
        self.settings = load_settings(
            {
                "MISERVER_HOME": str(home),
                "DEFAULT_MODEL": "tiny",
                "DEVICE": "cpu",
                "WEIGHTS_TOKENS": f"trn:trainer:{TRN},trn2:trainer:{TRN2},ops:operator:{OPS}",
                "WEIGHTS_CPU_ATTACH": "1",
                "WEIGHTS_AUDIT_LOG": str(self.audit),
                **env,
            }
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(120)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> None:
        from aiohttp import web

        from miserver.http import keys
        from miserver.http.app import create_app

        self.app = create_app(self.settings)
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        await self.app[keys.STARTUP_LOAD]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def chat(self) -> tuple[int, dict, dict]:
        import requests

        r = requests.post(
            self.url + "/v1/chat/completions",
            timeout=60,
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "temperature": 0,
            },
        )
        return r.status_code, r.json(), dict(r.headers)

    def audit_lines(self) -> list[dict]:
        return [json.loads(x) for x in self.audit.read_text().splitlines()]


@pytest.fixture
def server(tmp_path, tiny_model_dir):
    s = ThreadServer(tmp_path, tiny_model_dir)
    yield s
    s.stop()


@pytest.fixture
def client(server):
    c = WeightsClient(server.url, TRN, timeout=30)
    yield c
    c.close()


def test_every_code_has_its_exception_class_generated_from_codes() -> None:
    for name in codes.WEIGHTS_PAGE_CODES:
        cls = trainer.ERROR_CLASSES[name]
        assert issubclass(cls, WeightsError) and issubclass(cls, trainer.TrainerError)
        assert cls.__name__ == "".join(p.capitalize() for p in name.split("_"))
        assert getattr(trainer, cls.__name__) is cls
        assert cls.CODE is codes.ALL[name]
    assert set(trainer.ERROR_CLASSES) == set(codes.ALL)
    assert trainer.WeightsTorn.__name__ == "WeightsTorn" and trainer.NotQuiesced.CODE.status == 409
    assert trainer.error_class("SOMETHING_NEW") is WeightsError
    assert trainer.error_class(None) is WeightsError


def test_full_cycle_writes_land_in_the_served_storage_and_the_header_counts(server, client):
    att = client.attach()
    assert att.weights_state == "clean" and att.steps_since_load == 0
    assert att.model_ref["name"] == "tiny" and att.config["model_type"] == "llama"
    assert "attachment_id" not in att.body
    name = "model.layers.0.mlp.down_proj.weight"
    pattern = (
        torch.arange(att.tensors[name].numel(), dtype=torch.float32)
        .reshape(att.tensors[name].shape)
        .remainder(61)
        .div(8)
        .to(torch.bfloat16)
    )
    with client.commit() as cycle, torch.no_grad():
        att.tensors[name].copy_(pattern)
    assert cycle.quiesce["weights_state"] == "clean"
    assert cycle.begin["weights_state"] == "writing"
    assert cycle.end["steps_since_load"] == 1 and cycle.end["overran"] is False
    assert cycle.resume == {"barrier": "serving", "weights_state": "clean"}
    assert cycle.steps_since_load == 1 == client.steps_since_load
    st, _, headers = server.chat()
    assert st == 200 and headers["X-miLLM-Model"] == '"tiny";origin=model;commits=1'
    status = client.status()
    assert status["attached"] and status["steps_since_load"] == 1
    assert status["barrier"] == "serving" and status["weights_state"] == "clean"
    answer = client.detach()
    assert answer == {"weights_state": "clean", "barrier": "serving"}
    assert att.released and att.weights.lingering == 0 and client.detach() is None
    # a fresh attach maps the same shared memory again: the write is there
    again = client.attach()
    assert torch.equal(again.tensors[name], pattern)
    client.detach()
    # the last line is written just after its answer: wait for all eight
    ops = [line["operation"] for line in _audit_settled(server, 8)]
    assert ops == [
        "weights_attach",
        "weights_quiesce",
        "weights_commit_begin",
        "weights_commit_end",
        "weights_resume",
        "weights_detach",
        "weights_attach",
        "weights_detach",
    ]


def test_build_model_binds_the_served_tensors_and_detach_empties_them(client):
    att = client.attach(build_model=True)
    model = att.model
    assert att.build_model() is model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    emb = att.tensors["model.embed_tokens.weight"]
    assert model.model.embed_tokens.weight.data_ptr() == emb.data_ptr()
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 49152) and torch.isfinite(logits).all()
    client.detach()
    assert model.model.embed_tokens.weight.numel() == 0
    assert client.status()["attached"] is False


def test_refusals_are_typed_and_carry_code_reason_status_details(server, client):
    client.attach()
    other = WeightsClient(server.url, TRN2, timeout=30)
    with pytest.raises(AlreadyAttached) as exc:
        other.attach()
    assert exc.value.status == 409 and exc.value.code == "ALREADY_ATTACHED"
    assert exc.value.details["holder"]["label"] == "trn"
    assert other._attachment_id is None
    with pytest.raises(AlreadyAttached):
        client.attach()  # this client already holds one: refused before anything is sent
    with pytest.raises(NoOpenCommit):
        client.commit_end()
    with pytest.raises(WeightsForbidden) as exc:
        client.clear_stale()
    assert exc.value.status == 403
    with pytest.raises(WeightsUnauthorized) as exc:
        WeightsClient(server.url, "not-a-token-0123456789").clear_stale()
    assert exc.value.status == 401
    ops = WeightsClient(server.url, OPS, timeout=30)
    with pytest.raises(trainer.AttachmentNotStale):
        ops.clear_stale()
    with pytest.raises(trainer.NotAttachedHere):
        other.quiesce()  # no attachment: refused locally, nothing sent
    client.detach()
    with pytest.raises(NotAttached):
        other._attachment_id = "0" * 32
        other.quiesce()
    other._attachment_id = None
    assert TRN not in str(exc.value) and OPS not in repr(ops) and TRN not in repr(client)


def test_an_exception_in_the_block_still_ends_the_commit_and_resumes(client):
    client.attach()
    with pytest.raises(ZeroDivisionError), client.commit() as cycle:
        1 / 0  # noqa: B018
    assert cycle.end["steps_since_load"] == 1 and cycle.resume["barrier"] == "serving"
    status = client.status()
    assert status["weights_state"] == "clean" and status["barrier"] == "serving"
    assert status["steps_since_load"] == 1


def test_a_dying_process_leaves_the_commit_open_for_the_watchdog(tmp_path, tiny_model_dir):
    server = ThreadServer(tmp_path, tiny_model_dir, WEIGHTS_COMMIT_WATCHDOG_MS="150")
    try:
        with WeightsClient(server.url, TRN, timeout=30) as client:
            client.attach()
            with pytest.raises(KeyboardInterrupt), client.commit():
                raise KeyboardInterrupt
            assert client.status()["weights_state"] in ("writing", "torn")
            status = wait_until(
                lambda: (st := client.status())["weights_state"] == "torn" and st,
                "the watchdog tore the open commit",
            )
            assert status["weights_state"] == "torn" and status["barrier"] == "quiesced"
            st, body, headers = server.chat()
            assert st == 503 and body["error"]["code"] == "weights_torn"
            assert "Retry-After" in headers
            with pytest.raises(trainer.WeightsNotClean), client.commit():
                pass
            late = client.commit_end()  # the beginner's late commit-end recovers (overrun)
            assert late["overran"] is True and late["weights_state"] == "clean"
            client.resume()
            assert server.chat()[0] == 200
    finally:
        server.stop()


def _audit_settled(server, count: int) -> list[dict]:
    """The audit lines once ``count`` are written (a line is written just after its answer)."""
    deadline = time.monotonic() + 5
    lines = server.audit_lines()
    while len(lines) < count and time.monotonic() < deadline:
        time.sleep(0.02)
        lines = server.audit_lines()
    return lines


def _audit_ops(server, count: int) -> list[tuple[str, str]]:
    """``(operation, outcome)`` of each audit line once ``count`` are written."""
    return [(x["operation"], x["outcome"]) for x in _audit_settled(server, count)]


def _refuse_once(server, trigger: str, code: str, reason: str | None = None) -> None:
    """Make the real server's runtime refuse the next ``trigger`` call as the lifecycle would
    (an :class:`ApiError` with the code's status, audited by the route), deciding nothing."""
    from miserver.http import keys
    from miserver.spec.errors import ApiError

    runtime = server.app[keys.WEIGHTS]
    real = runtime.gated

    async def gated(trig, *args, **kwargs):
        if trig == trigger:
            runtime.gated = real
            raise ApiError(codes.ALL[code], f"refused for the test ({code})", reason=reason)
        return await real(trig, *args, **kwargs)

    runtime.gated = gated


def test_a_refused_commit_begin_resumes_the_barrier(server, client):
    client.attach()
    _refuse_once(server, "commit_begin", "PAUSE_IN_PROGRESS")
    with pytest.raises(trainer.PauseInProgress) as exc, client.commit():
        pytest.fail("the block must not run")
    assert exc.value.status == 409
    status = client.status()
    assert status["barrier"] == "serving" and status["weights_state"] == "clean"
    assert status["steps_since_load"] == 0
    with client.commit() as cycle:  # the connection and the barrier are usable again
        pass
    assert cycle.steps_since_load == 1
    lines = _audit_ops(server, 9)
    assert lines[1:5] == [
        ("weights_quiesce", "accepted"),
        ("weights_commit_begin", "refused"),
        ("weights_resume", "accepted"),
        ("weights_quiesce", "accepted"),
    ]


def test_a_refused_quiesce_raises_its_own_error_after_reading_commit_begins(
    tmp_path, tiny_model_dir
):
    server = ThreadServer(tmp_path, tiny_model_dir, WEIGHTS_COMMIT_WATCHDOG_MS="150")
    try:
        with WeightsClient(server.url, TRN, timeout=30, heartbeat=False) as client:
            client.attach()
            client.quiesce()
            client.commit_begin()
            time.sleep(0.4)  # the watchdog tears the open commit
            assert client.status()["weights_state"] == "torn"
            with pytest.raises(trainer.WeightsNotClean) as exc, client.commit():
                pytest.fail("the block must not run")
            assert exc.value.code == "WEIGHTS_NOT_CLEAN"  # the quiesce's, not commit-begin's
            notes = " ".join(getattr(exc.value, "__notes__", []))
            assert "commit-begin was not accepted either" in notes and "409" in notes
            late = client.commit_end()  # both answers were read: the connection is in step
            assert late["overran"] is True and late["weights_state"] == "clean"
            client.resume()
        audit = _audit_settled(server, 8)
        lines = [(x["operation"], x["outcome"], x["code"]) for x in audit]
        assert lines[3:7] == [
            ("weights_quiesce", "refused", "WEIGHTS_NOT_CLEAN"),
            ("weights_commit_begin", "refused", "WEIGHTS_NOT_CLEAN"),
            ("weights_commit_end", "accepted", None),
            ("weights_resume", "accepted", None),
        ]
    finally:
        server.stop()


def test_a_commit_begin_accepted_after_a_refused_quiesce_is_ended_not_left_open(server, client):
    client.attach()
    client.quiesce()  # this attachment holds the barrier: commit() quiesces again
    with pytest.raises(trainer.AlreadyQuiesced) as exc, client.commit():
        pytest.fail("the block must not run")
    notes = " ".join(getattr(exc.value, "__notes__", []))
    assert "empty commit was ended and the barrier resumed" in notes
    status = client.status()
    assert status["weights_state"] == "clean" and status["barrier"] == "serving"
    assert status["commit"] is None and status["steps_since_load"] == 1 == client.steps_since_load
    lines = _audit_ops(server, 6)
    assert lines[1:] == [
        ("weights_quiesce", "accepted"),
        ("weights_quiesce", "refused"),
        ("weights_commit_begin", "accepted"),
        ("weights_commit_end", "accepted"),
        ("weights_resume", "accepted"),
    ]


def test_a_refused_commit_end_is_raised_after_reading_resumes(tmp_path, tiny_model_dir):
    server = ThreadServer(
        tmp_path,
        tiny_model_dir,
        WEIGHTS_HEARTBEAT_TIMEOUT_S="0.3",
        WEIGHTS_HEARTBEAT_INTERVAL_HINT_S="0.1",
        WEIGHTS_COMMIT_WATCHDOG_MS="5000",
    )
    try:
        client = WeightsClient(server.url, TRN, timeout=30, heartbeat=False)
        ops = WeightsClient(server.url, OPS, timeout=30)
        client.attach()
        with pytest.raises(NotAttached) as exc, client.commit():
            time.sleep(0.5)  # stale by now; the operator clears it while the commit is open
            ops.clear_stale()
        assert exc.value.code == "NOT_ATTACHED"
        notes = " ".join(getattr(exc.value, "__notes__", []))
        assert "resume was not accepted either" in notes
        audit = _audit_settled(server, 6)  # attach, quiesce, begin, clear-stale, end, resume
        lines = [(x["operation"], x["outcome"], x["code"]) for x in audit]
        assert lines[-2:] == [
            ("weights_commit_end", "refused", "NOT_ATTACHED"),
            ("weights_resume", "refused", "NOT_ATTACHED"),
        ]
        assert client.status()["attached"] is False
        client._attachment_id = None  # the server holds none; nothing to detach
        client.close()
    finally:
        server.stop()


def test_a_refused_resume_after_an_accepted_commit_end_is_raised(server, client):
    client.attach()
    _refuse_once(server, "resume", "PAUSE_IN_PROGRESS")
    with pytest.raises(trainer.PauseInProgress), client.commit() as cycle:
        pass
    assert cycle.end["steps_since_load"] == 1 == client.steps_since_load
    assert cycle.resume is None
    assert client.status()["barrier"] == "quiesced"  # nothing resumed it
    client.resume()
    assert client.status()["barrier"] == "serving"


def _lose_opening_answers(client: WeightsClient, which: str) -> None:
    """Make the next opening pair reach the real server (both calls decided there) and then
    lose its answers as a dropped connection would: ``"second"`` (commit-begin's answer) or
    ``"both"`` (the first answer could not be read: request_pair raises)."""
    session = client._session
    real = session.request_pair

    def request_pair(method, paths, headers, timeout, first_body=None):
        session.request_pair = real  # once
        one, _ = real(method, paths, headers, timeout, first_body)
        lost = trainer.TransportError(f"{method} {paths[-1]}: RemoteDisconnected (the test)")
        if which == "both":
            raise lost
        return one, lost

    session.request_pair = request_pair


@pytest.mark.parametrize("which", ["second", "both"])
def test_a_lost_opening_answer_ends_the_commit_it_may_have_opened(server, client, which):
    """Breaker finding (2026-12-03): commit-begin accepted but its answer lost left the commit
    open, the resume was refused WEIGHTS_NOT_CLEAN and the watchdog tore the set."""
    client.attach()
    _lose_opening_answers(client, which)
    with pytest.raises(trainer.TransportError) as exc, client.commit():
        pytest.fail("the block must not run")
    notes = " ".join(getattr(exc.value, "__notes__", []))
    assert "empty commit was ended" in notes and "the barrier was resumed" in notes, notes
    status = client.status()
    assert (status["barrier"], status["weights_state"]) == ("serving", "clean"), status
    assert status["steps_since_load"] == 1 == client.steps_since_load  # the empty commit
    with client.commit() as cycle:  # and the next step goes through
        pass
    assert cycle.steps_since_load == 2
    ops = _audit_ops(server, 9)
    assert ops[1:5] == [
        ("weights_quiesce", "accepted"),
        ("weights_commit_begin", "accepted"),
        ("weights_commit_end", "accepted"),
        ("weights_resume", "accepted"),
    ], ops


def test_a_lost_answer_with_nothing_open_only_resumes(server, client):
    """The opening pair's answers lost when commit-begin was refused: commit-end is refused
    (no commit open), the resume releases the barrier, and the note says so."""
    client.attach()
    _refuse_once(server, "commit_begin", "PAUSE_IN_PROGRESS")
    _lose_opening_answers(client, "second")
    with pytest.raises(trainer.TransportError) as exc, client.commit():
        pytest.fail("the block must not run")
    notes = " ".join(getattr(exc.value, "__notes__", []))
    assert "no commit was open" in notes and "the barrier was resumed" in notes, notes
    status = client.status()
    assert (status["barrier"], status["weights_state"]) == ("serving", "clean"), status
    assert status["steps_since_load"] == 0 == client.steps_since_load


def test_a_refusal_names_the_refused_call(server, client):
    """Breaker finding (2026-12-03): a refusal raised from a pipelined pair did not say which
    call of the pair it answered."""
    client.attach()
    _refuse_once(server, "commit_end", "PAUSE_IN_PROGRESS")
    with pytest.raises(trainer.PauseInProgress) as exc, client.commit():
        pass
    assert exc.value.call == "POST /api/weights/commit-end"
    assert str(exc.value).startswith("POST /api/weights/commit-end: 409 PAUSE_IN_PROGRESS"), str(
        exc.value
    )
    again = pickle.loads(pickle.dumps(exc.value))
    assert (type(again), again.call, str(again)) == (
        type(exc.value),
        exc.value.call,
        str(exc.value),
    )


END = b"\r\n\r\n"


class _PairsOnly:
    """A raw HTTP/1.1 server that answers only once both requests of a pair have arrived:
    a client that waits for the first answer before sending the second times out."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.failure: str | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        conn.settimeout(5)
        answers = [
            {"weights_state": "clean", "quiesced_at": "x"},
            {"weights_state": "writing", "began_at": "x", "watchdog_ms": 800},
            {"weights_state": "clean", "steps_since_load": 7, "commit_ms": 0.1, "overran": False},
            {"barrier": "serving", "weights_state": "clean"},
        ]
        buf = b""
        with conn:
            for pair in (answers[:2], answers[2:]):
                try:
                    while buf.count(END) < 2:
                        chunk = conn.recv(65536)
                        if not chunk:
                            self.failure = "closed"
                            return
                        buf += chunk
                except TimeoutError:
                    got = buf.count(END)
                    self.failure = f"only {got} request(s) of a pair arrived"
                    return
                for _ in range(2):
                    head, buf = buf.split(END, 1)
                    line, *fields = head.decode().split("\r\n")
                    hdrs = dict(f.split(": ", 1) for f in fields)
                    self.requests.append((line, hdrs))
                out = b""
                for data in pair:
                    body = json.dumps({"success": True, "data": data, "error": None}).encode()
                    out += (
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(body)}\r\n\r\n".encode()
                        + body
                    )
                conn.sendall(out)


def test_commit_sends_each_pair_of_calls_in_one_write_before_reading_an_answer():
    srv = _PairsOnly()
    client = WeightsClient(f"http://127.0.0.1:{srv.port}", TRN, timeout=10, heartbeat=False)
    client._attachment_id = "a" * 32  # pretend to hold one: this server only answers pairs
    with client.commit() as cycle:
        assert cycle.begin["weights_state"] == "writing"
    srv.thread.join(10)
    assert srv.failure is None
    assert [line for line, _ in srv.requests] == [
        f"POST /api/weights/{name} HTTP/1.1"
        for name in ("quiesce", "commit-begin", "commit-end", "resume")
    ]
    for _, hdrs in srv.requests:
        assert hdrs["Authorization"] == f"Bearer {TRN}"
        assert hdrs[trainer.ATTACHMENT_HEADER] == "a" * 32
        assert hdrs["Host"] == f"127.0.0.1:{srv.port}" and hdrs["Content-Length"] == "0"
    assert cycle.steps_since_load == 7 == client.steps_since_load
    assert cycle.resume == {"barrier": "serving", "weights_state": "clean"}
    client._attachment_id = None


def test_heartbeat_thread_runs_at_the_hint_and_stops_on_detach(tmp_path, tiny_model_dir):
    # The staleness window is 30 hints long, and the test waits for heartbeats rather than for
    # a time: a loaded machine delays them, and nothing here depends on how much.
    server = ThreadServer(
        tmp_path,
        tiny_model_dir,
        WEIGHTS_HEARTBEAT_INTERVAL_HINT_S="0.1",
        WEIGHTS_HEARTBEAT_TIMEOUT_S="3",
    )
    try:
        with WeightsClient(server.url, TRN, timeout=30) as client:
            attached_at = time.monotonic()
            client.attach()
            assert client.heartbeat_interval_s == 0.1
            wait_until(lambda: client.heartbeats_sent >= 3, "three heartbeats answered")
            # At the hint, not faster: three waits of 0.1 s came before the third heartbeat.
            assert time.monotonic() - attached_at >= 0.3
            seen = client.status()["attachment"]["last_heartbeat_at"]
            assert seen is not None
            # Past the staleness window: only the heartbeat keeps the attachment active.
            wait_until(lambda: time.monotonic() - attached_at > 3.5, "the staleness window passed")
            status = client.status()
            assert status["attachment"]["state"] == "active"
            assert status["attachment"]["last_heartbeat_at"] != seen
            assert client.heartbeat_error is None
            thread = client._hb_thread
            client.detach()
            assert thread is not None and not thread.is_alive()
            sent = client.heartbeats_sent
            time.sleep(0.3)  # a stopped thread sends nothing more, however long this is
            assert client.heartbeats_sent == sent
            assert not any(t.name == "miserver-heartbeat" for t in threading.enumerate())
    finally:
        server.stop()


def test_a_cleared_attachment_stops_the_heartbeat_and_the_next_commit_raises(
    tmp_path, tiny_model_dir, caplog
):
    server = ThreadServer(
        tmp_path,
        tiny_model_dir,
        WEIGHTS_HEARTBEAT_INTERVAL_HINT_S="0.1",
        WEIGHTS_HEARTBEAT_TIMEOUT_S="0.3",
    )
    try:
        client = WeightsClient(server.url, TRN, timeout=30, heartbeat=False)
        client.attach()
        wait_until(
            lambda: client.status()["attachment"]["state"] == "stale",
            "the attachment without heartbeats went stale",
        )
        ops = WeightsClient(server.url, OPS, timeout=30)
        assert ops.clear_stale()["cleared"]["label"] == "trn"
        with caplog.at_level(logging.WARNING, logger="miserver.trainer"):
            client.start_heartbeat()
            wait_until(lambda: not client._hb_thread.is_alive(), "the refused heartbeat stopped")
        assert isinstance(client.heartbeat_error, NotAttached)
        assert any("heartbeat refused" in r.getMessage() for r in caplog.records)
        with pytest.raises(NotAttached), client.commit():
            pytest.fail("the block must not run")
        assert client.detach() is None  # the server has nothing: the client lets go
    finally:
        server.stop()
    assert client._attachment_id is None and client.attachment.released


def test_a_failed_rebuild_detaches_before_raising(client, monkeypatch):
    import miserver.trainer.client as tc

    def refuse(body, on_release=None):
        raise trainer.ProducerMismatch({"torch": ("9.9", torch.__version__)})

    monkeypatch.setattr(tc, "rebuild", refuse)
    with pytest.raises(trainer.ProducerMismatch):
        client.attach()
    assert client.status()["attached"] is False and client._attachment_id is None


def test_the_context_manager_detaches_on_an_exception(server):
    with pytest.raises(RuntimeError, match="boom"), WeightsClient(server.url, TRN) as c:
        att = c.attach()
        raise RuntimeError("boom")
    assert att.released and c.status()["attached"] is False


def test_no_token_or_attachment_id_in_logs_reprs_or_errors(server, client, caplog):
    caplog.set_level(logging.DEBUG)
    att = client.attach()
    att_id = client._attachment_id
    with client.commit():
        pass
    texts = [repr(client), repr(att), str(att.body), repr(client._auth)]
    with pytest.raises(AlreadyAttached) as exc:
        WeightsClient(server.url, TRN2).attach()
    texts += [str(exc.value), repr(exc.value), json.dumps(exc.value.details)]
    client.detach()
    texts += [r.getMessage() for r in caplog.records]
    texts.append(server.audit.read_text())
    for text in texts:
        assert TRN not in text and TRN2 not in text and att_id not in text


def test_transport_errors_and_foreign_answers_are_typed(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransportError) as exc:
        WeightsClient(f"http://127.0.0.1:{port}", TRN, timeout=2).attach()
    assert TRN not in str(exc.value)

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.send_response(502)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(b"bad gateway")

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(WeightsError) as exc:
            WeightsClient(f"http://127.0.0.1:{srv.server_address[1]}", TRN).attach()
        assert exc.value.status == 502 and exc.value.code is None
        assert type(exc.value) is WeightsError
    finally:
        srv.shutdown()
    with pytest.raises(ValueError):
        WeightsClient("127.0.0.1:8000", TRN)


ATEXIT_CHILD = """
import sys
from miserver.trainer import WeightsClient
client = WeightsClient(sys.argv[1], sys.argv[2])
att = client.attach(build_model=True)
KEEP = att.model  # a module global still holding the views at exit
print("attached", flush=True)
"""


def test_interpreter_exit_detaches(server):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [sys.executable, "-c", ATEXIT_CHILD, server.url, TRN],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0 and "attached" in proc.stdout, proc.stderr[-3000:]
    status = WeightsClient(server.url, TRN).status()
    assert status["attached"] is False
    ops = [line["operation"] for line in server.audit_lines()]
    assert [op for op in ops if op != "weights_heartbeat"] == ["weights_attach", "weights_detach"]


def test_save_records_the_commits_and_load_restores_the_checkpoint(server, client):
    att = client.attach()
    name = "model.norm.weight"
    original = att.tensors[name].clone()
    with client.commit(), torch.no_grad():
        att.tensors[name].fill_(0.5)
    saved = client.save("tiny-half")
    assert saved["name"] == "tiny-half" and saved["steps_since_load"] == 1
    assert len(saved["checkpoint_sha256"]) == 64
    assert client.status()["last_save"]["checkpoint_sha256"] == saved["checkpoint_sha256"]
    with pytest.raises(trainer.CheckpointExists):
        client.save("tiny-half")
    with client.commit(), torch.no_grad():
        att.tensors[name].copy_(original)
    st, _, headers = server.chat()
    assert st == 200 and headers["X-miLLM-Model"] == '"tiny-half";origin=checkpoint;commits=1'
    loaded = client.load(checkpoint="tiny-half")  # the holder loads in place
    assert loaded["in_place"] is True and loaded["steps_since_load"] == 0
    assert client.steps_since_load == 0
    assert torch.equal(att.tensors[name], torch.full_like(original, 0.5))
    with pytest.raises(trainer.CheckpointNotFound):
        client.load(checkpoint="no-such-checkpoint")
    with pytest.raises(ValueError):
        client.load()


class _Counting(http.server.BaseHTTPRequestHandler):
    """Answers GET status keep-alive, then closes the connection behind the client's back;
    a POST is read and the connection dropped without an answer."""

    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str]] = []

    def do_GET(self):  # noqa: N802
        self.seen.append(("GET", self.path))
        body = b'{"success": true, "data": {"attached": false}, "error": null}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True  # without saying so: the client finds out on reuse

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append(("POST", self.path))
        self.close_connection = True  # no answer at all

    def log_message(self, *a):
        pass


def closed_by_server(client: WeightsClient) -> bool:
    conn = client._session._conn
    return conn is None or conn.sock is None or trainer_transport._dropped(conn.sock)


def test_a_connection_the_server_closed_is_reopened_and_a_post_is_never_resent():
    _Counting.seen = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        client = WeightsClient(f"http://127.0.0.1:{srv.server_address[1]}", TRN, timeout=5)
        assert client.status() == {"attached": False}
        wait_until(lambda: closed_by_server(client), "the server closed the idle connection")
        assert client.status() == {"attached": False}  # a new connection, not an error
        # Let the server close that one too, so the POST goes out on a fresh connection and
        # reaches the handler (sent into a closing socket, it would never be seen: also no
        # resend, but then the test could not tell).
        wait_until(lambda: closed_by_server(client), "the server closed the idle connection")
        client._attachment_id = "x" * 32  # pretend to hold one, to send a holder call
        with pytest.raises(TransportError):
            client.commit_end()
        client._attachment_id = None
        assert _Counting.seen == [("GET", "/api/weights/status")] * 2 + [
            ("POST", "/api/weights/commit-end")
        ]
    finally:
        srv.shutdown()


def test_the_served_tokenizer_makes_a_batch_the_attached_model_trains_on(client):
    att = client.attach()
    tok = client.tokenizer()
    batch = trainer.chat_batch(
        tok,
        [([{"role": "user", "content": "hi"}], "hello")],
        device=next(att.model.parameters()).device,
    )
    loss = att.model(**batch).loss
    assert torch.isfinite(loss) and batch["labels"][0, -1] == tok.eos_token_id
    client.detach()
    with pytest.raises(trainer.NotAttachedHere):
        client.tokenizer()


def test_the_guides_raw_pipelining_example_drives_a_real_server(server, client):
    """docs/trainer-guide.md, "Two round trips a step instead of four": its ``pair`` function,
    run as printed, against the real server (a refused pair included)."""
    guide = (REPO / "docs" / "trainer-guide.md").read_text()
    section = guide.split("### Two round trips a step instead of four", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(code.split("\nsock = socket.create_connection", 1)[0], namespace)  # noqa: S102
    pair = namespace["pair"]
    client.attach()
    host = server.url.removeprefix("http://")
    sock = socket.create_connection(("127.0.0.1", server.port))
    hdrs = {"Authorization": f"Bearer {TRN}", trainer.ATTACHMENT_HEADER: client._attachment_id}
    try:
        (q, _), (b, bb) = pair(sock, host, "quiesce", "commit-begin", hdrs)
        assert (q, b) == (200, 200) and bb["data"]["weights_state"] == "writing"
        (e, eb), (r, rb) = pair(sock, host, "commit-end", "resume", hdrs)
        assert (e, r) == (200, 200) and eb["data"]["steps_since_load"] == 1
        assert rb["data"] == {"barrier": "serving", "weights_state": "clean"}
        (e, eb), (r, rb) = pair(sock, host, "commit-end", "resume", hdrs)  # nothing open
        assert e == 409 and eb["error"]["code"] == "NO_OPEN_COMMIT" and r == 200
    finally:
        sock.close()
    assert client.status()["steps_since_load"] == 1
