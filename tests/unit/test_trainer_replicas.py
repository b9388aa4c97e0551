"""The trainer's client over several replicas (contract section 10): :class:`ReplicaSet` against
two real apps serving a tiny Llama on the CPU in this process (their own event loop, real TCP
ports), gloo over loopback. One broadcast writes both arenas; a refusal names the replica and
the call, and says what was done about the others."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from aiohttp import web

from miserver.http import keys
from miserver.http.app import create_app
from miserver.serving.models.catalogue import Catalogue
from miserver.spec.settings import load_settings
from miserver.trainer.client import WeightsClient
from miserver.trainer.replicas import ReplicaRefused, ReplicaSet
from tests.unit.test_weights_routes import TRN, TRN2
from tests.waiting import wait_until


class _Servers:
    """Apps on a private event loop in a thread, each on a free loopback port."""

    def __init__(self, settings_list) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.apps, self.runners, self.urls = [], [], []
        for settings in settings_list:
            app = create_app(settings)
            runner = web.AppRunner(app)
            self._run(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            self._run(site.start())
            self._run(app[keys.STARTUP_LOAD])
            self.apps.append(app)
            self.runners.append(runner)
            self.urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")

    def _run(self, coro):
        async def wrapped():
            return await coro

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(120)

    def arena(self, i: int) -> torch.Tensor:
        (st,) = self.apps[i][keys.HOST].resident.arena.storages
        return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))

    def close(self) -> None:
        for runner in self.runners:
            self._run(runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture
def servers(tmp_path, tiny_model_dir):
    settings = []
    for i in (1, 2):
        home = tmp_path / f"home{i}"
        Catalogue(str(home)).register(
            name="tiny", format="safetensors", dtype="bfloat16", path=tiny_model_dir
        )
        settings.append(
            load_settings(
                {
                    "MISERVER_HOME": str(home),
                    "DEFAULT_MODEL": "tiny",
                    "DEVICE": "cpu",
                    "WEIGHTS_TOKENS": f"trn:trainer:{TRN},trn2:trainer:{TRN2}",
                    "WEIGHTS_CPU_ATTACH": "1",
                    "WEIGHTS_COMMIT_WATCHDOG_MS": "400" if i == 2 else "20000",
                }
            )
        )
    s = _Servers(settings)
    yield s
    s.close()


def _status(url: str) -> dict:
    with WeightsClient(url, TRN, heartbeat=False) as c:
        return c.status()


def test_one_broadcast_writes_both_replicas_and_counts_a_commit_on_each(servers):
    with ReplicaSet(servers.urls, TRN, timeout_s=60) as replicas:
        weights = replicas.attach()
        assert [b["storages"][0]["kind"] for b in replicas.bodies] == ["process_group"] * 2
        weights.buffers[0].copy_(servers.arena(0))
        with torch.no_grad():
            weights["model.norm.weight"].fill_(0.25)
        with replicas.commit() as bracket:
            assert [b["weights_state"] for b in bracket.begun] == ["writing", "writing"]
        assert bracket.sends == 1 and bracket.sent == weights.nbytes[0]
        assert replicas.steps_since_load == [1, 1]
        for i in (0, 1):
            assert torch.equal(servers.arena(i), weights.buffers[0])
        statuses = replicas.status()
        assert [s["attachment"]["process_group"]["rank"] for s in statuses] == [1, 2]
        assert all(s["barrier"] == "serving" for s in statuses)
    assert [_status(u)["attached"] for u in servers.urls] == [False, False]


def test_an_attach_refused_by_one_replica_names_it_and_detaches_the_other(servers):
    with WeightsClient(servers.urls[1], TRN2, heartbeat=False) as other:
        other.attach()  # replica 2 is taken
        replicas = ReplicaSet(servers.urls, TRN, timeout_s=60)
        with pytest.raises(ReplicaRefused) as info:
            replicas.attach()
        replicas.close()
        err = info.value
        assert [(url, call) for url, call, _ in err.failures] == [(servers.urls[1], "attach")]
        assert err.codes == {servers.urls[1]: "ALREADY_ATTACHED"}
        assert servers.urls[1] in str(err) and "detached again" in str(err)
        assert _status(servers.urls[0])["attached"] is False


def test_a_quiesce_refused_by_one_replica_resumes_the_other_and_writes_nothing(servers):
    with ReplicaSet(servers.urls, TRN, timeout_s=60) as replicas:
        weights = replicas.attach()
        before = [servers.arena(i).clone() for i in (0, 1)]
        # replica 2's own client opens a commit there and never sends: its watchdog (400 ms)
        # tears the set and destroys its group
        second = replicas.clients[1]
        second.quiesce()
        second.commit_begin()
        wait_until(lambda: _status(servers.urls[1])["weights_state"] == "torn", "torn")
        weights.buffers[0].fill_(1)
        with pytest.raises(ReplicaRefused) as info, replicas.commit():
            pytest.fail("the block must not run")
        err = info.value
        assert [(url, call) for url, call, _ in err.failures] == [(servers.urls[1], "quiesce")]
        assert err.codes[servers.urls[1]] == "WEIGHTS_NOT_CLEAN"  # torn: checked first
        assert "resumed; nothing written" in str(err)
        one = _status(servers.urls[0])
        assert one["barrier"] == "serving" and one["weights_state"] == "clean"
        assert one["steps_since_load"] == 0
        for i in (0, 1):
            assert torch.equal(servers.arena(i), before[i])
        pg = _status(servers.urls[1])["attachment"]["process_group"]
        assert pg["group_state"] == "destroyed"
