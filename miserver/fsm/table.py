"""The weights lifecycle as one table: every rule about weights, the barrier, the attachment and
every refusal is a row here, and nowhere else (design notes: the one idea).

A row is ``(trigger, when, unless, outcome)``. For one trigger the rows are **ordered guarded
alternatives**: the first row whose guards all hold (``when`` true, ``unless`` false) decides.
So the order of a route's refusal rows *is* its check order (weights page: Authentication and
headers; The write cycle). An accepted row lists the components it changes (``set``), the
effects the serving layer performs and the context actions (counters, records) the core
applies; a refusal row names its code, reason and status and changes nothing; an ``ignore`` row
is an internal event that does not apply in that state (a timer that fired late, say).

Timers are components: setting ``hold_armed=True`` (re)starts the hold timer in full, ``False``
cancels it. :func:`miserver.fsm.machine.compile_table` turns the rows into a plain
``transitions.Machine`` over the product states.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from miserver.spec import codes
from miserver.spec.codes import ErrorCode


class Effect(StrEnum):
    """What the serving layer does after an accepted event (in the order listed)."""

    EXPORT_HANDLES = "EXPORT_HANDLES"  # attach: export storages[]/parameters[]
    RELEASE_EXPORTS = "RELEASE_EXPORTS"  # detach / clear-stale: reclaim released blocks
    HOLD_ADMISSIONS = "HOLD_ADMISSIONS"  # from now on hold new /v1 requests and batch chunks
    START_DRAIN = "START_DRAIN"  # wait for running forward passes; then send `drained`
    CANCEL_DRAIN = "CANCEL_DRAIN"  # stop waiting for the drain
    DROP_CACHE = "DROP_CACHE"  # drop every cross-request cache (weights page: quiesce)
    RELEASE_HELD = "RELEASE_HELD"  # admit the held requests, stop holding
    REFUSE_HELD_TORN = "REFUSE_HELD_TORN"  # answer every held request 503 WEIGHTS_TORN
    ANSWER_PENDING = "ANSWER_PENDING"  # answer the call waiting on this pause with `pending`
    FAIL_PENDING = "FAIL_PENDING"  # answer the waiting call with the failure the layer saw
    BEGIN_SAVE = "BEGIN_SAVE"  # the barrier is held: write the checkpoint now
    BEGIN_WEIGHTS_LOAD = "BEGIN_WEIGHTS_LOAD"  # the barrier is held: load the weights now
    BEGIN_ADAPTER_CHANGE = "BEGIN_ADAPTER_CHANGE"  # the barrier is held: change the adapter
    START_MODEL_LOAD = "START_MODEL_LOAD"  # load (or swap to) the named row
    START_MODEL_UNLOAD = "START_MODEL_UNLOAD"  # unload the resident row
    ADMIT = "ADMIT"  # /v1: run the request now
    HOLD_REQUEST = "HOLD_REQUEST"  # /v1: hold the request until released
    RECORD_OVERRUN = "RECORD_OVERRUN"  # a late commit-end (status last_overrun)
    RECORD_WATCHDOG = "RECORD_WATCHDOG"  # the watchdog tore a commit (status commit_overran)
    RECORD_HOLD_TIMEOUT = "RECORD_HOLD_TIMEOUT"  # a hold timed out (last_hold_timeout_at)
    RECORD_STALE = "RECORD_STALE"  # the attachment became stale
    APPLY_SETTINGS = "APPLY_SETTINGS"  # PATCH /api/settings takes effect
    # contract 4b (a quiesce that holds running work):
    PARK_RUNNING = "PARK_RUNNING"  # stop at the next step boundary; park the running sequences
    RESUME_PARKED = "RESUME_PARKED"  # prefill the parked sequences again on today's weights
    END_PARKED_TORN = "END_PARKED_TORN"  # end every parked sequence with 503 WEIGHTS_TORN
    # contract 10 (the process-group transport); nothing for the other transports:
    ARM_RECEIVE = "ARM_RECEIVE"  # commit-begin: post the broadcast from rank 0 into the arena
    DESTROY_GROUP = "DESTROY_GROUP"  # detach, clear-stale, a tear: the attachment's group ends
    # issue 32 item 8: a holder removed without its own detach (clear-stale) is fenced out:
    FENCE_ARENA = "FENCE_ARENA"  # move the served set to fresh storages; graphs follow the move


E = Effect


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: status, code (``None`` for 200) and reason."""

    status: int
    code: ErrorCode | None = None
    reason: str | None = None


OK = Answer(200)

#: Codes whose refusals always carry ``Retry-After``: 409 MODEL_BUSY too, a refusal for as
#: long as a transition, a pause or a drain runs (docs/operations.md; issue 16 item 12).
RETRY_AFTER_CODES: frozenset[ErrorCode] = frozenset(
    {codes.WEIGHTS_TORN, codes.QUEUE_FULL, codes.MODEL_BUSY}
)


@dataclass(frozen=True)
class Refusal:
    """A refusal: its code, reason and status, and which details the message carries.

    ``details`` is one of ``holder`` (the attachment's role, label, state, attached_at),
    ``torn`` (how to recover), ``unsaved`` (served name, unsaved commits, ways forward),
    ``pause`` (which pause holds the barrier), ``busy`` (the barrier, its owner and the weights
    state, as the status route names them), ``catalogue_row`` (the event's catalogue row id and
    the pause that blocks it), ``resident_row`` (the resident's catalogue row: the event's
    ``model_id`` and ``name``) or ``None``. ``message``: this row's own message (``None``: the
    code's and reason's usual one), a template whose ``{fields}`` are filled from
    :func:`message_values`. ``pause``: the pause this refusal names (``None``: the one that
    holds the barrier), for a refusal made before its pause holds it (a weights load's
    checkpoint being checked). ``retry_after``: the answer carries ``Retry-After`` (always for
    :data:`RETRY_AFTER_CODES`).
    """

    code: ErrorCode
    reason: str | None = None
    status: int | None = None
    details: str | None = None
    message: str | None = None
    retry_after: bool = False
    pause: str | None = None

    @property
    def http_status(self) -> int:
        return self.status if self.status is not None else self.code.status

    @property
    def sends_retry_after(self) -> bool:
        """Whether the refusal is answered with ``Retry-After`` (weights page: States, 503
        WEIGHTS_TORN "with Retry-After"; contract 1, 503 QUEUE_FULL; 409 MODEL_BUSY, a refusal
        that ends with the operation in progress)."""
        return self.retry_after or self.code in RETRY_AFTER_CODES


