"""``MANAGEMENT_AUTH=operator``: the mutating management routes and every Batch API route need an
operator token (issue 16, item 6; issue 32, item 9).

By default (``MANAGEMENT_AUTH=none``) the management API is unauthenticated, as the weights page
chooses. With ``operator``, every route that changes something outside the weights routes needs
``Authorization: Bearer <operator token>``, checked as the weights routes check theirs: no or an
unknown token is ``401 WEIGHTS_UNAUTHORIZED`` (``WWW-Authenticate: Bearer``), a trainer token
``403 WEIGHTS_FORBIDDEN``; every such call, accepted or refused, writes one ``weights_audit``
line (operation below, role, label, outcome and code). Every Batch API route, reads included,
is guarded too: the uploaded files are an operator's prompts and the outputs their completions,
so only an operator token lists, reads or fetches them (a trainer token is ``403``); a refused
read writes one audit line (``file_read`` or ``batch_read``), an accepted one none (clients
poll a batch). The other reads (``GET /api/...``, ``GET /v1/models``) and ``/v1`` inference on
the resident stay open; a ``/v1`` auto-load needs an operator token too
(:func:`miserver.http.v1_admission.caller_may_load`, breaker finding F10).

=================================  ====================
route                              audit ``operation``
=================================  ====================
``POST /api/models``               ``model_register``
``DELETE /api/models/{id}``        ``model_delete``
``POST /api/models/{id}/load``     ``model_load``
``POST /api/models/{id}/unload``   ``model_unload``
``PATCH /api/settings``            ``settings_change``
``POST /v1/files``                 ``file_upload``
``DELETE /v1/files/{file_id}``     ``file_delete``
``POST /v1/batches``               ``batch_create``
``POST /v1/batches/{id}/cancel``   ``batch_cancel``
``GET /v1/files``                  ``file_read``
``GET /v1/files/{id}``             ``file_read``
``GET /v1/files/{id}/content``     ``file_read``
``GET /v1/batches``                ``batch_read``
``GET /v1/batches/{id}``           ``batch_read``
``POST /api/weights/adapter``      ``adapter``
``DELETE /api/weights/adapter``    ``adapter``
=================================  ====================

An adapter change changes what every client is served (contract 6), so it is gated like the
other mutating routes (breaker finding F4). Its accepted and refused lines past the token check
are written by the route itself (:func:`miserver.http.weights.gated_route`, in every mode: the
weights page's audit operation ``adapter``); here only its token refusals are written.
"""

from __future__ import annotations

from aiohttp import web

from miserver.http import keys
from miserver.http.errors import code_for_status
from miserver.serving.audit import AuditRecord
from miserver.serving.auth import WWW_AUTHENTICATE, Caller, identify
from miserver.spec import codes
from miserver.spec.errors import ApiError

#: (method, canonical route) -> audit operation, for every route this mode guards.
GUARDED: dict[tuple[str, str], str] = {
    ("POST", "/api/models"): "model_register",
    ("DELETE", "/api/models/{id}"): "model_delete",
    ("POST", "/api/models/{id}/load"): "model_load",
    ("POST", "/api/models/{id}/unload"): "model_unload",
    ("PATCH", "/api/settings"): "settings_change",
    ("POST", "/v1/files"): "file_upload",
    ("DELETE", "/v1/files/{file_id}"): "file_delete",
    ("POST", "/v1/batches"): "batch_create",
    ("POST", "/v1/batches/{batch_id}/cancel"): "batch_cancel",
    # issue 32, item 9: a Batch API read returns an operator's prompts and completions
    ("GET", "/v1/files"): "file_read",
    ("GET", "/v1/files/{file_id}"): "file_read",
    ("GET", "/v1/files/{file_id}/content"): "file_read",
    ("GET", "/v1/batches"): "batch_read",
    ("GET", "/v1/batches/{batch_id}"): "batch_read",
    ("POST", "/api/weights/adapter"): "adapter",
    ("DELETE", "/api/weights/adapter"): "adapter",
}
OPERATIONS = tuple(dict.fromkeys(GUARDED.values()))
#: Operations whose route writes its own audit line once past the token check (one line a call).
AUDITED_BY_ROUTE = frozenset({"adapter"})
#: Read operations: audited when refused only (a client polls its batch; reads change nothing).
READS = frozenset({"file_read", "batch_read"})


def _operation(request: web.Request) -> str | None:
    resource = request.match_info.route.resource
    if resource is None:
        return None
    return GUARDED.get((request.method, resource.canonical))


def _audit(request: web.Request, operation: str, caller: Caller, code: str | None) -> None:
    runtime = request.app.get(keys.WEIGHTS)
    if runtime is None:
        return
    resident = runtime.host.resident
    state = runtime.lifecycle.state.weights
    runtime.audit.write_soon(
        AuditRecord(
            operation=operation,
            outcome="refused" if code is not None else "accepted",
            code=code,
            reason=None,
            role=caller.role,
            label=caller.label,
            attachment_ref=None,
            model=resident.base_name if resident is not None else None,
            weights_state=state,
            weights_state_before=state,
        )
    )


def token_refusal(request: web.Request) -> ApiError | None:
    """The 401/403 this mode answers ``request`` with (no audit line written), or None when
    its route is not guarded or the caller holds an operator token."""
    if _operation(request) is None:
        return None
    settings = request.app[keys.SETTINGS]
    caller = identify(request.headers.get("Authorization"), settings.weights_tokens)
    return None if caller.role == "operator" else _refusal(caller)


def _refusal(caller: Caller) -> ApiError:
    if caller.role == "trainer":
        return ApiError(
            codes.WEIGHTS_FORBIDDEN,
            "This token's role may not call this route: with MANAGEMENT_AUTH=operator it "
            "needs an operator token.",
        )
    return ApiError(
        codes.WEIGHTS_UNAUTHORIZED,
        "A valid operator bearer token from WEIGHTS_TOKENS is required (MANAGEMENT_AUTH=operator).",
        headers={"WWW-Authenticate": WWW_AUTHENTICATE},
    )


@web.middleware
async def management_auth_middleware(
    request: web.Request, handler: web.Handler
) -> web.StreamResponse:
    """Check the operator token of a guarded route (only with ``MANAGEMENT_AUTH=operator``)."""
    settings = request.app[keys.SETTINGS]
    if settings.management_auth != "operator":
        return await handler(request)
    operation = _operation(request)
    if operation is None:
        return await handler(request)
    caller = identify(request.headers.get("Authorization"), settings.weights_tokens)
    if caller.role != "operator":
        err = _refusal(caller)
        _audit(request, operation, caller, err.code.name)
        raise err
    if operation in AUDITED_BY_ROUTE or operation in READS:
        return await handler(request)
    try:
        response = await handler(request)
    except ApiError as exc:
        _audit(request, operation, caller, exc.code.name)
        raise
    except web.HTTPException as exc:
        if exc.status >= 400:
            _audit(request, operation, caller, code_for_status(exc.status).name)
        raise
    except Exception:
        _audit(request, operation, caller, codes.INTERNAL_ERROR.name)
        raise
    if response.status >= 400:
        _audit(request, operation, caller, code_for_status(response.status).name)
    else:
        _audit(request, operation, caller, None)
    return response
