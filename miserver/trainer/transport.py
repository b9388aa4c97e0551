"""The trainer client's HTTP plumbing: one keep-alive connection (and a pipelined pair of
requests), the bearer token kept out of reprs, and an answer turned into its data or its
:class:`~miserver.trainer.errors.WeightsError`. Used by :mod:`miserver.trainer.client`.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from miserver.trainer.errors import TransportError, WeightsError, _make_error


class _Bearer:
    """Holds the token; its repr never shows it."""

    def __init__(self, token: str) -> None:
        self.header = f"Bearer {token}"

    def __repr__(self) -> str:
        return "<Bearer token>"


def _dropped(sock: socket.socket) -> bool:
    """Whether an idle keep-alive connection was closed by the server (readable: EOF or
    unexpected bytes), the check urllib3 makes before reusing a pooled connection."""
    if hasattr(select, "poll"):
        p = select.poll()
        p.register(sock, select.POLLIN)
        return bool(p.poll(0))
    return bool(select.select([sock], [], [], 0)[0])


class _Response:
    __slots__ = ("status", "headers", "data")

    def __init__(self, status: int, headers: Any, data: bytes) -> None:
        self.status, self.headers, self.data = status, headers, data


class _SharedReader:
    """One buffered reader of the socket shared by the responses of a pipelined pair: each
    :class:`http.client.HTTPResponse` would otherwise buffer its own reader and could swallow
    the start of the next answer. ``close`` is a no-op (a finished response closes its reader);
    the pair's code closes the real one."""

    def __init__(self, fp: Any) -> None:
        self._fp = fp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fp, name)

    def close(self) -> None:
        pass


class _ReaderSocket:
    """What :class:`http.client.HTTPResponse` needs of a socket: ``makefile``."""

    def __init__(self, reader: _SharedReader) -> None:
        self._reader = reader

    def makefile(self, *args: Any, **kwargs: Any) -> _SharedReader:
        return self._reader


