"""``UNIX_SOCKET``: the server also listening on a Unix domain socket, and
``WeightsClient(unix_socket=...)`` sending its calls there (issue 15; settings, UNIX_SOCKET)."""

from __future__ import annotations

import errno
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from miserver.http.protocol import (
    UNIX_SOCKET_MODE,
    bind_unix_socket,
    peer_name,
    remove_unix_socket,
)
from miserver.serving.models.catalogue import Catalogue
from miserver.spec.settings import MAX_SOCKET_PATH_BYTES, ConfigError, load_settings
from miserver.trainer import TransportError, WeightsClient

SECRET = "unix-trainer-secret-0123456789"

pytestmark = pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="needs Unix sockets")


@pytest.fixture
def short_dir():
    """A directory whose socket paths fit ``sun_path`` (pytest's tmp_path can be too long),
    removed afterwards."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="ms-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


# --- the setting -----------------------------------------------------------------------------
def test_unix_socket_is_unset_by_default_and_empty_is_none(tmp_path) -> None:
    assert load_settings({"MISERVER_HOME": str(tmp_path)}).unix_socket is None
    assert load_settings({"MISERVER_HOME": str(tmp_path), "UNIX_SOCKET": " "}).unix_socket is None
    path = str(tmp_path / "m.sock")
    assert load_settings({"MISERVER_HOME": str(tmp_path), "UNIX_SOCKET": path}).unix_socket == path


def test_a_relative_path_is_taken_from_the_working_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    got = load_settings({"MISERVER_HOME": str(tmp_path), "UNIX_SOCKET": "m.sock"}).unix_socket
    assert got == str(tmp_path / "m.sock")


def test_a_path_over_sun_path_or_in_a_missing_directory_is_a_configuration_error(
    tmp_path,
) -> None:
    long = "/tmp/" + "x" * (MAX_SOCKET_PATH_BYTES - 4)
    with pytest.raises(ConfigError) as exc:
        load_settings({"MISERVER_HOME": str(tmp_path), "UNIX_SOCKET": long})
    assert exc.value.variable == "UNIX_SOCKET" and str(MAX_SOCKET_PATH_BYTES) in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        load_settings({"MISERVER_HOME": str(tmp_path), "UNIX_SOCKET": str(tmp_path / "no/m.sock")})
    assert "does not exist" in str(exc.value) and "create it" in str(exc.value)


# --- binding ---------------------------------------------------------------------------------
def test_bind_makes_a_listening_socket_of_mode_0660_and_removes_only_its_own_file(
    short_dir,
) -> None:
    path = str(short_dir / "m.sock")
    first, identity = bind_unix_socket(path)
    try:
        info = os.lstat(path)
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == UNIX_SOCKET_MODE
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)  # listening already: a probe sees a live server
        os.chmod(path, 0o600)  # an operator's chmod (a new ctime) does not hide our file
        os.chmod(path, UNIX_SOCKET_MODE)
        os.unlink(path)  # someone removed it, and a later server bound the same path
        later, _ = bind_unix_socket(path)
        try:
            remove_unix_socket(path, identity)  # the first server's shutdown, still open
            assert stat.S_ISSOCK(os.lstat(path).st_mode)  # the later server's file stays
        finally:
            later.close()
        os.unlink(path)
        Path(path).write_text("a file")
        remove_unix_socket(path, identity)
        assert Path(path).read_text() == "a file"
        os.unlink(path)
    finally:
        first.close()
    sock, identity = bind_unix_socket(path)
    try:
        os.chmod(path, 0o640)  # an operator's chmod changes nothing about removal
        remove_unix_socket(path, identity)
        assert not os.path.lexists(path)
    finally:
        sock.close()


def test_a_stale_socket_is_replaced_a_live_one_a_plain_file_or_a_folder_refused(
    short_dir,
) -> None:
    path = str(short_dir / "m.sock")
    first, _ = bind_unix_socket(path)
    first.close()  # a server that is gone left its file: nobody listens
    second, _ = bind_unix_socket(path)
    try:
        with pytest.raises(OSError) as exc:
            bind_unix_socket(path)
        assert exc.value.errno == errno.EADDRINUSE and "already listens" in str(exc.value)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)  # the live one is untouched
    finally:
        second.close()
    os.unlink(path)
    Path(path).write_text("not a socket")
    with pytest.raises(OSError) as exc:
        bind_unix_socket(path)
    assert exc.value.errno == errno.EEXIST and "not a socket" in str(exc.value)
    assert Path(path).read_text() == "not a socket"  # nothing changed
    folder = short_dir / "d.sock"
    folder.mkdir()
    with pytest.raises(OSError, match="is a directory"):
        bind_unix_socket(str(folder))


def test_a_probe_that_cannot_tell_leaves_the_socket_alone(short_dir, monkeypatch) -> None:
    """Only a refused connect means nobody listens: a socket we may not connect to (EACCES)
    or whose backlog is full (EAGAIN) may belong to a live server."""
    path = str(short_dir / "m.sock")
    sock, _ = bind_unix_socket(path)
    sock.close()  # stale, but the probe below cannot tell

    def refuse(self, address):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    with pytest.raises(OSError) as exc:
        bind_unix_socket(path)
    assert exc.value.errno == errno.EACCES and "cannot tell" in str(exc.value)
    assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_peer_names_in_log_lines() -> None:
    class Transport:
        def __init__(self, peer):
            self.peer = peer

        def get_extra_info(self, name, default=None):
            return self.peer

    assert peer_name(Transport(("127.0.0.1", 5000))) == "127.0.0.1"
    assert peer_name(Transport("")) == "unix"  # a client of the UNIX_SOCKET
    assert peer_name(Transport(None)) == "-"


def test_the_client_refuses_https_with_a_socket_and_names_a_missing_one(short_dir) -> None:
    with pytest.raises(ValueError, match="unix_socket"):
        WeightsClient("https://localhost", SECRET, unix_socket="/tmp/x.sock")
    client = WeightsClient(
        "http://localhost", SECRET, unix_socket=str(short_dir / "none.sock"), heartbeat=False
    )
    assert "unix:" in repr(client) and SECRET not in repr(client)
    with pytest.raises(TransportError, match="attach") as exc:
        client.attach()
    assert str(short_dir / "none.sock") in str(exc.value) and "UNIX_SOCKET" in str(exc.value)


# --- the real server over the socket -------------------------------------------------------------
def serve_to_exit(default_home: str, **env: str) -> subprocess.CompletedProcess:
    """``miserver serve`` on the imported default home (a quick start) with nothing to load and
    ``env`` added, run until it exits (these starts are refused)."""
    return subprocess.run(
        [sys.executable, "-m", "miserver.cli", "serve"],
        env=os.environ
        | {"MISERVER_HOME": default_home, "DEFAULT_MODEL": "", "DEVICE": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_miserver_serve_answers_the_write_cycle_on_its_unix_socket_and_removes_it(
    tmp_path: Path, tiny_model_dir: str, short_dir: Path, default_home: str
) -> None:
    """``miserver serve`` with UNIX_SOCKET: the TCP port still answers; a trainer whose
    ``base_url`` names a closed port attaches, heartbeats (its thread), commits twice and
    detaches over the socket (pipelined pairs), the audit log has the lines; a stalled request
    head on the socket is answered 408; a second server on the same path exits 1 and leaves the
    socket alone; SIGTERM removes the socket file."""
    home = tmp_path / "home"
    Catalogue(str(home)).register(
        name="tiny", format="safetensors", dtype="bfloat16", path=tiny_model_dir
    )
    path = str(short_dir / "m.sock")
    audit = tmp_path / "audit.jsonl"
    log = tmp_path / "server.log"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "miserver.cli", "serve"],
        env=os.environ
        | {
            "MISERVER_HOME": str(home),
            "PORT": str(port),
            "UNIX_SOCKET": path,
            "DEFAULT_MODEL": "tiny",
            "DEVICE": "cpu",
            "WEIGHTS_CPU_ATTACH": "1",
            "WEIGHTS_COMMIT_WATCHDOG_MS": "60000",
            "WEIGHTS_TOKENS": f"lab:trainer:{SECRET}",
            "WEIGHTS_AUDIT_LOG": str(audit),
            "WEIGHTS_HEARTBEAT_INTERVAL_HINT_S": "0.2",
            "HEADER_READ_TIMEOUT_S": "5",  # the stalled head below waits 30 s for its 408
            "LOG_FORMAT": "text",
        },
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        # port 1 is closed: every call of this client must go over the socket
        client = WeightsClient("http://127.0.0.1:1", SECRET, unix_socket=path)
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if client.status()["resident_model"] is not None:
                    break
            except TransportError:
                pass
            time.sleep(0.3)
        assert stat.S_IMODE(os.lstat(path).st_mode) == UNIX_SOCKET_MODE
        tcp = WeightsClient(f"http://127.0.0.1:{port}", SECRET, heartbeat=False)
        assert tcp.status()["weights_state"] == "clean"  # TCP still serves
        with client:
            attachment = client.attach()
            deadline = time.monotonic() + 60
            while audit.read_text().count('"operation":"weights_heartbeat"') < 2:
                assert time.monotonic() < deadline, "the heartbeat thread sent nothing"
                time.sleep(0.1)
            assert client.heartbeat_error is None
            weights = attachment.weights.unique_tensors()
            for _ in range(2):
                with client.commit() as cycle, torch.no_grad():
                    weights[0].mul_(1.0)
                assert cycle.end is not None and cycle.end["weights_state"] == "clean"
            assert client.heartbeat()["attachment_state"] == "active"
            del weights, attachment
        assert tcp.status()["steps_since_load"] == 2
        text = audit.read_text()
        for op in ("weights_attach", "weights_quiesce", "weights_commit_end", "weights_detach"):
            assert f'"operation":"{op}"' in text
        assert SECRET not in log.read_text() and SECRET not in text
        assert f"unix:{path}" in log.read_text()
        with socket.socket(socket.AF_UNIX) as raw:  # a head that never ends: 408, closed
            raw.settimeout(30)
            raw.connect(path)
            raw.sendall(b"GET /api/weights/status HTTP/1.1\r\nHost: x\r\n")
            answer = b""
            while chunk := raw.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b'"success":false' in answer, answer
        assert "closed a connection from unix" in log.read_text()
        second = serve_to_exit(default_home, PORT="0", UNIX_SOCKET=path)
        assert second.returncode == 1, second.stderr[-2000:]
        assert "already listens" in second.stderr
        assert tcp.status()["weights_state"] == "clean" and os.path.exists(path)
        assert client.status()["weights_state"] == "clean"  # the first server's socket works
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert not os.path.lexists(path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_a_taken_tcp_port_exits_1_saying_to_set_port(default_home: str, short_dir: Path) -> None:
    """The start fails on the TCP port after the socket was bound: exit 1, one line that says
    what to do, and the socket file it made is gone again."""
    path = str(short_dir / "m.sock")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = serve_to_exit(default_home, PORT=str(port), UNIX_SOCKET=path, LOG_FORMAT="text")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"cannot listen on http://127.0.0.1:{port}" in proc.stderr
    assert "set PORT to a free one" in proc.stderr
    assert not os.path.lexists(path)


def _mocked_request(peername: object):
    from unittest import mock

    from aiohttp.test_utils import make_mocked_request

    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda key, default=None: (
        peername if key == "peername" else default
    )
    return make_mocked_request("GET", "/api/health", transport=transport)


def test_a_socket_client_is_logged_as_unix_in_the_access_and_refusal_lines(caplog) -> None:
    """Breaker finding (2026-12-03): the access line showed a socket client as ``-`` and the
    refusal line as an empty name, where the timeout lines said ``unix``."""
    import logging

    from aiohttp import web

    from miserver.http.protocol import request_peer
    from miserver.server import AccessLogger

    assert request_peer(_mocked_request("")) == "unix"  # AF_UNIX: an empty peer name
    assert request_peer(_mocked_request(("10.1.2.3", 40000))) == "10.1.2.3"
    assert request_peer(_mocked_request(None)) == "-"
    logger = logging.getLogger("miserver.test.access")
    with caplog.at_level(logging.INFO, logger=logger.name):
        AccessLogger(logger, "").log(_mocked_request(""), web.Response(text="{}"), 0.001)
    assert caplog.records[-1].getMessage().startswith('unix "GET /api/health HTTP/1.1" 200 ')
