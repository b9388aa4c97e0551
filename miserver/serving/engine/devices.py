"""Where a model computes: its device, and the one CUDA side stream per device that every
decode-graph capture warms up on (:class:`~miserver.serving.engine.model_runner.DecodeGraphs`)."""

from __future__ import annotations

import threading
from typing import Any

import torch


def device_of(model: Any) -> torch.device:
    """The device of ``model``'s first parameter (the CPU for a module without any)."""
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError, TypeError):
        return torch.device("cpu")


def dtype_of(model: Any) -> torch.dtype | None:
    """The dtype of ``model``'s first parameter (None for a module without any)."""
    try:
        return next(model.parameters()).dtype
    except (StopIteration, AttributeError, TypeError):
        return None


#: The side stream every capture's warm-up runs on, one per device for the process's life. A new
#: ``torch.cuda.Stream`` per capture came from PyTorch's pool of 32, and cuBLAS keeps a
#: workspace for every stream it has run on (32 MiB on an H200, allocated through the caching
#: allocator and never freed): each model swap counted 384-608 MiB more allocated until the
#: pool had gone round (tests/gpu/diagnose_swap_growth.py). One stream: one workspace.
_WARMUP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_warmup_lock = threading.Lock()


def warmup_stream(device: torch.device | str) -> torch.cuda.Stream:
    """The warm-up side stream of ``device`` (a CUDA device; made on first use)."""
    device = torch.device(device)
    with _warmup_lock:
        stream = _WARMUP_STREAMS.get(device)
        if stream is None:
            stream = _WARMUP_STREAMS[device] = torch.cuda.Stream(device)
        return stream
