"""The decode engine without a GPU (issue 13): bucket choice, the static cache's logic (run with
``graphs=False``: the eager-over-static-cache path a failed capture takes), the lifetime decisions
driven by the lifecycle's effects, and the fallbacks. tests/gpu/test_decode_graphs_cuda.py runs
the captured and compiled graphs for real on the H200."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miserver.fsm.table import Effect
from miserver.serving.engine import decode_graphs, generation
from miserver.serving.engine.decode_graphs import (
    DecodeEngine,
    EngineUnavailable,
    bucket_lengths,
    engine_for,
    pick_bucket,
    resolve_mode,
)
from miserver.serving.engine.generation import Finished, Generation, SamplingParams, TextDelta
from miserver.spec.settings import ConfigError, load_settings
from tests.unit.v1_fixtures import cached_tokenizer, tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return cached_tokenizer(tmp_path_factory.getbasetemp().parent / "miserver-v1-cache")


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model(tokenizer, context=64)


# --- buckets ------------------------------------------------------------------------------------
@pytest.mark.parametrize("context", [1, 100, 256, 257, 3000, 8192, 32768, 131072])
def test_buckets_double_up_to_the_context(context: int) -> None:
    buckets = bucket_lengths(context)
    assert buckets[-1] == context
    assert list(buckets) == sorted(set(buckets))
    for a, b in zip(buckets, buckets[1:-1], strict=False):
        assert b == 2 * a
    assert all(length >= 1 for length in buckets)


def test_pick_bucket_is_the_smallest_that_holds_the_positions() -> None:
    buckets = bucket_lengths(3000)
    for positions in (1, 255, 256, 257, 511, 512, 2048, 2049, 3000):
        chosen = pick_bucket(buckets, positions)
        assert chosen >= positions
        assert all(b < positions for b in buckets if b < chosen)
    with pytest.raises(ValueError, match="do not fit"):
        pick_bucket(buckets, 3001)


def test_bucket_lengths_refuses_an_empty_context() -> None:
    with pytest.raises(ValueError):
        bucket_lengths(0)


# --- the setting ----------------------------------------------------------------------------------
def test_decode_graphs_setting_is_validated(tmp_path) -> None:
    env = {"MISERVER_HOME": str(tmp_path)}
    assert load_settings(env).decode_graphs == "captured"
    for value in ("captured", "compiled", "off", "OFF"):
        assert load_settings({**env, "DECODE_GRAPHS": value}).decode_graphs == value.lower()
    with pytest.raises(ConfigError) as err:
        load_settings({**env, "DECODE_GRAPHS": "fast"})
    assert err.value.variable == "DECODE_GRAPHS"


def test_the_cpu_is_always_eager_and_says_why() -> None:
    for requested in ("captured", "compiled", "off"):
        mode, why = resolve_mode(requested, "cpu")
        assert mode == "off"
        assert (why is None) == (requested == "off")
    assert resolve_mode("compiled", "cuda:0") == ("compiled", None)
    with pytest.raises(ValueError, match="DECODE_GRAPHS"):
        resolve_mode("fast", "cpu")


def test_engine_for_a_cpu_resident_is_none_with_a_reason(model) -> None:
    reasons: list[str] = []
    engine, why = engine_for(model, "captured", 64, on_fallback=reasons.append)
    assert engine is None
    assert "CUDA" in why
    assert reasons == []  # the CPU is not a fallback: graphs never apply there


def test_a_failed_build_falls_back_with_a_metric(model, monkeypatch) -> None:
    reasons: list[str] = []
    monkeypatch.setattr(decode_graphs, "device_of", lambda _m: torch.device("cuda:0"))

    def broken(*_a, **_k):
        raise EngineUnavailable("memory", "the static KV cache needs 9 MiB, 1 MiB free")

    monkeypatch.setattr(decode_graphs, "DecodeEngine", broken)
    engine, why = engine_for(model, "captured", 64, on_fallback=reasons.append)
    assert engine is None and "MiB" in why
    assert reasons == ["memory"]

    def crash(*_a, **_k):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(decode_graphs, "DecodeEngine", crash)
    engine, why = engine_for(model, "compiled", 64, on_fallback=reasons.append)
    assert engine is None and "out of memory" in why
    assert reasons == ["memory", "build"]


# --- the static cache, eagerly ------------------------------------------------------------------
def _engine(model) -> DecodeEngine:
    return DecodeEngine(model, "captured", 64, buckets=(8, 16, 32, 64), graphs=False)


async def _tokens(model, tokenizer, prompt: str, engine=None, **kw) -> tuple[str, Finished, str]:
    ids = tokenizer(prompt)["input_ids"]
    gen = Generation(model, tokenizer, ids, SamplingParams(**kw), engine=engine)
    gen.start()
    events = [e async for e in gen.events()]
    await gen.wait()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    return text, events[-1], gen.timing.extra["decoder"]


@pytest.mark.parametrize(
    "prompt", ["Hello", "The capital of France is", "a b c d e f g h i j k l m n"]
)
async def test_static_cache_tokens_equal_the_eager_path_across_buckets(
    model, tokenizer, prompt
) -> None:
    engine = _engine(model)
    n = len(tokenizer(prompt)["input_ids"])
    max_tokens = 60 - n  # crosses every bucket boundary above the prompt
    eager, f_eager, kind_eager = await _tokens(
        model, tokenizer, prompt, temperature=0, max_tokens=max_tokens
    )
    static, f_static, kind_static = await _tokens(
        model, tokenizer, prompt, engine, temperature=0, max_tokens=max_tokens
    )
    assert kind_eager == "eager" and kind_static == "graphs:captured"
    assert static == eager
    assert f_static == f_eager
    # A second request over the same cache (its stale entries are masked) answers alike.
    again, _, _ = await _tokens(model, tokenizer, prompt, engine, temperature=0, max_tokens=9)
    first9, _, _ = await _tokens(model, tokenizer, prompt, temperature=0, max_tokens=9)
    assert again == first9


async def test_static_cache_logprobs_and_echo_match_the_eager_path(model, tokenizer) -> None:
    engine = _engine(model)
    ids = tokenizer("Paris is in")["input_ids"]
    out = []
    for eng in (None, engine):
        gen = Generation(
            model,
            tokenizer,
            ids,
            SamplingParams(max_tokens=12, temperature=0, logprobs=3, echo=True),
            engine=eng,
        )
        gen.start()
        out.append([e async for e in gen.events()])
        await gen.wait()
    eager, static = out
    assert len(eager[0].prompt_logprobs) == len(static[0].prompt_logprobs) == len(ids)
    lp_e = [lp for e in eager if isinstance(e, TextDelta) for lp in e.logprobs]
    lp_s = [lp for e in static if isinstance(e, TextDelta) for lp in e.logprobs]
    assert [lp.token_id for lp in lp_e] == [lp.token_id for lp in lp_s]
    for a, b in zip(lp_e, lp_s, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


async def test_a_full_context_ends_with_length(model, tokenizer, monkeypatch) -> None:
    # no end token, so that random weights cannot end the completion before the context does
    monkeypatch.setattr(generation, "end_token_ids", lambda model, tokenizer: frozenset())
    engine = _engine(model)
    ids = tokenizer("one two three")["input_ids"]
    gen = Generation(
        model, tokenizer, ids, SamplingParams(max_tokens=500, temperature=0), engine=engine
    )
    gen.start()
    events = [e async for e in gen.events()]
    await gen.wait()
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert finished.finish_reason == "length"
    assert len(ids) + finished.completion_tokens == 64 + 1


async def test_a_busy_engine_sends_the_second_generation_eager(model, tokenizer) -> None:
    engine = _engine(model)
    with engine.session(model) as first:
        assert first is not None
        _, finished, kind = await _tokens(
            model, tokenizer, "Hello", engine, temperature=0, max_tokens=5
        )
        assert kind == "eager"
        assert finished.completion_tokens >= 1


# --- lifetime -------------------------------------------------------------------------------------
def test_reset_zeroes_the_cache_before_the_next_prefill(model) -> None:
    engine = _engine(model)
    with torch.inference_mode(), engine.session(model) as s:
        s.prefill([1, 2, 3, 4, 5], all_logits=False)
        s.step(6)
    assert any(bool(k.abs().sum() > 0) for k in engine._keys)
    engine.reset()
    assert any(bool(k.abs().sum() > 0) for k in engine._keys)  # deferred: no work in the barrier
    with engine.session(model):
        assert all(bool(k.abs().sum() == 0) for k in (*engine._keys, *engine._values))
        assert int(engine._positions.abs().sum()) == 0


def test_a_session_for_another_module_tree_rebinds(model, tokenizer) -> None:
    engine = _engine(model)
    other = tiny_model(tokenizer, seed=1, context=64)
    engine._graphs[8] = None  # stands in for a captured bucket
    with engine.session(other) as s:
        assert s is not None
        assert engine.model is other
        assert engine._graphs == {}


def test_invalidate_and_close_wait_for_the_running_generation(model) -> None:
    engine = _engine(model)
    engine._graphs[8] = None
    with engine.session(model) as s:
        assert s is not None
        engine.invalidate()
        engine.close()
        assert engine._graphs == {8: None}  # the running generation keeps what it uses
        assert engine.closed
    assert engine._graphs == {}
    assert engine._keys == []
    with engine.session(model) as s:
        assert s is None


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.closed = False

    def reset(self) -> None:
        self.calls.append("reset")

    def invalidate(self) -> None:
        self.calls.append("invalidate")


@pytest.mark.parametrize(
    ("effect", "expected"),
    [
        (Effect.DROP_CACHE, ["reset"]),
        (Effect.BEGIN_ADAPTER_CHANGE, ["invalidate"]),
        (Effect.START_MODEL_LOAD, ["invalidate"]),
        (Effect.START_MODEL_UNLOAD, ["invalidate"]),
        (Effect.BEGIN_SAVE, []),
        (Effect.BEGIN_WEIGHTS_LOAD, []),
        (Effect.HOLD_ADMISSIONS, []),
        (Effect.RELEASE_HELD, []),
    ],
)
def test_graph_lifetime_follows_the_lifecycle_effects(effect, expected) -> None:
    from types import SimpleNamespace

    from miserver.serving.weights.runtime import WeightsRuntime

    recorder = _Recorder()
    runtime = WeightsRuntime.__new__(WeightsRuntime)
    runtime.host = SimpleNamespace(resident=SimpleNamespace(engine=recorder))
    runtime._decode_engine_effect(effect)
    assert recorder.calls == expected


def test_the_host_closes_a_dropped_residents_engine(tmp_path) -> None:
    from types import SimpleNamespace

    from miserver.serving.models.catalogue import Catalogue
    from miserver.serving.models.host import ModelHost

    settings = load_settings({"MISERVER_HOME": str(tmp_path), "DEFAULT_MODEL": ""})
    host = ModelHost(settings, Catalogue(settings.home))
    closed: list[bool] = []
    engine = SimpleNamespace(close=lambda: closed.append(True))
    host.resident = SimpleNamespace(
        engine=engine,
        arena=None,
        row=SimpleNamespace(name="m", id=1),
        names=lambda: ("m",),
    )
    host._drop_resident()
    assert closed == [True]
    assert host.resident is None


def test_generation_with_an_engine_still_cancels_between_steps(model, tokenizer) -> None:
    engine = _engine(model)

    async def main() -> Finished:
        ids = tokenizer("Count to a hundred:")["input_ids"]
        gen = Generation(
            model, tokenizer, ids, SamplingParams(max_tokens=50, temperature=0), engine=engine
        )
        gen.cancel()
        gen.start()
        events = [e async for e in gen.events()]
        await gen.wait()
        return events[-1]

    finished = asyncio.run(main())
    assert finished.finish_reason == "cancelled"
