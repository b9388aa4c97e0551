"""POST /api/weights/quiesce {"running": "finish" | "hold"} (contract 4b; issue 30), over HTTP on
a real app serving a tiny Llama on the CPU.

The table decides (miserver/fsm/table.py); these tests pin what reaches the wire and what the
effects ask of the engine. The engine's side of a hold is the
:class:`~miserver.serving.engine.parking.Parking` interface: a resident without it (a GGUF
resident: llama.cpp decodes, no engine of ours) refuses a hold with 409 BARRIER_UNAVAILABLE
``hold_unsupported``; a recording engine that has it, put in the place of the resident's
continuous engine, shows which calls each lifecycle step makes.
"""

from __future__ import annotations

import asyncio

import pytest

from miserver.http import keys
from miserver.serving.engine.parking import Parking, parking_of
from miserver.serving.weights.refusals import WeightsTornError
from tests.unit.test_weights_routes import TRN, TRN2, auth, make_client, post
from tests.waiting import eventually


class RecordingParkingEngine:
    """An engine double that implements :class:`Parking` and records each call: the lifecycle's
    effects are what is under test here, not an engine (the continuous engine's own tests
    show the parking itself)."""

    def __init__(self, running: int) -> None:
        self.running = running
        self.parked = 0
        self.calls: list[str] = []
        self.ended_with: list[BaseException] = []

    def park_running(self) -> None:
        self.calls.append("park_running")
        self.parked, self.running = self.running, 0

    def parked_sequences(self) -> int:
        return self.parked

    def resume_parked(self) -> int:
        self.calls.append("resume_parked")
        n, self.parked, self.running = self.parked, 0, self.parked
        return n

    def end_parked(self, exc: BaseException) -> int:
        self.calls.append("end_parked")
        self.ended_with.append(exc)
        n, self.parked = self.parked, 0
        return n

    # what the decode effects ask of the engine (DROP_CACHE, a model transition)
    def drop_prefix_cache(self) -> int:
        self.calls.append("drop_prefix_cache")
        return 0

    def drop_graphs(self) -> None:
        self.calls.append("drop_graphs")

    # what the status and health routes read
    closed = False
    engine = None

    def stats(self) -> dict:
        return {}

    def close(self, wait_s: float = 0.0) -> None:  # the host closes its resident's engine
        self.calls.append("close")


def _replace_engine(resident, engine) -> None:
    """Put ``engine`` in the place of ``resident``'s continuous engine, whose thread ends."""
    if resident.engine_loop is not None:
        resident.engine_loop.close(wait_s=5.0)
    resident.engine_loop = engine


def without_parking(client) -> None:
    """The resident has no engine that parks, as a GGUF resident has none."""
    _replace_engine(client.app[keys.HOST].resident, None)


def install(client, running: int = 3) -> RecordingParkingEngine:
    engine = RecordingParkingEngine(running)
    _replace_engine(client.app[keys.HOST].resident, engine)
    assert parking_of(client.app[keys.HOST]) is engine and isinstance(engine, Parking)
    return engine


@pytest.fixture
async def client(tmp_path, tiny_model_dir):
    # the continuous engine parks (test_engine_hold.py parks it); here the recording engine
    # stands in where a hold succeeds, and no engine where it cannot
    c = await make_client(tmp_path, tiny_model_dir)
    yield c
    await c.close()


async def attach(client) -> str:
    status, body, _ = await post(client, "/api/weights/attach", auth(TRN))
    assert status == 200, body
    return body["data"]["attachment_id"]


async def status(client) -> dict:
    resp = await client.get("/api/weights/status")
    return (await resp.json())["data"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"running": "pause"}, "running"),
        ({"running": 1}, "running"),
        ({"running": None}, "running"),
        ({"running": "hold", "force": True}, "force"),
    ],
)
async def test_a_bad_body_is_a_400_naming_the_field_and_changes_nothing(
    client, body, field
) -> None:
    att = await attach(client)
    before = await status(client)
    code, answer, _ = await post(client, "/api/weights/quiesce", auth(TRN, att), body)
    assert code == 400, answer
    assert answer["error"]["code"] == "INVALID_REQUEST"
    assert answer["error"]["details"] == {"field": field}
    after = await status(client)
    assert after["barrier"] == before["barrier"] == "serving"
    assert after["held_requests"] is None and after["parked_sequences"] is None


async def test_a_bodyless_and_a_finish_quiesce_are_the_drain_and_park_nothing(client) -> None:
    att = await attach(client)
    for body in (None, {}, {"running": "finish"}):
        code, answer, _ = await post(client, "/api/weights/quiesce", auth(TRN, att), body)
        assert code == 200, answer
        assert answer["data"]["parked_sequences"] == 0
        assert answer["data"]["held_requests"] == 0
        seen = await status(client)
        assert seen["barrier"] == "quiesced" and seen["parked_sequences"] == 0
        assert (await post(client, "/api/weights/resume", auth(TRN, att)))[0] == 200
        assert (await status(client))["parked_sequences"] is None


