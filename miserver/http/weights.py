"""The ``/api/weights/*`` routes: decode, identify the caller, hand the event to the runtime.

Weights page, Routes. A handler never decides anything about the lifecycle: it decodes the body
(msgspec), resolves the bearer token to a :class:`~miserver.serving.auth.Caller`, passes the
``X-miLLM-Attachment`` header through untouched, and lets
:meth:`~miserver.serving.weights.runtime.WeightsRuntime.gated` decide under one lock. It then
renders the answer as the route's response Struct (``miserver/spec/weights.py``). A missing
header is never a 422: the table answers 401 or 403 in its documented order.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from miserver.http import keys
from miserver.http.errors import (
    CLIENT_GONE,
    client_gone_error,
    code_for_status,
    ok,
    refuse_secret_name,
)
from miserver.http.management import decode_body as decode_management_body
from miserver.http.path_privacy import path_syntax_ok, private_path_refusal
from miserver.serving.audit import CURRENT_CALL, AuditRecord, AuditScope
from miserver.serving.auth import ATTACHMENT_HEADER, Caller, attachment_ref, identify
from miserver.serving.weights.runtime import CallResult, WeightsRuntime
from miserver.serving.weights.transport import group_spec
from miserver.spec import codes
from miserver.spec import weights as W
from miserver.spec.errors import ApiError

RUNTIME = keys.WEIGHTS

log = logging.getLogger("miserver.http.weights")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _caller(request: web.Request) -> Caller:
    values = request.headers.getall("Authorization", ())
    if len(values) > 1:  # two tokens: which one is meant is ambiguous, so neither is taken
        return Caller("none")
    return identify(values[0] if values else None, request.app[keys.SETTINGS].weights_tokens)


async def decode_body(request: web.Request, struct: type[msgspec.Struct]) -> Any:
    """Decode an optional JSON body into ``struct``: an empty body is ``{}`` (the weights routes
    without a body), anything else as the management API decodes it.

    Raises ApiError 400 INVALID_REQUEST naming the field (never echoing the body).
    """
    raw = await request.read()
    if not raw.strip():
        empty = _EMPTY.get(struct)
        if empty is not None:
            return empty  # the barrier calls: no body, nothing to decode
        raw = b"{}"
    return decode_management_body(raw, struct)


#: The bodies of the routes whose body is optional, as decoded from nothing (never mutated).
_EMPTY: dict[type, msgspec.Struct] = {
    W.EmptyRequest: W.EmptyRequest(),
    W.AttachRequest: W.AttachRequest(),
    W.CommitBeginRequest: W.CommitBeginRequest(),
    W.QuiesceRequest: W.QuiesceRequest(),
}


def audit_refusal(
    request: web.Request, operation: str, exc: BaseException, before: str | None = None
) -> None:
    """Write the refused ``weights_audit`` line of a gated call the lifecycle never saw.

    Weights page, Routes: every gated call writes one line, accepted or refused. The code and
    reason are the answer's (an :class:`ApiError`'s; aiohttp's 413 is PAYLOAD_TOO_LARGE; any
    other exception INTERNAL_ERROR), the role and label the caller's token's, and the state
    fields the lifecycle's (a refusal changes nothing: ``before`` defaults to the state now).
    A token refusal of ``save``/``load`` is named ``weights_save``/``weights_load``, as the
    lifecycle names its own. Never raises: a failure here is logged, and the call's own answer
    goes out unchanged.
    """
    try:
        if isinstance(exc, ApiError):
            code, reason = exc.code, exc.reason
        elif isinstance(exc, web.HTTPException):
            code, reason = code_for_status(exc.status), None
        elif isinstance(exc, CLIENT_GONE):
            code, reason = client_gone_error().code, None
        else:
            code, reason = codes.INTERNAL_ERROR, None
        if code in (codes.WEIGHTS_UNAUTHORIZED, codes.WEIGHTS_FORBIDDEN) and operation in (
            "save",
            "load",
        ):
            operation = f"weights_{operation}"
        runtime = request.app[RUNTIME]
        caller = _caller(request)
        resident = runtime.host.resident
        state = runtime.lifecycle.state.weights
        runtime.audit.write_soon(
            AuditRecord(
                operation=operation,
                outcome="refused",
                code=code.name,
                reason=reason,
                role=caller.role,
                label=caller.label,
                attachment_ref=attachment_ref(runtime.lifecycle.context.attachment_id),
                model=resident.base_name if resident is not None else None,
                weights_state=state,
                weights_state_before=before or state,
                transport=runtime.transport.name,
            )
        )
    except Exception:  # noqa: BLE001 - the audit must not replace the call's own answer
        log.exception("could not write the weights_audit line of a refused %s", operation)


def _unauthenticated(request: web.Request) -> bool:
    """Whether a token-gated route refuses ``request`` 401 before reading its body."""
    return _caller(request).role is None


def gated_route(operation: str, *, token_gated: bool = True) -> Callable[[Handler], Handler]:
    """Make a gated route write its ``weights_audit`` line also when it fails before (or
    outside) the lifecycle's decision: a body that does not decode (400), a body over
    MAX_REQUEST_BYTES (413), a checkpoint or row that does not exist (404), a taken name (409),
    a failure of ours (500). Weights page, Routes.

    The lifecycle writes the line of every call it decides; the call's
    :class:`~miserver.serving.audit.AuditScope` tells the wrapper whether it did, so a call writes
    exactly one. The accepted path costs one context-variable set and reset. The wrapper's
    ``audit_refusal(request, exc)`` attribute lets the body-limit middleware, which refuses
    before the handler runs, write the same line. A ``token_gated`` route (its handler refuses
    a caller without a valid token 401 before reading the body: every route of the table's
    ``ROUTE_AUTH``) has an ``unauthenticated(request)`` attribute, so the body-limit middleware
    lets its 401 go before a 413 (issue 32, item 13).
    """

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def route(request: web.Request) -> web.StreamResponse:
            call = AuditScope()
            token = CURRENT_CALL.set(call)
            before = request.app[RUNTIME].lifecycle.state.weights
            try:
                return await handler(request)
            except Exception as exc:
                if not call.written:
                    audit_refusal(request, operation, exc, before)
                raise
            finally:
                CURRENT_CALL.reset(token)

        route.audit_refusal = functools.partial(  # type: ignore[attr-defined]
            _refused_before_handler, operation=operation
        )
        if token_gated:
            route.unauthenticated = _unauthenticated  # type: ignore[attr-defined]
        return route

    return wrap


def _refused_before_handler(request: web.Request, exc: BaseException, *, operation: str) -> None:
    audit_refusal(request, operation, exc)


async def _gated(
    request: web.Request,
    trigger: str,
    operation: str,
    struct: type[msgspec.Struct] = W.EmptyRequest,
    params: dict[str, Any] | None = None,
    **fields: Any,
) -> tuple[CallResult, Any]:
    runtime = request.app[RUNTIME]
    caller = _caller(request)
    body = None
    extra: dict[str, Any] = {}
    if caller.role is not None:  # an unauthenticated call is refused 401 before its body
        body = await decode_body(request, struct)
        if struct is W.AttachRequest:  # contract 10: the body names the transport
            extra["group_spec"] = group_spec(body)
        elif struct is W.QuiesceRequest:  # contract 4b: finish or hold the running sequences
            fields["running"] = body.running
    result = await runtime.gated(
        trigger,
        caller,
        request.headers.get(ATTACHMENT_HEADER),
        operation=operation,
        params={**(params or {}), **extra, "body": body},
        **fields,
    )
    return result, body


def _state(runtime: WeightsRuntime) -> dict[str, Any]:
    """The lifecycle fields an answer reports (``Lifecycle.answer_view``: not the whole status
    view, which costs several times as much, on every barrier call)."""
    return runtime.lifecycle.answer_view()


@gated_route("weights_attach")
async def attach(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    result, _ = await _gated(request, "attach", "weights_attach", struct=W.AttachRequest)
    export = result.outputs["export"]
    view = _state(runtime)
    data = W.AttachResponse(
        attachment_id=result.outcome.details["attachment_id"],
        model=W.ModelRef(**runtime.model_ref()),  # type: ignore[arg-type]
        weights_state=view["weights_state"],
        steps_since_load=view["steps_since_load"] or 0,
        heartbeat=W.HeartbeatInfo(
            timeout_s=runtime.settings.weights_heartbeat_timeout_s,
            interval_hint_s=runtime.settings.weights_heartbeat_interval_hint_s,
        ),
        producer=export.producer,
        storages=export.storages,
        parameters=export.parameters,
        release=export.release,
        config=export.config,
    )
    return ok(data, headers={"Cache-Control": "no-store"})


@gated_route("weights_detach")
async def detach(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    await _gated(request, "detach", "weights_detach")
    view = _state(runtime)
    return ok(W.DetachResponse(weights_state=view["weights_state"], barrier=view["barrier"]))


@gated_route("weights_heartbeat")
async def heartbeat(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    await _gated(request, "heartbeat", "weights_heartbeat")
    view = _state(runtime)
    s = runtime.settings
    return ok(
        W.HeartbeatResponse(
            attachment_state=view["attachment_state"],
            timeout_s=s.weights_heartbeat_timeout_s,
            interval_hint_s=s.weights_heartbeat_interval_hint_s,
            weights_state=view["weights_state"],
        )
    )


@gated_route("weights_quiesce")
async def quiesce(request: web.Request) -> web.Response:
    """Hold new requests and return once no forward pass runs. Optional body
    ``{"running": "finish" | "hold"}`` (contract 4b): ``finish`` (the default, and no body)
    waits for the running sequences to finish; ``hold`` parks them at the next decode step
    (they continue after resume, prefilled again on the new weights) and is 409
    ``BARRIER_UNAVAILABLE`` ``hold_unsupported`` where the engine cannot park. The answer's
    ``parked_sequences`` (beside ``held_requests``) counts what a hold parked; bodies and
    answers: [the JSON schema](schemas/millm-weights-api-v1.json); refusals in order:
    [state-machine.md](state-machine.md)

    A bad body is 400 INVALID_REQUEST naming the field, and holds nothing."""
    runtime = request.app[RUNTIME]
    await _gated(request, "quiesce", "weights_quiesce", struct=W.QuiesceRequest)
    view = _state(runtime)
    counts = runtime.scheduler.counts()
    return ok(
        W.QuiesceResponse(
            held_requests=counts.held_interactive,
            held_batch_chunks=counts.held_batch,
            parked_sequences=runtime.effects.parked_sequences(),
            weights_state=view["weights_state"],
            quiesced_at=runtime.stamp(view["quiesced_at"]) or "",
            hold_deadline=runtime.stamp(view["hold_deadline"]),
        )
    )


@gated_route("weights_resume")
async def resume(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    await _gated(request, "resume", "weights_resume")
    view = _state(runtime)
    return ok(W.ResumeResponse(barrier=view["barrier"], weights_state=view["weights_state"]))


@gated_route("weights_commit_begin")
async def commit_begin(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    result, _ = await _gated(
        request, "commit_begin", "weights_commit_begin", struct=W.CommitBeginRequest
    )
    d = result.outcome.details
    return ok(
        W.CommitBeginResponse(
            weights_state=_state(runtime)["weights_state"],
            began_at=runtime.stamp(d["began_at"]) or "",
            watchdog_ms=d["watchdog_ms"],
        )
    )


@gated_route("weights_commit_end")
async def commit_end(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    result, _ = await _gated(request, "commit_end", "weights_commit_end")
    d = result.outcome.details
    return ok(
        W.CommitEndResponse(
            weights_state=_state(runtime)["weights_state"],
            steps_since_load=d["steps_since_load"],
            commit_ms=round(d["commit_ms"] or 0.0, 3),
            overran=d["overran"],
        )
    )


@gated_route("weights_clear_stale")
async def clear_stale(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    result, _ = await _gated(request, "clear_stale", "weights_clear_stale")
    cleared = result.outcome.details["cleared"]
    view = _state(runtime)
    return ok(
        W.ClearStaleResponse(
            cleared=W.ClearedAttachment(
                role=cleared["role"],
                label=cleared["label"],
                stale_since=runtime.stamp(cleared["stale_since"]),
            ),
            weights_state=view["weights_state"],
            barrier=view["barrier"],
        )
    )


async def status(request: web.Request) -> web.Response:
    """GET /api/weights/status: no token, no slot; never an attachment ID or a token."""
    runtime = request.app[RUNTIME]
    return ok(msgspec.convert(runtime.status(), W.StatusResponse))


def setup_routes(app: web.Application, runtime: WeightsRuntime) -> None:
    """Register ``/api/weights/*`` and plug the runtime into the app (health summary)."""
    app[RUNTIME] = runtime
    app[keys.WEIGHTS_SUMMARY] = runtime.summary
    r = app.router
    r.add_post("/api/weights/attach", attach)
    r.add_post("/api/weights/detach", detach)
    r.add_post("/api/weights/heartbeat", heartbeat)
    r.add_post("/api/weights/quiesce", quiesce)
    r.add_post("/api/weights/resume", resume)
    r.add_post("/api/weights/commit-begin", commit_begin)
    r.add_post("/api/weights/commit-end", commit_end)
    r.add_post("/api/weights/clear-stale", clear_stale)
    r.add_get("/api/weights/status", status)
    setup_checkpoint_routes(app, runtime)

    async def on_startup(app: web.Application) -> None:
        runtime.start()

    async def on_cleanup(app: web.Application) -> None:
        await runtime.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)


# --- checkpoints (contract 5) -----------------------------------------------------------------
@gated_route("save")
async def save(request: web.Request) -> web.Response:
    """POST /api/weights/save: a holder call; writes a checkpoint inside the barrier."""
    from miserver.serving.weights.jobs import prepare_save

    runtime = request.app[RUNTIME]
    caller = _caller(request)
    body = None
    gguf: dict[str, Any] = {}
    if caller.role is not None:
        body = await decode_body(request, W.SaveRequest)
        refuse_secret_name(request.app, body.name)
        gguf = runtime.gguf_facts()  # the table refuses a GGUF resident (contract 4a)
        if not gguf:
            prepare_save(runtime.host, body)
    result = await runtime.gated(
        "save",
        caller,
        request.headers.get(ATTACHMENT_HEADER),
        operation="save",
        params={"body": body},
        **gguf,
    )
    return ok(msgspec.convert(result.job["response"], W.SaveResponse))


@gated_route("load")
async def load(request: web.Request) -> web.Response:
    """POST /api/weights/load: a checkpoint (in place when the layout matches) or a row."""
    from miserver.serving.weights.jobs import prepare_load

    runtime = request.app[RUNTIME]
    caller = _caller(request)
    plan = None
    fields: dict[str, Any] = {}
    if caller.role is not None:
        body = await decode_body(request, W.LoadRequest)
        fields["checkpoint_load"] = body.model_id is None
        if body.model_id is None:  # the table refuses a checkpoint on a GGUF resident (4a)
            fields.update(runtime.gguf_facts())
    if caller.role is not None and "resident_gguf" not in fields:
        # Off the event loop: checking a checkpoint reads and hashes every file (seconds for a
        # large model), and serving goes on meanwhile.
        runtime.loads_checking += 1  # a catalogue DELETE meanwhile is refused (409 MODEL_BUSY)
        try:
            plan = await asyncio.to_thread(prepare_load, runtime.host, body)
        finally:
            runtime.loads_checking -= 1
        fields["in_place"] = plan.in_place
    await runtime.gated(
        "weights_load",
        caller,
        request.headers.get(ATTACHMENT_HEADER),
        operation="load",
        params={"plan": plan},
        **fields,
    )
    view = _state(runtime)
    return ok(
        W.LoadResponse(
            weights_state=view["weights_state"],
            steps_since_load=view["steps_since_load"] or 0,
            in_place=bool(plan and plan.in_place),
            model=W.ModelRef(**runtime.model_ref()),
        )
    )  # type: ignore[arg-type]


async def lineage(request: web.Request) -> web.Response:
    """GET /api/weights/lineage: the served set's chain back to its base row: ``chain[0]`` is
    the row the resident is served as (the last save's checkpoint after a save), then its
    parents (contract 5)."""
    from miserver.serving.weights.jobs import lineage as chain_of

    runtime = request.app[RUNTIME]
    resident = runtime.host.resident
    if resident is None:
        raise ApiError(codes.MODEL_NOT_LOADED, "nothing is resident")
    catalogue = runtime.host.catalogue
    # Start at what is served (issue 16 item 13): after a save the set is served as the
    # checkpoint, whose row is not the row it was loaded from (under an adapter, the name the
    # base tensors are served under). A served name with no row is the loaded row's set.
    served = resident.base_served_name if resident.adapter_block else resident.served_name
    row = (
        (catalogue.get_by_name(served) if served else None)
        or catalogue.get(resident.row.id)
        or resident.row
    )
    return ok(msgspec.convert({"chain": chain_of(catalogue, row)}, W.LineageResponse))


async def list_checkpoints(request: web.Request) -> web.Response:
    """GET /api/weights/checkpoints: every checkpoint in the catalogue."""
    from miserver.serving.weights.jobs import lineage_entry

    catalogue = request.app[RUNTIME].host.catalogue
    rows = [lineage_entry(r) for r in catalogue.list() if r.origin == "checkpoint"]
    return ok(msgspec.convert({"checkpoints": rows}, W.CheckpointsResponse))


# --- adapters (contract 6) ----------------------------------------------------------------------
async def get_adapter(request: web.Request) -> web.Response:
    return ok(request.app[RUNTIME].adapter_block())


async def _adapter_change(request: web.Request, apply: bool) -> web.Response:
    from miserver.serving.weights.jobs import prepare_adapter

    runtime = request.app[RUNTIME]
    body = await decode_body(request, W.AdapterRequest) if apply else None
    gguf = runtime.gguf_facts()  # the table refuses a GGUF resident (contract 4a)
    if apply:
        refuse_secret_name(request.app, body.name)
        refuse_secret_name(request.app, body.path, "path")  # GET /api/weights/adapter lists it
        syntax_ok = path_syntax_ok(body.path)
        try:
            if not gguf:
                prepare_adapter(runtime.host, body)
        except ApiError as exc:  # one that looked at the server's files: told only to operators
            if syntax_ok and (exc.param == "path" or exc.code is codes.ADAPTER_INVALID):
                raise private_path_refusal(request, exc) from None
            raise
    await runtime.gated(
        "adapter_change",
        _caller(request),  # MANAGEMENT_AUTH=operator checked the token (management_auth)
        None,
        operation="adapter",
        params={"body": body, "apply": apply},
        applied=apply,
        **gguf,
    )
    return ok(runtime.adapter_block())


@gated_route("adapter", token_gated=False)
async def post_adapter(request: web.Request) -> web.Response:
    """POST /api/weights/adapter {name, path}: apply a PEFT LoRA adapter, unmerged."""
    return await _adapter_change(request, True)


@gated_route("adapter", token_gated=False)
async def delete_adapter(request: web.Request) -> web.Response:
    """DELETE /api/weights/adapter: remove the adapter; outputs return exactly."""
    return await _adapter_change(request, False)


def setup_checkpoint_routes(app: web.Application, runtime: WeightsRuntime) -> None:
    """Register the checkpoint and adapter routes and their pause jobs."""
    from miserver.serving.weights.jobs import WeightsJobs

    WeightsJobs(runtime, app[keys.SETTINGS].home)
    r = app.router
    r.add_post("/api/weights/save", save)
    r.add_post("/api/weights/load", load)
    r.add_get("/api/weights/lineage", lineage)
    r.add_get("/api/weights/checkpoints", list_checkpoints)
    r.add_get("/api/weights/adapter", get_adapter)
    r.add_post("/api/weights/adapter", post_adapter)
    r.add_delete("/api/weights/adapter", delete_adapter)
