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
