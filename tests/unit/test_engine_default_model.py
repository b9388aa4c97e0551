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


LONG_PROMPTS = [  # each longer than MAX_ROWS tokens: a whole prefill exceeds the small kernel
    "The history of the river valley begins with the first farmers who settled along its "
    "banks, planting barley and wheat in the rich soil left by the yearly floods. Over many "
    "centuries the villages grew into towns, and then",
    "Dear committee, I am writing to apply for the position of assistant librarian at the "
    "town library. I have worked with books and readers for many years, in schools and in "
    "the county archive, and I",
    "Recipe for bread: mix flour, water, salt and yeast in a large bowl, knead the dough "
    "for ten minutes until smooth and elastic, let it rise in a warm place for about an hour, "
    "then shape it and",
]


def _scored(engine: ContinuousEngine) -> dict[Any, list[tuple[int, float]]]:
    got: dict[Any, list[tuple[int, float]]] = {}
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.seq_id, []).extend(
                (lp.token_id, lp.logprob) for lp in o.logprobs or ()
            )
    return got


@pytest.mark.timeout(1500)
def test_logprobs_are_bit_identical_alone_together_and_after_a_recompute(
    loaded: tuple[Any, Any],
) -> None:
    """The server's shapes (whole prompts of more than 32 tokens in one chunk, several in one
    step): every token's logprob is the same float alone, beside the others, and after a
    preemption's recompute, so the CPU rounds a sequence's rows the same whatever runs beside
    it (model_runner: a prefill chunk per forward pass, one-query rows at most MAX_ROWS a pass;
    step_scheduler: a recompute's generated positions as one-query rows). The prompts are
    longer than LINEAR_MAX_ROWS: beside each other in one pass, ``F.linear`` would round them
    otherwise."""
    from miserver.serving.engine.model_runner import LINEAR_MAX_ROWS as MAX_ROWS

    model, tok = loaded
    ids = [tok(p)["input_ids"] for p in LONG_PROMPTS]
    assert min(len(p) for p in ids) > MAX_ROWS
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=0)

    def engine(blocks: int) -> ContinuousEngine:
        budget = cache_shape(model).bytes_per_token * 16 * (blocks + 1)
        return ContinuousEngine(model, budget, prefix_cache=False)

    alone = []
    for i, p in enumerate(ids):
        e = engine(64)
        e.add(Sequence(i, p, params))
        alone.append(_scored(e)[i])
    together = engine(64)
    for i, p in enumerate(ids):
        together.add(Sequence(i, p, params))
    got = _scored(together)
    assert together.stats()["steps"] == 16  # the three prompts in one step, then decodes
    assert [got[i] for i in range(3)] == alone
    small = engine(7)  # 3 sequences of 3 blocks, then 4: preempted and recomputed
    for i, p in enumerate(ids):
        small.add(Sequence(i, p, params))
    got = _scored(small)
    assert small.stats()["preemptions"] > 0 and small.stats()["recomputes"] > 0
    assert [got[i] for i in range(3)] == alone


@pytest.mark.timeout(1500)
def test_speculation_keeps_the_default_models_greedy_text(loaded: tuple[Any, Any]) -> None:
    """Prompt-lookup speculation on the default model: the same tokens as the engine without
    it (bit-identical rows in bfloat16), for a lone story and for three beside each other, with
    drafts kept (the story repeats itself) and some rejected."""
    from miserver.serving.engine import speculation

    model, tok = loaded
    chat = [{"role": "user", "content": "Write a long story about the sea."}]
    story = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    prompts = [story["input_ids"], *(tok(p)["input_ids"] for p in PROMPTS[1:])]
    for count in (1, 3):
        got, stats = [], []
        for tokens in (speculation.DRAFT_TOKENS, 0):
            budget = cache_shape(model).bytes_per_token * 16 * 65
            engine = ContinuousEngine(model, budget, speculative_tokens=tokens)
            for i in range(count):
                engine.add(Sequence(i, prompts[i], SamplingParams(max_tokens=96, temperature=0)))
            got.append(_drain(engine))
            stats.append(engine.stats())
        assert got[0] == got[1], count
        assert stats[0]["accepted_draft_tokens"] > 0
        assert stats[0]["steps"] < stats[1]["steps"]


def test_products_moving_between_thread_counts_keep_the_greedy_text(
    loaded: tuple[Any, Any],
) -> None:
    """``CPU_MATMUL_THREADS``: a pass's products on 2 threads or on 1, the count changing from
    pass to pass (as :class:`~miserver.serving.engine.cpu_linear.MatmulThreads` may), give the
    same tokens as every product on the thread's own count: three sequences beside each
    other, and every pass's count recorded."""
    model, tok = loaded
    ids = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    got, counts = [], []
    for threads in (None, 2):
        budget = cache_shape(model).bytes_per_token * 16 * 65
        engine = ContinuousEngine(model, budget, speculative_tokens=0, matmul_threads=threads)
        engine.runner.settle_matmul_threads()  # what the first pass does
        chooser = engine.runner.threads
        assert (chooser is None) == (threads is None)
        if chooser is not None:
            turn = iter(range(10**6))
            record = chooser.record

            def choose(rows: int, turn: Any = turn) -> int:
                return 2 if next(turn) % 2 else 1  # every other pass

            def timed(rows: int, t: int, s: float, record: Any = record) -> None:
                counts.append(t)
                record(rows, t, s)

            chooser.choose, chooser.record = choose, timed
        for i, p in enumerate(ids):
            engine.add(Sequence(i, p, SamplingParams(max_tokens=24, temperature=0)))
        got.append(_drain(engine))
    assert got[0] == got[1]
    assert set(counts) == {1, 2}
