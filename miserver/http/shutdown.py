"""Graceful shutdown on SIGTERM (and SIGINT, a Ctrl-C): drain, then stop (issue 16, item 2).

Every message names the signal that came (issue 32, item 6) and, when a second signal ended the
grace early, says so with the seconds that had passed.

What a Kubernetes or systemd operator expects of a server told to stop:

1. From the signal on, every new request is answered ``503 SHUTTING_DOWN`` with ``Retry-After``
   (a JSON error in the route's shape); the listening socket stays open for the grace, so a
   client reaching this replica gets an answer it can retry elsewhere, not a reset. Liveness,
   ``GET /api/health``, still answers 200: the process is alive while it drains (a liveness
   probe failing now would only get it killed before its grace ends); readiness
   (``/api/health/detailed``) is 503.
2. Requests already running or queued (waiting for an execution slot) run to their end, for at
   most ``SHUTDOWN_GRACE_S`` seconds (default 10).
3. At the end of the grace, what still runs is cancelled: a request whose answer has not started
   gets ``503 SHUTTING_DOWN``; an event stream still open gets one ``error`` event (the OpenAI
   error object, as a generation failure ends a stream) and is closed; both say the request
   was ended after ``SHUTDOWN_GRACE_S``. A request whose body had not all arrived (a stalled
   upload) gets the same 503 and its connection is closed at once, not read on.
4. Then the app's cleanup runs (the batch runner stops: a batch resumes at the next start) and
   the process exits 0. A second signal ends the grace at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field

from aiohttp import web

from miserver.http.errors import json_response, management_error_body, openai_error_body
from miserver.spec import codes
from miserver.spec.errors import ApiError

log = logging.getLogger("miserver.shutdown")


@dataclass
class ShutdownState:
    """Where the process is in its shutdown. ``inflight`` maps each running request's task to
    its request."""

    grace_s: float = 10.0
    draining: bool = False
    cancelling: bool = False
    started: float = 0.0
    #: The signal that started the shutdown (``SIGTERM``, ``SIGINT`` for a Ctrl-C).
    signal: str = "SIGTERM"
    #: A second signal ended the grace before ``grace_s``.
    forced: bool = False
    #: Seconds from the first signal to the end of the grace (set when it ends).
    ended_after: float | None = None
    inflight: dict[asyncio.Task, web.BaseRequest] = field(default_factory=dict)
    _idle: asyncio.Event | None = None

    def retry_after(self) -> str:
        """Seconds a client should wait: what is left of the grace, at least 1."""
        left = self.grace_s - (time.monotonic() - self.started) if self.draining else 1.0
        return str(max(1, math.ceil(left)))

    def error(self) -> ApiError:
        """The answer to a request that arrives while draining."""
        return ApiError(
            codes.SHUTTING_DOWN,
            f"the server is shutting down ({self.signal}) and takes no new requests; retry after "
            "Retry-After seconds, on this server once restarted or on another replica",
            headers={"Retry-After": self.retry_after()},
        )

    def cut_error(self) -> ApiError:
        """The answer (or a stream's last event) for a request that was running when the
        signal came and was still running at the end of the grace (or at a second signal)."""
        return ApiError(
            codes.SHUTTING_DOWN,
            f"the server is shutting down ({self.signal}): this request was still running "
            f"{self.when_ended()} and was ended unfinished; retry it on another replica, or on "
            "this server once restarted",
            headers={"Retry-After": self.retry_after()},
        )

    def when_ended(self) -> str:
        """When the grace ended, in words: ``10 s (SHUTDOWN_GRACE_S) after the signal``, or
        ``when a second signal came, 2.3 s after the first``."""
        if self.forced:
            elapsed = self.ended_after if self.ended_after is not None else 0.0
            return f"when a second signal came, {elapsed:.1f} s after the first"
        return f"{self.grace_s:g} s (SHUTDOWN_GRACE_S) after the signal"


#: Liveness: answered as usual while draining (the process is alive; see the module docstring).
LIVENESS_PATHS = frozenset({"/api/health"})


SHUTDOWN: web.AppKey[ShutdownState] = web.AppKey("miserver_shutdown", ShutdownState)


def _is_v1(request: web.BaseRequest) -> bool:
    return request.path.startswith("/v1/")


@web.middleware
async def shutdown_middleware(request: web.Request, handler: web.Handler) -> web.StreamResponse:
    """Refuse new requests while draining; track running ones; answer those cancelled at the end
    of the grace with 503 SHUTTING_DOWN."""
    state = request.app.get(SHUTDOWN)
    if state is None:
        return await handler(request)
    if state.draining and not (
        request.path in LIVENESS_PATHS and request.method in ("GET", "HEAD")
    ):
        raise state.error()
    task = asyncio.current_task()
    assert task is not None
    state.inflight[task] = request
    try:
        return await handler(request)
    except asyncio.CancelledError:
        if not state.cancelling or request.writer is None or request.writer.output_size > 0:
            raise
        # Ours (the grace ended) and nothing sent yet: answer, do not drop the connection.
        task.uncancel()
        err = state.cut_error()
        if not request.content.is_eof() and request.content.exception() is None:
            # A body still arriving is abandoned: with the error in its reader the connection
            # closes after this answer (http/protocol.py), instead of reading on.
            request.content.set_exception(err)
        body = openai_error_body(err) if _is_v1(request) else management_error_body(err)
        resp = json_response(body, err.status, err.headers)
        resp.force_close()
        return resp
    finally:
        state.inflight.pop(task, None)
        if state._idle is not None and not state.inflight:
            state._idle.set()


def install(app: web.Application, grace_s: float) -> ShutdownState:
    """Put the shutdown state on ``app`` (before it starts); its middleware must be in the
    app's middleware list (:func:`shutdown_middleware`)."""
    state = ShutdownState(grace_s=grace_s)
    app[SHUTDOWN] = state
    return state


async def _end_stream(request: web.BaseRequest, err: ApiError) -> None:
    """Write one SSE error event on a stream that has started, then end its body (best effort:
    the client may be gone)."""
    import msgspec

    payload = b"data: " + msgspec.json.encode(openai_error_body(err)) + b"\n\n"
    with contextlib.suppress(Exception):
        await asyncio.wait_for(request.writer.write(payload), 1.0)
        await asyncio.wait_for(request.writer.write_eof(), 1.0)  # a complete response


async def drain(app: web.Application, *, force: asyncio.Event | None = None) -> int:
    """Refuse new requests, wait for running ones up to the grace (or until ``force`` is set),
    then end what still runs. Returns how many requests were cut at the end of the grace."""
    state = app[SHUTDOWN]
    state.draining = True
    state.started = time.monotonic()
    state._idle = asyncio.Event()
    if not state.inflight:
        state._idle.set()
    log.info(
        "shutting down (%s): %d request(s) running or queued, waiting up to %g s "
        "(SHUTDOWN_GRACE_S; a second signal ends the wait)",
        state.signal,
        len(state.inflight),
        state.grace_s,
    )
    waits = [asyncio.ensure_future(state._idle.wait())]
    if force is not None:
        waits.append(asyncio.ensure_future(force.wait()))
    try:
        await asyncio.wait(waits, timeout=state.grace_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    state.ended_after = time.monotonic() - state.started
    cut = list(state.inflight.items())
    state.forced = bool(cut) and force is not None and force.is_set()
    if not cut:
        log.info("shutting down: every request finished")
        return 0
    state.cancelling = True
    err = state.cut_error()
    for task, request in cut:
        if _is_v1(request) and request.writer is not None and request.writer.output_size > 0:
            await _end_stream(request, err)
        task.cancel()
    await asyncio.wait([t for t, _ in cut], timeout=5.0)
    log.warning(
        "shutting down: ended %d request(s) still running %s, with 503 SHUTTING_DOWN "
        "(streams with an error event)",
        len(cut),
        state.when_ended(),
    )
    return len(cut)
