"""The aiohttp application factory.

:func:`create_app` wires the parts of one server process: settings, catalogue, model host,
scheduler and metrics (as typed app keys, :mod:`miserver.http.keys`), the JSON error middleware
(every error body is JSON, contract 2), the body-size limit (413 as JSON before the body is read,
contract 1), the Management API and ``/v1``. At start-up it loads ``DEFAULT_MODEL`` in the
background (importing the embedded default first when its row is missing), so liveness answers at
once; a ``/v1`` request meanwhile is 409 MODEL_BUSY, never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_urldispatcher import _default_expect_handler

from miserver.http import batches, keys, management, shutdown, weights
from miserver.http.errors import SCRUB_SECRETS, json_errors_middleware
from miserver.http.management_auth import management_auth_middleware, token_refusal
from miserver.serving.engine.slot import Scheduler
from miserver.serving.metrics import Metrics
from miserver.serving.models.catalogue import Catalogue
from miserver.serving.models.host import ModelHost
from miserver.serving.weights.runtime import WeightsRuntime
from miserver.spec import codes
from miserver.spec.errors import ApiError
from miserver.spec.settings import Settings, resolved_batch_delay_s, resolved_max_batch_size

log = logging.getLogger("miserver.app")


def body_limit_middleware(max_bytes: int) -> Any:
    """Refuse a body declared larger than ``max_bytes`` with 413 before reading it.

    A chunked body without ``Content-Length`` is cut at the same limit by aiohttp's
    ``client_max_size`` when a handler reads it (also answered as JSON 413). On a gated weights
    route the refusal writes its ``weights_audit`` line (the route's ``audit_refusal``).
    """

    @web.middleware
    async def limit(request: web.Request, handler: Any) -> web.StreamResponse:
        length = request.content_length
        if length is not None and length > max_bytes and not _refused_unread(request):
            raise _too_large(request, length, max_bytes)  # else the route's 401 goes first
        return await handler(request)

    return limit


def _refused_unread(request: web.Request) -> bool:
    """Whether the route refuses this request before it reads the body: a token-gated weights
    route called without a valid token (:func:`miserver.http.weights.gated_route`), whose 401
    goes out before any 413, so a caller without a token learns nothing about the body limit
    of a route it may not call (issue 32, item 13). The route never reads such a body."""
    unauthenticated = getattr(request.match_info.handler, "unauthenticated", None)
    return unauthenticated is not None and bool(unauthenticated(request))


def body_unwanted(request: web.Request) -> bool:
    """Whether the request will be answered without its body being read: a body declared over
    ``MAX_REQUEST_BYTES`` (413), a token-gated route without a valid token (401; in operator
    mode a guarded route without an operator token, 401/403), a body of a type the route does
    not read (415). The ``Expect: 100-continue`` handler sends no ``100 Continue`` then, so the
    client never sends the body (RFC 9110, 10.1.1; issue 32, item 13)."""
    settings = request.app.get(keys.SETTINGS)
    if settings is None:
        return False
    length = request.content_length
    if length is not None and length > settings.max_request_bytes:
        return True
    if _refused_unread(request):
        return True
    if settings.management_auth == "operator" and token_refusal(request) is not None:
        return True
    return "Content-Type" in request.headers and _media_refusal(request) is not None


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The ``Expect`` handler of every route: ``100 Continue`` only for a request whose body
    will be read (:func:`body_unwanted`); otherwise nothing, and the middlewares' final answer
    (413, 401, 403, 415) is the only one. Any other ``Expect`` is aiohttp's 417 (the connection
    layer refuses it as JSON before routing: :func:`miserver.http.protocol.screen_request`)."""
    if body_unwanted(request):
        return None
    return await _default_expect_handler(request)


def use_expect_continue(app: web.Application) -> None:
    """Put :func:`expect_continue` on every route of ``app`` (call once all routes exist)."""
    for route in app.router.routes():
        if hasattr(route, "_expect_handler"):
            route._expect_handler = expect_continue


def _too_large(request: web.Request, length: int, max_bytes: int) -> ApiError:
    """The 413 of a body declared larger than ``max_bytes``, its audit line written."""
    err = ApiError(
        codes.PAYLOAD_TOO_LARGE,
        f"the request body is {length} bytes; MAX_REQUEST_BYTES is {max_bytes}",
        details={"max_request_bytes": max_bytes, "content_length": length},
    )
    # A gated weights route audits this refusal too (weights page: Routes).
    audit_refusal = getattr(request.match_info.handler, "audit_refusal", None)
    if audit_refusal is not None:
        audit_refusal(request, err)
    return err


def body_checks_middleware(max_bytes: int) -> Any:
    """:func:`body_limit_middleware` and then :func:`media_type_middleware` as one middleware
    (one call a request instead of two; neither wraps the handler's exceptions, so the
    answers, their order and the audit lines are the same)."""

    @web.middleware
    async def checks(request: web.Request, handler: Any) -> web.StreamResponse:
        length = request.content_length
        if length is not None and length > max_bytes and not _refused_unread(request):
            raise _too_large(request, length, max_bytes)  # else the route's 401 goes first
        if "Content-Type" in request.headers:
            err = _media_refusal(request)
            if err is not None:
                raise err
        return await handler(request)

    return checks


#: What a route's body must be when it has one (a handler's ``body_media`` attribute; the
#: default is JSON): the media types accepted for it.
JSON_MEDIA = "application/json"


#: "Bytes of no stated type" (RFC 9110 8.3): what a client library sends for a raw body (aiohttp's
#: ``data=bytes``); read as the route's type, like a body without Content-Type.
UNTYPED_MEDIA = "application/octet-stream"


def _accepts(expected: str, media: str) -> bool:
    if media == UNTYPED_MEDIA:
        return True
    if expected == JSON_MEDIA:  # application/json, or a structured +json type (RFC 6839)
        return media == JSON_MEDIA or (media.startswith("application/") and media.endswith("+json"))
    return media == expected


@web.middleware
async def media_type_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Refuse a body whose ``Content-Type`` is present and is not what the route reads: JSON
    (``application/json`` or an ``application/*+json`` type) everywhere except ``POST
    /v1/files`` (``multipart/form-data``): 415 UNSUPPORTED_MEDIA_TYPE naming the type expected.

    A body without ``Content-Type``, or typed ``application/octet-stream`` (bytes of no stated
    type), is read as the route's type (raw sockets, minimal clients, client libraries' raw
    bodies; neither is a type a browser may send cross-origin without a preflight). ``application/x-www-form-urlencoded`` (what ``curl -d`` and Python's urllib send
    when no type is given) is refused with a message saying to add the header: it is also what
    a web page may send cross-origin without a CORS preflight, as are ``text/plain`` and
    ``multipart/form-data``, so refusing them keeps a browser from driving the open management
    routes of a server on localhost (docs/decisions.md). A request without a body, or to no
    route (404/405), is not checked.
    """
    if "Content-Type" in request.headers:
        err = _media_refusal(request)
        if err is not None:
            raise err
    return await handler(request)


def _media_refusal(request: web.Request) -> ApiError | None:
    """:func:`media_type_middleware`'s 415 for a request that has a ``Content-Type`` header,
    or None when its body is what the route reads (or it has none, or matches no route)."""
    media = request.content_type
    if not media or not request.body_exists or request.match_info.http_exception is not None:
        return None
    expected = getattr(request.match_info.handler, "body_media", JSON_MEDIA)
    if _accepts(expected, media):
        return None
    hint = (
        "; curl -d sends application/x-www-form-urlencoded unless told: add "
        "-H 'Content-Type: application/json'"
        if media == "application/x-www-form-urlencoded" and expected == JSON_MEDIA
        else ""
    )
    shown = media if len(media) <= 64 and media.isascii() else "this type"
    return ApiError(
        codes.UNSUPPORTED_MEDIA_TYPE,
        f"{request.method} {request.path} reads {'an' if expected[:1] in 'aeiou' else 'a'} "
        f"{expected} body, not {shown}{hint}",
        details={"expected": expected},
    )


async def load_default_model(app: web.Application) -> None:
    """Load ``DEFAULT_MODEL`` (importing the embedded default when it is named and missing).

    Errors are logged, never raised: the server keeps serving with nothing resident.
    """
    settings = app[keys.SETTINGS]
    name = settings.default_model
    if not name:
        return
    app[keys.HOST]
    catalogue = app[keys.CATALOGUE]
    try:
        from miserver.serving.models.default_model import (
            DEFAULT_NAME,
            import_default,
            repair_gguf_row,
        )

        await asyncio.to_thread(repair_gguf_row, settings.home)  # an older home's q4 row
        if catalogue.get_by_name(name) is None and name == DEFAULT_NAME:
            await asyncio.to_thread(import_default, settings.home, False)
        row = catalogue.get_by_name(name)
        if row is None:
            log.error(
                "DEFAULT_MODEL %r is not in the catalogue (%s); nothing is resident",
                name,
                ", ".join(r.name for r in catalogue.list()) or "empty",
            )
            return
        await app[keys.WEIGHTS].model_transition("model_load", row.id)
    except ApiError as exc:
        log.error("loading DEFAULT_MODEL %r failed: %s %s", name, exc.code.name, exc.message)
    except Exception:  # noqa: BLE001 - a failed start-up load leaves the server up and empty
        log.exception("loading DEFAULT_MODEL %r failed", name)


def app_middlewares(settings: Settings) -> list[Any]:
    """The application's middlewares, outermost first: JSON errors, the shutdown drain, the
    operator token of the guarded management routes (only with ``MANAGEMENT_AUTH=operator``:
    otherwise it passes every request through, so it is left out; the settings of an app do
    not change), and the body checks (413 for a declared size over ``MAX_REQUEST_BYTES``, then
    415 for a body that is not the route's type; :func:`body_checks_middleware`)."""
    middlewares: list[Any] = [
        json_errors_middleware,
        shutdown.shutdown_middleware,  # 503 SHUTTING_DOWN while draining (SIGTERM)
    ]
    if settings.management_auth == "operator":
        middlewares.append(management_auth_middleware)
    middlewares.append(body_checks_middleware(settings.max_request_bytes))
    return middlewares


def create_app(
    settings: Settings,
    *,
    host: ModelHost | None = None,
    scheduler: Scheduler | None = None,
    catalogue: Catalogue | None = None,
    metrics: Metrics | None = None,
    clock: Callable[[], float] | None = None,
) -> web.Application:
    """Build the application of one server process.

    Args:
        settings: the validated configuration.
        host: the model host (default: a new one over ``catalogue``).
        scheduler: the execution slots (default: ``MAX_CONCURRENT_REQUESTS`` slots,
            ``MAX_QUEUED_REQUESTS`` waiting, ``MAX_BATCH_SIZE`` sequences a grant).
        catalogue: the catalogue (default: the one in ``settings.home``).
        metrics: the metric families (default: a fresh registry).
        clock: the weights lifecycle's monotonic clock in seconds (default
            ``time.monotonic``; tests pass a fake clock to jump timers to their deadlines).

    ``app[keys.STARTUP_LOAD]`` is the task loading ``DEFAULT_MODEL`` once the app starts.
    """
    metrics = metrics or Metrics()
    if host is not None:
        catalogue = host.catalogue
    catalogue = catalogue or Catalogue(settings.home)
    host = host or ModelHost(settings, catalogue, metrics=metrics)
    if host.metrics is None:
        host.metrics = metrics
    device_type = settings.resolved_device().split(":")[0]
    scheduler = scheduler or Scheduler(
        max_concurrent=settings.max_concurrent_requests,
        max_queued=settings.max_queued_requests,
        max_batch_size=resolved_max_batch_size(settings, device_type),
        batch_delay_s=resolved_batch_delay_s(settings, device_type),
    )
    # The continuous engine: requests join the running batch of their resident at the next
    # step instead of waiting for it to end (slot.py, "Joining the running batch").
    scheduler.join_running = True
    host.scheduler = scheduler
    app = web.Application(
        middlewares=app_middlewares(settings), client_max_size=settings.max_request_bytes
    )
    shutdown.install(app, settings.shutdown_grace_s)
    app[keys.SETTINGS] = settings
    app[SCRUB_SECRETS] = tuple(token.secret for token in settings.weights_tokens)
    app[keys.CATALOGUE] = catalogue
    app[keys.HOST] = host
    app[keys.SCHEDULER] = scheduler
    app[keys.METRICS] = metrics
    app[keys.STARTUP_LOAD] = None

    runtime = WeightsRuntime(
        settings=settings,
        scheduler=scheduler,
        host=host,
        metrics=metrics,
        clock=clock or time.monotonic,
    )
    weights.setup_routes(app, runtime)
    management.setup_routes(app)
    try:
        v1 = importlib.import_module("miserver.http.v1")
    except ModuleNotFoundError as exc:  # part of the tree not written yet: serve without /v1
        if exc.name != "miserver.http.v1":
            raise
        log.warning("miserver.http.v1 is missing: /v1 routes are not served")
    else:
        v1.setup_routes(app)
    batches.setup_routes(app)  # /v1/files, /v1/batches and the batch runner (contract 7)

    async def on_startup(app: web.Application) -> None:
        use_expect_continue(app)  # every route, those added after create_app included
        warning = settings.training_warning(scheduler.max_concurrent)
        if warning is not None:  # issue 32, item 5: training is impossible, said once
            log.warning(warning)
        app[keys.STARTUP_LOAD] = asyncio.create_task(
            load_default_model(app), name="miserver-default-load"
        )

    async def on_cleanup(app: web.Application) -> None:
        task = app[keys.STARTUP_LOAD]
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if not host.busy:
            host.shutdown()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
