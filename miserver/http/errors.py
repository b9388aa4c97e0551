"""The management envelope, OpenAI-shaped errors, and the middleware that makes every error JSON.

Contract section 2: management routes answer ``{"success", "data", "error"}``; ``/v1`` routes
answer ``{"error": {"message", "type", "param", "code"}}``. Every error body is JSON, also 404,
405, 413 and 500. No error echoes a token or a raw request body.

The error itself (:class:`~miserver.spec.errors.ApiError`, and the full disk's 507) is the
contract's and lives in :mod:`miserver.spec.errors`; this module only maps it to responses.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec
from aiohttp import http_exceptions, web

from miserver.spec import codes
from miserver.spec.codes import ErrorCode
from miserver.spec.errors import ApiError, disk_full_error, is_disk_full

log = logging.getLogger("miserver.http")

_encoder = msgspec.json.Encoder()


def json_response(
    body: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    """A JSON response encoded with msgspec (Structs, dicts, lists)."""
    return web.Response(
        body=_encoder.encode(body), status=status, content_type="application/json", headers=headers
    )


def ok(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    """``{"success": true, "data": data, "error": null}``."""
    return json_response({"success": True, "data": data, "error": None}, status, headers)


def management_error_body(err: ApiError) -> dict[str, Any]:
    return {
        "success": False,
        "data": None,
        "error": {
            "code": err.code.name,
            "message": err.message,
            "reason": err.reason,
            "details": err.details,
        },
    }


def openai_error_body(err: ApiError) -> dict[str, Any]:
    return {
        "error": {
            "message": err.message,
            "type": err.code.openai_type,
            "param": err.param,
            "code": err.code.wire,
        }
    }


def is_openai_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


#: Codes answered with ``Retry-After`` wherever they are raised (the table's
#: ``RETRY_AFTER_CODES`` for lifecycle refusals; a route's own 409 MODEL_BUSY too: it lasts only
#: as long as the operation in progress; issue 16 item 12).
RETRY_AFTER_S = "1"
_ALWAYS_RETRY_AFTER = frozenset(
    {codes.MODEL_BUSY.name, codes.QUEUE_FULL.name, codes.WEIGHTS_TORN.name}
)


def error_response(request_path: str, err: ApiError) -> web.Response:
    """The error in the shape of the route family of ``request_path``; a 409 MODEL_BUSY, 503
    QUEUE_FULL or 503 WEIGHTS_TORN always with ``Retry-After``."""
    body = openai_error_body(err) if is_openai_path(request_path) else management_error_body(err)
    headers = err.headers
    if err.code.name in _ALWAYS_RETRY_AFTER and not any(
        k.lower() == "retry-after" for k in headers
    ):
        headers = {**headers, "Retry-After": RETRY_AFTER_S}
    return json_response(body, err.status, headers)


_HTTP_CODES: dict[int, ErrorCode] = {
    400: codes.INVALID_REQUEST,
    404: codes.NOT_FOUND,
    405: codes.METHOD_NOT_ALLOWED,
    413: codes.PAYLOAD_TOO_LARGE,
    415: codes.UNSUPPORTED_MEDIA_TYPE,
}


def code_for_status(status: int) -> ErrorCode:
    """The error code for one of aiohttp's own HTTP errors (404, 405, 413, ...; 5xx: internal)."""
    return _HTTP_CODES.get(status, codes.INTERNAL_ERROR if status >= 500 else codes.INVALID_REQUEST)


#: The secrets no error body may repeat (the configured weights tokens; set by the app factory).
SCRUB_SECRETS: web.AppKey[tuple[str, ...]] = web.AppKey("scrub_secrets", tuple)
#: What a secret is replaced with in an error body.
MASK = "***"
#: What ``request.read()`` raises when the client closed the connection mid-body.
CLIENT_GONE = ConnectionResetError


