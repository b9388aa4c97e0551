"""The HTTP connection layer: aiohttp's own low-level errors answered as JSON.

A request aiohttp's parser cannot accept (a request line or header over ``max_line_size`` /
``max_field_size``, 8190 bytes; a malformed header; a request line that is not HTTP) never
reaches the application or its middlewares: aiohttp answers it from
``RequestHandler.handle_error`` with a ``text/plain`` page that repeats the first ~100 bytes of
the offending line, which is an ``Authorization: Bearer <token>`` header as often as not.
Contract section 2 ("every error body is JSON, never aiohttp's plain-text pages"; "no error
echoes a token or a raw request body") and the weights page ("a token is never logged, returned
or echoed in an error") rule that out.

aiohttp has no hook for these errors (aio-libs/aiohttp#3287, open), so :class:`AppRunner` serves
the app through a :class:`~aiohttp.web_protocol.RequestHandler` whose only change is
:meth:`JsonErrorRequestHandler.handle_error`: the management error envelope, a message that says
what was wrong and what to do, and a log line that names the fault without the request's bytes.
The same handler keeps a half-closed connection open until the requests it already carried
are answered (:meth:`JsonErrorRequestHandler.eof_received`), answers the valid requests of a
read before the one it cannot parse (:meth:`JsonErrorRequestHandler._parse_rest`; aiohttp dropped
them all), bounds the wait for a request's
head (``HEADER_READ_TIMEOUT_S``) and for each further byte of its body
(``BODY_READ_TIMEOUT_S``), and never writes the ``499`` of a client that went away. Before
routing, :func:`screen_request` refuses what aiohttp would accept but misread or answer in
text: an HTTP version other than 1.0 and 1.1 (505), a transfer coding other than ``chunked``
(400), a content coding aiohttp does not decode (415), an ``Expect`` other than
``100-continue`` (417), each as JSON in the route's shape. ``miserver serve`` runs the app
with this runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import stat
from collections.abc import Callable
from typing import Any

from aiohttp import compression_utils, http_exceptions, web
from aiohttp.http import HttpRequestParser, HttpVersion10, HttpVersion11
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo

from miserver.http.errors import (
    CLIENT_GONE_STATUS,
    DECODED_CODINGS,
    SCRUB_SECRETS,
    body_read_timeout_error,
    error_response,
    json_response,
    management_error_body,
    scrub,
)
from miserver.http.keys import SETTINGS
from miserver.http.shutdown import SHUTDOWN, drain
from miserver.spec import codes
from miserver.spec.errors import ApiError

log = logging.getLogger("miserver.http")


def peer_name(transport: asyncio.BaseTransport) -> str:
    """The client's address for a log line: the host of a TCP peer, ``unix`` for a client of
    the ``UNIX_SOCKET`` (whose peer name is an empty string), ``-`` when unknown."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, (tuple, list)) and peer:
        return str(peer[0])
    return "unix" if isinstance(peer, (str, bytes)) else "-"


def request_peer(request: web.BaseRequest) -> str:
    """:func:`peer_name` of ``request``'s client: aiohttp's ``request.remote`` (the TCP peer's
    host, or a forwarded one), else ``unix`` for a ``UNIX_SOCKET`` client, ``-`` when unknown."""
    remote = request.remote
    if remote:
        return remote
    transport = request.transport
    return peer_name(transport) if transport is not None else "-"


_LIMIT_HINT = (
    "Send long values in the JSON body, not in the URL or a header; an Authorization header "
    "carries only 'Bearer <token>'."
)


