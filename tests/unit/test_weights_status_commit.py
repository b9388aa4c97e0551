"""GET /api/weights/status ``commit``: ``overran`` says the watchdog timed the commit out, not
that the set is torn (weights page: Status; Timers, WEIGHTS_COMMIT_WATCHDOG_MS "A commit open
longer than this becomes torn"). A detach mid-commit tears the set without any overrun.

The core is driven with jumped times; one test goes over HTTP on a real tiny model (CPU).
"""

from __future__ import annotations

import asyncio

import pytest

from miserver.fsm.machine import Lifecycle
from miserver.fsm.state import Caller, Event
from tests.unit.test_weights_routes import TRN, auth, make_client, post

T = Caller("trainer", "t", "att-1")


def writing(watchdog_ms: float = 800.0) -> Lifecycle:
    ids = iter(f"att-{n}" for n in range(1, 100))
    core = Lifecycle(
        resident=True, served_name="smol", watchdog_ms=watchdog_ms, id_factory=lambda: next(ids)
    )
    assert core.handle(Event("attach", caller=Caller("trainer", "t")), 0.0).accepted
    assert core.handle(Event("quiesce", caller=T), 0.0).accepted
    assert core.handle(Event("drained"), 0.0).accepted
    assert core.handle(Event("commit_begin", caller=T), 1.0).accepted
    return core


def test_an_open_commit_has_not_overran() -> None:
    core = writing()
    commit = core.status_view(1.5)["commit"]
    assert commit["overran"] is False and commit["open_ms"] == pytest.approx(500.0)


def test_detach_mid_commit_tears_without_an_overrun() -> None:
    core = writing(watchdog_ms=800.0)
    assert core.handle(Event("detach", caller=T), 1.25).accepted
    assert core.state.weights == "torn"
    commit = core.status_view(60.0)["commit"]
    # torn by the detach after 250 ms: the watchdog never timed it
    assert commit["overran"] is False
    assert commit["open_ms"] == pytest.approx(250.0)  # nobody can end it: it stopped there
    assert core.status_view(60.0)["commit_overran"] is None


def test_the_watchdog_overran_flag_stays_after_a_detach() -> None:
    core = writing(watchdog_ms=800.0)
    (out,) = core.fire_due(1.8)
    assert out.trigger == "watchdog_expired"
    view = core.status_view(2.0)["commit"]
    # stopped where the watchdog tore it (issue 16 item 15: it used to run on, 1000 here)
    assert view["overran"] is True and view["open_ms"] == pytest.approx(800.0)
    assert core.handle(Event("detach", caller=T), 2.5).accepted
    view = core.status_view(9.0)["commit"]
    assert view["overran"] is True and view["open_ms"] == pytest.approx(800.0)


def test_a_moved_address_tears_without_an_overrun() -> None:
    core = writing()
    assert core.handle(Event("address_moved"), 1.1).accepted
    commit = core.status_view(5.0)["commit"]
    assert commit["overran"] is False and commit["open_ms"] == pytest.approx(100.0)


def test_a_new_commit_after_a_late_commit_end_starts_fresh() -> None:
    core = writing(watchdog_ms=800.0)
    core.fire_due(1.8)
    late = core.handle(Event("commit_end", caller=T), 2.0)
    assert late.details["overran"] is True and core.status_view(2.0)["commit"] is None
    assert core.handle(Event("commit_begin", caller=T), 2.0).accepted
    assert core.status_view(2.1)["commit"]["overran"] is False


async def test_status_after_detach_mid_commit_over_http(tmp_path, tiny_model_dir) -> None:
    """Finding 10: after a detach mid-commit, status.commit said overran: true."""
    client = await make_client(tmp_path, tiny_model_dir, WEIGHTS_COMMIT_WATCHDOG_MS="3000")
    try:
        att = (await post(client, "/api/weights/attach", auth(TRN)))[1]["data"]["attachment_id"]
        h = auth(TRN, att)
        assert (await post(client, "/api/weights/quiesce", h))[0] == 200
        assert (await post(client, "/api/weights/commit-begin", h))[0] == 200
        assert (await post(client, "/api/weights/detach", h))[0] == 200
        await asyncio.sleep(0.05)
        status = (await (await client.get("/api/weights/status")).json())["data"]
        assert status["weights_state"] == "torn"
        commit = status["commit"]
        assert commit["overran"] is False and commit["watchdog_ms"] == 3000
        assert commit["open_ms"] < 3000
        assert status["commit_overran"] is None
    finally:
        await client.close()


def test_open_ms_stops_at_the_watchdog_tear_and_keeps_its_value_through_clear_stale() -> None:
    """Issue 16 item 15: after the watchdog tore the commit, ``open_ms`` kept counting (the
    beginner could still end it), then jumped back to the tear's value after clear-stale."""
    core = writing(watchdog_ms=800.0)
    (out,) = core.fire_due(1.8)
    assert out.trigger == "watchdog_expired" and core.state.weights == "torn"
    seen = [core.status_view(t)["commit"]["open_ms"] for t in (1.9, 5.0, 29.0)]
    assert seen == [pytest.approx(800.0)] * 3
    stale = [o for o in core.fire_due(1000.0) if o.trigger == "heartbeat_lapsed"]
    assert stale and core.state.attachment == "stale"
    assert core.status_view(1000.0)["commit"]["open_ms"] == pytest.approx(800.0)
    assert core.handle(Event("clear_stale", caller=Caller("operator", "ops")), 1001.0).accepted
    view = core.status_view(2000.0)["commit"]
    assert view["open_ms"] == pytest.approx(800.0) and view["overran"] is True
