"""Attention over the paged KV cache, plugged in through transformers' own extension point.

:func:`register` adds :func:`paged_attention_forward` to transformers' ``AttentionInterface``
under the name ``"miserver_paged"`` (issue 29). The engine's forward calls run with
``config._attn_implementation`` set to that name for the duration of the call
(:func:`use_paged_attention`) and pass the step's :class:`PagedMetadata` as the keyword
argument ``miserver_paged``, which transformers hands through every layer to the attention
function. Nothing of the model is replaced, copied or moved: the same modules, the same
parameter storages (the arena invariant); only the attention function and the cache differ.
Because ``"miserver_paged"`` has no mask function registered, transformers builds no mask
(``masking_utils``: a custom attention without a mask function gets none): the metadata carries
what each sequence may attend to.

The step's tokens are flattened into one row (``input_ids`` ``[1, T]``): each sequence's new
tokens are a contiguous run. Per layer the function

1. writes the run's keys and values into the cache at ``slot_mapping`` (``block * block_size +
   offset`` per token), then
2. attends, per sequence, its queries over its own cached positions (``[0, context_len)``),
   causal within the run.

Two attention paths, chosen per sequence by its query count (never by its neighbours):

- one query (a decode, or a one-token chunk): one masked ``scaled_dot_product_attention`` call
  for all such rows over their block tables padded to the widest (``[B, max_blocks]``). On the
  CPU a row's result is bit-identical whatever the padding width (measured, torch 2.13: widths
  16 to 2048), so it does not depend on its neighbours (issue 29); fixed shapes and no host
  reads, so a CUDA graph can capture it (:mod:`~miserver.serving.engine.model_runner`).
- several queries (a prefill chunk): on the CPU one call per sequence over its own gathered
  keys, causal within the chunk (so a chunk's bits do not depend on its neighbours). On CUDA the
  step's chunks are packed (:func:`pack_spans`): one call per pack over the pack's blocks
  gathered once, with a mask made once a step that lets each query see only its own sequence's
  positions up to its own (a varlen attention in one kernel launch a layer instead of one per
  sequence: a step admitting 64 prompts made 64 x layers launches before).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from miserver.serving.engine.kv_cache import PagedKVCache

#: The name under which the function is registered in transformers' ``AttentionInterface``.
ATTENTION_NAME = "miserver_paged"

_REGISTER_LOCK = threading.Lock()
_SWITCH_LOCK = threading.Lock()


@dataclass
class SeqSpan:
    """One sequence's part of a step.

    Attributes:
        q_start: index of its first new token in the flattened step.
        q_len: its new tokens this step.
        context_len: positions it attends to after this step's write (cached + new).
        blocks: its block ids covering ``context_len`` (int64, on the cache's device).
        mask: ``[q_len, context_len]`` bool (True: attend) when ``1 < q_len < context_len``;
            None otherwise (one query: no mask; ``q_len == context_len``: plain causal).
    """

    q_start: int
    q_len: int
    context_len: int
    blocks: torch.Tensor
    mask: torch.Tensor | None = None


@dataclass
class SpanPack:
    """Several sequences' prefill chunks attended in one call (:func:`pack_spans`).

    Attributes:
        q_index: ``[Tq]`` int64, the flattened step positions of the pack's queries.
        blocks: ``[nb]`` int64, every pack sequence's blocks, one sequence after another (the
            keys: ``S = nb * block_size`` positions).
        mask: ``[Tq, S]`` bool, True where a query attends a key: the same sequence, a key
            position at most the query's.
    """

    q_index: torch.Tensor
    blocks: torch.Tensor
    mask: torch.Tensor
    _grouped: dict[int, torch.Tensor] = field(default_factory=dict)

    def grouped_mask(self, group: int) -> torch.Tensor:
        """The mask for ``group`` query heads a KV head, ``[group * Tq, S]`` (made once)."""
        if group == 1:
            return self.mask
        if group not in self._grouped:
            self._grouped[group] = self.mask.repeat(group, 1)
        return self._grouped[group]


#: The most mask elements (queries x keys) of one pack: 16 M, 16 MB of bool.
PACK_LIMIT = 1 << 24


def pack_spans(
    spans: list[SeqSpan], block_size: int, limit: int = PACK_LIMIT
) -> tuple[list[SpanPack], list[SeqSpan]]:
    """Group ``spans`` into packs of at least two whose mask (queries x keys) stays within
    ``limit`` elements, in order; a span that packs with no other is returned alone (it is
    attended by itself, as on the CPU). Returns ``(packs, alone)``.

    Each pack's mask is made on the spans' device from a few small tensors (no host loop over
    positions): query ``t`` of sequence ``j`` (absolute position ``p_t``) attends key ``s`` of
    sequence ``j`` (position ``s - offset_j`` in its blocks) iff that position is ``<= p_t``;
    positions past the sequence's context are never attended (``p_t < context_len``)."""
    groups: list[list[SeqSpan]] = []
    current: list[SeqSpan] = []
    q_total = k_total = 0
    for span in spans:
        keys = span.blocks.shape[0] * block_size
        if current and (q_total + span.q_len) * (k_total + keys) > limit:
            groups.append(current)
            current, q_total, k_total = [], 0, 0
        current.append(span)
        q_total += span.q_len
        k_total += keys
    if current:
        groups.append(current)
    packs: list[SpanPack] = []
    alone: list[SeqSpan] = []
    for group in groups:
        if len(group) == 1:
            alone.append(group[0])
            continue
        packs.append(_pack(group, block_size))
    return packs, alone


