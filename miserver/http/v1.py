"""``/v1``: OpenAI-compatible serving (companion contract 4).

Routes: ``GET /v1/models``, ``GET /v1/models/{model}``, ``POST /v1/chat/completions``,
``POST /v1/completions``, streamed (server-sent events ending ``data: [DONE]``) or not.

The path of one request:

1. the body is decoded and checked strictly (:mod:`miserver.http.openai_schema`; 400 before
   anything is queued);
2. :func:`admit` decides which resident serves it (the one admission decision; auto-load with
   ``X-miLLM-Load-Policy``);
3. the prompt is tokenized and checked against the context window (400);
4. the request waits for a scheduler slot (:class:`~miserver.serving.scheduler.Scheduler`,
   503 QUEUE_FULL when the queue is full) and keeps it until its generation thread has ended,
   so it is computed on one parameter set;
5. the generation runs in a worker thread (:mod:`miserver.serving.generation`); a failure before
   the first token is a JSON 500, after a stream opened it is one ``error`` event and no
   ``[DONE]``; a client that goes away cancels it within a decode step.

Every successful response carries ``X-miLLM-Model`` (:func:`miserver.http.model_header.model_header`)
and a stream's terminal chunk (and its usage chunk) carries the same value as ``millm_model``.

:func:`run_completion` is the one public entry point that runs a request body to its final
(non-streamed) answer: the non-streamed ``/v1`` path and the Batch API's rows
(:mod:`miserver.http.batches`, at :attr:`~miserver.serving.scheduler.Priority.BATCH`) both go
through it, so a batch row is validated, admitted, computed and answered exactly as ``/v1`` would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec
from aiohttp import web

from miserver.http import keys
from miserver.http import openai_schema as schema
from miserver.http.errors import json_response, openai_error_body
from miserver.http.model_header import HEADER, model_header
from miserver.serving.generation import (
    Finished,
    Generation,
    GenerationError,
    NonFiniteLogits,
    SamplingParams,
    Started,
    TextDelta,
    TokenLogprob,
    context_length,
)
from miserver.serving.host import Resident, normalize_load_policy
from miserver.serving.scheduler import Priority, QueueFull
from miserver.spec import codes
from miserver.spec.errors import ApiError

log = logging.getLogger("miserver.v1")

LOAD_POLICY_HEADER = "X-miLLM-Load-Policy"
#: How often a waiting or generating request checks that its client is still connected (s).
DISCONNECT_POLL_S = 0.05
#: The longest a ``/v1`` request waits for the start-up load of ``DEFAULT_MODEL`` before it is
#: admitted as usual (then 409 model_busy with ``Retry-After`` while that load still runs), s.
STARTUP_LOAD_WAIT_S = 300.0
#: Default ``max_tokens`` of ``/v1/completions`` (OpenAI's).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_encoder = msgspec.json.Encoder()


class RequestCancelled(Exception):
    """The request was cancelled before it finished (its ``/v1`` client disconnected, or the
    ``cancelled`` callable given to :func:`run_completion` returned True); nothing is answered
    and the slot is free again."""


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


# --- admission ---------------------------------------------------------------------------------
async def admit(
    app: web.Application,
    model: str,
    load_policy: str | None = None,
    priority: Priority = Priority.INTERACTIVE,
) -> Resident:
    """The one ``/v1`` admission decision: which resident serves ``model`` (contract 4).

    ``model`` is the resident's served or base name (served at once) or a catalogue row's name
    (auto-loaded, a swap), honouring ``load_policy``, the ``X-miLLM-Load-Policy`` header's value
    (``auto``, the default when None, or ``refuse``). ``priority``: the scheduler priority the
    request will wait at (a batch row, ``Priority.BATCH``, is never refused QUEUE_FULL). The
    lifecycle table decides (serve / hold / refuse / auto-load, and after an auto-load whether
    the request may go on); the scheduler then holds a held request until the barrier is
    released.

    Raises:
        ApiError: 404 MODEL_NOT_FOUND, 409 MODEL_NOT_LOADED (policy refuse), 409 MODEL_BUSY
            (a load is in progress, or the model was unloaded or changed while the request
            waited for its auto-load: with ``Retry-After``), 400 INVALID_REQUEST (an unknown
            policy), the lifecycle's refusals (409 ALREADY_ATTACHED, 503 WEIGHTS_TORN /
            QUEUE_FULL, 409 WEIGHTS_UNSAVED), and 500 MODEL_LOAD_FAILED.
    """
    host = app[keys.HOST]
    policy = normalize_load_policy(load_policy)
    row_id = None
    if not host.answers_to(model):  # the resident, or the one a running swap replaces
        row = host.resolve(model)
        if row is None:
            available = [r.name for r in host.catalogue.list()]
            raise ApiError(
                codes.MODEL_NOT_FOUND,
                f"model {model!r} is neither resident nor in the catalogue",
                details={"model": model, "available": available},
                param="model",
            )
        row_id = row.id
    try:
        return await app[keys.WEIGHTS].admit_v1(
            refuse_policy=policy == "refuse", row_id=row_id, priority=priority
        )
    except ApiError as err:
        raise _lifecycle_refusal(err) from None


def _lifecycle_refusal(err: ApiError) -> ApiError:
    """A lifecycle refusal as ``/v1`` answers it: the same code, status, reason and headers,
    with what its ``details`` say written into the message.

    ``/v1`` error bodies have OpenAI's shape only (``message``, ``type``, ``param``, ``code``;
    contract 2), so the facts a management body carries in ``details`` must be in the message:
    for 409 WEIGHTS_UNSAVED the resident's served name, the number of unsaved commits and the
    ways forward (weights page: Unsaved commits and the auto-load); for 409 ALREADY_ATTACHED the
    holder's role, label, state and attached_at (weights page: The write cycle 1). Other
    refusals come back unchanged (503 WEIGHTS_TORN already names ``POST /api/weights/load``).
    """
    details = err.details or {}
    extra = ""
    if err.code is codes.WEIGHTS_UNSAVED and "unsaved_commits" in details:
        n = details.get("unsaved_commits")
        ways = details.get("ways_forward") or ()
        extra = (
            f" {details.get('served_name')!s} carries {n} unsaved commit"
            f"{'' if n == 1 else 's'}; to serve another model: " + "; or ".join(map(str, ways))
        )
    elif err.code is codes.ALREADY_ATTACHED and isinstance(details.get("holder"), dict):
        h = details["holder"]
        extra = (
            f" Attached by {h.get('role')} {h.get('label')!r} ({h.get('state')}) since "
            f"{h.get('attached_at')}; no model is loaded or swapped until it detaches."
        )
    if not extra:
        return err
    return ApiError(
        err.code,
        err.message.rstrip() + extra.rstrip(".") + ".",
        reason=err.reason,
        details=err.details,
        status=err.status,
        param=err.param,
        headers=err.headers,
    )


# --- helpers ----------------------------------------------------------------------------------
def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(codes.INVALID_REQUEST, message, param=param)


def _client_gone(request: web.Request) -> bool:
    """The client hung up: the transport is closed, or the peer sent its EOF (a half-closed
    connection is kept open to answer management requests, but a generation stops at it:
    a closed client and a half-closed one look the same, http/protocol.py)."""
    transport = request.transport
    if transport is None or transport.is_closing():
        return True
    return bool(transport.get_extra_info("peer_eof", False))


async def _read_body(request: web.Request) -> bytes:
    """The body (413 JSON via the app's limits when too large)."""
    return await request.read()


async def _acquire_slot(
    app: web.Application,
    resident: Resident,
    priority: Priority,
    cancelled: Callable[[], bool] | None,
    adapter: dict[str, Any] | None = None,
) -> None:
    """Wait for a slot at ``priority``, giving up (and leaving no trace) once ``cancelled()``.

    ``adapter``: the adapter block of the applied adapter the request named (see
    :class:`_Job`); a request for an adapter removed or replaced while it waited is refused as
    one for a model that went away (409 MODEL_BUSY ``model_transition``, issue 16 item 8).

    Raises:
        ApiError: 503 QUEUE_FULL with ``Retry-After`` (interactive only); the lifecycle's
            refusals inside the slot (the table's ``v1_confirm`` rows: 409 MODEL_BUSY
            ``model_transition`` with ``Retry-After`` when ``resident`` was unloaded or replaced
            while the request waited, 503 WEIGHTS_TORN, 409 MODEL_BUSY).
        RequestCancelled: ``cancelled()`` became true while waiting.
    """
    scheduler = app[keys.SCHEDULER]
    metrics = app.get(keys.METRICS)
    held = scheduler.barrier_held or scheduler.barrier_draining
    task = asyncio.ensure_future(scheduler.acquire(priority))
    _update_queue_gauge(app)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S * 4)
            if done:
                break
            held = held or scheduler.barrier_held or scheduler.barrier_draining
            if cancelled is not None and cancelled():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise RequestCancelled
        try:
            task.result()
        except QueueFull as exc:
            raise ApiError(
                codes.QUEUE_FULL,
                str(exc),
                details={"max_queued_requests": exc.max_queued},
                headers={"Retry-After": "1"},
            ) from None
    except BaseException:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        raise
    finally:
        _update_queue_gauge(app)
    if held and metrics is not None and priority == Priority.INTERACTIVE:
        metrics.requests_held.inc()  # held batch chunks are counted by the scheduler
    try:
        # Inside the slot: the table must still let this request go on (the model may have
        # been unloaded or swapped, or the set torn, while it waited; weights page: States).
        await app[keys.WEIGHTS].confirm_v1(resident, adapter=adapter)
    except ApiError as err:
        scheduler.release()
        raise _lifecycle_refusal(err) from None
    except BaseException:
        scheduler.release()
        raise


