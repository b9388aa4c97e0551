"""The trainer's client retries a barrier call refused with ``Retry-After`` within a bound it
documents (issue 32 item 11), against the real server: its interactive queue is made full for
the next quiesce decisions, so the lifecycle table itself refuses ``503 QUEUE_FULL`` with
``Retry-After: 1`` (weights page: The write cycle 2), audited by the route as usual."""

from __future__ import annotations

import time

import pytest
import torch

from miserver import trainer
from miserver.http import keys
from miserver.trainer import WeightsClient
from tests.unit.test_trainer_client import TRN, ThreadServer, _audit_settled


@pytest.fixture
def server(tmp_path, tiny_model_dir):
    s = ThreadServer(tmp_path, tiny_model_dir)
    yield s
    s.stop()


def _queue_full_for(server, decisions: int | None) -> list[float]:
    """The next ``decisions`` quiesce decisions (None: every one) see a full queue; returns the
    list the ``time.monotonic()`` of each such decision is appended to."""
    refusals = server.app[keys.WEIGHTS].refusals
    real = refusals.queue_full
    seen: list[float] = []

    def queue_full(*args, **kwargs):
        if decisions is None or len(seen) < decisions:
            seen.append(time.monotonic())
            return True
        return real(*args, **kwargs)

    refusals.queue_full = queue_full
    return seen


def _quiesce_lines(server, count: int) -> list[tuple[str, str, str | None]]:
    lines = _audit_settled(server, count)
    return [(x["operation"], x["outcome"], x["code"]) for x in lines if "quiesce" in x["operation"]]


def test_a_commit_whose_quiesce_finds_the_queue_full_is_retried_and_goes_through(server):
    with WeightsClient(server.url, TRN, timeout=30, heartbeat=False) as client:
        att = client.attach()
        seen = _queue_full_for(server, 2)
        name = "model.norm.weight"
        with client.commit() as cycle, torch.no_grad():
            att.tensors[name].fill_(0.25)
        assert cycle.steps_since_load == 1 and client.retries == 2
        assert len(seen) == 2 and seen[1] - seen[0] >= 0.9  # the server's Retry-After: 1 s
        status = client.status()
        assert status["weights_state"] == "clean" and status["barrier"] == "serving"
        assert _quiesce_lines(server, 10) == [
            ("weights_quiesce", "refused", "QUEUE_FULL"),
            ("weights_quiesce", "refused", "QUEUE_FULL"),
            ("weights_quiesce", "accepted", None),
        ]
        # a single call too
        _queue_full_for(server, 1)
        assert client.quiesce()["weights_state"] == "clean" and client.retries == 3
        client.resume()


def test_retries_stop_at_the_documented_bound_and_raise_the_last_refusal(server):
    with WeightsClient(server.url, TRN, timeout=30, heartbeat=False, retry_within_s=2.5) as client:
        client.attach()
        seen = _queue_full_for(server, None)
        t0 = time.monotonic()
        with pytest.raises(trainer.QueueFull) as exc, client.commit():
            pytest.fail("the block must not run")
        elapsed = time.monotonic() - t0
        # tries at 0, 1 and 2 s; a fourth would go out at 3 s, past the 2.5 s bound
        assert len(seen) == 3 and client.retries == 2
        assert 1.9 <= elapsed < 2.5 + 1.0
        assert exc.value.status == 503 and exc.value.retry_after_s == 1
        assert client.status()["barrier"] == "serving"  # nothing was held


def test_no_retry_without_retry_after_or_with_retries_off(server):
    with WeightsClient(server.url, TRN, timeout=30, heartbeat=False, retry_within_s=0) as client:
        client.attach()
        seen = _queue_full_for(server, 1)
        with pytest.raises(trainer.QueueFull):
            client.quiesce()
        assert len(seen) == 1 and client.retries == 0
    with WeightsClient(server.url, TRN, timeout=30, heartbeat=False) as client:
        client.attach()
        with pytest.raises(trainer.NotQuiesced):  # a refusal without Retry-After: once
            client.commit_begin()
        assert client.retries == 0
        lines = [x["operation"] for x in _audit_settled(server, 6)]
        assert lines.count("weights_commit_begin") == 1