@dataclass(frozen=True)
class Row:
    """One guarded alternative of a trigger. Exactly one of accept / ``refuse`` / ``ignore``."""

    trigger: str
    when: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    set: tuple[tuple[str, object], ...] = ()
    effects: tuple[Effect, ...] = ()
    actions: tuple[str, ...] = ()
    refuse: Refusal | None = None
    ignore: bool = False
    pending: Answer | None = None
    note: str = ""
    id: str = field(default="", compare=False)

    @property
    def kind(self) -> str:
        """``accepted``, ``refused`` or ``ignored``."""
        if self.refuse is not None:
            return "refused"
        return "ignored" if self.ignore else "accepted"

    @property
    def changes(self) -> dict[str, object]:
        return dict(self.set)


# ----------------------------------------------------------------------------------------------
# Builders (keep the rows below readable)


def _accept(
    trigger: str,
    when: tuple[str, ...] = (),
    unless: tuple[str, ...] = (),
    effects: tuple[Effect, ...] = (),
    actions: tuple[str, ...] = (),
    pending: Answer | None = None,
    note: str = "",
    **changes: object,
) -> Row:
    return Row(
        trigger,
        tuple(when),
        tuple(unless),
        tuple(changes.items()),
        tuple(effects),
        tuple(actions),
        None,
        False,
        pending,
        note,
    )


def _refuse(
    trigger: str,
    code: ErrorCode,
    reason: str | None = None,
    when: tuple[str, ...] = (),
    unless: tuple[str, ...] = (),
    status: int | None = None,
    details: str | None = None,
    note: str = "",
    message: str | None = None,
    retry_after: bool = False,
    pause: str | None = None,
) -> Row:
    return Row(
        trigger,
        tuple(when),
        tuple(unless),
        (),
        (),
        (),
        Refusal(code, reason, status, details, message, retry_after, pause),
        False,
        None,
        note,
    )


def _ignore(trigger: str, note: str = "does not apply in this state") -> Row:
    return Row(trigger, (), (), (), (), (), None, True, None, note)


PAUSES = ("save", "weights_load", "adapter")

#: How a refusal's message names who holds the barrier (``{pause_label}``, ``{busy}``).
PAUSE_LABELS: dict[str, str] = {
    "holder": "the attached trainer's quiesce",
    "save": "a checkpoint save (POST /api/weights/save)",
    "weights_load": "a weights load (POST /api/weights/load)",
    "adapter": "an adapter change (/api/weights/adapter)",
}

#: ``{busy}``: why the lifecycle is busy: the weights are writing, else who holds the barrier.
WRITING_BUSY = "the weights are being written (a commit or a weights load is open)"


def message_values(refusal: Refusal, state: object, event: object) -> dict[str, object]:
    """The fields a refusal's message template may name: ``pause`` (the refusal's pause, else
    the barrier's owner), ``pause_label`` (its :data:`PAUSE_LABELS` wording, ``a pause`` when
    nothing holds it), ``busy`` (:data:`WRITING_BUSY` while the weights are writing, else
    ``the weights barrier is held by <pause_label>``), ``name`` and ``model_id`` (the event's
    catalogue row). ``state`` is a :class:`~miserver.fsm.state.LifecycleState`, ``event`` an
    :class:`~miserver.fsm.state.Event`."""
    pause = refusal.pause or getattr(state, "owner", "none")
    label = PAUSE_LABELS.get(pause, "a pause")
    writing = getattr(state, "weights", None) == "writing"
    return {
        "pause": pause,
        "pause_label": label,
        "busy": WRITING_BUSY if writing else f"the weights barrier is held by {label}",
        "name": getattr(event, "name", None),
        "model_id": getattr(event, "model_id", None),
    }


#: The auth checks of each gated route, in order (weights page: Authentication and headers).
#: ``token``: 401 WEIGHTS_UNAUTHORIZED; ``operator``: 403 WEIGHTS_FORBIDDEN for a trainer token;
#: ``attached``: 409 NOT_ATTACHED; ``holder``: 403 NOT_ATTACHMENT_HOLDER; ``trainer_holder``:
#: while attached, a trainer token must be the holder (contract 5: weights load).
ROUTE_AUTH: dict[str, tuple[str, ...]] = {
    "attach": ("token",),
    "detach": ("token", "attached", "holder"),
    "heartbeat": ("token", "attached", "holder"),
    "quiesce": ("token", "attached", "holder"),
    "resume": ("token", "attached", "holder"),
    "commit_begin": ("token", "attached", "holder"),
    "commit_end": ("token", "attached", "holder"),
    "clear_stale": ("token", "operator", "attached"),
    "save": ("token", "attached", "holder"),
    "weights_load": ("token", "trainer_holder"),
}


def _auth_rows(trigger: str) -> list[Row]:
    rows: list[Row] = []
    for check in ROUTE_AUTH[trigger]:
        if check == "token":
            rows.append(_refuse(trigger, codes.WEIGHTS_UNAUTHORIZED, when=("no_valid_token",)))
        elif check == "operator":
            rows.append(_refuse(trigger, codes.WEIGHTS_FORBIDDEN, when=("trainer_token",)))
        elif check == "attached":
            rows.append(_refuse(trigger, codes.NOT_ATTACHED, unless=("attached",)))
        elif check == "holder":
            rows.append(_refuse(trigger, codes.NOT_ATTACHMENT_HOLDER, unless=("caller_is_holder",)))
        elif check == "trainer_holder":
            rows.append(
                _refuse(
                    trigger,
                    codes.NOT_ATTACHMENT_HOLDER,
                    when=("attached", "trainer_token"),
                    unless=("caller_is_holder",),
                )
            )
        else:  # pragma: no cover - a typo in ROUTE_AUTH
            raise ValueError(check)
    return rows