async def test_hold_is_refused_409_hold_unsupported_while_the_engine_cannot_park(client) -> None:
    assert parking_of(client.app[keys.HOST]) is not None  # the continuous engine parks
    without_parking(client)
    assert parking_of(client.app[keys.HOST]) is None
    att = await attach(client)
    code, answer, headers = await post(
        client, "/api/weights/quiesce", auth(TRN, att), {"running": "hold"}
    )
    assert code == 409, answer
    error = answer["error"]
    assert (error["code"], error["reason"]) == ("BARRIER_UNAVAILABLE", "hold_unsupported")
    assert '{"running": "finish"}' in error["message"]  # what to do instead
    assert (await status(client))["barrier"] == "serving"  # a refusal holds nothing
    # a finish quiesce still works
    assert (await post(client, "/api/weights/quiesce", auth(TRN, att)))[0] == 200


async def test_every_refusal_of_quiesce_comes_before_the_hold_s_own(client) -> None:
    hold = {"running": "hold"}
    code, answer, _ = await post(client, "/api/weights/quiesce", auth(TRN), hold)
    assert (code, answer["error"]["code"]) == (409, "NOT_ATTACHED")
    att = await attach(client)
    code, answer, _ = await post(client, "/api/weights/quiesce", auth(TRN2, att), hold)
    assert (code, answer["error"]["code"]) == (403, "NOT_ATTACHMENT_HOLDER")
    assert (await post(client, "/api/weights/quiesce", auth(TRN, att)))[0] == 200
    code, answer, _ = await post(client, "/api/weights/quiesce", auth(TRN, att), hold)
    assert (code, answer["error"]["code"]) == (409, "ALREADY_QUIESCED")


async def test_hold_parks_counts_and_resume_continues_the_parked(client) -> None:
    engine = install(client, running=3)
    att = await attach(client)
    code, answer, _ = await post(
        client, "/api/weights/quiesce", auth(TRN, att), {"running": "hold"}
    )
    assert code == 200, answer
    assert answer["data"]["parked_sequences"] == 3
    assert engine.calls[:1] == ["park_running"] and "drop_prefix_cache" in engine.calls
    seen = await status(client)
    assert seen["barrier"] == "quiesced" and seen["parked_sequences"] == 3
    # a commit while parked; nothing is resumed until resume
    assert (await post(client, "/api/weights/commit-begin", auth(TRN, att)))[0] == 200
    assert (await post(client, "/api/weights/commit-end", auth(TRN, att)))[0] == 200
    assert "resume_parked" not in engine.calls
    assert (await post(client, "/api/weights/resume", auth(TRN, att)))[0] == 200
    assert engine.calls.count("resume_parked") == 1 and engine.running == 3
    assert (await status(client))["parked_sequences"] is None
    # a second resume is the no-op 200, and resumes nothing again
    assert (await post(client, "/api/weights/resume", auth(TRN, att)))[0] == 200
    assert engine.calls.count("resume_parked") == 1


async def test_a_hold_past_the_hold_timeout_resumes_the_parked_on_its_own(
    tmp_path, tiny_model_dir
) -> None:
    client = await make_client(tmp_path, tiny_model_dir, WEIGHTS_HOLD_TIMEOUT_S="0.2")
    try:
        engine = install(client, running=2)
        att = await attach(client)
        code, _, _ = await post(client, "/api/weights/quiesce", auth(TRN, att), {"running": "hold"})
        assert code == 200
        await eventually(
            lambda: "resume_parked" in engine.calls, "the hold timer resumes the parked"
        )
        seen = await status(client)
        assert seen["barrier"] == "serving" and seen["last_hold_timeout_at"] is not None
        assert engine.running == 2 and engine.parked == 0
    finally:
        await client.close()


async def test_a_tear_while_parked_ends_the_parked_with_weights_torn(
    tmp_path, tiny_model_dir
) -> None:
    client = await make_client(tmp_path, tiny_model_dir, WEIGHTS_COMMIT_WATCHDOG_MS="100")
    try:
        engine = install(client, running=4)
        att = await attach(client)
        code, _, _ = await post(client, "/api/weights/quiesce", auth(TRN, att), {"running": "hold"})
        assert code == 200
        assert (await post(client, "/api/weights/commit-begin", auth(TRN, att)))[0] == 200
        await eventually(lambda: "end_parked" in engine.calls, "the watchdog tear ends the parked")
        assert (await status(client))["weights_state"] == "torn"
        assert isinstance(engine.ended_with[0], WeightsTornError)
        assert "resume_parked" not in engine.calls and engine.parked == 0
        # the late commit-end and resume continue nothing: the parked are gone
        await post(client, "/api/weights/commit-end", auth(TRN, att))
        await post(client, "/api/weights/resume", auth(TRN, att))
        await asyncio.sleep(0)
        assert "resume_parked" not in engine.calls
    finally:
        await client.close()


async def test_detach_while_parked_continues_the_parked(client) -> None:
    engine = install(client, running=1)
    att = await attach(client)
    assert (await post(client, "/api/weights/quiesce", auth(TRN, att), {"running": "hold"}))[
        0
    ] == 200
    assert (await post(client, "/api/weights/detach", auth(TRN, att)))[0] == 200
    assert engine.calls.count("resume_parked") == 1 and engine.running == 1
