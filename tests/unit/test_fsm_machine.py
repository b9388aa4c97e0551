"""The sans-IO lifecycle core, driven like the HTTP layer will drive it: scripted scenarios
from the weights page's sentences, with times jumped to the exact deadlines."""

from __future__ import annotations

import pytest

from miserver.fsm.context import served_after_removal
from miserver.fsm.machine import Lifecycle, TableError
from miserver.fsm.state import Caller, Event
from miserver.fsm.table import Effect, check_order
from miserver.spec.settings import Settings

T = Caller("trainer", "t", "att-1")
OP = Caller("operator", "op", None)


def fresh(**kw) -> Lifecycle:
    ids = iter(f"att-{n}" for n in range(1, 100))
    return Lifecycle(resident=True, served_name="smol", id_factory=lambda: next(ids), **kw)


def quiesced(core: Lifecycle, now: float = 0.0) -> None:
    assert core.handle(Event("attach", caller=Caller("trainer", "t")), now).accepted
    assert core.handle(Event("quiesce", caller=T), now).accepted
    assert core.handle(Event("drained"), now).pending.status == 200


def test_write_cycle() -> None:
    core = fresh()
    out = core.handle(Event("attach", caller=Caller("trainer", "t")), 0.0)
    assert out.kind == "accepted" and out.effects == (Effect.EXPORT_HANDLES,)
    assert out.details["attachment_id"] == "att-1"
    out = core.handle(Event("quiesce", caller=T), 1.0)
    assert out.effects == (Effect.HOLD_ADMISSIONS, Effect.START_DRAIN)
    assert core.status_view()["barrier"] == "quiesced" and core.status_view()["draining"]
    out = core.handle(Event("drained"), 1.5)
    assert out.pending.status == 200 and Effect.DROP_CACHE in out.effects
    assert core.context.hold_deadline == 6.5
    out = core.handle(Event("commit_begin", caller=T), 2.0)
    assert core.state.weights == "writing" and core.context.hold_deadline is None
    assert core.context.watchdog_deadline == pytest.approx(2.8)
    assert out.details["watchdog_ms"] == 800.0
    out = core.handle(Event("commit_end", caller=T), 2.25)
    assert core.state.weights == "clean" and out.details["overran"] is False
    assert out.details["commit_ms"] == pytest.approx(250.0)
    assert core.status_view()["steps_since_load"] == 1
    assert core.context.hold_deadline == 7.25  # "the hold timer restarts in full"
    assert core.status_view()["barrier"] == "quiesced"  # "Serving stays quiesced"
    out = core.handle(Event("resume", caller=T), 3.0)
    assert out.effects == (Effect.RELEASE_HELD,) and core.status_view()["barrier"] == "serving"
    out = core.handle(Event("detach", caller=T), 4.0)
    assert out.accepted and not core.status_view()["attached"]
    assert core.status_view()["served"] == {"name": "smol", "origin": "model", "commits": 1}


def test_hold_times_out_exactly_at_its_deadline() -> None:
    core = fresh(hold_timeout_s=5.0)
    quiesced(core, 10.0)
    assert core.next_deadline() == 15.0  # the hold (heartbeat is at 40)
    assert core.fire_due(14.999) == []
    outs = core.fire_due(15.0)
    assert [o.trigger for o in outs] == ["hold_expired"]
    assert Effect.RECORD_HOLD_TIMEOUT in outs[0].effects
    assert core.status_view()["barrier"] == "serving"
    assert core.status_view()["last_hold_timeout_at"] == 15.0


def test_watchdog_tears_and_a_late_commit_end_repairs() -> None:
    core = fresh(watchdog_ms=800.0)
    quiesced(core)
    core.handle(Event("commit_begin", caller=T), 1.0)
    assert core.fire_due(1.7999) == []
    (out,) = core.fire_due(1.8)
    assert out.trigger == "watchdog_expired" and Effect.REFUSE_HELD_TORN in out.effects
    assert core.state.weights == "torn" and core.status_view()["commit_overran"] == 1.8
    refused = core.handle(Event("v1", target="resident"), 1.9)
    assert (refused.status, refused.code.name) == (503, "WEIGHTS_TORN")
    assert refused.details["recover"] == "POST /api/weights/load"
    late = core.handle(Event("commit_end", caller=T), 2.0)
    assert late.details["overran"] is True and core.state.weights == "clean"
    assert core.status_view()["last_overrun"] == {"at": 2.0, "commit_ms": pytest.approx(1000.0)}
    assert core.context.hold_deadline == 7.0


