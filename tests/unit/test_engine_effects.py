"""What the lifecycle's effects do to a resident's continuous engine (issue 29; issue 13's graph
lifetime), its ``DECODE_GRAPHS`` setting, and the engine's end with its resident: no model,
no server (the engine is a recorder; tests/gpu/test_decode_graphs_cuda.py replays real graphs
through a reload, a swap and an adapter on CUDA)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from miserver.fsm.table import Effect
from miserver.spec.settings import ConfigError, load_settings


class _LoopRecorder:
    """The engine thread's side the effects call (:class:`EngineLoop`), recording each call."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.closed = False

    def drop_prefix_cache(self) -> int:
        self.calls.append("drop_prefix_cache")
        return 0

    def drop_graphs(self) -> None:
        self.calls.append("drop_graphs")

    def close(self, wait_s: float = 0.0) -> None:
        self.calls.append("close")
        self.closed = True


def test_decode_graphs_setting_is_validated(tmp_path) -> None:
    env = {"MISERVER_HOME": str(tmp_path)}
    assert load_settings(env).decode_graphs == "captured"
    for value in ("captured", "compiled", "off", "OFF"):
        assert load_settings({**env, "DECODE_GRAPHS": value}).decode_graphs == value.lower()
    with pytest.raises(ConfigError) as err:
        load_settings({**env, "DECODE_GRAPHS": "fast"})
    assert err.value.variable == "DECODE_GRAPHS"


@pytest.mark.parametrize(
    ("effect", "expected"),
    [
        (Effect.DROP_CACHE, ["drop_prefix_cache"]),
        (Effect.BEGIN_ADAPTER_CHANGE, ["drop_graphs"]),
        (Effect.START_MODEL_LOAD, ["drop_graphs"]),
        (Effect.START_MODEL_UNLOAD, ["drop_graphs"]),
        (Effect.FENCE_ARENA, ["drop_graphs"]),  # the served set moved to fresh storages
        (Effect.BEGIN_SAVE, []),
        (Effect.BEGIN_WEIGHTS_LOAD, []),
        (Effect.HOLD_ADMISSIONS, []),
        (Effect.RELEASE_HELD, []),
    ],
)
def test_graph_and_prefix_cache_lifetime_follow_the_lifecycle_effects(effect, expected) -> None:
    from miserver.serving.weights.runtime import WeightsRuntime

    recorder = _LoopRecorder()
    runtime = WeightsRuntime.__new__(WeightsRuntime)
    runtime.host = SimpleNamespace(resident=SimpleNamespace(engine_loop=recorder))
    runtime._decode_engine_effect(effect)
    assert recorder.calls == expected


def test_effects_on_a_resident_without_an_engine_do_nothing() -> None:
    """A GGUF resident (llama.cpp decodes) and no resident at all: nothing to drop, no error."""
    from miserver.serving.weights.effects import decode_engine_effect

    for resident in (None, SimpleNamespace(engine_loop=None)):
        for effect in (Effect.DROP_CACHE, Effect.FENCE_ARENA, Effect.START_MODEL_LOAD):
            decode_engine_effect(SimpleNamespace(resident=resident), effect)


def test_the_host_closes_a_dropped_residents_engine(tmp_path) -> None:
    from miserver.serving.models.catalogue import Catalogue
    from miserver.serving.models.host import ModelHost

    settings = load_settings({"MISERVER_HOME": str(tmp_path), "DEFAULT_MODEL": ""})
    host = ModelHost(settings, Catalogue(settings.home))
    loop = _LoopRecorder()
    host.resident = SimpleNamespace(
        engine_loop=loop,
        arena=None,
        model=None,
        row=SimpleNamespace(name="m", id=1, format="safetensors"),
        names=lambda: ("m",),
    )
    host._drop_resident()
    assert loop.calls == ["close"]
    assert host.resident is None


def test_the_decode_graph_gauges_and_cuda_memory_read_the_engines_graphs() -> None:
    """``/metrics``' decode-graph gauges and ``cuda_memory[].decode_graphs_mb`` read the
    continuous engine's graphs (``stats()["decode_graphs"]``); 0 without an engine."""
    import torch

    from miserver.serving.metrics import Metrics
    from miserver.serving.weights.views import _with_decode_memory

    def gauges(metrics: Metrics) -> dict[str, float]:
        text = metrics.render()[0].decode()
        names = ("graph_pool_bytes", "graphs_captured", "graph_replays")
        return {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line.startswith(tuple(f"miserver_decode_{n} " for n in names))
        }

    metrics = Metrics()
    assert set(gauges(metrics).values()) == {0.0}
    graphs = {"mode": "captured", "captured": [[1, 16], [8, 16]], "replays": 7, "bytes": 3 << 20}
    loop = SimpleNamespace(
        closed=False,
        engine=SimpleNamespace(device=torch.device("cuda:0")),
        stats=lambda: {"cache_bytes": 64 << 20, "decode_graphs": graphs},
    )
    metrics.set_engine_loop(loop)
    assert gauges(metrics) == {
        "miserver_decode_graph_pool_bytes": float(3 << 20),
        "miserver_decode_graphs_captured": 2.0,
        "miserver_decode_graph_replays": 7.0,
    }
    cards = _with_decode_memory(
        [{"device_index": 0, "allocated_mb": 1.0, "reserved_mb": 2.0}],
        SimpleNamespace(engine_loop=loop),
    )
    assert cards[0]["kv_cache_mb"] == 64.0 and cards[0]["decode_graphs_mb"] == 3.0
