"""The models and prompts the benchmarks share: random-weight model shapes (SmolLM2-135M's,
Qwen2.5-0.5B's, Llama-3-8B's) built in process (:func:`build_model`) or saved into a home's
catalogue with the default model's tokenizer (:func:`make_shape`), random prompts, and the chat
topics of the serving benchmarks (:data:`TOPICS`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

TOPICS = (
    "the sea",
    "a forest",
    "the moon",
    "a city at night",
    "a mountain",
    "rain",
    "a library",
    "the desert",
    "a garden",
    "winter",
    "a train",
    "the sun",
    "a river",
    "a market",
    "an old house",
    "the stars",
)


SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
}


def bfloat16_model(folder: str | None) -> Any:
    """The transformers model in ``folder`` in bfloat16, eval mode; None: the embedded default
    (SmolLM2-135M-Instruct), imported into a temporary ``MISERVER_HOME``."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    if folder is None:
        from miserver.serving.models.default_model import import_default, model_dir

        home = tempfile.mkdtemp(prefix="miserver-bench-")
        import_default(home, progress=False)
        folder = str(model_dir(home))
    from miserver.serving.models.loader import own_cpu_storages

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    own_cpu_storages(model)  # as the server's load does (not the file's memory mapping)
    return model


def build_model(shape: str, device: str, context: int | None) -> tuple[Any, str]:
    """A bfloat16 model of ``shape`` on ``device``: the real default for smollm2 when it is
    imported (``MISERVER_HOME``), else random weights (lm_head sharpened so greedy decoding is
    well defined)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape == "smollm2":
        try:
            from miserver.serving.models.default_model import model_dir
            from miserver.spec.settings import default_home

            folder = model_dir(os.environ.get("MISERVER_HOME") or default_home())
            if (folder / "config.json").exists():
                model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
                return model.eval().to(device), "SmolLM2-135M-Instruct (real weights)"
        except Exception as exc:  # noqa: BLE001 - fall back to the random shape
            print(f"(default model unavailable: {exc}; random SmolLM2 shape)", file=sys.stderr)
    spec = dict(SHAPES[shape])
    if context:
        spec["max_position_embeddings"] = context
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval(), f"{shape} shape (random weights)"


def prompts(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = [8, 40, 120, 300][i % 4] + i
        out.append(torch.randint(10, vocab - 10, (length,), generator=g).tolist())
    return out


#: Qwen2.5-0.5B's layers with SmolLM2's vocabulary and a 4096-token context (``SHAPES``): served
#: with the default model's tokenizer.
SHAPE_05B = dict(SHAPES["0.5b"], vocab_size=49152, max_position_embeddings=4096)


#: Llama-3-8B's layers (32 x 4096, 32 heads, 8 key-value heads, vocabulary 128256: ``SHAPES``):
#: SmolLM2's tokenizer covers the first 49152 ids; the output rows past them are zero (see
#: :func:`make_shape`).
SHAPE_8B = dict(SHAPES["8b"])


def make_shape(
    home: str, name: str, shape: dict[str, Any] | None = None, device: str = "cpu"
) -> None:
    """Save a random bfloat16 model of ``shape`` (default :data:`SHAPE_05B`) with the default
    model's tokenizer into ``home`` and register it as ``name`` (nothing when the row exists).
    The output embedding is scaled by 8 (greedy decoding well defined); where the shape's
    vocabulary is larger than the tokenizer's, the output rows past the tokenizer's are zero, so
    their logits (0) stay far below the top ones and no id the tokenizer lacks is picked (the
    cost of the full-width head is kept). ``device``: where the weights are drawn (``cuda``: an
    8B shape in seconds, not minutes)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from miserver.serving.models.catalogue import Catalogue
    from miserver.serving.models.default_model import DEFAULT_NAME, model_dir

    catalogue = Catalogue(home)
    if catalogue.get_by_name(name) is not None:
        return
    folder = Path(home) / "bench-models" / name
    default = catalogue.get_by_name(DEFAULT_NAME)  # its folder may be another home's
    tokenizer = AutoTokenizer.from_pretrained(default.path if default else model_dir(home))
    config = AutoConfig.for_model(
        **(shape or SHAPE_05B),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(8.0)  # greedy decoding well defined
        if head.shape[0] > len(tokenizer):
            head[len(tokenizer) :].zero_()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    catalogue.register(name=name, format="safetensors", dtype="bfloat16", path=folder)
