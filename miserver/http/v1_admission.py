"""``/v1`` admission and the slot (companion contract 4): which resident serves a request, the
wait for the start-up load, and the scheduler slot a request holds while it is computed.

:func:`admit` is the one admission decision (the lifecycle table decides serve / hold / refuse /
auto-load); :func:`acquire_slot` waits for a slot at the request's priority and lets the table
confirm the request inside it; a lifecycle refusal is worded for ``/v1``'s OpenAI-shaped bodies
by :func:`lifecycle_refusal`. Used by :mod:`miserver.http.v1`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from miserver.http import keys
from miserver.serving.engine.generation import SamplingParams
from miserver.serving.engine.slot import Grant, Priority, QueueFull, Unit
from miserver.serving.models.host import Resident, normalize_load_policy
from miserver.serving.weights.admission import RELOAD_WAIT_S
from miserver.spec import codes
from miserver.spec.errors import ApiError

LOAD_POLICY_HEADER = "X-miLLM-Load-Policy"
#: How often a waiting or generating request checks that its client is still connected (s).
DISCONNECT_POLL_S = 0.05
#: The longest a ``/v1`` request waits for the start-up load of ``DEFAULT_MODEL`` before it is
#: admitted as usual (then 409 model_busy with ``Retry-After`` while that load still runs), s.
STARTUP_LOAD_WAIT_S = 300.0


class RequestCancelled(Exception):
    """The request was cancelled before it finished (its ``/v1`` client disconnected, or the
    ``cancelled`` callable given to :func:`run_completion` returned True); nothing is answered
    and the slot is free again."""


# --- admission ---------------------------------------------------------------------------------
def caller_may_load(request: web.Request) -> bool:
    """Whether this ``/v1`` request may auto-load a catalogue row that is not resident.

    Always, with ``MANAGEMENT_AUTH=none`` (contract 4). With ``MANAGEMENT_AUTH=operator`` only
    with a valid operator token (``Authorization: Bearer``): an auto-load is the model load
    that ``POST /api/models/{id}/load`` gates, and it drains every running request (breaker
    finding F10); reads and inference on the resident stay open.
    """
    from miserver.serving.auth import identify

    settings = request.app[keys.SETTINGS]
    if settings.management_auth != "operator":
        return True
    values = request.headers.getall("Authorization", ())
    if len(values) != 1:  # none, or two (ambiguous: neither is taken, as the weights routes)
        return False
    return identify(values[0], settings.weights_tokens).role == "operator"


def _operator_gate_refusal(
    err: ApiError, model: str, row_id: int, resident: str | None
) -> ApiError:
    """The table's 409 MODEL_NOT_LOADED for an auto-load the operator gate refused, worded for
    ``/v1``: which model is served, and how to load the one named."""
    served = f"the served model is {resident!r}" if resident else "nothing is resident"
    return ApiError(
        codes.MODEL_NOT_LOADED,
        f"model {model!r} is not resident ({served}), and with MANAGEMENT_AUTH=operator a /v1 "
        f"request loads a model only with an operator token: name the served model, or have "
        f"an operator load it (POST /api/models/{row_id}/load with an operator token) or send "
        "this request with one",
        status=409,
        details={"model": model, "model_id": row_id, "resident": resident},
        param="model",
        headers=err.headers,
    )


def _setting_refusal(err: ApiError, model: str, row_id: int, resident: str | None) -> ApiError:
    """The table's 409 MODEL_NOT_LOADED for an auto-load that ``V1_LOAD_POLICY=refuse``
    refused (issue 32, item 3), worded for ``/v1``: which model is served, and how an operator
    loads the one named."""
    served = f"the served model is {resident!r}" if resident else "nothing is resident"
    return ApiError(
        codes.MODEL_NOT_LOADED,
        f"model {model!r} is not resident ({served}), and this server never loads a model for "
        f"a /v1 request (V1_LOAD_POLICY=refuse): name the served model, or have an operator "
        f"load it (POST /api/models/{row_id}/load)",
        status=409,
        details={"model": model, "model_id": row_id, "resident": resident},
        param="model",
        headers=err.headers,
    )


async def admit(
    app: web.Application,
    model: str,
    load_policy: str | None = None,
    priority: Priority = Priority.INTERACTIVE,
    *,
    may_load: bool = True,
) -> Resident:
    """The one ``/v1`` admission decision: which resident serves ``model`` (contract 4).

    ``model`` is the resident's served or base name (served at once) or a catalogue row's name
    (auto-loaded, a swap), honouring ``load_policy``, the ``X-miLLM-Load-Policy`` header's value
    (``auto``, the default when None, or ``refuse``). ``priority``: the scheduler priority the
    request will wait at (a batch row, ``Priority.BATCH``, is never refused QUEUE_FULL). The
    lifecycle table decides (serve / hold / refuse / auto-load, and after an auto-load whether
    the request may go on); the scheduler then holds a held request until the barrier is
    released; one held through a weights load's full reload waits for the reloaded model and
    is admitted again (503 NOT_READY with ``Retry-After`` past :data:`RELOAD_WAIT_S`; issue 32,
    item 2). ``may_load`` False (:func:`caller_may_load`) refuses an auto-load as the refuse
    policy does, in the table's same row, with a message naming the served model and how to load;
    so does the setting ``V1_LOAD_POLICY=refuse``, for every request (issue 32, item 3).

    Raises:
        ApiError: 404 MODEL_NOT_FOUND, 409 MODEL_NOT_LOADED (policy refuse, the setting
            ``V1_LOAD_POLICY=refuse``, or ``may_load`` False for a row that is not resident),
            409 MODEL_BUSY
            (a load is in progress, or the model was unloaded or changed while the request
            waited for its auto-load: with ``Retry-After``), 400 INVALID_REQUEST (an unknown
            policy), the lifecycle's refusals (409 ALREADY_ATTACHED, 503 WEIGHTS_TORN /
            QUEUE_FULL, 409 WEIGHTS_UNSAVED), 400 MODEL_LOAD_FAILED (the named row's folder
            failed its check; the resident stays) and 500 MODEL_LOAD_FAILED (its load failed;
            the previous model was loaded back when it could be).
    """
    host = app[keys.HOST]
    weights = app[keys.WEIGHTS]
    policy = normalize_load_policy(load_policy)
    pinned = app[keys.SETTINGS].v1_load_policy == "refuse" and policy != "refuse"
    gated = not may_load and policy != "refuse" and not pinned
    deadline = asyncio.get_running_loop().time() + RELOAD_WAIT_S
    row_id = None
    try:
        while True:
            row_id = None
            if not host.answers_to(model):  # the resident, or the one a running swap replaces
                row_id = host.resolve_or_not_found(model).id
            resident = await weights.admit_v1(
                refuse_policy=policy == "refuse" or pinned or not may_load,
                row_id=row_id,
                priority=priority,
            )
            if resident is not None:
                return resident
            # Held through a weights load's full reload (issue 32, item 2): once the model
            # is made, admitted again by the name it gave (it may name another model now).
            await weights.wait_reloaded(deadline)
    except ApiError as err:
        if (pinned or gated) and row_id is not None and err.code is codes.MODEL_NOT_LOADED:
            resident = host.resident
            refusal = _setting_refusal if pinned else _operator_gate_refusal
            raise refusal(
                err, model, row_id, resident.served_name if resident is not None else None
            ) from None
        raise lifecycle_refusal(err) from None


def lifecycle_refusal(err: ApiError) -> ApiError:
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


def client_disconnected(request: web.Request) -> bool:
    """The client hung up: the transport is closed, or the peer sent its EOF (a half-closed
    connection is kept open to answer management requests, but a generation stops at it:
    a closed client and a half-closed one look the same, http/protocol.py)."""
    transport = request.transport
    if transport is None or transport.is_closing():
        return True
    return bool(transport.get_extra_info("peer_eof", False))


async def acquire_slot(
    app: web.Application,
    resident: Resident,
    priority: Priority,
    cancelled: Callable[[], bool] | None,
    adapter: dict[str, Any] | None = None,
    size: int = 1,
    unit: Unit | None = None,
    model: str | None = None,
) -> tuple[Grant, Resident]:
    """Wait for a slot at ``priority``, giving up (and leaving no trace) once ``cancelled()``.

    The request waits in the group of ``resident``
    (:class:`~miserver.serving.engine.slot.SlotBatch`): it is granted into the resident's
    running batch (the continuous engine admits it at its next step), and a grant of a free
    slot takes the group's waiting requests along, up to ``MAX_BATCH_SIZE`` sequences;
    ``size`` is this request's (its ``n``).
    On a GGUF resident it is granted into the group's running batch while that has room
    (``fill_running``: llama.cpp's slots take it at their next step).
    ``unit``: the :class:`~miserver.serving.engine.slot.Unit` (a Batch API chunk) the request
    belongs to, passed to the scheduler: held, the chunk counts once in ``held_batch_chunks``,
    and its rows are granted together.

    ``adapter``: the adapter block of the applied adapter the request named (see
    :class:`Job`); a request for an adapter removed or replaced while it waited is refused as
    one for a model that went away (409 MODEL_BUSY ``model_transition``, issue 16 item 8).

    ``model``: the name the request gave. A request held through a weights load's full
    reload goes on on the reloaded model when it answers to that name (issue 32, item 2).

    Returns:
        the request's :class:`~miserver.serving.engine.slot.Grant` (release it with
        ``scheduler.release(grant)``) and the resident it goes on on: ``resident``, or the
        model a weights load reloaded while it was held.

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
    # One group per resident: a request naming the applied adapter and one naming the base are
    # computed by the same modules (the adapter is applied to the resident, not per request).
    group = id(resident)
    # A GGUF resident's llama.cpp batches its parallel slots at each of its steps: a request
    # goes into the running work while it has room (contract 4a; slot.py, fill_running).
    fill = getattr(resident, "kind", None) == "gguf"
    task = asyncio.ensure_future(
        scheduler.acquire(priority, group=group, size=size, unit=unit, fill_running=fill)
    )
    update_queue_gauge(app)
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
            grant = task.result()
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
        elif not task.cancelled() and task.exception() is None and not task.result().released:
            scheduler.release(task.result())  # granted as the wait was given up
        raise
    finally:
        update_queue_gauge(app)
    if held and metrics is not None and priority == Priority.INTERACTIVE:
        metrics.requests_held.inc()  # held batch chunks are counted by the scheduler
    try:
        # Inside the slot: the table must still let this request go on (the model may have
        # been unloaded or swapped, or the set torn, while it waited; weights page: States).
        serving = await app[keys.WEIGHTS].confirm_v1(resident, adapter=adapter, model=model)
    except ApiError as err:
        scheduler.release(grant)
        raise lifecycle_refusal(err) from None
    except BaseException:
        scheduler.release(grant)
        raise
    return grant, serving if serving is not None else resident


def update_queue_gauge(app: web.Application) -> None:
    metrics = app.get(keys.METRICS)
    if metrics is None:
        return
    counts = app[keys.SCHEDULER].counts()
    metrics.queue_depth.set(counts.queued + counts.held_interactive)


@dataclass
class Job:
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
    #: Choices to generate (OpenAI's ``n``, 1..``MAX_BATCH_SIZE``): sequences of the batch.
    n: int = 1
    #: The ``model`` the request named (a held request goes on on a reloaded model that
    #: answers to it; issue 32, item 2).
    model: str | None = None
    #: ``response_format`` / ``tools`` (a :class:`~miserver.serving.structured.request.Structured`),
    #: or None: free text. Chat answers with tools are parsed for tool calls.
    structured: Any = None


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
