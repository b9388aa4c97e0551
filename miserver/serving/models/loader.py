"""Loading a catalogue row into memory: a transformers model, its tokenizer, its device.

Blocking code: the model host runs :func:`load_model` in a worker thread. The one place a load is
made attachable is :func:`make_attachable` (issue 4 places the parameters of a 16-bit load in one
shared allocation there; weights page: Which models can be attached).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miserver.serving.models.catalogue import CatalogueRow
from miserver.spec import codes
from miserver.spec.errors import ApiError
from miserver.spec.settings import Settings

log = logging.getLogger("miserver.loader")

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


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


def check_loadable(row: CatalogueRow) -> None:
    """Refuse a row this build cannot load, before anything is unloaded (contract 3).

    Raises:
        ApiError: for a gguf row, :func:`miserver.serving.models.gguf.check_loadable` (400
            BACKEND_UNAVAILABLE without the llama.cpp binding); 500 MODEL_LOAD_FAILED when the
            row's files are gone.
    """
    if row.format == "gguf":  # served through llama.cpp (contract 4a)
        from miserver.serving.models import gguf

        gguf.check_loadable(row)
        return
    if not (Path(row.path) / "config.json").is_file():
        raise ApiError(
            codes.MODEL_LOAD_FAILED,
            f"catalogue row {row.name!r}: {row.path} has no config.json (moved or deleted?)",
            details={"model_id": row.id, "name": row.name, "path": row.path},
        )


#: The largest safetensors header read (the format's own limit is 100 MB).
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
_SAFETENSORS_DTYPES = frozenset(
    {"BOOL", "U8", "I8", "U16", "I16", "F16", "BF16", "U32", "I32", "F32", "U64", "I64", "F64"}
    | {"F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64", "I4", "U4"}
)


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors a ``.safetensors`` file declares, ``{name: (dtype, shape)}``, read from its
    header without loading any tensor; the data each entry points at must lie inside the file.

    Raises:
        ValueError: the file is not a readable safetensors file (too short, a header length
            past the end, a header that is not a JSON object of tensor entries, an entry whose
            data lies outside the file); the message says which.
        OSError: the file cannot be read.
    """
    import json
    import struct

    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name} is {size} bytes: too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
            raise ValueError(
                f"{path.name} is not a safetensors file (its header length, {n} bytes, does not "
                f"fit the file of {size} bytes)"
            )
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ValueError(
            f"{path.name} is not a safetensors file (its header is not JSON)"
        ) from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name} is not a safetensors file (its header is not an object)")
    data_size = size - 8 - n
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ok = (
            isinstance(entry, dict)
            and entry.get("dtype") in _SAFETENSORS_DTYPES
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
            and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2
            and all(isinstance(o, int) for o in entry["data_offsets"])
        )
        if not ok:
            raise ValueError(f"{path.name}: the header entry of tensor {name!r} is malformed")
        start, end = entry["data_offsets"]
        if not 0 <= start <= end <= data_size:
            raise ValueError(
                f"{path.name}: tensor {name!r} lies outside the file (offsets {start}..{end}, "
                f"{data_size} data bytes): the file is cut short or damaged"
            )
        out[name] = (entry["dtype"], tuple(entry["shape"]))
    if not out:
        raise ValueError(f"{path.name} holds no tensors")
    return out


