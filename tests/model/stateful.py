"""The Hypothesis state machine that runs the lifecycle core beside the independent reference
model (tests/model/reference.py) on a fake clock, and compares every outcome and status field.

``make_machine(table)`` builds the test class for any table, so a planted bug in a copy of the
table can be shown to fail it (tests/model/test_planted_bugs.py).
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from miserver.fsm.machine import Lifecycle, Outcome
from miserver.fsm.state import Caller, Event
from miserver.fsm.table import TABLE, Effect, Row
from tests.model.reference import Reference, Reply

HOLD_S, WATCHDOG_MS, HEARTBEAT_S, DRAIN_S = 5.0, 800.0, 30.0, 60.0
#: Timer settings a program starts with: the defaults, and orders that make timers collide or
#: overtake one another (hold, watchdog ms, heartbeat, drain), seconds.
TIMINGS = (
    (HOLD_S, WATCHDOG_MS, HEARTBEAT_S, DRAIN_S),
    (5.0, 800.0, 0.5, 60.0),  # an attachment goes stale in the middle of a commit
    (1.0, 1000.0, 1.0, 1.0),  # everything due at once
    (5.0, 800.0, 30.0, 0.25),  # drains time out
)

GATED = (
    "detach",
    "heartbeat",
    "quiesce",
    "resume",
    "commit_begin",
    "commit_end",
    "clear_stale",
    "save",
    "weights_load",
)
WHO = ("holder",) * 8 + (
    "none",
    "invalid",
    "wrong_id",
    "other_label",
    "operator_header",
    "operator",
)
TOKENS = {"t": "trainer", "t2": "trainer", "op": "operator"}


def _admission(out: Outcome) -> str | None:
    if Effect.ADMIT in out.effects:
        return "serve"
    if out.trigger == "v1_confirm":
        return "goes_on"  # accepted without running it now: a pause began while it waited
    if Effect.START_MODEL_LOAD in out.effects and out.trigger == "v1":
        return "autoload"
    if Effect.HOLD_REQUEST in out.effects:
        return "hold"
    return None


def _pending(out: Outcome) -> tuple[int, str | None, str | None] | None:
    if out.pending is None:
        return None
    code = out.pending.code.name if out.pending.code else None
    return (out.pending.status, code, out.pending.reason)


def _same(out: Outcome, ref: Reply, what: str) -> None:
    got_kind = "accepted" if out.kind == "ignored" else out.kind
    want_kind = "accepted" if ref.kind == "ignored" else ref.kind
    got = (got_kind, out.status, out.code.name if out.code else None, out.reason)
    want = (want_kind, ref.status, ref.code, ref.reason)
    assert got == want, f"{what}: core {got} ({out.row}), reference {want}"
    assert _pending(out) == ref.pending, f"{what}: pending core {_pending(out)} ref {ref.pending}"
    if ref.details is not None:
        assert out.details == ref.details, (
            f"{what}: details core {out.details} ({out.row}) ref {ref.details}"
        )
    if out.trigger in ("v1", "v1_confirm") and out.kind == "accepted":
        assert _admission(out) == ref.admission, (
            f"{what}: core {_admission(out)} ({out.row}) reference {ref.admission}"
        )


_RECORDS = {
    Effect.RECORD_WATCHDOG: "watchdog",
    Effect.RECORD_HOLD_TIMEOUT: "hold_timeout",
    Effect.RECORD_STALE: "stale",
    Effect.RECORD_OVERRUN: "overrun",
}


class World:
    """What the serving layer would do with the core's effects, kept small: whether handles
    are exported, whether new requests are held and how many /v1 requests wait in the hold,
    which weight versions the cross-request cache holds entries for, the records made and the
    waiting calls answered. :meth:`agrees` holds it to the reference model."""

    def __init__(self) -> None:
        self.exported = False
        self.holding = False
        self.held = 0
        self.cache: set[int] = set()
        self.records: list[str] = []
        self.answered = 0
        self.failed = 0
        self.parked = False  # contract 4b: the running sequences a hold parked
        self.resumed = 0
        self.ended = 0

    def perform(self, out: Outcome, ref: Reference, what: str) -> None:
        """Apply ``out``'s effects in order; ``ref`` is the reference after the event."""
        if out.kind != "accepted":
            return
        for effect in out.effects:
            if effect is Effect.EXPORT_HANDLES:
                assert not self.exported, f"{what}: handles exported twice ({out.row})"
                self.exported = True
            elif effect is Effect.RELEASE_EXPORTS:
                self.exported = False
            elif effect is Effect.HOLD_ADMISSIONS:
                self.holding = True
            elif effect is Effect.RELEASE_HELD:
                self.holding = False
                if self.held:
                    self._run(ref, what, out, "a released request")
                self.held = 0
            elif effect is Effect.REFUSE_HELD_TORN:
                self.held = 0
            elif effect is Effect.PARK_RUNNING:
                assert not self.parked, f"{what}: parked twice ({out.row})"
                self.parked = True
            elif effect is Effect.RESUME_PARKED:
                assert self.parked, f"{what}: resumed with nothing parked ({out.row})"
                self.parked, self.resumed = False, self.resumed + 1
                # a parked sequence is prefilled again on today's weights: nothing computed on
                # the weights it was parked on may be reused (contract 4b)
                self._run(ref, what, out, "a parked sequence prefilled again")
            elif effect is Effect.END_PARKED_TORN:
                assert self.parked, f"{what}: ended with nothing parked ({out.row})"
                self.parked, self.ended = False, self.ended + 1
            elif effect is Effect.HOLD_REQUEST:
                if Effect.START_MODEL_LOAD not in out.effects:
                    self.held += 1  # an auto-load's request waits for the load, not the hold
            elif effect is Effect.ADMIT:
                self._run(ref, what, out, "an admitted request")
            elif effect is Effect.DROP_CACHE:
                self.cache.clear()
            elif effect in _RECORDS:
                self.records.append(_RECORDS[effect])
            elif effect is Effect.ANSWER_PENDING:
                self.answered += 1
            elif effect is Effect.FAIL_PENDING:
                self.failed += 1

    def _run(self, ref: Reference, what: str, out: Outcome, who: str) -> None:
        """A request runs on the reference's current weights: the cache must hold nothing
        computed on other weights (weights page: The write cycle 2, "nothing computed on the old
        weights is reused")."""
        stale = self.cache - {ref.version}
        assert not stale, (
            f"{what}: {who} would reuse the cross-request cache of weights version(s) "
            f"{sorted(stale)} on version {ref.version} ({out.row})"
        )
        self.cache.add(ref.version)

    def agrees(self, ref: Reference, what: str) -> None:
        want = {
            "exported": ref.att is not None,
            "holding": ref.barrier != "serving",
            "records": ref.records,
            "answered": ref.answered,
            "failed": ref.failed,
            "parked": ref.parked,
            "resumed": ref.resumed,
            "ended": ref.ended,
        }
        got = {
            "exported": self.exported,
            "holding": self.holding,
            "records": self.records,
            "answered": self.answered,
            "failed": self.failed,
            "parked": self.parked,
            "resumed": self.resumed,
            "ended": self.ended,
        }
        diff = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
        assert not diff, f"{what}: effects differ (core, reference): {diff}"
        if ref.weights == "torn" or ref.barrier == "serving":
            assert self.held == 0, (
                f"{what}: {self.held} request(s) still held (weights {ref.weights})"
            )


