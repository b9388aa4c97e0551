"""The Management API (contract section 3): catalogue, loads, run-time settings, health, metrics.

Every route answers in the envelope ``{"success", "data", "error"}`` (contract 2). Request bodies
are decoded strictly with msgspec: a wrong type, a missing or unknown field, or a body that is not
a JSON object is ``400 INVALID_REQUEST`` naming the field (``param`` and ``details.field``), and
nothing changes. No route here needs a token.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from aiohttp import web

from miserver.http import keys
from miserver.http.errors import ok, refuse_secret_name
from miserver.http.path_privacy import path_syntax_ok, private_path_refusal
from miserver.serving.models import checkpoints
from miserver.serving.models.catalogue import (
    DTYPES,
    CatalogueError,
    CatalogueRow,
    DuplicateName,
)
from miserver.serving.models.client_paths import ClientPathError, check_client_path
from miserver.serving.models.loader import check_weight_files
from miserver.serving.weights.jobs import refuse_applied_adapter_name
from miserver.spec import codes
from miserver.spec.errors import ApiError
from miserver.spec.json_syntax import decode_error_message, plain_validation_message

log = logging.getLogger("miserver.management")

T = TypeVar("T")

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
GGUF_MAGIC = b"GGUF"


# --- request bodies --------------------------------------------------------------------------
class RegisterModel(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /api/models``: a local Hugging Face folder or a ``.gguf`` file (contract 3).

    ``dtype`` and ``quantization`` are detected from the folder's ``config.json`` when absent;
    when given they must agree with it.
    """

    name: str
    path: str
    dtype: Literal["float16", "bfloat16", "float32"] | None = None
    quantization: (
        Literal["none", "bitsandbytes-8bit", "bitsandbytes-4bit", "gptq", "awq", "gguf"] | None
    ) = None


PositiveInt = Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]


class SettingsPatch(msgspec.Struct, forbid_unknown_fields=True):
    """``PATCH /api/settings`` (contract 1): any subset of the run-time serving settings."""

    max_concurrent_requests: PositiveInt | msgspec.UnsetType = msgspec.UNSET
    continuous_batching: bool | msgspec.UnsetType = msgspec.UNSET
    max_queued_requests: PositiveInt | msgspec.UnsetType = msgspec.UNSET


_FIELD_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def _invalid(message: str, field: str | None) -> ApiError:
    return ApiError(
        codes.INVALID_REQUEST, message, param=field, details={"field": field} if field else None
    )


def decode_body(body: bytes, type_: type[T], *, hints: dict[str, str] | None = None) -> T:
    """Decode a JSON request body strictly into ``type_`` (a msgspec Struct).

    ``hints`` maps a wrongly spelled field to the right one (named in the error).

    Raises:
        ApiError: 400 INVALID_REQUEST naming the offending field (contract 2). The message never
            repeats the body.
    """
    if not body.strip():
        raise _invalid("the request body must be a JSON object; it is empty", None)
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        text = str(exc)
        unknown = _UNKNOWN.search(text)
        missing = _MISSING.search(text)
        at = _FIELD_AT.search(text)
        if unknown:
            field = unknown.group(1)
            fields = ", ".join(getattr(type_, "__struct_fields__", ()))
            hint = (hints or {}).get(field)
            if not fields:  # the barrier calls: the token and headers say everything
                raise _invalid(
                    f"unknown field {field!r}: this route takes no body; send none, or {{}}",
                    field,
                ) from None
            raise _invalid(
                f"unknown field {field!r}"
                + (f" (did you mean {hint!r}?)" if hint else "")
                + f"; allowed fields: {fields}",
                field,
            ) from None
        if missing:
            field = missing.group(1)
            raise _invalid(f"{field} is required", field) from None
        field = at.group(1) if at else None
        detail = _FIELD_AT.sub("", text)
        if field is None and detail.startswith("Expected `object`"):
            raise _invalid("the request body must be a JSON object", None) from None
        raise _invalid(plain_validation_message(detail, field), field) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _invalid(decode_error_message(body, exc), None) from None