def _update_queue_gauge(app: web.Application) -> None:
    metrics = app.get(keys.METRICS)
    if metrics is None:
        return
    counts = app[keys.SCHEDULER].counts()
    metrics.queue_depth.set(counts.queued + counts.held_interactive)


def _completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@dataclass
class _Job:
    """One admitted request, ready to run."""

    kind: str  # "chat" or "completion"
    resident: Resident
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo_text: str | None  # completions with echo: the prompt text returned before the output
    want_logprobs: bool
    #: The adapter block of the applied adapter the request named (by its served name), or
    #: None: the request is for that application of the adapter, not for the base tensors.
    adapter: dict[str, Any] | None = None


def _named_adapter(resident: Resident, model: str) -> dict[str, Any] | None:
    """The resident's adapter block when ``model`` names its applied adapter, else None."""
    block = resident.adapter_block
    return block if block and block.get("name") == model else None


def _check_context(
    resident: Resident,
    prompt_ids: list[int],
    max_tokens: int | None,
    default: int | None,
    param: str,
    prompt_param: str,
) -> int:
    context = context_length(resident.model)
    n = len(prompt_ids)
    if n >= context:
        raise _bad(
            f"the prompt is {n} tokens; the context window of {resident.served_name} is "
            f"{context} tokens",
            prompt_param,
        )
    if max_tokens is None:
        return min(default, context - n) if default is not None else context - n
    if max_tokens > context:
        raise _bad(
            f"{param} must be at most the context window ({context}), got {max_tokens}", param
        )
    if n + max_tokens > context:
        raise _bad(
            f"the prompt ({n} tokens) plus {param} ({max_tokens}) exceeds the context "
            f"window of {context} tokens",
            param,
        )
    return max_tokens


