"""The base model's tensors seen through LoRA layers: the served parameters and buffers by their
base names, whether an adapter is applied or not (contract 6: an unmerged adapter leaves every base
tensor the same object at the same address).

A checkpoint save stores these (:mod:`miserver.serving.models.checkpoints`), and the adapter layer
(:mod:`miserver.serving.models.adapters`) checks and applies against them; this module imports neither.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def is_tuner_layer(module: nn.Module) -> bool:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(module, BaseTunerLayer)


def _walk(module: nn.Module, prefix: str, params_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
    if is_tuner_layer(module):
        module = module.get_base_layer()
    for name, p in module._parameters.items():
        if p is not None:
            yield prefix + name, p
    if not params_only:
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                yield prefix + name, b
    for name, child in module._modules.items():
        if child is not None:
            yield from _walk(child, prefix + name + ".", params_only)


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict by base names, LoRA layers looked through (``keep_vars=True``).

    Without an adapter it has exactly the keys of ``model.state_dict()`` (tied names included,
    mapping to the same Parameter); with one applied, the same keys and the same objects: the
    adapter's own tensors are left out and ``...q_proj.base_layer.weight`` is named
    ``...q_proj.weight``. Used by checkpoints (a save stores the base weights) and handle export.
    """
    return dict(_walk(model, "", params_only=False))


def base_named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The base parameters by base name (tied names each listed), adapter parameters left out."""
    return dict(_walk(model, "", params_only=True))  # type: ignore[arg-type]


def has_adapter(model: nn.Module) -> bool:
    """Whether any LoRA (PEFT tuner) layer is present in ``model``."""
    return any(is_tuner_layer(m) for m in model.modules())