def make_machine(table: tuple[Row, ...] = TABLE) -> type[RuleBasedStateMachine]:
    class LifecycleVersusReference(RuleBasedStateMachine):
        """Rules are the events; after each, outcomes and status fields must agree."""

        def __init__(self) -> None:
            super().__init__()
            self.now = 0.0
            self.configure(TIMINGS[0])

        def configure(self, timing: tuple[float, float, float, float]) -> None:
            hold, watchdog_ms, heartbeat, drain = timing
            counter = iter(range(1, 10**9))
            self.core = Lifecycle(
                hold_timeout_s=hold,
                watchdog_ms=watchdog_ms,
                heartbeat_timeout_s=heartbeat,
                drain_timeout_s=drain,
                table=table,
                id_factory=lambda: f"att-{next(counter)}",
            )
            self.ref = Reference(
                hold_s=hold, watchdog_s=watchdog_ms / 1000.0, heartbeat_s=heartbeat, drain_s=drain
            )
            self.world = World()

        # --- helpers ----------------------------------------------------------------
        def caller(self, who: str) -> Caller:
            att = self.ref.att
            label = att.label if att else "t"
            role = att.role if att else "trainer"
            att_id = att.id if att else "att-none"
            return {
                "holder": Caller(role, label, att_id),  # type: ignore[arg-type]
                "none": Caller("none"),
                "invalid": Caller("invalid"),
                "wrong_id": Caller(role, label, "att-wrong"),  # type: ignore[arg-type]
                "other_label": Caller("trainer", "t2" if label != "t2" else "t", att_id),
                "operator_header": Caller("operator", "op", att_id),
                "operator": Caller("operator", "op", None),
            }[who]

        def both(self, event: Event, ref_call) -> None:
            out = self.core.handle(event, self.now)
            ref = ref_call()
            what = f"t={self.now:g} {event.short()}"
            _same(out, ref, what)
            self.world.perform(out, self.ref, what)
            self.world.agrees(self.ref, what)

        # --- rules --------------------------------------------------------------------
        @initialize(
            resident=st.sampled_from([True, True, True, False]), timing=st.sampled_from(TIMINGS)
        )
        def start(self, resident: bool, timing: tuple[float, float, float, float]) -> None:
            self.configure(timing)
            if resident:  # begin with a model resident (the usual start)
                self.both(
                    Event("model_load", target="other"),
                    lambda: self.ref.model_load(self.now, "other"),
                )
                self.both(Event("transition_done"), lambda: self.ref.transition_done(self.now))

        @rule(
            token=st.sampled_from(["t", "t", "t2", "op", "none"]),
            not_attachable=st.sampled_from(
                [None] * 8 + ["gguf", "quantized", "dtype", "not_on_gpu", "allocator"]
            ),
        )
        def attach(self, token: str, not_attachable: str | None) -> None:
            caller = Caller(TOKENS[token], token) if token in TOKENS else Caller("none")  # type: ignore[arg-type]
            self.both(
                Event("attach", caller=caller, not_attachable=not_attachable),
                lambda: self.ref.attach(caller, self.now, not_attachable),
            )

        @rule(route=st.sampled_from(GATED), who=st.sampled_from(WHO), flag=st.booleans())
        def gated(self, route: str, who: str, flag: bool) -> None:
            caller = self.caller(who)
            if route == "quiesce":
                full = flag and who == "holder" and self.now > 50.0  # rarely a full queue
                self.both(
                    Event(route, caller=caller, queue_full=full),
                    lambda: self.ref.quiesce(caller, self.now, full),
                )
            elif route == "weights_load":
                self.both(
                    Event(route, caller=caller, in_place=flag),
                    lambda: self.ref.weights_load(caller, self.now, flag),
                )
            else:
                self.both(
                    Event(route, caller=caller), lambda: getattr(self.ref, route)(caller, self.now)
                )

        @rule(route=st.sampled_from(GATED), flag=st.booleans())
        def holder_call(self, route: str, flag: bool) -> None:
            """A gated call by the holder (or, with nothing attached, a trainer token): the
            state checks after auth, reached far more often than through ``gated``."""
            self.gated(route, "holder", flag)

        @rule(
            who=st.sampled_from(WHO),
            supported=st.sampled_from([True, True, True, False]),
            full=st.sampled_from([False] * 7 + [True]),
        )
        def quiesce_hold(self, who: str, supported: bool, full: bool) -> None:
            """A quiesce ``{"running": "hold"}`` (contract 4b), now and then while the engine
            cannot park or the queue is full: its refusals after every other, its parking, and
            (with the timer settings of ``start``) every timer that ends or tears the hold."""
            caller = self.caller(who)
            self.both(
                Event(
                    "quiesce",
                    caller=caller,
                    queue_full=full,
                    running="hold",
                    hold_supported=supported,
                ),
                lambda: self.ref.quiesce(caller, self.now, full, "hold", supported),
            )

        @rule(route=st.sampled_from(GGUF_ROUTES), who=st.sampled_from(WHO), flag=st.booleans())
        def on_gguf(self, route: str, who: str, flag: bool) -> None:
            """A call llama.cpp's resident cannot serve (contract 4a), in whatever state the
            program reached: refused GGUF_UNSUPPORTED where the table checks it."""
            self.gguf_call(route, who, flag)

        def gguf_call(self, route: str, who: str, flag: bool) -> None:
            """On a GGUF resident (contract 4a): a save, a weights load (``flag``: of a
            checkpoint; else a ``{"model_id": N}`` reload, which goes on) or an adapter
            change."""
            if route == "gguf_adapter":
                self.both(
                    Event("adapter_change", resident_gguf=True),
                    lambda: self.ref.adapter_change(self.now, True),
                )
                return
            caller = self.caller(who)
            if route == "gguf_save":
                self.both(
                    Event("save", caller=caller, resident_gguf=True),
                    lambda: self.ref.save(caller, self.now, True),
                )
            else:
                self.both(
                    Event(
                        "weights_load",
                        caller=caller,
                        in_place=False,
                        resident_gguf=True,
                        checkpoint_load=flag,
                    ),
                    lambda: self.ref.weights_load(caller, self.now, False, True, flag),
                )

        @rule(
            route=st.sampled_from((*GATED, "attach")),
            who=st.sampled_from(
                ["none", "invalid", "wrong_id", "other_label", "operator_header", "operator"]
            ),
            flag=st.booleans(),
        )
        def stranger(self, route: str, who: str, flag: bool) -> None:
            """A gated call by someone who is not the holder: each auth check in its order."""
            if route == "attach":
                caller = self.caller(who)
                self.both(Event("attach", caller=caller), lambda: self.ref.attach(caller, self.now))
            else:
                self.gated(route, who, flag)

        @rule()
        def expire(self) -> None:
            """Jump the clock to the next deadline exactly: the next timer fires."""
            self.advance("at", 0.0)

        @rule(
            avail=st.sampled_from(["cbm", "concurrency", "ok"]),
            reason=st.sampled_from([None, "gguf", "quantized", "dtype", "not_on_gpu", "allocator"]),
            then=st.sampled_from(["attach", "quiesce", "save", "adapter_change", "weights_load"]),
        )
        def unavailable(self, avail: str, reason: str | None, then: str) -> None:
            """A settings change that makes pauses unavailable (or available again), then a
            call that checks it: the order of the availability checks among the others."""
            self.both(
                Event("settings_change", avail=avail),  # type: ignore[arg-type]
                lambda: self.ref.settings_change(self.now, avail),
            )
            if then == "attach":
                if self.ref.att is not None:
                    holder = self.caller("holder")
                    self.both(
                        Event("detach", caller=holder), lambda: self.ref.detach(holder, self.now)
                    )
                trainer = Caller("trainer", "t")
                self.both(
                    Event("attach", caller=trainer, not_attachable=reason),
                    lambda: self.ref.attach(trainer, self.now, reason),
                )
            elif then == "adapter_change":
                self.both(Event(then), lambda: self.ref.adapter_change(self.now))
            else:
                self.gated(then, "holder", reason is None)

        def start_pause(self, kind: str) -> None:
            holder = self.caller("holder")
            if kind == "adapter_change":
                self.both(Event(kind), lambda: self.ref.adapter_change(self.now))
            elif kind == "quiesce":
                self.both(Event(kind, caller=holder), lambda: self.ref.quiesce(holder, self.now))
            elif kind == "quiesce_hold":  # contract 4b: the running sequences are parked
                self.both(
                    Event("quiesce", caller=holder, running="hold"),
                    lambda: self.ref.quiesce(holder, self.now, False, "hold"),
                )
            else:
                self.both(
                    Event(kind, caller=holder), lambda: getattr(self.ref, kind)(holder, self.now)
                )

        @rule(
            kind=st.sampled_from(TOUR_KINDS),
            stage=st.sampled_from(TOUR_STAGES),
            route=st.sampled_from(
                (*GATED, "attach", "adapter_change", "model_load", "model_unload", "v1")
            ),
            who=st.sampled_from(WHO),
            flag=st.booleans(),
        )
        def interleave(self, kind: str, stage: str, route: str, who: str, flag: bool) -> None:
            """Bring the barrier to a stage (a pause draining or holding; the holder writing,
            torn, or taken over by a pause; the attachment stale), then make one call there: each
            route's checks in each stage of the barrier, in one step (each event compared)."""
            self.bring_to(kind, stage)
            self.call(route, who, flag)

        def bring_to(self, kind: str, stage: str) -> None:
            """Attach (when nothing is), then bring the barrier to ``stage`` with a pause of
            ``kind`` (see :data:`TOUR_STAGES`)."""
            if self.ref.att is None:
                trainer = Caller("trainer", "t")
                self.both(
                    Event("attach", caller=trainer), lambda: self.ref.attach(trainer, self.now)
                )
            holder = self.caller("holder")
            if stage in ("writing", "torn", "takeover", "takeover_torn", "takeover_writing"):
                self.start_pause("quiesce_hold" if kind == "quiesce_hold" else "quiesce")
                self.both(Event("drained"), lambda: self.ref.drained(self.now))
                if stage in ("writing", "torn"):
                    self.both(
                        Event("commit_begin", caller=holder),
                        lambda: self.ref.commit_begin(holder, self.now),
                    )
                    if stage == "torn":
                        self.advance("at", 0.0)
                elif kind not in ("quiesce", "quiesce_hold"):
                    self.start_pause(kind)  # takes over the holder's hold
                    if stage == "takeover_torn":
                        self.both(Event("address_moved"), lambda: self.ref.address_moved(self.now))
                    elif stage == "takeover_writing":  # a weights load that took over writes
                        self.completion("weights_load_write")
            else:
                self.start_pause(kind)
                if stage in ("quiesced", "stale", "quiesced_torn", "job_writing"):
                    self.both(Event("drained"), lambda: self.ref.drained(self.now))
                if stage in ("quiesced_torn", "draining_torn"):  # the set tears in the pause
                    self.both(Event("address_moved"), lambda: self.ref.address_moved(self.now))
                if stage == "job_writing":  # a weights load drained from serving writes
                    self.completion("weights_load_write")
                if stage in ("stale", "draining_stale") and self.ref.att is not None:
                    self.now = self.ref.deadlines.get("heartbeat", self.now)
                    self.advance("small", 0.0)

        def call(self, route: str, who: str, flag: bool, reason: str | None = None) -> None:
            """One call of ``route`` by ``who`` (``flag``: in place, resident target;
            ``reason``: why the resident is not attachable, for an attach)."""
            if route in GATED:
                self.gated(route, who, flag)
            elif route == "attach":
                caller = self.caller(who)
                self.both(
                    Event("attach", caller=caller, not_attachable=reason),
                    lambda: self.ref.attach(caller, self.now, reason),
                )
            elif route == "adapter_change":
                self.both(Event(route), lambda: self.ref.adapter_change(self.now))
            elif route in GGUF_ROUTES:
                self.gguf_call(route, who, flag)
            elif route == "model_load":
                target = "resident" if flag else "other"
                self.both(
                    Event(route, target=target),  # type: ignore[arg-type]
                    lambda: self.ref.model_load(self.now, target),
                )
            elif route == "model_unload":
                self.both(Event(route), lambda: self.ref.model_unload(self.now))
            elif route == "quiesce_hold":  # contract 4b; flag: the engine can park
                caller = self.caller(who)
                self.both(
                    Event("quiesce", caller=caller, running="hold", hold_supported=flag),
                    lambda: self.ref.quiesce(caller, self.now, False, "hold", flag),
                )
            elif route == "quiesce_full":  # a quiesce while the interactive queue is full
                caller = self.caller(who)
                self.both(
                    Event("quiesce", caller=caller, queue_full=True),
                    lambda: self.ref.quiesce(caller, self.now, True),
                )
            elif route in ("v1", "v1_refuse", "v1_full"):
                names = "resident" if flag else "other"
                refuse, full = route == "v1_refuse", route == "v1_full"
                self.both(
                    Event("v1", target=names, refuse_policy=refuse, queue_full=full),  # type: ignore[arg-type]
                    lambda: self.ref.v1(self.now, names, refuse, full),
                )
            elif route == "v1_confirm":
                self.v1_confirm(flag)
            elif route == "adapter_done":
                self.completion("adapter_done" if flag else "adapter_removed")
            elif route in INTERNAL:
                self.completion(route)
            else:  # pragma: no cover - a typo in the tour
                raise ValueError(route)

        @rule(
            kind=st.sampled_from(["quiesce", "quiesce", "save", "weights_load", "adapter_change"]),
            then=st.sampled_from(["drained", "commit", "done", "nothing", "tear", "stale"]),
        )
        def macro(self, kind: str, then: str) -> None:
            """A few events in a row, so that deep states are reached often: a pause that
            drains, then maybe a commit cycle or the pause's completion (each step compared)."""
            if self.ref.att is None:
                trainer = Caller("trainer", "t")
                self.both(
                    Event("attach", caller=trainer), lambda: self.ref.attach(trainer, self.now)
                )
            if then == "stale" and self.ref.att is not None:
                self.now = self.ref.deadlines.get("heartbeat", self.now)  # let it lapse
                self.advance("small", 0.0)
            holder = self.caller("holder")
            if kind == "adapter_change":
                self.both(Event(kind), lambda: self.ref.adapter_change(self.now))
            elif kind == "quiesce":
                self.both(Event(kind, caller=holder), lambda: self.ref.quiesce(holder, self.now))
            else:
                self.both(
                    Event(kind, caller=holder), lambda: getattr(self.ref, kind)(holder, self.now)
                )
            if then == "nothing":
                return
            self.both(Event("drained"), lambda: self.ref.drained(self.now))
            if then in ("commit", "tear", "stale"):
                self.both(
                    Event("commit_begin", caller=holder),
                    lambda: self.ref.commit_begin(holder, self.now),
                )
                if then == "tear":  # jump to the watchdog's deadline
                    self.advance("at", 0.0)
                elif then == "stale":  # stale mid-commit: clear it, then try to attach
                    operator = self.caller("operator")
                    self.both(
                        Event("clear_stale", caller=operator),
                        lambda: self.ref.clear_stale(operator, self.now),
                    )
                    other = Caller("trainer", "t2")
                    self.both(
                        Event("attach", caller=other), lambda: self.ref.attach(other, self.now)
                    )
            elif then == "done":
                done = {
                    "quiesce": ("commit_end", None),
                    "save": ("save_done", "save"),
                    "weights_load": ("weights_load_write", None),
                    "adapter_change": ("adapter_done", "adapter"),
                }[kind]
                if done[0] == "commit_end":
                    self.both(
                        Event("commit_begin", caller=holder),
                        lambda: self.ref.commit_begin(holder, self.now),
                    )
                    self.both(
                        Event("commit_end", caller=holder),
                        lambda: self.ref.commit_end(holder, self.now),
                    )
                elif done[0] == "weights_load_write":
                    self.both(
                        Event("weights_load_write"), lambda: self.ref.weights_load_write(self.now)
                    )
                else:
                    self.both(Event(done[0]), lambda: self.ref.finish(done[1], self.now, True))

        @rule(
            which=st.sampled_from(
                [
                    "drained",
                    "drained",
                    "save_done",
                    "save_failed",
                    "weights_load_write",
                    "weights_load_done",
                    "weights_load_failed",
                    "adapter_done",
                    "adapter_removed",
                    "adapter_failed",
                    "transition_done",
                    "transition_failed",
                    "transition_failed",  # as often as before the two variants below came
                    "transition_failed_kept",
                    "transition_failed_reloaded",
                    "transition_abandoned",
                    "address_moved",
                    "fence_failed",
                ]
            )
        )
        def completion(self, which: str) -> None:
            ref, now = self.ref, self.now
            calls = {
                "drained": (Event("drained"), lambda: ref.drained(now)),
                "save_done": (Event("save_done"), lambda: ref.finish("save", now, True)),
                "save_failed": (Event("save_failed"), lambda: ref.finish("save", now, False)),
                "weights_load_write": (
                    Event("weights_load_write"),
                    lambda: ref.weights_load_write(now),
                ),
                "weights_load_done": (
                    Event("weights_load_done"),
                    lambda: ref.weights_load_done(now),
                ),
                "weights_load_failed": (
                    Event("weights_load_failed"),
                    lambda: ref.weights_load_failed(now),
                ),
                "adapter_done": (
                    Event("adapter_done", applied=True),
                    lambda: ref.finish("adapter", now, True, True),
                ),
                "adapter_removed": (
                    Event("adapter_done", applied=False),
                    lambda: ref.finish("adapter", now, True, False),
                ),
                "adapter_failed": (
                    Event("adapter_failed"),
                    lambda: ref.finish("adapter", now, False),
                ),
                "transition_done": (Event("transition_done"), lambda: ref.transition_done(now)),
                "transition_failed": (
                    Event("transition_failed"),
                    lambda: ref.transition_done(now, failed=True),
                ),
                "transition_failed_kept": (
                    Event("transition_failed", after_failure="kept"),
                    lambda: ref.transition_done(now, failed=True, after="kept"),
                ),
                "transition_failed_reloaded": (
                    Event("transition_failed", after_failure="reloaded"),
                    lambda: ref.transition_done(now, failed=True, after="reloaded"),
                ),
                "transition_abandoned": (
                    Event("transition_abandoned"),
                    lambda: ref.transition_abandoned(now),
                ),
                "address_moved": (Event("address_moved"), lambda: ref.address_moved(now)),
                "fence_failed": (Event("fence_failed"), lambda: ref.fence_failed(now)),
            }
            event, call = calls[which]
            self.both(event, call)

        @rule(
            which=st.sampled_from(
                [
                    "adapter_change",
                    "model_load_other",
                    "model_load_resident",
                    "model_unload",
                    "settings_ok",
                    "settings_ok",
                    "settings_cbm",
                    "settings_concurrency",
                ]
            )
        )
        def management(self, which: str) -> None:
            ref, now = self.ref, self.now
            if which == "adapter_change":
                self.both(Event("adapter_change"), lambda: ref.adapter_change(now))
            elif which.startswith("model_load"):
                target = which.removeprefix("model_load_")
                self.both(
                    Event("model_load", target=target),  # type: ignore[arg-type]
                    lambda: ref.model_load(now, target),
                )
            elif which == "model_unload":
                self.both(Event("model_unload"), lambda: ref.model_unload(now))
            else:
                avail = which.removeprefix("settings_")
                self.both(
                    Event("settings_change", avail=avail),  # type: ignore[arg-type]
                    lambda: ref.settings_change(now, avail),
                )

        @rule(checking=st.booleans(), row_id=st.sampled_from([3, 7]))
        def catalogue_delete(self, checking: bool, row_id: int) -> None:
            """DELETE /api/models/{id}, while a weights load's checkpoint may be being checked
            (before its pause): refused while a load or save needs the catalogue rows."""
            ref, now = self.ref, self.now
            self.both(
                Event("catalogue_delete", name="ck", model_id=row_id, loads_checking=checking),
                lambda: ref.catalogue_delete(now, checking, row_id),
            )

        @rule(
            names=st.sampled_from(["resident", "resident", "other"]),
            refuse_policy=st.booleans(),
            queue_full=st.booleans(),
        )
        def v1(self, names: str, refuse_policy: bool, queue_full: bool) -> None:
            full = queue_full and refuse_policy  # a full queue about a quarter of the time
            self.both(
                Event(
                    "v1",
                    target=names,
                    refuse_policy=refuse_policy,  # type: ignore[arg-type]
                    queue_full=full,
                ),
                lambda: self.ref.v1(self.now, names, refuse_policy, full),
            )

        @rule(same_resident=st.sampled_from([True, True, False]))
        def v1_confirm(self, same_resident: bool) -> None:
            """A /v1 request that waited goes on: the model it was admitted for is still
            resident, or it was unloaded or replaced meanwhile."""
            self.both(
                Event("v1_confirm", same_resident=same_resident),
                lambda: self.ref.v1_confirm(self.now, same_resident),
            )

        @rule(
            where=st.sampled_from(["at", "before", "after", "small", "large"]),
            small=st.floats(min_value=0.0, max_value=2.0),
        )
        def advance(self, where: str, small: float) -> None:
            """Jump the fake clock, biased to the exact deadline and just either side of it."""
            deadline = self.ref.next_deadline()
            if deadline is None or where == "small":
                target = self.now + small
            elif where == "large":
                target = self.now + 100.0
            else:
                target = deadline + {"at": 0.0, "before": -1e-3, "after": 1e-3}[where]
            self.now = max(self.now, target)
            core_outs = self.core.fire_due(self.now)
            ref_outs = self.ref.fire_due(self.now)
            got = [(o.kind == "refused", _pending(o)) for o in core_outs if o.kind != "ignored"]
            want = [(r.kind == "refused", r.pending) for r in ref_outs]
            what = f"t={self.now:g} timers"
            assert got == want, f"{what}: core {[o.row for o in core_outs]} {got}, reference {want}"
            for out in core_outs:
                self.world.perform(out, self.ref, what)
            self.world.agrees(self.ref, what)

        @invariant()
        def status_agrees(self) -> None:
            view = self.core.status_view(self.now)
            core = {
                k: view[k]
                for k in (
                    "weights_state",
                    "barrier",
                    "draining",
                    "pause_owner",
                    "attached",
                    "steps_since_load",
                    "unsaved_commits",
                    "pause_unavailable",
                    "adapter_applied",
                    "model_transition",
                    "hold_deadline",
                )
            }
            core["attachment_state"] = view["attachment"]["state"] if view["attachment"] else None
            core["commit_overran"] = view["commit"]["overran"] if view["commit"] else None
            want = self.ref.view()
            diff = {k: (core[k], want[k]) for k in want if core[k] != want[k]}
            assert not diff, f"t={self.now:g} status differs (core, reference): {diff}"

        @invariant()
        def deadlines_agree(self) -> None:
            assert self.core.next_deadline() == self.ref.next_deadline(), (
                f"next deadline core {self.core.next_deadline()} "
                f"reference {self.ref.next_deadline()}"
            )

    return LifecycleVersusReference


