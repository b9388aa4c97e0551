"""The static batch's eager decode step: several sequences, one forward pass a token (issue 14;
companion contract 4, "static batch").

One grant of the slot decodes up to ``MAX_BATCH_SIZE`` sequences together
(:class:`~miserver.serving.engine.slot.SlotBatch`). :class:`BatchDecoder` runs them with the
model's own eager forward over one Hugging Face ``DynamicCache`` of ``[rows, kv_heads, length,
head_dim]`` per layer:

- **Prefill, alone.** Each distinct prompt is prefilled by itself (batch 1, exactly the forward a
  request run alone makes), so its first token and its prompt logprobs are those of the request
  run alone; the ``n`` sequences of one request share that prefill.
- **One cache, left-padded.** The prefilled keys and values are laid side by side, shorter
  prompts padded on the left to the longest; a sequence that ends is dropped from the cache
  (its row), so the pass shrinks as sequences finish.
- **Attention by row (CPU).** The padding is never attended to: while a batched step runs, the
  ``sdpa`` attention function of transformers (``AttentionInterface``, the extension point
  transformers documents for replacing an attention function) computes each row over its own
  keys only, with no mask: the very call a request run alone makes. The override is keyed to
  the calling thread (a thread-local set for the step), so every other forward in the process,
  the trainer's included, runs the stock function. A model whose attention is not ``sdpa``,
  or that uses a sliding window, gets a padding mask instead (correct, not bit-identical), and
  so does every model on CUDA (one attention call a layer; a call per row would make a step of
  64 sequences thousands of kernel launches).
- **At least two rows (CPU).** Matrix products on the CPU (oneDNN, bfloat16) give a row the same bits
  whatever other rows share the product, as long as there are at least two; a product of one
  row takes another kernel whose sums round differently (measured 2026-12-02, torch 2.13,
  SmolLM2-135M's ``down_proj``: up to 1 ulp, which greedy decoding turns into a different text
  within tens of tokens). So a step of one sequence runs it twice. On two cores that costs
  nothing measurable (60.6 ms a step for one row, 65.9 for two, 87.2 for eight).

Together these make a batched greedy answer the same text as the same request decoded by
itself (tests/unit/test_static_batch.py checks it on the default model). On CUDA the decode of a
lone sequence runs through the decode engine's graphs (:mod:`~miserver.serving.engine.decode_graphs`),
whose kernels differ from the eager batched ones: there the two agree to rounding, not bit for
bit.

The seed of each choice (contract 4, ``n`` with ``seed``): :func:`choice_seed`.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from typing import Any

import torch

#: The fewest rows a batched decode step computes (see the module docstring).
MIN_ROWS = 2

_ROWS = threading.local()  # .starts: each row's first real position, during a batched step
_INSTALL_LOCK = threading.Lock()


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request with ``seed`` (contract 4, ``n``).

    Choice 0 samples with ``seed`` itself, so ``n=1`` and the first choice of any ``n`` give the
    same answer. Choice ``i > 0`` samples with the integer whose big-endian bytes are the first
    eight of ``sha256(b"miserver-choice:<seed>:<i>")`` (decimal ``seed`` and ``i``): a request
    with that seed and ``n=1`` reproduces choice ``i``. None (no seed) stays None.

    >>> choice_seed(7, 0), choice_seed(None, 3)
    (7, None)
    """
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"miserver-choice:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def install_row_attention() -> None:
    """Wrap transformers' ``sdpa`` attention function so that, inside :func:`_rows`, each row
    attends over its own keys only (idempotent; the stock function otherwise)."""
    from transformers.modeling_utils import AttentionInterface

    with _INSTALL_LOCK:
        original = AttentionInterface._global_mapping.get("sdpa")
        if original is None or getattr(original, "_miserver_rows", False):
            return

        def sdpa_by_row(module, query, key, value, attention_mask, *args, **kwargs):  # noqa: ANN001, ANN202
            starts = getattr(_ROWS, "starts", None)
            if starts is None:
                return original(module, query, key, value, attention_mask, *args, **kwargs)
            outputs = [
                original(
                    module,
                    query[b : b + 1],
                    key[b : b + 1, :, start:],
                    value[b : b + 1, :, start:],
                    None,
                    *args,
                    **kwargs,
                )[0]
                for b, start in enumerate(starts)
            ]
            return torch.cat(outputs, dim=0), None

        sdpa_by_row._miserver_rows = True  # type: ignore[attr-defined]
        AttentionInterface.register("sdpa", sdpa_by_row)


def _by_row_ok(model: Any, device: torch.device) -> bool:
    if device.type != "cpu":
        return False  # one masked attention call a layer: a call per row would be launch-bound
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    window = getattr(config, "sliding_window", None)
    return not (window and getattr(config, "use_sliding_window", True))