def describe_bad_request(exc: BaseException | None) -> tuple[str, dict[str, Any] | None]:
    """A message (and details) for a request aiohttp's parser refused, built only from the
    exception's type and limits: never from the request's bytes (a header may hold a token).

    Returns ``(message, details)``.
    """
    if isinstance(exc, http_exceptions.LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else None
        limit_bytes = limit if isinstance(limit, int) else None
        size = f"{limit_bytes} bytes" if limit_bytes is not None else "the server's limit"
        return (
            f"The request line (the URL) or a header line is longer than {size}; the request "
            f"was not read. {_LIMIT_HINT}",
            {"limit_bytes": limit_bytes},
        )
    if isinstance(exc, http_exceptions.BadStatusLine):  # BadHttpMethod included
        return (
            "The request line is not a valid HTTP/1.x request line (METHOD /path HTTP/1.1).",
            None,
        )
    if isinstance(exc, http_exceptions.InvalidHeader):
        return ("A header line is malformed (not 'Name: value' with a valid name).", None)
    if isinstance(exc, http_exceptions.InvalidURLError):
        return ("The request target is not a valid URL path.", None)
    if isinstance(exc, http_exceptions.ContentEncodingError):
        text = str(exc).lower()
        name = next((c for c in DECODED_CODINGS if c in text), None)
        if name is not None:
            return (
                f"The request body is not valid {name} data (Content-Encoding: {name}), or "
                f"this server cannot decode {name}; send the body compressed with gzip or "
                "deflate, or uncompressed without a Content-Encoding header.",
                {"content_encoding": name},
            )
    if isinstance(exc, http_exceptions.PayloadEncodingError):
        return (
            "The request body's framing is invalid (its Content-Length, Transfer-Encoding or "
            "Content-Encoding does not match the bytes sent).",
            None,
        )
    return ("The request is not valid HTTP/1.1 and was not read.", None)


def low_level_error(status: int, exc: BaseException | None) -> web.Response:
    """The JSON answer (management envelope) for an error aiohttp raised outside the app.

    Such a request was never routed, so its path is unknown and the management shape is used.
    ``status`` is aiohttp's: 400 for a request it could not parse, 500 for a failure outside the
    middlewares, 504 for a handler timeout.
    """
    if status >= 500:
        if status == 504:
            message = "The request handler timed out; retry the request."
        else:
            message = "internal server error"
        err = ApiError(codes.INTERNAL_ERROR, message, status=status)
    else:
        message, details = describe_bad_request(exc)
        err = ApiError(codes.INVALID_REQUEST, message, details=details, status=status)
    return json_response(management_error_body(err), err.status)


#: id(handler) -> (timer, whether any byte of the head arrived): the head-read deadline of each
#: connection waiting for a request head (the handler's slots cannot grow, see JsonErrorServer).
_HEAD_TIMERS: dict[int, tuple[asyncio.TimerHandle, bool]] = {}
#: The default head-read deadline, seconds (``HEADER_READ_TIMEOUT_S``).
HEADER_READ_TIMEOUT_S = 20.0


#: The default body-read deadline, seconds (``BODY_READ_TIMEOUT_S``): the longest pause
#: between two bytes of a request body that is still incomplete.
BODY_READ_TIMEOUT_S = 20.0


def _decoded_codings() -> frozenset[str]:
    """The content codings aiohttp decodes here: gzip and deflate, br and zstd when their
    optional libraries are installed."""
    extra = {"br": compression_utils.HAS_BROTLI, "zstd": compression_utils.HAS_ZSTD}
    return frozenset(c for c in DECODED_CODINGS if extra.get(c, True))


def _codings(request: web.BaseRequest, header: str) -> list[str]:
    """The comma-separated tokens of every ``header`` line, lower case, empty ones dropped."""
    values = request.headers.getall(header, ())
    return [c.strip().lower() for v in values for c in v.split(",") if c.strip()]


def screen_request(request: web.BaseRequest) -> ApiError | None:
    """What the server refuses before routing, or None. aiohttp's parser accepts these and then
    echoes a version it does not speak, ignores a coding, or answers in text/plain:

    - an HTTP version other than 1.0 and 1.1 (``GET / HTTP/2.0``, ``HTTP/0.9``): 505;
    - ``Transfer-Encoding`` other than exactly ``chunked`` (``gzip, chunked``: aiohttp
      de-chunks and ignores the gzip, where a proxy honouring it reads another body): 400;
    - a body whose ``Content-Encoding`` is not one coding aiohttp decodes (``identity``, gzip,
      deflate; br, zstd with their libraries): aiohttp passes an unknown coding through as if
      it were none: 415 UNSUPPORTED_MEDIA_TYPE;
    - an ``Expect`` other than ``100-continue``: 417 (aiohttp's is text/plain).

    No message repeats a header's value (only fixed coding names).
    """
    if request.version not in (HttpVersion10, HttpVersion11):
        return ApiError(
            codes.INVALID_REQUEST,
            f"HTTP/{request.version.major}.{request.version.minor} is not supported on this "
            "port: send HTTP/1.1 (or HTTP/1.0)",
            details={"supported": ["HTTP/1.1", "HTTP/1.0"]},
            status=505,
        )
    transfer = _codings(request, "Transfer-Encoding")
    if transfer and transfer != ["chunked"]:
        return ApiError(
            codes.INVALID_REQUEST,
            "Transfer-Encoding may only be chunked: this server applies no other transfer "
            "coding; send the body chunked (or with a Content-Length), compressed if you like "
            "with Content-Encoding: gzip",
            details={"transfer_encoding": "chunked"},
        )
    content = _codings(request, "Content-Encoding")
    coded = [c for c in content if c != "identity"]
    decoded = _decoded_codings() if coded else frozenset()  # only a coded body asks
    if request.body_exists and coded and (len(content) > 1 or content[0] not in decoded):
        return ApiError(
            codes.UNSUPPORTED_MEDIA_TYPE,
            "the request body's Content-Encoding is not one this server decodes: send it "
            f"with one of {', '.join(sorted(decoded))} (one coding), or uncompressed "
            "without a Content-Encoding header",
            details={"content_encodings": sorted(decoded)},
        )
    expect = request.headers.get("Expect")
    if expect is not None and expect.strip().lower() != "100-continue":
        return ApiError(
            codes.INVALID_REQUEST,
            "the only Expect this server meets is 100-continue; send the request without "
            "this Expect header",
            status=417,
        )
    return None


def screened(
    handler: Callable[[web.BaseRequest], Any], secrets: tuple[str, ...] = ()
) -> Callable[[web.BaseRequest], Any]:
    """``handler`` (the app's) behind :func:`screen_request`: a refused request is answered
    as JSON in its route's shape and its connection closed; the rest goes on to the app.
    ``secrets`` are masked in the log line's path."""

    async def screen(request: web.BaseRequest) -> web.StreamResponse:
        err = screen_request(request)
        if err is None:
            return await handler(request)
        if err.status == 505:
            # aiohttp writes the status line in the request's version (``request.version``, a
            # cached property): answer as HTTP/1.1.
            request._version = HttpVersion11  # type: ignore[attr-defined]
            request._cache["version"] = HttpVersion11  # type: ignore[attr-defined]
        log.warning(
            "%s %s refused before routing with %d: %s",
            request.method,
            scrub(request.path, secrets),
            err.status,
            err.message,
        )
        resp = error_response(request.path, err)
        resp.force_close()
        return resp

    return screen


class _BodyWatch:
    """The body-read deadline of the request body a connection is receiving."""

    __slots__ = ("payload", "last", "timer")

    def __init__(self, payload: Any, last: float) -> None:
        self.payload = payload
        self.last = last
        self.timer: asyncio.TimerHandle | None = None


#: id(handler) -> the body it is receiving (see _HEAD_TIMERS for why not an attribute).
_BODY_WATCH: dict[int, _BodyWatch] = {}


def _head_timeout_body(timeout_s: float) -> bytes:
    err = ApiError(
        codes.INVALID_REQUEST,
        f"The request head (request line and headers) did not arrive within {timeout_s:g} s"
        " (HEADER_READ_TIMEOUT_S); the connection is closed. Send the whole head at once.",
        details={"header_read_timeout_s": timeout_s},
        status=408,
    )
    return json_response(management_error_body(err), 408).body  # type: ignore[return-value]


class JsonErrorRequestHandler(RequestHandler):
    """aiohttp's connection handler with JSON error answers (see the module docstring) and a
    head-read deadline: a connection whose request head (request line and headers) has not
    arrived within ``HEADER_READ_TIMEOUT_S`` of the connection opening, or of the first byte of
    a later request's head, is answered 408 (JSON, when part of a head came) and closed. aiohttp
    has no such deadline: its keep-alive timeout (75 s) is all that bounds a client trickling
    header bytes (issue 16, item 7; Go's ``ReadHeaderTimeout``, nginx's
    ``client_header_timeout``).

    A request body still incomplete with no byte for ``BODY_READ_TIMEOUT_S`` (nginx's
    ``client_body_timeout``: a pause, not the upload's length, so a large ``POST /v1/files``
    that keeps flowing is never cut) makes the body's reader raise 408 (JSON, answered by
    the error middleware in the route's shape) and the connection closes after that answer.
    A pause while the server itself stopped reading (its buffer full) does not count."""

    __slots__ = ()

    def _body_timeout_s(self) -> float:
        return getattr(self._manager, "body_read_timeout_s", BODY_READ_TIMEOUT_S)

    def _watch_body(self, payload: Any) -> None:
        self._unwatch_body()
        watch = _BodyWatch(payload, self._loop.time())
        watch.timer = self._loop.call_later(self._body_timeout_s(), self._body_check)
        _BODY_WATCH[id(self)] = watch

    def _unwatch_body(self) -> None:
        watch = _BODY_WATCH.pop(id(self), None)
        if watch is not None and watch.timer is not None:
            watch.timer.cancel()

    def _body_check(self) -> None:
        watch = _BODY_WATCH.get(id(self))
        if watch is None:
            return
        payload, transport = watch.payload, self.transport
        if (
            payload.is_eof()
            or payload.exception() is not None
            or transport is None
            or transport.is_closing()
        ):
            _BODY_WATCH.pop(id(self), None)
            return
        timeout, now = self._body_timeout_s(), self._loop.time()
        if getattr(self, "_reading_paused", False) or getattr(self, "_buffer_paused", False):
            watch.last = now  # the handler has not consumed what came: not the client's pause
        idle = now - watch.last
        if idle < timeout:
            watch.timer = self._loop.call_later(timeout - idle, self._body_check)
            return
        _BODY_WATCH.pop(id(self), None)
        log.warning(
            "a request body from %s stalled: no byte for %g s (BODY_READ_TIMEOUT_S); answered "
            "408 and closed",
            peer_name(transport),
            timeout,
        )
        payload.set_exception(body_read_timeout_error(timeout))

    def _head_timeout_s(self) -> float:
        return getattr(self._manager, "header_read_timeout_s", HEADER_READ_TIMEOUT_S)

    def _arm_head_timer(self, got_bytes: bool) -> None:
        timeout = self._head_timeout_s()
        handle = self._loop.call_later(timeout, self._head_timed_out)
        _HEAD_TIMERS[id(self)] = (handle, got_bytes)

    def _disarm_head_timer(self) -> None:
        entry = _HEAD_TIMERS.pop(id(self), None)
        if entry is not None:
            entry[0].cancel()

    def _head_timed_out(self) -> None:
        entry = _HEAD_TIMERS.pop(id(self), None)
        transport = self.transport
        if entry is None or transport is None or transport.is_closing():
            return
        if self._current_request is not None or self._messages:
            return  # a head arrived meanwhile
        timeout = self._head_timeout_s()
        self.logger.warning(
            "closed a connection from %s: no complete request head within %g s",
            peer_name(transport),
            timeout,
        )
        if entry[1]:
            body = _head_timeout_body(timeout)
            transport.write(
                b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json; charset=utf-8"
                b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
            )
        self.force_close()
        transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_head_timer(False)

    def data_received(self, data: bytes) -> None:
        before = self._request_count
        super().data_received(data)
        self._parse_rest()
        watch = _BODY_WATCH.get(id(self))
        if watch is not None and data:
            watch.last = self._loop.time()  # the body (or what follows it) is coming
        if self._request_count != before:
            self._disarm_head_timer()  # a whole head arrived
            if self._messages:  # the newest request's body is the one now arriving
                payload = self._messages[-1][1]
                if not payload.is_eof() and payload.exception() is None:
                    self._watch_body(payload)
        elif (
            data
            and id(self) not in _HEAD_TIMERS
            and self._current_request is None
            and not self._messages
        ):
            self._arm_head_timer(True)  # the first bytes of a further request's head
        elif data and id(self) in _HEAD_TIMERS and not _HEAD_TIMERS[id(self)][1]:
            handle, _ = _HEAD_TIMERS[id(self)]
            _HEAD_TIMERS[id(self)] = (handle, True)

    def _parse_rest(self) -> None:
        """Take the further requests of what was read, one at a time, until the queue holds
        aiohttp's maximum (the rest waits in the parser, as aiohttp's own pause leaves it).

        The parser stops after each request (:meth:`JsonErrorServer.__call__` builds it so):
        aiohttp's feeds a whole read at once, and one request it cannot parse makes it drop
        every request of that read, so a valid request pipelined before a malformed one was
        neither run nor answered. Now the valid ones are queued first, then the 400 (issue 32,
        item 13).
        """
        while (
            self._parser is not None
            and self._payload_parser is None
            and not self._upgraded
            and not self._force_close
            and not self._close
            and len(self._messages) < getattr(self, "_max_msg_queue_size", 32)
            and not (self._messages and isinstance(self._messages[-1][0], _ErrInfo))
        ):
            count = self._request_count
            super().data_received(b"")  # the parser's buffered rest: at most one request
            if self._request_count == count:
                return

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_head_timer()
        self._unwatch_body()
        super().connection_lost(exc)

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        """aiohttp's, except: the ``499`` of a client that went away
        (:data:`~miserver.http.errors.CLIENT_GONE_STATUS`) is logged and never written (a
        status line with no reason phrase and an empty body is no answer; a half-closed
        client sees the connection end); and a request whose body could not be read (a bad
        coding, a stalled body: its reader holds the error) closes its connection once the
        answer is written, instead of aiohttp's lingering read, which would raise that error
        again and log it as unhandled.

        Returns ``(response, reset)`` as aiohttp's does (``reset``: the client is gone).
        """
        if _BODY_WATCH.get(id(self)) is not None and _BODY_WATCH[id(self)].payload is (
            request.content
        ):
            self._unwatch_body()  # answered: what is left of the body is aiohttp's lingering
        if resp.status == CLIENT_GONE_STATUS:
            with contextlib.suppress(Exception):
                request._finish()  # type: ignore[attr-defined]
            self.log_access(request, resp, start_time)
            self.force_close()
            return resp, True
        result = await super().finish_response(request, resp, start_time)
        content = request.content
        if not content.is_eof() and content.exception() is not None:
            self.force_close()
        return result

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Answer an error raised outside the application as JSON and close the connection.

        Logs the fault's kind and limits, never the request's bytes (aiohttp's own line and its
        traceback repeat the header that was too long). A 500 keeps the traceback: it is a bug
        of ours, and its frames hold no request data.

        Raises ``ConnectionError`` when part of a response was already sent (as aiohttp does).
        """
        if status >= 500:
            self.log_exception(
                "Error handling request from %s", request_peer(request), exc_info=exc
            )
        elif self._request_count == 1 and isinstance(exc, http_exceptions.BadHttpMethod):
            # Not HTTP at all (TLS to a plain port, a scanner): aiohttp logs these at debug.
            self.logger.debug("non-HTTP bytes from %s refused", request_peer(request))
        else:
            self.logger.warning(
                "refused an unreadable HTTP request from %s with %d: %s",
                request_peer(request),
                status,
                describe_bad_request(exc)[0],
            )
        if request.writer.output_size > 0:
            raise ConnectionError(
                "Response is sent already, cannot send another response with the error message"
            )
        resp = low_level_error(status, exc)
        resp.force_close()
        return resp

    def eof_received(self) -> bool | None:
        """The client half-closed its side (``shutdown(SHUT_WR)``) after sending a request:
        keep the socket open for writing, answer the request in hand, then close (no further
        request can come).

        aiohttp's ``eof_received`` returns None, so asyncio closed the transport at the EOF and
        a complete request got no response at all (issue 16 item 14). An idle connection (no
        request received, or only part of a request head) and a request whose body is still
        incomplete (the parser's EOF raises) close as before: nothing can be answered, and the
        handler of an incomplete body sees the connection lost instead of waiting forever.
        """
        idle = self._waiter is not None and not self._waiter.done() and not self._messages
        if idle or self._parser is None:
            return None
        try:
            self._parser.feed_eof()
        except Exception:  # noqa: BLE001 - an incomplete body (ContentLengthError, ...)
            return None
        # A generation cannot tell a half-close from a hang-up (both are this EOF), and a client
        # that timed out and closed must stop costing compute (contract 4: cancellation between
        # decode steps): /v1 reads this as "the client is gone" (http/v1_admission.client_disconnected).
        self.close()  # once the request in hand is answered
        transport = self.transport
        extra = getattr(transport, "_extra", None)
        if isinstance(extra, dict):  # read back with transport.get_extra_info("peer_eof")
            extra["peer_eof"] = True
        return True


class JsonErrorServer(web.Server):
    """aiohttp's low-level server, making :class:`JsonErrorRequestHandler` connections."""

    def __call__(self) -> RequestHandler:
        handler = super().__call__()  # aiohttp builds it with every configured option
        # Same slots layout (the subclass adds none), so only the methods change.
        handler.__class__ = JsonErrorRequestHandler
        # aiohttp's parser, except that it stops after each request, buffering the rest of
        # the read (its own queue limit, 1): JsonErrorRequestHandler._parse_rest takes them.
        # An aiohttp before the per-message pause (3.14) keeps its own parser (TypeError): a
        # malformed request there still drops the ones before it in the same read.
        with contextlib.suppress(TypeError, AttributeError):
            handler._parser = HttpRequestParser(
                handler,
                handler._loop,
                handler._read_bufsize,
                max_line_size=handler.max_line_size,
                max_field_size=handler.max_field_size,
                max_headers=handler.max_headers,
                payload_exception=RequestPayloadError,
                auto_decompress=self._kwargs.get("auto_decompress", True),
                max_msg_queue_size=1,
            )
        return handler


class AppRunner(web.AppRunner):
    """``web.AppRunner`` whose server answers aiohttp's own low-level errors as JSON."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = JsonErrorServer  # a plain class; the subclass only overrides __call__
        settings = self.app.get(SETTINGS) if isinstance(self.app, web.Application) else None
        timeout = getattr(settings, "header_read_timeout_s", HEADER_READ_TIMEOUT_S)
        server.header_read_timeout_s = timeout  # type: ignore[attr-defined]
        body = getattr(settings, "body_read_timeout_s", BODY_READ_TIMEOUT_S)
        server.body_read_timeout_s = body  # type: ignore[attr-defined]
        # Each connection takes the handler at its creation: the screen is in place before any.
        secrets = self.app.get(SCRUB_SECRETS, ()) if isinstance(self.app, web.Application) else ()
        server.request_handler = screened(server.request_handler, secrets)
        return server


class UnixSocketError(OSError):
    """``UNIX_SOCKET`` could not be taken (:func:`bind_unix_socket`): its ``errno`` and a
    message naming the path; ``miserver serve`` exits 1 with it."""


#: The mode of the ``UNIX_SOCKET`` file: its owner and group may connect (settings, UNIX_SOCKET).
UNIX_SOCKET_MODE = 0o660


def bind_unix_socket(path: str) -> tuple[socket.socket, tuple[int, int]]:
    """A listening ``AF_UNIX`` stream socket bound at ``path``, mode :data:`UNIX_SOCKET_MODE`,
    and the file's ``(st_dev, st_ino)`` (so that shutdown removes only the file it created:
    :func:`remove_unix_socket`).

    A socket file nobody listens on (a server that is gone: connect is refused) is replaced.
    The probe, the replacement and the bind hold an exclusive ``flock`` on the socket's
    directory, so two servers starting at once cannot both take the path. Raises ``OSError``:
    ``EADDRINUSE`` when a live server listens on ``path``, ``EEXIST`` when ``path`` exists and
    is not a socket, the probe's own error when it cannot tell (``EACCES``: a socket we may
    not connect to; ``EAGAIN``: a full backlog), or the bind's (a directory we may not
    write), each as :class:`UnixSocketError`. Settings, UNIX_SOCKET.
    """
    import fcntl

    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            info = os.lstat(path)
            if not stat.S_ISSOCK(info.st_mode):
                kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a socket"
                raise UnixSocketError(
                    errno.EEXIST, f"{path} exists and is {kind}; choose another UNIX_SOCKET path"
                )
            _replace_if_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
        except OSError as exc:
            sock.close()
            raise UnixSocketError(exc.errno, f"cannot bind {path}: {exc.strerror or exc}") from None
        except BaseException:
            sock.close()
            raise
        try:
            os.chmod(path, UNIX_SOCKET_MODE)
            info = os.lstat(path)
            sock.listen(128)  # at once: a probe from now on sees a live server
        except BaseException:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
    finally:
        os.close(folder)  # releases the lock
    return sock, (info.st_dev, info.st_ino)


def _replace_if_stale(path: str) -> None:
    """Remove the socket file at ``path`` when connecting to it is refused (nobody listens);
    raise when a server listens, or when the probe cannot tell."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # stale: no server behind it
        return
    except FileNotFoundError:
        return  # gone meanwhile
    except OSError as exc:
        raise UnixSocketError(
            exc.errno,
            f"cannot tell whether a server listens on {path} ({exc.strerror or exc}); "
            "left as it is",
        ) from None
    finally:
        probe.close()
    raise UnixSocketError(errno.EADDRINUSE, f"a server already listens on {path}")


