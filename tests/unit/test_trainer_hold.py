"""The trainer client's ``running`` (contract 4b; issue 30): ``commit(running="hold")``,
``quiesce(running=...)`` and the ``WeightsClient(running=...)`` default, against the real app
on the CPU. The server's engine side is the recording
:class:`~tests.unit.test_quiesce_hold.RecordingParkingEngine` where a hold must succeed, and
no engine that parks (as on a GGUF resident: 409 ``hold_unsupported``) where it must be
refused.
"""

from __future__ import annotations

import asyncio

import pytest

from miserver import trainer
from miserver.http import keys
from miserver.trainer import WeightsClient
from tests.unit.test_quiesce_hold import RecordingParkingEngine, _replace_engine
from tests.unit.test_trainer_client import TRN, ThreadServer


@pytest.fixture
def server(tmp_path, tiny_model_dir):
    # the continuous engine parks (test_engine_hold.py); here the recording engine stands in
    # where a hold must succeed, and no engine (as on a GGUF resident) where it must not
    s = ThreadServer(tmp_path, tiny_model_dir)
    yield s
    s.stop()


def install(server: ThreadServer, running: int | None) -> RecordingParkingEngine | None:
    """The recording engine in the place of the resident's engine (None: no engine)."""
    engine = RecordingParkingEngine(running) if running is not None else None

    async def put() -> None:
        _replace_engine(server.app[keys.HOST].resident, engine)

    asyncio.run_coroutine_threadsafe(put(), server.loop).result(10)
    return engine


def test_running_must_be_finish_or_hold(server) -> None:
    with pytest.raises(ValueError, match="running"):
        WeightsClient(server.url, TRN, running="pause")  # type: ignore[arg-type]
    with WeightsClient(server.url, TRN, heartbeat=False) as client:
        client.attach()
        with pytest.raises(ValueError, match="running"):
            client.quiesce(running="keep")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="running"), client.commit(running=1):  # type: ignore[arg-type]
            pass
        assert client.status()["barrier"] == "serving"  # nothing was sent


def test_commit_with_hold_parks_and_resumes_through_the_pipelined_pair(server) -> None:
    engine = install(server, running=5)
    with WeightsClient(server.url, TRN, heartbeat=False) as client:
        client.attach()
        with client.commit(running="hold") as cycle:
            assert engine.calls[0] == "park_running"
            assert client.status()["parked_sequences"] == 5
        assert cycle.quiesce["parked_sequences"] == 5
        assert cycle.end["steps_since_load"] == 1 and cycle.resume["barrier"] == "serving"
        assert engine.calls.count("resume_parked") == 1 and engine.running == 5
        # the default is still finish: nothing parked
        engine.calls.clear()
        with client.commit() as cycle:
            pass
        assert cycle.quiesce["parked_sequences"] == 0 and "park_running" not in engine.calls


def test_the_client_default_hold_applies_to_quiesce_and_commit(server) -> None:
    engine = install(server, running=2)
    with WeightsClient(server.url, TRN, heartbeat=False, running="hold") as client:
        client.attach()
        assert client.quiesce()["parked_sequences"] == 2
        client.resume()
        with client.commit() as cycle:
            pass
        assert cycle.quiesce["parked_sequences"] == 2
        # one call may override the default
        with client.commit(running="finish") as cycle:
            pass
        assert cycle.quiesce["parked_sequences"] == 0
    assert engine.calls.count("park_running") == 2


def test_hold_on_an_engine_that_cannot_park_is_barrier_unavailable(server) -> None:
    install(server, None)
    with WeightsClient(server.url, TRN, heartbeat=False) as client:
        client.attach()
        with pytest.raises(trainer.BarrierUnavailable) as err, client.commit(running="hold"):
            pass
        assert err.value.reason == "hold_unsupported"
        assert client.status()["barrier"] == "serving"
        with client.commit():  # the connection is still usable; finish works
            pass