def scrub(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with every occurrence of each of ``secrets`` replaced by ``***``."""
    for secret in secrets:
        if secret and secret in text:
            text = text.replace(secret, MASK)
    return text


def contains_secret(value: Any, secrets: tuple[str, ...]) -> bool:
    """Whether any string in ``value`` (a string, or the keys and values of nested dicts and
    lists) contains one of ``secrets``."""
    if isinstance(value, str):
        return any(secret and secret in value for secret in secrets)
    if isinstance(value, dict):
        return any(
            contains_secret(k, secrets) or contains_secret(v, secrets) for k, v in value.items()
        )
    if isinstance(value, (list, tuple)):
        return any(contains_secret(v, secrets) for v in value)
    return False


def refuse_secret_name(app: web.Application, name: Any, field: str = "name") -> None:
    """Refuse a public name or listed field (a served name, a catalogue row's name or path, a
    checkpoint's or adapter's name, a batch's metadata, an uploaded file's name: they go out in
    ``X-miLLM-Model`` and in listings, some unauthenticated) that contains one of the configured
    weights tokens, without repeating it (weights page: a token is never returned).

    Raises:
        ApiError: 400 INVALID_REQUEST naming ``field``.
    """
    if name and contains_secret(name, app.get(SCRUB_SECRETS, ())):
        raise ApiError(
            codes.INVALID_REQUEST,
            f"this {field} contains one of the server's weights tokens; {field} is public (it is"
            " sent in X-miLLM-Model or listed): choose another, and replace that token",
            param=field,
            details={"field": field},
        )


#: The status ``/v1`` gives a request whose client went away (nginx's "client closed request";
#: http/v1.py): the access line says 499, but nothing is written to the connection, which is
#: closed (:meth:`miserver.http.protocol.JsonErrorRequestHandler.finish_response`). Not a status
#: any client is ever sent: it has no reason phrase and no JSON body.
CLIENT_GONE_STATUS = 499

#: The content codings aiohttp decodes in a request body (more with its optional extras).
DECODED_CODINGS = ("gzip", "deflate", "br", "zstd")


def body_unreadable_error(request: web.BaseRequest, exc: BaseException) -> ApiError:
    """The 400 for a body aiohttp could not read (``web.RequestPayloadError``): a body that is
    not what its ``Content-Encoding`` says (gzip that is not gzip), or whose chunked framing or
    length is wrong. Built from the exception's type and the coding's name only (one of
    :data:`DECODED_CODINGS`), never from the body's bytes."""
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, http_exceptions.ContentEncodingError):
        coding = request.headers.get("Content-Encoding", "").strip().lower()
        name = coding if coding in DECODED_CODINGS else "the declared coding"
        return ApiError(
            codes.INVALID_REQUEST,
            f"the request body is not valid {name} data (Content-Encoding: {name}); send the "
            f"body compressed with {name}, or uncompressed without a Content-Encoding header",
            details={"content_encoding": name},
        )
    return ApiError(
        codes.INVALID_REQUEST,
        "the request body's framing is invalid (its Content-Length, Transfer-Encoding or "
        "chunk sizes do not match the bytes sent)",
    )


def body_read_timeout_error(timeout_s: float) -> ApiError:
    """408: no byte of the request body arrived for ``timeout_s`` seconds
    (``BODY_READ_TIMEOUT_S``); the connection is closed after this answer."""
    return ApiError(
        codes.INVALID_REQUEST,
        f"no byte of the request body arrived for {timeout_s:g} s (BODY_READ_TIMEOUT_S) before "
        "the length it declared was complete; the connection is closed. Send the whole body "
        "without pausing",
        details={"body_read_timeout_s": timeout_s},
        status=408,
    )


def client_gone_error() -> ApiError:
    """The answer to a request whose client closed the connection before its whole body
    arrived (400; nobody reads it, but the access and audit lines say what happened)."""
    return ApiError(
        codes.INVALID_REQUEST,
        "the client closed the connection before the whole request body arrived",
    )


@web.middleware
async def json_errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turn :class:`ApiError` and aiohttp's own HTTP errors into JSON bodies; never a plain 500.

    No error body repeats a configured weights token (weights page: a token is never returned
    or echoed in an error): a client that put its token in a path or a field gets ``***``
    there. A client that closed the connection mid-body is a 400, not a failure of ours.
    """
    try:
        resp = await handler(request)
    except ApiError as err:
        resp = error_response(request.path, err)
    except CLIENT_GONE:
        log.info("%s request: the client closed the connection mid-body", request.method)
        resp = error_response(request.path, client_gone_error())
    except web.RequestPayloadError as exc:  # a client's bad body: one line, no traceback
        err = body_unreadable_error(request, exc)
        path = scrub(request.path, request.app.get(SCRUB_SECRETS, ()))
        log.warning("%s %s refused with 400: %s", request.method, path, err.message)
        resp = error_response(request.path, err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = code_for_status(exc.status)
        message = {
            404: f"no route for {request.method} {request.path}",
            405: f"method {request.method} is not allowed on {request.path}",
            413: "the request body is larger than MAX_REQUEST_BYTES",
        }.get(exc.status, exc.reason or "request refused")
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        resp = error_response(
            request.path, ApiError(code, message, status=exc.status, headers=headers)
        )
    except Exception as exc:  # noqa: BLE001 - the last line of defence: log it, answer JSON 500
        secrets = request.app.get(SCRUB_SECRETS, ())
        path = scrub(request.path, secrets)
        if is_disk_full(exc):  # not a bug of ours: one line, no traceback, a 507 that says so
            log.error("%s %s failed: the disk is full (%s)", request.method, path, exc)
            from miserver.http import keys  # here: keys imports the serving layer

            where = getattr(request.app.get(keys.SETTINGS), "home", None)
            err = disk_full_error(f"the data of {request.method} {path}", where)
        else:
            log.exception("unhandled error on %s %s", request.method, path)
            err = ApiError(codes.INTERNAL_ERROR, "internal server error")
        resp = error_response(request.path, err)
    if resp.status >= 400 and isinstance(resp, web.Response) and isinstance(resp.body, bytes):
        secrets = request.app.get(SCRUB_SECRETS, ())
        if secrets:
            text = resp.body.decode("utf-8", "replace")
            clean = scrub(text, secrets)
            if clean is not text:
                resp.body = clean.encode("utf-8")
    return resp
