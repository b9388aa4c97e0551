"""An independent reference model of the weights lifecycle, written straight from the spec's
sentences (weights page; companion contract 1, 3-6), route by route, with concrete times.

It shares nothing with ``miserver.fsm`` except the code names: no table, no guards, no
product states. Where the spec is silent it follows the decisions recorded in
docs/state-machine.md (the quoted sentence or decision is next to each branch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PAUSES = ("save", "weights_load", "adapter")


@dataclass
class Reply:
    """``kind`` accepted/refused/ignored; for a refusal its status, code and reason; ``pending``
    the answer given to a call waiting on a pause; ``admission`` serve/hold/autoload on /v1,
    serve/goes_on for a /v1 request that waited (``v1_confirm``)."""

    kind: str
    status: int = 200
    code: str | None = None
    reason: str | None = None
    pending: tuple[int, str | None, str | None] | None = None
    admission: str | None = None
    details: dict[str, object] | None = None  # compared with the core's when given


def refused(status: int, code: str, reason: str | None = None) -> Reply:
    return Reply("refused", status, code, reason)


OK = Reply("accepted")
IGNORED = Reply("ignored")


@dataclass
class Attachment:
    id: str
    label: str
    role: str
    state: str = "active"


@dataclass
class Commit:
    by: str | None  # the attachment that began it; None once that attachment is gone
    began: float
    timed_out: bool = False  # the watchdog tore it (status commit.overran)


@dataclass
class Reference:
    hold_s: float = 5.0
    watchdog_s: float = 0.8
    heartbeat_s: float = 30.0
    drain_s: float = 60.0
    resident: bool = False
    weights: str = "clean"
    barrier: str = "serving"  # serving | draining | quiesced
    pause: str | None = None  # holder | save | weights_load | adapter
    taken_over: bool = False
    att: Attachment | None = None
    commit: Commit | None = None
    transition: str | None = None
    steps: int | None = None
    saved: int = 0
    adapter: bool = False
    avail: str = "ok"
    deadlines: dict[str, float] = field(default_factory=dict)
    ids: int = 0
    # What the serving layer is told to do, as far as the spec says (compared with the core's
    # effects by tests/model/stateful.py): ``version`` counts changes of the weights a request
    # would be computed on (a commit begins, a weights load writes, an adapter change applies,
    # a model load completes); ``records`` the status records made (``watchdog``,
    # ``hold_timeout``, ``stale``, ``overrun``); ``answered`` / ``failed`` how many waiting
    # calls (a quiesce's drain, a pause) were answered, successfully or with a failure.
    version: int = 0
    records: list[str] = field(default_factory=list)
    answered: int = 0
    failed: int = 0
    # Contract 4b: the holder's quiesce was a hold, so the running sequences are parked;
    # ``resumed`` / ``ended`` count the holds whose parked sequences continued or were ended
    # by a tear ("a tear ends parked sequences as it ends held requests").
    parked: bool = False
    resumed: int = 0
    ended: int = 0

    # --- helpers ----------------------------------------------------------------------
    def unsaved(self) -> int:
        return (self.steps or 0) - self.saved

    def _auth(self, caller, route: str) -> Reply | None:
        """Weights page, Authentication and headers: token (401), role (403), nothing attached
        (409), attachment ID or label (403), then the state checks."""
        if caller.token not in ("trainer", "operator"):
            return refused(401, "WEIGHTS_UNAUTHORIZED")
        if route == "clear_stale" and caller.token != "operator":
            return refused(403, "WEIGHTS_FORBIDDEN")  # "operator token only"
        holder = (
            self.att is not None
            and caller.label == self.att.label
            and caller.attachment_id == self.att.id
        )
        if route == "weights_load":
            # contract 5: "while attached, a trainer token must be the holder"
            if self.att is not None and caller.token == "trainer" and not holder:
                return refused(403, "NOT_ATTACHMENT_HOLDER")
            return None
        if route == "attach":
            return None
        if self.att is None:
            return refused(409, "NOT_ATTACHED")
        if route != "clear_stale" and not holder:
            return refused(403, "NOT_ATTACHMENT_HOLDER")
        return None

    def _arm(self, name: str, now: float, seconds: float) -> None:
        self.deadlines[name] = now + seconds

    def _disarm(self, name: str) -> None:
        self.deadlines.pop(name, None)

    def _tear(self) -> None:
        """The set becomes torn; parked sequences end with it (contract 4b)."""
        self.weights = "torn"
        if self.parked:
            self.parked, self.ended = False, self.ended + 1

    def _serve_again(self) -> None:
        if self.parked:  # contract 4b: "a resume continues them"
            self.parked, self.resumed = False, self.resumed + 1
        self.barrier, self.pause = "serving", None
        self._disarm("hold")
        self._disarm("drain")

    def _give_back(self, now: float) -> None:
        """Contract 5/6: a save or adapter change that took over the holder's hold gives it
        back with the hold timer restarted (the timer runs only while clean)."""
        if self.taken_over:
            self.pause, self.taken_over = "holder", False
            if self.weights == "clean":
                self._arm("hold", now, self.hold_s)
        else:
            self._serve_again()

    def _busy_pause(self) -> Reply | None:
        if self.pause in PAUSES:
            return refused(409, "PAUSE_IN_PROGRESS", self.pause)
        return None

    def _unavailable(self) -> Reply | None:
        if self.avail != "ok":
            return refused(409, "BARRIER_UNAVAILABLE", self.avail)
        return None

    def _take_barrier(self, owner: str, now: float) -> Reply:
        if self.barrier == "draining":
            return refused(409, "MODEL_BUSY")  # decision: the holder's quiesce still drains
        if self.pause == "holder":  # quiesced: take over the holder's hold
            self.pause, self.taken_over = owner, True
            self._disarm("hold")
        else:
            self.barrier, self.pause = "draining", owner
            self._arm("drain", now, self.drain_s)
        return OK

    def _drop_attachment(self, tears: bool) -> Reply:
        """Detach (tears a commit still writing) and clear-stale (leaves it to the watchdog)."""
        att = self.att
        assert att is not None
        reply = OK
        mine = self.commit is not None and self.commit.by == att.id
        if self.barrier == "draining" and self.pause == "holder":
            self._serve_again()
            self.answered += 1  # the waiting quiesce is answered 409 NOT_ATTACHED
            reply = Reply("accepted", pending=(409, "NOT_ATTACHED", None))
        elif self.weights == "writing" and mine:
            if tears:  # States: torn is entered by "detach while writing"
                self._tear()
                self._disarm("watchdog")
                self._serve_again()
            # Timers: "a commit still open is left for the watchdog"
        elif self.taken_over:
            self.taken_over = False
        elif self.pause == "holder":  # "Clearing releases a clean quiesce"
            self._serve_again()
        if self.commit is not None and mine:
            self.commit.by = None
        self.att = None
        self._disarm("heartbeat")
        return reply

    # --- gated routes -------------------------------------------------------------------
    def attach(self, caller, now: float, not_attachable: str | None = None) -> Reply:
        if r := self._auth(caller, "attach"):
            return r
        if self.att is not None:
            return refused(409, "ALREADY_ATTACHED")
        if self.transition is not None or self.pause in PAUSES:
            return refused(400, "NOT_ATTACHABLE", "model_transition")
        if not self.resident:
            return refused(400, "MODEL_NOT_LOADED")
        if not_attachable:
            return refused(400, "NOT_ATTACHABLE", not_attachable)
        if self.avail == "cbm":
            return refused(400, "NOT_ATTACHABLE", "continuous_batching_running")
        if self.avail == "concurrency":
            return refused(400, "NOT_ATTACHABLE", "concurrency")
        if self.weights == "writing":
            return refused(400, "NOT_ATTACHABLE", "weights_writing")
        self.ids += 1
        self.att = Attachment(f"att-{self.ids}", caller.label, caller.token)
        self._arm("heartbeat", now, self.heartbeat_s)
        return OK

    def detach(self, caller, now: float) -> Reply:
        if r := self._auth(caller, "detach"):
            return r
        return self._drop_attachment(tears=True)

    def heartbeat(self, caller, now: float) -> Reply:
        if r := self._auth(caller, "heartbeat"):
            return r
        assert self.att is not None
        self.att.state = "active"  # "A heartbeat from the same attachment revives it"
        self._arm("heartbeat", now, self.heartbeat_s)
        return OK

    def quiesce(
        self,
        caller,
        now: float,
        queue_full: bool = False,
        running: str = "finish",
        hold_supported: bool = True,
    ) -> Reply:
        if r := self._auth(caller, "quiesce"):
            return r
        if self.weights != "clean":
            return refused(409, "WEIGHTS_NOT_CLEAN")
        if self.pause == "holder":
            return refused(409, "ALREADY_QUIESCED")
        if r := self._busy_pause() or self._unavailable():
            return r
        if queue_full:
            return refused(503, "QUEUE_FULL")
        # contract 4b: "every refusal of quiesce applies to it in the weights page's order";
        # a hold the engine cannot make is refused, never made a drain
        if running == "hold" and not hold_supported:
            return refused(409, "BARRIER_UNAVAILABLE", "hold_unsupported")
        self.parked = running == "hold"
        self.barrier, self.pause = "draining", "holder"
        self._arm("drain", now, self.drain_s)
        return OK

    def resume(self, caller, now: float) -> Reply:
        if r := self._auth(caller, "resume"):
            return r
        if self.pause == "holder" and self.barrier == "draining":
            return refused(409, "NOT_QUIESCED", "quiesce_in_progress")
        if self.taken_over:
            return refused(409, "PAUSE_IN_PROGRESS", self.pause)
        if self.pause == "holder":
            if self.weights == "writing":
                return refused(409, "WEIGHTS_NOT_CLEAN")  # decision: commit-end first
            self._serve_again()
        return OK  # "Resume while serving is a no-op 200"

    def commit_begin(self, caller, now: float) -> Reply:
        if r := self._auth(caller, "commit_begin"):
            return r
        if self.pause == "holder" and self.barrier == "draining":
            return refused(409, "NOT_QUIESCED", "quiesce_in_progress")
        if self.pause != "holder" and not self.taken_over:
            return refused(409, "NOT_QUIESCED")
        if self.weights != "clean":
            return refused(409, "WEIGHTS_NOT_CLEAN")
        if self.taken_over:
            return refused(409, "PAUSE_IN_PROGRESS", self.pause)
        assert self.att is not None
        self.weights = "writing"
        self.version += 1
        self.commit = Commit(self.att.id, now)
        self._arm("watchdog", now, self.watchdog_s)
        self._disarm("hold")  # "Suspended while a commit is open"
        return OK

    def commit_end(self, caller, now: float) -> Reply:
        if r := self._auth(caller, "commit_end"):
            return r
        assert self.att is not None
        if self.commit is None:
            return refused(409, "NO_OPEN_COMMIT")
        if self.commit.by != self.att.id:
            return refused(403, "NOT_ATTACHMENT_HOLDER")
        if self.weights == "torn":
            self.records.append("overrun")  # Timers: "recorded in last_overrun"
        # writing: clean again; torn: "a late commit-end ... (recorded as an overrun)"
        self.weights = "clean"
        self.commit = None
        self.steps = (self.steps or 0) + 1
        self._disarm("watchdog")
        if self.pause == "holder" and self.barrier == "quiesced":
            self._arm("hold", now, self.hold_s)  # "the hold timer restarts in full"
        return OK

    def clear_stale(self, caller, now: float) -> Reply:
        if r := self._auth(caller, "clear_stale"):
            return r
        assert self.att is not None
        if self.att.state == "active":
            return refused(409, "ATTACHMENT_NOT_STALE")
        return self._drop_attachment(tears=False)

    def save(self, caller, now: float, gguf: bool = False) -> Reply:
        # contract 4a: a GGUF resident is never saved; refused once the token is valid (no
        # attachment could make it possible: attach is refused gguf)
        if gguf and self.resident and caller.token in ("trainer", "operator"):
            return refused(400, "GGUF_UNSUPPORTED", "save")
        if r := self._auth(caller, "save"):
            return r
        if self.weights != "clean":
            return refused(409, "WEIGHTS_NOT_CLEAN")
        if r := self._busy_pause() or self._unavailable():
            return r
        return self._take_barrier("save", now)

    def weights_load(
        self, caller, now: float, in_place: bool = True, gguf: bool = False, checkpoint: bool = True
    ) -> Reply:
        if r := self._auth(caller, "weights_load"):
            return r
        if self.transition is not None:
            return refused(409, "MODEL_BUSY", "model_transition")
        if not self.resident:
            return refused(400, "MODEL_NOT_LOADED")
        if gguf and checkpoint:  # contract 4a; a {"model_id": N} reload goes on
            return refused(400, "GGUF_UNSUPPORTED", "weights_load")
        if self.weights == "writing":
            return refused(409, "WEIGHTS_NOT_CLEAN")  # "Refused while a commit is open"
        if r := self._busy_pause() or self._unavailable():
            return r
        if self.att is not None and not in_place:
            return refused(409, "ALREADY_ATTACHED")  # a full reload while attached
        reply = self._take_barrier("weights_load", now)
        if reply.kind == "accepted":
            self.commit = None  # the load replaces whatever a torn commit left
        return reply

    # --- management and /v1 -------------------------------------------------------------
    def adapter_change(self, now: float, gguf: bool = False) -> Reply:
        if self.transition is not None:
            return refused(409, "MODEL_BUSY", "model_transition")
        if not self.resident:
            return refused(400, "MODEL_NOT_LOADED")
        if gguf:  # contract 4a
            return refused(400, "GGUF_UNSUPPORTED", "adapter")
        if self.weights != "clean":
            return refused(409, "WEIGHTS_NOT_CLEAN")
        if r := self._busy_pause() or self._unavailable():
            return r
        return self._take_barrier("adapter", now)

    def model_load(self, now: float, target: str) -> Reply:
        if self.att is not None:
            return refused(409, "ALREADY_ATTACHED")  # "stale or not"
        if self.transition is not None or self.pause in PAUSES:
            return refused(409, "MODEL_BUSY", "model_transition")
        if self.resident and target == "resident":
            return OK  # "Loading the resident row is a no-op 200 that leaves a torn set torn"
        if self.weights == "torn":
            return refused(503, "WEIGHTS_TORN")
        if self.weights == "writing":
            return refused(409, "MODEL_BUSY")
        self.transition = "load"
        return OK

    def model_unload(self, now: float) -> Reply:
        if self.att is not None:
            return refused(409, "ALREADY_ATTACHED")
        if self.transition is not None or self.pause in PAUSES:
            return refused(409, "MODEL_BUSY", "model_transition")
        if not self.resident:
            # the management API answers an unload with nothing resident 409 (http/management)
            return refused(409, "MODEL_NOT_LOADED")
        if self.weights == "writing":
            return refused(409, "MODEL_BUSY")
        self.transition = "unload"  # "A management unload is allowed" while torn
        return OK

    def settings_change(self, now: float, avail: str) -> Reply:
        if self.barrier != "serving" or self.weights == "writing":
            reply = refused(409, "MODEL_BUSY")  # contract 1
            reply.details = {  # what holds it, in the status route's names
                "barrier": "serving" if self.barrier == "serving" else "quiesced",
                "pause_owner": self.pause,
                "weights_state": self.weights,
            }
            return reply
        self.avail = avail
        return OK

    def catalogue_delete(self, now: float, checking: bool, row_id: int) -> Reply:
        """Contract 3: a catalogue row is not deleted (409 MODEL_BUSY model_transition) while a
        weights load (it reads its checkpoint's folder; also while it checks the checkpoint,
        before its pause) or a save (it registers a row) runs; ``details`` name the row and
        the pause."""
        pause = self.pause if self.pause in ("weights_load", "save") else None
        if pause is None and checking:
            pause = "weights_load"
        if pause is None:
            return OK
        reply = refused(409, "MODEL_BUSY", "model_transition")
        reply.details = {"model_id": row_id, "pause_owner": pause}
        return reply

    def v1(self, now: float, target: str, refuse_policy: bool, queue_full: bool) -> Reply:
        if self.resident and target == "resident":
            if self.weights == "torn":
                return refused(503, "WEIGHTS_TORN")
            if self.transition is not None:
                return refused(409, "MODEL_BUSY", "model_transition")
            if self.barrier != "serving":
                if queue_full:
                    return refused(503, "QUEUE_FULL")
                return Reply("accepted", admission="hold")
            return Reply("accepted", admission="serve")
        # contract 4: refuse policy ("still refuses any swap first"), attached, torn, a
        # transition in progress, unsaved. Decision (docs/state-machine.md): a running load or
        # unload is discarding the commits already ("the deliberate way to discard them"), so
        # it answers 409 MODEL_BUSY, not WEIGHTS_UNSAVED (whose way forward, a save, is gone).
        if refuse_policy:
            return refused(409, "MODEL_NOT_LOADED")
        if self.att is not None:
            return refused(409, "ALREADY_ATTACHED")
        if self.weights == "torn":
            return refused(503, "WEIGHTS_TORN")
        if self.transition is not None:
            return refused(409, "MODEL_BUSY", "model_transition")
        if self.resident and self.unsaved() > 0:
            return refused(409, "WEIGHTS_UNSAVED")
        if self.pause in PAUSES:
            return refused(409, "MODEL_BUSY", "model_transition")
        if self.barrier != "serving":
            return refused(409, "MODEL_BUSY")
        self.transition = "load"
        return Reply("accepted", admission="autoload")

    def v1_confirm(self, now: float, same_resident: bool) -> Reply:
        """A /v1 request that was admitted and then waited (for its auto-load, or for its
        scheduler slot) is about to go on. ``same_resident``: the model it was admitted for is
        still the one resident.

        - The model was unloaded or replaced while it waited: decision (docs/state-machine.md,
          "A /v1 request that waited"): 409 MODEL_BUSY model_transition, retry; it is never
          auto-loaded again from there.
        - Otherwise it names the resident: weights page, States: "every /v1 call is 503
          WEIGHTS_TORN" while torn; contract 4: "a transition in progress (409 model_busy)".
        - Contract 4: "a request admitted before a quiesce finishes on the weights it started
          with": a pause that began while it waited does not stop it (``goes_on``).
        """
        if not (self.resident and same_resident):
            return refused(409, "MODEL_BUSY", "model_transition")
        if self.weights == "torn":
            return refused(503, "WEIGHTS_TORN")
        if self.transition is not None:
            return refused(409, "MODEL_BUSY", "model_transition")
        if self.barrier != "serving":
            return Reply("accepted", admission="goes_on")
        return Reply("accepted", admission="serve")

    # --- completions ----------------------------------------------------------------------
    def drained(self, now: float) -> Reply:
        if self.barrier != "draining":
            return IGNORED
        self.barrier = "quiesced"
        self._disarm("drain")
        if self.pause == "holder":
            if self.weights == "clean":
                self._arm("hold", now, self.hold_s)
            self.answered += 1
            return Reply("accepted", pending=(200, None, None))
        return OK

    def finish(self, owner: str, now: float, ok: bool, applied: bool = True) -> Reply:
        """save_done/failed, adapter_done/failed."""
        if self.pause != owner or self.barrier != "quiesced":
            return IGNORED
        if ok and self.weights == "torn":
            ok = False  # the set tore during the pause: answered as a failure
        if ok and owner == "save":
            self.saved = self.steps or 0
        if ok and owner == "adapter":
            self.adapter = applied
            self.version += 1
        self._give_back(now)
        if ok:
            self.answered += 1
        else:
            self.failed += 1
        return Reply("accepted", pending=(200, None, None)) if ok else OK

    def weights_load_write(self, now: float) -> Reply:
        if self.pause != "weights_load" or self.barrier != "quiesced" or self.weights == "writing":
            return IGNORED
        self.weights = "writing"
        self.version += 1
        return OK

    def weights_load_done(self, now: float) -> Reply:
        if self.pause != "weights_load" or self.weights != "writing":
            return IGNORED
        self.weights, self.steps, self.saved, self.adapter = "clean", 0, 0, False
        self._give_back(now)
        self.answered += 1
        return Reply("accepted", pending=(200, None, None))

    def weights_load_failed(self, now: float) -> Reply:
        if self.pause != "weights_load" or self.barrier != "quiesced":
            return IGNORED
        if self.weights == "writing":
            self._tear()
        self._give_back(now)
        self.failed += 1
        return OK

    def transition_done(self, now: float, failed: bool = False, after: str = "nothing") -> Reply:
        """A transition's end. ``after`` (a failed load): ``nothing`` resident, the resident
        ``kept`` (refused before it was dropped), or the previous row ``reloaded`` (resident
        afresh, as after a load: breaker finding F16)."""
        if self.transition is None:
            return IGNORED
        kind, self.transition = self.transition, None
        if kind == "unload" and failed:
            return OK
        if kind == "load" and failed and after == "kept":
            return OK
        reloaded = kind == "load" and failed and after == "reloaded"
        self.resident = (kind == "load" and not failed) or reloaded
        if self.resident:
            self.version += 1
        self.weights, self.commit, self.adapter, self.saved = "clean", None, False, 0
        self.steps = 0 if self.resident else None
        return OK

    def transition_abandoned(self, now: float) -> Reply:
        """Decision (docs/state-machine.md): a load, swap or unload first drains the running
        generations, bounded like quiesce's drain (Timers: WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S);
        past it the transition is abandoned, 409 MODEL_BUSY drain_timeout, nothing changed."""
        if self.transition is None:
            return IGNORED
        self.transition = None
        return Reply("accepted", pending=(409, "MODEL_BUSY", "drain_timeout"))

    def address_moved(self, now: float) -> Reply:
        if self.att is None:
            return IGNORED
        self._tear()
        if self.commit is not None:
            self.commit.by = None
        self._disarm("watchdog")
        self._disarm("hold")
        return OK

    def fence_failed(self, now: float) -> Reply:
        """Issue 32 item 8: a clear-stale's fence found no room to move the set, so the removed
        holder's handles still reach what would be served: the set is torn (not while a commit
        is open, which the watchdog tears; not with a holder attached or a model transition
        running, which no clear-stale leaves behind)."""
        if not self.resident or self.att is not None or self.transition is not None:
            return IGNORED
        if self.weights == "writing":
            return IGNORED
        self.weights = "torn"
        return OK

    # --- timers ---------------------------------------------------------------------------
    ORDER = ("watchdog", "drain", "hold", "heartbeat")

    def next_deadline(self) -> float | None:
        return min(self.deadlines.values()) if self.deadlines else None

    def fire_due(self, now: float) -> list[Reply]:
        replies: list[Reply] = []
        while True:
            due = sorted((d, self.ORDER.index(n), n) for n, d in self.deadlines.items() if d <= now)
            if not due:
                return replies
            name = due[0][2]
            self._disarm(name)
            if name == "hold":  # "resumes on its own"; "status records last_hold_timeout_at"
                self._serve_again()
                self.records.append("hold_timeout")
            elif name == "drain":  # "409 MODEL_BUSY (reason: drain_timeout) and holds nothing"
                self._serve_again()
                self.answered += 1
                replies.append(Reply("accepted", pending=(409, "MODEL_BUSY", "drain_timeout")))
                continue
            elif name == "watchdog":  # "A commit open longer than this becomes torn"
                self._tear()
                self.records.append("watchdog")  # Status: commit_overran
                if self.commit is not None:
                    self.commit.timed_out = True  # Status: commit.overran
                if self.commit is not None and self.commit.by is None:
                    self._serve_again()  # nobody holds an orphaned commit's barrier
            elif name == "heartbeat":
                assert self.att is not None
                self.att.state = "stale"
                self.records.append("stale")  # attachment.stale_since
            replies.append(OK)

    # --- the status fields compared with the core ---------------------------------------
    def view(self) -> dict[str, object]:
        return {
            "weights_state": self.weights,
            "barrier": "serving" if self.barrier == "serving" else "quiesced",
            "draining": self.barrier == "draining",
            "pause_owner": self.pause,
            "attached": self.att is not None,
            "attachment_state": self.att.state if self.att else None,
            "steps_since_load": self.steps if self.resident else None,
            "unsaved_commits": self.unsaved() if self.resident else None,
            "pause_unavailable": None if self.avail == "ok" else self.avail,
            "adapter_applied": self.adapter,
            "model_transition": self.transition,
            "hold_deadline": self.deadlines.get("hold"),
            # Status: commit "while a commit is open or torn"; overran only when the watchdog
            # timed it out (a detach while writing or a moved address tears without one)
            "commit_overran": None if self.commit is None else self.commit.timed_out,
        }
