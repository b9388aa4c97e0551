"""LoRA adapters applied unmerged to the served model (contract 6, ``/api/weights/adapter``).

``apply_adapter`` wraps the targeted ``Linear``/``Embedding`` modules of the served model in PEFT
LoRA layers (``PeftModel.from_pretrained``, inference mode). Unmerged means the base tensors are
not touched: every base parameter stays the same object at the same address, so an attached
trainer keeps writing the base weights and :func:`~miserver.serving.models.base_tensors.base_state_dict` still names them by their
base names. ``remove_adapter`` puts the original modules back (PEFT ``unload()``, never
``merge_and_unload()``), after which the model computes exactly what it computed before.

The served module object does not change: the model host keeps ``resident.model`` and the
functions return it for clarity. Like :mod:`miserver.serving.models.checkpoints` this layer takes no lock
and knows nothing of the barrier; the route runs it inside the pause (pause owner ``adapter``).
Errors are :class:`AdapterInvalid` (``400 ADAPTER_INVALID`` with a reason); nothing is changed
when one is raised.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from miserver.serving.models.base_tensors import base_named_parameters, has_adapter, is_tuner_layer
from miserver.serving.models.checkpoint_format import NAME_RE, rfc3339
from miserver.serving.models.client_paths import ClientPathError, check_client_path
from miserver.spec import codes

if TYPE_CHECKING:
    from peft import PeftModel

    from miserver.spec.errors import ApiError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_WEIGHTS_NAME = "adapter_model.bin"
#: PEFT's internal adapter name (a Python identifier; the served name is kept separately).
PEFT_ADAPTER_NAME = "served"
_PEFT_PREFIX = "base_model.model."


class AdapterInvalid(Exception):
    """The adapter folder cannot be applied to this model; nothing was changed.

    Answered ``400 ADAPTER_INVALID`` with ``reason`` one of ``not_found``, ``no_config``,
    ``not_lora``, ``unsafe_format``, ``incompatible`` (contract 6).
    """

    code = codes.ADAPTER_INVALID

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        path: Path | str | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        assert reason in self.code.reasons, reason
        self.reason = reason
        self.message = message
        self.details: dict[str, Any] = {"path": str(path)} if path is not None else {}
        self.details.update(details or {})

    def as_api_error(self) -> ApiError:
        """The :class:`miserver.spec.errors.ApiError` a route raises for this refusal."""
        from miserver.spec.errors import ApiError

        return ApiError(self.code, self.message, reason=self.reason, details=self.details)


class InvalidAdapterName(Exception):
    """The served name given for an adapter is not valid (``400 INVALID_REQUEST``)."""

    code = codes.INVALID_REQUEST

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.reason: str | None = None
        self.details: dict[str, Any] = {"field": "name"}

    def as_api_error(self) -> ApiError:
        """The :class:`miserver.spec.errors.ApiError` a route raises for this refusal."""
        from miserver.spec.errors import ApiError

        return ApiError(self.code, self.message, details=self.details, param="name")


class InvalidAdapterPath(Exception):
    """The adapter ``path`` is not an absolute path (``400 INVALID_REQUEST``, field ``path``).

    Like ``POST /api/models``: a relative path (or ``~``) would resolve against the server's
    working directory or home, which are not the caller's.
    """

    code = codes.INVALID_REQUEST

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.reason: str | None = None
        self.details: dict[str, Any] = {"field": "path"}

    def as_api_error(self) -> ApiError:
        """The :class:`miserver.spec.errors.ApiError` a route raises for this refusal."""
        from miserver.spec.errors import ApiError

        return ApiError(self.code, self.message, details=self.details, param="path")


#: What a request can get wrong about an adapter; each has ``as_api_error()``.
AdapterRequestError = (AdapterInvalid, InvalidAdapterName, InvalidAdapterPath)


def validate_adapter_name(name: Any) -> str:
    """Return ``name`` if it can be the served name while the adapter is applied (contract 6).

    The rule of a checkpoint name (:data:`miserver.serving.models.checkpoint_format.NAME_RE`): 1-128
    characters of ``[A-Za-z0-9._-]``, starting with a letter or digit, so it is a valid
    ``X-miLLM-Model`` sf-string.

    Raises:
        InvalidAdapterName: anything else (``400 INVALID_REQUEST``, field ``name``).
    """
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidAdapterName(
            "an adapter name is 1-128 characters of letters, digits, '.', '_' and '-', starting"
            " with a letter or digit (it becomes the served name)"
        )
    return name


def validate_adapter_path(path: Any) -> Path:
    """Return ``path`` as a :class:`~pathlib.Path` if it is absolute (as ``POST /api/models``).

    Raises:
        InvalidAdapterPath: empty, holding a NUL, not absolute, too long, a symlink loop or not
            readable by the server (``400 INVALID_REQUEST``, field ``path``; the checks of
            :func:`~miserver.serving.models.client_paths.check_client_path`); a path that does not
            exist passes (``inspect_adapter`` answers ``not_found``).
    """
    raw = str(path) if isinstance(path, Path) else path
    try:
        return check_client_path(raw)
    except ClientPathError as exc:
        raise InvalidAdapterPath(str(exc)) from None


# --- the adapter folder ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterInfo:
    """A validated adapter folder (from :func:`inspect_adapter`).

    Attributes:
        path: absolute folder path.
        rank: LoRA rank ``r``.
        alpha: ``lora_alpha`` (the scale is alpha / rank).
        target_modules: the configured target module names, sorted (a regex is one entry).
        base_model_name_or_path: what the adapter says it was trained on (informational).
    """

    path: Path
    rank: int
    alpha: float
    target_modules: list[str]
    base_model_name_or_path: str | None


def _module_by_name(model: nn.Module) -> dict[str, nn.Module]:
    """Modules by base name: LoRA wrappers stand for their base layer, their insides hidden."""
    out: dict[str, nn.Module] = {}

    def walk(m: nn.Module, prefix: str) -> None:
        if is_tuner_layer(m):
            m = m.get_base_layer()
        out[prefix.rstrip(".")] = m
        for n, c in m._modules.items():
            if c is not None:
                walk(c, prefix + n + ".")

    walk(model, "")
    return out


def _check_shapes(model: nn.Module, folder: Path, header: dict[str, Any]) -> None:
    """Every adapter tensor must sit on an existing module with matching dimensions."""
    modules = _module_by_name(model)
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        name = key.removeprefix(_PEFT_PREFIX)
        shape = list(meta.get("shape", []))
        parts = name.split(".")
        kind = next((p for p in parts if p.startswith("lora_")), None)
        if kind is None:
            raise AdapterInvalid(
                "incompatible",
                f"adapter tensor {key!r} is not a LoRA tensor (lora_A/lora_B);"
                " only plain LoRA adapters are served",
                path=folder,
                details={"tensor": key},
            )
        mod_name = ".".join(parts[: parts.index(kind)])
        module = modules.get(mod_name)
        if module is None:
            raise AdapterInvalid(
                "incompatible",
                f"the served model has no module {mod_name!r} (adapter tensor"
                f" {key!r}): the adapter was trained on another architecture",
                path=folder,
                details={"tensor": key, "module": mod_name},
            )
        want: int | None = None
        dim = None
        if isinstance(module, nn.Linear):
            if kind == "lora_A":
                want, dim = module.in_features, 1
            elif kind == "lora_B":
                want, dim = module.out_features, 0
        elif isinstance(module, nn.Embedding):
            if kind == "lora_embedding_A":
                want, dim = module.num_embeddings, 1
            elif kind == "lora_embedding_B":
                want, dim = module.embedding_dim, 0
        if want is not None and (len(shape) != 2 or shape[dim] != want):
            raise AdapterInvalid(
                "incompatible",
                f"adapter tensor {key!r} has shape {shape}, which does not fit the served"
                f" module {mod_name!r} ({type(module).__name__}, needs {want} along dim {dim})",
                path=folder,
                details={"tensor": key, "module": mod_name, "shape": shape},
            )


def _lora_module_types() -> tuple[type, ...]:
    """Module types PEFT's LoRA can wrap (``peft.tuners.lora.model.LoraModel._create_new_module``)."""
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention, Conv1D)