def test_stale_blocks_loads_and_a_heartbeat_revives() -> None:
    core = fresh(heartbeat_timeout_s=30.0)
    core.handle(Event("attach", caller=Caller("trainer", "t")), 0.0)
    (out,) = core.fire_due(30.0)
    assert out.trigger == "heartbeat_lapsed" and core.state.attachment == "stale"
    load = core.handle(Event("model_load", target="other"), 31.0)
    assert load.code.name == "ALREADY_ATTACHED"
    assert load.details["holder"]["state"] == "stale" and load.details["holder"]["label"] == "t"
    assert core.handle(Event("heartbeat", caller=T), 32.0).accepted
    assert core.state.attachment == "active" and core.next_deadline() == 62.0


def test_drain_timeout_answers_model_busy_and_holds_nothing() -> None:
    core = fresh(drain_timeout_s=60.0, heartbeat_timeout_s=600.0)
    core.handle(Event("attach", caller=Caller("trainer", "t")), 0.0)
    core.handle(Event("quiesce", caller=T), 0.0)
    (out,) = core.fire_due(60.0)
    assert (out.pending.status, out.pending.code.name, out.pending.reason) == (
        409,
        "MODEL_BUSY",
        "drain_timeout",
    )
    assert Effect.RELEASE_HELD in out.effects and core.state.barrier == "serving"


def test_resume_while_draining_is_not_quiesced_quiesce_in_progress() -> None:
    core = fresh()
    core.handle(Event("attach", caller=Caller("trainer", "t")), 0.0)
    core.handle(Event("quiesce", caller=T), 0.0)
    out = core.handle(Event("resume", caller=T), 0.1)
    assert (out.status, out.code.name, out.reason) == (409, "NOT_QUIESCED", "quiesce_in_progress")


def test_auth_check_order() -> None:
    core = fresh()
    assert (
        core.handle(Event("quiesce", caller=Caller("none")), 0).code.name == "WEIGHTS_UNAUTHORIZED"
    )
    assert core.handle(Event("quiesce", caller=T), 0).code.name == "NOT_ATTACHED"
    core.handle(Event("attach", caller=Caller("trainer", "t")), 0)
    other = Caller("trainer", "t2", "att-1")
    assert core.handle(Event("quiesce", caller=other), 0).code.name == "NOT_ATTACHMENT_HOLDER"
    no_header = Caller("trainer", "t", None)
    assert core.handle(Event("quiesce", caller=no_header), 0).code.name == "NOT_ATTACHMENT_HOLDER"
    assert core.handle(Event("clear_stale", caller=T), 0).code.name == "WEIGHTS_FORBIDDEN"
    assert core.handle(Event("clear_stale", caller=OP), 0).code.name == "ATTACHMENT_NOT_STALE"


def test_check_order_is_data_in_the_spec_s_order() -> None:
    assert check_order("quiesce") == (
        ("WEIGHTS_UNAUTHORIZED", None),
        ("NOT_ATTACHED", None),
        ("NOT_ATTACHMENT_HOLDER", None),
        ("WEIGHTS_NOT_CLEAN", None),
        ("ALREADY_QUIESCED", None),
        ("PAUSE_IN_PROGRESS", "save"),
        ("PAUSE_IN_PROGRESS", "weights_load"),
        ("PAUSE_IN_PROGRESS", "adapter"),
        ("BARRIER_UNAVAILABLE", "cbm"),
        ("BARRIER_UNAVAILABLE", "concurrency"),
        ("QUEUE_FULL", None),
        # contract 4b: a hold's own refusal comes after every refusal both variants share
        ("BARRIER_UNAVAILABLE", "hold_unsupported"),
    )
    assert check_order("clear_stale")[:4] == (
        ("WEIGHTS_UNAUTHORIZED", None),
        ("WEIGHTS_FORBIDDEN", None),
        ("NOT_ATTACHED", None),
        ("ATTACHMENT_NOT_STALE", None),
    )
    # contract 4: refuse policy, attached, torn, a transition in progress (before unsaved: a
    # running load or unload discards the commits already; docs/state-machine.md), unsaved
    assert check_order("v1")[3:] == (
        ("MODEL_NOT_LOADED", None),
        ("ALREADY_ATTACHED", None),
        ("WEIGHTS_TORN", None),
        ("MODEL_BUSY", "model_transition"),
        ("WEIGHTS_UNSAVED", None),
        ("MODEL_BUSY", "model_transition"),
        ("MODEL_BUSY", None),
    )


