"""The decode engine of a CUDA resident: a static KV cache in length buckets and the one-token
decode step captured as a CUDA graph per bucket (issue 13; design notes, "Decoding at the GPU's
speed"; companion contract 1, ``DECODE_GRAPHS``).

Why it is valid across commits. A CUDA graph replays kernels over fixed addresses. The served
storages never move (weights page: a moved address tears the set), so a graph captured over them
reads whatever a trainer or an in-place checkpoint load last wrote there: nothing is recaptured
after a commit. Only a change of *which* modules compute (an adapter applied or removed) or of the
storages themselves (a full reload, a swap, an unload) makes a graph stale. The weights runtime
performs those lifecycle effects (``BEGIN_ADAPTER_CHANGE``, ``START_MODEL_LOAD``,
``START_MODEL_UNLOAD``) by calling :meth:`DecodeEngine.invalidate`; a replaced or unloaded
resident's engine is closed by the host's drop hook; ``DROP_CACHE`` (quiesce, save, loads, the
adapter) calls :meth:`DecodeEngine.reset`, which zeroes the KV cache, the only thing the engine
keeps between requests.

The cache. One buffer per layer of ``[1, kv_heads, context, head_dim]`` (the model's dtype), made
at load. A bucket of length ``L`` is a ``transformers.StaticCache`` whose layers are *views* of
the first ``L`` positions of those buffers, so attention over a short chat reads ``L`` positions,
not the whole context, and a generation that outgrows its bucket moves to the next one with its
keys and values already in place (the same memory). All buckets share one write-position tensor
per layer (``StaticLayer.cumulative_length``), which a replay advances on the device.

The step. ``captured``: the eager Hugging Face forward over a bucket's cache, captured once per
bucket with ``torch.cuda.CUDAGraph`` (all buckets at load: a capture costs two warm-up steps and
one recorded step, well under a second for all buckets of a small model; a bucket that is not yet
captured, e.g. after an adapter change, is captured at its first use). ``compiled``: the same
forward through ``torch.compile`` (inductor's fused kernels, no cudagraph trees), captured the
same way; compiles are slow (tens of seconds a bucket) and are cached under
``MISERVER_HOME/compile-cache`` so a restart is quick. A replay writes the next token's logits,
float32 ``[vocab]``, into a static buffer; sampling, logprobs, stop matching, detokenization and
cancellation stay in :mod:`miserver.serving.engine.generation`, between steps.

Failure. Any error while building, capturing or compiling is one warning line, a count in
``miserver_decode_graph_fallbacks_total{reason}``, and the step of that bucket runs eagerly over
the same static cache (correct, slower); a request never fails for it. One generation uses the
engine at a time (:meth:`DecodeEngine.session` returns None while it is busy: a second concurrent
generation, possible only with ``MAX_CONCURRENT_REQUESTS`` above 1, decodes eagerly with its own
cache).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# the static batch's session and the buckets, re-exported from here for the callers of old
from miserver.serving.engine.batch_graphs import BATCH_PREFILL_POSITIONS, BatchGraphSession  # noqa: F401
from miserver.serving.engine.graph_buckets import (  # noqa: F401
    SMALLEST_BUCKET,
    bucket_lengths,
    pick_bucket,
    row_buckets,
)

log = logging.getLogger("miserver.decode_graphs")

#: ``DECODE_GRAPHS`` values (companion contract 1).
MODES = ("captured", "compiled", "off")
#: Room kept free on the card beyond the cache, for the graphs' private pool and activations.
GRAPH_POOL_MARGIN_BYTES = 256 * 2**20
#: The share of the card's free memory (after the weights and the one-sequence cache, at load)
#: that the static batch's cache may take; its rows are cut to fit (issue 14).
BATCH_CACHE_FRACTION = 0.25


class EngineUnavailable(RuntimeError):
    """The decode engine cannot serve this resident; ``reason`` is a short label for the metric
    (``cpu``, ``off``, ``memory``, ``layout``, ``build``), the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def resolve_mode(requested: str, device: torch.device | str) -> tuple[str, str | None]:
    """The mode that applies on ``device``, and why it differs from ``requested`` (or None).

    On the CPU it is always ``off`` (contract 1: ``DECODE_GRAPHS`` applies to CUDA residents).
    """
    if requested not in MODES:
        raise ValueError(f"DECODE_GRAPHS must be one of {', '.join(MODES)}, got {requested!r}")
    kind = torch.device(device).type
    if kind != "cuda" and requested != "off":
        return "off", f"the resident is on {kind}: decode graphs need CUDA, decoding eagerly"
    return requested, None