def _tensor_module(key: str) -> str:
    """The base module name an adapter tensor belongs to (``...q_proj.lora_A.weight`` ->
    ``...q_proj``)."""
    parts = key.removeprefix(_PEFT_PREFIX).split(".")
    kind = next((i for i, p in enumerate(parts) if p.startswith("lora_")), len(parts))
    return ".".join(parts[:kind])


def _check_targets(
    model: nn.Module, folder: Path, config: Mapping[str, Any], header: Mapping[str, Any]
) -> None:
    """The modules ``target_modules`` selects, matched exactly as PEFT matches them when it
    injects (``check_target_module_exists``: names, ``.``-suffixes or a regex, with
    ``exclude_modules`` and ``layers_to_transform``), must exist in the served model, be layers
    LoRA can wrap, and hold every tensor the adapter file carries (a tensor on a module that is
    not targeted would be dropped without an error, serving another adapter than the file)."""
    from types import SimpleNamespace

    from peft.tuners.tuners_utils import check_target_module_exists

    targets = config.get("target_modules")
    if targets is None:  # PEFT fills in its default for the model type (LoraModel)
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

        model_type = getattr(getattr(model, "config", None), "model_type", None)
        targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    modules = {n: m for n, m in _module_by_name(model).items() if n}
    if isinstance(targets, str) and targets.lower() == "all-linear":
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        selected = {n for n, m in modules.items() if isinstance(m, nn.Linear) and m is not output}
    elif isinstance(targets, str) or (
        isinstance(targets, list | tuple) and targets and all(isinstance(t, str) for t in targets)
    ):
        view = SimpleNamespace(
            target_modules=targets if isinstance(targets, str) else set(targets),
            target_parameters=config.get("target_parameters"),
            exclude_modules=config.get("exclude_modules"),
            modules_to_save=None,
            layers_to_transform=config.get("layers_to_transform"),
            layers_pattern=config.get("layers_pattern"),
        )
        try:
            selected = {n for n in modules if check_target_module_exists(view, n)}
        except Exception as e:  # noqa: BLE001 - a malformed regex or field in the config
            raise AdapterInvalid(
                "no_config",
                f"{CONFIG_NAME} target_modules cannot be matched: {e}",
                path=folder,
                details={"target_modules": targets},
            ) from None
    else:
        raise AdapterInvalid(
            "incompatible",
            f"{CONFIG_NAME} names no target_modules; only LoRA on modules is served",
            path=folder,
            details={"target_modules": targets},
        )
    shown = targets if isinstance(targets, str) else sorted(targets)
    if not selected:
        raise AdapterInvalid(
            "incompatible",
            f"the adapter's target_modules {shown} match no module of the served model:"
            " the adapter was trained on another architecture",
            path=folder,
            details={"target_modules": shown},
        )
    supported = _lora_module_types()
    wrong = sorted(n for n in selected if not isinstance(modules[n], supported))
    if wrong:
        raise AdapterInvalid(
            "incompatible",
            f"the adapter's target_modules {shown} select {wrong[0]!r}"
            f" ({type(modules[wrong[0]]).__name__}), which LoRA cannot wrap",
            path=folder,
            details={"target_modules": shown, "module": wrong[0]},
        )
    held = {_tensor_module(k) for k in header if k != "__metadata__"}
    dropped = sorted(held - selected)
    if dropped:
        raise AdapterInvalid(
            "incompatible",
            f"the adapter file has tensors for {dropped[0]!r}, which its target_modules"
            f" {shown} do not select (PEFT would drop them and serve another adapter)",
            path=folder,
            details={"target_modules": shown, "module": dropped[0]},
        )


