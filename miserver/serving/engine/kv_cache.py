"""The paged KV cache: per layer, keys and values in fixed-size blocks, allocated once (issue 29).

Each layer holds ``keys`` and ``values`` of shape ``[num_blocks, block_size, num_kv_heads,
head_dim]`` in the model's dtype on its device. The number of blocks follows a byte budget
(:func:`blocks_for_budget`), not rows x context. The tensors are made once, when the engine is
built, and never reallocated while the model is resident, so a captured CUDA graph that reads
them stays valid across weight commits (the served weights change in place; the cache does not
move).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class CacheShape:
    """What one block position holds, per layer: ``num_kv_heads x head_dim`` keys and values."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token position takes over all layers (keys and values)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


def cache_shape(model: Any) -> CacheShape:
    """The cache geometry of a transformers causal LM (``config.num_hidden_layers``,
    ``num_key_value_heads`` (else ``num_attention_heads``), ``head_dim`` (else hidden /
    heads)); the dtype of its first floating parameter."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return CacheShape(config.num_hidden_layers, kv_heads, head_dim, dtype)


def blocks_for_budget(budget_bytes: int, shape: CacheShape, block_size: int) -> int:
    """Blocks that fit ``budget_bytes`` (at least 1 is not promised: 0 when it does not fit).

    >>> blocks_for_budget(2**20, CacheShape(2, 1, 64, torch.bfloat16), 16)
    128
    """
    return max(0, int(budget_bytes) // (shape.bytes_per_token * block_size))


class PagedKVCache:
    """Per-layer ``keys[layer]`` / ``values[layer]``: ``[num_blocks + 1, block_size,
    num_kv_heads, head_dim]`` (zeros), allocated once. Block ``num_blocks`` (``scratch_block``)
    is never given to a sequence: padding rows of a step write there.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1.
    """

    def __init__(
        self, shape: CacheShape, num_blocks: int, block_size: int, device: torch.device | str
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"the KV cache needs at least one block of at least one position "
                f"(num_blocks={num_blocks}, block_size={block_size}): raise the cache budget"
            )
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.scratch_block = num_blocks
        dims = (num_blocks + 1, block_size, shape.num_kv_heads, shape.head_dim)
        self.keys = [
            torch.zeros(dims, dtype=shape.dtype, device=self.device)
            for _ in range(shape.num_layers)
        ]
        self.values = [
            torch.zeros(dims, dtype=shape.dtype, device=self.device)
            for _ in range(shape.num_layers)
        ]

    @property
    def bytes(self) -> int:
        """Bytes the cache tensors take (the scratch block included)."""
        return (self.num_blocks + 1) * self.block_size * self.shape.bytes_per_token

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src`` onto ``dst`` in every layer, for each ``(src, dst)`` (copy on
        write)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        for tensor in (*self.keys, *self.values):
            tensor.index_copy_(0, dst, tensor.index_select(0, src))
