"""The continuous engine on the default model (SmolLM2-135M-Instruct, bfloat16, CPU; issue 29):
the greedy text of a sequence is the model's own (``generate``) and does not depend on what runs
beside it (mixed lengths, staggered arrivals, a small cache that forces preemption)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from miserver.serving.engine.continuous import ContinuousEngine
from miserver.serving.engine.generation import SamplingParams
from miserver.serving.engine.kv_cache import cache_shape
from miserver.serving.engine.sequence import Sequence

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea and the wind:",
    "def fibonacci(n):",
]
TOKENS = [12, 6, 9]


@pytest.fixture(scope="module")
def loaded(default_home: str) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miserver.serving.models.default_model import model_dir

    path = model_dir(default_home)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared CI machine: no spinning OpenMP team (same bits either way)
    yield model, AutoTokenizer.from_pretrained(path)
    torch.set_num_threads(threads)


def _engine(model: Any, blocks: int = 64, block_size: int = 16) -> ContinuousEngine:
    budget = cache_shape(model).bytes_per_token * block_size * (blocks + 1)
    return ContinuousEngine(
        model, budget, block_size=block_size, prefill_chunk=16, max_num_batched_tokens=32
    )


def _drain(engine: ContinuousEngine) -> dict[Any, list[int]]:
    got: dict[Any, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.seq_id, []).extend(o.new_token_ids)
    return got


@pytest.mark.timeout(1500)
def test_greedy_text_is_independent_of_batch_neighbours(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    alone = []
    for i, p in enumerate(ids):
        engine = _engine(model)
        engine.add(Sequence(i, p, SamplingParams(max_tokens=TOKENS[i], temperature=0)))
        alone.append(_drain(engine)[i])
    with torch.inference_mode():
        hf = model.generate(torch.tensor([ids[0]]), max_new_tokens=TOKENS[0], do_sample=False)
    assert alone[0] == hf[0, len(ids[0]) :].tolist()  # the model's own greedy text
    # together: staggered arrivals, mixed lengths, chunked prefills beside decodes
    engine = _engine(model)
    got: dict[Any, list[int]] = {}
    for i, p in enumerate(ids):
        engine.add(Sequence(i, p, SamplingParams(max_tokens=TOKENS[i], temperature=0)))
        for o in engine.step():
            got.setdefault(o.seq_id, []).extend(o.new_token_ids)
    for k, v in _drain(engine).items():
        got.setdefault(k, []).extend(v)
    assert [got[i] for i in range(3)] == alone
    # a cache too small for the three at once: preempted, recomputed, the same text
    small = _engine(model, blocks=6, block_size=4)  # 14 blocks wanted at once
    for i, p in enumerate(ids):
        small.add(Sequence(i, p, SamplingParams(max_tokens=TOKENS[i], temperature=0)))
    assert [_d[i] for _d in [_drain(small)] for i in range(3)] == alone
    assert small.stats()["preemptions"] > 0
