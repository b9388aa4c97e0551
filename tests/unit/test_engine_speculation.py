"""Prompt-lookup speculation (miserver/serving/engine/speculation.py): drafts from the
sequence's own tokens, verified in one step as one-query rows, greedy text unchanged."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from miserver.serving.engine import speculation
from miserver.serving.engine.continuous import ContinuousEngine
from miserver.serving.engine.sampling import SamplingParams
from miserver.serving.engine.sequence import Sequence
from tests.tiny_llama import sharp_tiny_llama
from tests.unit.test_engine_core import VOCAB, greedy, make_engine, run

LOOPS = [[5, 6, 7, 8] * 6, [9, 2, 44, 9, 2, 44, 9, 2], list(range(20, 40)) * 2, [3, 1, 3, 1, 3]]


@pytest.fixture(scope="module")
def model() -> Any:
    """The sharp tiny Llama in bfloat16 (speculation runs where a drafted step's rows are
    bit-identical to plain decodes), its attention outputs scaled by 0.02: its greedy text
    falls into short loops (so drafts are proposed, some kept, some not) while attention still
    shapes every token."""
    looping = sharp_tiny_llama(VOCAB)
    with torch.no_grad():
        for layer in looping.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.02)
    return looping.to(torch.bfloat16)


def test_propose_takes_what_followed_the_latest_longest_recurrence() -> None:
    propose = speculation.propose
    assert propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    # the longest suffix wins over a later, shorter one
    assert propose([1, 2, 3, 7, 5, 2, 3, 8, 1, 2, 3], 3, ngram_max=3) == [7, 5, 2]
    # among equal lengths, the latest occurrence
    assert propose([4, 5, 1, 4, 5, 2, 4, 5], 1) == [2]
    assert propose([1, 2, 3, 4], 3) == []  # nothing recurs
    assert propose([7, 1, 9, 1], 2) == []  # a one-token match is below NGRAM_MIN (2)
    assert propose([7, 1, 9, 1], 2, ngram_min=1) == [9, 1]
    assert propose([1, 2, 1, 2], 0) == []
    assert propose([5], 3) == []
    # the proposal stops at the end of the tokens
    assert propose([1, 2, 1, 2], 5) == [1, 2]


def _spec_and_plain(model: Any, params: list[SamplingParams], **kw: Any) -> tuple[Any, Any, Any]:
    results = []
    for tokens in (speculation.DRAFT_TOKENS, 0):
        engine = make_engine(model, speculative_tokens=tokens, **kw)
        for i, (p, sp) in enumerate(zip(LOOPS, params, strict=False)):
            engine.add(Sequence(i, p, sp, stop_token_ids=frozenset(kw.get("stops", ()))))
        results.append((run(engine), engine.stats()))
    (spec, stats), (plain, plain_stats) = results
    assert plain_stats["draft_tokens"] == 0
    return spec, plain, stats


@pytest.mark.parametrize("together", [False, True])
def test_speculation_keeps_greedy_text_and_takes_fewer_steps(model: Any, together: bool) -> None:
    params = [greedy(n) for n in (40, 33, 25, 18)]
    if together:
        spec, plain, stats = _spec_and_plain(model, params)
    else:
        spec, plain, stats = {}, {}, {"draft_tokens": 0, "accepted_draft_tokens": 0, "steps": 0}
        steps_plain = 0
        for i, sp in enumerate(params):
            for tokens, into in ((speculation.DRAFT_TOKENS, spec), (0, plain)):
                engine = make_engine(model, speculative_tokens=tokens)
                engine.add(Sequence(i, LOOPS[i], sp))
                into.update(run(engine))
                if tokens:
                    for key in stats:
                        stats[key] += engine.stats()[key]
                else:
                    steps_plain += engine.stats()["steps"]
        assert stats["steps"] < steps_plain
    assert spec == plain
    assert all(len(spec[i]) == p.max_tokens for i, p in enumerate(params))
    assert stats["accepted_draft_tokens"] > 0
    assert stats["draft_tokens"] >= stats["accepted_draft_tokens"]


def test_a_stop_token_among_kept_drafts_ends_the_sequence_there(model: Any) -> None:
    plain_engine = make_engine(model, speculative_tokens=0)
    plain_engine.add(Sequence(0, LOOPS[0], greedy(40)))
    text = run(plain_engine)[0]
    stop = text[len(text) // 2]  # a token the sequence produces mid-way
    cut = text[: text.index(stop) + 1]
    for tokens in (speculation.DRAFT_TOKENS, 0):
        engine = make_engine(model, speculative_tokens=tokens)
        engine.add(Sequence(0, LOOPS[0], greedy(40), stop_token_ids=frozenset({stop})))
        outputs: list[Any] = []
        while engine.has_work():
            outputs += engine.step()
        assert [t for o in outputs for t in o.new_token_ids] == cut
        assert outputs[-1].finished and outputs[-1].finish_reason == "stop"


def test_a_cache_too_small_for_the_drafts_still_gives_the_same_text(model: Any) -> None:
    params = [greedy(n) for n in (30, 30, 30, 30)]
    spec, plain, stats = _spec_and_plain(model, params, blocks=40)
    assert spec == plain


def test_only_greedy_sequences_without_logprobs_or_echo_are_drafted(model: Any) -> None:
    kinds = [
        SamplingParams(max_tokens=20, temperature=0.8, seed=1),
        SamplingParams(max_tokens=20, temperature=0, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0, logprobs=0, echo=True),
    ]
    for sp in kinds:
        engine = make_engine(model)
        engine.add(Sequence(0, LOOPS[0], sp))
        run(engine)
        assert engine.stats()["draft_tokens"] == 0, sp
    assert make_engine(model).speculative_tokens == speculation.DRAFT_TOKENS  # on the CPU
    float32 = copy.deepcopy(model).float()  # its rows are not bit-identical across pass sizes
    assert make_engine(float32, speculative_tokens=4).speculative_tokens == 0
    with pytest.raises(ValueError, match="speculative_tokens"):
        make_engine(model, speculative_tokens=-1)


def test_no_drafts_beside_a_prefill_or_past_max_seqs(model: Any) -> None:
    engine = make_engine(model, max_num_seqs=16)
    for i in range(speculation.MAX_SEQS + 1):
        engine.add(Sequence(i, LOOPS[i % len(LOOPS)], greedy(12)))
    for _ in range(6):  # admitted and decoding: more than MAX_SEQS run
        engine.step()
    assert engine.stats()["draft_tokens"] == 0
    engine = make_engine(model, prefill_chunk=4, max_num_batched_tokens=8)
    engine.add(Sequence(0, LOOPS[1], greedy(30)))
    engine.step()
    engine.step()  # decoding now
    engine.add(Sequence(1, list(range(60, 100)), greedy(4)))  # a long prompt, in chunks of 4
    engine.step()
    drafted = engine.stats()["draft_tokens"]
    for _ in range(8):  # the prefill shares these steps: no drafts
        engine.step()
    assert engine.stats()["draft_tokens"] == drafted


def test_a_failed_step_leaves_no_draft_in_the_tokens(model: Any, monkeypatch) -> None:
    engine: ContinuousEngine = make_engine(model)
    engine.add(Sequence(0, LOOPS[1], greedy(40)))
    seq = engine._pending[0]
    real = engine.runner.run
    seen: list[list[int]] = []

    def boom(batch: Any) -> Any:
        if any(item.draft for item in batch):
            seen.append(list(seq.output_token_ids))
            raise RuntimeError("device lost")
        return real(batch)

    monkeypatch.setattr(engine.runner, "run", boom)
    outputs: list[Any] = []
    for _ in range(40):
        outputs = engine.step()
        if seen:
            break
    assert seen, "no step was drafted"
    assert outputs and outputs[0].finish_reason == "error"
    assert len(seq.output_token_ids) < len(seen[0])  # the drafts were taken off again
    assert seen[0][: len(seq.output_token_ids)] == seq.output_token_ids
    assert not engine._drafts


def test_kept_drafts_leave_the_cache_as_plain_decodes_do(model: Any) -> None:
    """The cached keys and values of every computed position after speculation are
    bit-identical to the engine's without it (a rejected draft's position is computed again
    with the right token)."""
    engines = {}
    for tokens in (speculation.DRAFT_TOKENS, 0):
        engine = make_engine(model, speculative_tokens=tokens, block_size=16)
        engine.add(Sequence(0, LOOPS[1], greedy(40)))
        seq = engine._pending[0]
        while len(seq.output_token_ids) < 36:
            engine.step()
        engines[tokens] = (engine, seq)
    (a, sa), (b, sb) = engines[speculation.DRAFT_TOKENS], engines[0]
    assert a.stats()["accepted_draft_tokens"] > 0
    assert a.stats()["draft_tokens"] > a.stats()["accepted_draft_tokens"]  # some rejected
    n = min(sa.num_computed_tokens, sb.num_computed_tokens)
    assert sa.token_ids()[:n] == sb.token_ids()[:n]
    bs = a.blocks.block_size
    assert n > 40 and bs == 16
    for pool_a, pool_b in ((a.cache.keys, b.cache.keys), (a.cache.values, b.cache.values)):
        for layer in range(len(pool_a)):
            ka = torch.cat([pool_a[layer][blk] for blk in sa.block_table]).flatten(1)[:n]
            kb = torch.cat([pool_b[layer][blk] for blk in sb.block_table]).flatten(1)[:n]
            assert ka.shape[0] == n
            assert torch.equal(ka, kb), layer


def test_a_non_finite_draft_row_ends_the_step_there_not_the_sequence(
    model: Any, monkeypatch
) -> None:
    """A later row of a drafted step that cannot be sampled ends the verification there: the
    tokens before it are the sequence's, and its position is decoded plainly next step (where
    a real non-finite row then fails the sequence, after those tokens reached the client)."""
    from miserver.serving.engine import sampler

    plain = make_engine(model, speculative_tokens=0)
    plain.add(Sequence(0, LOOPS[1], greedy(30)))
    expected = run(plain)[0]
    real = sampler.pick_token
    calls = {"row": 0, "failed": 0, "verifying": 0}

    def flaky(logits: torch.Tensor, *args: Any) -> int:
        calls["row"] += calls["verifying"]
        if calls["row"] == 2 and not calls["failed"]:  # a drafted step's second row, once
            calls["failed"] += 1
            logits = torch.full_like(logits, float("nan"))
        return real(logits, *args)

    monkeypatch.setattr(sampler, "pick_token", flaky)
    engine = make_engine(model)
    real_verify = engine._verify

    def verify(*args: Any) -> int:
        calls["row"], calls["verifying"] = 0, 1  # rows counted per drafted step
        try:
            return real_verify(*args)
        finally:
            calls["verifying"] = 0

    monkeypatch.setattr(engine, "_verify", verify)
    engine.add(Sequence(0, LOOPS[1], greedy(30)))
    outputs: list[Any] = []
    while engine.has_work():
        outputs += engine.step()
    assert calls["failed"] == 1
    assert [t for o in outputs for t in o.new_token_ids] == expected
    assert outputs[-1].finish_reason == "length" and outputs[-1].error is None