def _pause_refusals(trigger: str, when: tuple[str, ...] = ()) -> list[Row]:
    """409 PAUSE_IN_PROGRESS, reason = which pause holds the barrier."""
    return [
        _refuse(trigger, codes.PAUSE_IN_PROGRESS, p, when=(*when, f"held_by_{p}"), details="pause")
        for p in PAUSES
    ]


def _unavailable_refusals(trigger: str) -> list[Row]:
    """409 BARRIER_UNAVAILABLE, reason cbm or concurrency (weights page: Status)."""
    return [
        _refuse(trigger, codes.BARRIER_UNAVAILABLE, "cbm", when=("pause_cbm",)),
        _refuse(trigger, codes.BARRIER_UNAVAILABLE, "concurrency", when=("pause_concurrency",)),
    ]


def _start_pause(
    trigger: str, owner: str, begin: Effect, *, clears_commit: bool = False
) -> list[Row]:
    """Take the barrier: take over the holder's hold (no drain), or drain from serving."""
    extra: dict[str, object] = {"commit": "none"} if clears_commit else {}
    return [
        _refuse(
            trigger,
            codes.MODEL_BUSY,
            when=("draining",),
            note="the holder's quiesce is still draining; retry when it returns",
        ),
        _accept(
            trigger,
            when=("quiesced", "held_by_holder"),
            effects=(begin, E.DROP_CACHE),
            owner=owner,
            takeover=True,
            hold_armed=False,
            **extra,
            note="takes over the holder's hold; gives it back when done (contract 5, 6)",
        ),
        _accept(
            trigger,
            when=("serving",),
            effects=(E.HOLD_ADMISSIONS, E.START_DRAIN),
            barrier="draining",
            owner=owner,
            drain_armed=True,
            **extra,
        ),
    ]


def _give_back(
    trigger: str,
    owner: str,
    *,
    ok: bool,
    sets: dict[str, object] | None = None,
    actions: tuple[str, ...] = (),
    effects: tuple[Effect, ...] = (),
    when: tuple[str, ...] = (),
    torn_fails: bool = False,
) -> list[Row]:
    """End a pause: give a taken-over hold back (hold timer restarted in full, only while
    clean) or serve again (contract 5, 6).

    ``ok``: the pause's call is answered 200 (else the failure the layer saw); ``sets``: the
    components the completion sets. ``torn_fails``: a completion that finds the set torn (a
    parameter's address moved during the pause) is answered as a failure and records nothing.
    """
    held = ("quiesced", f"held_by_{owner}", *when)
    rows: list[Row] = []
    if torn_fails:
        rows += [
            _accept(
                trigger,
                when=(*held, "torn", "takeover"),
                effects=(E.FAIL_PENDING,),
                owner="holder",
                takeover=False,
                note="the set tore during the pause: a failure; no hold timer while torn",
            ),
            _accept(
                trigger,
                when=(*held, "torn"),
                effects=(E.RELEASE_HELD, E.FAIL_PENDING),
                barrier="serving",
                owner="none",
                note="the set tore during the pause",
            ),
        ]
    answer = (E.ANSWER_PENDING,) if ok else (E.FAIL_PENDING,)
    pending = OK if ok else None
    done = dict(sets or {})
    ends = done.get("weights")
    give = {
        "effects": (*effects, *answer),
        "actions": actions,
        "pending": pending,
        "owner": "holder",
        "takeover": False,
        **done,
    }
    if ends == "clean" or (ends is None and torn_fails):
        rows.append(
            _accept(
                trigger,
                when=(*held, "takeover"),
                hold_armed=True,
                note="hold given back, timer restarted in full",
                **give,
            )
        )
    elif ends == "torn":
        rows.append(
            _accept(
                trigger,
                when=(*held, "takeover"),
                note="given back torn: no hold timer while torn",
                **give,
            )
        )
    else:
        rows += [
            _accept(
                trigger,
                when=(*held, "takeover", "clean"),
                hold_armed=True,
                note="hold given back, timer restarted in full",
                **give,
            ),
            _accept(
                trigger,
                when=(*held, "takeover"),
                note="given back torn: no hold timer while torn",
                **give,
            ),
        ]
    rows.append(
        _accept(
            trigger,
            when=held,
            effects=(*effects, E.RELEASE_HELD, *answer),
            actions=actions,
            pending=pending,
            barrier="serving",
            owner="none",
            **done,
        )
    )
    return rows


def _remove_attachment(trigger: str, *, tears: bool, fences: bool = False) -> list[Row]:
    """Detach (``tears``: a commit still writing becomes torn) or clear-stale (left for the
    watchdog). Weights page: The write cycle; States; Timers. Either ends the attachment's
    process group (contract 10: ``DESTROY_GROUP``; nothing for the other transports).

    ``fences`` (clear-stale: the holder is removed without its own detach, issue 32 item 8):
    every accepted row first moves the served set to fresh storages (``FENCE_ARENA``: the
    removed holder's handles keep mapping the old ones, which nothing serves any more) and
    drops what was computed over the old ones (``DROP_CACHE``), before anything is released."""
    gone: dict[str, object] = {"attachment": "none", "heartbeat_armed": False}
    rows = [
        _accept(
            trigger,
            when=("draining", "held_by_holder"),
            effects=(
                E.CANCEL_DRAIN,
                E.RELEASE_HELD,
                E.RELEASE_EXPORTS,
                E.DESTROY_GROUP,
                E.ANSWER_PENDING,
            ),
            pending=Answer(409, codes.NOT_ATTACHED),
            barrier="serving",
            owner="none",
            drain_armed=False,
            **gone,
            note="the waiting quiesce is answered 409 NOT_ATTACHED",
        ),
    ]
    if tears:
        rows.append(
            _accept(
                trigger,
                when=("writing", "commit_mine"),
                effects=(E.REFUSE_HELD_TORN, E.RELEASE_HELD, E.RELEASE_EXPORTS, E.DESTROY_GROUP),
                weights="torn",
                commit="orphan",
                watchdog_armed=False,
                barrier="serving",
                owner="none",
                **gone,
                note="detach while writing tears the set (weights page: States)",
            )
        )
    else:
        rows.append(
            _accept(
                trigger,
                when=("writing", "commit_mine"),
                effects=(E.RELEASE_EXPORTS, E.DESTROY_GROUP),
                commit="orphan",
                **gone,
                note="a commit still open is left for the watchdog (Timers)",
            )
        )
    rows += [
        _accept(
            trigger,
            when=("takeover",),
            effects=(E.RELEASE_EXPORTS, E.DESTROY_GROUP),
            takeover=False,
            **gone,
            note="the running pause has no hold to give back",
        ),
        _accept(
            trigger,
            when=("held_by_holder", "commit_mine", "torn"),
            effects=(E.RELEASE_HELD, E.RELEASE_EXPORTS, E.DESTROY_GROUP),
            barrier="serving",
            owner="none",
            commit="orphan",
            **gone,
            note="the holder's commit was torn by the watchdog (writing is the row above)",
        ),
        _accept(
            trigger,
            when=("held_by_holder",),
            effects=(E.RELEASE_HELD, E.RELEASE_EXPORTS, E.DESTROY_GROUP),
            barrier="serving",
            owner="none",
            hold_armed=False,
            **gone,
            note="releases a clean quiesce; torn stays torn",
        ),
        _accept(
            trigger,
            when=("commit_mine",),
            effects=(E.RELEASE_EXPORTS, E.DESTROY_GROUP),
            commit="orphan",
            **gone,
        ),
        _accept(trigger, effects=(E.RELEASE_EXPORTS, E.DESTROY_GROUP), **gone),
    ]
    if fences:
        from dataclasses import replace

        fence = (E.FENCE_ARENA, E.DROP_CACHE)
        rows = [replace(row, effects=fence + row.effects) for row in rows]
    return rows