def _read_header(folder: Path) -> dict[str, Any]:
    """The safetensors header of the adapter weights, read without loading tensors."""
    import struct

    path = folder / WEIGHTS_NAME
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 * 1024 * 1024:
                raise ValueError("header too large")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
        return header
    except (OSError, ValueError, struct.error) as e:
        raise AdapterInvalid(
            "incompatible", f"{WEIGHTS_NAME} cannot be read: {e}", path=folder
        ) from None


def _check_finite(folder: Path, header: dict[str, Any]) -> None:
    """Refuse an adapter whose floating-point tensors hold a NaN or an infinity (breaker finding
    F3): applied, it would make every ``/v1`` answer a 500 (non-finite logits). Reads each
    tensor once, in name order, on the CPU; the first non-finite one is named.

    Raises:
        AdapterInvalid: reason ``incompatible``, details ``{"tensor": name}``; also when a
            tensor cannot be read (a file cut short).
    """
    from safetensors import safe_open

    path = folder / WEIGHTS_NAME
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in sorted(k for k in header if k != "__metadata__"):
                tensor = f.get_tensor(key)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise AdapterInvalid(
                        "incompatible",
                        f"adapter tensor {key!r} holds non-finite values (NaN or infinity);"
                        " applied, every answer would fail: train or export it again",
                        path=folder,
                        details={"tensor": key},
                    )
    except AdapterInvalid:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' own errors: a damaged file
        raise AdapterInvalid(
            "incompatible", f"{WEIGHTS_NAME} cannot be read: {e}", path=folder
        ) from None