#: The tour's stages, routes and callers (``interleave``'s arguments); who: the holder, no
#: token, a trainer that is not the holder, an operator that is not the holder.
TOUR_KINDS = ("quiesce", "quiesce_hold", "save", "weights_load", "adapter_change")
#: ``job_writing``: a pause drained from serving, then (a weights load) writing;
#: ``takeover_writing``: a weights load that took over the holder's hold, writing;
#: ``quiesced_torn`` / ``draining_torn``: the set tore (a moved address) while the pause holds
#: or drains.
TOUR_STAGES = (
    "draining",
    "quiesced",
    "writing",
    "torn",
    "takeover",
    "takeover_torn",
    "stale",
    "draining_stale",
    "job_writing",
    "takeover_writing",
    "quiesced_torn",
    "draining_torn",
)
#: Internal events (completions the serving layer reports); ``adapter_done`` is flagged
#: (applied or removed), and so is ``v1_confirm`` (the same resident or not).
INTERNAL = (
    "drained",
    "save_done",
    "save_failed",
    "weights_load_write",
    "weights_load_done",
    "weights_load_failed",
    "adapter_done",
    "adapter_failed",
    "transition_done",
    "transition_failed",
    "transition_abandoned",
    "address_moved",
    "fence_failed",
    "v1_confirm",
)
#: Requests: each gated route, attach, the management calls, /v1 (plain, with the refuse
#: policy, with a full queue) and a quiesce with a full queue.
TOUR_REQUESTS = (
    *GATED,
    "attach",
    "adapter_change",
    "model_load",
    "model_unload",
    "v1",
    "v1_refuse",
    "v1_full",
    "quiesce_full",
    "quiesce_hold",
)
TOUR_ROUTES = (*TOUR_REQUESTS, *INTERNAL)
#: Calls on a GGUF resident (contract 4a; the event's ``resident_gguf``), made in every prelude
#: (a GGUF resident is never attached, so the pause stages never see one).
GGUF_ROUTES = ("gguf_save", "gguf_weights_load", "gguf_adapter")
TOUR_WHO = ("holder", "none", "wrong_id", "operator")
_FLAGGED = (
    "weights_load",
    "gguf_weights_load",
    "model_load",
    "v1",
    "v1_refuse",
    "v1_full",
    "quiesce",
    "quiesce_hold",
    "v1_confirm",
    "adapter_done",
)


