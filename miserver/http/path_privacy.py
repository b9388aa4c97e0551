"""What a caller without an operator token learns about the server's files (issue 32, item 13).

``POST /api/models`` and ``POST /api/weights/adapter`` take a path on the server. Their detailed
refusals (the path does not exist, is a file, has no ``config.json``, cannot be read, is not a
LoRA adapter, ...) tell whoever sends them which paths exist on the server and what they hold.
In the open mode (``MANAGEMENT_AUTH=none``) anyone may call these routes, so a caller without
an operator token is told only that the path is not a model folder; the detailed reason goes to
the server log (one info line) and to a caller with an operator token. With
``MANAGEMENT_AUTH=operator`` only operators reach these routes, and they get the details.
What depends only on the string sent (empty, relative, too long:
:func:`~miserver.serving.models.client_paths.check_path_syntax`) is answered to anyone.
"""

from __future__ import annotations

import logging

from aiohttp import web

from miserver.http import keys
from miserver.serving.auth import identify
from miserver.serving.models.client_paths import ClientPathError, check_path_syntax
from miserver.spec import codes
from miserver.spec.errors import ApiError

log = logging.getLogger("miserver.http")

#: The only refusal of a server path an anonymous caller gets in the open mode.
NOT_A_MODEL_FOLDER = (
    "path is not a model folder this server can use (a Hugging Face folder with config.json "
    "and *.safetensors files, a .gguf file, or for an adapter a PEFT LoRA folder that fits the "
    "served model); the server log says why, and so does the answer to an operator token"
)


def sees_server_paths(request: web.Request) -> bool:
    """Whether the caller may be told about the server's files: an operator token, or any
    caller with ``MANAGEMENT_AUTH=operator`` (which let only operators through)."""
    settings = request.app[keys.SETTINGS]
    if settings.management_auth == "operator":
        return True
    values = request.headers.getall("Authorization", ())
    if len(values) != 1:
        return False
    return identify(values[0], settings.weights_tokens).role == "operator"


def path_syntax_ok(raw: object) -> bool:
    """Whether ``raw`` passes the checks that do not look at the server's files."""
    try:
        check_path_syntax(raw)
    except ClientPathError:
        return False
    return True


def private_path_refusal(request: web.Request, exc: ApiError) -> ApiError:
    """``exc`` (a refusal about the server path of ``request``) as its caller may see it:
    unchanged for :func:`sees_server_paths`, else saying only :data:`NOT_A_MODEL_FOLDER`, the
    reason logged: ``400 ADAPTER_INVALID`` reason ``not_found`` (no adapter folder there) for
    an adapter folder's refusal, ``400 INVALID_REQUEST`` ``path`` for any other. An adapter
    that is a LoRA folder but does not fit the served model (reason ``incompatible``) is told
    as it is: only the folder's owner knows where one is."""
    if sees_server_paths(request) or exc.reason == "incompatible":
        return exc
    log.info(
        "%s %s: refused a path (%s %s); the caller was told only that it is not a model folder",
        request.method,
        request.path,
        exc.code.name,
        exc.message,
    )
    if exc.code is codes.ADAPTER_INVALID:
        return ApiError(codes.ADAPTER_INVALID, NOT_A_MODEL_FOLDER, reason="not_found", param="path")
    return ApiError(
        codes.INVALID_REQUEST, NOT_A_MODEL_FOLDER, param="path", details={"field": "path"}
    )