# ----------------------------------------------------------------------------------------------
# The table


def build_rows() -> tuple[Row, ...]:
    """Every row of the production table, per trigger in check order."""
    r: list[Row] = []

    # --- attach (weights page: The write cycle 1; Which models can be attached) -------------
    t = "attach"
    r += _auth_rows(t)
    r += [
        _refuse(t, codes.ALREADY_ATTACHED, when=("attached",), details="holder"),
        _refuse(t, codes.NOT_ATTACHABLE, "model_transition", when=("in_transition",)),
        _refuse(t, codes.NOT_ATTACHABLE, "model_transition", when=("held_by_pause",)),
        _refuse(t, codes.MODEL_NOT_LOADED, unless=("resident",)),
        *[
            _refuse(t, codes.NOT_ATTACHABLE, reason, when=(f"model_{reason}",))
            for reason in ("gguf", "quantized", "dtype", "not_on_gpu", "allocator")
        ],
        _refuse(t, codes.NOT_ATTACHABLE, "continuous_batching_running", when=("pause_cbm",)),
        _refuse(t, codes.NOT_ATTACHABLE, "concurrency", when=("pause_concurrency",)),
        _refuse(t, codes.NOT_ATTACHABLE, "weights_writing", when=("writing",)),
        _accept(
            t,
            effects=(E.EXPORT_HANDLES,),
            actions=("attach",),
            attachment="active",
            heartbeat_armed=True,
            note="attaching to torn is allowed",
        ),
    ]

    # --- detach, heartbeat --------------------------------------------------------------
    r += _auth_rows("detach") + _remove_attachment("detach", tears=True)
    r += _auth_rows("heartbeat") + [
        _accept(
            "heartbeat",
            actions=("heartbeat",),
            attachment="active",
            heartbeat_armed=True,
            note="revives a stale attachment; restarts the staleness window",
        ),
    ]

    # --- quiesce (The write cycle 2) ----------------------------------------------------
    t = "quiesce"
    r += _auth_rows(t) + [
        _refuse(t, codes.WEIGHTS_NOT_CLEAN, unless=("clean",)),
        _refuse(t, codes.ALREADY_QUIESCED, when=("held_by_holder",)),
        *_pause_refusals(t),
        *_unavailable_refusals(t),
        _refuse(t, codes.QUEUE_FULL, when=("queue_full",)),
        _accept(
            t,
            unless=("running_hold",),
            effects=(E.HOLD_ADMISSIONS, E.START_DRAIN),
            barrier="draining",
            owner="holder",
            drain_armed=True,
            note='{"running": "finish"} (the default): the running sequences finish first',
        ),
    ]

    # --- drained / drain_expired (internal completion, timer) ----------------------------
    t = "drained"
    r += [
        _accept(
            t,
            when=("draining", "held_by_holder", "clean"),
            effects=(E.DROP_CACHE, E.ANSWER_PENDING),
            pending=OK,
            barrier="quiesced",
            drain_armed=False,
            hold_armed=True,
            note="quiesce returns 200; the hold timer starts",
        ),
        _accept(
            t,
            when=("draining", "held_by_holder"),
            effects=(E.DROP_CACHE, E.ANSWER_PENDING),
            pending=OK,
            barrier="quiesced",
            drain_armed=False,
            note="the set tore while draining: quiesce returns torn, no hold timer",
        ),
        _accept(
            t,
            when=("draining", "held_by_save"),
            effects=(E.BEGIN_SAVE,),
            barrier="quiesced",
            drain_armed=False,
        ),
        _accept(
            t,
            when=("draining", "held_by_weights_load"),
            effects=(E.DROP_CACHE, E.BEGIN_WEIGHTS_LOAD),
            barrier="quiesced",
            drain_armed=False,
        ),
        _accept(
            t,
            when=("draining", "held_by_adapter"),
            effects=(E.DROP_CACHE, E.BEGIN_ADAPTER_CHANGE),
            barrier="quiesced",
            drain_armed=False,
        ),
        _ignore(t),
    ]
    t = "drain_expired"
    r += [
        _accept(
            t,
            when=("drain_armed",),
            effects=(E.CANCEL_DRAIN, E.RELEASE_HELD, E.ANSWER_PENDING),
            pending=Answer(409, codes.MODEL_BUSY, "drain_timeout"),
            barrier="serving",
            owner="none",
            drain_armed=False,
            note="409 MODEL_BUSY drain_timeout; holds nothing (The write cycle 2)",
        ),
        _ignore(t, "no drain is waiting (a late timer)"),
    ]

    # --- resume (The write cycle 5) -------------------------------------------------------
    t = "resume"
    r += _auth_rows(t) + [
        _refuse(t, codes.NOT_QUIESCED, "quiesce_in_progress", when=("draining", "held_by_holder")),
        *_pause_refusals(t, when=("takeover",)),
        _refuse(
            t,
            codes.WEIGHTS_NOT_CLEAN,
            when=("held_by_holder", "writing"),
            note="a commit is open: commit-end first",
        ),
        _accept(
            t,
            when=("held_by_holder",),
            effects=(E.RELEASE_HELD,),
            barrier="serving",
            owner="none",
            hold_armed=False,
        ),
        _accept(t, note="resume while not holding is a no-op 200"),
    ]

    # --- commit-begin / commit-end (The write cycle 3, 4) ----------------------------------
    t = "commit_begin"
    r += _auth_rows(t) + [
        _refuse(t, codes.NOT_QUIESCED, "quiesce_in_progress", when=("draining", "held_by_holder")),
        _refuse(t, codes.NOT_QUIESCED, unless=("held_by_holder", "takeover")),
        _refuse(t, codes.WEIGHTS_NOT_CLEAN, unless=("clean",)),
        *_pause_refusals(t, when=("takeover",)),
        _refuse(
            t,
            codes.GROUP_UNAVAILABLE,
            when=("group_unusable",),
            note="contract 10: nothing could receive the write; detach and attach again",
        ),
        _accept(
            t,
            effects=(E.ARM_RECEIVE,),
            actions=("begin_commit",),
            weights="writing",
            commit="mine",
            watchdog_armed=True,
            hold_armed=False,
            note="the hold timer is suspended while a commit is open",
        ),
    ]
    t = "commit_end"
    r += _auth_rows(t) + [
        _refuse(t, codes.NO_OPEN_COMMIT, unless=("commit_open",)),
        _refuse(
            t,
            codes.NOT_ATTACHMENT_HOLDER,
            unless=("commit_mine",),
            note="only the attachment that began the commit may end it",
        ),
        _refuse(
            t,
            codes.WEIGHTS_NOT_CLEAN,
            "receive_incomplete",
            when=("receive_incomplete",),
            note="contract 10: the broadcast into the arena did not complete; the watchdog "
            "tears the set (a late commit-end cannot repair it)",
        ),
        _accept(
            t,
            when=("writing",),
            actions=("end_commit",),
            weights="clean",
            commit="none",
            watchdog_armed=False,
            hold_armed=True,
            unsaved=True,
            note="serving stays quiesced; the hold timer restarts in full",
        ),
        _accept(
            t,
            when=("torn", "held_by_holder"),
            actions=("end_commit", "overrun"),
            effects=(E.RECORD_OVERRUN,),
            weights="clean",
            commit="none",
            hold_armed=True,
            unsaved=True,
            note="late commit-end: clean, overran: true",
        ),
        _accept(
            t,
            when=("torn",),
            actions=("end_commit", "overrun"),
            effects=(E.RECORD_OVERRUN,),
            weights="clean",
            commit="none",
            unsaved=True,
            note="late commit-end after a resume",
        ),
    ]

    # --- clear-stale (Timers) -------------------------------------------------------------
    t = "clear_stale"
    r += _auth_rows(t) + [
        _refuse(t, codes.ATTACHMENT_NOT_STALE, when=("active",)),
        *_remove_attachment(t, tears=False, fences=True),
    ]

    # --- timers ---------------------------------------------------------------------------
    t = "hold_expired"
    r += [
        _accept(
            t,
            when=("hold_armed",),
            effects=(E.RELEASE_HELD, E.RECORD_HOLD_TIMEOUT),
            actions=("hold_timeout",),
            barrier="serving",
            owner="none",
            hold_armed=False,
            note="a quiesce left open resumes on its own",
        ),
        _ignore(t, "the hold timer is not armed (a late timer)"),
    ]
    t = "watchdog_expired"
    r += [
        _accept(
            t,
            when=("watchdog_armed", "commit_mine"),
            effects=(E.REFUSE_HELD_TORN, E.RECORD_WATCHDOG, E.DESTROY_GROUP),
            actions=("watchdog",),
            weights="torn",
            watchdog_armed=False,
            note="the holder may still end it late; its hold stays",
        ),
        _accept(
            t,
            when=("watchdog_armed",),
            effects=(E.REFUSE_HELD_TORN, E.RELEASE_HELD, E.RECORD_WATCHDOG, E.DESTROY_GROUP),
            actions=("watchdog",),
            weights="torn",
            watchdog_armed=False,
            barrier="serving",
            owner="none",
            note="an orphaned commit tears; nobody holds",
        ),
        _ignore(t, "no commit is open (a late timer)"),
    ]
    t = "heartbeat_lapsed"
    r += [
        _accept(
            t,
            when=("heartbeat_armed",),
            effects=(E.RECORD_STALE,),
            actions=("stale",),
            attachment="stale",
            heartbeat_armed=False,
            note="stale changes nothing about serving",
        ),
        _ignore(t, "no active attachment (a late timer)"),
    ]

    # --- save (contract 5) ----------------------------------------------------------------
    t = "save"
    auth = _auth_rows(t)
    r += auth[:1] + [_gguf_unsupported(t, "save")] + auth[1:]
    r += [
        _refuse(t, codes.WEIGHTS_NOT_CLEAN, unless=("clean",)),
        *_pause_refusals(t),
        *_unavailable_refusals(t),
        *_start_pause(t, "save", E.BEGIN_SAVE),
    ]
    r += [
        *_give_back(
            "save_done",
            "save",
            ok=True,
            sets={"unsaved": False},
            actions=("save",),
            torn_fails=True,
        ),
        _ignore("save_done", "no save holds the barrier"),
        *_give_back("save_failed", "save", ok=False),
        _ignore("save_failed", "no save holds the barrier"),
    ]

    # --- weights load (contract 5) ----------------------------------------------------------
    t = "weights_load"
    r += _auth_rows(t) + [
        _refuse(t, codes.MODEL_BUSY, "model_transition", when=("in_transition",)),
        _refuse(t, codes.MODEL_NOT_LOADED, unless=("resident",)),
        _gguf_unsupported(t, "weights_load", when=("checkpoint_load",)),
        _refuse(t, codes.WEIGHTS_NOT_CLEAN, when=("writing",), note="a commit is open"),
        *_pause_refusals(t),
        *_unavailable_refusals(t),
        _refuse(
            t,
            codes.ALREADY_ATTACHED,
            when=("attached",),
            unless=("in_place",),
            details="holder",
            note="a full reload is refused while attached",
        ),
        *_start_pause(t, "weights_load", E.BEGIN_WEIGHTS_LOAD, clears_commit=True),
    ]
    t = "weights_load_write"
    r += [
        _accept(
            t, when=("quiesced", "held_by_weights_load"), unless=("writing",), weights="writing"
        ),
        _ignore(t, "no weights load holds the barrier"),
    ]
    loaded = {"weights": "clean", "unsaved": False, "adapter": False}
    r += [
        *_give_back(
            "weights_load_done",
            "weights_load",
            ok=True,
            sets=loaded,
            when=("writing",),
            actions=("load",),
            effects=(E.DROP_CACHE,),
        ),
        _ignore("weights_load_done", "no weights load is writing"),
        *_give_back(
            "weights_load_failed",
            "weights_load",
            ok=False,
            sets={"weights": "torn"},
            when=("writing",),
            effects=(E.REFUSE_HELD_TORN, E.DESTROY_GROUP),
        ),
        *_give_back("weights_load_failed", "weights_load", ok=False),
        _ignore("weights_load_failed", "no weights load holds the barrier"),
    ]

    # --- adapter change (contract 6) -----------------------------------------------------
    t = "adapter_change"
    r += [
        _refuse(t, codes.MODEL_BUSY, "model_transition", when=("in_transition",)),
        _refuse(t, codes.MODEL_NOT_LOADED, unless=("resident",)),
        _gguf_unsupported(t, "adapter"),
        _refuse(t, codes.WEIGHTS_NOT_CLEAN, unless=("clean",)),
        *_pause_refusals(t),
        *_unavailable_refusals(t),
        *_start_pause(t, "adapter", E.BEGIN_ADAPTER_CHANGE),
    ]
    r += [
        *_give_back(
            "adapter_done",
            "adapter",
            ok=True,
            sets={"adapter": True},
            when=("applies_adapter",),
            actions=("adapter",),
            effects=(E.DROP_CACHE,),
            torn_fails=True,
        ),
        *_give_back(
            "adapter_done",
            "adapter",
            ok=True,
            sets={"adapter": False},
            actions=("adapter",),
            effects=(E.DROP_CACHE,),
            torn_fails=True,
        ),
        _ignore("adapter_done", "no adapter change holds the barrier"),
        *_give_back("adapter_failed", "adapter", ok=False),
        _ignore("adapter_failed", "no adapter change holds the barrier"),
    ]

    # --- model load / unload / swap (contract 3) -----------------------------------------
    for t, start in (("model_load", E.START_MODEL_LOAD), ("model_unload", E.START_MODEL_UNLOAD)):
        r += [
            _refuse(t, codes.ALREADY_ATTACHED, when=("attached",), details="holder"),
            _refuse(t, codes.MODEL_BUSY, "model_transition", when=("in_transition",)),
            _refuse(t, codes.MODEL_BUSY, "model_transition", when=("held_by_pause",)),
        ]
        if t == "model_load":
            r += [
                _accept(
                    t,
                    when=("resident", "targets_resident"),
                    note="loading the resident row is a no-op 200; torn stays torn",
                ),
                _refuse(t, codes.WEIGHTS_TORN, when=("torn",), details="torn"),
            ]
        else:
            r.append(_refuse(t, codes.MODEL_NOT_LOADED, unless=("resident",), status=409))
        r += [
            _refuse(
                t,
                codes.MODEL_BUSY,
                when=("writing",),
                note="a cleared holder's commit is still open; the watchdog decides",
            ),
            _accept(t, effects=(start,), transition="load" if t == "model_load" else "unload"),
        ]
    fresh = {
        "weights": "clean",
        "commit": "none",
        "unsaved": False,
        "adapter": False,
        "transition": "none",
    }
    r += [
        _accept(
            "transition_done",
            when=("loading",),
            effects=(E.DROP_CACHE,),
            actions=("load",),
            resident=True,
            **fresh,
        ),
        _accept(
            "transition_done",
            when=("unloading",),
            actions=("unload",),
            resident=False,
            **fresh,
            note="nothing resident is clean by construction",
        ),
        _ignore("transition_done", "no model transition is in progress"),
        _accept(
            "transition_failed",
            when=("loading", "kept_resident"),
            transition="none",
            note="the host refused before it dropped the resident: nothing changed",
        ),
        _accept(
            "transition_failed",
            when=("loading", "reloaded_previous"),
            effects=(E.DROP_CACHE,),
            actions=("load",),
            resident=True,
            **fresh,
            note="the load failed after the previous model was dropped, and the host loaded "
            "that row back from its files: it is resident afresh (breaker finding F16)",
        ),
        _accept(
            "transition_failed",
            when=("loading",),
            actions=("unload",),
            resident=False,
            **fresh,
            note="a failed load or swap leaves nothing resident",
        ),
        _accept("transition_failed", when=("unloading",), transition="none"),
        _ignore("transition_failed", "no model transition is in progress"),
        # A load, swap or unload first drains the generations running on the resident (the
        # scheduler takes every slot, holding new ones), so two models are never in memory at
        # once and no running generation loses its model; a drain longer than
        # WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S abandons the transition with nothing changed.
        _accept(
            "transition_abandoned",
            when=("in_transition",),
            pending=Answer(409, codes.MODEL_BUSY, "drain_timeout"),
            transition="none",
            note="the running generations did not finish within the drain timeout: "
            "409 MODEL_BUSY drain_timeout, nothing loaded or unloaded",
        ),
        _ignore("transition_abandoned", "no model transition is in progress"),
    ]

    # --- settings change (contract 1: PATCH /api/settings) -----------------------------------
    t = "settings_change"
    r += [
        _refuse(
            t,
            codes.MODEL_BUSY,
            unless=("serving",),
            details="busy",
            message="Serving settings cannot change while {busy}. Retry once it is released "
            "(GET /api/weights/status shows barrier: serving and weights_state: clean).",
            note="refused while the barrier is held or weights are writing",
        ),
        *[
            _accept(t, when=(f"sets_avail_{a}",), effects=(E.APPLY_SETTINGS,), avail=a)
            for a in ("ok", "cbm", "concurrency")
        ],
    ]

    # --- /v1 admission (contract 4; weights page: States, Unsaved commits) -----------------
    t = "v1"
    res = ("resident", "targets_resident")
    r += [
        _refuse(t, codes.WEIGHTS_TORN, when=(*res, "torn"), details="torn"),
        _refuse(t, codes.MODEL_BUSY, "model_transition", when=(*res, "in_transition")),
        _refuse(t, codes.QUEUE_FULL, when=(*res, "queue_full"), unless=("serving",)),
        _accept(
            t,
            when=res,
            unless=("serving",),
            effects=(E.HOLD_REQUEST,),
            note="held while draining, quiesced or writing; also through a weights load's "
            "full reload (admitted again once the model is made; issue 32 item 2)",
        ),
        _accept(t, when=res, effects=(E.ADMIT,)),
        _refuse(t, codes.MODEL_NOT_LOADED, when=("refuse_policy",), status=409),
        _refuse(t, codes.ALREADY_ATTACHED, when=("attached",), details="holder"),
        _refuse(t, codes.WEIGHTS_TORN, when=("torn",), details="torn"),
        _refuse(
            t,
            codes.MODEL_BUSY,
            "model_transition",
            when=("in_transition",),
            note="before unsaved: a running load or unload is discarding the commits already "
            "(an explicit operator load, never refused for them), so save is no way forward",
        ),
        _refuse(t, codes.WEIGHTS_UNSAVED, when=("unsaved",), details="unsaved"),
        _refuse(t, codes.MODEL_BUSY, "model_transition", when=("held_by_pause",)),
        _refuse(t, codes.MODEL_BUSY, unless=("serving",)),
        _accept(
            t,
            effects=(E.START_MODEL_LOAD, E.HOLD_REQUEST),
            transition="load",
            note="auto-load (a swap when another model is resident)",
        ),
    ]

    # --- /v1: a request that waited goes on (contract 4; weights page: States) -------------
    # Sent when a /v1 request that was admitted (v1 above) has waited, for its auto-load or
    # for its scheduler slot, and is about to go on; `same_resident` says whether the model it
    # was admitted for is still the resident. Not the `v1` trigger: with nothing resident or
    # another model resident, the `v1` rows would start an auto-load from inside a slot.
    t = "v1_confirm"
    r += [
        _refuse(
            t,
            codes.MODEL_BUSY,
            "model_transition",
            unless=("same_resident",),
            message="The model was unloaded or changed while the request waited; retry.",
            retry_after=True,
            note="a model transition ran while the request waited; the retry is admitted anew",
        ),
        _refuse(t, codes.WEIGHTS_TORN, when=("torn",), details="torn"),
        _refuse(t, codes.MODEL_BUSY, "model_transition", when=("in_transition",)),
        _accept(
            t,
            unless=("serving",),
            note="a pause began while it waited: in its slot the drain waits for it, before "
            "its slot the scheduler holds it",
        ),
        _accept(t, effects=(E.ADMIT,)),
    ]

    # --- a parameter's address moved (weights page: States) ------------------------------
    t = "address_moved"
    r += [
        _accept(
            t,
            when=("attached", "commit_open"),
            effects=(E.REFUSE_HELD_TORN, E.DESTROY_GROUP),
            weights="torn",
            commit="orphan",
            watchdog_armed=False,
            hold_armed=False,
            note="no late commit-end can repair moved storage",
        ),
        _accept(
            t,
            when=("attached",),
            effects=(E.REFUSE_HELD_TORN, E.DESTROY_GROUP),
            weights="torn",
            hold_armed=False,
        ),
        _ignore(t, "nothing is exported"),
    ]

    # --- catalogue DELETE (contract 3: 409 MODEL_BUSY while a weights load or save runs) -----
    # A weights load reads its checkpoint's folder (or its row's files) inside the pause, and
    # checks it before (the runtime says so: `checking_load`); a save registers a row whose
    # parent is the base row. Appended last so that no earlier row's id moves.
    t = "catalogue_delete"
    busy = (
        "catalogue row {name!r} (id {model_id}) cannot be deleted while {pause_label} is in "
        "progress: it reads or registers catalogue rows and their folders. Retry when it "
        "finishes (GET /api/weights/status shows barrier: serving)."
    )
    r += [
        *[
            _refuse(
                t,
                codes.MODEL_BUSY,
                "model_transition",
                when=(f"held_by_{p}",),
                details="catalogue_row",
                message=busy,
                pause=p,
                note=f"the {p.replace('_', ' ')} holds the barrier, its drain included",
            )
            for p in ("weights_load", "save")
        ],
        _refuse(
            t,
            codes.MODEL_BUSY,
            "model_transition",
            when=("checking_load",),
            details="catalogue_row",
            message=busy,
            pause="weights_load",
            note="a weights load's checkpoint is being checked, before its pause",
        ),
        _accept(t, note="the handler deletes the row (no lifecycle state changes)"),
    ]

    # --- quiesce {"running": "hold"} (contract 4b) -----------------------------------------
    # Appended last so that no earlier row's id moves. The quiesce rows above check every
    # refusal first, in the weights page's order, and their accepted row is the finish
    # variant's (``unless running_hold``): so every refusal of quiesce applies to both
    # variants, and a hold's own refusal comes after them. Where the parked sequences go when
    # the hold ends is :func:`_parked_variant`'s rule.
    t = "quiesce"
    r += [
        _refuse(
            t,
            codes.BARRIER_UNAVAILABLE,
            "hold_unsupported",
            when=("running_hold", "hold_unsupported"),
            note="the resident's engine cannot park running sequences: a hold is refused, "
            "never faked by a drain",
        ),
        _accept(
            t,
            effects=(E.HOLD_ADMISSIONS, E.PARK_RUNNING, E.START_DRAIN),
            barrier="draining",
            owner="holder",
            drain_armed=True,
            parked=True,
            note='{"running": "hold"}: the engine stops at the next step boundary and parks '
            "the running sequences; the drain ends with that step (drained drops their cache)",
        ),
    ]

    # --- the fence could not move the set (issue 32 item 8) --------------------------------
    # FENCE_ARENA found no room for the fresh copy (a card without space for a second set):
    # the removed holder's handles still reach the served storages, so they are not served.
    # Appended last so that no earlier row's id moves.
    t = "fence_failed"
    r += [
        _accept(
            t,
            when=("resident",),
            unless=("attached", "writing", "in_transition"),
            effects=(E.REFUSE_HELD_TORN, E.DESTROY_GROUP),
            weights="torn",
            note='recover with a {"model_id": N} reload (fresh storages) or a restart',
        ),
        _ignore(
            t,
            "nothing is resident, a holder or a model transition came since, or the removed "
            "holder's commit is still open (writing: the watchdog tears it)",
        ),
    ]
    # Row ids never move (the mutation sweep's equivalents name them): the rows that were
    # there before a row was inserted among its trigger's alternatives keep their numbers, and
    # an inserted row (marked with :data:`_INSERTED`) takes the next free number.
    first = [row for row in r if row.id != _INSERTED]
    later = [row for row in r if row.id == _INSERTED]
    ids = {id(row): n for n, row in enumerate([*first, *later])}
    table: list[Row] = []
    for row in r:
        row = _with_id(row, ids[id(row)])
        parked = _parked_variant(row)
        if parked is not None:
            table.append(parked)
        table.append(row)
    return tuple(table)