def _tour_calls(route: str):
    """``(who, flag)`` for each call of ``route`` in the tour: an internal event has no
    caller (once, as the holder's turn)."""
    flags = (True, False) if route in _FLAGGED else (True,)
    whos = ("holder",) if route in INTERNAL else TOUR_WHO
    return [(who, flag) for who in whos for flag in flags]


def tour_size() -> int:
    """How many programs :func:`tour` runs."""
    per_stage = sum(len(_tour_calls(r)) for r in TOUR_ROUTES)
    attach_extra = len(TOUR_WHO) * 5  # an attach in a prelude tries every not-attachable reason
    gguf = sum(len(_tour_calls(r)) for r in GGUF_ROUTES)
    return len(TOUR_KINDS) * len(TOUR_STAGES) * per_stage + len(TOUR_PRELUDES) * (
        per_stage + attach_extra + gguf
    )


def tour(table: tuple[Row, ...] = TABLE) -> int:
    """Run every ``interleave`` program once, deterministically: each pause kind brought to each
    stage, then each route called by each kind of caller, then the next timer fired; each
    event compared with the reference model as in the stateful test. Returns how many programs
    ran; raises ``AssertionError`` naming the program at the first disagreement."""
    machine_cls = make_machine(table)
    return _tour_preludes(machine_cls) + _tour_stages(machine_cls)


