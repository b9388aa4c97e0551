"""A tiny random Llama with sharp distributions, for the engine's in-process tests."""

from __future__ import annotations

from typing import Any


def sharp_tiny_llama(vocab_size: int = 128, max_position_embeddings: int = 256) -> Any:
    """A 2-layer Llama (hidden 64, 4 query heads over 2 KV heads, ``sdpa``), float32, in eval
    mode, drawn with seed 0, every parameter times 4: sharp distributions, so greedy
    comparisons meet no near-ties."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model