def test_a_refusal_changes_nothing() -> None:
    core = fresh()
    quiesced(core)
    before = core.snapshot()
    out = core.handle(Event("quiesce", caller=T), 1.0)
    assert out.code.name == "ALREADY_QUIESCED" and out.effects == ()
    assert core.snapshot() == before and hash(before) == hash(core.snapshot())


def test_v1_admission_serve_hold_refuse_autoload() -> None:
    core = fresh()
    assert Effect.ADMIT in core.handle(Event("v1", target="resident"), 0).effects
    quiesced(core)
    assert Effect.HOLD_REQUEST in core.handle(Event("v1", target="resident"), 0).effects
    full = core.handle(Event("v1", target="resident", queue_full=True), 0)
    assert (full.status, full.code.name) == (503, "QUEUE_FULL")
    core.handle(Event("commit_begin", caller=T), 0)
    core.handle(Event("commit_end", caller=T), 0)
    core.handle(Event("detach", caller=T), 0)
    unsaved = core.handle(Event("v1", target="other"), 0)
    assert (unsaved.status, unsaved.code.name) == (409, "WEIGHTS_UNSAVED")
    assert unsaved.details["unsaved_commits"] == 1 and unsaved.details["served_name"] == "smol"
    policy = core.handle(Event("v1", target="other", refuse_policy=True), 0)
    assert (policy.status, policy.code.name) == (409, "MODEL_NOT_LOADED")
    # an explicit operator load discards the commits
    load = core.handle(Event("model_load", target="other"), 0)
    assert load.effects == (Effect.START_MODEL_LOAD,)
    core.handle(Event("transition_done", name="other"), 1)
    assert core.status_view()["steps_since_load"] == 0 and core.unsaved_commits == 0
    auto = core.handle(Event("v1", target="other"), 2)
    assert auto.effects == (Effect.START_MODEL_LOAD, Effect.HOLD_REQUEST)


def test_save_takes_over_the_hold_and_gives_it_back_with_the_timer_restarted() -> None:
    core = fresh(hold_timeout_s=5.0)
    quiesced(core, 0.0)
    core.handle(Event("commit_begin", caller=T), 1.0)
    core.handle(Event("commit_end", caller=T), 1.1)
    out = core.handle(Event("save", caller=T), 2.0)
    assert Effect.BEGIN_SAVE in out.effects and core.state.takeover
    assert core.context.hold_deadline is None  # suspended while the save holds it
    assert core.handle(Event("commit_begin", caller=T), 2.1).reason == "save"
    done = core.handle(Event("save_done", name="smol-step1-abcdef12"), 3.0)
    assert done.pending.status == 200 and core.state.owner == "holder"
    assert core.context.hold_deadline == 8.0 and core.unsaved_commits == 0
    assert core.status_view()["served"] == {
        "name": "smol-step1-abcdef12",
        "origin": "checkpoint",
        "commits": 0,
    }


def test_weights_load_recovers_torn() -> None:
    core = fresh()
    quiesced(core)
    core.handle(Event("commit_begin", caller=T), 1.0)
    core.handle(Event("detach", caller=T), 1.1)  # "detach while writing" tears
    assert core.state.weights == "torn"
    refused = core.handle(Event("model_load", target="other"), 1.2)
    assert (refused.status, refused.code.name) == (503, "WEIGHTS_TORN")
    assert core.handle(Event("weights_load", caller=OP), 2.0).accepted
    core.handle(Event("drained"), 2.1)
    core.handle(Event("weights_load_write"), 2.2)
    assert core.state.weights == "writing"
    done = core.handle(Event("weights_load_done", name="ckpt"), 2.3)
    assert done.pending.status == 200 and core.state.weights == "clean"
    assert core.state.barrier == "serving" and core.status_view()["steps_since_load"] == 0


def test_status_never_holds_the_attachment_id() -> None:
    core = fresh()
    quiesced(core)
    assert "att-1" not in repr(core.status_view())
    assert "att-1" not in repr(T) and "att-1" not in repr(core.context)


def test_timers_due_together_fire_watchdog_first() -> None:
    core = fresh(hold_timeout_s=5.0, watchdog_ms=800.0, heartbeat_timeout_s=1.0)
    quiesced(core, 0.0)
    core.handle(Event("heartbeat", caller=T), 0.0)
    core.handle(Event("commit_begin", caller=T), 0.5)
    outs = core.fire_due(100.0)
    assert [o.trigger for o in outs] == ["heartbeat_lapsed", "watchdog_expired"]


def test_unknown_trigger_is_a_table_error() -> None:
    with pytest.raises(TableError):
        fresh().handle(Event("no_such_event"), 0.0)