def _pack(group: list[SeqSpan], block_size: int) -> SpanPack:
    device = group[0].blocks.device
    q_lens = [s.q_len for s in group]
    k_lens = [s.blocks.shape[0] * block_size for s in group]
    tq, sk = sum(q_lens), sum(k_lens)
    # host-side: per sequence, its first query position and its keys' offset in the pack
    q_index: list[int] = []
    q_first: list[int] = []
    k_offset: list[int] = []
    offset = 0
    for span, k_len in zip(group, k_lens, strict=True):
        q_index.extend(range(span.q_start, span.q_start + span.q_len))
        q_first.append(span.context_len - span.q_len)
        k_offset.append(offset)
        offset += k_len
    small = torch.tensor([q_lens, k_lens, q_first, k_offset], dtype=torch.long).to(device)
    seq_ids = torch.arange(len(group), device=device)
    q_seq = torch.repeat_interleave(seq_ids, small[0], output_size=tq)
    k_seq = torch.repeat_interleave(seq_ids, small[1], output_size=sk)
    q_starts = torch.cumsum(small[0], 0) - small[0]
    q_pos = torch.arange(tq, device=device) - q_starts[q_seq] + small[2][q_seq]
    k_pos = torch.arange(sk, device=device) - small[3][k_seq]
    mask = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    return SpanPack(
        torch.tensor(q_index, dtype=torch.long).to(device),
        torch.cat([s.blocks for s in group]),
        mask,
    )


@dataclass
class PagedMetadata:
    """What :func:`paged_attention_forward` needs for one forward pass.

    Attributes:
        cache: the paged cache.
        slot_mapping: ``[T]`` int64, the cache slot each flattened token writes (``block *
            block_size + offset``).
        spans: per sequence, for the ``loop`` path.
        packs: the spans packed for one attention call each (:func:`pack_spans`); None: one
            call per span.
        block_tables: ``[B, max_blocks]`` int64: the one-query rows' blocks (padded with the
            scratch block), for the batched decode path.
        context_lens: ``[B]`` int64, their context lengths.
        decode_index: ``[B]`` int64, which flattened tokens those rows are; None: every token
            (a pure decode step, the graph path).
        decode_mask: ``[B, 1, 1, max_blocks * block_size]`` bool, made once a step (else per
            layer from ``context_lens``).
    """

    cache: PagedKVCache
    slot_mapping: torch.Tensor
    spans: list[SeqSpan] = field(default_factory=list)
    packs: list[SpanPack] | None = None
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    decode_index: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None