def check_weight_files(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Read the header of every ``*.safetensors`` file of a model folder (:func:`read_safetensors_header`)
    and return all their tensors; with a ``model.safetensors.index.json`` every file it names
    must be there.

    Raises:
        ValueError: no weight file, a file the index names is missing, or a file is not a
            readable safetensors file (the message names it).
        OSError: a file cannot be read.
    """
    import json

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors file")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            named = set(weight_map.values()) if isinstance(weight_map, dict) else set()
        except (ValueError, UnicodeDecodeError, AttributeError):
            raise ValueError(f"{index.name} is not a readable JSON index") from None
        missing = sorted(str(f) for f in named if not (folder / str(f)).is_file())
        if missing:
            raise ValueError(f"{index.name} names weight files that are missing: {missing[:5]}")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in files:
        tensors.update(read_safetensors_header(f))
    return tensors


def _check_shapes(config: Any, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> str | None:
    """Compare the file's tensor shapes with the model ``config`` describes (built on the meta
    device: no memory). Returns the first mismatch in words, or None; None also when the
    architecture cannot be built this way (transformers' own load decides then)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - an unusual architecture: not checked here
        return None
    prefix = getattr(model, "base_model_prefix", "") or ""
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    matched = 0
    for name, (_, shape) in sorted(tensors.items()):
        key = name if name in expected else (name.removeprefix(prefix + ".") if prefix else name)
        if key not in expected and prefix and f"{prefix}.{name}" in expected:
            key = f"{prefix}.{name}"
        want = expected.get(key)
        if want is None:
            continue
        matched += 1
        if want != shape:
            return (
                f"tensor {name!r} has shape {list(shape)} in the weight files, but config.json "
                f"describes {list(want)}"
            )
    if matched == 0:
        return "no tensor of the weight files is a parameter of the model config.json describes"
    return None


def preflight(row: CatalogueRow) -> None:
    """Check, before anything is unloaded, what can be checked of a row's folder without loading
    its weights (breaker finding F16): :func:`check_loadable`, ``config.json`` (transformers'
    ``AutoConfig``), the tokenizer (``AutoTokenizer``), every weight file's safetensors header
    (:func:`check_weight_files`) and the tensors' shapes against the config. Blocking (the
    tokenizer is read, about a second at most): run it in a worker thread.

    Raises:
        ApiError: as :func:`check_loadable`; 400 MODEL_LOAD_FAILED naming the row and the
            problem (the resident model stays).
    """
    if row.format == "gguf":
        from miserver.serving.models import gguf

        gguf.preflight(row)
        return
    check_loadable(row)
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(row.path)

    def refuse(what: str) -> ApiError:
        return ApiError(
            codes.MODEL_LOAD_FAILED,
            f"catalogue row {row.name!r} cannot be loaded from {row.path}: {what}; nothing was "
            "unloaded (fix or re-register the folder)",
            status=400,
            details={"model_id": row.id, "name": row.name, "path": row.path},
        )

    try:
        config = AutoConfig.from_pretrained(row.path)
    except Exception as exc:  # noqa: BLE001 - transformers' errors, reported in words
        raise refuse(f"config.json: {type(exc).__name__}: {str(exc)[:300]}") from None
    try:
        AutoTokenizer.from_pretrained(row.path)
    except Exception as exc:  # noqa: BLE001
        raise refuse(f"the tokenizer: {type(exc).__name__}: {str(exc)[:300]}") from None
    try:
        tensors = check_weight_files(folder)
    except (OSError, ValueError) as exc:
        raise refuse(f"the weights: {exc}") from None
    mismatch = _check_shapes(config, tensors)
    if mismatch is not None:
        raise refuse(mismatch)


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
    arena = make_attachable(model, settings)
    if arena is None and device.type == "cpu":
        own_cpu_storages(model)
    return arena


def own_cpu_storages(model: torch.nn.Module) -> None:
    """Give each CPU parameter and buffer of ``model`` a storage of its own in process memory,
    at load, before anything is served (shapes, dtypes and values unchanged; a tied parameter
    stays one parameter).

    transformers' safetensors loader leaves a CPU model's tensors as views of the file's
    memory mapping (page-cache pages). The decode step streams every weight once a token, and
    from the mapping it was measured slower: SmolLM2-135M in bfloat16, 1 thread, 2-core
    machine, 55.4 against 47.7 ms a step for one sequence and 75.9 against 67.4 for 16
    (docs/decisions.md, "Weights out of the file mapping"). The copy is the load's placement,
    as ``model.to("cuda")`` is on a card: from here on the storages never move (the arena
    invariant), so what a trainer or a commit writes is what the next step reads. Sibling
    projections (queries/keys/values, gate/up) are laid out as row slices of one tensor a group
    (:func:`~miserver.serving.engine.cpu_linear.place_fused_projections`)."""
    from miserver.serving.engine.cpu_linear import place_fused_projections

    placed = {
        t.untyped_storage().data_ptr()
        for g in place_fused_projections(model)  # sibling projections: one tensor each group
        for t in (g.weight, g.bias)
        if t is not None
    }
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if (
                tensor.device.type == "cpu"
                and tensor.numel()
                and tensor.untyped_storage().data_ptr() not in placed
            ):
                tensor.data = tensor.data.clone()


def load_model(row: CatalogueRow, settings: Settings) -> LoadedModel:
    """Load ``row`` (a safetensors Hugging Face folder) onto ``settings.resolved_device()``;
    a GGUF row into llama.cpp (:func:`miserver.serving.models.gguf.load_gguf`).

    Blocking (seconds for a small model on CPU): call it in a worker thread.

    Raises:
        ApiError: as :func:`check_loadable`; 500 MODEL_LOAD_FAILED when transformers cannot
            load the folder (the message names the row and transformers' error).
    """
    if row.format == "gguf":  # llama.cpp (contract 4a)
        from miserver.serving.models import gguf

        model, tokenizer = gguf.load_gguf(row, settings)
        return LoadedModel(
            model=model, tokenizer=tokenizer, device=torch.device("cpu"), attachable=False
        )
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
