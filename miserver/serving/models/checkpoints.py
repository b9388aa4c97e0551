"""Checkpoints of the resident weights: atomic save, verified open, in-place load (contract 5).

A checkpoint is a normal Hugging Face model folder (``AutoModelForCausalLM.from_pretrained``
loads it) with one extra file, ``manifest.json``::

    MISERVER_HOME/checkpoints/<name>/
        model.safetensors     every tensor once (tied names share one entry: the manifest's aliases)
        config.json           the served model's architecture config (dtype set to the weights')
        generation_config.json  when the model has one
        tokenizer.json, tokenizer_config.json, chat_template.jinja, ...  (the served tokenizer)
        manifest.json         see :class:`Manifest`

``checkpoint_sha256`` is the sha256 of the ``manifest.json`` bytes; the manifest holds the sha256
of every tensor (and of every other file), so that one hash names the whole checkpoint. The format
itself (the manifest, names, hashes, the errors) is :mod:`miserver.serving.models.checkpoint_format`; this
module saves, opens, verifies and loads.

This module is the layer the routes ``POST /api/weights/save``, ``POST /api/weights/load`` and
``GET /api/weights/checkpoints`` call; it takes no lock and knows nothing of the barrier: the
caller runs it inside the pause (weights page: "Unsaved commits and the auto-load", contract 5).
Errors are :class:`CheckpointError` subclasses carrying their :class:`ErrorCode`; a route turns
one into its answer with :meth:`CheckpointError.as_api_error`.

The routes' recipe:

- save: check the catalogue for a row named ``name`` first (409), then :func:`save_checkpoint`
  inside the pause, then register the row (origin ``checkpoint``, parent the checkpoint the
  weights were loaded from, else the base row, ``checkpoint_sha256``, ``dtype`` from :class:`SavedCheckpoint`); if registering fails, delete
  ``saved.path`` so no unregistered checkpoint is left.
- load ``{checkpoint}``: :func:`resolve_checkpoint` over the catalogue rows, then
  :func:`open_checkpoint` on the row's path and :func:`verify`, then inside the pause, *before*
  the set is marked ``writing``: :func:`reopen` (still the manifest checked) and
  :func:`layout_matches` true -> :func:`read_for_load` (every file and tensor verified, kept in
  memory), then ``writing`` and :func:`write_in_place` (reads no file; nothing allocated);
  false -> :func:`verify_for_reload`, then ``writing`` and the model host's normal load of the
  row (the folder is a plain Hugging Face folder), refused while attached. A
  :class:`CheckpointCorrupt` changes nothing and leaves the set clean.
- start-up: :func:`remove_partial_saves` on the checkpoints folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from miserver.serving.models.checkpoint_format import (
    DTYPES,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    PARTIAL_PREFIX,
    SHA256_RE,
    WEIGHTS_NAME,
    BaseRef,
    CheckpointCorrupt,
    CheckpointError,  # noqa: F401 - the base of every error raised here; callers catch it here
    CheckpointExists,
    CheckpointHandle,
    CheckpointNotFound,
    InvalidCheckpointRequest,
    LayoutMismatch,
    Manifest,
    SavedCheckpoint,
    TensorEntry,
    default_name,
    dtype_name,
    encode_manifest,
    file_sha256,
    manifest_layout,
    model_layout,
    rfc3339,
    safe_relative,
    tensor_groups,
    tensor_sha256,
    validate_name,
)

# --- writing a folder durably ----------------------------------------------------------------


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """fsync every file and folder under ``folder``, the folder itself last."""
    for dirpath, _dirnames, filenames in os.walk(folder, topdown=False):
        for f in filenames:
            _fsync_path(Path(dirpath) / f)
        _fsync_path(Path(dirpath))


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished temporary folder to its final name (atomic on one filesystem)."""
    if final.exists():
        raise CheckpointExists(
            f"a checkpoint named {final.name!r} already exists",
            details={"name": final.name, "path": str(final)},
        )
    os.rename(tmp, final)
    _fsync_path(final.parent)


