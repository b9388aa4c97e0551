"""The on-disk format of a checkpoint (contract 5): its files, the manifest, names and hashes, and
the refusals of a checkpoint operation.

A checkpoint is a normal Hugging Face model folder (``AutoModelForCausalLM.from_pretrained``
loads it) with one extra file, ``manifest.json`` (:class:`Manifest`); ``checkpoint_sha256`` is
the sha256 of the ``manifest.json`` bytes, and the manifest holds the sha256 of every tensor (and
of every other file), so that one hash names the whole checkpoint. Saving, opening, verifying and
loading one is :mod:`miserver.serving.models.checkpoints`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import torch

from miserver.serving.models.base_tensors import base_state_dict
from miserver.spec import codes
from miserver.spec.codes import ErrorCode
from miserver.spec.errors import ApiError

MANIFEST_NAME = "manifest.json"
WEIGHTS_NAME = "model.safetensors"
MANIFEST_FORMAT = "miserver-checkpoint"
MANIFEST_VERSION = 1
#: Prefix of the temporary folder a save writes into (inside ``root``); never a checkpoint.
PARTIAL_PREFIX = ".saving-"
#: A checkpoint name: a folder name and an RFC 8941 sf-string (it becomes the served name).
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SHA256_RE = re.compile(r"[0-9a-f]{64}")
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}


# --- errors -------------------------------------------------------------------------------------


class CheckpointError(Exception):
    """A checkpoint operation was refused; nothing was changed.

    Attributes:
        code: the error code the route answers with (status from the code).
        message: one human sentence (never holds a token).
        reason: the error's ``reason`` value, or None.
        details: machine-readable details (tensor name, path, ...), or None.
    """

    code: ErrorCode = codes.INVALID_REQUEST

    def __init__(
        self, message: str, *, details: Mapping[str, Any] | None = None, reason: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.details = dict(details) if details is not None else None

    def as_api_error(self) -> ApiError:
        """The :class:`miserver.spec.errors.ApiError` a route raises for this refusal."""
        from miserver.spec.errors import ApiError

        return ApiError(self.code, self.message, reason=self.reason, details=self.details)


class CheckpointCorrupt(CheckpointError):
    """The folder is not a valid checkpoint, or a tensor/file does not match its sha256.

    ``tensor`` names the first tensor that failed (None when the failure is not a tensor's).
    Answered ``400 CHECKPOINT_CORRUPT`` (contract 5), always before anything is written.
    """

    code = codes.CHECKPOINT_CORRUPT

    def __init__(
        self, message: str, *, path: Path, tensor: str | None = None, file: str | None = None
    ) -> None:
        details: dict[str, Any] = {"path": str(path)}
        if tensor is not None:
            details["tensor"] = tensor
        if file is not None:
            details["file"] = file
        super().__init__(message, details=details)
        self.tensor = tensor
        self.file = file


class CheckpointNotFound(CheckpointError):
    """No checkpoint matches the reference (``404 CHECKPOINT_NOT_FOUND``)."""

    code = codes.CHECKPOINT_NOT_FOUND


class CheckpointExists(CheckpointError):
    """A save was given a name whose folder already exists (``409 CHECKPOINT_EXISTS``)."""

    code = codes.CHECKPOINT_EXISTS


class InvalidCheckpointRequest(CheckpointError):
    """A malformed name or reference (``400 INVALID_REQUEST``)."""

    code = codes.INVALID_REQUEST


class LayoutMismatch(CheckpointError):
    """:func:`load_in_place` was asked to write a checkpoint whose layout differs from the model.

    The route checks :func:`layout_matches` first and takes the full-reload path instead; this is
    the guard that keeps a wrong call from writing anything (``400 INVALID_REQUEST``).
    """

    code = codes.INVALID_REQUEST


# --- the manifest -------------------------------------------------------------------------------


class TensorEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One stored tensor.

    Attributes:
        name: its key in ``model.safetensors`` (the model's state-dict name).
        dtype: torch dtype name without ``torch.`` (``bfloat16``).
        shape: its shape.
        sha256: sha256 (hex) of its bytes as stored: C-contiguous, little-endian.
        aliases: further state-dict names that share this tensor (tied weights, e.g.
            ``lm_head.weight`` for ``model.embed_tokens.weight``); not stored again.
    """

    name: str
    dtype: str
    shape: list[int]
    sha256: str
    aliases: list[str] = []


class BaseRef(msgspec.Struct, frozen=True, kw_only=True):
    """The catalogue row the weights were first loaded from (origin ``model``)."""

    row_id: int
    name: str


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """``manifest.json`` (contract 5). Encoded with sorted keys and 2-space indent.

    Attributes:
        format, format_version: ``miserver-checkpoint``, 1.
        saved_at: RFC 3339 UTC time of the save (``2026-11-30T08:00:00.000000Z``).
        base: the base catalogue row.
        parent_checkpoint_sha256: the checkpoint the weights were loaded from, or None.
        steps_since_load: commits since the parameter set became resident (weights page).
        architecture: ``{"model_type": ..., "architectures": [...]}`` from the config.
        weights_file: the safetensors file (``model.safetensors``).
        tensors: every stored tensor, sorted by name.
        files: sha256 of every other file in the folder (config, tokenizer, ...), by relative path.
    """

    format: str
    format_version: int
    saved_at: str
    base: BaseRef
    parent_checkpoint_sha256: str | None
    steps_since_load: int
    architecture: dict[str, Any]
    weights_file: str
    tensors: list[TensorEntry]
    files: dict[str, str] = {}

    def names(self) -> set[str]:
        """Every state-dict name the checkpoint covers (stored names and their aliases)."""
        out: set[str] = set()
        for t in self.tensors:
            out.add(t.name)
            out.update(t.aliases)
        return out


def encode_manifest(manifest: Manifest) -> bytes:
    """The exact bytes written to ``manifest.json`` (sorted keys, indent 2, final newline)."""
    return (json.dumps(msgspec.to_builtins(manifest), indent=2, sort_keys=True) + "\n").encode()


@dataclass(frozen=True)
class SavedCheckpoint:
    """What :func:`save_checkpoint` wrote; the route registers the catalogue row from it.

    Attributes:
        name: the folder name, also the new served name (contract 5).
        path: the absolute path of the checkpoint folder.
        checkpoint_sha256: sha256 (hex) of ``manifest.json``.
        manifest: the decoded manifest.
        saved_at: RFC 3339 UTC time, as in the manifest.
        dtype: the floating dtype of the weights (``bfloat16``), for the catalogue row.
        weights_bytes: size of ``model.safetensors`` in bytes.
    """

    name: str
    path: Path
    checkpoint_sha256: str
    manifest: Manifest
    saved_at: str
    dtype: str
    weights_bytes: int


@dataclass(frozen=True)
class CheckpointHandle:
    """An opened checkpoint folder whose manifest parsed; tensors are not yet verified.

    Attributes:
        path: the absolute folder path.
        name: the folder name.
        checkpoint_sha256: sha256 (hex) of the ``manifest.json`` bytes read.
        manifest: the decoded manifest.
    """

    path: Path
    name: str
    checkpoint_sha256: str
    manifest: Manifest


# --- the model's tensors ------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorGroup:
    """State-dict names that are one tensor (same data pointer, dtype, shape and stride)."""

    names: tuple[str, ...]  # canonical first
    tensor: torch.Tensor  # the Parameter/buffer itself (keep_vars), never a copy


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_groups(model: torch.nn.Module) -> list[TensorGroup]:
    """The model's base tensors (LoRA layers looked through), tied names grouped.

    The canonical name of a tied group is its first state-dict name that the model does not
    declare as a tied alias (``_tied_weights_keys``), so ``from_pretrained`` re-ties it.
    """

    state = base_state_dict(model)
    tied = getattr(model, "_tied_weights_keys", None)
    alias_names = set(tied) if isinstance(tied, Mapping) else set()
    by_key: dict[tuple, list[str]] = {}
    tensors: dict[tuple, torch.Tensor] = {}
    for name, t in state.items():
        if t.device.type == "meta":
            raise InvalidCheckpointRequest(f"tensor {name} is on the meta device: nothing to save")
        ptr = t.data_ptr() if t.numel() else f"empty:{name}"  # empty tensors share address 0
        key = (t.device, t.dtype, ptr, tuple(t.shape), tuple(t.stride()))
        by_key.setdefault(key, []).append(name)
        tensors.setdefault(key, t)
    groups = []
    for key, names in by_key.items():
        names.sort(key=lambda n: n in alias_names)  # stable: keeps state-dict order otherwise
        groups.append(TensorGroup(tuple(names), tensors[key]))
    return groups


def _layout(groups: Iterable[tuple[Iterable[str], str, Iterable[int]]]) -> set[tuple]:
    return {(frozenset(names), dtype, tuple(shape)) for names, dtype, shape in groups}


def model_layout(model: torch.nn.Module) -> set[tuple]:
    return _layout(
        (g.names, dtype_name(g.tensor.dtype), g.tensor.shape) for g in tensor_groups(model)
    )


def manifest_layout(manifest: Manifest) -> set[tuple]:
    return _layout(((t.name, *t.aliases), t.dtype, t.shape) for t in manifest.tensors)


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 (hex) of a CPU tensor's bytes in C order (what safetensors stores)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy().data).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rfc3339(now: float) -> str:
    """Unix seconds as an RFC 3339 UTC timestamp with microseconds (``...T08:00:00.000000Z``)."""
    return (
        datetime.fromtimestamp(now, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
    )


def safe_relative(name: str) -> bool:
    p = Path(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts and name != MANIFEST_NAME


def default_name(base_name: str, steps_since_load: int, checkpoint_sha256: str) -> str:
    """``<base name>-step<steps_since_load>-<first 8 of sha256>`` (contract 5); the caller
    passes the parent's name (the checkpoint the weights were loaded from, else the base row).

    Characters of ``base_name`` outside ``[A-Za-z0-9._-]`` become ``-`` so the result is a valid
    folder and served name.
    """
    safe = re.sub(r"[^A-Za-z0-9._-]", "-", base_name).lstrip(".-_") or "checkpoint"
    return f"{safe[:100]}-step{steps_since_load}-{checkpoint_sha256[:8]}"


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid checkpoint name, else raise InvalidCheckpointRequest.

    Valid: 1-128 characters of ``[A-Za-z0-9._-]``, starting with a letter or digit (a folder
    name, never a path, and a valid served name in ``X-miLLM-Model``).
    """
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidCheckpointRequest(
            "a checkpoint name is 1-128 characters of letters, digits, '.', '_' and '-',"
            " starting with a letter or digit",
            details={"field": "name"},
        )
    return name
