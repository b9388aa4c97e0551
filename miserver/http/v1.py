"""``/v1``: OpenAI-compatible serving (companion contract 4).

Routes: ``GET /v1/models``, ``GET /v1/models/{model}``, ``POST /v1/chat/completions``,
``POST /v1/completions``, streamed (server-sent events ending ``data: [DONE]``) or not.

The path of one request:

1. the body is decoded and checked strictly (:mod:`miserver.http.openai_schema`; 400 before
   anything is queued);
2. :func:`admit` decides which resident serves it (the one admission decision; auto-load with
   ``X-miLLM-Load-Policy``);
3. the prompt is tokenized and checked against the context window (400;
   :mod:`miserver.http.v1_prepare`);
4. the request waits for a scheduler slot (:class:`~miserver.serving.engine.slot.Scheduler`,
   503 QUEUE_FULL when the queue is full) and keeps it until the engine is done with its
   sequences, so it is computed on one parameter set;
5. its sequences join the resident's continuous engine
   (:mod:`miserver.serving.engine.engine_loop`; llama.cpp on a GGUF resident), whose events
   it reads (:mod:`miserver.serving.engine.generation`); a failure before the first token is a
   JSON 500, after a stream opened it is one ``error`` event and no ``[DONE]``; a client that
   goes away cancels it within a decode step.

Every successful response carries ``X-miLLM-Model`` (:func:`miserver.http.model_header.model_header`)
and a stream's terminal chunk (and its usage chunk) carries the same value as ``millm_model``.

:func:`run_completion` is the one public entry point that runs a request body to its final
(non-streamed) answer: the non-streamed ``/v1`` path and the Batch API's rows
(:mod:`miserver.http.batches`, at :attr:`~miserver.serving.engine.slot.Priority.BATCH`) both go
through it, so a batch row is validated, admitted, computed and answered exactly as ``/v1`` would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec
from aiohttp import web

from miserver.http import keys
from miserver.http import openai_schema as schema
from miserver.http.errors import json_response
from miserver.http.model_header import HEADER, model_header
from miserver.http.v1_admission import (
    DISCONNECT_POLL_S,
    LOAD_POLICY_HEADER,
    Job,
    RequestCancelled,
    acquire_slot,
    caller_may_load,
    client_disconnected,
    update_queue_gauge,
    wait_for_startup_load,
)
from miserver.http.v1_prepare import (
    bad_request,
    check_n,
    prepare_chat,
    prepare_completion,
    read_body,
)
from miserver.http.v1_rendering import (
    DISCONNECTED,
    OUTCOME,
    collect_with_header,
    generation_failed,
    stream_response,
)
from miserver.serving.engine.generation import Generation, GenerationError, Started
from miserver.serving.engine.slot import Grant, Priority, Unit
from miserver.serving.models import gguf
from miserver.serving.models.host import Resident
from miserver.spec import codes
from miserver.spec.errors import ApiError

log = logging.getLogger("miserver.v1")


#: The request body type of each endpoint (the Batch API's ``url`` / ``endpoint`` values).
COMPLETION_ENDPOINTS: dict[str, type[msgspec.Struct]] = {
    "/v1/chat/completions": schema.ChatCompletionRequest,
    "/v1/completions": schema.CompletionRequest,
}

RequestBody = bytes | Mapping[str, Any] | schema.ChatCompletionRequest | schema.CompletionRequest


@dataclass(frozen=True)
class CompletionResult:
    """The final answer of :func:`run_completion`.

    Attributes:
        body: the OpenAI response object as JSON-ready data (``chat.completion`` or
            ``text_completion``), exactly the body ``/v1`` answers with status 200.
        model_header: the ``X-miLLM-Model`` value of the parameter set that computed it
            (weights page: Which weights answered), e.g. ``"tiny";origin=model;commits=1``.
    """

    body: dict[str, Any]
    model_header: str

    @property
    def headers(self) -> dict[str, str]:
        """``{"X-miLLM-Model": model_header}``: the headers ``/v1`` sends with the body."""
        return {HEADER: self.model_header}


# --- running ----------------------------------------------------------------------------------
class _DisconnectWatch:
    """One poller, per event loop, of every generating request's ``cancelled`` (its client's
    disconnection): every :data:`DISCONNECT_POLL_S` it asks each watched request, and cancels
    the generations of one whose ``cancelled()`` is true (then stops watching it). A request
    that goes away is stopped within one poll and one decode step, as with a poller of its own;
    one timer for all instead of one a request (64 requests polled each on its own woke the
    event loop 64 times every 50 ms). The polling task runs while a request is watched."""

    def __init__(self) -> None:
        self._watched: dict[object, tuple[Callable[[], bool], list[Generation]]] = {}
        self._task: asyncio.Task[None] | None = None

    def add(self, cancelled: Callable[[], bool], gens: list[Generation]) -> object:
        """Watch ``cancelled`` for ``gens``; returns the key to :meth:`remove` it with."""
        key = object()
        self._watched[key] = (cancelled, gens)
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        return key

    def remove(self, key: object) -> None:
        """Stop watching ``key`` (nothing if it is not watched); the last one stops the task."""
        self._watched.pop(key, None)
        if not self._watched and self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._watched:
            await asyncio.sleep(DISCONNECT_POLL_S)
            for key, (cancelled, gens) in list(self._watched.items()):
                if key not in self._watched:
                    continue  # removed while an earlier one was asked
                try:
                    gone = cancelled()
                except Exception as exc:  # noqa: BLE001 - that request's poller alone ends
                    self._watched.pop(key, None)
                    loop.call_exception_handler(
                        {"message": "Task exception was never retrieved", "exception": exc}
                    )
                    continue
                if gone:
                    self._watched.pop(key, None)
                    for gen in gens:
                        gen.cancel()
        self._task = None


_WATCHES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _DisconnectWatch] = (
    weakref.WeakKeyDictionary()
)


def _disconnect_watch() -> _DisconnectWatch:
    """The running loop's :class:`_DisconnectWatch`."""
    loop = asyncio.get_running_loop()
    watch = _WATCHES.get(loop)
    if watch is None:
        watch = _WATCHES[loop] = _DisconnectWatch()
    return watch


