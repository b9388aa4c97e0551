"""The static batch through the decode engine without a GPU (issue 14): the batch cache's logic
(left-padded rows over one write column, the per-row mask, the padded prefill, rows leaving and
the move to a smaller row bucket), run with ``graphs=False`` (each step the eager forward that a
capture records), the decoder choice and the memory cut. tests/gpu/test_static_batch_cuda.py
replays the graphs for real on the H200."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miserver.serving.engine.decode_graphs import BatchGraphSession, DecodeEngine, row_buckets
from miserver.serving.engine.generation import (
    Finished,
    SamplingParams,
    StaticBatch,
    TextDelta,
    _EagerDecoder,
)
from tests.unit.v1_fixtures import cached_tokenizer, tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return cached_tokenizer(tmp_path_factory.getbasetemp().parent / "miserver-v1-cache")


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model(tokenizer, context=64)


def _engine(model, max_rows: int = 8) -> DecodeEngine:
    return DecodeEngine(
        model, "captured", 64, buckets=(8, 16, 32, 64), graphs=False, max_rows=max_rows
    )


@pytest.mark.parametrize(
    ("rows", "expected"),
    [(0, ()), (1, ()), (2, (2,)), (3, (2, 3)), (8, (2, 4, 8)), (24, (2, 4, 8, 16, 24))],
)
def test_row_buckets_double_up_to_the_rows(rows: int, expected: tuple[int, ...]) -> None:
    assert row_buckets(rows) == expected


def _alone(model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    dec = _EagerDecoder(model, torch.device("cpu"))
    out = [dec.prefill(prompt, all_logits=False)[-1].float()]
    return out + [dec.step(t).clone() for t in tokens]


def test_the_batch_cache_follows_each_sequence_as_it_decodes_alone(model) -> None:
    """Five rows (two share a prompt, one prompt prefilled alone for its logits), of different
    lengths, decode over one write column that crosses length buckets; rows leave, and once at
    most half of the row bucket is live the rest move to the front of a smaller bucket. Every
    row's logits stay those of its sequence decoded alone (float32: to rounding)."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18]]
    sources = [0, 1, 1, 2, 3]  # prompt 1 decodes twice (a request with n=2)
    steps = 14  # the column goes from 7 to 21: buckets 8, 16 and 32
    forced = [[20 + i + r for i in range(steps)] for r in range(len(sources))]
    engine = _engine(model)
    with torch.inference_mode():
        alone = [_alone(model, prompts[s], forced[r]) for r, s in enumerate(sources)]
        with engine.batch_session(model, len(sources), 7 + steps) as batch:
            assert isinstance(batch, BatchGraphSession)
            batch.expect([prompts[0], prompts[1], prompts[3]])  # prompt 2 wants all logits
            firsts = []
            for i, p in enumerate(prompts):
                logits = batch.prefill(p, all_logits=i == 2)
                vocab = model.config.vocab_size
                assert logits.shape == ((len(p), vocab) if i == 2 else (1, vocab))
                firsts.append(logits[-1].float())
            batch.begin(sources)
            assert batch._bucket == 8  # the row bucket holding 5 rows
            live = list(range(len(sources)))
            for r in live:
                torch.testing.assert_close(firsts[sources[r]], alone[r][0], rtol=1e-4, atol=1e-4)
            for step in range(steps):
                logits = batch.step([forced[r][step] for r in live])
                assert logits.shape == (len(live), model.config.vocab_size)
                for i, r in enumerate(live):
                    torch.testing.assert_close(logits[i], alone[r][step + 1], rtol=1e-4, atol=1e-4)
                if step == 2:  # two rows leave: 3 of 8 live, moved to the front of bucket 4
                    batch.keep([1, 2, 4])
                    live = [live[i] for i in (1, 2, 4)]
                    assert batch._bucket == 4 and batch._phys == [0, 1, 2]
                if step == 6:  # one more leaves: 2 of 4, bucket 2
                    batch.keep([0, 2])
                    live = [live[0], live[2]]
                    assert batch._bucket == 2
                if step == 9:  # one leaves a bucket of two: it stays in place, unread
                    batch.keep([1])
                    live = [live[1]]
                    assert batch._bucket == 2 and batch._phys == [1]
            assert batch.rows == 1


async def _run(gen) -> tuple[str, str | None]:
    parts, finish = [], None
    async for ev in gen.events():
        if isinstance(ev, TextDelta):
            parts.append(ev.text)
        elif isinstance(ev, Finished):
            finish = ev.finish_reason
    await gen.wait()
    return "".join(parts), finish