def _parked_variant(row: Row) -> Row | None:
    """Contract 4b: the parked sequences follow the held requests. Before every row that
    answers the held requests 503 WEIGHTS_TORN, or releases them, comes its variant for a hold
    that parked running sequences (guard ``parked``, id ``<row>.parked``): the same row, and a
    tear also ends every parked sequence with that error (``END_PARKED_TORN``: nothing
    computed on a torn set is served), a release first continues them (``RESUME_PARKED``,
    before ``RELEASE_HELD``: they were admitted first), each prefilled again on the weights of
    that time. Either leaves nothing parked. ``None`` for a row that does neither, or that
    fires only on a torn set."""
    from dataclasses import replace

    effects = row.effects
    if "torn" in row.when:  # nothing is parked on a torn set: the tear ended it
        return None
    if E.REFUSE_HELD_TORN in effects:
        at = effects.index(E.REFUSE_HELD_TORN) + 1
        effects = (*effects[:at], E.END_PARKED_TORN, *effects[at:])
        note = "parked sequences end with 503 WEIGHTS_TORN"
    elif E.RELEASE_HELD in effects:
        at = effects.index(E.RELEASE_HELD)
        effects = (*effects[:at], E.RESUME_PARKED, *effects[at:])
        note = "parked sequences continue, prefilled again"
    else:
        return None
    return replace(
        row,
        when=(*row.when, "parked"),
        effects=effects,
        set=(*row.set, ("parked", False)),
        note=f"{row.note}; {note}" if row.note else note,
        id=f"{row.id}.parked",
    )


