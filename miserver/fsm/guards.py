"""The named guards the lifecycle table refers to, each a pure predicate.

A guard takes ``(state, context, event)`` and returns a bool. It declares what it reads: guards
that read only ``NAMED`` components are *static* (the compiler evaluates them per source state
and drops rows that cannot fire there); the others are evaluated when the event arrives. The
table names guards by string (design notes: guards are never lambdas).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass

from miserver.fsm.context import Context
from miserver.fsm.state import NAMED, PAUSE_OWNERS, Event, LifecycleState

Predicate = Callable[[LifecycleState, Context, Event], bool]


@dataclass(frozen=True)
class Guard:
    """A named predicate. ``reads`` lists the state fields it reads, plus ``event``/``context``."""

    name: str
    fn: Predicate
    reads: frozenset[str]
    doc: str

    @property
    def static(self) -> bool:
        """Reads only named components, so it is fixed for a given machine state."""
        return self.reads <= set(NAMED)


GUARDS: dict[str, Guard] = {}


def _g(name: str, reads: str, doc: str) -> Callable[[Predicate], Predicate]:
    def deco(fn: Predicate) -> Predicate:
        GUARDS[name] = Guard(name, fn, frozenset(reads.split()), doc)
        return fn

    return deco


def _is_holder(c: Context, e: Event) -> bool:
    caller = e.caller
    return (
        caller is not None
        and caller.token in ("trainer", "operator")
        and c.attachment_id is not None
        and caller.attachment_id is not None
        and hmac.compare_digest(
            caller.attachment_id.encode("utf-8", "surrogateescape"), c.attachment_id.encode()
        )
        and caller.label == c.attachment_label
    )


# --- callers (weights page: Authentication and headers) -------------------------------------
@_g("no_valid_token", "event", "no Authorization header, or a token not in WEIGHTS_TOKENS")
def _(s, c, e):
    return e.caller is None or e.caller.token not in ("trainer", "operator")


@_g("trainer_token", "event", "the caller's token has role trainer")
def _(s, c, e):
    return e.caller is not None and e.caller.token == "trainer"


@_g(
    "caller_is_holder",
    "event context",
    "the caller's token label attached and X-miLLM-Attachment matches the attachment ID",
)
def _(s, c, e):
    return _is_holder(c, e)


# --- named components ---------------------------------------------------------------------
@_g("resident", "resident", "a model is resident")
def _(s, c, e):
    return s.resident


@_g("clean", "weights", "weights_state is clean")
def _(s, c, e):
    return s.weights == "clean"


@_g("writing", "weights", "weights_state is writing")
def _(s, c, e):
    return s.weights == "writing"


@_g("torn", "weights", "weights_state is torn")
def _(s, c, e):
    return s.weights == "torn"


@_g("serving", "barrier", "the barrier is serving (nothing holds it)")
def _(s, c, e):
    return s.barrier == "serving"


@_g("draining", "barrier", "a pause is waiting for running requests to finish")
def _(s, c, e):
    return s.barrier == "draining"


@_g("quiesced", "barrier", "the barrier is held and no forward pass runs")
def _(s, c, e):
    return s.barrier == "quiesced"


@_g("held_by_holder", "owner", "the attachment's quiesce owns the barrier")
def _(s, c, e):
    return s.owner == "holder"


@_g("held_by_pause", "owner", "a save, weights load or adapter change owns the barrier")
def _(s, c, e):
    return s.owner in PAUSE_OWNERS


for _owner in PAUSE_OWNERS:

    def _mk(owner: str) -> Predicate:
        return lambda s, c, e: s.owner == owner

    GUARDS[f"held_by_{_owner}"] = Guard(
        f"held_by_{_owner}",
        _mk(_owner),
        frozenset({"owner"}),
        f"a {_owner.replace('_', ' ')} owns the barrier",
    )


@_g("attached", "attachment", "an attachment exists (active or stale)")
def _(s, c, e):
    return s.attachment != "none"


@_g("active", "attachment", "the attachment is active")
def _(s, c, e):
    return s.attachment == "active"


@_g("commit_open", "commit", "a commit is open or torn and not yet ended")
def _(s, c, e):
    return s.commit != "none"


@_g("commit_mine", "commit", "the commit was begun by the current attachment")
def _(s, c, e):
    return s.commit == "mine"


# --- variables ----------------------------------------------------------------------------
@_g("pause_cbm", "avail", "continuous batching is on (pause_unavailable: cbm)")
def _(s, c, e):
    return s.avail == "cbm"


@_g("pause_concurrency", "avail", "MAX_CONCURRENT_REQUESTS is not 1 (pause_unavailable)")
def _(s, c, e):
    return s.avail == "concurrency"


@_g("in_transition", "transition", "a model load, swap or unload is in progress")
def _(s, c, e):
    return s.transition != "none"


@_g("loading", "transition", "a model load or swap is in progress")
def _(s, c, e):
    return s.transition == "load"


@_g("unloading", "transition", "a model unload is in progress")
def _(s, c, e):
    return s.transition == "unload"


@_g("takeover", "takeover", "the pause took over the holder's hold and gives it back")
def _(s, c, e):
    return s.takeover


@_g("unsaved", "unsaved", "the resident carries commits no checkpoint records")
def _(s, c, e):
    return s.unsaved


@_g("parked", "parked", "a hold quiesce parked the running sequences (contract 4b)")
def _(s, c, e):
    return s.parked


for _timer in ("hold", "watchdog", "heartbeat", "drain"):

    def _mk_t(field: str) -> Predicate:
        return lambda s, c, e: getattr(s, field)

    GUARDS[f"{_timer}_armed"] = Guard(
        f"{_timer}_armed",
        _mk_t(f"{_timer}_armed"),
        frozenset({f"{_timer}_armed"}),
        f"the {_timer} timer is armed",
    )


# --- event parameters ---------------------------------------------------------------------
@_g("queue_full", "event", "the interactive queue is full (MAX_QUEUED_REQUESTS)")
def _(s, c, e):
    return e.queue_full


@_g("in_place", "event", "the checkpoint's layout matches the resident (contract 5)")
def _(s, c, e):
    return e.in_place


@_g("targets_resident", "event", "the request names the resident (served or base name)")
def _(s, c, e):
    return e.target == "resident"


@_g(
    "same_resident",
    "event resident",
    "a model is resident and it is the one the waiting /v1 request was admitted for (or "
    "the model a weights load reloaded while the request was held, when it answers to the "
    "name the request gave: issue 32, item 2)",
)
def _(s, c, e):
    return s.resident and e.same_resident


@_g("refuse_policy", "event", "X-miLLM-Load-Policy: refuse")
def _(s, c, e):
    return e.refuse_policy


@_g(
    "kept_resident",
    "event",
    "the failed load was refused before the resident was dropped: it is unchanged",
)
def _(s, c, e):
    return e.after_failure == "kept"


@_g(
    "reloaded_previous",
    "event",
    "the load failed after the resident was dropped, and the previous row was loaded back",
)
def _(s, c, e):
    return e.after_failure == "reloaded"


@_g("checking_load", "event", "a weights load's checkpoint is being checked before its pause")
def _(s, c, e):
    return e.loads_checking


@_g(
    "receive_incomplete",
    "event",
    "the commit's broadcast into the arena did not complete (contract 10, process-group)",
)
def _(s, c, e):
    return not e.received


@_g(
    "group_unusable",
    "event",
    "the attachment's process group failed to form or was destroyed (contract 10)",
)
def _(s, c, e):
    return not e.group_ok


@_g("running_hold", "event", 'the quiesce asks {"running": "hold"} (contract 4b)')
def _(s, c, e):
    return e.running == "hold"


@_g(
    "hold_unsupported",
    "event",
    "the resident's engine cannot park running sequences (a hold is refused; contract 4b)",
)
def _(s, c, e):
    return not e.hold_supported


@_g(
    "resident_gguf",
    "event resident",
    "a model is resident and it is a GGUF file served by llama.cpp, which holds its weights "
    "(contract 4a: no save, no checkpoint load, no adapter)",
)
def _(s, c, e):
    return s.resident and e.resident_gguf


@_g(
    "checkpoint_load",
    "event",
    'the weights load names a checkpoint (contract 5), not a {"model_id": N} reload',
)
def _(s, c, e):
    return e.checkpoint_load


@_g("applies_adapter", "event", "the adapter change applied an adapter (not removed it)")
def _(s, c, e):
    return e.applied


for _reason in ("gguf", "quantized", "dtype", "not_on_gpu", "allocator"):

    def _mk_r(reason: str) -> Predicate:
        return lambda s, c, e: e.not_attachable == reason

    GUARDS[f"model_{_reason}"] = Guard(
        f"model_{_reason}",
        _mk_r(_reason),
        frozenset({"event"}),
        f"the resident model is not attachable: {_reason}",
    )

for _avail in ("ok", "cbm", "concurrency"):

    def _mk_a(avail: str) -> Predicate:
        return lambda s, c, e: e.avail == avail

    GUARDS[f"sets_avail_{_avail}"] = Guard(
        f"sets_avail_{_avail}",
        _mk_a(_avail),
        frozenset({"event"}),
        f"the new settings make pause availability {_avail}",
    )


def evaluate(name: str, state: LifecycleState, context: Context, event: Event) -> bool:
    """Evaluate the guard called ``name``. Raises ``KeyError`` for an unknown name."""
    return GUARDS[name].fn(state, context, event)
