"""The cheaper paths of a request (issue 14, the server's own cost per request) give the same
answers as the paths they replace:

- a sequence read whole (``stream=False``, a non-streamed request or a Batch API row) sends its
  text as one delta before its end: the same joined text, logprobs and end as a streamed one;
- the detokenizer calls the ``tokenizers`` backend's decode directly when that is what
  ``tokenizer.decode`` would run, and gives the same pieces;
- one disconnect poller per event loop cancels exactly the requests whose client went away.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch

from miserver.http import v1
from miserver.serving.engine.detokenize import IncrementalDetokenizer, backend_decoder
from miserver.serving.engine.generation import (
    Finished,
    GenerationError,
    SamplingParams,
    Started,
    TextDelta,
)
from tests.unit.v1_fixtures import cached_tokenizer, engine_events, engine_loop_for, tiny_model

MIXED = "Café ☕ naïve 日本語 emoji 🦙🎉 — done."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return cached_tokenizer(tmp_path_factory.getbasetemp().parent / "miserver-v1-cache")


@pytest.fixture(scope="module")
def model(tokenizer: Any) -> Any:
    return tiny_model(tokenizer)


def _summary(events: list[Any]) -> tuple[Any, ...]:
    """What a non-streamed answer reads from a sequence's events."""
    deltas = [e for e in events if isinstance(e, TextDelta)]
    lps = [
        (lp.token_id, lp.text, lp.bytes, lp.logprob, lp.top) for d in deltas for lp in d.logprobs
    ]
    return events[0], "".join(d.text for d in deltas), lps, events[-1]


PARAMS = [
    {"max_tokens": 12, "temperature": 0},
    {"max_tokens": 12, "temperature": 0, "stop": (" the", "e")},
    {"max_tokens": 10, "temperature": 0, "logprobs": 2},
    {"max_tokens": 6, "temperature": 0, "logprobs": 1, "echo": True},
    {"max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 7},
]


@pytest.mark.parametrize("kw", PARAMS, ids=["greedy", "stops", "logprobs", "echo", "seeded"])
async def test_a_sequence_read_whole_equals_the_streamed_one(model, tokenizer, kw) -> None:
    ids = tokenizer(MIXED)["input_ids"]
    (s_events,) = await engine_events(model, tokenizer, [(ids, SamplingParams(**kw), 1)])
    (w_events,) = await engine_events(
        model, tokenizer, [(ids, SamplingParams(**kw), 1)], stream=False
    )
    assert isinstance(w_events[0], Started) and isinstance(w_events[-1], Finished)
    assert len([e for e in w_events if isinstance(e, TextDelta)]) <= 1  # one delta, at the end
    assert len(w_events) <= 3
    assert _summary(w_events) == _summary(s_events)
    if not kw.get("stop"):  # (a stop may end it at once) the stream: a delta per token
        assert len([e for e in s_events if isinstance(e, TextDelta)]) > 1


async def test_requests_read_whole_equal_the_same_requests_streamed(model, tokenizer) -> None:
    prompts = ["Hello", MIXED, "Numbers: 1, 2, 3,", "A"]
    params = [
        SamplingParams(max_tokens=n, temperature=0, stop=stop)
        for n, stop in ((9, ()), (14, ("e",)), (5, ()), (11, (",",)))
    ]
    requests = [
        (tokenizer(prompt)["input_ids"], p, 2) for prompt, p in zip(prompts, params, strict=True)
    ]
    answers = []
    for stream in (True, False):
        events = await engine_events(model, tokenizer, requests, stream=stream)
        answers.append([_summary(e) for e in events])
    assert len(answers[0]) == 8 and answers[0] == answers[1]


async def test_a_sequence_read_whole_that_fails_raises(model, tokenizer) -> None:
    class Exploding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.calls = model, 0

        def forward(self, **kw: Any) -> Any:
            self.calls += 1
            if self.calls == 4:
                raise RuntimeError("injected failure")
            return self.inner(**kw)

    (seen,) = await engine_events(
        model,
        tokenizer,
        [([1, 2, 3], SamplingParams(max_tokens=10, temperature=0), 1)],
        stream=False,
        wrap=lambda _m: Exploding(),
    )
    assert isinstance(seen[0], Started)
    assert isinstance(seen[-1], GenerationError) and "injected failure" in str(seen[-1])
    assert all(not isinstance(e, Finished) for e in seen)


async def test_a_cancelled_sequence_read_whole_ends_cancelled(model, tokenizer) -> None:
    loop = engine_loop_for(model, tokenizer)
    try:
        (gen,) = loop.submit(
            [1, 2, 3], SamplingParams(max_tokens=100_000, temperature=0), stream=False
        )
        async for e in gen.events():
            if isinstance(e, Started):
                gen.cancel()
            last = e
        assert isinstance(last, Finished) and last.finish_reason == "cancelled"
        await asyncio.wait_for(gen.wait(), 5)
    finally:
        loop.close(wait_s=5.0)


# --- the detokenizer's direct decode -----------------------------------------------------------
def test_the_backend_decode_is_the_tokenizers_decode(tokenizer) -> None:
    decode = backend_decoder(tokenizer)
    assert decode is not None  # SmolLM2's tokenizer is a plain TokenizersBackend
    rng = random.Random(0)
    specials = sorted(tokenizer.all_special_ids)
    mixed = tokenizer(MIXED, add_special_tokens=False)["input_ids"]
    cases = [[], mixed, mixed[:3] + specials[:2] + mixed[3:]]
    cases += [[rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 9))] for _ in range(300)]
    for ids in cases:
        for skip in (True, False):
            expected = tokenizer.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            )
            assert decode(ids, skip_special_tokens=skip) == expected, ids