# --- save ---------------------------------------------------------------------------------------


def save_checkpoint(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    root: Path,
    name: str | None,
    base_row_id: int,
    base_name: str,
    parent_sha256: str | None,
    steps_since_load: int,
    now: float,
    parent_name: str | None = None,
) -> SavedCheckpoint:
    """Write the model's current weights as the checkpoint ``root/<name>/``, atomically.

    Everything is written into a temporary folder ``root/.saving-*``, every file and the folder are
    fsynced, the manifest's sha256 is computed, and only then is the folder renamed to its final
    name (and ``root`` fsynced). Any failure removes the temporary folder and re-raises; a process
    killed mid-save leaves only a ``.saving-*`` folder, which is never a checkpoint and which
    :func:`remove_partial_saves` deletes. Tied tensors are stored once. With a LoRA adapter
    applied, the base weights are saved (the adapter is not part of the checkpoint).

    Runs inside the barrier (contract 5): the weights must not change while it reads them. Needs
    one host copy of the weights at a time (tensors are copied to CPU before writing).

    Args:
        model: the served ``PreTrainedModel`` (any device).
        tokenizer: its tokenizer (``save_pretrained``), or None to save weights and config only.
        root: the checkpoints folder (``MISERVER_HOME/checkpoints``), created if missing.
        name: the folder name, or None for :func:`default_name`.
        base_row_id, base_name: the base catalogue row (origin ``model``).
        parent_sha256: the checkpoint the resident weights were loaded from, or None.
        steps_since_load: commits since the weights became resident (weights page).
        now: the wall-clock time of the save, Unix seconds.
        parent_name: the catalogue name of the row the weights were loaded from (the loaded
            checkpoint's, else the base row's; ``base_name`` when None): the default name is
            ``<parent_name>-step<steps_since_load>-<sha8>``, what the weights are.

    Returns:
        The :class:`SavedCheckpoint`.

    Raises:
        InvalidCheckpointRequest: ``name`` is not a valid name (nothing written).
        CheckpointExists: ``root/<name>`` exists (nothing left behind).
        OSError: the disk failed (nothing left behind).
    """
    root = Path(root).absolute()
    if name is not None:
        validate_name(name)
        if (root / name).exists():
            raise CheckpointExists(
                f"a checkpoint named {name!r} already exists",
                details={"name": name, "path": str(root / name)},
            )
    root.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    saved_at = rfc3339(now)
    tmp = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=root))
    try:
        os.chmod(tmp, PRIVATE_DIR_MODE)  # the served weights: the owner's only (issue 32)
        groups = tensor_groups(model)
        entries: list[TensorEntry] = []
        host: dict[str, torch.Tensor] = {}
        for g in groups:
            cpu = g.tensor.detach().to("cpu", copy=True).contiguous()
            host[g.names[0]] = cpu
            entries.append(
                TensorEntry(
                    name=g.names[0],
                    dtype=dtype_name(cpu.dtype),
                    shape=list(cpu.shape),
                    sha256=tensor_sha256(cpu),
                    aliases=list(g.names[1:]),
                )
            )
        save_file(host, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        del host
        dtype = _weights_dtype(entries)
        _save_config(model, tmp, dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        files = {
            p.relative_to(tmp).as_posix(): file_sha256(p)
            for p in sorted(tmp.rglob("*"))
            if p.is_file() and p.name != WEIGHTS_NAME
        }
        config = getattr(model, "config", None)
        manifest = Manifest(
            format=MANIFEST_FORMAT,
            format_version=MANIFEST_VERSION,
            saved_at=saved_at,
            base=BaseRef(row_id=base_row_id, name=base_name),
            parent_checkpoint_sha256=parent_sha256,
            steps_since_load=steps_since_load,
            architecture={
                "model_type": getattr(config, "model_type", None),
                "architectures": list(
                    getattr(config, "architectures", None) or [type(model).__name__]
                ),
            },
            weights_file=WEIGHTS_NAME,
            tensors=sorted(entries, key=lambda e: e.name),
            files=files,
        )
        data = encode_manifest(manifest)
        (tmp / MANIFEST_NAME).write_bytes(data)
        private_modes(tmp)
        _fsync_tree(tmp)
        sha = hashlib.sha256(data).hexdigest()
        final_name = (
            name
            if name is not None
            else default_name(parent_name or base_name, steps_since_load, sha)
        )
        final = root / final_name
        weights_bytes = (tmp / WEIGHTS_NAME).stat().st_size
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return SavedCheckpoint(
        name=final_name,
        path=final,
        checkpoint_sha256=sha,
        manifest=manifest,
        saved_at=saved_at,
        dtype=dtype,
        weights_bytes=weights_bytes,
    )


#: A checkpoint's folder and files: the weights a trainer wrote are its owner's (uid 1000 in the
#: shipped deployments, the trainer's too), as the shared-memory files are (issue 32, item 13).
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_modes(folder: Path) -> None:
    """Make ``folder`` and everything in it its owner's only: folders 0700, files 0600 (the
    tokenizer's files are written with ``open()``, 0666 less the umask; safetensors' 0600)."""
    os.chmod(folder, PRIVATE_DIR_MODE)
    for path in folder.rglob("*"):
        os.chmod(path, PRIVATE_DIR_MODE if path.is_dir() else PRIVATE_FILE_MODE)


def ordinary_mode(path: Path, *, like: Path) -> None:
    """Give ``path`` the permission bits of ``like``, a file written with ``open()`` (0666 less
    the umask, usually 0644): safetensors writes its file 0600 (a temporary file renamed), so
    a checkpoint's or the imported default's ``model.safetensors`` was the one file other
    users could not read (issue 16 item 17)."""
    os.chmod(path, stat.S_IMODE(like.stat().st_mode))


def _weights_dtype(entries: list[TensorEntry]) -> str:
    """The most common floating dtype by element count (the catalogue row's dtype)."""
    counts: dict[str, int] = {}
    for e in entries:
        if DTYPES.get(e.dtype, torch.int8).is_floating_point:
            n = 1
            for d in e.shape:
                n *= d
            counts[e.dtype] = counts.get(e.dtype, 0) + n
    return max(counts, key=counts.__getitem__) if counts else "float32"


def _save_config(model: torch.nn.Module, folder: Path, dtype: str) -> None:
    """config.json (dtype set to the weights' dtype, the live config untouched) and the
    generation config."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config = config.__class__.from_dict(config.to_dict())
        config.dtype = dtype
        if not getattr(config, "architectures", None):
            config.architectures = [type(model).__name__]
        config.save_pretrained(str(folder))
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(str(folder))


def remove_partial_saves(root: Path) -> list[Path]:
    """Delete the ``.saving-*`` folders a killed save left in ``root``, and the ``.deleting-*``
    folders a deleted checkpoint row left (:meth:`Catalogue.delete
    <miserver.serving.models.catalogue.Catalogue.delete>`); returns what it removed.

    Call it at start-up (no save can be running then). Never touches a finished checkpoint.
    """
    from miserver.serving.models.catalogue import DELETING_PREFIX

    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    leftovers = [*root.glob(PARTIAL_PREFIX + "*"), *root.glob(DELETING_PREFIX + "*")]
    for p in sorted(leftovers):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


# --- open, verify, load -------------------------------------------------------------------------


def open_checkpoint(path: str | os.PathLike[str]) -> CheckpointHandle:
    """Open a checkpoint folder and parse its manifest (tensors are not read yet).

    Raises:
        CheckpointNotFound: ``path`` is not a folder.
        CheckpointCorrupt: no ``manifest.json``, or it does not parse as a version-1 manifest,
            or it names a file outside the folder, or the weights file is missing.
    """
    folder = Path(path).absolute()
    if not folder.is_dir() or folder.name.startswith(PARTIAL_PREFIX):
        raise CheckpointNotFound(
            f"no checkpoint folder at {str(folder)!r}", details={"path": str(folder)}
        )
    mpath = folder / MANIFEST_NAME
    try:
        data = mpath.read_bytes()
    except FileNotFoundError:
        raise CheckpointCorrupt(
            f"{folder.name!r} is not a miserver checkpoint: manifest.json is missing",
            path=folder,
            file=MANIFEST_NAME,
        ) from None
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise CheckpointCorrupt(
            f"manifest.json of {folder.name!r} is invalid: {e}", path=folder, file=MANIFEST_NAME
        ) from None
    if manifest.format != MANIFEST_FORMAT or manifest.format_version != MANIFEST_VERSION:
        raise CheckpointCorrupt(
            f"manifest.json of {folder.name!r} is format {manifest.format!r} version"
            f" {manifest.format_version}, not {MANIFEST_FORMAT!r} version {MANIFEST_VERSION}",
            path=folder,
            file=MANIFEST_NAME,
        )
    for rel in [manifest.weights_file, *manifest.files]:
        if not safe_relative(rel):
            raise CheckpointCorrupt(
                f"manifest.json names a file outside the checkpoint: {rel!r}",
                path=folder,
                file=MANIFEST_NAME,
            )
    if manifest.weights_file in manifest.files:
        raise CheckpointCorrupt(
            "manifest.json lists the weights file among the other files",
            path=folder,
            file=MANIFEST_NAME,
        )
    seen: set[str] = set()
    for t in manifest.tensors:
        for n in (t.name, *t.aliases):
            if n in seen:
                raise CheckpointCorrupt(
                    f"manifest.json names tensor {n!r} twice", path=folder, tensor=n
                )
            seen.add(n)
        if (
            t.dtype not in DTYPES
            or any(d < 0 for d in t.shape)
            or not SHA256_RE.fullmatch(t.sha256)
        ):
            raise CheckpointCorrupt(
                f"manifest entry of tensor {t.name!r} is invalid", path=folder, tensor=t.name
            )
    if not (folder / manifest.weights_file).is_file():
        raise CheckpointCorrupt(
            f"{manifest.weights_file} is missing", path=folder, file=manifest.weights_file
        )
    return CheckpointHandle(
        path=folder,
        name=folder.name,
        checkpoint_sha256=hashlib.sha256(data).hexdigest(),
        manifest=manifest,
    )


def _read_verified(handle: CheckpointHandle, keep: bool) -> dict[str, torch.Tensor]:
    folder, manifest = handle.path, handle.manifest
    for rel, want in manifest.files.items():
        p = folder / rel
        if not p.is_file():
            raise CheckpointCorrupt(f"{rel} is missing", path=folder, file=rel)
        if file_sha256(p) != want:
            raise CheckpointCorrupt(
                f"{rel} does not match its sha256 in manifest.json", path=folder, file=rel
            )
    out: dict[str, torch.Tensor] = {}
    wpath = folder / manifest.weights_file
    try:
        with safe_open(str(wpath), framework="pt", device="cpu") as f:
            stored = set(f.keys())
            listed = {t.name for t in manifest.tensors}
            if stored != listed:
                missing = sorted(listed - stored)
                extra = sorted(stored - listed)
                culprit = (missing or extra)[0]
                raise CheckpointCorrupt(
                    f"{manifest.weights_file} and manifest.json list different tensors"
                    f" (missing from the file: {missing[:5]}, not in the manifest: {extra[:5]})",
                    path=folder,
                    tensor=culprit,
                )
            for entry in manifest.tensors:
                t = f.get_tensor(entry.name)
                if dtype_name(t.dtype) != entry.dtype or list(t.shape) != entry.shape:
                    raise CheckpointCorrupt(
                        f"tensor {entry.name!r} is {dtype_name(t.dtype)}{list(t.shape)} in the"
                        f" file but {entry.dtype}{entry.shape} in manifest.json",
                        path=folder,
                        tensor=entry.name,
                    )
                if tensor_sha256(t) != entry.sha256:
                    raise CheckpointCorrupt(
                        f"tensor {entry.name!r} does not match its sha256 in manifest.json",
                        path=folder,
                        tensor=entry.name,
                    )
                if keep:
                    out[entry.name] = t
    except SafetensorError as e:
        raise CheckpointCorrupt(
            f"{manifest.weights_file} cannot be read: {e}", path=folder, file=manifest.weights_file
        ) from None
    except OSError as e:
        raise CheckpointCorrupt(
            f"{manifest.weights_file} cannot be read: {e.strerror}",
            path=folder,
            file=manifest.weights_file,
        ) from None
    return out


def verify(handle: CheckpointHandle) -> None:
    """Check every tensor (dtype, shape, sha256) and every listed file against the manifest.

    Reads the whole weights file, one tensor at a time.

    Raises:
        CheckpointCorrupt: naming the first tensor (``.tensor``) or file (``.file``) that does not
            match, or the weights file is unreadable.
    """
    _read_verified(handle, keep=False)


def layout_matches(model: torch.nn.Module, handle: CheckpointHandle) -> bool:
    """Whether ``handle`` can be written in place into ``model`` (contract 5).

    True when the model's base state dict (LoRA layers looked through) and the checkpoint cover
    the same names with the same dtypes and shapes, and the same names are tied together (a tied
    pair in the checkpoint is one tensor in the model, and the reverse).
    """
    return model_layout(model) == manifest_layout(handle.manifest)


def read_for_load(model: torch.nn.Module, handle: CheckpointHandle) -> dict[str, torch.Tensor]:
    """Read and check everything an in-place load of ``handle`` into ``model`` needs, writing
    nothing (contract 5: a corrupt checkpoint is refused before anything is written).

    Every file the manifest lists (config, tokenizer, ...) is present and matches its sha256,
    every tensor is read and matches its dtype, shape and sha256, and the layout matches the
    model's (:func:`layout_matches`). Returns the verified tensors (CPU, by stored name: one host
    copy of the weights) for :func:`write_in_place`. Call it *before* the set is marked
    ``writing``, so a refusal leaves the weights clean.

    Raises:
        CheckpointCorrupt: a tensor or file does not match the manifest, or is missing.
        LayoutMismatch: :func:`layout_matches` is false.
    """
    tensors = _read_verified(handle, keep=True)
    if not layout_matches(model, handle):
        raise LayoutMismatch(
            f"checkpoint {handle.name!r} does not have the resident model's layout (names,"
            " shapes, dtypes, tied weights); it needs a full reload",
            details={"path": str(handle.path)},
        )
    return tensors


def write_in_place(
    model: torch.nn.Module, handle: CheckpointHandle, tensors: Mapping[str, torch.Tensor]
) -> None:
    """``copy_`` the tensors :func:`read_for_load` returned into the model's existing parameters
    and buffers under ``torch.no_grad()``: no parameter storage is allocated and every
    ``data_ptr()`` stays the same (weights page: "Releasing the handles": the in-place load
    writes into the exported storages). A tied group is written once. Reads no file, so it
    cannot fail on a checkpoint folder changed or removed after :func:`read_for_load`.
    """
    stored_name = {n: t.name for t in handle.manifest.tensors for n in (t.name, *t.aliases)}
    with torch.no_grad():
        for g in tensor_groups(model):
            g.tensor.copy_(tensors[stored_name[g.names[0]]])


def load_in_place(model: torch.nn.Module, handle: CheckpointHandle) -> None:
    """Write the checkpoint's tensors into the model's existing parameters and buffers:
    :func:`read_for_load` (every file and tensor verified, the layout checked, all before the
    first write, so a damaged checkpoint is reported as corrupt, not as a layout mismatch), then
    :func:`write_in_place`. Needs one host copy of the weights. Runs inside the barrier.

    Raises:
        CheckpointCorrupt: a tensor or file does not match the manifest (nothing written).
        LayoutMismatch: :func:`layout_matches` is false (nothing written).
    """
    write_in_place(model, handle, read_for_load(model, handle))


#: Files a full reload reads besides the weights: the config, and a tokenizer (either file).
RELOAD_CONFIG = "config.json"
RELOAD_TOKENIZER = ("tokenizer_config.json", "tokenizer.json")


def verify_for_reload(handle: CheckpointHandle) -> None:
    """:func:`verify`, and the files a full reload reads are there: ``config.json`` and a
    tokenizer (``tokenizer_config.json`` or ``tokenizer.json``): the model host loads the folder
    as a Hugging Face model folder, tokenizer first. Call it before the set is marked
    ``writing``.

    Raises:
        CheckpointCorrupt: as :func:`verify`, or ``config.json`` or the tokenizer is missing
            (``.file`` names it).
    """
    verify(handle)
    if not (handle.path / RELOAD_CONFIG).is_file():
        raise CheckpointCorrupt(
            f"{RELOAD_CONFIG} is missing (a full reload loads the folder as a Hugging Face model)",
            path=handle.path,
            file=RELOAD_CONFIG,
        )
    if not any((handle.path / name).is_file() for name in RELOAD_TOKENIZER):
        raise CheckpointCorrupt(
            f"{RELOAD_TOKENIZER[0]} is missing, and so is {RELOAD_TOKENIZER[1]}: a full reload"
            " loads the checkpoint's own tokenizer",
            path=handle.path,
            file=RELOAD_TOKENIZER[0],
        )


def reopen(handle: CheckpointHandle) -> CheckpointHandle:
    """Open ``handle``'s folder again and check it is still the checkpoint that was checked
    (the same ``manifest.json`` bytes): a load re-reads its checkpoint inside the pause, and the
    folder may have changed since the request was checked.

    Raises:
        CheckpointNotFound: the folder is gone.
        CheckpointCorrupt: its manifest is missing, invalid or no longer the one checked.
    """
    again = open_checkpoint(handle.path)
    if again.checkpoint_sha256 != handle.checkpoint_sha256:
        raise CheckpointCorrupt(
            f"manifest.json of {handle.name!r} changed after the load was checked (sha256"
            f" {again.checkpoint_sha256[:12]}..., was {handle.checkpoint_sha256[:12]}...);"
            " nothing was written: retry the load",
            path=handle.path,
            file=MANIFEST_NAME,
        )
    return again


# --- references ---------------------------------------------------------------------------------


def _field(row: Any, key: str) -> Any:
    return row[key] if isinstance(row, Mapping) else getattr(row, key)


def resolve_checkpoint(catalogue_rows: Iterable[Any], ref: str) -> Any:
    """The catalogue row of origin ``checkpoint`` that ``ref`` names (contract 5 ``load``).

    ``ref`` is tried as a full sha256 (64 hex digits, any case), then as a row name, then as a
    path (compared after resolving). Rows are :class:`CatalogueRow` objects or mappings with
    ``origin``, ``name``, ``path`` and ``checkpoint_sha256``.

    Raises:
        InvalidCheckpointRequest: ``ref`` is empty or not a string.
        CheckpointNotFound: no checkpoint row matches.
    """
    if not isinstance(ref, str) or not ref.strip():
        raise InvalidCheckpointRequest(
            "checkpoint must be a sha256, a name or a path", details={"field": "checkpoint"}
        )
    ref = ref.strip()
    rows = [r for r in catalogue_rows if _field(r, "origin") == "checkpoint"]
    if SHA256_RE.fullmatch(ref.lower()):
        for r in rows:
            if (_field(r, "checkpoint_sha256") or "").lower() == ref.lower():
                return r
    for r in rows:
        if _field(r, "name") == ref:
            return r
    try:
        wanted = Path(ref).expanduser().resolve()
    except (OSError, RuntimeError, ValueError):
        wanted = None
    if wanted is not None:
        for r in rows:
            if Path(_field(r, "path")).expanduser().resolve() == wanted:
                return r
    shown = ref if len(ref) <= 200 else ref[:200] + "..."
    raise CheckpointNotFound(
        f"no checkpoint with sha256, name or path {shown!r}", details={"checkpoint": shown}
    )