@dataclass
class Running:
    """A request inside the slot: its ``n`` sequences (choice order), each one's
    :class:`~miserver.serving.engine.generation.Started`, and the ``X-miLLM-Model`` of the parameter
    set computing them (the same for every request of the batch: one set per pass)."""

    gens: list[Generation]
    events: list[AsyncIterator[Any]]
    firsts: list[Started]
    header: str

    def cancel(self) -> None:
        for gen in self.gens:
            gen.cancel()

    async def wait(self) -> None:
        for gen in self.gens:
            await gen.wait()


def _join_batch(app: web.Application, grant: Grant, job: Job) -> list[Generation]:
    """Hand ``job``'s ``n`` sequences to the resident: on a transformers resident they join its
    continuous engine's running batch at the engine's next step
    (:meth:`~miserver.serving.engine.engine_loop.EngineLoop.submit`); on a GGUF resident they
    start on llama.cpp's slots at once (:func:`~miserver.serving.models.gguf.submit`).

    Raises:
        RuntimeError: a transformers resident without an engine (closed: it was dropped).
    """
    engine_loop = getattr(job.resident, "engine_loop", None)
    if engine_loop is not None:  # the continuous engine: the request joins its running batch
        streams = engine_loop.submit(
            job.prompt_ids,
            job.params,
            n=job.n,
            stream=job.stream,  # a whole answer: each sequence's text as one delta, at its end
            priority=grant.priority,
        )
        grant.join()
        return list(streams)
    if job.resident.kind == "gguf":
        # A GGUF resident's sequences start on llama.cpp's slots at once (contract 4a): the
        # grant put the request into the running work while it had room (fill_running).
        gens = gguf.submit(
            job.resident.model,
            job.resident.tokenizer,
            job.prompt_ids,
            job.params,
            n=job.n,
            stream=job.stream,
        )
        grant.join()
        return list(gens)
    raise RuntimeError("the engine of this model is closed")


