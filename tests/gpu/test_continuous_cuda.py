"""The continuous engine on a real CUDA card (issues 29 and 34): the decode graphs per (rows,
width) bucket over the paged cache against the same engine without graphs, a trainer's in-place
write seen by graphs captured before it, and a served CUDA resident.
Skipped without CUDA (run on the GPU machine); tests/unit/test_engine_core.py covers the same
code on the CPU with a fake graph."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.gpu.chats import CHATS as SHARED_CHATS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEVICE = torch.device("cuda:0")
# the shared chats, the last one long: a wider block table
CHATS = [*SHARED_CHATS[:-1], (SHARED_CHATS[-1] + " ") * 30]


@pytest.fixture(scope="module")
def default_model(default_home):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miserver.serving.models.default_model import model_dir

    folder = model_dir(default_home)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval().to(DEVICE)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = []
    for c in CHATS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True
        )
        prompts.append(ids if isinstance(ids, list) else ids["input_ids"])
    return model, prompts


def _engine(model: Any, graphs: str, **kw: Any) -> Any:
    from miserver.serving.engine.continuous import ContinuousEngine

    return ContinuousEngine(model, 256 << 20, max_num_seqs=8, decode_graphs=graphs, **kw)


def _greedy(engine: Any, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Every prompt's greedy tokens, all added at once (staggered lengths: rows leave as they
    end, so the batch shrinks through several row buckets)."""
    from miserver.serving.engine.generation import SamplingParams
    from miserver.serving.engine.sequence import Sequence

    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add(Sequence(i, p, SamplingParams(max_tokens=n, temperature=0)))
    out: dict[Any, list[int]] = {i: [] for i in range(len(prompts))}
    with torch.inference_mode():
        for _ in range(10_000):
            if not engine.has_work():
                break
            for o in engine.step():
                out[o.seq_id] += o.new_token_ids
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("mode", ["captured", "compiled"])
def test_decode_graphs_follow_the_engine_without_graphs(default_model, mode) -> None:
    """Eight prompts (one of about 400 tokens), staggered lengths 8-36: the captured graphs
    (``compiled``: of the ``torch.compile``'d forward) against the same engine's eager
    per-step path. Equal to rounding (other kernels per bucket):
    every first token and most sequences agree; graphs were replayed; the narrowest width that
    holds the longest sequence was used; the served parameters did not move."""
    model, prompts = default_model
    ptrs = [p.data_ptr() for p in model.parameters()]
    lengths = [8 + 4 * i for i in range(len(prompts))]
    eager = _greedy(_engine(model, "off"), prompts, lengths)
    graphed_engine = _engine(model, mode)
    graphed = _greedy(graphed_engine, prompts, lengths)
    graphs = graphed_engine.runner.graphs
    same = sum(a == b for a, b in zip(eager, graphed, strict=True))
    print(
        f"continuous engine, {mode} graphs: {same}/{len(prompts)} sequences as without graphs;"
        f" buckets captured {graphs.captured}, replays {graphs.replays}, failed {graphs.failed}"
    )
    assert not graphs.failed and graphs.replays > 0
    assert {w for _, w in graphs.captured} <= {16, 32, 64}  # never the whole context's width
    assert {r for r, _ in graphs.captured} >= {1, 8}
    assert all(a[0] == b[0] for a, b in zip(eager, graphed, strict=True))
    assert same >= len(prompts) - 2
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_packed_prefill_follows_each_chunk_attended_alone(default_model) -> None:
    """The eight prompts admitted in one step: their chunks attended in packs (one masked call a
    layer, the CUDA default) against one call a chunk. Equal to rounding: every first token and
    most sequences agree, and the packed path ran."""
    from miserver.serving.engine import paged_attention

    model, prompts = default_model
    lengths = [8 + 4 * i for i in range(len(prompts))]
    alone_engine = _engine(model, "off", packed_prefill=False)
    assert not alone_engine.runner.packed_prefill
    alone = _greedy(alone_engine, prompts, lengths)
    calls: list[int] = []
    real = paged_attention._packed_prefill

    def counting(*args: Any, **kw: Any) -> None:
        calls.append(1)
        real(*args, **kw)

    paged_attention._packed_prefill = counting
    try:
        packed_engine = _engine(model, "off")
        assert packed_engine.runner.packed_prefill  # the CUDA default
        packed = _greedy(packed_engine, prompts, lengths)
    finally:
        paged_attention._packed_prefill = real
    same = sum(a == b for a, b in zip(alone, packed, strict=True))
    print(f"packed prefill: {same}/{len(prompts)} sequences as alone; pack calls {len(calls)}")
    assert calls
    assert all(a[0] == b[0] for a, b in zip(alone, packed, strict=True))
    assert same >= len(prompts) - 2


def test_decode_graphs_serve_an_in_place_write(default_model) -> None:
    """Graphs captured, then every parameter written in place (a trainer's commit): the graphed
    engine's greedy tokens on the written weights follow the eager engine's on the same weights,
    and differ from what the graphs gave before the write (a graph that missed the write would
    repeat the old tokens)."""
    model, prompts = default_model
    prompts = prompts[:4]
    lengths = [12] * len(prompts)
    saved = [p.detach().clone() for p in model.parameters()]
    engine = _engine(model, "captured")
    try:
        before = _greedy(engine, prompts, lengths)
        captured = list(engine.runner.graphs.captured)
        g = torch.Generator(device=DEVICE).manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                noise = torch.randn(p.shape, generator=g, device=DEVICE, dtype=p.dtype)
                p.add_(noise * p.std() * 0.25)
        engine.drop_prefix_cache()
        after = _greedy(engine, prompts, lengths)
        eager = _greedy(_engine(model, "off"), prompts, lengths)
    finally:
        with torch.no_grad():
            for p, s in zip(model.parameters(), saved, strict=True):
                p.copy_(s)
    print(f"after an in-place write: before {before}\n after {after}\n eager {eager}")
    assert engine.runner.graphs.captured == captured  # replayed, not recaptured
    assert sum(a != b for a, b in zip(before, after, strict=True)) >= 3
    assert all(a[0] == e[0] for a, e in zip(after, eager, strict=True))
    assert sum(a == e for a, e in zip(after, eager, strict=True)) >= len(prompts) - 1


async def test_a_served_cuda_resident_runs_the_continuous_engine(tmp_path, tiny_model_dir) -> None:
    """The continuous engine on ``cuda:0``: a chat with ``n`` = 4 answers four choices, the
    health route and ``/metrics`` show the paged cache, and the engine replayed graphs."""
    from tests.unit.test_weights_routes import make_client

    client = await make_client(tmp_path, tiny_model_dir, DEVICE="cuda:0", KV_CACHE_BYTES="64MiB")
    try:
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 8,
                "n": 4,
                "temperature": 1.0,
                "seed": 1,
            },
        )
        body = await r.json()
        assert r.status == 200, body
        assert len(body["choices"]) == 4
        health = await (await client.get("/api/health/detailed")).json()
        text = str(health)
        print("health:", text[:600])
        assert "kv_cache" in text
        metrics = await (await client.get("/metrics")).text()
        assert "kv_cache" in metrics
    finally:
        await client.close()
