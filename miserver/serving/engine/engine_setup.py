"""Building a resident's continuous engine at load (issue 29): the paged KV cache's budget, the
step's limits by device, the engine thread (:class:`~miserver.serving.engine.engine_loop.EngineLoop`)
and its wiring to the scheduler and the metrics."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from miserver.serving.engine.engine_loop import EngineLoop
from miserver.spec import codes
from miserver.spec.errors import ApiError

log = logging.getLogger("miserver.engine")

#: The step's token budget on CUDA: a prefill step of 2,048 tokens in chunks of 512 costs a
#: card a few milliseconds for a small model, so a burst of prompts (or the re-prefill of 64
#: parked 2,000-token sequences after a ``hold`` commit: 128k tokens) takes tens of steps, not
#: hundreds; the CPU keeps the engine's defaults (512 / 256), where a step's cost grows with its
#: tokens and running decodes would wait.
CUDA_STEP_TOKENS = {"max_num_batched_tokens": 2048, "prefill_chunk": 512}


class EngineUnavailable(ApiError):
    """The continuous engine cannot be built for the model ``name`` (:func:`build`): its load
    fails, 500 ``MODEL_LOAD_FAILED`` naming the model and the engine's error (``details``:
    ``name``)."""

    def __init__(self, name: str, exc: BaseException) -> None:
        super().__init__(
            codes.MODEL_LOAD_FAILED,
            f"the continuous engine cannot serve {name}: {type(exc).__name__}: {str(exc)[:300]}",
            details={"name": name},
        )


def build(
    model: Any, tokenizer: Any, name: str, settings: Any, scheduler: Any = None, metrics: Any = None
) -> EngineLoop:
    """The continuous engine of a freshly loaded model and its thread: its paged KV cache
    allocated once from ``KV_CACHE_BYTES`` (on CUDA ``auto`` takes a quarter of the card's free
    memory now, after the load; never more than twice what the engine's most sequences hold at
    the model's full context), up to ``MAX_BATCH_SIZE`` sequences a step (``auto``: 64).
    ``scheduler`` counts the engine's waiting requests; ``metrics`` reads its gauges.

    Raises:
        EngineUnavailable: the engine cannot hold the model (e.g. its attention layout or a
            cache budget too small for one block a layer); the load fails with it (the
            continuous engine serves every sequence of a transformers resident: there is no
            other path)."""
    from miserver.serving.engine.continuous import ContinuousEngine
    from miserver.serving.engine.devices import device_of
    from miserver.serving.engine.generation import context_length
    from miserver.serving.engine.kv_cache import cache_shape
    from miserver.spec.settings import (
        DEFAULT_ENGINE_MAX_SEQS,
        resolved_cpu_matmul_threads,
        resolved_cpu_threads,
        resolved_kv_cache_bytes,
        resolved_speculative_tokens,
    )

    device = device_of(model)
    if device.type == "cuda" and settings.decode_graphs == "compiled":
        # inductor's cache survives restarts under the home (docs/decisions.md)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(settings.home) / "compile-cache"))
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    budget = resolved_kv_cache_bytes(settings, device.type, free)
    max_seqs = settings.max_batch_size or DEFAULT_ENGINE_MAX_SEQS
    threads = resolved_cpu_threads(settings) if device.type == "cpu" else None
    matmul = resolved_cpu_matmul_threads(settings) if device.type == "cpu" else None
    started = time.perf_counter()
    try:
        if settings.kv_cache_bytes is None:
            full = 2 * max_seqs * context_length(model) * cache_shape(model).bytes_per_token
            budget = min(budget, max(full, 1 << 20))
        engine = ContinuousEngine(
            model,
            budget,
            max_num_seqs=max_seqs,
            decode_graphs=settings.decode_graphs if device.type == "cuda" else "off",
            prefix_cache=device.type != "cpu",
            speculative_tokens=resolved_speculative_tokens(settings, device.type),
            matmul_threads=matmul,
            cpu_threads=threads,
            **(CUDA_STEP_TOKENS if device.type == "cuda" else {}),
        )
    except Exception as exc:  # noqa: BLE001 - the load fails, saying why
        raise EngineUnavailable(name, exc) from exc
    stats = engine.stats()
    log.info(
        "continuous engine for %s: KV cache %.1f MiB (KV_CACHE_BYTES %s), %d blocks of %d "
        "positions, up to %d sequences a step%s%s, in %.2f s",
        name,
        stats["cache_bytes"] / 2**20,
        "auto" if settings.kv_cache_bytes is None else settings.kv_cache_bytes,
        stats["blocks_total"],
        stats["block_size"],
        max_seqs,
        "" if threads is None else f", {threads} CPU thread{'s' if threads > 1 else ''}",
        "" if matmul in (None, threads) else f" ({matmul} for products where they round alike)",
        time.perf_counter() - started,
    )
    # On the CPU a prompt whose head comes from the prefix cache is computed in another shape
    # than the whole prompt and rounds otherwise: keep an answer independent of what ran
    # before it (docs/decisions.md)
    loop = EngineLoop(
        engine,
        model,
        tokenizer,
        name=f"engine-{name}",
        cross_request_prefix_cache=device.type != "cpu",
        threads=threads,
    )
    if scheduler is not None:
        scheduler.batch_waiting = loop.interactive_waiting
    if metrics is not None:
        metrics.set_engine_loop(loop)
    return loop