@contextlib.asynccontextmanager
async def _generation(
    app: web.Application,
    job: Job,
    priority: Priority,
    cancelled: Callable[[], bool] | None,
    check_in_slot: Callable[[Resident], None] | None,
    unit: Unit | None = None,
) -> AsyncIterator[Running]:
    """Hold a share of a slot for the whole generation: yields the :class:`Running` request.

    The request joins the running batch its grant belongs to (contract 4); its share of the
    slot is released when the engine is done with all its sequences, never before,
    also when the caller is cancelled; leaving the block cancels its sequences that still run.

    Raises:
        ApiError: the slot's refusals (:func:`acquire_slot`), 500 GENERATION_FAILED before
            the first token.
        RequestCancelled: ``cancelled()`` became true while waiting for the slot.
    """
    grant, job.resident = await acquire_slot(
        app, job.resident, priority, cancelled, job.adapter, job.n, unit=unit, model=job.model
    )
    scheduler = app[keys.SCHEDULER]

    def release() -> None:
        scheduler.release(grant)
        update_queue_gauge(app)

    try:
        if check_in_slot is not None:
            check_in_slot(job.resident)
        header = model_header(job.resident)
        gens = _join_batch(app, grant, job)
    except BaseException:
        release()
        raise
    left = [len(gens)]

    def one_done() -> None:
        left[0] -= 1
        if left[0] == 0:
            release()

    for gen in gens:
        gen.add_done_callback(one_done)
    watch = _disconnect_watch() if cancelled is not None else None
    watched: object | None = None
    running: Running | None = None
    try:
        if watch is not None and cancelled is not None:
            watched = watch.add(cancelled, gens)
        events = [gen.events() for gen in gens]
        firsts = []
        for stream in events:
            try:
                first = await stream.__anext__()
            except GenerationError as exc:
                raise generation_failed(app, job, exc) from exc
            assert isinstance(first, Started)
            firsts.append(first)
        running = Running(gens, events, firsts, header)
        yield running
    finally:
        if watch is not None and watched is not None:
            watch.remove(watched)
        for gen in gens:
            gen.cancel()  # a no-op once it finished
        for gen in gens:
            await gen.wait()


def _decode(
    endpoint: str, body: RequestBody
) -> schema.ChatCompletionRequest | schema.CompletionRequest:
    kind = COMPLETION_ENDPOINTS.get(endpoint)
    if kind is None:
        raise ValueError(
            f"endpoint must be one of {', '.join(COMPLETION_ENDPOINTS)}, got {endpoint!r}"
        )
    if isinstance(body, kind):
        return body  # type: ignore[return-value]
    if isinstance(body, msgspec.Struct):
        raise TypeError(f"{type(body).__name__} is not the request body of {endpoint}")
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    return schema.decode(raw, kind)


async def _prepare(
    app: web.Application,
    req: schema.ChatCompletionRequest | schema.CompletionRequest,
    load_policy: str | None,
    priority: Priority = Priority.INTERACTIVE,
    cancelled: Callable[[], bool] | None = None,
    may_load: bool = True,
) -> Job:
    check_n(app, req)
    await wait_for_startup_load(app, cancelled)
    if isinstance(req, schema.ChatCompletionRequest):
        return await prepare_chat(app, req, load_policy, priority, may_load)
    return await prepare_completion(app, req, load_policy, priority, may_load)


