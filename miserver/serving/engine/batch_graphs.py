"""The static batch's session over the decode engine's batch cache (issue 14): the batch's
prompts prefilled together, left-padded, into one write column, and each decode step replayed
as a CUDA graph per (rows, length) bucket (:class:`BatchGraphSession`, obtained from
:meth:`miserver.serving.engine.decode_graphs.DecodeEngine.batch_session`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from miserver.serving.engine.graph_buckets import pick_bucket

log = logging.getLogger("miserver.decode_graphs")

#: The most padded prompt positions prefilled in one forward pass of a static batch.
BATCH_PREFILL_POSITIONS = 16384


class BatchGraphSession:
    """A static batch's prefill and decode steps over the engine's batch cache, with the
    :class:`~miserver.serving.engine.static_batch.BatchDecoder` interface (``prefill``, ``begin``,
    ``step``, ``keep``, ``full``, ``rows``), obtained from :meth:`DecodeEngine.batch_session`.

    - **Prefill, padded together.** :meth:`expect` names the batch's distinct prompts; the first
      :meth:`prefill` runs them left-padded through one eager forward pass per
      :data:`BATCH_PREFILL_POSITIONS` padded positions (a pass per prompt would be launch-bound
      on a GPU), and each :meth:`prefill` returns its prompt's last logits. A prompt that wants
      every position's logits (echo with logprobs), or one whose padded pass failed, is
      prefilled alone.
    - **One write column.** Row ``r`` holds its prompt's keys and values at the positions just
      before the shared write column, padded on the left; the additive mask of row ``r`` opens
      its own positions only, and each step opens the new column in every row (inside the
      graph). Position ids are per row.
    - **Graphs per (rows, length) bucket.** A step replays the graph of the smallest row bucket
      holding the live rows (:func:`row_buckets`) and the smallest length bucket holding the
      next column, captured at its first use (a capture is two warm-up steps and one recorded
      one; capturing every pair at load would cost tens of seconds for pairs most servers never
      use). Rows whose sequences ended stay in place (their results unread) until at most half
      the bucket is live; then the live rows are moved to the front and a smaller bucket
      decodes them.

    On CUDA a batched answer equals the same request decoded alone to rounding (other kernels,
    a padded prefill), not bit for bit: greedy texts agree except at near-ties
    (tests/gpu/test_static_batch_cuda.py).
    """

    def __init__(self, engine: Any) -> None:  # a DecodeEngine
        self._e = engine
        self.kind = "graphs:captured"
        self._expected: list[list[int]] = []
        self._prefilled: list[tuple[Any, int, int, int]] = []  # (kv, index, length, width)
        self._batched: dict[tuple[int, ...], tuple[Any, int, int, torch.Tensor]] | None = None
        self._phys: list[int] = []  # per live row: its row in the cache
        self._bucket = 0  # rows of the graph that decodes
        self._column = 0  # the shared write column

    @property
    def rows(self) -> int:
        """Sequences still decoding."""
        return len(self._phys)

    def full(self, row: int) -> bool:
        """Never: the batch was admitted only if its longest need fits the context."""
        return False

    def expect(self, prompts: Sequence[Sequence[int]]) -> None:
        """The distinct prompts the batch will prefill (before the first :meth:`prefill`)."""
        self._expected = [list(p) for p in prompts]

    def _prefill_together(self) -> None:
        from transformers import DynamicCache

        e = self._e
        self._batched = {}
        prompts = list({tuple(p): None for p in self._expected})
        chunk: list[tuple[int, ...]] = []
        chunks: list[list[tuple[int, ...]]] = []
        for p in sorted(prompts, key=len):
            if chunk and len(p) * (len(chunk) + 1) > BATCH_PREFILL_POSITIONS:
                chunks.append(chunk)
                chunk = []
            chunk.append(p)
        if chunk:
            chunks.append(chunk)
        for chunk in chunks:
            width = max(len(p) for p in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            pos = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, p in enumerate(chunk):
                start = width - len(p)
                ids[j, start:] = torch.tensor(p, dtype=torch.long)
                mask[j, start:] = 1
                pos[j, start:] = torch.arange(len(p))
            cache = DynamicCache()
            out = e.model(
                input_ids=ids.to(e.device),
                attention_mask=mask.to(e.device),
                position_ids=pos.to(e.device),
                use_cache=True,
                logits_to_keep=1,
                **{e._cache_name: cache},
            )
            padding = (mask == 0).to(e.device)[:, None, :, None]
            kv = [
                (k.masked_fill(padding, 0), v.masked_fill(padding, 0))  # no NaN of a pad row
                for k, v in _kv_layers(cache)  # updated in place by the forward
            ]
            for j, p in enumerate(chunk):
                self._batched[p] = (kv, j, width, out.logits[j : j + 1, -1])

    def prefill(self, prompt_ids: Sequence[int], *, all_logits: bool) -> torch.Tensor:
        """The prompt's logits ``[1, vocab]`` (or ``[len, vocab]`` with ``all_logits``), in the
        model's dtype; its keys and values wait for :meth:`begin`."""
        from transformers import DynamicCache

        e = self._e
        key = tuple(prompt_ids)
        if not all_logits:
            if self._batched is None and self._expected:
                try:
                    self._prefill_together()
                except Exception as exc:  # noqa: BLE001 - each prompt alone, below
                    log.warning(
                        "static batch: the padded prefill failed (%s: %s); prefilling each "
                        "prompt alone",
                        type(exc).__name__,
                        exc,
                    )
                    self._batched = {}
            found = (self._batched or {}).get(key)
            if found is not None:
                kv, j, width, logits = found
                self._prefilled.append((kv, j, len(key), width))
                return logits
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=e.device)
        kwargs: dict[str, Any] = {"use_cache": True, e._cache_name: DynamicCache()}
        if not all_logits:
            kwargs["logits_to_keep"] = 1
        out = e.model(input_ids=ids, **kwargs)
        self._prefilled.append((_kv_layers(kwargs[e._cache_name]), 0, len(key), len(key)))
        return out.logits[0]

    def begin(self, sources: Sequence[int]) -> None:
        """Lay out the cache: row ``r`` continues prefill ``sources[r]`` (an index into the
        :meth:`prefill` calls, in order)."""
        e = self._e
        rows = len(sources)
        if not 1 <= rows <= e.batch_rows:  # one: the others ended at their first token
            raise ValueError(f"a batch of {rows} rows; this engine decodes 1 to {e.batch_rows}")
        bucket = next(b for b in e.batch_buckets if b >= rows)
        width = max(self._prefilled[i][2] for i in sources)
        e._bmask[:bucket].fill_(torch.finfo(e._bmask.dtype).min)
        by_block: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (kv id, width) -> rows
        for row, i in enumerate(sources):
            kv, j, n, w = self._prefilled[i]
            by_block.setdefault((id(kv), w), []).append((row, j))
            e._bmask[row, 0, 0, width - n : width] = 0
        blocks = {(id(kv), w): kv for kv, _j, _n, w in self._prefilled}
        for (kv_id, w), placed in by_block.items():
            kv = blocks[(kv_id, w)]
            target = torch.tensor([r for r, _ in placed], dtype=torch.long, device=e.device)
            source = torch.tensor([j for _, j in placed], dtype=torch.long, device=e.device)
            for layer, (k, v) in enumerate(kv):
                e._bkeys[layer][target, :, width - w : width] = k.index_select(0, source)
                e._bvalues[layer][target, :, width - w : width] = v.index_select(0, source)
        lengths = [self._prefilled[i][2] for i in sources] + [0] * (bucket - rows)
        e._bpos[:bucket].copy_(torch.tensor(lengths, dtype=torch.long)[:, None])
        e._bpositions.fill_(width)
        self._prefilled = []
        self._batched = None
        self._phys = list(range(rows))
        self._bucket = bucket
        self._column = width

    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        """One decode step: row ``r`` takes ``tokens[r]``; returns float32 ``[rows, vocab]``
        logits (a view of the static buffer when no row has left, overwritten by the next step).

        Raises:
            ValueError: a token count other than the rows, or the context is full.
        """
        e = self._e
        if len(tokens) != len(self._phys):
            raise ValueError(f"{len(self._phys)} rows decode, got {len(tokens)} tokens")
        length = pick_bucket(e.buckets, self._column + 1)
        ids = [0] * self._bucket
        for row, token in zip(self._phys, tokens, strict=True):
            ids[row] = int(token)
        e._bids[: self._bucket].copy_(torch.tensor(ids, dtype=torch.long)[:, None])
        key = (self._bucket, length)
        if key not in e._bgraphs and e._use_graphs:
            e._capture_batch(*key)
        graph = e._bgraphs.get(key)
        if graph is not None:
            graph.replay()
            e.stats.batch_replays += 1
        else:
            e._batch_step_fn(*key)()
        self._column += 1
        used_rows, used_positions = e._bused
        e._bused = (max(used_rows, self._bucket), max(used_positions, self._column))
        logits = e._blogits
        if self._phys == list(range(len(self._phys))):
            return logits[: len(self._phys)]
        return logits.index_select(0, torch.tensor(self._phys, device=e.device))

    def keep(self, rows: Sequence[int]) -> None:
        """Go on with ``rows`` (indices into the current rows, in order) only; at most half of
        the bucket live moves them to the front of the cache and to a smaller bucket."""
        e = self._e
        self._phys = [self._phys[r] for r in rows]
        live = len(self._phys)
        if not live:
            return
        smaller = [b for b in e.batch_buckets if b >= live]
        target = smaller[0] if smaller else self._bucket
        if target >= self._bucket or live > self._bucket // 2:
            return
        if self._phys != list(range(live)):
            index = torch.tensor(self._phys, dtype=torch.long, device=e.device)
            upto = self._column
            for t in (*e._bkeys, *e._bvalues):
                t[:live, :, :upto] = t[: self._bucket, :, :upto].index_select(0, index)
            e._bmask[:live] = e._bmask[: self._bucket].index_select(0, index)
            e._bpos[:live] = e._bpos[: self._bucket].index_select(0, index)
        self._phys = list(range(live))
        self._bucket = target


def _kv_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``(keys, values)`` of a Hugging Face cache, ``[batch, kv_heads, length,
    head_dim]``."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # transformers 4.x