def inspect_adapter(model: nn.Module, path: str | Path) -> AdapterInfo:
    """Validate an adapter folder against the served model without changing anything.

    Checks: the folder exists; ``adapter_config.json`` parses and says ``peft_type: LORA``;
    weights are in ``adapter_model.safetensors`` (a pickled ``.bin`` is refused: loading it could
    run code); no ``modules_to_save`` / ``trainable_token_indices`` (they replace or add whole
    base tensors, which an unmerged adapter must not); every adapter tensor sits on a module the
    served model has, with matching dimensions; ``target_modules`` selects (as PEFT matches it)
    at least one module LoRA can wrap, and every module the file has tensors for; every
    floating-point tensor is finite (no NaN or infinity).

    Raises:
        InvalidAdapterPath: ``path`` is not absolute (``400 INVALID_REQUEST``, as
            ``POST /api/models``).
        AdapterInvalid: with reason ``not_found``, ``no_config``, ``not_lora``,
            ``unsafe_format`` or ``incompatible``.
    """
    folder = validate_adapter_path(path)
    if not folder.is_dir():
        raise AdapterInvalid("not_found", f"no adapter folder at {str(folder)!r}", path=folder)
    cpath = folder / CONFIG_NAME
    if not cpath.is_file():
        raise AdapterInvalid(
            "no_config", f"{CONFIG_NAME} is missing in {str(folder)!r}", path=folder
        )
    try:
        config = json.loads(cpath.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise AdapterInvalid(
            "no_config", f"{CONFIG_NAME} is not valid JSON: {e}", path=folder
        ) from None
    if not isinstance(config, dict):
        raise AdapterInvalid("no_config", f"{CONFIG_NAME} is not a JSON object", path=folder)
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterInvalid(
            "not_lora",
            f"the adapter is peft_type {peft_type!r}; only LORA adapters can be applied",
            path=folder,
            details={"peft_type": peft_type},
        )
    for key in ("modules_to_save", "trainable_token_indices"):
        if config.get(key):
            raise AdapterInvalid(
                "incompatible",
                f"the adapter sets {key}, which replaces base tensors; only"
                " plain unmerged LoRA is served",
                path=folder,
                details={"field": key},
            )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if (
        not isinstance(rank, int)
        or isinstance(rank, bool)
        or rank < 1
        or not isinstance(alpha, int | float)
        or isinstance(alpha, bool)
    ):
        raise AdapterInvalid(
            "no_config",
            f"{CONFIG_NAME} needs an integer r >= 1 and a numeric lora_alpha",
            path=folder,
        )
    if not (folder / WEIGHTS_NAME).is_file():
        if (folder / PICKLE_WEIGHTS_NAME).is_file():
            raise AdapterInvalid(
                "unsafe_format",
                f"the adapter weights are a pickle"
                f" ({PICKLE_WEIGHTS_NAME}); save them as {WEIGHTS_NAME}"
                " (peft save_pretrained(safe_serialization=True))",
                path=folder,
            )
        raise AdapterInvalid(
            "not_found", f"{WEIGHTS_NAME} is missing in {str(folder)!r}", path=folder
        )
    if getattr(model, "config", None) is None:
        raise AdapterInvalid(
            "incompatible",
            "the served model is not a transformers model"
            " (a GGUF model cannot take a LoRA adapter)",
            path=folder,
        )
    header = _read_header(folder)
    _check_shapes(model, folder, header)
    _check_targets(model, folder, config, header)
    _check_finite(folder, header)
    targets = config.get("target_modules")
    if isinstance(targets, str):
        target_modules = [targets]
    elif isinstance(targets, list | tuple) and all(isinstance(t, str) for t in targets):
        target_modules = sorted(targets)
    else:
        target_modules = sorted(
            {
                key.removeprefix(_PEFT_PREFIX).split(".lora_")[0].rsplit(".")[-1]
                for key in header
                if key != "__metadata__"
            }
        )
    base = config.get("base_model_name_or_path")
    return AdapterInfo(
        path=folder,
        rank=rank,
        alpha=float(alpha),
        target_modules=target_modules,
        base_model_name_or_path=base if isinstance(base, str) else None,
    )


# --- apply / remove -------------------------------------------------------------------------------


@dataclass
class AppliedAdapter:
    """An adapter in effect on the served model.

    Attributes:
        name: the served name while it is applied (``X-miLLM-Model`` ``origin=adapter``).
        info: the validated folder.
        applied_at: RFC 3339 UTC time it was applied.
        module: the module to serve: the same object as the model it was applied to.
    """

    name: str
    info: AdapterInfo
    applied_at: str
    module: nn.Module
    _peft: PeftModel = field(repr=False)
    _requires_grad: dict[str, bool] = field(repr=False, default_factory=dict)

    def block(self) -> dict[str, Any]:
        """The adapter block ``{applied: true, name, path, rank, alpha, target_modules,
        applied_at}`` (contract 6)."""
        return {
            "applied": True,
            "name": self.name,
            "path": str(self.info.path),
            "rank": self.info.rank,
            "alpha": self.info.alpha,
            "target_modules": list(self.info.target_modules),
            "applied_at": self.applied_at,
        }


def adapter_block(applied: AppliedAdapter | None) -> dict[str, Any]:
    """``GET /api/weights/adapter`` and the status ``adapter`` field: ``{"applied": false}`` or
    :meth:`AppliedAdapter.block`."""
    return applied.block() if applied is not None else {"applied": False}


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _restore_flags(model: nn.Module, requires_grad: Mapping[str, bool], training: bool) -> None:
    for n, p in base_named_parameters(model).items():
        if n in requires_grad:
            p.requires_grad_(requires_grad[n])
    model.train(training)


def apply_adapter(
    model: nn.Module,
    *,
    name: str,
    path: str | Path,
    now: float,
    replacing: AppliedAdapter | None = None,
) -> AppliedAdapter:
    """Apply the LoRA adapter at ``path`` to ``model``, unmerged (contract 6 ``POST``).

    The folder is validated first (:func:`inspect_adapter`); then a ``replacing`` adapter is
    removed and the new one injected with PEFT (``PeftModel.from_pretrained``, inference mode,
    adapter weights on the model's device). Base parameters keep their identity, address,
    values and ``requires_grad``; the model keeps its train/eval mode. If injecting fails, the
    model is restored (and ``replacing`` re-applied) before the error is raised.

    Args:
        model: the served transformers model, without an adapter unless ``replacing`` is it.
        name: the served name while applied (same rule as a checkpoint name).
        path: the adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).
        now: wall-clock time, Unix seconds (``applied_at``).
        replacing: the adapter currently applied, to swap out.

    Returns:
        The :class:`AppliedAdapter`; its ``module`` is ``model`` (serve it as before).

    Raises:
        InvalidAdapterName: ``name`` is not a valid served name (nothing changed).
        AdapterInvalid: the folder does not validate, or PEFT refuses it (nothing changed).
        RuntimeError: ``model`` already has an adapter that ``replacing`` does not describe.
    """
    from peft import PeftModel

    validate_adapter_name(name)
    info = inspect_adapter(model, path)
    if replacing is None and has_adapter(model):
        raise RuntimeError("the model already has an adapter; pass it as replacing=")
    if replacing is not None:
        remove_adapter(model, replacing)
    params = base_named_parameters(model)
    requires_grad = {n: p.requires_grad for n, p in params.items()}
    addresses = {n: p.data_ptr() for n, p in params.items()}
    training = model.training
    try:
        peft_model = PeftModel.from_pretrained(
            model,
            str(info.path),
            adapter_name=PEFT_ADAPTER_NAME,
            is_trainable=False,
            torch_device=str(_model_device(model)),
        )
    except Exception as e:
        _undo_partial(model, requires_grad, training)
        if replacing is not None:  # put the current adapter back; the caller's record stays valid
            restored = apply_adapter(model, name=replacing.name, path=replacing.info.path, now=now)
            replacing._peft = restored._peft
        raise AdapterInvalid(
            "incompatible", f"PEFT could not apply the adapter: {e}", path=info.path
        ) from e
    _restore_flags(model, requires_grad, training)
    moved = [n for n, p in base_named_parameters(model).items() if p.data_ptr() != addresses.get(n)]
    if moved:  # pragma: no cover - PEFT never reallocates base layers for plain LoRA
        peft_model.unload()
        _restore_flags(model, requires_grad, training)
        raise RuntimeError(f"applying the adapter moved base parameters: {moved[:5]}")
    return AppliedAdapter(
        name=name,
        info=info,
        applied_at=rfc3339(now),
        module=model,
        _peft=peft_model,
        _requires_grad=requires_grad,
    )


def _undo_partial(model: nn.Module, requires_grad: Mapping[str, bool], training: bool) -> None:
    """Put back every base layer a failed injection may have wrapped."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if isinstance(child, BaseTunerLayer):
                setattr(parent, child_name, child.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config
    _restore_flags(model, requires_grad, training)


def remove_adapter(model: nn.Module, applied: AppliedAdapter) -> nn.Module:
    """Remove the adapter without merging (PEFT ``unload()``); returns the module to serve.

    The original ``Linear``/``Embedding`` modules go back in place, holding the same base
    parameters (never merged, so never rounded): outputs are exactly those before the adapter.
    ``requires_grad`` of the base parameters and the train/eval mode are restored.
    """
    training = model.training
    out = applied._peft.unload()
    if out is not model:  # pragma: no cover - unload returns the wrapped model itself
        raise RuntimeError("PEFT unload returned another module")
    _restore_flags(model, applied._requires_grad, training)
    return model