async def run_completion(
    app: web.Application,
    endpoint: str,
    body: RequestBody,
    *,
    priority: Priority = Priority.INTERACTIVE,
    load_policy: str | None = None,
    cancelled: Callable[[], bool] | None = None,
    check_in_slot: Callable[[Resident], None] | None = None,
    may_load: bool = True,
    unit: Unit | None = None,
) -> CompletionResult:
    """Run one chat-completion or completion request to its final, non-streamed answer.

    The one run path of ``/v1`` (contract 4) outside streaming: strict decoding and range checks,
    admission (:func:`admit`, honouring ``load_policy``), tokenization and the context checks,
    a scheduler slot at ``priority`` held until the generation thread has ended (so the answer
    is computed on one parameter set; weights page: Which weights answered), the table's
    confirmation inside the slot, the generation, and the OpenAI response body.

    Args:
        app: the running application (host, scheduler, lifecycle).
        endpoint: ``"/v1/chat/completions"`` or ``"/v1/completions"``
            (:data:`COMPLETION_ENDPOINTS`).
        body: the request body: JSON bytes, a decoded JSON object, or the already decoded
            request Struct of ``endpoint``. ``stream`` must be false or absent.
        priority: ``Priority.INTERACTIVE`` (``/v1``) or ``Priority.BATCH`` (Batch API rows:
            granted after every waiting interactive request, held by a quiesce and counted in
            ``held_batch_chunks``, once per ``unit``; contract 7). ``MAX_QUEUED_REQUESTS``
            bounds the interactive requests that wait (queued or held); a batch row is never refused
            503 QUEUE_FULL, and batch rows do not count toward that bound.
        load_policy: the ``X-miLLM-Load-Policy`` value, ``"auto"`` (None) or ``"refuse"`` (a
            batch never loads a model, so its rows pass ``"refuse"``).
        cancelled: polled about every 50 ms while the request waits for its slot and while it
            generates; once it returns True the request stops within a decode step and
            :class:`RequestCancelled` is raised. None: only task cancellation stops it.
        check_in_slot: called with the resident inside the slot, after the lifecycle confirmed
            the request and before the forward pass; whatever it raises propagates, the slot
            given back and nothing generated (the Batch API raises ``RowDeferred`` there).
        may_load: whether the request may auto-load a row that is not resident (False: an
            anonymous ``/v1`` request under ``MANAGEMENT_AUTH=operator``,
            :func:`~miserver.http.v1_admission.caller_may_load`; refused 409
            MODEL_NOT_LOADED).
        unit: the :class:`~miserver.serving.engine.slot.Unit` the request waits in (a Batch API
            chunk): a held chunk counts once in ``held_batch_chunks``, and the rows of a unit
            made with ``members`` are granted together (never the first alone). The caller makes
            the unit's member leave (:meth:`~miserver.serving.engine.slot.Unit.leave`) once this
            call has returned or raised. None: the request waits alone.

    Returns:
        :class:`CompletionResult`: the body ``/v1`` answers with status 200 and the
        ``X-miLLM-Model`` record.

    Raises:
        ApiError: every refusal ``/v1`` answers (400 INVALID_REQUEST naming the field, 404
            MODEL_NOT_FOUND, 409 MODEL_NOT_LOADED / ALREADY_ATTACHED / WEIGHTS_UNSAVED /
            MODEL_BUSY, 503 WEIGHTS_TORN / QUEUE_FULL, 500 GENERATION_FAILED, ...); render it
            with :func:`miserver.http.errors.openai_error_body` and ``err.status``.
        RequestCancelled: ``cancelled()`` returned True before the answer was complete.
        ValueError: ``endpoint`` is not a completion endpoint or ``priority`` is the barrier's.
    """
    if priority not in (Priority.INTERACTIVE, Priority.BATCH):
        raise ValueError(f"priority must be INTERACTIVE or BATCH, got {priority!r}")
    req = _decode(endpoint, body)
    if req.stream:
        raise bad_request("stream must be false or absent: this answer is not streamed", "stream")
    job = await _prepare(app, req, load_policy, priority, cancelled, may_load)
    async with _generation(app, job, priority, cancelled, check_in_slot, unit) as running:
        answer, header = await collect_with_header(
            app, job, running.events, running.firsts, running.header
        )
    return CompletionResult(answer, header)