def _tour_stages(machine_cls) -> int:
    n = 0
    for kind in TOUR_KINDS:
        for stage in TOUR_STAGES:
            for route in TOUR_ROUTES:
                for who, flag in _tour_calls(route):
                    m = machine_cls()
                    try:
                        m.start(True, TIMINGS[0])
                        m.bring_to(kind, stage)
                        m.call(route, who, flag)
                        m.status_agrees()
                        m.deadlines_agree()
                        m.expire()
                        m.status_agrees()
                        m.deadlines_agree()
                    except AssertionError as exc:
                        raise AssertionError(
                            f"tour {kind}/{stage}/{route}/{who}/flag={flag}: {exc}"
                        ) from None
                    n += 1
    return n


def _tour_preludes(machine_cls) -> int:
    n = 0
    reasons = (None, "gguf", "quantized", "dtype", "not_on_gpu", "allocator")
    for prelude in TOUR_PRELUDES:
        for route in (*TOUR_ROUTES, *GGUF_ROUTES):
            for who, flag0 in _tour_calls(route):
                for flag, reason in (
                    ((True, r) for r in reasons) if route == "attach" else ((flag0, None),)
                ):
                    m = machine_cls()
                    try:
                        _prelude(m, prelude)
                        m.status_agrees()
                        m.call(route, who, flag, reason)
                        m.status_agrees()
                        m.deadlines_agree()
                        m.expire()
                        m.status_agrees()
                        m.deadlines_agree()
                    except AssertionError as exc:
                        raise AssertionError(
                            f"tour {prelude}/{route}/{who}/flag={flag}/{reason}: {exc}"
                        ) from None
                    n += 1
    return n


