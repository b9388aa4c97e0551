"""The Batch API routes: OpenAI-compatible ``/v1/files`` and ``/v1/batches`` (contract 7).

| Route | Does |
|---|---|
| ``POST /v1/files`` | multipart ``file`` (JSONL) + ``purpose=batch``; validated line by line; File |
| ``GET /v1/files`` | list (``purpose``, ``after``, ``limit``, ``order``) |
| ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content`` | the File object, its bytes |
| ``DELETE /v1/files/{id}`` | ``{id, object: "file", deleted: true}`` |
| ``POST /v1/batches`` | ``{input_file_id, endpoint, completion_window: "24h", metadata?}``; Batch |
| ``GET /v1/batches`` | list, newest first (``after``, ``limit`` 1..100) |
| ``GET /v1/batches/{id}`` | the Batch object plus ``waiting_reason`` |
| ``POST /v1/batches/{id}/cancel`` | cancelling, then cancelled with the results so far |

Errors are :class:`~miserver.spec.errors.ApiError` with codes from :mod:`miserver.spec.codes`;
the JSON-errors middleware renders them in OpenAI's shape on ``/v1``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import BodyPartReader, web

from miserver.http import keys
from miserver.http.errors import json_response, openai_error_body, refuse_secret_name
from miserver.http.openai_schema import check_body
from miserver.http.v1 import run_completion
from miserver.serving.batches.input_file import BatchRequestError
from miserver.serving.batches.runner import BLOCKING_REASONS, BatchRunner, RowDeferred, RowExecutor
from miserver.serving.batches.store import BatchStore
from miserver.serving.engine.slot import Priority, Unit
from miserver.serving.models.host import Resident
from miserver.spec import codes
from miserver.spec.errors import ApiError
from miserver.spec.json_syntax import decode_error_message

log = logging.getLogger("miserver.batches")

BATCH_STORE: web.AppKey[BatchStore] = web.AppKey("batch_store", BatchStore)
BATCH_RUNNER: web.AppKey[BatchRunner] = web.AppKey("batch_runner", BatchRunner)

#: Multipart fields OpenAI's client may send besides ``file`` and ``purpose``; ignored.
_IGNORED_FILE_FIELDS = frozenset({"expires_after[anchor]", "expires_after[seconds]"})
_READ_CHUNK = 1 << 16

ExecutorSource = RowExecutor | Callable[[web.Application], RowExecutor]


def body_problem(url: str, body: dict[str, Any]) -> str | None:
    """What ``url``'s route would refuse in a Batch line's ``body`` before it looks at a model
    (:func:`miserver.http.openai_schema.check_body`), as ``body.<field>: ...``; None if nothing."""
    try:
        check_body(url, body)
    except ApiError as err:
        where = f"body.{err.param}" if err.param else "body"
        return f"{where}: {err.message}"
    return None


def _api_error(exc: BatchRequestError) -> ApiError:
    return ApiError(exc.code, exc.message, param=exc.param)


def _store(request: web.Request) -> BatchStore:
    return request.app[BATCH_STORE]


def _runner(request: web.Request) -> BatchRunner:
    return request.app[BATCH_RUNNER]


def _waiting(request: web.Request) -> Callable[[str], str | None]:
    return _runner(request).waiting_reason


def _int_query(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(
            codes.INVALID_REQUEST, f"{name} must be an integer, got {raw[:40]!r}", param=name
        ) from None
    if not lo <= value <= hi:
        raise ApiError(codes.INVALID_REQUEST, f"{name} must be between {lo} and {hi}", param=name)
    return value


# -- files -------------------------------------------------------------------------------------

#: The most bytes a multipart field other than ``file`` may hold.
_MAX_FIELD_BYTES = 1024


async def _read_part(part: BodyPartReader, limit: int, param: str) -> bytes:
    """A part's bytes; 413 past ``limit`` (a chunked body has no Content-Length to check)."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await part.read_chunk(_READ_CHUNK):
        size += len(chunk)
        if size > limit:
            raise ApiError(
                codes.PAYLOAD_TOO_LARGE,
                f"{param} is larger than {limit} bytes"
                + (" (MAX_REQUEST_BYTES)" if param == "file" else ""),
                param=param,
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def create_file(request: web.Request) -> web.Response:
    """``POST /v1/files``: multipart ``purpose=batch`` and ``file``; 400 naming bad lines."""
    if request.content_type != "multipart/form-data":
        raise ApiError(
            codes.INVALID_REQUEST,
            "POST /v1/files takes multipart/form-data with the fields file and purpose",
            param="file",
        )
    max_bytes: int = request.app.get(_MAX_UPLOAD, 8 * 1024 * 1024)
    try:
        reader = await request.multipart()
        purpose: str | None = None
        data: bytes | None = None
        filename = "batch.jsonl"
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise ApiError(
                    codes.INVALID_REQUEST, "nested multipart bodies are not accepted", param="file"
                )
            name = part.name or ""
            if name == "purpose":
                raw = await _read_part(part, _MAX_FIELD_BYTES, "purpose")
                purpose = raw.decode("utf-8", "replace").strip()
            elif name == "file":
                filename = (part.filename or filename)[:255]
                data = await _read_part(part, max_bytes, "file")
            elif name in _IGNORED_FILE_FIELDS:
                await _read_part(part, _MAX_FIELD_BYTES, name)
            else:
                raise ApiError(
                    codes.INVALID_REQUEST, f"unknown field {name[:64]!r}", param=name[:64]
                )
    except (ValueError, AssertionError) as exc:
        raise ApiError(
            codes.INVALID_REQUEST, f"malformed multipart body ({exc})"[:200], param="file"
        ) from None
    if purpose is None:
        raise ApiError(codes.INVALID_REQUEST, 'purpose is required ("batch")', param="purpose")
    if data is None:
        raise ApiError(codes.INVALID_REQUEST, "file is required", param="file")
    refuse_secret_name(request.app, filename, "filename")  # GET /v1/files lists it
    try:
        obj = await asyncio.to_thread(
            _store(request).create_file, data, filename=filename, purpose=purpose
        )
    except BatchRequestError as exc:
        raise _api_error(exc) from None
    return json_response(obj)


create_file.body_media = "multipart/form-data"  # type: ignore[attr-defined]


async def list_files(request: web.Request) -> web.Response:
    """``GET /v1/files``."""
    limit = _int_query(request, "limit", 10000, 1, 10000)
    try:
        page = _store(request).list_files(
            purpose=request.query.get("purpose"),
            after=request.query.get("after"),
            limit=limit,
            order=request.query.get("order", "desc"),
        )
    except BatchRequestError as exc:
        raise _api_error(exc) from None
    return json_response(page)


async def get_file(request: web.Request) -> web.Response:
    """``GET /v1/files/{file_id}``."""
    try:
        return json_response(_store(request).get_file(request.match_info["file_id"]))
    except BatchRequestError as exc:
        raise _api_error(exc) from None


async def file_content(request: web.Request) -> web.Response:
    """``GET /v1/files/{file_id}/content``: the JSONL bytes."""
    try:
        data = await asyncio.to_thread(_store(request).file_content, request.match_info["file_id"])
    except BatchRequestError as exc:
        raise _api_error(exc) from None
    return web.Response(body=data, content_type="application/jsonl")


async def delete_file(request: web.Request) -> web.Response:
    """``DELETE /v1/files/{file_id}``."""
    try:
        return json_response(_store(request).delete_file(request.match_info["file_id"]))
    except BatchRequestError as exc:
        raise _api_error(exc) from None


# -- batches -----------------------------------------------------------------------------------


async def create_batch(request: web.Request) -> web.Response:
    """``POST /v1/batches``: the Batch object, status ``in_progress``."""
    raw = await request.read()
    try:
        body: Any = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ApiError(codes.INVALID_REQUEST, decode_error_message(raw, exc)) from None
    if isinstance(body, dict):  # GET /v1/batches lists metadata, unauthenticated
        refuse_secret_name(request.app, body.get("metadata"), "metadata")
    try:
        obj = await asyncio.to_thread(_store(request).create_batch, body)
    except BatchRequestError as exc:
        raise _api_error(exc) from None
    _runner(request).wake()
    obj["waiting_reason"] = None
    return json_response(obj)


async def list_batches(request: web.Request) -> web.Response:
    """``GET /v1/batches``."""
    limit = _int_query(request, "limit", 20, 1, 100)
    try:
        page = _store(request).list_batches(
            after=request.query.get("after"), limit=limit, waiting=_waiting(request)
        )
    except BatchRequestError as exc:
        raise _api_error(exc) from None
    return json_response(page)


async def get_batch(request: web.Request) -> web.Response:
    """``GET /v1/batches/{batch_id}``."""
    batch_id = request.match_info["batch_id"]
    try:
        return json_response(_store(request).get_batch(batch_id, _waiting(request)(batch_id)))
    except BatchRequestError as exc:
        raise _api_error(exc) from None


async def cancel_batch(request: web.Request) -> web.Response:
    """``POST /v1/batches/{batch_id}/cancel``."""
    batch_id = request.match_info["batch_id"]
    try:
        obj = _store(request).cancel_batch(batch_id)
    except BatchRequestError as exc:
        raise _api_error(exc) from None
    _runner(request).cancel(batch_id)  # a row held by a quiesce or generating stops now
    return json_response(obj)


_MAX_UPLOAD: web.AppKey[int] = web.AppKey("batch_max_upload_bytes", int)


# -- the seam over the running server -----------------------------------------------------------


class ServerRowExecutor:
    """The :class:`~miserver.serving.batches.runner.RowExecutor` of a live server (contract 7).

    ``waiting_reason(model)``: ``weights_torn`` while the lifecycle says torn
    (``keys.WEIGHTS_SUMMARY``), ``model_not_resident`` while ``model`` is not the resident's
    served or base name (a load in progress included; a name that is neither resident nor in the
    catalogue runs and gets its 404 line), ``quiesced`` while the scheduler's barrier is held or
    draining, else None.

    ``execute_row`` runs one row through :func:`miserver.http.v1.run_completion`, the path of a
    non-streamed ``/v1`` request (the same strict schema, admission, context checks, generation,
    response body and ``X-miLLM-Model``), with the refuse load policy (a batch never loads a
    model) and at ``Priority.BATCH``: behind every interactive request, held by a quiesce
    (``held_batch_chunks``, one per chunk), in the row's ``unit`` (its chunk, whose rows the
    scheduler grants together: never the first alone). Refusals come back as ``(status, headers,
    OpenAI error body)`` (the runner turns the "not now" ones into waiting,
    :func:`~miserver.serving.batches.runner.deferral_of`); a row found blocked inside the slot
    raises :class:`~miserver.serving.batches.runner.RowDeferred`.
    """

    def __init__(self, app: web.Application) -> None:
        self.app = app

    def _torn(self) -> bool:
        summary = self.app.get(keys.WEIGHTS_SUMMARY)
        if summary is None:
            return False
        try:
            return summary().get("weights_state") == "torn"
        except Exception:  # noqa: BLE001 - unreadable: do not run rows on unknown weights
            log.exception("the weights summary could not be read; batch rows wait")
            return True

    def waiting_reason(self, model: str) -> str | None:
        if self._torn():
            return "weights_torn"
        host = self.app[keys.HOST]
        if not host.serves(model) and (host.busy or host.resolve(model) is not None):
            return "model_not_resident"
        scheduler = self.app[keys.SCHEDULER]
        if scheduler.barrier_held or scheduler.barrier_draining:
            return "quiesced"
        return None

    def _check_in_slot(self, resident: Resident) -> None:
        """Inside the slot, before the forward pass: a row that cannot run now waits."""
        reason = self.waiting_reason(resident.served_name)
        if reason in BLOCKING_REASONS:
            raise RowDeferred(reason)

    async def execute_row(
        self, method: str, url: str, body: dict[str, Any], *, unit: Unit | None = None
    ) -> tuple[int, dict[str, str], dict[str, Any]]:
        try:
            result = await run_completion(
                self.app,
                url,
                body,
                priority=Priority.BATCH,
                load_policy="refuse",
                check_in_slot=self._check_in_slot,
                unit=unit,
            )
        except ApiError as err:
            return err.status, dict(err.headers), openai_error_body(err)
        return 200, result.headers, result.body


def setup_routes(
    app: web.Application,
    *,
    home: str | None = None,
    executor: ExecutorSource | None = None,
    max_upload_bytes: int | None = None,
    chunk_size: int = 8,
    poll_s: float = 0.5,
) -> None:
    """Register the Batch API on ``app`` and run its runner with the app (contract 7).

    ``home`` is ``MISERVER_HOME`` (``batches.sqlite3`` and ``files/`` live there; default
    ``app[keys.SETTINGS].home``). ``executor`` is the runtime seam, or a function of the app
    returning it, called at start-up; default :class:`ServerRowExecutor`. ``max_upload_bytes``
    caps an uploaded file (default ``MAX_REQUEST_BYTES``). ``chunk_size`` is the most rows the
    runner starts together; it is raised to the scheduler's ``max_batch_size``
    (``MAX_BATCH_SIZE``, when ``app[keys.SCHEDULER]`` is set) so a chunk can fill a static
    batch. The runner starts with the app and stops before the app's later cleanup hooks; the
    rows it was running run again after a restart.
    """
    settings = app.get(keys.SETTINGS)
    if home is None:
        if settings is None:
            raise ValueError("setup_routes needs home= or app[keys.SETTINGS]")
        home = settings.home
    if max_upload_bytes is None:
        max_upload_bytes = settings.max_request_bytes if settings is not None else 8 << 20
    scheduler = app.get(keys.SCHEDULER)
    if scheduler is not None:
        chunk_size = max(chunk_size, scheduler.max_batch_size)
    store = BatchStore(home)
    store.body_check = body_problem  # every line's body, as its route checks it (issue 32)
    runner = BatchRunner(store, None, chunk_size=chunk_size, poll_s=poll_s)
    app[BATCH_STORE] = store
    app[BATCH_RUNNER] = runner
    app[_MAX_UPLOAD] = max_upload_bytes
    app.router.add_post("/v1/files", create_file)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)

    async def start_runner(app: web.Application) -> None:
        source = executor if executor is not None else ServerRowExecutor
        if isinstance(source, type) or not hasattr(source, "execute_row"):
            runner.executor = source(app)  # type: ignore[operator]
        else:
            runner.executor = source
        runner.start()

    async def stop_runner(app: web.Application) -> None:
        await runner.stop()
        store.close()

    app.on_startup.append(start_runner)
    app.on_cleanup.append(stop_runner)