def _cache_of(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def _layers_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``(keys, values)``, ``[batch, kv_heads, length, head_dim]``."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # transformers 4.x


class BatchDecoder:
    """The eager decode of a static batch (see the module docstring).

    Use: :meth:`prefill` each distinct prompt (returns its logits), :meth:`begin` with the
    prefill each row decodes from, then :meth:`step` with each row's next token and
    :meth:`keep` the rows that go on, until none is left.

    Args:
        model: a causal LM in eval mode (a transformers model, possibly wrapped by PEFT).
        device: where its parameters are.
        cache_name: the forward argument that takes the cache (``cache`` or
            ``past_key_values``; :func:`~miserver.serving.engine.generation.cache_kwarg`).
    """

    kind = "eager"

    def __init__(self, model: Any, device: torch.device, cache_name: str) -> None:
        install_row_attention()
        self._model = model
        self._device = device
        self._cache_name = cache_name
        self._by_row = _by_row_ok(model, device)
        self._min_rows = MIN_ROWS if device.type == "cpu" else 1
        self._prefilled: list[tuple[Any, int]] = []
        self._cache: Any = None
        self._starts: list[int] = []  # per cache row: its first real position
        self._lengths: list[int] = []  # per cache row: its real positions so far
        self._real = 0  # rows that carry a sequence (the cache may hold one more, a copy)
        self._width = 0  # positions in the cache, padding included

    @property
    def rows(self) -> int:
        """Sequences still decoding."""
        return self._real

    def full(self, row: int) -> bool:
        """Whether ``row`` has no further position: never (the context check at admission
        bounds every sequence; the cache grows)."""
        return False

    def prefill(self, prompt_ids: Sequence[int], *, all_logits: bool) -> torch.Tensor:
        """Prefill one prompt alone; returns its logits ``[len(prompt_ids), vocab]``
        (``all_logits``) or ``[1, vocab]``, in the model's dtype. Call before :meth:`begin`."""
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self._device)
        kwargs: dict[str, Any] = {"use_cache": True}
        if not all_logits:
            kwargs["logits_to_keep"] = 1
        out = self._model(input_ids=ids, **kwargs)
        self._prefilled.append((_cache_of(out), len(prompt_ids)))
        return out.logits[0]

    def begin(self, sources: Sequence[int]) -> None:
        """Lay out the cache: row ``r`` continues prefill ``sources[r]`` (an index into the
        :meth:`prefill` calls, in order; repeated for the ``n`` sequences of one prompt)."""
        from transformers import DynamicCache

        if not sources:
            raise ValueError("a batch needs at least one row")
        rows = list(sources)
        self._real = len(rows)
        if len(rows) < self._min_rows:
            rows += [rows[-1]] * (self._min_rows - len(rows))
        lengths = [self._prefilled[i][1] for i in rows]
        width = max(lengths)
        per_prefill = [_layers_kv(cache) for cache, _n in self._prefilled]
        joint = DynamicCache()
        for layer in range(len(per_prefill[0])):
            keys, values = [], []
            for i, n in zip(rows, lengths, strict=True):
                k, v = per_prefill[i][layer]
                pad = (0, 0, width - n, 0)
                keys.append(torch.nn.functional.pad(k, pad) if width > n else k)
                values.append(torch.nn.functional.pad(v, pad) if width > n else v)
            joint.update(torch.cat(keys), torch.cat(values), layer)
        self._prefilled = []  # the joint cache holds what is needed
        self._cache = joint
        self._lengths = lengths
        self._starts = [width - n for n in lengths]
        self._width = width

    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        """One decode step: row ``r`` takes ``tokens[r]``; returns the next logits, float32
        ``[rows, vocab]``."""
        if len(tokens) != self._real:
            raise ValueError(f"{self._real} rows decode, got {len(tokens)} tokens")
        ids = list(tokens) + [tokens[-1]] * (len(self._lengths) - self._real)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self._device)[:, None]
        positions = torch.tensor(self._lengths, dtype=torch.long, device=self._device)[:, None]
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "position_ids": positions,
            "use_cache": True,
            self._cache_name: self._cache,
        }
        if self._by_row:
            _ROWS.starts = self._starts
        elif any(self._starts):  # rows of equal length need no mask (one sequence: none)
            mask = torch.ones(len(ids), self._width + 1, dtype=torch.long, device=self._device)
            for r, start in enumerate(self._starts):
                mask[r, :start] = 0
            kwargs["attention_mask"] = mask
        try:
            out = self._model(**kwargs)
        finally:
            _ROWS.starts = None
        self._cache = _cache_of(out)
        self._lengths = [n + 1 for n in self._lengths]
        self._width += 1
        return out.logits[: self._real, -1].float()

    def keep(self, rows: Sequence[int]) -> None:
        """Go on with ``rows`` (indices into the current rows, in order) only."""
        rows = list(rows)
        if rows == list(range(self._real)):
            return
        self._real = len(rows)
        if not rows:
            self._cache = None
            return
        if len(rows) < self._min_rows:
            rows += [rows[-1]] * (self._min_rows - len(rows))
        index = torch.tensor(rows, dtype=torch.long, device=self._device)
        select = getattr(self._cache, "batch_select_indices", None)
        if select is not None:
            select(index)
        else:  # transformers 4.x
            for i in range(len(self._cache.key_cache)):
                self._cache.key_cache[i] = self._cache.key_cache[i][index]
                self._cache.value_cache[i] = self._cache.value_cache[i][index]
        self._starts = [self._starts[r] for r in rows]
        self._lengths = [self._lengths[r] for r in rows]
        # positions that are padding in every row left are dropped
        drop = min(self._starts)
        if drop > 0:
            self._crop_left(drop)

    def _crop_left(self, drop: int) -> None:
        layers = getattr(self._cache, "layers", None)
        if layers is None:
            return  # transformers 4.x: keep the padding (attended by no row)
        for layer in layers:
            layer.keys = layer.keys[:, :, drop:]
            layer.values = layer.values[:, :, drop:]
        self._starts = [s - drop for s in self._starts]
        self._width -= drop
