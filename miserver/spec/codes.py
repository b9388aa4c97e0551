"""Every error code miserver can answer with: HTTP status, allowed ``reason`` values, OpenAI type.

This module is the one place a code is defined. The weights page
(``weights-attachment-and-step-barrier.md``) and the companion contract (sections 2-8) are the
sources; each entry names the section it comes from. Nothing here imports torch or aiohttp.

Management routes answer ``{"success": false, "data": null, "error": {code, message, reason,
details}}``; ``/v1`` routes answer ``{"error": {message, type, param, code}}`` with ``code`` the
lower-case form of the management code (contract section 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ErrorCode:
    """One error code.

    Attributes:
        name: the wire name, upper case (``WEIGHTS_TORN``).
        status: the HTTP status it is normally sent with.
        reasons: the allowed values of the error's ``reason`` field (empty: always null).
        openai_type: the ``type`` of the OpenAI-shaped error on ``/v1``.
        source: the spec section the code comes from.
        other_statuses: further statuses the spec uses for the same code in another context
            (``MODEL_NOT_LOADED`` is 400 on attach and 409 on ``/v1`` with the refuse policy).
    """

    name: str
    status: int
    reasons: tuple[str, ...] = ()
    openai_type: str = "invalid_request_error"
    source: str = ""
    other_statuses: tuple[int, ...] = field(default=())

    @property
    def wire(self) -> str:
        """The lower-case form used as ``code`` on ``/v1`` (contract section 2)."""
        return self.name.lower()

    def allows(self, status: int, reason: str | None) -> bool:
        """Whether ``(status, reason)`` is a legal use of this code."""
        ok_status = status == self.status or status in self.other_statuses
        ok_reason = reason is None or reason in self.reasons
        return ok_status and ok_reason


W = "weights page"


def _c(
    name: str,
    status: int,
    *reasons: str,
    t: str = "invalid_request_error",
    src: str = W,
    other: tuple[int, ...] = (),
) -> ErrorCode:
    return ErrorCode(name, status, tuple(reasons), t, src, other)


# --- the weights page -----------------------------------------------------------------------
WEIGHTS_UNAUTHORIZED = _c(
    "WEIGHTS_UNAUTHORIZED", 401, t="authentication_error", src=W + ": Authentication and headers"
)
WEIGHTS_FORBIDDEN = _c(
    "WEIGHTS_FORBIDDEN", 403, t="permission_error", src=W + ": Authentication and headers"
)
NOT_ATTACHED = _c("NOT_ATTACHED", 409, src=W + ": Authentication and headers")
NOT_ATTACHMENT_HOLDER = _c(
    "NOT_ATTACHMENT_HOLDER",
    403,
    t="permission_error",
    src=W + ": Authentication and headers; The write cycle 4",
)
ALREADY_ATTACHED = _c("ALREADY_ATTACHED", 409, src=W + ": The write cycle 1")
MODEL_NOT_LOADED = _c(
    "MODEL_NOT_LOADED", 400, src=W + ": The write cycle 1; contract 4", other=(409,)
)
MODEL_BUSY = _c(
    "MODEL_BUSY",
    409,
    "drain_timeout",
    "model_transition",
    src=W + ": The write cycle 2; contract 1, 3, 4",
)
QUEUE_FULL = _c("QUEUE_FULL", 503, t="server_error", src=W + ": The write cycle 2; contract 1")
WEIGHTS_NOT_CLEAN = _c(
    "WEIGHTS_NOT_CLEAN",
    409,
    "receive_incomplete",
    src=W + ": The write cycle 2, 3; contract 10 (commit-end, receive_incomplete)",
)
ALREADY_QUIESCED = _c("ALREADY_QUIESCED", 409, src=W + ": The write cycle 2")
PAUSE_IN_PROGRESS = _c(
    "PAUSE_IN_PROGRESS", 409, "save", "weights_load", "adapter", src=W + ": The write cycle 2, 3"
)
BARRIER_UNAVAILABLE = _c(
    "BARRIER_UNAVAILABLE",
    409,
    "cbm",
    "concurrency",
    "hold_unsupported",
    src=W + ": The write cycle 2; Status pause_unavailable; contract 4b",
)
NOT_QUIESCED = _c("NOT_QUIESCED", 409, "quiesce_in_progress", src=W + ": The write cycle 3, 5")
NO_OPEN_COMMIT = _c("NO_OPEN_COMMIT", 409, src=W + ": The write cycle 4")
ATTACHMENT_NOT_STALE = _c("ATTACHMENT_NOT_STALE", 409, src=W + ": Timers")
WEIGHTS_TORN = _c("WEIGHTS_TORN", 503, t="server_error", src=W + ": States")
WEIGHTS_UNSAVED = _c("WEIGHTS_UNSAVED", 409, src=W + ": Unsaved commits and the auto-load")
NOT_ATTACHABLE = _c(
    "NOT_ATTACHABLE",
    400,
    "gguf",
    "quantized",
    "dtype",
    "not_on_gpu",
    "allocator",
    "continuous_batching_running",
    "concurrency",
    "model_transition",
    "weights_writing",
    src=W + ": Which models can be attached",
)

# --- the companion contract -----------------------------------------------------------------
C = "companion contract"
MODEL_RESIDENT = _c("MODEL_RESIDENT", 409, src=C + " 3")
BACKEND_UNAVAILABLE = _c("BACKEND_UNAVAILABLE", 400, "gguf", src=C + " 3")
# What a GGUF resident (served by llama.cpp, whose weights miserver does not hold) cannot do:
# a save, a weights load of a checkpoint (in place), an adapter change. Refused by the lifecycle
# table's rows before anything is paused or touched; attach is NOT_ATTACHABLE reason gguf (the
# weights page).
GGUF_UNSUPPORTED = _c("GGUF_UNSUPPORTED", 400, "save", "weights_load", "adapter", src=C + " 4a")
# A registered row whose files cannot be loaded (deleted, corrupt, unsupported architecture):
# 400 when a check before the load found it (the resident model stays), 500 when the load
# itself failed (the previous model is loaded back when it can be).
MODEL_LOAD_FAILED = _c("MODEL_LOAD_FAILED", 500, t="server_error", src=C + " 3", other=(400,))
# POST /api/models with a name another catalogue row already has.
MODEL_EXISTS = _c("MODEL_EXISTS", 409, src=C + " 3")
CHECKPOINT_CORRUPT = _c("CHECKPOINT_CORRUPT", 400, src=C + " 5")
CHECKPOINT_NOT_FOUND = _c("CHECKPOINT_NOT_FOUND", 404, t="not_found_error", src=C + " 5")
CHECKPOINT_EXISTS = _c("CHECKPOINT_EXISTS", 409, src=C + " 5")
ADAPTER_INVALID = _c(
    "ADAPTER_INVALID",
    400,
    "not_found",
    "no_config",
    "not_lora",
    "unsafe_format",
    "incompatible",
    src=C + " 6",
)
MODEL_NOT_FOUND = _c("MODEL_NOT_FOUND", 404, t="not_found_error", src=C + " 3, 4")
INVALID_REQUEST = _c("INVALID_REQUEST", 400, src=C + " 2, 4")
#: Commit-begin of a process-group attachment whose group failed to form or was destroyed (a
#: tear): nothing could be received; detach and attach again (contract 10).
GROUP_UNAVAILABLE = _c("GROUP_UNAVAILABLE", 409, src=C + " 10")
NOT_FOUND = _c("NOT_FOUND", 404, t="not_found_error", src=C + " 2")
METHOD_NOT_ALLOWED = _c("METHOD_NOT_ALLOWED", 405, src=C + " 2")
PAYLOAD_TOO_LARGE = _c("PAYLOAD_TOO_LARGE", 413, src=C + " 1, 2")
UNSUPPORTED_MEDIA_TYPE = _c("UNSUPPORTED_MEDIA_TYPE", 415, src=C + " 2")
GENERATION_FAILED = _c(
    "GENERATION_FAILED", 500, "non_finite_logits", "error", t="server_error", src=C + " 4"
)
INTERNAL_ERROR = _c("INTERNAL_ERROR", 500, t="server_error", src=C + " 2")
#: miserver's own: the process is draining after SIGTERM (issue 16; docs/operations.md).
SHUTTING_DOWN = _c("SHUTTING_DOWN", 503, t="server_error", src="miserver: graceful shutdown")
#: miserver's own: ``GET /api/health/ready`` while the server cannot serve (the readiness probe).
NOT_READY = _c(
    "NOT_READY",
    503,
    "no_model",
    "model_transition",
    "weights_torn",
    t="server_error",
    src="miserver: readiness",
)
# The disk under MISERVER_HOME (or the audit log) is full: nothing was written (WebDAV's 507).
INSUFFICIENT_STORAGE = _c("INSUFFICIENT_STORAGE", 507, "disk_full", t="server_error", src=C + " 2")

ALL: dict[str, ErrorCode] = {
    v.name: v for v in list(globals().values()) if isinstance(v, ErrorCode)
}

#: The codes the weights page itself defines (the checker must reach each one).
WEIGHTS_PAGE_CODES: tuple[str, ...] = tuple(
    name for name, code in ALL.items() if code.source.startswith(W)
)


def lookup(name: str) -> ErrorCode:
    """The code called ``name``. Raises ``KeyError`` for an unknown name."""
    return ALL[name]


#: What a code means and what to do, for the codes whose answers always carry their own message
#: (the routes build it from the request) and the table therefore gives no default: the
#: reference's "Meaning, and what to do" column (docs/reference.md; issue 32, item 6).
MEANINGS: dict[str, str] = {
    "MODEL_RESIDENT": "The catalogue row cannot be deleted now: it is the resident model, it is "
    "DEFAULT_MODEL, or it holds the only save of the resident weights' commits. Unload it "
    "(POST /api/models/{id}/unload), change DEFAULT_MODEL, or save the weights under another "
    "name first; the message says which.",
    "BACKEND_UNAVAILABLE": "The row needs a backend this installation lacks (reason gguf: a "
    "GGUF file and the xllamacpp package is missing; reinstall with make serve or pip install "
    "-e .). The resident model stays; load a safetensors row instead.",
    "GGUF_UNSUPPORTED": "The resident is a GGUF file served by llama.cpp, which this operation "
    "cannot reach (reason save, weights_load or adapter): its weights are quantized and not "
    "held by miserver. Load a safetensors row first (POST /api/models/{id}/load).",
    "MODEL_LOAD_FAILED": "The row's files could not be loaded (moved, deleted, unreadable or "
    "damaged weights). 400 when the files were checked before anything was unloaded (the "
    "resident keeps serving), 500 when the load failed after. Fix or re-register the folder.",
    "MODEL_EXISTS": "A catalogue row already has this name (details.model_id): choose another "
    "name, or delete that row first.",
    "CHECKPOINT_CORRUPT": "The checkpoint folder does not verify: a file or tensor differs from "
    "its manifest's sha256, or the manifest is unreadable (details.tensor or details.file names "
    "it). Nothing was loaded; load another checkpoint or the base row.",
    "CHECKPOINT_NOT_FOUND": "No checkpoint has this name, id or path: GET "
    "/api/weights/checkpoints lists them.",
    "CHECKPOINT_EXISTS": "A checkpoint with this name exists already: choose another name "
    "(or omit it for a generated one).",
    "ADAPTER_INVALID": "The adapter folder cannot be applied (the reason says why: not_found, "
    "no_config, not_lora, unsafe_format, incompatible). Nothing changed; the served weights "
    "stay as they were.",
    "MODEL_NOT_FOUND": "No catalogue row or served model has this id or name: GET /api/models "
    "(or GET /v1/models) lists them.",
    "INVALID_REQUEST": "The request is malformed: not JSON, a field of the wrong type, an "
    "unknown or missing field, a value out of range. The message and param name the field; "
    "fix the request (retrying it unchanged gives the same answer).",
    "NOT_FOUND": "No route has this path: the reference lists every route.",
    "METHOD_NOT_ALLOWED": "The path exists but not with this method; the Allow header lists "
    "the methods it takes.",
    "PAYLOAD_TOO_LARGE": "The request body is larger than MAX_REQUEST_BYTES (details give both "
    "sizes); nothing was read. Send less, or raise the setting.",
    "UNSUPPORTED_MEDIA_TYPE": "The body's Content-Type (or Content-Encoding) is not what the "
    "route reads: application/json (multipart/form-data for POST /v1/files), uncompressed or "
    "gzip/deflate. details.expected names it.",
    "GENERATION_FAILED": "Generation failed while computing the answer (reason "
    "non_finite_logits: the model produced NaN or inf, as weights a trainer broke do; error: "
    "another failure, in the server log). Nothing is served from it; check the weights "
    "(GET /api/weights/status) and retry.",
    "INTERNAL_ERROR": "A fault of the server's, not of the request: the server log has the "
    "traceback. Retrying may succeed; report it if it repeats.",
    "SHUTTING_DOWN": "The server is draining after a signal (SIGTERM, or SIGINT for a Ctrl-C): "
    "new requests are refused and running ones ended at the end of SHUTDOWN_GRACE_S. Retry "
    "after Retry-After seconds, on another replica or once it has restarted.",
    "NOT_READY": "GET /api/health/ready: the server cannot serve now (reason no_model, "
    "model_transition or weights_torn). A readiness probe keeps traffic away until it is 200.",
    "INSUFFICIENT_STORAGE": "The disk under MISERVER_HOME (or the audit log's) is full: nothing "
    "half-written was kept. Free space, then retry.",
}