async def read_body(request: web.Request, type_: type[T], **kw: Any) -> T:
    """Read and :func:`decode_body` the request body (413 beyond ``MAX_REQUEST_BYTES``)."""
    return decode_body(await request.read(), type_, **kw)


# --- helpers ---------------------------------------------------------------------------------
def _row_id(request: web.Request) -> int:
    raw = request.match_info["id"]
    digits = raw.isascii() and raw.isdigit()  # str.isdigit alone takes "\u0661", "\uff11"
    if not digits or len(raw) > 18:
        what = "is larger than any row id" if digits else "is not a row id"
        raise ApiError(
            codes.MODEL_NOT_FOUND,
            f"no catalogue row with id {raw[:40]!r}: it {what}; a row id is a positive "
            "integer (GET /api/models lists the rows and their ids)",
            details={"model_id": raw[:40]},
        )
    return int(raw)


def _row_or_404(request: web.Request, row_id: int) -> CatalogueRow:
    row = request.app[keys.CATALOGUE].get(row_id)
    if row is None:
        raise ApiError(
            codes.MODEL_NOT_FOUND,
            f"no catalogue row with id {row_id}",
            details={"model_id": row_id},
        )
    return row


def _detect_quantization(config: dict[str, Any]) -> str:
    q = config.get("quantization_config")
    if not q:
        return "none"
    method = str(q.get("quant_method", "")).lower()
    if method == "bitsandbytes":
        return "bitsandbytes-4bit" if q.get("load_in_4bit") else "bitsandbytes-8bit"
    if method in ("gptq", "awq"):
        return method
    raise _invalid(
        f"config.json has a quantization_config of method {method or 'unknown'!r}; "
        "supported: bitsandbytes, gptq, awq",
        "path",
    )


def _detect_dtype(config: dict[str, Any]) -> str | None:
    raw = config.get("dtype") or config.get("torch_dtype")
    if raw is None and isinstance(config.get("text_config"), dict):
        raw = config["text_config"].get("dtype") or config["text_config"].get("torch_dtype")
    if raw is None:
        return None
    value = str(raw).removeprefix("torch.")
    return value if value in DTYPES else None


def inspect_model_path(body: RegisterModel) -> dict[str, str]:
    """Validate a ``POST /api/models`` path and detect ``format``, ``dtype``, ``quantization``.

    A directory must hold ``config.json`` and at least one ``*.safetensors`` file, each with a
    readable safetensors header whose tensors lie inside the file
    (:func:`~miserver.serving.models.loader.check_weight_files`); a file must be a GGUF file (magic
    ``GGUF``). Returns the row's ``{format, dtype, quantization, path}``.

    Raises:
        ApiError: 400 INVALID_REQUEST naming ``path`` (also for a path too long, a symlink loop
            or one the server may not read: :func:`~miserver.serving.models.client_paths.check_client_path`),
            ``dtype`` or ``quantization``.
    """
    try:
        path = check_client_path(body.path).resolve()
    except ClientPathError as exc:
        raise _invalid(str(exc), "path") from None
    try:
        return _inspect_resolved(body, path)
    except OSError as exc:  # a file inside the folder the server may not read, say
        raise _invalid(
            f"path cannot be read on the server ({exc.strerror or type(exc).__name__})", "path"
        ) from None