def _write(cache: PagedKVCache, layer: int, key: torch.Tensor, value: torch.Tensor, slots: Any):
    kc, vc = cache.keys[layer], cache.values[layer]
    heads, dim = kc.shape[2], kc.shape[3]
    # key/value: [1, kv_heads, T, head_dim] -> [T, kv_heads, head_dim]
    kc.view(-1, heads, dim).index_copy_(0, slots, key[0].transpose(0, 1))
    vc.view(-1, heads, dim).index_copy_(0, slots, value[0].transpose(0, 1))
    return kc, vc


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[1, heads, T, head_dim]``,
    ``key``/``value`` ``[1, kv_heads, T, head_dim]`` (this step's tokens only); returns
    ``([1, T, heads, head_dim], None)``. The step's :class:`PagedMetadata` comes as the
    ``miserver_paged`` keyword (module docstring).

    Raises:
        RuntimeError: called without metadata (a forward outside the engine while the model
            is switched to this function).
    """
    meta: PagedMetadata | None = kwargs.get(ATTENTION_NAME)
    if meta is None:
        raise RuntimeError(
            "miserver_paged attention called without the engine's metadata: only the "
            "continuous engine's forward passes may use it"
        )
    layer = module.layer_idx
    kc, vc = _write(meta.cache, layer, key, value, meta.slot_mapping)
    if meta.block_tables is not None and meta.decode_index is None:
        return _batched_decode(query, kc, vc, meta, scaling), None  # every row one query
    kv_heads, dim = kc.shape[2], kc.shape[3]
    tokens = query.shape[2]
    heads = query.shape[1]
    covered = sum(s.q_len for s in meta.spans)
    if meta.packs is not None:
        covered += sum(int(p.q_index.shape[0]) for p in meta.packs)
    if meta.decode_index is not None:
        covered += meta.decode_index.shape[0]
    out = (query.new_empty if covered == tokens else query.new_zeros)(1, tokens, heads, dim)
    if meta.decode_index is not None:
        rows = _batched_decode(query.index_select(2, meta.decode_index), kc, vc, meta, scaling)
        out[0].index_copy_(0, meta.decode_index, rows[0])
    for pack in meta.packs or ():
        _packed_prefill(query, kc, vc, pack, out, scaling)
    for span in meta.spans:
        q = query[:, :, span.q_start : span.q_start + span.q_len]
        n = span.context_len
        k = kc.index_select(0, span.blocks).view(-1, kv_heads, dim)[:n].transpose(0, 1)[None]
        v = vc.index_select(0, span.blocks).view(-1, kv_heads, dim)[:n].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=span.mask,
            is_causal=span.mask is None and span.q_len > 1,
            scale=scaling,
            enable_gqa=heads != kv_heads,
        )
        out[0, span.q_start : span.q_start + span.q_len] = o[0].transpose(0, 1)
    return out, None


def _packed_prefill(
    query: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    pack: SpanPack,
    out: torch.Tensor,
    scaling: float | None,
) -> None:
    """One attention call for a pack's queries (``query`` ``[1, heads, T, head_dim]``) over
    its blocks, written into ``out`` ``[1, T, heads, head_dim]`` at the queries' positions.
    The query heads sharing a KV head are stacked as that head's queries (as
    :func:`_batched_decode` does on CUDA), the mask repeated for them."""
    heads, dim = query.shape[1], query.shape[3]
    kv_heads = kc.shape[2]
    group = heads // kv_heads
    tq = pack.q_index.shape[0]
    q = query.index_select(2, pack.q_index).contiguous()  # [1, heads, Tq, dim]
    k = kc.index_select(0, pack.blocks).view(-1, kv_heads, dim).transpose(0, 1)[None]
    v = vc.index_select(0, pack.blocks).view(-1, kv_heads, dim).transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(
        q.view(1, kv_heads, group * tq, dim),
        k,
        v,
        attn_mask=pack.grouped_mask(group),
        scale=scaling,
    )  # [1, kv_heads, group * Tq, dim]
    out[0].index_copy_(0, pack.q_index, o.view(1, heads, tq, dim)[0].transpose(0, 1))


def decode_mask(context_lens: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, 1, 1, length]`` bool: position ``p`` of row ``b`` is attended iff ``p <
    context_lens[b]``."""
    positions = torch.arange(length, device=context_lens.device)
    return (positions[None, :] < context_lens[:, None])[:, None, None, :]


