"""The paged decode attention kernel on the CPU: gather + SDPA against ``flex_attention``
(issue 29; docs/decisions.md, "The continuous engine's core").

One query per sequence (a decode step) of SmolLM2-135M's attention shape (9 heads, 3 key-value
heads, 64 dims, bfloat16) over ``--context`` positions in blocks of 16 scattered in a pool:

- ``gather + sdpa``: the engine's path (``paged_attention._batched_decode``): ``index_select``
  of the rows' blocks, one masked ``scaled_dot_product_attention`` call;
- ``flex (compiled)``: ``torch.compile(flex_attention)`` over the whole pool with a block mask
  that lets each row see its own blocks only (the block mask is built once, not timed; an
  engine would rebuild it whenever a block table changes), its compile time beside;
- ``sdpa, dense``: SDPA over keys already contiguous (the floor: no gather at all).

CPU ms a call (the process's CPU time), one thread. Usage::

    python benchmarks/engine_attention.py [--batches 1,16] [--context 256]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def _cpu_ms(fn, n: int = 20) -> float:  # noqa: ANN001
    fn()
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n * 1e3


def _one(batch: int, ctx: int, flex_attention, create_block_mask) -> None:  # noqa: ANN001
    heads, kv_heads, dim, bs, pool = 9, 3, 64, 16, 200
    kc = torch.randn(pool, bs, kv_heads, dim, dtype=torch.bfloat16)
    tables = torch.stack([torch.randperm(pool)[: ctx // bs] for _ in range(batch)])
    lens = torch.full((batch,), ctx)
    q = torch.randn(batch, heads, 1, dim, dtype=torch.bfloat16)
    width = tables.shape[1] * bs

    def gather_sdpa() -> torch.Tensor:
        k = kc.index_select(0, tables.reshape(-1)).view(batch, width, kv_heads, dim)
        k = k.transpose(1, 2)
        mask = (torch.arange(width)[None] < lens[:, None])[:, None, None]
        return F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)

    dense = kc.index_select(0, tables.reshape(-1)).view(batch, width, kv_heads, dim)
    dense = dense.transpose(1, 2).contiguous()
    pool_k = kc.view(1, pool * bs, kv_heads, dim).transpose(1, 2).contiguous()
    owner = torch.full((pool * bs,), -1)
    for b in range(batch):
        for blk in tables[b].tolist():
            owner[blk * bs : (blk + 1) * bs] = b

    def own_blocks(b, h, qi, kvi):  # noqa: ANN001, ANN202
        return owner[kvi] == qi

    rows = q.transpose(0, 2).reshape(1, heads, batch, dim)
    mask = create_block_mask(own_blocks, 1, None, batch, pool * bs, device="cpu")
    flex = torch.compile(flex_attention)
    start = time.time()
    flex(rows, pool_k, pool_k, block_mask=mask, enable_gqa=True)
    compile_s = time.time() - start
    g = _cpu_ms(gather_sdpa)
    f = _cpu_ms(lambda: flex(rows, pool_k, pool_k, block_mask=mask, enable_gqa=True))
    d = _cpu_ms(lambda: F.scaled_dot_product_attention(q, dense, dense, enable_gqa=True))
    print(f"{batch:>5} | {g:>11.3f} {f:>8.3f} {d:>8.3f} | {f / g:>11.1f} | {compile_s:>9.0f}")


def main() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = args.context
    print(
        f"{'batch':>5} | {'gather+sdpa':>11} {'flex':>8} {'dense':>8} | {'flex/gather':>11} | compile s"
    )
    for batch in [int(b) for b in args.batches.split(",")]:
        _one(batch, ctx, flex_attention, create_block_mask)


if __name__ == "__main__":
    main()