async def _batched(model, tokenizer, requests, engine) -> tuple[list, list[str]]:
    batch = StaticBatch()
    gens = []
    for prompt, params, n in requests:
        gens += batch.join(model, tokenizer, tokenizer(prompt)["input_ids"], params, n, engine)
    batch.start()
    answers = await asyncio.gather(*(_run(g) for g in gens))
    return answers, [g.timing.extra["decoder"] for g in gens]


async def test_batched_greedy_answers_through_the_engine_equal_each_alone(model, tokenizer) -> None:
    """Mixed prompt lengths, stop sequences and max_tokens, one request with n=2: the batch
    decodes over the engine's batch cache and every greedy answer is the request's alone."""
    requests = [
        ("Once upon a time", SamplingParams(max_tokens=20, temperature=0), 1),
        ("Hi", SamplingParams(max_tokens=7, temperature=0), 2),
        (
            "The capital of France is",
            SamplingParams(max_tokens=30, temperature=0, stop=["ssis"]),
            1,
        ),
        ("a b c d e f g h", SamplingParams(max_tokens=12, temperature=0), 1),
    ]
    engine = _engine(model)
    answers, kinds = await _batched(model, tokenizer, requests, engine)
    assert set(kinds) == {"graphs:captured"}
    expected = []
    for prompt, params, n in requests:
        alone, _ = await _batched(model, tokenizer, [(prompt, params, 1)], None)
        expected += alone * n
    assert answers == expected
    assert answers[3][1] == "stop" and answers[0][1] == "length"  # n=2 gives rows 1 and 2


async def test_a_batch_left_with_one_row_after_the_prefill_decodes_it(model, tokenizer) -> None:
    """Every other sequence ended at its first token: the one left decodes in the batch cache."""
    requests = [
        ("Hi", SamplingParams(max_tokens=1, temperature=0), 2),
        ("Hello there", SamplingParams(max_tokens=9, temperature=0), 1),
    ]
    answers, kinds = await _batched(model, tokenizer, requests, _engine(model))
    assert set(kinds) == {"graphs:captured"}
    expected = []
    for prompt, params, n in requests:
        expected += (await _batched(model, tokenizer, [(prompt, params, 1)], None))[0] * n
    assert answers == expected and answers[2][1] == "length"


async def test_a_batch_that_does_not_fit_decodes_eagerly(model, tokenizer) -> None:
    """More rows than the batch cache holds, or a longest prompt plus the most tokens beyond
    the context: the eager batched decoder, the same answers."""
    engine = _engine(model, max_rows=2)
    params = SamplingParams(max_tokens=5, temperature=0)
    three = [("Hello", params, 3)]
    answers, kinds = await _batched(model, tokenizer, three, engine)
    assert set(kinds) == {"eager"}
    assert answers == (await _batched(model, tokenizer, three, None))[0]
    long = "a b c d e f g h i j k l m n o p q r s t"
    n, h = len(tokenizer(long)["input_ids"]), len(tokenizer("Hi")["input_ids"])
    # "Hi" may fill the context alone, but padded to the long prompt it would not fit
    over = [(long, params, 1), ("Hi", SamplingParams(max_tokens=64 - h, temperature=0), 1)]
    _, kinds = await _batched(model, tokenizer, over, engine)
    assert set(kinds) == {"eager"}
    fits = [(long, params, 1), ("Hi", SamplingParams(max_tokens=64 - n, temperature=0), 1)]
    _, kinds = await _batched(model, tokenizer, fits, engine)
    assert set(kinds) == {"graphs:captured"}


def test_reset_zeroes_what_a_batch_wrote(model) -> None:
    engine = _engine(model, max_rows=4)
    with torch.inference_mode():
        with engine.batch_session(model, 2, 10) as batch:
            batch.expect([[5, 6, 7], [8]])
            batch.prefill([5, 6, 7], all_logits=False)
            batch.prefill([8], all_logits=False)
            batch.begin([0, 1])
            batch.step([9, 10])
        assert any(bool(t.abs().sum() > 0) for t in engine._bkeys)
        engine.reset()
        with engine.session(model):
            pass  # the next user zeroes
        assert all(bool(t.abs().sum() == 0) for t in (*engine._bkeys, *engine._bvalues))


