"""The continuous engine's core on a tiny random-weight Llama (issue 29): greedy tokens equal the
model's own full-recompute argmax, chunked prefill, ``n`` choices prefilled once, preemption
and recompute, the prefix cache and DROP_CACHE, admission control, aborts, sampling with seeds,
logprobs, the constraint hook, the fixed-shape decode path, and the arena invariant (the model's
parameters and config stay as they were)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from miserver.serving.engine.continuous import ContinuousEngine
from miserver.serving.engine.generation import SamplingParams, SeedStream, pick_token
from miserver.serving.engine.kv_cache import cache_shape
from miserver.serving.engine.sequence import BATCH, INTERACTIVE, Sequence
from tests.tiny_llama import sharp_tiny_llama

VOCAB = 128


@pytest.fixture(scope="module")
def model() -> Any:
    return sharp_tiny_llama(VOCAB)


def reference_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full recomputation (no cache) with the stock attention."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt) :]


def make_engine(model: Any, blocks: int = 64, **kw: Any) -> ContinuousEngine:
    per_block = cache_shape(model).bytes_per_token * kw.get("block_size", 4)
    kw.setdefault("block_size", 4)
    return ContinuousEngine(model, per_block * (blocks + 1), **kw)


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


def run(engine: ContinuousEngine, limit: int = 2000) -> dict[Any, list[int]]:
    out: dict[Any, list[int]] = {}
    for _ in range(limit):
        if not engine.has_work():
            return out
        for o in engine.step():
            out.setdefault(o.seq_id, []).extend(o.new_token_ids)
    raise AssertionError("the engine did not finish")


PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 7, 30, 1, 12, 90, 4], [100], list(range(20, 45))]


def test_greedy_tokens_equal_the_models_own_argmax_alone_and_together(model: Any) -> None:
    refs = [reference_greedy(model, p, 12) for p in PROMPTS]
    for i, p in enumerate(PROMPTS):
        engine = make_engine(model)
        engine.add(Sequence(i, p, greedy(12)))
        assert run(engine)[i] == refs[i]
    engine = make_engine(model, prefill_chunk=8, max_num_batched_tokens=16)
    for i, p in enumerate(PROMPTS):
        engine.add(Sequence(i, p, greedy(12 - i)))  # mixed lengths
    got = run(engine)
    assert [got[i] for i in range(len(PROMPTS))] == [r[: 12 - i] for i, r in enumerate(refs)]
    assert engine.stats()["blocks_free"] == engine.stats()["blocks_total"]  # all given back


def test_the_arena_invariant_parameters_and_config_are_untouched(model: Any) -> None:
    before = {n: (p.data_ptr(), p.clone()) for n, p in model.named_parameters()}
    modules = list(model.modules())
    engine = make_engine(model)
    engine.add(Sequence(0, PROMPTS[1], greedy(4)))
    run(engine)
    assert model.config._attn_implementation == "sdpa"
    assert list(model.modules()) == modules
    for name, p in model.named_parameters():
        assert p.data_ptr() == before[name][0] and torch.equal(p, before[name][1])


def test_a_long_prompt_is_chunked_and_a_running_decode_gets_a_token_every_step(model: Any) -> None:
    engine = make_engine(model, prefill_chunk=4, max_num_batched_tokens=8)
    engine.add(Sequence("short", [1, 2], greedy(30)))
    engine.step()
    engine.add(Sequence("long", list(range(1, 41)), greedy(3)))
    steps_until_long_first = 0
    for _ in range(10):
        outs = {o.seq_id: o for o in engine.step()}
        assert outs["short"].new_token_ids, "the decode stalled behind the prefill"
        steps_until_long_first += 1
        if "long" in outs and outs["long"].new_token_ids:
            break
    assert steps_until_long_first == 10  # 40 prompt tokens, 4 a step
    assert engine.stats()["prefill_tokens"] >= 42


def test_n_choices_prefill_the_prompt_once_and_share_its_blocks(model: Any) -> None:
    engine = make_engine(model)
    group = object()
    prompt = PROMPTS[3]
    for i in range(8):
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=i)
        engine.add(Sequence(i, prompt, params, group=group))
    first = {o.seq_id: o.new_token_ids for o in engine.step()}  # one chunk: all 25 tokens
    assert sorted(first) == list(range(8)) and all(len(t) == 1 for t in first.values())
    stats = engine.stats()
    assert stats["prefills"] == 1 and stats["forks"] == 7 and stats["running"] == 8
    shared = -(-len(prompt) // 4)
    assert stats["blocks_total"] - stats["blocks_free"] == shared
    got = {i: first[i] + t for i, t in run(engine).items()}
    assert all(len(got[i]) == 6 for i in range(8))
    assert len({tuple(v) for v in got.values()}) > 1  # different seeds, different samples
    assert engine.stats()["prefills"] == 1


def test_seeded_sampling_follows_pick_token_and_seed_stream(model: Any) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=1234)
    engine = make_engine(model)
    engine.add(Sequence(0, PROMPTS[0], params))
    got = run(engine)[0]
    stream = SeedStream(1234)
    ids = list(PROMPTS[0])
    with torch.inference_mode():
        for _ in range(8):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            ids.append(pick_token(logits, params, stream))
    assert got == ids[len(PROMPTS[0]) :]


def test_preemption_under_a_small_budget_completes_with_the_same_greedy_tokens(model: Any) -> None:
    refs = {i: reference_greedy(model, p, 16) for i, p in enumerate(PROMPTS)}
    engine = make_engine(model, blocks=14)  # 4 sequences of up to 41 positions cannot all fit
    for i, p in enumerate(PROMPTS):
        engine.add(Sequence(i, p, greedy(16)))
    got = run(engine)
    assert got == refs
    assert engine.stats()["preemptions"] > 0


def test_preempt_all_parks_and_readmission_continues_the_same_text(model: Any) -> None:
    ref = reference_greedy(model, PROMPTS[1], 10)
    engine = make_engine(model)
    engine.add(Sequence(0, PROMPTS[1], greedy(10)))
    first = []
    for _ in range(4):
        for o in engine.step():
            first += o.new_token_ids
    engine.close_admission()
    assert engine.preempt_all() == 1
    assert engine.stats()["running"] == 0 and not engine.has_work()  # parked while closed
    engine.open_admission()
    assert engine.has_work()
    rest = run(engine)
    assert first + rest.get(0, []) == ref


def test_closed_admission_holds_new_sequences_but_running_ones_finish(model: Any) -> None:
    engine = make_engine(model)
    engine.add(Sequence("running", PROMPTS[0], greedy(5)))
    assert [o.seq_id for o in engine.step()] == ["running"]
    engine.close_admission()
    engine.add(Sequence("new", PROMPTS[2], greedy(5)))
    got = run(engine)
    assert len(got["running"]) == 4 and "new" not in got
    assert engine.stats()["waiting"] == 1
    engine.open_admission()
    assert len(run(engine)["new"]) == 5


def test_prefix_cache_serves_a_repeated_prompt_and_drop_forgets_it(model: Any) -> None:
    engine = make_engine(model)
    prompt = list(range(1, 30))
    engine.add(Sequence("a", prompt, greedy(3)))
    first = run(engine)["a"]
    engine.add(Sequence("b", prompt, greedy(3)))
    assert run(engine)["b"] == first
    hits = engine.stats()["prefix_cache_hits"]
    assert hits == 7  # (29 - 1) // 4 full blocks
    assert engine.drop_prefix_cache() > 0
    engine.add(Sequence("c", prompt, greedy(3)))
    assert run(engine)["c"] == first
    assert engine.stats()["prefix_cache_hits"] == hits


def test_abort_ends_a_sequence_at_the_next_step_and_frees_its_blocks(model: Any) -> None:
    engine = make_engine(model)
    engine.add(Sequence("x", PROMPTS[1], greedy(50)))
    engine.step()
    engine.abort("x", "cancelled")
    outs = engine.step()
    assert [(o.seq_id, o.finished, o.finish_reason) for o in outs] == [("x", True, "cancelled")]
    assert engine.stats()["blocks_free"] == engine.stats()["blocks_total"]
    assert not engine.has_work()


def test_interactive_is_admitted_before_batch(model: Any) -> None:
    engine = make_engine(model, max_num_seqs=1)
    engine.add(Sequence("batch", PROMPTS[0], greedy(2), priority=BATCH))
    engine.add(Sequence("chat", PROMPTS[0], greedy(2), priority=INTERACTIVE))
    outs = engine.step()
    assert [o.seq_id for o in outs] == ["chat"]


def test_stop_tokens_and_length_end_sequences(model: Any) -> None:
    ref = reference_greedy(model, PROMPTS[0], 6)
    engine = make_engine(model)
    engine.add(Sequence("stop", PROMPTS[0], greedy(6), stop_token_ids=frozenset({ref[2]})))
    engine.add(Sequence("length", PROMPTS[0], greedy(4)))
    ends: dict[str, str] = {}
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.seq_id, []).extend(o.new_token_ids)
            if o.finished:
                ends[o.seq_id] = o.finish_reason
    stop_at = ref.index(ref[2])
    assert got["stop"] == ref[: stop_at + 1] and ends["stop"] == "stop"
    assert got["length"] == ref[:4] and ends["length"] == "length"


def test_logprobs_and_echo_prompt_logprobs_come_from_the_models_distribution(model: Any) -> None:
    prompt = PROMPTS[1]
    engine = make_engine(model, prefill_chunk=4, max_num_batched_tokens=8)
    engine.add(Sequence(0, prompt, greedy(3, logprobs=2, echo=True)))
    outs = []
    while engine.has_work():
        outs += engine.step()
    prompt_lp = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
    tokens = [t for o in outs for t in o.new_token_ids]
    entries = [e for o in outs for e in (o.logprobs or [])]
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    lps = torch.log_softmax(full, dim=-1)
    assert len(prompt_lp) == len(prompt) - 1
    for i, e in enumerate(prompt_lp):
        assert e.token_id == prompt[i + 1]
        assert e.logprob == pytest.approx(float(lps[i, prompt[i + 1]]), abs=1e-3)
        assert len(e.top) == 2
    for j, e in enumerate(entries):
        pos = len(prompt) - 1 + j
        assert e.token_id == tokens[j] == e.top[0][0]
        assert e.logprob == pytest.approx(float(lps[pos, tokens[j]]), abs=1e-3)


class _OnlyEven:
    """A fake constraint: even token ids only; terminated after three tokens."""

    def new_matcher(self) -> Any:
        return _EvenMatcher()


class _EvenMatcher:
    def __init__(self) -> None:
        self.accepted: list[int] = []

    def fill_mask(self, logits: torch.Tensor) -> None:
        logits[1::2] = float("-inf")

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def is_terminated(self) -> bool:
        return len(self.accepted) >= 3


def test_the_constraint_hook_masks_accepts_and_ends_with_stop(model: Any) -> None:
    if "constraint" not in {f.name for f in dataclasses.fields(SamplingParams)}:
        params: Any = dataclasses.make_dataclass(
            "P", [("constraint", object, None)], bases=(SamplingParams,), frozen=True
        )(max_tokens=10, temperature=0, constraint=_OnlyEven())
    else:
        params = SamplingParams(max_tokens=10, temperature=0, constraint=_OnlyEven())  # type: ignore[call-arg]
    engine = make_engine(model)
    engine.add(Sequence("c", PROMPTS[1], params))
    engine.add(Sequence("free", PROMPTS[1], greedy(3)))
    outs = []
    while engine.has_work():
        outs += engine.step()
    tokens = [t for o in outs if o.seq_id == "c" for t in o.new_token_ids]
    assert len(tokens) == 3 and all(t % 2 == 0 for t in tokens)
    assert [o.finish_reason for o in outs if o.seq_id == "c" and o.finished] == ["stop"]
    free = [t for o in outs if o.seq_id == "free" for t in o.new_token_ids]
    assert free == reference_greedy(model, PROMPTS[1], 3)  # unconstrained neighbour untouched


def test_the_fixed_shape_decode_path_matches_the_per_sequence_path(model: Any) -> None:
    loop = make_engine(model)
    fixed = make_engine(model, decode_graphs="eager", max_num_seqs=8)
    for engine in (loop, fixed):
        for i, p in enumerate(PROMPTS):
            engine.add(Sequence(i, p, greedy(10)))
    assert run(fixed) == run(loop)
    assert fixed.runner.graphs is not None and fixed.runner.graphs.buckets == (1, 2, 4, 8)


class _FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` on the CPU: replay reruns the recorded step."""

    def __init__(self, replay: Any) -> None:
        self.replay = replay


