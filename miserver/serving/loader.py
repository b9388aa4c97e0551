"""Loading a catalogue row into memory: a transformers model, its tokenizer, its device.

Blocking code: the model host runs :func:`load_model` in a worker thread. The one place a load is
made attachable is :func:`make_attachable` (issue 4 places the parameters of a 16-bit load in one
shared allocation there; weights page: Which models can be attached).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miserver.serving.catalogue import CatalogueRow
from miserver.spec import codes
from miserver.spec.errors import ApiError
from miserver.spec.settings import Settings

log = logging.getLogger("miserver.loader")

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
GGUF_EXTRA = "miserver[gguf]"


class ModelLoadError(RuntimeError):
    """The files of a row could not be loaded (missing, corrupt, unsupported architecture)."""


@dataclass
class LoadedModel:
    """What :func:`load_model` returns.

    Attributes:
        model: the ``torch.nn.Module`` in eval mode on ``device``, parameters of ``row.dtype``.
        tokenizer: the transformers tokenizer saved with the model (chat template included).
        device: where the parameters live.
        attachable: whether :func:`make_attachable` placed the parameters in one shared allocation.
        arena: that allocation (:class:`miserver.ipc.arena.ParameterArena`), or None.
    """

    model: torch.nn.Module
    tokenizer: Any
    device: torch.device
    attachable: bool
    arena: Any = None


def llama_cpp_available() -> bool:
    """Whether llama-cpp-python (the extra ``miserver[gguf]``) is importable."""
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_install_command() -> str:
    """The command that installs the extra ``miserver[gguf]`` into the running interpreter's
    environment: ``pip install -e '<checkout>[gguf]'`` when miserver runs from a source checkout
    (``miserver`` is not on PyPI, so ``pip install 'miserver[gguf]'`` would fail there)."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "miserver").is_dir():
        return f"{sys.executable} -m pip install -e '{root}[gguf]'"
    return f"{sys.executable} -m pip install '{GGUF_EXTRA}'"


def check_loadable(row: CatalogueRow) -> None:
    """Refuse a row this build cannot load, before anything is unloaded (contract 3).

    Raises:
        ApiError: 400 BACKEND_UNAVAILABLE (reason ``gguf``) for a gguf row, naming the extra
            ``miserver[gguf]``; 500 MODEL_LOAD_FAILED when the row's files are gone.
    """
    if row.format == "gguf":
        installed = llama_cpp_available()
        raise ApiError(
            codes.BACKEND_UNAVAILABLE,
            f"catalogue row {row.name!r} is a GGUF file; this version of miserver serves "
            "safetensors rows only"
            + (
                " (llama-cpp-python is installed, but the llama.cpp backend is not part of this "
                "version yet)"
                if installed
                else f" (the llama.cpp backend, the optional extra {GGUF_EXTRA}, is not part of "
                f"this version yet; it installs with: {gguf_install_command()})"
            )
            + ": load a safetensors row instead (GET /api/models lists them)",
            reason="gguf",
            details={
                "model_id": row.id,
                "name": row.name,
                "extra": GGUF_EXTRA,
                "llama_cpp_installed": installed,
            },
        )
    if not (Path(row.path) / "config.json").is_file():
        raise ApiError(
            codes.MODEL_LOAD_FAILED,
            f"catalogue row {row.name!r}: {row.path} has no config.json (moved or deleted?)",
            details={"model_id": row.id, "name": row.name, "path": row.path},
        )


def make_attachable(
    model: torch.nn.Module, settings: Settings, *, device: torch.device | str | None = None
) -> Any:
    """Place the parameters of ``model`` in one shared allocation so a trainer can attach.

    Weights page "Which models can be attached" (the ``allocator`` row): when
    ``settings.has_trainer_token`` and the model is an unquantized 16-bit load (on CUDA, or on
    the CPU with ``WEIGHTS_CPU_ATTACH=1``, contract 8), every parameter of a device moves into one
    allocation (:func:`miserver.ipc.arena.make_attachable`) and the arena is returned. Otherwise
    nothing changes and this returns None, so attach answers 400 NOT_ATTACHABLE (``allocator``
    or an earlier reason).

    ``device``: where the model is to be served when that is not where its parameters are now
    (a model read on the CPU and served from a GPU). The decision is taken for ``device``, and
    the parameters are copied straight from where they are into the arena there, with the
    buffers moved along, so the card never holds the model twice. When None to return, the
    model is left where it is (the caller moves it).
    """
    from miserver.ipc import arena as ipc_arena
    from miserver.ipc.attachability import should_make_attachable

    config = getattr(model, "config", None)
    quantized = getattr(model, "is_quantized", False) or (
        getattr(config, "quantization_config", None) is not None
    )
    target = torch.device(device) if device is not None else None
    if not should_make_attachable(
        fmt="safetensors",
        quantization="quantized" if quantized else "none",
        param_dtypes=ipc_arena.parameter_dtypes(model),
        devices=[str(target)] if target is not None else ipc_arena.parameter_devices(model),
        has_trainer_token=settings.has_trainer_token,
        cpu_attach=settings.weights_cpu_attach,
    ):
        return None
    return ipc_arena.make_attachable(model, cpu_shared=settings.weights_cpu_attach, device=target)


def place_model(model: torch.nn.Module, settings: Settings, device: torch.device) -> Any:
    """Put a model read on the CPU onto ``device``, in an arena when the load is attachable.

    Returns the :class:`miserver.ipc.arena.ParameterArena`, or None (not attachable).

    On CUDA an attachable load is copied parameter by parameter from the CPU straight into the
    arena on the card (one copy there, never two: moving the model first and then into the
    arena briefly doubled it). Every other load moves with ``model.to(device)``, and a CPU load
    with ``WEIGHTS_CPU_ATTACH=1`` is then placed in a CPU shared-memory arena.
    """
    if device.type == "cuda":
        arena = make_attachable(model, settings, device=device)
        if arena is not None:
            return arena
        model.to(device)
        return None
    model.to(device)
    return make_attachable(model, settings)


def load_model(row: CatalogueRow, settings: Settings) -> LoadedModel:
    """Load ``row`` (a safetensors Hugging Face folder) onto ``settings.resolved_device()``.

    Blocking (seconds for a small model on CPU): call it in a worker thread.

    Raises:
        ApiError: as :func:`check_loadable`; 500 MODEL_LOAD_FAILED when transformers cannot
            load the folder (the message names the row and transformers' error).
    """
    check_loadable(row)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if settings.log_format == "json":  # tqdm bars would break one-JSON-object-a-line logs
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    device = torch.device(settings.resolved_device())
    dtype = TORCH_DTYPES[row.dtype]
    try:
        tokenizer = AutoTokenizer.from_pretrained(row.path)
        model = AutoModelForCausalLM.from_pretrained(row.path, dtype=dtype)  # on the CPU
        model.eval()
        arena = place_model(model, settings, device)
    except Exception as exc:  # any failure of a third-party loader: report it, never a 500 page
        log.warning("loading catalogue row %s (%s) failed: %s", row.id, row.name, exc)
        raise ApiError(
            codes.MODEL_LOAD_FAILED,
            f"catalogue row {row.name!r} could not be loaded from {row.path} onto {device}: "
            f"{type(exc).__name__}: {str(exc)[:500]}",
            details={"model_id": row.id, "name": row.name, "path": row.path},
        ) from exc
    return LoadedModel(
        model=model, tokenizer=tokenizer, device=device, attachable=arena is not None, arena=arena
    )