def _inspect_resolved(body: RegisterModel, path: Path) -> dict[str, str]:
    if not path.exists():
        raise _invalid(f"path does not exist on the server: {str(path)[:300]}", "path")
    if path.is_file():
        try:
            with path.open("rb") as fh:
                magic = fh.read(4)
        except OSError as exc:
            raise _invalid(f"path cannot be read: {exc.strerror}", "path") from None
        if magic != GGUF_MAGIC:
            raise _invalid(
                "path is a file but not a GGUF file (no GGUF magic); register a "
                "Hugging Face model folder or a .gguf file",
                "path",
            )
        if body.quantization not in (None, "gguf"):
            raise _invalid("a GGUF file's quantization is gguf", "quantization")
        return {
            "format": "gguf",
            "dtype": body.dtype or "float32",
            "quantization": "gguf",
            "path": str(path),
        }
    if not path.is_dir():
        raise _invalid("path is neither a folder nor a regular file", "path")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise _invalid(f"{path} has no config.json: not a Hugging Face model folder", "path")
    if not any(path.glob("*.safetensors")):
        raise _invalid(
            f"{path} has no *.safetensors file (only safetensors weights are supported)", "path"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("not an object")
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise _invalid(f"{config_file} is not a readable JSON object ({exc})", "path") from None
    try:  # breaker finding F16: a garbage weight file is refused here, not at its first load
        check_weight_files(path)
    except ValueError as exc:
        raise _invalid(f"{path}: the weights cannot be read: {exc}", "path") from None
    detected_q = _detect_quantization(config)
    if body.quantization is not None and body.quantization != detected_q:
        raise _invalid(
            f"quantization {body.quantization!r} does not match the folder's "
            f"config.json ({detected_q!r})",
            "quantization",
        )
    if body.quantization == "gguf":
        raise _invalid("quantization gguf is for .gguf files", "quantization")
    dtype = body.dtype or _detect_dtype(config) or "float32"
    return {"format": "safetensors", "dtype": dtype, "quantization": detected_q, "path": str(path)}


# --- catalogue routes ------------------------------------------------------------------------
async def list_models(request: web.Request) -> web.Response:
    """``GET /api/models``: every catalogue row, ordered by id."""
    return ok(request.app[keys.CATALOGUE].list())


async def get_model(request: web.Request) -> web.Response:
    """``GET /api/models/{id}``: one row (404 MODEL_NOT_FOUND)."""
    return ok(_row_or_404(request, _row_id(request)))


async def register_model(request: web.Request) -> web.Response:
    """``POST /api/models {name, path, dtype?, quantization?}``: 201 with the new row.

    400 INVALID_REQUEST for a bad body or path, 409 MODEL_EXISTS for a taken name.
    """
    body = await read_body(request, RegisterModel)
    if not NAME_RE.match(body.name):
        raise _invalid(
            "name must be 1-128 characters of letters, digits and . _ : / @ + -, "
            "starting with a letter or digit",
            "name",
        )
    refuse_secret_name(request.app, body.name)  # before any answer repeats the name
    refuse_secret_name(request.app, body.path, "path")  # listed by GET /api/models
    catalogue = request.app[keys.CATALOGUE]
    existing = catalogue.get_by_name(body.name)
    if existing is not None:
        raise ApiError(
            codes.MODEL_EXISTS,
            f"a catalogue row named {body.name!r} already exists (id {existing.id})",
            details={"name": body.name, "model_id": existing.id},
        )
    refuse_applied_adapter_name(request.app[keys.HOST], body.name, "this row")
    syntax_ok = path_syntax_ok(body.path)
    try:
        found = inspect_model_path(body)
    except ApiError as exc:
        if syntax_ok and exc.param == "path":  # it looked at the server's files
            raise private_path_refusal(request, exc) from None
        raise
    try:
        row = catalogue.register(name=body.name, origin="model", **found)  # type: ignore[arg-type]
    except DuplicateName as exc:
        raise ApiError(
            codes.MODEL_EXISTS, str(exc), details={"name": body.name, "model_id": exc.existing_id}
        ) from None
    except CatalogueError as exc:
        raise _invalid(str(exc), None) from None
    return ok(row, status=201)


def _same_folder(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, RuntimeError, ValueError):
        return a == b


def _refuse_delete_of_last_save(app: web.Application, row: CatalogueRow) -> None:
    """409 MODEL_RESIDENT for the checkpoint row whose folder holds the resident weights' last
    save (status ``last_save``, made since the resident was loaded) when that save recorded
    commits (its manifest's ``steps_since_load`` > 0; a save of none is a copy of the loaded
    row, which stays, and is deleted as any checkpoint row).

    Deleting the row removes its folder (``Catalogue.delete``), the only copy of the commits the
    save recorded: "unsaved" counts only the commits after the save (weights page: Unsaved
    commits and the auto-load), so nothing would refuse the auto-load that discards them, and
    the served name (``"<row>";origin=checkpoint``) would name nothing. So the row stays
    while the weights are its save, as a resident row does (contract 3): save them under
    another name, or unload (or load other weights), then delete it.
    """
    runtime = app.get(keys.WEIGHTS)
    resident = app[keys.HOST].resident
    last_save = runtime.last_save if runtime is not None else None
    if row.origin != "checkpoint" or resident is None or not last_save:
        return
    try:
        saved_at = datetime.fromisoformat(str(last_save["at"])).timestamp()
    except (KeyError, ValueError):
        saved_at = float("inf")  # unknown: assume the save is of the resident weights
    if saved_at < resident.loaded_at or not _same_folder(str(last_save["path"]), row.path):
        return
    try:
        recorded = checkpoints.open_checkpoint(row.path).manifest.steps_since_load
    except (checkpoints.CheckpointError, OSError):
        return  # no manifest miserver can open: nothing it could load back from the folder
    if not recorded:
        return  # a copy of the loaded row's weights, which stays: nothing is lost
    rid = resident.row.id
    raise ApiError(
        codes.MODEL_RESIDENT,
        f"checkpoint {row.name!r} (id {row.id}) holds the last save of the resident weights"
        f" (served as {resident.served_name!r}); deleting it would delete its folder, the only"
        f" copy of the {recorded} commit(s) that save recorded. Save the weights under another"
        " name first"
        f' (attach, then POST /api/weights/save {{"name": ...}}), or unload them'
        f" (POST /api/models/{rid}/unload) or load other weights, then delete this row.",
        details={
            "model_id": row.id,
            "resident_model_id": rid,
            "commits": recorded,
            "last_save": {"path": str(last_save["path"]), "at": last_save.get("at")},
        },
    )


async def delete_model(request: web.Request) -> web.Response:
    """``DELETE /api/models/{id}``: remove the row. A registered model's files stay; a
    checkpoint miserver saved takes its folder with it (``Catalogue.delete``).

    Refused with 409 MODEL_RESIDENT while the row is resident, is DEFAULT_MODEL (the next start
    would fail) or holds the resident weights' last save, 409 MODEL_BUSY (reason
    ``model_transition``) while a model load or unload, a weights load or a save runs."""
    row = _row_or_404(request, _row_id(request))
    host = request.app[keys.HOST]
    if host.resident is not None and host.resident.row.id == row.id:
        raise ApiError(
            codes.MODEL_RESIDENT,
            f"catalogue row {row.name!r} (id {row.id}) is resident; unload it first "
            f"(POST /api/models/{row.id}/unload)",
            details={"model_id": row.id},
        )
    default = request.app[keys.SETTINGS].default_model
    if default and row.name == default:
        raise ApiError(
            codes.MODEL_RESIDENT,
            f"catalogue row {row.name!r} (id {row.id}) is DEFAULT_MODEL, the model this server"
            " loads at start: without it the next start fails. Set DEFAULT_MODEL to another row"
            " (or to empty) and restart, then delete it",
            details={"model_id": row.id, "setting": "DEFAULT_MODEL"},
        )
    if host.busy:
        raise ApiError(
            codes.MODEL_BUSY,
            "a model load or unload is in progress; retry when it finishes",
            reason="model_transition",
            details={"transition": host.transition},
        )
    runtime = request.app.get(keys.WEIGHTS)
    if runtime is not None:  # the table decides (catalogue_delete): no await before the delete
        runtime.catalogue_delete(row.id, row.name)
    _refuse_delete_of_last_save(request.app, row)
    try:
        request.app[keys.CATALOGUE].delete(row.id)
    except CatalogueError as exc:
        raise ApiError(codes.MODEL_RESIDENT, str(exc), details={"model_id": row.id}) from None
    return ok({"id": row.id, "name": row.name, "deleted": True})


async def load_model(request: web.Request) -> web.Response:
    """``POST /api/models/{id}/load``: make the row resident (a swap; a no-op when resident)."""
    row_id = _row_id(request)
    host = request.app[keys.HOST]
    already = host.resident is not None and host.resident.row.id == row_id
    await request.app[keys.WEIGHTS].model_transition("model_load", row_id)
    resident = host.resident
    return ok({"model": resident.row, "already_resident": already, "resident": host.describe()})


async def unload_model(request: web.Request) -> web.Response:
    """``POST /api/models/{id}/unload``: unload the resident row (409 MODEL_NOT_LOADED)."""
    row = await request.app[keys.WEIGHTS].model_transition("model_unload", _row_id(request))
    return ok({"model": request.app[keys.CATALOGUE].get(row.id) or row, "resident": None})


# --- settings --------------------------------------------------------------------------------
_SETTINGS_HINTS = {
    "MAX_CONCURRENT_REQUESTS": "max_concurrent_requests",
    "CONTINUOUS_BATCHING": "continuous_batching",
    "MAX_QUEUED_REQUESTS": "max_queued_requests",
}


def _continuous_batching(app: web.Application) -> bool:
    """Whether ``CONTINUOUS_BATCHING`` is on: the lifecycle's pause availability is ``cbm``
    (the one record of it, set at start and by :func:`patch_settings`; contract 1)."""
    return app[keys.WEIGHTS].lifecycle.state.avail == "cbm"


def _settings_view(app: web.Application) -> dict[str, Any]:
    scheduler = app[keys.SCHEDULER]
    return {
        "max_concurrent_requests": scheduler.max_concurrent,
        "continuous_batching": _continuous_batching(app),
        "max_queued_requests": scheduler.max_queued,
    }


async def get_settings(request: web.Request) -> web.Response:
    """``GET /api/settings``: the run-time serving settings (contract 1)."""
    return ok(_settings_view(request.app))


async def patch_settings(request: web.Request) -> web.Response:
    """``PATCH /api/settings``: change any of ``max_concurrent_requests``,
    ``continuous_batching`` (the weights page's cbm) and ``max_queued_requests`` (contract 1).

    The resulting pause availability (``cbm`` while continuous batching is on, else
    ``concurrency`` while ``MAX_CONCURRENT_REQUESTS`` is not 1, else ``ok``) goes through the
    lifecycle table: 409 MODEL_BUSY while the barrier is held or a commit is open; accepted
    while a trainer is attached and idle (its next quiesce is then 409 BARRIER_UNAVAILABLE).
    """
    patch = await read_body(request, SettingsPatch, hints=_SETTINGS_HINTS)
    kwargs = {}
    if patch.max_concurrent_requests is not msgspec.UNSET:
        kwargs["max_concurrent"] = patch.max_concurrent_requests
    if patch.max_queued_requests is not msgspec.UNSET:
        kwargs["max_queued"] = patch.max_queued_requests
    concurrency = kwargs.get("max_concurrent", request.app[keys.SCHEDULER].max_concurrent)
    # The lifecycle decides (409 MODEL_BUSY while the barrier is held or weights are writing,
    # its message and details the table's; contract 1) and records the resulting pause
    # availability (weights page: Status).
    scheduler = request.app[keys.SCHEDULER]
    continuous = (
        _continuous_batching(request.app)
        if patch.continuous_batching is msgspec.UNSET
        else patch.continuous_batching
    )
    avail = "cbm" if continuous else ("ok" if concurrency == 1 else "concurrency")
    await request.app[keys.WEIGHTS].settings_change(avail)
    before = scheduler.max_concurrent
    if kwargs:
        scheduler.set_limits(**kwargs)
    warning = request.app[keys.SETTINGS].training_warning(scheduler.max_concurrent)
    if warning is not None and before <= 1:  # the barrier just went off (issue 32, item 5)
        log.warning(warning)
    return ok(_settings_view(request.app))


# --- health and metrics ----------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    """``GET /api/health``: liveness; 200 whenever the process answers."""
    return ok({"status": "ok"})


async def health_ready(request: web.Request) -> web.Response:
    """``GET /api/health/ready``: readiness (a Kubernetes ``readinessProbe``): 200 while a model
    is resident and served, else ``503 NOT_READY`` with the reason: ``no_model`` (nothing
    resident), ``model_transition`` (a load or unload is running), ``weights_torn`` (the served
    set is torn; ``/v1`` answers 503 ``WEIGHTS_TORN`` until a weights load). A quiesce or a
    commit does not make the server unready: it holds requests for milliseconds and serves them.
    During the SIGTERM grace this route is ``503 SHUTTING_DOWN``, as every route but liveness.
    """
    app = request.app
    host = app[keys.HOST]
    resident = host.describe()
    if host.transition:
        raise ApiError(
            codes.NOT_READY,
            f"a model {'unload' if host.transition == 'unload' else 'load'} is running; "
            "ready once it ends",
            reason="model_transition",
        )
    if resident is None:
        raise ApiError(
            codes.NOT_READY,
            "no model is resident: load one (POST /api/models/{id}/load) or set DEFAULT_MODEL",
            reason="no_model",
        )
    summary = weights_summary(app) or {}
    if summary.get("weights_state") == "torn":
        raise ApiError(
            codes.NOT_READY,
            "the served weights are torn (a commit did not complete): recover with "
            "POST /api/weights/load (docs/operations.md)",
            reason="weights_torn",
        )
    return ok({"status": "ready", "served_name": resident["served_name"]})


def weights_summary(app: web.Application) -> dict[str, Any] | None:
    """The ``weights`` block of ``/api/health/detailed`` (weights page: Status, last paragraph):
    ``{weights_state, barrier, attached, attachment_state}`` from ``app[keys.WEIGHTS_SUMMARY]``
    (set by the weights lifecycle), ``{"error": ...}`` when it could not be read, None before
    the lifecycle is wired in."""
    provider = app.get(keys.WEIGHTS_SUMMARY)
    if provider is None:
        return None
    try:
        return provider()
    except Exception as exc:  # noqa: BLE001 - reported, never a 500 on a health route
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def _not_attachable(app: web.Application) -> dict[str, Any] | None:
    """Why the resident cannot be attached, and what to do: ``{reason, message}``, the reason
    and message attach would answer (400 NOT_ATTACHABLE), or None when it cannot be read."""
    from miserver.fsm.machine import refusal_message

    runtime = app.get(keys.WEIGHTS)
    try:
        reason = runtime.not_attachable_reason() if runtime is not None else None
    except Exception:  # noqa: BLE001 - reported as unknown, never a 500 on a health route
        reason = None
    if reason is None:
        return None
    return {"reason": reason, "message": refusal_message("NOT_ATTACHABLE", reason)}


def kv_cache_summary(resident: Any) -> dict[str, Any] | None:
    """The ``kv_cache`` block of ``/api/health/detailed`` (issue 29): the resident's paged KV
    cache, ``{bytes, blocks_total, blocks_free, block_size, running, waiting, peak_batch}``
    (``bytes``: ``KV_CACHE_BYTES`` rounded down to whole blocks; ``peak_batch``: the most
    sequences one step computed; ``step_times``: ``{graph: {steps, ms}, eager: {steps, ms},
    slowest_ms}``, where the engine's time went), and on CUDA with graphs ``decode_graphs`` ``{mode, captured:
    [[rows, width in blocks], ...], failed, replays, bytes}``, and on a CPU resident
    ``matmul_threads`` ``{threads, fallback, chosen: {rows: count in use}, switches}`` (the linear
    products' thread count each size of pass uses now, ``CPU_MATMUL_THREADS``); None with
    nothing resident or no engine."""
    loop = getattr(resident, "engine_loop", None) if resident is not None else None
    if loop is None or loop.closed:
        return None
    try:
        stats = loop.stats()
    except Exception as exc:  # noqa: BLE001 - reported, never a 500 on a health route
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {
        "bytes": stats.get("cache_bytes"),
        "blocks_total": stats.get("blocks_total"),
        "blocks_free": stats.get("blocks_free"),
        "block_size": stats.get("block_size"),
        "running": stats.get("running"),
        "waiting": stats.get("waiting"),
        "peak_batch": stats.get("peak_batch"),
        "step_times": stats.get("step_times"),
        **({"decode_graphs": stats["decode_graphs"]} if "decode_graphs" in stats else {}),
        **({"matmul_threads": stats["matmul_threads"]} if "matmul_threads" in stats else {}),
    }


async def health_detailed(request: web.Request) -> web.Response:
    """``GET /api/health/detailed``: resident model, device, queue, weights summary. A resident
    that cannot be attached says why (``resident.not_attachable: {reason, message}``).
    ``warnings``: what the operator should know about the configuration, one line each (empty
    when none): a trainer token with ``MAX_CONCURRENT_REQUESTS`` above 1, the barrier off
    (:meth:`~miserver.spec.settings.Settings.training_warning`, issue 32 item 5)."""
    app = request.app
    host = app[keys.HOST]
    scheduler = app[keys.SCHEDULER]
    counts = scheduler.counts()
    resident = host.describe()
    if resident is not None and not resident["attachable"]:
        resident["not_attachable"] = _not_attachable(app)
    return ok(
        {
            "status": "ok",
            "resident": resident,
            "transition": host.transition,
            "device": app[keys.SETTINGS].resolved_device(),
            "queue": {
                "running": counts.running,
                "queued": counts.queued,
                "held_requests": counts.held_interactive,
                "held_batch_chunks": counts.held_batch,
                "max_concurrent_requests": scheduler.max_concurrent,
                "max_queued_requests": scheduler.max_queued,
            },
            "weights": weights_summary(app),
            "warnings": [
                w for w in (app[keys.SETTINGS].training_warning(scheduler.max_concurrent),) if w
            ],
            "kv_cache": kv_cache_summary(host.resident),
        }
    )


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format (contract 9)."""
    m = request.app[keys.METRICS]
    counts = request.app[keys.SCHEDULER].counts()
    m.queue_depth.set(counts.queued + counts.held_interactive)
    body, content_type = m.render()
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = content_type
    return resp


def setup_routes(app: web.Application) -> None:
    """Register the Management API, health and ``/metrics`` on ``app``."""
    r = app.router
    r.add_get("/api/models", list_models)
    r.add_post("/api/models", register_model)
    r.add_get("/api/models/{id}", get_model)
    r.add_delete("/api/models/{id}", delete_model)
    r.add_post("/api/models/{id}/load", load_model)
    r.add_post("/api/models/{id}/unload", unload_model)
    r.add_get("/api/settings", get_settings)
    r.add_patch("/api/settings", patch_settings)
    r.add_get("/api/health", health)
    r.add_get("/api/health/detailed", health_detailed)
    r.add_get("/api/health/ready", health_ready)
    r.add_get("/metrics", metrics)