def test_the_detokenizer_gives_the_same_pieces_with_and_without_the_backend(tokenizer) -> None:
    rng = random.Random(1)
    ids = tokenizer(MIXED * 3, add_special_tokens=False)["input_ids"]
    ids += [rng.randrange(len(tokenizer)) for _ in range(200)] + sorted(tokenizer.all_special_ids)
    fast = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    slow = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    slow._backend = None  # tokenizer.decode, as for any other tokenizer
    assert fast._backend is not None
    assert [fast.add(i) for i in ids] + [fast.flush()] == [slow.add(i) for i in ids] + [
        slow.flush()
    ]


def test_a_tokenizer_that_overrides_decode_keeps_its_own(tokenizer) -> None:
    class Custom(type(tokenizer)):  # type: ignore[misc]
        def decode(self, *args: Any, **kwargs: Any) -> Any:
            return "custom"

    other = object.__new__(Custom)  # the same state, another class
    other.__dict__.update(tokenizer.__dict__)
    assert backend_decoder(other) is None
    assert IncrementalDetokenizer(other)._backend is None
    assert backend_decoder(object()) is None


# --- the disconnect poller ---------------------------------------------------------------------
class _Gen:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


async def test_one_poller_cancels_only_the_requests_whose_client_went_away() -> None:
    watch = v1._disconnect_watch()
    assert v1._disconnect_watch() is watch  # one per loop
    gone = {i: False for i in range(20)}
    gens = {i: [_Gen(), _Gen()] for i in gone}
    keys = {i: watch.add(lambda i=i: gone[i], gens[i]) for i in gone}
    task = watch._task
    assert task is not None and not task.done()
    gone[3] = gone[11] = True
    await asyncio.sleep(v1.DISCONNECT_POLL_S * 3)
    for i, pair in gens.items():
        assert all(g.cancelled == (i in (3, 11)) for g in pair), i
    assert watch._task is task  # one task for all of them
    for key in keys.values():
        watch.remove(key)
    assert watch._task is None
    await asyncio.sleep(0)
    assert task.cancelled() or task.done()


async def test_a_poll_that_raises_ends_only_its_own_watch() -> None:
    watch = v1._disconnect_watch()
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        flag = {"gone": False}
        broken, fine = [_Gen()], [_Gen()]

        def boom() -> bool:
            raise ValueError("no transport")

        k1 = watch.add(boom, broken)
        k2 = watch.add(lambda: flag["gone"], fine)
        await asyncio.sleep(v1.DISCONNECT_POLL_S * 2)
        assert [type(c.get("exception")) for c in reported] == [ValueError]
        flag["gone"] = True
        await asyncio.sleep(v1.DISCONNECT_POLL_S * 2)
        assert fine[0].cancelled and not broken[0].cancelled
        watch.remove(k1)
        watch.remove(k2)
        assert watch._task is None
    finally:
        loop.set_exception_handler(None)
