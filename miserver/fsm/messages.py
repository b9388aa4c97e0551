"""The words of the lifecycle's refusals: what happened and what to do, by error code and by
(code, reason), used when a table row gives no message of its own (also
``/api/health/detailed``'s ``not_attachable`` and ``miserver reference``).
"""

from __future__ import annotations

_MESSAGES: dict[str, str] = {
    "WEIGHTS_UNAUTHORIZED": "A valid bearer token from WEIGHTS_TOKENS is required.",
    "WEIGHTS_FORBIDDEN": "This token's role may not call this route: it needs a token of role "
    "operator (an entry label:operator:secret of WEIGHTS_TOKENS).",
    "NOT_ATTACHED": "Nothing is attached. POST /api/weights/attach first.",
    "NOT_ATTACHMENT_HOLDER": "Only the attachment holder may do this (token label and "
    "X-miLLM-Attachment must match).",
    "ALREADY_ATTACHED": "An attachment exists (details.holder names its role, label, state and "
    "attached_at). Its holder detaches with POST /api/weights/detach; when it is stale (its "
    "trainer died), an operator token (role operator) clears it with POST "
    "/api/weights/clear-stale.",
    "MODEL_NOT_LOADED": "No model is resident, or the requested model is not loaded.",
    "MODEL_BUSY": "The model is busy; retry when the current operation ends.",
    "QUEUE_FULL": (
        "The request queue is full: MAX_QUEUED_REQUESTS interactive requests are already waiting;"
        " retry after Retry-After seconds."
    ),
    "WEIGHTS_NOT_CLEAN": "The weights are not clean.",
    "ALREADY_QUIESCED": "This attachment already holds the barrier.",
    "PAUSE_IN_PROGRESS": "Another pause holds the barrier.",
    "BARRIER_UNAVAILABLE": "Serving cannot be paused now (see pause_unavailable).",
    "NOT_QUIESCED": "The barrier is not held by this attachment.",
    "NO_OPEN_COMMIT": "No commit is open.",
    "ATTACHMENT_NOT_STALE": "The attachment is active; only a stale one can be cleared.",
    "WEIGHTS_TORN": "The weights are torn. Recover with POST /api/weights/load.",
    "WEIGHTS_UNSAVED": "The resident carries unsaved commits; a load would discard them.",
    "NOT_ATTACHABLE": "The resident model cannot be attached.",
    "GROUP_UNAVAILABLE": "The attachment's process group failed to form or was destroyed (a "
    "tear destroys it), so nothing can receive a write: detach, attach again (a new group), "
    "and recover a torn set with POST /api/weights/load.",
}
_REASON_MESSAGES: dict[tuple[str, str], str] = {
    ("NOT_ATTACHABLE", "not_on_gpu"): "The resident model is on the CPU, which is attachable "
    "only in shared memory: restart the server with WEIGHTS_CPU_ATTACH=1 (it applies when the "
    "model loads; keep the trainer token configured), then attach.",
    ("NOT_ATTACHABLE", "allocator"): "The resident model was not loaded attachably: a load is "
    "made attachable only while a trainer token is configured (WEIGHTS_TOKENS, read at start). "
    "Configure one and restart the server, then attach.",
    ("NOT_ATTACHABLE", "gguf"): "The resident model is a GGUF file, which cannot be attached: "
    "load a safetensors row.",
    ("NOT_ATTACHABLE", "quantized"): "The resident model is quantized, which cannot be attached: "
    "load an unquantized float16 or bfloat16 row.",
    ("NOT_ATTACHABLE", "dtype"): "The resident model's parameters are not float16 or bfloat16, "
    "which attach needs: load a float16 or bfloat16 row.",
    ("NOT_ATTACHABLE", "concurrency"): "MAX_CONCURRENT_REQUESTS is not 1, which the step "
    "barrier needs: set it to 1 (PATCH /api/settings), then attach.",
    ("NOT_ATTACHABLE", "continuous_batching_running"): "Continuous batching is on, which the "
    "step barrier cannot pause: set CONTINUOUS_BATCHING=0, then attach.",
    ("NOT_ATTACHABLE", "model_transition"): "A model load, unload, save, weights load or "
    "adapter change is in progress: retry when it ends.",
    ("NOT_ATTACHABLE", "weights_writing"): "A commit is still open (the weights are writing): "
    "retry once it ends or the watchdog tears it.",
    ("WEIGHTS_NOT_CLEAN", "receive_incomplete"): "The commit's broadcast into the arena did "
    "not complete (the trainer stopped sending, or a rank left the group): the arena may be "
    "half-written, so the commit cannot end clean; the watchdog tears the set. Detach, attach "
    "again, and recover with POST /api/weights/load.",
    ("NOT_QUIESCED", "quiesce_in_progress"): "Quiesce is still draining in-flight work; wait "
    "for it to return, then retry.",
    ("BARRIER_UNAVAILABLE", "hold_unsupported"): 'A quiesce with {"running": "hold"} needs '
    "the continuous engine, which parks running sequences at a step boundary; the resident "
    "cannot (contract 4b): it is a GGUF row, decoded by llama.cpp. Quiesce with "
    '{"running": "finish"} instead, or serve a transformers row.',
    ("MODEL_BUSY", "drain_timeout"): "Running requests did not finish within "
    "WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S; nothing is held.",
    ("MODEL_BUSY", "model_transition"): "A model load, unload, save, weights load or adapter "
    "change is in progress.",
}


def refusal_message(code: str, reason: str | None = None) -> str:
    """The message a refusal of ``code`` (and ``reason``) carries when its table row gives none:
    what happened and what to do (also ``/api/health/detailed``'s ``not_attachable``)."""
    return _REASON_MESSAGES.get((code, reason or ""), _MESSAGES.get(code, code))