def test_from_settings_reads_timers_and_pause_availability(tmp_path) -> None:
    s = Settings(home=str(tmp_path), max_concurrent_requests=2, weights_hold_timeout_s=2.5)
    core = Lifecycle.from_settings(s, resident=True)
    assert core.status_view()["pause_unavailable"] == "concurrency"
    assert core.durations["hold"] == 2.5
    core.handle(Event("attach", caller=Caller("trainer", "t")), 0.0)
    assert core.state.attachment == "none"  # refused: NOT_ATTACHABLE concurrency


def _adapter_change(core: Lifecycle, now: float, **done: object) -> None:
    if done.get("applied") is False:  # what the adapter job sends for a removal
        name, origin, commits = served_after_removal(core.context, "base-name")
        done.update(name=name, origin=origin, commits=commits)
    assert core.handle(Event("adapter_change"), now).kind == "accepted"
    assert core.handle(Event("drained"), now).kind == "accepted"
    assert core.handle(Event("adapter_done", **done), now).kind == "accepted"  # type: ignore[arg-type]


def test_the_lifecycle_keeps_what_was_served_before_the_adapter() -> None:
    """Contract 6, weights page Which weights answered: the context records the name served
    before the first adapter (a replacing adapter keeps it; a save under the adapter records
    its checkpoint), and a removal restores it, counting the commits made under the adapter."""
    core = Lifecycle(resident=True, served_name="base")
    _adapter_change(core, 1.0, name="lora-a", applied=True)
    ctx = core.context
    assert (ctx.served_name, ctx.served_origin, ctx.commits_since_name) == ("lora-a", "adapter", 0)
    assert ctx.before_adapter is not None
    assert (ctx.before_adapter.served_name, ctx.before_adapter.origin) == ("base", "model")
    _adapter_change(core, 2.0, name="lora-b", applied=True)  # replacing: the record stays
    assert core.context.before_adapter.served_name == "base"
    trainer = Caller("trainer", "t")
    out = core.handle(Event("attach", caller=trainer), 3.0)
    holder = Caller("trainer", "t", out.details["attachment_id"])
    assert core.handle(Event("quiesce", caller=holder), 3.0).kind == "accepted"
    assert core.handle(Event("drained"), 3.0).pending.status == 200
    for trigger in ("commit_begin", "commit_end", "resume"):
        assert core.handle(Event(trigger, caller=holder), 3.0).kind == "accepted", trigger
    assert core.handle(Event("detach", caller=holder), 3.0).kind == "accepted"
    assert core.context.commits_since_name == 1
    _adapter_change(core, 4.0, applied=False)
    ctx = core.context
    assert (ctx.served_name, ctx.served_origin, ctx.commits_since_name) == ("base", "model", 1)
    assert ctx.before_adapter is None


def test_a_save_under_an_adapter_is_what_its_removal_restores() -> None:
    core = Lifecycle(resident=True, served_name="base")
    _adapter_change(core, 1.0, name="lora", applied=True)
    trainer = Caller("trainer", "t")
    out = core.handle(Event("attach", caller=trainer), 2.0)
    holder = Caller("trainer", "t", out.details["attachment_id"])
    assert core.handle(Event("quiesce", caller=holder), 2.0).kind == "accepted"
    assert core.handle(Event("drained"), 2.0).pending.status == 200
    for trigger in ("commit_begin", "commit_end"):
        assert core.handle(Event(trigger, caller=holder), 2.0).kind == "accepted", trigger
    assert core.handle(Event("save", caller=holder), 2.0).kind == "accepted"
    assert core.handle(Event("save_done", name="ck"), 2.0).kind == "accepted"
    assert core.context.served_name == "lora"  # the adapter keeps its name
    assert core.context.before_adapter.served_name == "ck"
    for trigger in ("commit_begin", "commit_end", "resume"):
        assert core.handle(Event(trigger, caller=holder), 3.0).kind == "accepted", trigger
    assert core.handle(Event("detach", caller=holder), 3.0).kind == "accepted"
    _adapter_change(core, 4.0, applied=False)
    ctx = core.context
    assert (ctx.served_name, ctx.served_origin, ctx.commits_since_name) == ("ck", "checkpoint", 1)
    # a load or an unload forgets the record with the adapter
    _adapter_change(core, 5.0, name="lora", applied=True)
    assert core.handle(Event("model_unload"), 6.0).kind == "accepted"
    assert core.handle(Event("transition_done"), 6.0).kind == "accepted"
    assert core.context.before_adapter is None