class _UnixHTTPConnection(http.client.HTTPConnection):
    """``http.client.HTTPConnection`` over a Unix domain socket (the server's ``UNIX_SOCKET``);
    ``host`` and ``port`` only fill the ``Host`` header."""

    def __init__(self, path: str, host: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._socket_path)
        except OSError as exc:
            sock.close()
            raise OSError(
                exc.errno,
                f"cannot connect to the Unix socket {self._socket_path} ({exc.strerror or exc}); "
                "is the server running with UNIX_SOCKET set to this path, and may this user "
                "connect (mode 0660: the server's user or group)?",
            ) from None
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class _Connection:
    """One keep-alive HTTP/1.1 connection to the server (``http.client``), reopened when the
    server has closed it: TCP to ``base_url``, or the Unix socket ``unix_socket``. A call is
    sent once: a failure after the connection was made is a :class:`TransportError`, never a
    retry (a POST of the write cycle must not be sent twice). Calls from several threads take
    turns."""

    def __init__(self, base_url: str, unix_socket: str | None = None) -> None:
        u = urllib.parse.urlsplit(base_url)
        self._https = u.scheme == "https"
        self._host = u.hostname or "127.0.0.1"
        self._port = u.port or (443 if self._https else 80)
        self.prefix = u.path.rstrip("/")
        self._unix_socket = unix_socket
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def _open(self, timeout: float) -> http.client.HTTPConnection:
        if self._unix_socket is not None:
            conn = _UnixHTTPConnection(self._unix_socket, self._host, self._port, timeout)
            conn.connect()
            return conn
        if self._https:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout, context=ssl.create_default_context()
            )
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str], timeout: float
    ) -> _Response:
        where = f"{method} {path}"
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None and (conn.sock is None or _dropped(conn.sock)):
                conn.close()
                conn = None
            try:
                if conn is None:
                    conn = self._open(min(timeout, 10.0))
                conn.sock.settimeout(timeout)
                conn.request(method, self.prefix + path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                if conn is not None:
                    conn.close()
                raise TransportError(f"{where}: {type(exc).__name__}: {exc}") from None
            if resp.will_close:
                conn.close()
            else:
                self._conn = conn
            return _Response(resp.status, resp.headers, data)

    def request_pair(
        self,
        method: str,
        paths: tuple[str, str],
        headers: dict[str, str],
        timeout: float,
        first_body: bytes | None = None,
    ) -> tuple[_Response, _Response | TransportError]:
        """Send two requests in one write on the keep-alive connection (HTTP/1.1
        pipelining: the server answers them in order), then read both answers. The second has
        no body; the first has ``first_body`` (JSON) when given (a quiesce's
        ``{"running": "hold"}``, contract 4b).

        Returns the two responses; the second is a :class:`TransportError` when the first
        answer closed the connection (``Connection: close``: the second was not answered) or
        the second answer could not be read. Raises :class:`TransportError` when nothing could
        be sent or the first answer could not be read. Like :meth:`request`, never resends.
        """
        where = f"{method} {paths[0]} + {paths[1]}"
        lines = [f"Host: {self._host_header()}", "Accept-Encoding: identity"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"{where}: a header contains a line break")
            lines.append(f"{name}: {value}")
        head = "\r\n".join(lines)
        bodies = (first_body or b"", b"")
        wire = b"".join(
            f"{method} {self.prefix}{path} HTTP/1.1\r\n{head}\r\n".encode("latin-1")
            + (b"Content-Type: application/json\r\n" if body else b"")
            + f"Content-Length: {len(body)}\r\n\r\n".encode("latin-1")
            + body
            for path, body in zip(paths, bodies, strict=True)
        )
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None and (conn.sock is None or _dropped(conn.sock)):
                conn.close()
                conn = None
            reader = None
            try:
                if conn is None:
                    conn = self._open(min(timeout, 10.0))
                conn.sock.settimeout(timeout)
                conn.sock.sendall(wire)
                reader = conn.sock.makefile("rb")
                shared = _ReaderSocket(_SharedReader(reader))
                first = http.client.HTTPResponse(shared, method=method)  # type: ignore[arg-type]
                first.begin()
                first_data = first.read()
            except (OSError, http.client.HTTPException) as exc:
                if reader is not None:
                    reader.close()
                if conn is not None:
                    conn.close()
                raise TransportError(f"{where}: {type(exc).__name__}: {exc}") from None
            answers: tuple[_Response, _Response | TransportError]
            one = _Response(first.status, first.headers, first_data)
            if first.will_close:
                reader.close()
                conn.close()
                gone = TransportError(
                    f"{method} {paths[1]}: the server closed the connection after answering "
                    f"{paths[0]}; {paths[1]} was not answered"
                )
                return one, gone
            try:
                second = http.client.HTTPResponse(shared, method=method)  # type: ignore[arg-type]
                second.begin()
                second_data = second.read()
            except (OSError, http.client.HTTPException) as exc:
                reader.close()
                conn.close()
                return one, TransportError(f"{method} {paths[1]}: {type(exc).__name__}: {exc}")
            reader.close()  # the socket stays open (http.client's own makefile does the same)
            answers = (one, _Response(second.status, second.headers, second_data))
            if second.will_close:
                conn.close()
            else:
                self._conn = conn
            return answers

    def _host_header(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        default = 443 if self._https else 80
        return host if self._port == default else f"{host}:{self._port}"

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def _unwrap(method: str, path: str, resp: _Response) -> dict[str, Any]:
    """The envelope's ``data``, or the typed error. Raises WeightsError (a subclass per code)."""
    try:
        body = json.loads(resp.data)
    except ValueError:
        body = None
    retry = resp.headers.get("Retry-After")
    try:
        retry_s = float(retry) if retry is not None else None
    except ValueError:
        retry_s = None
    if isinstance(body, dict) and body.get("success") is True and resp.status < 400:
        data = body.get("data")
        return data if isinstance(data, dict) else {"value": data}
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("code"), str):
        raise _make_error(
            err["code"],
            err.get("reason"),
            resp.status,
            str(err.get("message", "")),
            err.get("details"),
            retry_s,
            f"{method} {path}",
        )
    raise WeightsError(
        None,
        None,
        resp.status,
        f"{method} {path} answered {resp.status} without a miserver JSON "
        "body (is base_url a miserver?)",
        retry_after_s=retry_s,
    )


#: The shortest wait before a retry, whatever ``Retry-After`` says (``0`` would spin).
MIN_RETRY_WAIT_S = 0.05


def retry_wait(exc: BaseException, started: float, within_s: float) -> float | None:
    """How long to wait before sending again a barrier call that ``exc`` refused, or None when
    it is not retried: only a :class:`WeightsError` carrying ``Retry-After`` (503
    ``QUEUE_FULL``, 409 ``MODEL_BUSY``, 503 ``SHUTTING_DOWN``: a refusal changed nothing on
    the server, so the same call may go again), and only while the retry would still be sent
    within ``within_s`` seconds of ``started`` (``time.monotonic()`` of the first try). A lost
    answer (:class:`TransportError`) is never retried: the call may have been accepted."""
    if not isinstance(exc, WeightsError) or exc.retry_after_s is None or within_s <= 0:
        return None
    wait = max(float(exc.retry_after_s), MIN_RETRY_WAIT_S)
    return wait if time.monotonic() + wait - started <= within_s else None


def call_retrying(
    send: Callable[[], dict[str, Any]],
    within_s: float,
    on_retry: Callable[[WeightsError, float], None],
    started: float | None = None,
) -> dict[str, Any]:
    """``send()``, sent again while it is refused with ``Retry-After`` within ``within_s`` of
    ``started`` (default: now; :func:`retry_wait`); ``on_retry(refusal, wait)`` waits."""
    started = time.monotonic() if started is None else started
    while True:
        try:
            return send()
        except WeightsError as exc:
            wait = retry_wait(exc, started, within_s)
            if wait is None:
                raise
            on_retry(exc, wait)