def _batched_decode(
    query: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    meta: PagedMetadata,
    scaling: float | None,
) -> torch.Tensor:
    """One query per sequence over its blocks, padded to the table's width and masked:
    ``query`` ``[1, heads, B, head_dim]`` -> ``[1, B, heads, head_dim]``. Fixed shapes, no
    host reads (graph-capturable). On the CPU a row's result does not depend on the padding
    width, so not on its neighbours (measured: bit-identical for widths 16..2048)."""
    tables, lens = meta.block_tables, meta.context_lens
    assert tables is not None and lens is not None
    rows, max_blocks = tables.shape
    block_size, kv_heads, dim = kc.shape[1], kc.shape[2], kc.shape[3]
    length = max_blocks * block_size
    flat = tables.reshape(-1)  # index_select: measured faster than kc[tables] on the CPU
    k = kc.index_select(0, flat).view(rows, length, kv_heads, dim).transpose(1, 2)
    v = vc.index_select(0, flat).view(rows, length, kv_heads, dim).transpose(1, 2)
    mask = meta.decode_mask if meta.decode_mask is not None else decode_mask(lens, length)
    q = query[0].transpose(0, 1)[:, :, None]  # [B, heads, 1, head_dim]
    heads = q.shape[1]
    gqa = heads != kv_heads
    if gqa and q.is_cuda:
        # The query heads that share a KV head become that head's queries: [B, kv_heads,
        # group, head_dim] against [B, kv_heads, L, head_dim], the mask broadcast over them.
        # The same arithmetic as repeating K and V per query head (transformers' repeat_kv
        # order: head h reads KV head h // group), without the two copies a layer, and one
        # fused kernel (enable_gqa with a mask is not fused on every CUDA kernel).
        group = heads // kv_heads
        grouped = q.reshape(rows, kv_heads, group, dim)
        o = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scaling)
        return o.reshape(rows, heads, dim)[None]  # [1, B, heads, head_dim]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return o[:, :, 0][None]  # [1, B, heads, head_dim]


def register() -> None:
    """Register :func:`paged_attention_forward` as ``"miserver_paged"`` (idempotent)."""
    from transformers import AttentionInterface

    with _REGISTER_LOCK:
        if AttentionInterface._global_mapping.get(ATTENTION_NAME) is not paged_attention_forward:
            AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def model_configs(model: Any) -> list[Any]:
    """Every distinct config object the model's modules read ``_attn_implementation`` from."""
    seen: dict[int, Any] = {}
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    for module in modules:
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


@contextmanager
def use_paged_attention(configs: list[Any]) -> Iterator[None]:
    """Run the body with ``configs`` (a model's :func:`model_configs`) switched to
    ``"miserver_paged"``, restored after (the parameters, modules and their storages are
    untouched)."""
    with _SWITCH_LOCK:
        before = [c._attn_implementation for c in configs]
        for c in configs:
            c._attn_implementation = ATTENTION_NAME
        try:
            yield
        finally:
            for c, b in zip(configs, before, strict=True):
                c._attn_implementation = b