@dataclass
class EngineStats:
    """What the engine did, for ``/metrics`` and the benchmarks (times in milliseconds)."""

    mode: str
    buckets: tuple[int, ...]
    cache_bytes: int = 0
    graph_pool_bytes: int = 0
    captured: dict[int, float] = field(default_factory=dict)  # bucket -> capture ms
    eager_buckets: set[int] = field(default_factory=set)  # capture failed: eager over the cache
    replays: int = 0
    invalidations: int = 0
    fallbacks: int = 0
    batch_rows: int = 0  # the most sequences a batched graph decodes (0: batches decode eagerly)
    batch_cache_bytes: int = 0  # of cache_bytes, the static batch's cache
    batch_captured: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, L) -> ms
    batch_replays: int = 0
    batch_note: str = ""  # why there are no batched graphs, when there are none


def device_of(model: Any) -> torch.device:
    """The device of ``model``'s first parameter (the CPU for a module without any)."""
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError, TypeError):
        return torch.device("cpu")


def _cache_kwarg(model: Any) -> str:
    from miserver.serving.engine.decoders import cache_kwarg

    return cache_kwarg(model)


def _call_forward(model: Any, cache_name: str, cache: Any, ids: torch.Tensor, pos: torch.Tensor):
    return model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_name: cache})


#: The side stream every capture's warm-up runs on, one per device for the process's life. A new
#: ``torch.cuda.Stream`` per capture came from PyTorch's pool of 32, and cuBLAS keeps a
#: workspace for every stream it has run on (32 MiB on an H200, allocated through the caching
#: allocator and never freed): each model swap counted 384-608 MiB more allocated until the
#: pool had gone round (tests/gpu/diagnose_swap_growth.py). One stream: one workspace.
_WARMUP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_warmup_lock = threading.Lock()


def warmup_stream(device: torch.device | str) -> torch.cuda.Stream:
    """The warm-up side stream of ``device`` (made on first use)."""
    device = torch.device(device)
    with _warmup_lock:
        stream = _WARMUP_STREAMS.get(device)
        if stream is None:
            stream = _WARMUP_STREAMS[device] = torch.cuda.Stream(device)
        return stream