#: Situations outside a pause the tour also calls every route in: ``base+then``. Bases:
#: ``empty`` (nothing resident), ``fresh`` (a model resident, serving), ``unsaved_detached``
#: (a commit ended, then the holder detached), ``torn_detached`` (a commit torn by the
#: watchdog, then the holder detached), ``attached`` (the holder attached, serving),
#: ``orphan_writing`` (the holder went stale mid-commit and was cleared: the commit is left
#: for the watchdog). Then: a model load (or swap) or unload running, pauses made unavailable
#: (``cbm``, ``concurrency``), an adapter change or a weights load by an operator (nothing
#: attached) draining, holding the barrier, or writing.
TOUR_PRELUDES = (
    "empty",
    "empty+loading",
    "fresh",
    "fresh+loading",
    "fresh+unloading",
    "fresh+cbm",
    "fresh+concurrency",
    "fresh+adapter_draining",
    "fresh+adapter_quiesced",
    "fresh+load_draining",
    "fresh+load_writing",
    "unsaved_detached",
    "unsaved_detached+loading",
    "unsaved_detached+unloading",
    "unsaved_detached+adapter_draining",
    "unsaved_detached+adapter_quiesced",
    "unsaved_detached+load_draining",
    "torn_detached",
    "torn_detached+unloading",
    "torn_detached+load_draining",
    "torn_detached+load_writing",
    "attached+cbm",
    "attached+concurrency",
    "orphan_writing",
)


