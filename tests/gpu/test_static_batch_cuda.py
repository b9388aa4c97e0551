"""The static batch on a real CUDA card (issue 14): the eager batched decode of the default model
against each sequence decoded alone, and ``n`` through a served CUDA resident. Skipped without
CUDA (run on the GPU machine); tests/unit/test_static_batch.py covers the CPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEVICE = torch.device("cuda:0")
CHATS = [
    "What is the capital of France?",
    "Hi",
    "Explain what a CUDA graph is in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into German, French and Spanish, one per line.",
    "Why is the sky blue?",
    "Give me a name for a cat.",
    "Summarise the plot of Hamlet in two sentences.",
]
TOKENS = 32


@pytest.fixture(scope="module")
def default_model(default_home):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miserver.serving.default_model import model_dir

    folder = model_dir(default_home)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval().to(DEVICE)
    return model, AutoTokenizer.from_pretrained(folder)


def _greedy_batch(model, prompts: list[list[int]]) -> list[list[int]]:
    from miserver.serving.generation import cache_kwarg
    from miserver.serving.static_batch import BatchDecoder

    dec = BatchDecoder(model, DEVICE, cache_kwarg(model))
    logits = torch.stack([dec.prefill(p, all_logits=False)[-1].float() for p in prompts])
    dec.begin(list(range(len(prompts))))
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(TOKENS):
        tokens = [int(t) for t in torch.argmax(logits, dim=-1)]
        for row, t in zip(out, tokens, strict=True):
            row.append(t)
        logits = dec.step(tokens)
    return out


def test_batched_eager_decode_follows_the_lone_sequences(default_model) -> None:
    """Eight chat prompts of different lengths, 32 greedy tokens: batched (one masked pass a
    step) against each alone. Equal to rounding on CUDA (other kernels per batch size), so the
    test counts agreeing prompts and requires most of them, and every first token."""
    model, tokenizer = default_model
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
        for c in CHATS
    ]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    with torch.inference_mode():
        alone = [_greedy_batch(model, [p])[0] for p in prompts]
        batched = _greedy_batch(model, prompts)
    same = sum(a == b for a, b in zip(alone, batched, strict=True))
    print(f"cuda: {same}/{len(prompts)} prompts give the same {TOKENS} tokens batched and alone")
    assert all(a[0] == b[0] for a, b in zip(alone, batched, strict=True))
    assert same >= len(prompts) - 2
