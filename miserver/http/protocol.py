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
are answered (:meth:`JsonErrorRequestHandler.eof_received`). ``miserver serve`` runs the app
with this runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from typing import Any

from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler

from miserver.http.errors import json_response, management_error_body
from miserver.http.keys import SETTINGS
from miserver.http.shutdown import SHUTDOWN, drain
from miserver.spec import codes
from miserver.spec.errors import ApiError

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
    ``client_header_timeout``)."""

    __slots__ = ()

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
            transport.get_extra_info("peername", ("-",))[0],
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
        if self._request_count != before:
            self._disarm_head_timer()  # a whole head arrived
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

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

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
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        elif self._request_count == 1 and isinstance(exc, http_exceptions.BadHttpMethod):
            # Not HTTP at all (TLS to a plain port, a scanner): aiohttp logs these at debug.
            self.logger.debug("non-HTTP bytes from %s refused", request.remote)
        else:
            self.logger.warning(
                "refused an unreadable HTTP request from %s with %d: %s",
                request.remote,
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
        return handler


class AppRunner(web.AppRunner):
    """``web.AppRunner`` whose server answers aiohttp's own low-level errors as JSON."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = JsonErrorServer  # a plain class; the subclass only overrides __call__
        settings = self.app.get(SETTINGS) if isinstance(self.app, web.Application) else None
        timeout = getattr(settings, "header_read_timeout_s", HEADER_READ_TIMEOUT_S)
        server.header_read_timeout_s = timeout  # type: ignore[attr-defined]
        return server


def run_app(
    app: web.Application,
    *,
    host: str,
    port: int,
    on_listening: Callable[[], None] | None = None,
    shutdown_timeout: float = 10.0,
    **server_options: Any,
) -> None:
    """Serve ``app`` on ``host:port`` through :class:`AppRunner` until SIGINT or SIGTERM.

    What ``aiohttp.web.run_app`` does for one TCP address, with JSON low-level errors.
    ``on_listening`` is called once the socket is bound; ``server_options`` go to the runner
    (``access_log``, ``access_log_class``, ...). Raises ``OSError`` when the address cannot be
    bound; returns after a clean shutdown (the app's cleanup has run).
    """

    async def serve() -> None:
        runner = AppRunner(
            app, handle_signals=False, shutdown_timeout=shutdown_timeout, **server_options
        )
        loop = asyncio.get_running_loop()
        stop, force = asyncio.Event(), asyncio.Event()

        def on_signal() -> None:  # the first stops, a second ends the grace at once
            (force if stop.is_set() else stop).set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            if on_listening is not None:
                on_listening()
            await stop.wait()
            if SHUTDOWN in app:  # 503 to new requests, running ones finish within the grace
                await drain(app, force=force)
        finally:
            await runner.cleanup()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    with contextlib.suppress(web.GracefulExit, KeyboardInterrupt):
        asyncio.run(serve())