def _prelude(m, prelude: str) -> None:
    base, _, then = prelude.partition("+")
    # orphan_writing: the heartbeat window (0.5 s) ends before the watchdog's (0.8 s)
    m.start(base != "empty", TIMINGS[1] if base == "orphan_writing" else TIMINGS[0])
    ref = m.ref
    holder = m.caller("holder")
    if base in ("unsaved_detached", "torn_detached"):
        # a commit (ended, or torn by the watchdog), then the holder detaches
        m.bring_to("quiesce", "torn" if base == "torn_detached" else "writing")
        holder = m.caller("holder")
        if base == "unsaved_detached":
            m.both(Event("commit_end", caller=holder), lambda: ref.commit_end(holder, m.now))
        m.both(Event("detach", caller=holder), lambda: ref.detach(holder, m.now))
    elif base == "attached":
        trainer = Caller("trainer", "t")
        m.both(Event("attach", caller=trainer), lambda: ref.attach(trainer, m.now))
    elif base == "orphan_writing":
        m.bring_to("quiesce", "writing")
        m.now = ref.deadlines["heartbeat"]  # the attachment goes stale mid-commit
        m.advance("small", 0.0)
        operator = m.caller("operator")
        m.both(Event("clear_stale", caller=operator), lambda: ref.clear_stale(operator, m.now))
    if then == "loading":
        m.both(Event("model_load", target="other"), lambda: ref.model_load(m.now, "other"))
    elif then == "unloading":
        m.both(Event("model_unload"), lambda: ref.model_unload(m.now))
    elif then in ("cbm", "concurrency"):
        m.both(
            Event("settings_change", avail=then),  # type: ignore[arg-type]
            lambda: ref.settings_change(m.now, then),
        )
    elif then.startswith("adapter_"):
        m.both(Event("adapter_change"), lambda: ref.adapter_change(m.now))
    elif then.startswith("load_"):
        operator = Caller("operator", "op")
        m.both(Event("weights_load", caller=operator), lambda: ref.weights_load(operator, m.now))
    if then.endswith("_quiesced") or then.endswith("_writing"):
        m.both(Event("drained"), lambda: ref.drained(m.now))
    if then.endswith("_writing"):
        m.completion("weights_load_write")