def _chat_prompt(resident: Resident, req: schema.ChatCompletionRequest) -> list[int]:
    tok = resident.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise _bad(
            f"model {resident.served_name} has no chat template; use /v1/completions", "messages"
        )
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": schema.message_text(m)}
        for m in req.messages
    ]
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template may refuse a conversation (jinja)
        raise _bad(
            f"the chat template refused the messages: {str(exc)[:300]}", "messages"
        ) from None
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _completion_prompt(resident: Resident, prompt: schema.PromptSpec) -> list[int]:
    tok = resident.tokenizer
    if isinstance(prompt, str):
        ids = list(tok(prompt)["input_ids"])
    else:
        vocab = len(tok)
        bad = next((t for t in prompt if t >= vocab), None)
        if bad is not None:
            raise _bad(f"token id {bad} is outside the vocabulary (size {vocab})", "prompt")
        ids = list(prompt)
    if not ids:
        bos = getattr(tok, "bos_token_id", None)
        if bos is None:
            raise _bad("the prompt is empty", "prompt")
        ids = [bos]
    return ids


def _sampling(
    req: Any, stops: tuple[str, ...], max_tokens: int, logprobs: int | None, echo: bool
) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        seed=req.seed,
        stop=stops,
        logprobs=logprobs,
        echo=echo,
    )


