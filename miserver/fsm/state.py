"""The lifecycle's state, events and callers as plain hashable values (no I/O, no clock).

The state is a product of components (weights page: States, The write cycle, Timers). Six of them
name the states of the ``transitions.Machine`` (``NAMED``); the others are variables beside it,
tested by guards. Concrete times, counters and identities live in :class:`Context`; the checker
sees only :class:`LifecycleState`, where each timer is abstracted to "armed".
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Literal

WeightsState = Literal["clean", "writing", "torn"]
Barrier = Literal["serving", "draining", "quiesced"]
Owner = Literal["none", "holder", "save", "weights_load", "adapter"]
AttachmentState = Literal["none", "active", "stale"]
Commit = Literal["none", "mine", "orphan"]
PauseAvailability = Literal["ok", "cbm", "concurrency"]
ModelTransition = Literal["none", "load", "unload"]

#: The values each component can take, in a fixed order (the checker's non-vacuity uses these).
DOMAINS: dict[str, tuple[object, ...]] = {
    "resident": (False, True),
    "weights": ("clean", "writing", "torn"),
    "barrier": ("serving", "draining", "quiesced"),
    "owner": ("none", "holder", "save", "weights_load", "adapter"),
    "attachment": ("none", "active", "stale"),
    "commit": ("none", "mine", "orphan"),
    "avail": ("ok", "cbm", "concurrency"),
    "transition": ("none", "load", "unload"),
    "takeover": (False, True),
    "unsaved": (False, True),
    "adapter": (False, True),
    "hold_armed": (False, True),
    "watchdog_armed": (False, True),
    "heartbeat_armed": (False, True),
    "drain_armed": (False, True),
    "parked": (False, True),
}

#: Components that make up the ``transitions.Machine`` state names.
NAMED: tuple[str, ...] = ("resident", "weights", "barrier", "owner", "attachment", "commit")

#: The pauses other than the holder's quiesce (``PAUSE_IN_PROGRESS`` reasons).
PAUSE_OWNERS: tuple[str, ...] = ("save", "weights_load", "adapter")

TIMERS: tuple[str, ...] = ("hold", "watchdog", "heartbeat", "drain")


@dataclass(frozen=True, slots=True)
class LifecycleState:
    """One abstract state of the weights lifecycle.

    Attributes:
        resident: a model is resident.
        weights: ``clean``, ``writing`` or ``torn`` (weights page: States).
        barrier: ``serving``, ``draining`` (a pause is waiting for running requests) or
            ``quiesced``. The wire reports ``draining`` as ``quiesced`` (held requests wait).
        owner: who holds the barrier: ``none``, ``holder`` (the attachment's quiesce), ``save``,
            ``weights_load`` or ``adapter``.
        attachment: ``none``, ``active`` or ``stale``.
        commit: ``none``; ``mine`` (open, or torn by the watchdog, begun by the current
            attachment); ``orphan`` (its beginner was detached or cleared).
        avail: pause availability: ``ok``, ``cbm`` or ``concurrency`` (status pause_unavailable).
        transition: a model ``load`` (or swap) or ``unload`` is in progress.
        takeover: a save, weights load or adapter change took over the holder's hold and gives it
            back when done (contract 5, 6).
        unsaved: the resident carries commits no checkpoint records.
        adapter: an adapter is applied.
        hold_armed, watchdog_armed, heartbeat_armed, drain_armed: which timers are armed.
        parked: the holder's quiesce was a ``hold`` (contract 4b): the sequences that were
            running are parked in the engine (blocks freed, tokens kept) and continue, each
            prefilled again on the weights of that time, when the hold is released; a tear
            ends them.
    """

    resident: bool = False
    weights: WeightsState = "clean"
    barrier: Barrier = "serving"
    owner: Owner = "none"
    attachment: AttachmentState = "none"
    commit: Commit = "none"
    avail: PauseAvailability = "ok"
    transition: ModelTransition = "none"
    takeover: bool = False
    unsaved: bool = False
    adapter: bool = False
    hold_armed: bool = False
    watchdog_armed: bool = False
    heartbeat_armed: bool = False
    drain_armed: bool = False
    parked: bool = False

    def named(self) -> str:
        """The ``transitions.Machine`` state name of this state (its ``NAMED`` components)."""
        return state_name(
            self.resident, self.weights, self.barrier, self.owner, self.attachment, self.commit
        )

    def with_(self, **changes: object) -> LifecycleState:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)

    def short(self) -> str:
        """A compact one-line rendering for traces."""
        parts = [self.named()]
        extras = [
            f"avail={self.avail}" if self.avail != "ok" else "",
            f"transition={self.transition}" if self.transition != "none" else "",
            "takeover" if self.takeover else "",
            "unsaved" if self.unsaved else "",
            "adapter" if self.adapter else "",
            "parked" if self.parked else "",
        ]
        armed = [t for t in TIMERS if getattr(self, f"{t}_armed")]
        if armed:
            extras.append("armed=" + ",".join(armed))
        parts += [e for e in extras if e]
        return " ".join(parts)


STATE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(LifecycleState))
VARIABLES: tuple[str, ...] = tuple(f for f in STATE_FIELDS if f not in NAMED)


@lru_cache(maxsize=4096)
def state_name(
    resident: bool, weights: str, barrier: str, owner: str, attachment: str, commit: str
) -> str:
    """``resident.clean.quiesced-holder.active.commit-none`` (``empty...`` when not resident)."""
    bar = barrier if owner == "none" else f"{barrier}-{owner}"
    return ".".join(
        ("resident" if resident else "empty", weights, bar, f"att-{attachment}", f"commit-{commit}")
    )


def parse_state_name(name: str) -> dict[str, object]:
    """The inverse of :func:`state_name`: the ``NAMED`` components as a dict."""
    res, weights, bar, att, com = name.split(".")
    barrier, _, owner = bar.partition("-")
    return {
        "resident": res == "resident",
        "weights": weights,
        "barrier": barrier,
        "owner": owner or "none",
        "attachment": att.removeprefix("att-"),
        "commit": com.removeprefix("commit-"),
    }


TokenKind = Literal["none", "invalid", "trainer", "operator"]


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a gated call (weights page: Authentication and headers).

    Attributes:
        token: ``none`` (no Authorization header), ``invalid`` (not in WEIGHTS_TOKENS), or the
            token's role ``trainer`` / ``operator``.
        label: the token's label (``None`` unless the token is valid).
        attachment_id: the ``X-miLLM-Attachment`` header, or ``None`` when absent.
    """

    token: TokenKind = "none"
    label: str | None = None
    attachment_id: str | None = None

    def __repr__(self) -> str:  # never show the attachment ID
        shown = "set" if self.attachment_id else "none"
        return f"Caller(token={self.token}, label={self.label!r}, attachment_header={shown})"


@dataclass(frozen=True, slots=True)
class Event:
    """One input to the lifecycle: a request, an internal completion or a timer expiry.

    Only the fields a trigger reads matter; the others keep their defaults.

    Attributes:
        trigger: the event's name (a row trigger of :mod:`miserver.fsm.table`).
        caller: the gated caller (routes under /api/weights).
        queue_full: the interactive queue is full (MAX_QUEUED_REQUESTS; quiesce and /v1 hold).
        in_place: a weights load's checkpoint matches the resident layout (contract 5).
        not_attachable: why the resident model cannot be attached (``gguf``, ``quantized``,
            ``dtype``, ``not_on_gpu``, ``allocator``) or ``None`` (weights page).
        target: ``/v1`` and model loads: ``resident`` (names the resident by served or base name,
            or loads the resident row) or ``other`` (another catalogue row).
        refuse_policy: ``X-miLLM-Load-Policy: refuse`` was sent.
        avail: a settings change's resulting pause availability.
        applied: an adapter change's result: applied (``True``) or removed (``False``).
        name: the served name a completion sets (checkpoint, model or adapter name).
        origin: the ``X-miLLM-Model`` origin a load completion sets (``model`` for a
            ``{"model_id": N}`` reload, ``checkpoint`` for a checkpoint), or an adapter
            removal restores; ``None``: inferred.
        commits: the commit count an adapter removal restores with the name it had before the
            adapter (its commits, and those made while the adapter was applied); ``None``: 0.
        same_resident: ``v1_confirm``: the resident a waiting ``/v1`` request was admitted for
            (the one it named, or the row its auto-load loaded) is still the resident; False
            when it was unloaded, or replaced by another model, while the request waited.
        after_failure: ``transition_failed`` of a load: what is resident afterwards:
            ``nothing``; ``kept`` (the host refused before it dropped anything: the resident
            is unchanged); ``reloaded`` (the load failed after the previous model was dropped,
            and the host loaded that row back from its files; ``name`` and ``origin`` are its).
        model_id: ``catalogue_delete``: the catalogue row's id (``name``: its name); a GGUF
            refusal (``resident_gguf``): the resident's row.
        loads_checking: ``catalogue_delete``: a weights load's checkpoint is being checked
            before its pause (the runtime counts those checks).
        received: ``commit_end``: the commit's receive completed (contract 10, the
            process-group transport: every byte of the broadcast landed in the arena); always
            True for the other transports, whose write the server cannot see.
        group_ok: ``commit_begin``: the attachment's process group can still receive (it is
            joining or joined, not failed or destroyed); always True for the other transports.
        running: ``quiesce``: what happens to the running sequences (contract 4b): ``finish``
            (the weights page's drain) or ``hold`` (parked at the next step boundary).
        hold_supported: ``quiesce``: the resident's engine can park its running sequences
            (``ContinuousEngine.preempt_all``); a ``hold`` is refused while it cannot.
        resident_gguf: ``save``, ``weights_load``, ``adapter_change``: the resident is a GGUF
            file served by llama.cpp (contract 4a); ``model_id`` and ``name`` are its row's.
        checkpoint_load: ``weights_load``: the load names a checkpoint (contract 5), not a
            ``{"model_id": N}`` reload.
    """

    trigger: str
    caller: Caller | None = None
    queue_full: bool = False
    in_place: bool = True
    not_attachable: str | None = None
    target: Literal["resident", "other"] = "other"
    refuse_policy: bool = False
    avail: PauseAvailability = "ok"
    applied: bool = True
    name: str | None = None
    origin: Literal["model", "checkpoint"] | None = None
    same_resident: bool = True
    commits: int | None = None
    after_failure: Literal["nothing", "kept", "reloaded"] = "nothing"
    model_id: int | None = None
    loads_checking: bool = False
    received: bool = True
    group_ok: bool = True
    running: Literal["finish", "hold"] = "finish"
    hold_supported: bool = True
    resident_gguf: bool = False
    checkpoint_load: bool = True

    def short(self) -> str:
        """A compact rendering for traces: ``quiesce(trainer holder)``."""
        args: list[str] = []
        if self.caller is not None:
            args.append(f"token={self.caller.token}")
            if self.caller.label:
                args.append(f"label={self.caller.label}")
            if self.caller.attachment_id:
                args.append("header")
        defaults = Event(self.trigger)
        for f in (
            "queue_full",
            "in_place",
            "not_attachable",
            "target",
            "refuse_policy",
            "avail",
            "applied",
            "same_resident",
            "after_failure",
            "loads_checking",
            "received",
            "group_ok",
            "running",
            "hold_supported",
            "resident_gguf",
            "checkpoint_load",
        ):
            if getattr(self, f) != getattr(defaults, f):
                args.append(f"{f}={getattr(self, f)}")
        return f"{self.trigger}({', '.join(args)})"