#: The id :func:`_gguf_unsupported` gives a row inserted among its trigger's alternatives, until
#: :func:`build_rows` numbers it after every row that was there before.
_INSERTED = "inserted"


def _gguf_unsupported(trigger: str, reason: str, when: tuple[str, ...] = ()) -> Row:
    """400 GGUF_UNSUPPORTED ``reason`` on a GGUF resident (contract 4a): llama.cpp holds its
    weights, quantized, not torch tensors miserver could save, write in place or wrap with an
    adapter. Inserted where its trigger checks it (the caller's token first; for a weights
    load and an adapter change, after a transition and nothing resident, as attach checks its
    ``gguf`` reason), so it takes an id after every row that was there before."""
    from dataclasses import replace

    what = {
        "save": "saved as a checkpoint",
        "weights_load": "overwritten in place by a checkpoint",
        "adapter": "given a LoRA adapter",
    }[reason]
    row = _refuse(
        trigger,
        codes.GGUF_UNSUPPORTED,
        reason,
        when=("resident_gguf", *when),
        details="resident_row",
        message="The resident model {name!r} (catalogue row {model_id}) is a GGUF file served "
        f"by llama.cpp, which holds its weights: they cannot be {what}. Load a safetensors row "
        "first (POST /api/models/{{id}}/load).",
        note="what llama.cpp serves cannot be reached from miserver (contract 4a)",
    )
    return replace(row, id=_INSERTED)