async def _prepare_chat(
    app: web.Application,
    req: schema.ChatCompletionRequest,
    load_policy: str | None,
    priority: Priority = Priority.INTERACTIVE,
) -> _Job:
    stops = schema.check_chat(req)
    resident = await admit(app, req.model, load_policy, priority)
    adapter = _named_adapter(resident, req.model)
    prompt_ids = await asyncio.to_thread(_chat_prompt, resident, req)
    given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = _check_context(resident, prompt_ids, given, None, param, "messages")
    want = bool(req.logprobs)
    logprobs = (req.top_logprobs or 0) if want else None
    return _Job(
        "chat",
        resident,
        prompt_ids,
        _sampling(req, stops, max_tokens, logprobs, False),
        bool(req.stream),
        bool(req.stream_options and req.stream_options.include_usage),
        None,
        want,
        adapter,
    )


async def _prepare_completion(
    app: web.Application,
    req: schema.CompletionRequest,
    load_policy: str | None,
    priority: Priority = Priority.INTERACTIVE,
) -> _Job:
    prompt, stops = schema.check_completion(req)
    resident = await admit(app, req.model, load_policy, priority)
    adapter = _named_adapter(resident, req.model)
    prompt_ids = await asyncio.to_thread(_completion_prompt, resident, prompt)
    max_tokens = _check_context(
        resident, prompt_ids, req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, "max_tokens", "prompt"
    )
    echo = bool(req.echo)
    echo_text = None
    if echo:
        echo_text = prompt if isinstance(prompt, str) else resident.tokenizer.decode(prompt_ids)
    want = req.logprobs is not None
    return _Job(
        "completion",
        resident,
        prompt_ids,
        _sampling(req, stops, max_tokens, req.logprobs, echo and want),
        bool(req.stream),
        bool(req.stream_options and req.stream_options.include_usage),
        echo_text,
        want,
        adapter,
    )


# --- logprobs shapes ---------------------------------------------------------------------------
def _chat_logprob(lp: TokenLogprob) -> dict[str, Any]:
    return {
        "token": lp.text,
        "logprob": lp.logprob,
        "bytes": list(lp.bytes),
        "top_logprobs": [
            {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}
            for _i, text, value in lp.top
        ],
    }