def remove_unix_socket(path: str, identity: tuple[int, int]) -> None:
    """Remove the socket file at ``path`` if it is still the one :func:`bind_unix_socket` made.
    Call it while that socket is still open: its inode cannot be reused by a later file then,
    so the device and inode numbers tell (a ``chmod`` or ``chgrp`` by an operator changes
    nothing here)."""
    with contextlib.suppress(OSError):
        info = os.lstat(path)
        if stat.S_ISSOCK(info.st_mode) and (info.st_dev, info.st_ino) == identity:
            os.unlink(path)


def run_app(
    app: web.Application,
    *,
    host: str,
    port: int,
    unix_socket: str | None = None,
    on_listening: Callable[[], None] | None = None,
    shutdown_timeout: float = 10.0,
    **server_options: Any,
) -> None:
    """Serve ``app`` on ``host:port`` through :class:`AppRunner` until SIGINT or SIGTERM.

    What ``aiohttp.web.run_app`` does for one TCP address, with JSON low-level errors; with
    ``unix_socket``, the same app also on that Unix socket (:func:`bind_unix_socket`; removed at
    shutdown). ``on_listening`` is called once every socket is bound; ``server_options`` go to
    the runner (``access_log``, ``access_log_class``, ...). Raises ``OSError`` when an address
    cannot be bound; returns after a clean shutdown (the app's cleanup has run).
    """

    async def serve() -> None:
        runner = AppRunner(
            app, handle_signals=False, shutdown_timeout=shutdown_timeout, **server_options
        )
        loop = asyncio.get_running_loop()
        stop, force = asyncio.Event(), asyncio.Event()

        def on_signal(sig: signal.Signals) -> None:  # the first stops, a second ends the grace
            if stop.is_set():
                force.set()
                return
            state = app.get(SHUTDOWN)
            if state is not None:  # the messages name it: a Ctrl-C is SIGINT
                state.signal = sig.name
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        await runner.setup()
        unix: tuple[str, tuple[int, int]] | None = None
        try:
            if unix_socket is not None:  # first: a refused socket stops the start before TCP
                sock, identity = bind_unix_socket(unix_socket)
                unix = (unix_socket, identity)
                await web.SockSite(runner, sock).start()
            await web.TCPSite(runner, host, port).start()
            if on_listening is not None:
                on_listening()
            await stop.wait()
            if SHUTDOWN in app:  # 503 to new requests, running ones finish within the grace
                await drain(app, force=force)
        finally:
            if unix is not None:  # while the socket is open (remove_unix_socket)
                remove_unix_socket(*unix)
            await runner.cleanup()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    with contextlib.suppress(web.GracefulExit, KeyboardInterrupt):
        asyncio.run(serve())