def test_decode_graphs_capture_once_per_bucket_replay_and_fall_back(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from miserver.serving.engine.model_runner import DecodeGraphs, decode_buckets

    assert decode_buckets(20) == (1, 2, 4, 8, 16, 24) and decode_buckets(1) == (1,)
    captured: list[int] = []

    def fake_capture(self: DecodeGraphs, key: tuple[int, int]) -> None:
        rows, width = key
        captured.append(rows)
        assert width in self.widths and width < self.max_blocks  # short sequences: a narrow table
        if rows == 4:
            raise RuntimeError("capture failed")  # that bucket runs eagerly from then on

        def replay() -> None:
            self._outputs[key] = self._step(key).float()

        self._graphs[key] = _FakeGraph(replay)

    monkeypatch.setattr(DecodeGraphs, "_capture", fake_capture)
    graphed = make_engine(model, decode_graphs="captured", max_num_seqs=8)
    loop = make_engine(model)
    for engine in (graphed, loop):
        for i, p in enumerate(PROMPTS[:3]):
            engine.add(Sequence(i, p, greedy(6 + 2 * i)))  # 3, then 2, then 1 decoding
    assert run(graphed) == run(loop)
    graphs = graphed.runner.graphs
    assert graphs is not None
    assert sorted(set(captured)) == [1, 2, 4] and captured.count(4) == 1  # no retry a step
    assert [rows for rows, _ in graphs.failed] == [4] and graphs.replays > 0
    assert graphs.captured == sorted(graphs._graphs)
    summary = graphed.stats()["decode_graphs"]
    assert summary["captured"] == [list(k) for k in graphs.captured]
    assert summary["failed"] == [list(k) for k in sorted(graphs.failed)]
    assert summary["replays"] == graphs.replays and summary["mode"] == "captured"
    assert graphed.stats()["peak_batch"] == 3 and "decode_graphs" not in loop.stats()
    # padding rows of a bucket write only the scratch block and attend one position
    graphs.fill([], 2)
    assert graphs.slot_mapping[:2].tolist() == [
        graphed.cache.scratch_block * 4,
        graphed.cache.scratch_block * 4 + 1,
    ]
    assert graphs.context_lens[:2].tolist() == [1, 1]
    graphs.drop()
    assert graphs._graphs == {} and graphs.failed == set()


def test_a_request_arriving_during_a_long_decode_starts_at_once_and_ended_rows_free_blocks(
    model: Any,
) -> None:
    engine = make_engine(model, blocks=20)
    engine.add(Sequence("long", PROMPTS[1], greedy(40)))
    for _ in range(3):
        engine.step()
    engine.add(Sequence("late", PROMPTS[0], greedy(2)))
    first = engine.step()
    assert {o.seq_id for o in first if o.new_token_ids} == {"long", "late"}  # the next step
    used_with_both = engine.stats()["blocks_total"] - engine.stats()["blocks_free"]
    second = engine.step()
    assert [o.finish_reason for o in second if o.seq_id == "late"] == ["length"]
    used_after = engine.stats()["blocks_total"] - engine.stats()["blocks_free"]
    assert used_after < used_with_both  # the ended row's blocks are free for the next step
    assert engine.stats()["running"] == 1


def test_close_ends_everything_and_releases_the_cache(model: Any) -> None:
    engine = make_engine(model)
    engine.add(Sequence("a", PROMPTS[0], greedy(20)))
    engine.step()
    engine.add(Sequence("b", PROMPTS[1], greedy(20)))
    assert sorted(engine.close()) == ["a", "b"]
    assert engine.cache.keys == [] and not engine.has_work()
    assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0


def test_cpu_matrix_products_of_2_to_linear_max_rows_rows_give_a_row_the_same_bits() -> None:
    """What the runner's CPU invariance rests on without ``weight_first``
    (model_runner.LINEAR_MAX_ROWS), checked on the running torch with SmolLM2-135M's weight
    shapes in bfloat16: a row's ``F.linear`` is the same bits in every product of 2 to
    LINEAR_MAX_ROWS rows, wherever the row sits (tests/unit/test_cpu_linear.py checks the
    ``weight @ inputᵀ`` path the runner takes by default)."""
    from miserver.serving.engine.model_runner import LINEAR_MAX_ROWS as MAX_ROWS

    gen = torch.Generator().manual_seed(1)
    for k, n in ((576, 576), (576, 192), (576, 1536), (1536, 576)):
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        x = torch.randn(MAX_ROWS + 1, k, generator=gen).to(torch.bfloat16)
        pairs = torch.cat(
            [torch.nn.functional.linear(x[[r, r + 1]], w)[:1] for r in range(MAX_ROWS)]
        )
        for m in range(2, MAX_ROWS + 1):
            assert torch.equal(torch.nn.functional.linear(x[:m], w), pairs[:m]), (k, n, m)


def test_cpu_forward_passes_put_each_prefill_chunk_alone_and_at_most_max_rows_rows() -> None:
    from miserver.serving.engine.model_runner import _cpu_groups, _Unit

    def seq(i: int, prompt: int, out: int) -> Sequence:
        s = Sequence(i, list(range(1, prompt + 1)), greedy(100))
        s.output_token_ids = list(range(out))
        return s

    recompute = seq(0, 10, 40)  # its 40 generated positions as one-query rows
    decodes = [seq(i, 5, 3) for i in (1, 2, 3)]
    chunk = seq(4, 50, 0)
    units = [
        _Unit(recompute, 10, 40, True),
        *(_Unit(s, s.num_tokens - 1, 1, True) for s in decodes),
        _Unit(chunk, 0, 50, True),
    ]
    groups = _cpu_groups(units, 32)
    assert [[(u.seq.seq_id, u.start, u.num_new, u.sample) for u in g] for g in groups] == [
        [(0, 10, 32, False)],  # the recompute's rows, split where a pass is full
        [(4, 0, 50, True)],  # the prefill chunk alone
        [(0, 42, 8, True), (1, 7, 1, True), (2, 7, 1, True), (3, 7, 1, True)],
    ]
    assert [all(u.rows for u in g) for g in groups] == [True, False, True]
    # sharing (the weight-first linear layers): a chunk joins a pass that has room for all of
    # it, a chunk longer than a pass is alone, and rows still split where a pass is full
    other_chunk = seq(5, 30, 0)
    shared = _cpu_groups([*units, _Unit(other_chunk, 0, 30, True)], 32, share_chunks=True)
    assert [[(u.seq.seq_id, u.start, u.num_new) for u in g] for g in shared] == [
        [(0, 10, 32)],
        [(4, 0, 50)],  # longer than a pass: alone
        [(0, 42, 8), (1, 7, 1), (2, 7, 1), (3, 7, 1)],  # 11 rows: no room for 30 more
        [(5, 0, 30)],
    ]
    small = _cpu_groups([_Unit(chunk, 0, 20, True), *units[1:4]], 32, share_chunks=True)
    assert [[(u.seq.seq_id, u.num_new) for u in g] for g in small] == [
        [(4, 20), (1, 1), (2, 1), (3, 1)]
    ]


def test_a_recompute_computes_the_prompt_as_a_chunk_and_the_generated_tokens_as_rows(
    model: Any,
) -> None:
    """After a preemption the sequence computes what it computed first: the prompt as its
    prefill chunk, the generated positions as one-query rows (not one chunk of prompt plus
    generated tokens); a parked sequence (a hold) prefills everything as a fresh prompt."""
    from miserver.serving.engine import model_runner

    seen: list[list[tuple[int, int, bool]]] = []
    runner_group = model_runner.ModelRunner._run_group

    def spy(self: Any, units: Any, sampled: Any, prompt: Any) -> None:
        seen.append([(u.start, u.num_new, u.rows) for u in units])
        runner_group(self, units, sampled, prompt)

    engine = make_engine(model, prefill_chunk=8, max_num_batched_tokens=16, prefix_cache=False)
    s = Sequence(0, PROMPTS[1], greedy(12))  # 11 prompt tokens: chunks of 8 and 3
    engine.add(s)
    for _ in range(7):
        engine.step()
    assert len(s.output_token_ids) == 6
    engine.scheduler.preempt(s)
    try:
        model_runner.ModelRunner._run_group = spy  # type: ignore[method-assign]
        engine.step()
        engine.step()
        engine.step()
    finally:
        model_runner.ModelRunner._run_group = runner_group  # type: ignore[method-assign]
    assert seen == [[(0, 8, False)], [(8, 3, False)], [(11, 6, True)]]
    assert s.num_prefill_tokens == 11
    engine.close_admission()
    engine.preempt_all()
    engine.open_admission()
    engine.step()
    assert s.num_prefill_tokens == s.num_tokens == 11 + 7  # a hold's re-prefill: a fresh prompt


def test_the_health_route_reports_the_engine_cache_and_graphs(model: Any) -> None:
    from types import SimpleNamespace

    from miserver.http.management import kv_cache_summary

    engine = make_engine(model, decode_graphs="eager", max_num_seqs=4)
    for i, p in enumerate(PROMPTS[:2]):
        engine.add(Sequence(i, p, greedy(3)))
    run(engine)
    loop = SimpleNamespace(closed=False, stats=engine.stats)
    summary = kv_cache_summary(SimpleNamespace(engine_loop=loop))
    assert summary is not None
    assert summary["blocks_free"] == summary["blocks_total"] == engine.blocks.num_blocks
    assert summary["peak_batch"] == 2 and summary["running"] == 0
    times = summary["step_times"]
    assert times["eager"]["steps"] + times["graph"]["steps"] == engine.stats()["steps"] > 0
    assert times["graph"]["steps"] > 0 and times["eager"]["steps"] > 0  # decodes, prefills
    assert times["slowest_ms"] > 0
    assert summary["decode_graphs"]["mode"] == "eager" and summary["decode_graphs"]["bytes"] == 0
    assert kv_cache_summary(SimpleNamespace(engine_loop=None)) is None


def test_packed_prefill_attends_each_chunk_as_alone_in_one_call_per_pack(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA path (issue 34): a step's prefill chunks in one masked attention call a layer
    (``pack_spans``), here forced on the CPU in float32: every sequence (whole prompts, chunks
    after computed positions, a prefix from the prefix cache) gets the greedy tokens of the
    one-call-per-chunk path, which are the model's own."""
    from miserver.serving.engine import paged_attention
    from miserver.serving.engine.paged_attention import SeqSpan, pack_spans

    calls: list[int] = []
    real = paged_attention._packed_prefill

    def counting(*args: Any, **kw: Any) -> None:
        calls.append(1)
        real(*args, **kw)

    monkeypatch.setattr(paged_attention, "_packed_prefill", counting)
    prompts = [*PROMPTS, list(range(3, 60)), list(range(1, 30)), list(range(1, 30)) + [7, 8]]
    refs = [reference_greedy(model, p, 8) for p in prompts]
    got: dict[str, dict[Any, list[int]]] = {}
    for mode in ("alone", "packed"):
        engine = make_engine(
            model,
            blocks=128,
            prefill_chunk=8,
            max_num_batched_tokens=64,
            packed_prefill=mode == "packed",
        )
        calls.clear()
        for i, p in enumerate(prompts):
            engine.add(Sequence(i, p, greedy(8)))
        got[mode] = run(engine)
        assert (len(calls) > 0) == (mode == "packed")
    assert got["packed"] == got["alone"] == dict(enumerate(refs))
    # the mask itself: each query sees its own sequence's keys up to its own position
    blocks = [torch.tensor([0, 1]), torch.tensor([2])]
    spans = [SeqSpan(0, 3, 6, blocks[0]), SeqSpan(3, 2, 2, blocks[1])]
    packs, alone = pack_spans(spans, block_size=4)
    assert alone == [] and len(packs) == 1
    mask = packs[0].mask
    assert mask.shape == (5, 12)
    assert mask[0].tolist() == [True] * 4 + [False] * 8  # position 3 of sequence 0
    assert mask[2].tolist() == [True] * 6 + [False] * 6  # position 5
    assert mask[3].tolist() == [False] * 8 + [True] + [False] * 3  # sequence 1, position 0
    assert packs[0].q_index.tolist() == [0, 1, 2, 3, 4]
    assert packs[0].grouped_mask(2).shape == (10, 12)
    # a limit too small for two spans leaves each alone
    packs, alone = pack_spans(spans, block_size=4, limit=20)
    assert packs == [] and alone == spans


def test_packed_prefill_matches_alone_with_decode_rows_in_the_same_step(model: Any) -> None:
    """Mixed steps: decode rows beside packed chunks (the batched decode path and the packs
    write disjoint positions of the step's output)."""
    outs = {}
    for packed in (False, True):
        engine = make_engine(model, blocks=128, prefill_chunk=4, packed_prefill=packed)
        engine.add(Sequence("early", [1, 2, 3], greedy(20)))
        first = [t for o in engine.step() for t in o.new_token_ids]
        for i, p in enumerate(PROMPTS):
            engine.add(Sequence(i, p, greedy(6)))
        outs[packed] = run(engine)
        outs[packed]["early"] = first + outs[packed]["early"]
    assert outs[True] == outs[False]
    assert outs[True]["early"] == reference_greedy(model, [1, 2, 3], 20)


def test_a_sequence_the_whole_cache_cannot_hold_ends_with_length_instead_of_looping(
    model: Any,
) -> None:
    """A cache of 3 blocks of 4 positions holds 12 positions: a sequence that would need more
    is not preempted and recomputed for ever (it would never fit) but ends ``length`` with what
    it produced, as at the end of a context; a prompt longer than the cache ends at once; a
    sequence that fits beside them completes."""
    engine = make_engine(model, blocks=3, prefix_cache=False)
    engine.add(Sequence("long", [5, 17, 3, 9, 2], greedy(40)))
    engine.add(Sequence("huge", list(range(1, 21)), greedy(5)))
    ended: dict[Any, tuple[str | None, int]] = {}
    tokens: dict[Any, int] = {}
    for _ in range(200):
        if not engine.has_work():
            break
        for o in engine.step():
            tokens[o.seq_id] = tokens.get(o.seq_id, 0) + len(o.new_token_ids)
            if o.finished:
                ended[o.seq_id] = (o.finish_reason, tokens[o.seq_id])
    assert not engine.has_work()
    assert ended["huge"] == ("length", 0)
    reason, produced = ended["long"]
    assert (reason, produced) == ("length", 12 - 5 + 1)  # the last from position 11
    engine.add(Sequence("fits", [5, 17, 3], greedy(4)))
    assert run(engine)["fits"] == reference_greedy(model, [5, 17, 3], 4)
    assert engine.stats()["blocks_free"] == engine.stats()["blocks_total"]