class DecodeEngine:
    """A static KV cache and one CUDA graph per length bucket for one resident model.

    Args:
        model: the served causal LM (eval mode) on one CUDA device.
        mode: ``captured`` or ``compiled`` (``off`` and CPU residents raise; see
            :func:`resolve_mode`).
        context: the context window in positions (the largest bucket).
        buckets: the bucket lengths (default :func:`bucket_lengths` of ``context``).
        on_fallback: called with a reason label each time a bucket falls back to eager.
        compile_cache_dir: where ``compiled`` keeps inductor's cache (``TORCHINDUCTOR_CACHE_DIR``
            is set to it unless already set).
        graphs: False runs every step eagerly over the static cache (the path a bucket whose
            capture failed takes; on any device: the CPU tests check the cache logic with it).
        max_rows: ``MAX_BATCH_SIZE``; from 2 on, a second static cache of up to that many rows
            (cut to :data:`BATCH_CACHE_FRACTION` of the free memory) decodes a static batch
            through graphs per (rows, length) bucket (:meth:`batch_session`).

    Raises:
        EngineUnavailable: the model's cache layout is not one static layer per decoder layer
            (``layout``: sliding-window or hybrid attention), the card lacks room for the cache
            (``memory``), or the probe forward failed (``build``).
    """

    def __init__(
        self,
        model: Any,
        mode: str,
        context: int,
        *,
        buckets: Sequence[int] | None = None,
        on_fallback: Any = None,
        compile_cache_dir: str | None = None,
        graphs: bool = True,
        max_rows: int = 1,
    ) -> None:
        if mode not in ("captured", "compiled"):
            raise EngineUnavailable("off", f"decode graphs are {mode}")
        device = device_of(model)
        if graphs and device.type != "cuda":
            raise EngineUnavailable("cpu", "decode graphs need a CUDA resident")
        self._use_graphs = graphs
        self.model = model
        self.mode = mode
        self.device = device
        self.buckets = tuple(buckets) if buckets is not None else bucket_lengths(context)
        self.context = self.buckets[-1]
        self.stats = EngineStats(mode=mode, buckets=self.buckets)
        self._on_fallback = on_fallback
        self._lock = threading.Lock()  # one generation at a time
        self._state = threading.Lock()  # graphs and caches vs invalidate/close
        self._cache_name = _cache_kwarg(model)
        self._graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self._pool: Any = None
        self._closed = False
        self._closing = False
        self._stale = False
        self._reset_pending = False
        self._compiled: Any = None
        if mode == "compiled" and compile_cache_dir:
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", compile_cache_dir)
        self.batch_rows = 0
        self.batch_buckets: tuple[int, ...] = ()
        self._bgraphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}
        self._bcaches: dict[tuple[int, int], Any] = {}
        self._bkeys: list[torch.Tensor] = []
        self._bvalues: list[torch.Tensor] = []
        self._bused = (0, 0)  # (rows, positions) written since the last zeroing
        with torch.inference_mode():
            self._allocate()
            self._allocate_batch(max_rows)

    # --- building ---------------------------------------------------------------------------
    def _allocate(self) -> None:
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        config = self.model.config
        probe = StaticCache(config=config, max_cache_len=1)
        if not probe.layers or any(type(layer) is not StaticLayer for layer in probe.layers):
            kinds = sorted({type(layer).__name__ for layer in probe.layers})
            raise EngineUnavailable(
                "layout",
                f"the model's KV cache is not one full-attention static layer per decoder layer "
                f"({', '.join(kinds) or 'no layers'}): decoding eagerly",
            )
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        pos = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        try:  # one forward tells each layer's heads, head sizes and dtype
            _call_forward(self.model, self._cache_name, probe, ids, pos)
        except Exception as exc:
            raise EngineUnavailable(
                "build", f"the probe forward over a static cache failed: {exc}"
            ) from exc
        shapes = [
            (layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1], layer.keys.dtype)
            for layer in probe.layers
        ]
        if any(layer.keys.device != self.device for layer in probe.layers):
            raise EngineUnavailable("layout", "the model spans several devices: decoding eagerly")
        del probe
        need = sum(
            h * (kd + vd) * self.context * torch.empty((), dtype=dt).element_size()
            for h, kd, vd, dt in shapes
        )
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else need * 2
        if need + GRAPH_POOL_MARGIN_BYTES > free and self.device.type == "cuda":
            raise EngineUnavailable(
                "memory",
                f"the static KV cache needs {need / 2**20:.0f} MiB plus "
                f"{GRAPH_POOL_MARGIN_BYTES / 2**20:.0f} MiB for the graphs, and "
                f"{free / 2**20:.0f} MiB are free on {self.device}: decoding eagerly",
            )
        self._keys = [
            torch.zeros((1, h, self.context, kd), dtype=dt, device=self.device)
            for h, kd, _vd, dt in shapes
        ]
        self._values = [
            torch.zeros((1, h, self.context, vd), dtype=dt, device=self.device)
            for h, _kd, vd, dt in shapes
        ]
        # One write position per layer, shared by every bucket (views of one tensor).
        self._positions = torch.zeros(len(shapes), dtype=torch.long, device=self.device)
        self._shapes = shapes
        self.stats.cache_bytes = need
        self._caches = {length: self._bucket_cache(length) for length in self.buckets}
        self._ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self._pos = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        vocab = self._vocab_size()
        self._logits = torch.zeros(vocab, dtype=torch.float32, device=self.device)

    def _vocab_size(self) -> int:
        out = _call_forward(
            self.model, self._cache_name, self._caches[self.buckets[0]], self._ids, self._pos
        )
        self._positions.zero_()
        return int(out.logits.shape[-1])

    def _allocate_batch(self, max_rows: int) -> None:
        """The static batch's cache: per layer ``[rows, kv_heads, context, head_dim]``, an additive
        attention mask ``[rows, 1, 1, context]`` (0 where a row attends, the dtype's minimum
        elsewhere: a row's padding and unwritten positions), each row's next position id, its
        next input token and its logits ``[rows, vocab]`` float32."""
        if max_rows < 2:
            return
        per_row = self.stats.cache_bytes  # one row of the whole context
        free = self._free_bytes()
        if free is None:  # the CPU (graphs=False): no card to fit
            free = per_row * max_rows * 4
        rows = min(max_rows, int(max(0, free) * BATCH_CACHE_FRACTION) // max(per_row, 1))
        if rows < 2:
            self.stats.batch_note = (
                f"a static batch's cache of 2 rows needs {2 * per_row / 2**20:.0f} MiB, more "
                f"than {BATCH_CACHE_FRACTION:.0%} of the {max(0, free) / 2**20:.0f} MiB free: "
                "batches decode eagerly"
            )
            return
        if rows < max_rows:
            self.stats.batch_note = (
                f"batched graphs decode up to {rows} of MAX_BATCH_SIZE={max_rows} sequences "
                f"(a cache of {BATCH_CACHE_FRACTION:.0%} of the free memory); larger batches "
                "decode eagerly"
            )
        dtype = self._shapes[0][3]
        self._bkeys = [
            torch.zeros((rows, h, self.context, kd), dtype=dt, device=self.device)
            for h, kd, _vd, dt in self._shapes
        ]
        self._bvalues = [
            torch.zeros((rows, h, self.context, vd), dtype=dt, device=self.device)
            for h, _kd, vd, dt in self._shapes
        ]
        self._bpositions = torch.zeros(len(self._shapes), dtype=torch.long, device=self.device)
        self._bmask = torch.full(
            (rows, 1, 1, self.context), torch.finfo(dtype).min, dtype=dtype, device=self.device
        )
        self._bids = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        self._bpos = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        self._blogits = torch.zeros(
            (rows, self._logits.shape[0]), dtype=torch.float32, device=self.device
        )
        self.batch_rows = rows
        self.batch_buckets = row_buckets(rows)
        self.stats.batch_rows = rows
        self.stats.batch_cache_bytes = rows * per_row
        self.stats.cache_bytes += rows * per_row

    def _free_bytes(self) -> int | None:
        """Free memory on the card less the graphs' margin (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        return torch.cuda.mem_get_info(self.device)[0] - GRAPH_POOL_MARGIN_BYTES

    def _bucket_cache(self, length: int, rows: int = 0) -> Any:
        """A ``StaticCache`` over the first ``length`` positions of the one-sequence cache
        (``rows`` 0) or of the first ``rows`` rows of the static batch's cache."""
        from transformers import StaticCache

        cache = StaticCache(config=self.model.config, max_cache_len=length)
        keys_of, values_of = (self._bkeys, self._bvalues) if rows else (self._keys, self._values)
        positions = self._bpositions if rows else self._positions
        for i, layer in enumerate(cache.layers):
            keys = keys_of[i][: rows or 1, :, :length, :]
            values = values_of[i][: rows or 1, :, :length, :]
            layer.device = self.device
            layer.batch_size, layer.num_heads = keys.shape[:2]
            layer.k_head_dim = keys.shape[-1]
            layer.v_head_dim = values.shape[-1]
            layer.keys = keys
            layer.values = values
            layer.cumulative_length = positions[i]
            layer.is_initialized = True
            if self.mode == "compiled" and not rows:
                # One compile per bucket: the mask's length is the cache's Python-int length, so a
                # symbolic length (mark_dynamic) is refused (ConstraintViolationError, H200 run
                # of 2026-12-01). Static addresses let inductor treat the cache as fixed.
                for t in (keys, values, layer.cumulative_length):
                    torch._dynamo.mark_static_address(t)
        return cache

    def _step_fn(self, length: int) -> Any:
        cache = self._caches[length]
        forward = self._compiled_forward() if self.mode == "compiled" else _call_forward

        def step() -> None:
            out = forward(self.model, self._cache_name, cache, self._ids, self._pos)
            self._logits.copy_(out.logits[0, -1])

        return step

    def _compiled_forward(self) -> Any:
        if self._compiled is None:
            self._compiled = torch.compile(_call_forward, dynamic=False)
        return self._compiled

    def _capture(self, length: int) -> None:
        """Capture bucket ``length``'s step (the caller holds the engine). The warm-up steps run
        for real: the write positions are restored afterwards; the keys and values they wrote
        lie at or after the current position, which the next real step overwrites before any
        step attends to them (the causal mask hides later positions)."""
        started = time.perf_counter()
        saved = self._positions.clone()

        def restore() -> None:
            self._positions.copy_(saved)

        try:
            self._graphs[length] = self._record(self._step_fn(length), restore)
            self.stats.captured[length] = (time.perf_counter() - started) * 1000
        except Exception as exc:  # a capture failure never fails the request
            restore()
            self._graphs[length] = None
            self.stats.eager_buckets.add(length)
            self._fallback("capture", f"bucket {length}: {type(exc).__name__}: {exc}")

    def _record(self, step: Any, restore: Any) -> torch.cuda.CUDAGraph:
        """Warm ``step`` up on a side stream, then record it into the engine's pool; ``restore``
        undoes each run's writes to the positions, ids and mask."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        reserved = torch.cuda.memory_reserved(self.device)
        stream = warmup_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(3 if self.mode == "compiled" else 2):
                step()
                restore()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            step()
        restore()
        self.stats.graph_pool_bytes += max(0, torch.cuda.memory_reserved(self.device) - reserved)
        return graph

    # --- the static batch ------------------------------------------------------------------
    def _batch_step_fn(self, rows: int, length: int) -> Any:
        """One decode step of the first ``rows`` rows over the first ``length`` positions: the
        new position becomes attendable in every row, the forward writes its keys and values
        there and the logits of each row into the static buffer, and each row's position id
        advances. Eager forward (``compiled`` compiles the one-sequence step only: a compile
        per (rows, length) pair would take minutes)."""
        key = (rows, length)
        cache = self._bcaches.get(key)
        if cache is None:
            cache = self._bcaches[key] = self._bucket_cache(length, rows)
        mask = self._bmask[:rows]
        view = mask[:, :, :, :length]
        ids, pos, logits = self._bids[:rows], self._bpos[:rows], self._blogits[:rows]
        column = self._bpositions[:1]

        def step() -> None:
            mask.index_fill_(3, column, 0.0)
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                attention_mask=view,
                use_cache=True,
                **{self._cache_name: cache},
            )
            logits.copy_(out.logits[:, -1])
            pos.add_(1)

        return step

    def _capture_batch(self, rows: int, length: int) -> None:
        started = time.perf_counter()
        saved = (self._bpositions.clone(), self._bpos[:rows].clone(), self._bmask[:rows].clone())

        def restore() -> None:
            self._bpositions.copy_(saved[0])
            self._bpos[:rows].copy_(saved[1])
            self._bmask[:rows].copy_(saved[2])

        try:
            graph = self._record(self._batch_step_fn(rows, length), restore)
            self._bgraphs[(rows, length)] = graph
            self.stats.batch_captured[(rows, length)] = (time.perf_counter() - started) * 1000
        except Exception as exc:  # a capture failure never fails the request
            restore()
            self._bgraphs[(rows, length)] = None
            self._fallback(
                "capture", f"batch of {rows}, bucket {length}: {type(exc).__name__}: {exc}"
            )

    def _fallback(self, reason: str, message: str) -> None:
        self.stats.fallbacks += 1
        log.warning(
            "decode graphs: %s failed (%s); this bucket decodes eagerly over the static cache",
            reason,
            message,
        )
        if self._on_fallback is not None:
            with contextlib.suppress(Exception):
                self._on_fallback(reason)

    def warm(self) -> None:
        """Capture every length bucket of the one-sequence step now (at load), and the static
        batch's step of every row bucket at the smallest length bucket (a burst of short chats
        then meets no capture; a batch that outgrows that length captures its bucket at first
        use). Failures fall back per bucket (one warning each)."""
        with self._lock, torch.inference_mode():
            self._apply_pending_locked()
            for length in self.buckets if self._use_graphs else ():
                if length not in self._graphs and not self._closed:
                    self._capture(length)
            for rows in self.batch_buckets if self._use_graphs else ():
                key = (rows, self.buckets[0])
                if key not in self._bgraphs and not self._closed:
                    self._capture_batch(*key)
                    # the warm-up steps wrote column 0 of these rows: zeroed below
                    self._bused = (max(self._bused[0], rows), max(self._bused[1], 1))
            if not self._closed:
                self._zero_locked()

    # --- lifecycle ----------------------------------------------------------------------------
    # The event loop calls invalidate/reset/close inside the barrier or a model transition, when
    # no generation runs; none of them waits for one or launches GPU work: each records what to do
    # (under ``_state``, held for a few instructions), and the engine's next user, or the caller
    # when the engine is idle, does it.
    def invalidate(self) -> None:
        """Drop every graph (the modules that compute changed: an adapter, a reload, a swap, an
        unload). The caches stay; buckets are captured again at their next use, over the
        resident model of that time (:meth:`session` rebinds it)."""
        with self._state:
            self._stale = True
            self.stats.invalidations += 1
        self._apply_pending()

    def reset(self) -> None:
        """Empty what the engine keeps between requests, the keys, values and write positions of
        the last one (``DROP_CACHE``: nothing computed on old weights survives a write). The
        zeroing is done by the next generation before its prefill (on its worker thread, off the
        barrier's path)."""
        with self._state:
            self._reset_pending = True

    def close(self) -> None:
        """Free the graphs and the cache (the resident is dropped). Idempotent; a generation
        still running keeps what it uses until it ends."""
        with self._state:
            self._closing = True
        self._apply_pending()

    def _apply_pending(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # the running generation applies it when its session ends
        try:
            self._apply_pending_locked()
        finally:
            self._lock.release()

    def _apply_pending_locked(self) -> None:
        """Apply recorded invalidations and closes (the caller holds the generation lock)."""
        with self._state:
            stale, closing = self._stale, self._closing
            self._stale = False
        if stale or closing:
            self._drop_graphs_locked()
        if closing and not self._closed:
            self._caches = {}
            self._keys = []
            self._values = []
            self._bkeys = []
            self._bvalues = []
            for name in ("_bmask", "_bids", "_bpos", "_blogits", "_bpositions"):
                self.__dict__.pop(name, None)  # the batch's buffers (its logits: rows x vocab)
            self.batch_rows = 0
            self._closed = True

    def _drop_graphs_locked(self) -> None:
        """Forget every graph, its pool and the compiled step (the caller holds the engine)."""
        self._graphs.clear()
        self.stats.captured.clear()
        self.stats.eager_buckets.clear()
        self.stats.graph_pool_bytes = 0
        self._pool = None
        self._compiled = None
        self._bgraphs.clear()
        self._bcaches.clear()  # built over the model of their capture
        self.stats.batch_captured.clear()

    def _zero_locked(self) -> None:
        with torch.inference_mode():  # the cache tensors are inference tensors
            for t in (*self._keys, *self._values):
                t.zero_()
            self._positions.zero_()
            rows, positions = self._bused
            if rows and positions:  # the batch cache: only what a batch wrote since
                for t in (*self._bkeys, *self._bvalues):
                    t[:rows, :, :positions].zero_()
            self._bused = (0, 0)

    @property
    def closed(self) -> bool:
        return self._closed or self._closing

    @contextlib.contextmanager
    def session(self, model: Any) -> Iterator[DecodeSession | None]:
        """One generation's use of the engine, or None when it is busy or closed (the
        generation then decodes eagerly). ``model`` is the resident's model now: an engine built
        for another module tree (PEFT wraps the base model when an adapter is applied) rebinds
        to it and drops its graphs."""
        with self._use(model) as ok:
            yield DecodeSession(self) if ok else None

    @contextlib.contextmanager
    def batch_session(
        self, model: Any, rows: int, positions: int
    ) -> Iterator[BatchGraphSession | None]:
        """A static batch's use of the engine: ``rows`` sequences (2 to :attr:`batch_rows`)
        whose prompts padded to the longest plus the most tokens any may generate need
        ``positions`` (at most the context). None when the batch does not fit, or the engine
        is busy or closed: the batch then decodes eagerly
        (:class:`~miserver.serving.engine.static_batch.BatchDecoder`)."""
        if not 2 <= rows <= self.batch_rows or positions > self.context:
            yield None
            return
        with self._use(model) as ok:
            yield BatchGraphSession(self) if ok else None

    @contextlib.contextmanager
    def _use(self, model: Any) -> Iterator[bool]:
        if not self._lock.acquire(blocking=False):
            yield False
            return
        try:
            self._apply_pending_locked()
            if self._closed:
                yield False
                return
            with self._state:
                zero, self._reset_pending = self._reset_pending, False
            if zero:
                self._zero_locked()
            if model is not self.model:
                self.model = model
                self._cache_name = _cache_kwarg(model)
                self._drop_graphs_locked()
                self._caches = {length: self._bucket_cache(length) for length in self.buckets}
            yield True
        finally:
            try:
                self._apply_pending_locked()
            finally:
                self._lock.release()


class DecodeSession:
    """One generation's prefill and decode steps over the engine's static cache (obtained from
    :meth:`DecodeEngine.session`; used from the generation's worker thread)."""

    def __init__(self, engine: DecodeEngine) -> None:
        self._e = engine
        self.position = 0  # cache entries written

    @property
    def capacity(self) -> int:
        """The most positions this session can hold (the context)."""
        return self._e.context

    def prefill(self, prompt_ids: Sequence[int], *, all_logits: bool) -> torch.Tensor:
        """Run the prompt eagerly into the cache; returns logits ``[n, vocab]`` (``all_logits``)
        or ``[1, vocab]`` (the last position), in the model's dtype.

        Raises:
            ValueError: the prompt does not fit the context.
        """
        e = self._e
        n = len(prompt_ids)
        length = pick_bucket(e.buckets, n)
        e._positions.zero_()
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=e.device)
        pos = torch.arange(n, dtype=torch.long, device=e.device).unsqueeze(0)
        kwargs: dict[str, Any] = {"use_cache": True, e._cache_name: e._caches[length]}
        if not all_logits:
            kwargs["logits_to_keep"] = 1
        out = e.model(input_ids=ids, position_ids=pos, **kwargs)
        self.position = n
        return out.logits[0]

    def step(self, token: int) -> torch.Tensor:
        """Decode one token at the current position; returns the static float32 ``[vocab]``
        logits buffer (overwritten by the next step: copy what must outlive it).

        Raises:
            ValueError: the context is full.
        """
        e = self._e
        length = pick_bucket(e.buckets, self.position + 1)
        e._ids.fill_(int(token))
        e._pos.fill_(self.position)
        if length not in e._graphs and e._use_graphs:
            e._capture(length)
        graph = e._graphs.get(length)
        if graph is not None:
            graph.replay()
            e.stats.replays += 1
        else:
            e._step_fn(length)()
        self.position += 1
        return e._logits


def engine_for(
    model: Any,
    requested: str,
    context: int,
    *,
    warm: bool = True,
    on_fallback: Any = None,
    compile_cache_dir: str | None = None,
    max_rows: int = 1,
) -> tuple[DecodeEngine | None, str | None]:
    """Build the decode engine for a freshly loaded resident, or say why there is none.

    Returns ``(engine, None)``, or ``(None, reason)`` where reason is a sentence for the log
    (graphs off, a CPU resident, too little memory, an unsupported layout, a failed build).
    Never raises for a model it cannot serve.
    """
    mode, why = resolve_mode(requested, device_of(model))
    if mode == "off":
        return None, why or "DECODE_GRAPHS=off: decoding eagerly"
    try:
        engine = DecodeEngine(
            model,
            mode,
            context,
            on_fallback=on_fallback,
            compile_cache_dir=compile_cache_dir,
            max_rows=max_rows,
        )
    except EngineUnavailable as exc:
        if on_fallback is not None:
            with contextlib.suppress(Exception):
                on_fallback(exc.reason)
        return None, str(exc)
    except Exception as exc:  # never a failed load for the engine
        if on_fallback is not None:
            with contextlib.suppress(Exception):
                on_fallback("build")
        return None, f"building the decode engine failed ({type(exc).__name__}: {exc})"
    if warm:
        engine.warm()
    return engine, None