# --- metrics ----------------------------------------------------------------------------------
def _count(request: web.Request, outcome: str, code: str | None = None) -> None:
    metrics = request.app.get(keys.METRICS)
    if metrics is None:
        return
    route = (
        request.match_info.route.resource.canonical
        if request.match_info.route.resource
        else request.path
    )
    if outcome == "served":
        metrics.requests_served.labels(route=route).inc()
    else:
        metrics.requests_refused.labels(route=route, code=code or "UNKNOWN").inc()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _instrumented(handler: Handler) -> Handler:
    """Count served/refused requests and their latency; a vanished client gets no answer."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        metrics = request.app.get(keys.METRICS)
        try:
            response = await handler(request)
        except ApiError as err:
            _count(request, "refused", err.code.name)
            raise
        except RequestCancelled:
            _count(request, "refused", DISCONNECTED)
            return web.Response(status=499)  # never delivered: the client is gone
        except (ConnectionError, asyncio.CancelledError):
            _count(request, "refused", DISCONNECTED)
            raise
        except web.HTTPException as exc:
            if exc.status >= 400:
                _count(
                    request,
                    "refused",
                    {413: codes.PAYLOAD_TOO_LARGE.name}.get(exc.status, str(exc.status)),
                )
            raise
        outcome = request.get(OUTCOME, "served")
        if outcome == "served":
            _count(request, "served")
        else:
            _count(request, "refused", outcome)
        if metrics is not None:
            route = (
                request.match_info.route.resource.canonical
                if request.match_info.route.resource
                else request.path
            )
            metrics.request_latency.labels(route=route).observe(time.perf_counter() - started)
        return response

    return wrapped


# --- handlers ---------------------------------------------------------------------------------
async def _serve(request: web.Request, endpoint: str) -> web.StreamResponse:
    """Decode the body once; a stream is answered here, anything else by
    :func:`run_completion` (the path batch rows take too)."""
    req = _decode(endpoint, await read_body(request))
    load_policy = request.headers.get(LOAD_POLICY_HEADER)
    may_load = caller_may_load(request)

    def client_gone() -> bool:
        return client_disconnected(request)

    if not req.stream:
        result = await run_completion(
            request.app,
            endpoint,
            req,
            load_policy=load_policy,
            cancelled=client_gone,
            may_load=may_load,
        )
        return json_response(result.body, headers=result.headers)
    job = await _prepare(request.app, req, load_policy, cancelled=client_gone, may_load=may_load)
    async with _generation(request.app, job, Priority.INTERACTIVE, client_gone, None) as running:
        return await stream_response(request, job, running)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await _serve(request, "/v1/chat/completions")


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` (``echo`` and ``logprobs`` score a text under the weights)."""
    return await _serve(request, "/v1/completions")


def _epoch(created_at: str) -> int:
    try:
        return int(datetime.fromisoformat(created_at.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0


def _model_entries(request: web.Request) -> list[dict[str, Any]]:
    host = request.app[keys.HOST]
    resident = host.resident
    entries: list[dict[str, Any]] = []
    names: set[str] = set()
    if resident is not None and resident.served_name != resident.row.name:
        entries.append(
            {
                "id": resident.served_name,
                "object": "model",
                "created": int(resident.loaded_at),
                "owned_by": "miserver",
                "resident": True,
                "origin": resident.origin,
            }
        )
        names.add(resident.served_name)
    for row in request.app[keys.CATALOGUE].list():
        if row.name in names:
            continue
        is_resident = resident is not None and row.id == resident.row.id
        entries.append(
            {
                "id": row.name,
                "object": "model",
                "created": _epoch(row.created_at),
                "owned_by": "miserver",
                "resident": is_resident,
                "origin": resident.origin if is_resident and resident else row.origin,
            }
        )
    return entries


def _resident_header(request: web.Request) -> dict[str, str]:
    resident = request.app[keys.HOST].resident
    return {HEADER: model_header(resident)} if resident is not None else {}


async def list_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the catalogue rows and the resident's served name.

    ``X-miLLM-Model`` names the resident (absent while nothing is resident).
    """
    return json_response(
        {"object": "list", "data": _model_entries(request)}, headers=_resident_header(request)
    )


async def get_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``; 404 ``model_not_found`` for an unknown name."""
    name = request.match_info["model"]
    for entry in _model_entries(request):
        if entry["id"] == name:
            return json_response(entry, headers=_resident_header(request))
    raise ApiError(
        codes.MODEL_NOT_FOUND,
        f"model {name!r} is neither resident nor in the catalogue",
        param="model",
    )


def setup_routes(app: web.Application) -> None:
    """Add the ``/v1`` routes to ``app`` (called by :func:`miserver.http.app.create_app`)."""
    app.router.add_get("/v1/models", _instrumented(list_models))
    app.router.add_get("/v1/models/{model:.+}", _instrumented(get_model))
    app.router.add_post("/v1/chat/completions", _instrumented(chat_completions))
    app.router.add_post("/v1/completions", _instrumented(completions))