class _CompletionLogprobs:
    """OpenAI's legacy ``logprobs`` object; ``text_offset`` counts characters of ``text``."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset

    def block(self, entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for lp in entries:
            tokens.append(lp.text)
            token_logprobs.append(lp.logprob)
            top.append(
                {text: value for _i, text, value in lp.top}
                if lp.logprob is not None or lp.top
                else None
            )
            offsets.append(self.offset)
            self.offset += len(lp.text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }


def _usage(fin: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
    }


def _finish_reason(fin: Finished) -> str:
    return "length" if fin.finish_reason == "length" else "stop"


# --- running ----------------------------------------------------------------------------------
async def _watch(cancelled: Callable[[], bool], gen: Generation) -> None:
    while True:
        await asyncio.sleep(DISCONNECT_POLL_S)
        if cancelled():
            gen.cancel()
            return


@contextlib.asynccontextmanager
async def _generation(
    app: web.Application,
    job: _Job,
    priority: Priority,
    cancelled: Callable[[], bool] | None,
    check_in_slot: Callable[[Resident], None] | None,
) -> AsyncIterator[tuple[Generation, AsyncIterator[Any], Started, str]]:
    """Hold a slot for the whole generation: yields ``(generation, events, first, header)``.

    The slot is released when the worker thread has ended, never before, also when the caller
    is cancelled; leaving the block cancels a generation that is still running.

    Raises:
        ApiError: the slot's refusals (:func:`_acquire_slot`), 500 GENERATION_FAILED before
            the first token.
        RequestCancelled: ``cancelled()`` became true while waiting for the slot.
    """
    await _acquire_slot(app, job.resident, priority, cancelled, job.adapter)
    scheduler = app[keys.SCHEDULER]

    def release() -> None:
        scheduler.release()
        _update_queue_gauge(app)

    try:
        if check_in_slot is not None:
            check_in_slot(job.resident)
        header = model_header(job.resident)
        gen = Generation(
            job.resident.model,
            job.resident.tokenizer,
            job.prompt_ids,
            job.params,
            engine=job.resident.engine,
        )
        gen.start()
    except BaseException:
        release()
        raise
    gen.add_done_callback(release)
    watcher: asyncio.Task[None] | None = None
    try:
        if cancelled is not None:
            watcher = asyncio.ensure_future(_watch(cancelled, gen))
        events = gen.events()
        try:
            first = await events.__anext__()
        except GenerationError as exc:
            raise _generation_failed(app, job, exc) from exc
        assert isinstance(first, Started)
        yield gen, events, first, header
    finally:
        if watcher is not None:
            watcher.cancel()
        gen.cancel()  # a no-op once it finished
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


async def wait_for_startup_load(
    app: web.Application,
    cancelled: Callable[[], bool] | None = None,
    timeout_s: float | None = None,
) -> None:
    """Wait, at most ``timeout_s`` (default :data:`STARTUP_LOAD_WAIT_S`), for the start-up load
    of ``DEFAULT_MODEL`` while it runs, as a request behind an auto-load waits for it (issue 16
    item 11: ``make serve`` then an immediate request was refused 409 model_busy). Returns at
    once when no start-up load runs; returns after the bound with the load still running (the
    request is then admitted as usual). Its outcome is not this request's: a failed load is
    logged by the start-up, and the request is admitted against what is resident then.

    Raises:
        RequestCancelled: ``cancelled()`` became true while waiting (polled every 200 ms).
    """
    task = app.get(keys.STARTUP_LOAD)
    if task is None or task.done():
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (STARTUP_LOAD_WAIT_S if timeout_s is None else timeout_s)
    while not task.done():
        left = deadline - loop.time()
        if left <= 0:
            return
        await asyncio.wait({task}, timeout=min(left, DISCONNECT_POLL_S * 4))
        if not task.done() and cancelled is not None and cancelled():
            raise RequestCancelled


async def _prepare(
    app: web.Application,
    req: schema.ChatCompletionRequest | schema.CompletionRequest,
    load_policy: str | None,
    priority: Priority = Priority.INTERACTIVE,
    cancelled: Callable[[], bool] | None = None,
) -> _Job:
    await wait_for_startup_load(app, cancelled)
    if isinstance(req, schema.ChatCompletionRequest):
        return await _prepare_chat(app, req, load_policy, priority)
    return await _prepare_completion(app, req, load_policy, priority)


async def run_completion(
    app: web.Application,
    endpoint: str,
    body: RequestBody,
    *,
    priority: Priority = Priority.INTERACTIVE,
    load_policy: str | None = None,
    cancelled: Callable[[], bool] | None = None,
    check_in_slot: Callable[[Resident], None] | None = None,
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
            granted after every waiting interactive request, held by a quiesce as a
            ``held_batch_chunks`` chunk; contract 7). ``MAX_QUEUED_REQUESTS`` bounds the
            interactive requests that wait (queued or held); a batch row is never refused
            503 QUEUE_FULL, and batch rows do not count toward that bound.
        load_policy: the ``X-miLLM-Load-Policy`` value, ``"auto"`` (None) or ``"refuse"`` (a
            batch never loads a model, so its rows pass ``"refuse"``).
        cancelled: polled about every 50 ms while the request waits for its slot and while it
            generates; once it returns True the request stops within a decode step and
            :class:`RequestCancelled` is raised. None: only task cancellation stops it.
        check_in_slot: called with the resident inside the slot, after the lifecycle confirmed
            the request and before the forward pass; whatever it raises propagates, the slot
            given back and nothing generated (the Batch API raises ``RowDeferred`` there).

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
        raise _bad("stream must be false or absent: this answer is not streamed", "stream")
    job = await _prepare(app, req, load_policy, priority, cancelled)
    async with _generation(app, job, priority, cancelled, check_in_slot) as (
        _,
        events,
        first,
        header,
    ):
        answer = await _collect(app, job, events, first)
    return CompletionResult(answer, header)


def _generation_failed(app: web.Application, job: _Job, exc: GenerationError) -> ApiError:
    """The 500 GENERATION_FAILED of a generation that failed, counted in
    ``miserver_generation_failures_total{reason}`` and logged once. Non-finite logits (the
    weights hold NaN or infinity: issue 16 item 10) are reason ``non_finite_logits``, logged
    as an error naming the served parameter set and what to do; any other failure ``error``."""
    non_finite = isinstance(exc.__cause__, NonFiniteLogits)
    reason = "non_finite_logits" if non_finite else "error"
    metrics = app.get(keys.METRICS)
    if metrics is not None:
        metrics.generation_failures.labels(reason=reason).inc()
    if non_finite:
        log.error(
            "generation failed: non-finite logits (NaN or infinity) from %s; the served weights "
            "hold non-finite values: load finite weights (POST /api/weights/load)",
            model_header(job.resident),
        )
        message = f"{job.resident.served_name}: {exc.__cause__}"
        return ApiError(codes.GENERATION_FAILED, message, reason=reason)
    return ApiError(codes.GENERATION_FAILED, str(exc), reason=reason)


async def _collect(app: web.Application, job: _Job, events: Any, first: Started) -> dict[str, Any]:
    text_parts: list[str] = []
    lps: list[TokenLogprob] = []
    fin: Finished | None = None
    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                text_parts.append(ev.text)
                lps.extend(ev.logprobs)
            elif isinstance(ev, Finished):
                fin = ev
    except GenerationError as exc:
        raise _generation_failed(app, job, exc) from exc
    assert fin is not None
    if fin.finish_reason == "cancelled":
        raise RequestCancelled
    text = "".join(text_parts)
    created = int(time.time())
    name = job.resident.served_name
    if job.kind == "chat":
        body = {
            "id": _completion_id("chatcmpl"),
            "object": "chat.completion",
            "created": created,
            "model": name,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": {"content": [_chat_logprob(lp) for lp in lps], "refusal": None}
                    if job.want_logprobs
                    else None,
                    "finish_reason": _finish_reason(fin),
                }
            ],
            "usage": _usage(fin),
        }
    else:
        logprobs = None
        if job.want_logprobs:
            block = _CompletionLogprobs()
            entries = list(first.prompt_logprobs or ()) + lps
            logprobs = block.block(entries)
        body = {
            "id": _completion_id("cmpl"),
            "object": "text_completion",
            "created": created,
            "model": name,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "text": (job.echo_text or "") + text,
                    "logprobs": logprobs,
                    "finish_reason": _finish_reason(fin),
                }
            ],
            "usage": _usage(fin),
        }
    return body


def _sse(payload: Any) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


async def _stream(
    request: web.Request, job: _Job, gen: Generation, events: Any, first: Started, header: str
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            HEADER: header,
        }
    )
    await resp.prepare(request)
    created = int(time.time())
    name = job.resident.served_name
    chat = job.kind == "chat"
    cid = _completion_id("chatcmpl" if chat else "cmpl")
    obj = "chat.completion.chunk" if chat else "text_completion"
    lp_block = _CompletionLogprobs()

    def chunk(choice: dict[str, Any] | None, **extra: Any) -> bytes:
        body: dict[str, Any] = {
            "id": cid,
            "object": obj,
            "created": created,
            "model": name,
            "system_fingerprint": None,
            "choices": [choice] if choice is not None else [],
        }
        body.update(extra)
        return _sse(body)

    def delta_choice(
        text: str,
        lps: tuple[TokenLogprob, ...] | list[TokenLogprob],
        finish: str | None = None,
        role: bool = False,
    ) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text or role:
                delta["content"] = text
            logprobs = (
                {"content": [_chat_logprob(lp) for lp in lps], "refusal": None}
                if job.want_logprobs and lps
                else None
            )
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        logprobs = lp_block.block(lps) if job.want_logprobs and (lps or text) else None
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    request[_OUTCOME] = "served"
    try:
        if chat:
            await resp.write(chunk(delta_choice("", (), role=True)))
        elif job.echo_text is not None:
            await resp.write(chunk(delta_choice(job.echo_text, first.prompt_logprobs or ())))
        fin: Finished | None = None
        try:
            async for ev in events:
                if isinstance(ev, TextDelta):
                    if ev.text or ev.logprobs:
                        await resp.write(chunk(delta_choice(ev.text, ev.logprobs)))
                elif isinstance(ev, Finished):
                    fin = ev
        except GenerationError as exc:
            err = _generation_failed(request.app, job, exc)
            log.warning("stream ended by a generation error: %s", exc)
            request[_OUTCOME] = codes.GENERATION_FAILED.name
            await gen.wait()  # the slot is free before the client sees the end
            await resp.write(_sse(openai_error_body(err)))
            await resp.write_eof()
            return resp
        assert fin is not None
        if fin.finish_reason == "cancelled":
            request[_OUTCOME] = _DISCONNECTED
            return resp
        await gen.wait()  # the slot is free before the client sees the end
        final = delta_choice("", (), finish=_finish_reason(fin))
        if not chat:
            final["logprobs"] = None
        await resp.write(chunk(final, millm_model=header))
        if job.include_usage:
            await resp.write(chunk(None, usage=_usage(fin), millm_model=header))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionError:  # the client went away mid-stream
        gen.cancel()
        request[_OUTCOME] = _DISCONNECTED
    except asyncio.CancelledError:
        gen.cancel()
        raise
    return resp


# --- metrics ----------------------------------------------------------------------------------
_OUTCOME = web.RequestKey("millm_outcome", str)  # how a stream that opened ended
_DISCONNECTED = "CLIENT_DISCONNECTED"


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
            _count(request, "refused", _DISCONNECTED)
            return web.Response(status=499)  # never delivered: the client is gone
        except (ConnectionError, asyncio.CancelledError):
            _count(request, "refused", _DISCONNECTED)
            raise
        except web.HTTPException as exc:
            if exc.status >= 400:
                _count(
                    request,
                    "refused",
                    {413: codes.PAYLOAD_TOO_LARGE.name}.get(exc.status, str(exc.status)),
                )
            raise
        outcome = request.get(_OUTCOME, "served")
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
    req = _decode(endpoint, await _read_body(request))
    load_policy = request.headers.get(LOAD_POLICY_HEADER)

    def client_gone() -> bool:
        return _client_gone(request)

    if not req.stream:
        result = await run_completion(
            request.app, endpoint, req, load_policy=load_policy, cancelled=client_gone
        )
        return json_response(result.body, headers=result.headers)
    job = await _prepare(request.app, req, load_policy, cancelled=client_gone)
    async with _generation(request.app, job, Priority.INTERACTIVE, client_gone, None) as (
        gen,
        events,
        first,
        header,
    ):
        return await _stream(request, job, gen, events, first, header)


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