def _with_id(row: Row, n: int) -> Row:
    from dataclasses import replace

    return replace(row, id=f"{row.trigger}#{n}")


TABLE: tuple[Row, ...] = build_rows()

#: Every trigger, in table order.
TRIGGERS: tuple[str, ...] = tuple(dict.fromkeys(row.trigger for row in TABLE))


def fingerprint(table: tuple[Row, ...] = TABLE) -> str:
    """A short hash of ``table`` (every row with its id), so that a result computed for one
    table (the mutation sweep in docs/state-machine-mutants.json) can tell it is stale."""
    import hashlib

    text = "\n".join(repr((row.id, row)) for row in table)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def rows_for(trigger: str, table: tuple[Row, ...] = TABLE) -> tuple[Row, ...]:
    """The ordered alternatives of ``trigger``."""
    return tuple(row for row in table if row.trigger == trigger)


def check_order(trigger: str, table: tuple[Row, ...] = TABLE) -> tuple[tuple[str, str | None], ...]:
    """The refusals of ``trigger`` in the order they are checked: ``(code, reason)`` pairs
    (a pair repeated by consecutive rows, for different guards, is listed once)."""
    seen: list[tuple[str, str | None]] = []
    for row in rows_for(trigger, table):
        if row.refuse is not None:
            pair = (row.refuse.code.name, row.refuse.reason)
            if not seen or seen[-1] != pair:
                seen.append(pair)
    return tuple(seen)