def test_the_batch_cache_is_cut_to_the_free_memory(model, monkeypatch) -> None:
    """Rows beyond :data:`BATCH_CACHE_FRACTION` of the free memory are not allocated (and said);
    too little for two rows leaves batches eager."""
    per_row = _engine(model, max_rows=1).stats.cache_bytes
    monkeypatch.setattr(DecodeEngine, "_free_bytes", lambda self: per_row * 12)
    engine = _engine(model, max_rows=8)
    assert engine.batch_rows == 3 and engine.batch_buckets == (2, 3)
    assert "up to 3 of MAX_BATCH_SIZE=8" in engine.stats.batch_note
    assert engine.stats.batch_cache_bytes == 3 * per_row
    assert engine.stats.cache_bytes == 4 * per_row
    monkeypatch.setattr(DecodeEngine, "_free_bytes", lambda self: per_row * 4)
    engine = _engine(model, max_rows=8)
    assert engine.batch_rows == 0 and "decode eagerly" in engine.stats.batch_note
    with engine.batch_session(model, 2, 10) as batch:
        assert batch is None


def test_close_frees_the_batch_cache_and_refuses_batches(model) -> None:
    engine = _engine(model, max_rows=4)
    assert engine.batch_rows == 4 and engine._bkeys
    engine.close()
    assert engine.batch_rows == 0 and not engine._bkeys and not hasattr(engine, "_blogits")
    with engine.batch_session(model, 2, 10) as batch:
        assert batch is None


# --- the batched sampler (the static batch's rows on CUDA) ------------------------------------
def test_pick_tokens_samples_every_row_as_pick_token_does() -> None:
    """Random logits, rows of every kind (greedy, temperatures, top-p cut or not, seeded draws,
    a non-finite row): each seeded or greedy row gets exactly ``pick_token``'s token with the
    same seed; an unseeded row a token inside its top-p set."""
    from miserver.serving.engine.generation import (
        NonFiniteLogits,
        SeedStream,
        pick_token,
        pick_tokens,
    )

    g = torch.Generator().manual_seed(0)
    kinds = [(t, p) for t in (0.0, 0.3, 1.0, 1.7) for p in (1.0, 0.9, 0.2)]
    for trial in range(6):
        rows = len(kinds) + 2
        logits = torch.randn((rows, 3000), generator=g) * (1 + trial)
        logits[-1, 7] = float("nan")
        params = [SamplingParams(max_tokens=4, temperature=t, top_p=p) for t, p in kinds]
        params += [SamplingParams(max_tokens=4, temperature=1.0, top_p=0.5)]  # unseeded
        params += [SamplingParams(max_tokens=4, temperature=0.7)]  # the NaN row
        seeds = [1000 * trial + r for r in range(rows)]
        gens = [
            SeedStream(s) if q.temperature > 0 else None for s, q in zip(seeds, params, strict=True)
        ]
        gens[-2] = None
        batched = pick_tokens(logits, params, gens)
        for r in range(len(kinds)):
            stream = SeedStream(seeds[r]) if params[r].temperature > 0 else None
            assert batched[r] == pick_token(logits[r], params[r], stream), (trial, kinds[r])
        probs = torch.softmax(logits[-2].double(), -1)
        ranked = torch.sort(probs, descending=True)
        keep = ranked.indices[(torch.cumsum(ranked.values, 0) - ranked.values) < 0.5]
        assert batched[-2] in keep.tolist()
        assert isinstance(batched[-1], NonFiniteLogits)


async def test_a_batch_sampled_together_answers_as_row_by_row(
    model, tokenizer, monkeypatch
) -> None:
    """The decode loop with the batched sampler (forced on here; CUDA's path): seeded sampled
    choices, top-p, a greedy request: the same answers as sampling row by row (on the CPU the
    arithmetic agrees bit for bit, as the test above shows)."""
    from miserver.serving.engine import generation

    requests = [
        ("Once upon a time", SamplingParams(max_tokens=12, temperature=0.9, seed=3), 3),
        ("Hi", SamplingParams(max_tokens=9, temperature=1.3, top_p=0.8, seed=11), 2),
        ("The capital of France is", SamplingParams(max_tokens=10, temperature=0), 1),
    ]
    engine = _engine(model)
    row_by_row, _ = await _batched(model, tokenizer, requests, engine)
    calls = []
    real = generation.pick_tokens

    def spy(*args):  # noqa: ANN002, ANN202
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(generation, "_samples_batched", lambda logits: True)
    monkeypatch.setattr(generation, "pick_tokens", spy)
    together, kinds = await _batched(model, tokenizer, requests, engine)
    assert calls and set(kinds) == {"graphs:captured"}
    assert together == row_by_row
    assert len({a for a, _ in together[:3]}) > 1  # the seeds of the choices differ
