"""The work a save, a weights load and an adapter change do once their pause holds the barrier.

Contract sections 5 (checkpoints) and 6 (adapters). The lifecycle table decides whether a pause
may start and what follows; :class:`~miserver.serving.weights.runtime.WeightsRuntime` runs these
jobs when the table's ``BEGIN_SAVE`` / ``BEGIN_WEIGHTS_LOAD`` / ``BEGIN_ADAPTER_CHANGE`` effect
fires, and reports their end as ``*_done`` / ``*_failed`` events. Everything a client can get
wrong (an unknown checkpoint, a corrupt manifest, a bad adapter folder, a name taken) is checked
by the ``prepare_*`` functions *before* the event, so a refusal changes nothing.

The blocking work runs in a worker thread through
:func:`~miserver.serving.models.host.run_without_keeping`, never a bare ``asyncio.to_thread``: its
futures would keep a result that holds the model (an applied adapter, the unwrapped model) alive
for the rest of the awaiting step, and a failure's frames hold the model for as long as the
runtime keeps the error (it is the answer). A job's failure leaves with its finished frames
cleared, so an unload or swap after it frees the model at once (on a GPU: returns the memory).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from miserver.fsm.context import served_after_removal
from miserver.serving.models import adapters, checkpoints
from miserver.serving.models.catalogue import CHECKPOINTS_DIR
from miserver.serving.models.host import clear_traceback_frames, run_without_keeping
from miserver.spec import codes
from miserver.spec.errors import ApiError

log = logging.getLogger("miserver.weights.jobs")


def _base_row(catalogue: Any, row: Any) -> Any:
    """Follow ``parent_id`` from ``row`` to its base row (origin ``model``)."""
    seen: set[int] = set()
    current = row
    while (
        current.origin == "checkpoint" and current.parent_id is not None and current.id not in seen
    ):
        seen.add(current.id)
        parent = catalogue.get(current.parent_id)
        if parent is None:
            break
        current = parent
    return current


def _loaded_parent(catalogue: Any, loaded: Any, base: Any) -> tuple[Any, str | None]:
    """A save's parent (contract 5; issue 32, item 1): the row the resident weights were
    loaded from when it is a checkpoint still in the catalogue (an in-place load or a reload of
    checkpoint A: a save B after it is ``A + steps``, lineage ``[B, A, base]``), else the base
    row. Returns ``(parent row, parent checkpoint sha256 or None)``; the sha256 is the
    manifest's ``parent_checkpoint_sha256`` (the loaded checkpoint's, also when its row was
    deleted since: the row's ``parent_id`` then falls back to the base row)."""
    if loaded.origin != "checkpoint":
        return base, None
    row = catalogue.get(loaded.id)
    return (row if row is not None else base), loaded.checkpoint_sha256


def _manifest_parent(catalogue: Any, manifest: Any) -> Any:
    """The catalogue row a checkpoint's manifest names as its parent: the row holding
    ``parent_checkpoint_sha256`` when one does, else the base row (``base.row_id``), else None."""
    sha = manifest.parent_checkpoint_sha256
    if sha is not None:
        for row in catalogue.list():
            if row.origin == "checkpoint" and row.checkpoint_sha256 == sha:
                return row
    return catalogue.get(manifest.base.row_id)


def lineage(catalogue: Any, row: Any) -> list[dict[str, Any]]:
    """The chain from ``row`` back to its base row (contract 5: GET /api/weights/lineage)."""
    chain: list[dict[str, Any]] = []
    seen: set[int] = set()
    current = row
    while current is not None and current.id not in seen:
        seen.add(current.id)
        chain.append(lineage_entry(current))
        current = catalogue.get(current.parent_id) if current.parent_id is not None else None
    return chain


def lineage_entry(row: Any) -> dict[str, Any]:
    steps = None
    if row.origin == "checkpoint" and row.path:
        try:
            steps = checkpoints.open_checkpoint(row.path).manifest.steps_since_load
        except (checkpoints.CheckpointError, OSError, AttributeError):
            steps = None
    return {
        "model_id": row.id,
        "name": row.name,
        "origin": row.origin,
        "parent_id": row.parent_id,
        "checkpoint_sha256": row.checkpoint_sha256,
        "steps_since_load": steps,
        "created_at": row.created_at,
    }


@dataclass
class LoadPlan:
    """A checked ``POST /api/weights/load``: the row and whether it is written in place."""

    row: Any
    handle: checkpoints.CheckpointHandle | None
    in_place: bool


def prepare_load(host: Any, body: Any) -> LoadPlan:
    """Resolve and check a weights load before the lifecycle sees it (contract 5).

    ``{"checkpoint": sha256|name|path}``: the checkpoint row, every tensor verified (400
    CHECKPOINT_CORRUPT before anything is written), in place when the layout matches the
    resident. ``{"model_id": N}``: a full reload of that row.

    Raises:
        ApiError: 404 CHECKPOINT_NOT_FOUND / MODEL_NOT_FOUND, 400 CHECKPOINT_CORRUPT. (A
            checkpoint onto a GGUF resident is the table's 400 GGUF_UNSUPPORTED: the route does
            not check it here.)
    """
    catalogue = host.catalogue
    if body.model_id is not None:
        row = catalogue.get(body.model_id)
        if row is None:
            raise ApiError(
                codes.MODEL_NOT_FOUND,
                f"no catalogue row with id {body.model_id}",
                details={"model_id": body.model_id},
            )
        from miserver.serving.models.loader import check_loadable

        check_loadable(row)
        return LoadPlan(row, None, False)
    rows = [r for r in catalogue.list() if r.origin == "checkpoint"]
    try:
        row = checkpoints.resolve_checkpoint(rows, body.checkpoint)
        handle = checkpoints.open_checkpoint(row.path)
        checkpoints.verify(handle)
    except checkpoints.CheckpointError as exc:
        raise exc.as_api_error() from None
    resident = host.resident
    in_place = resident is not None and checkpoints.layout_matches(resident.model, handle)
    return LoadPlan(row, handle, in_place)


def refuse_applied_adapter_name(host: Any, name: str, taker: str) -> None:
    """A catalogue row or a checkpoint may not take the applied adapter's served name: while
    applied, ``/v1`` requests naming it reach the adapter, not ``taker`` (contract 6). The
    reverse of :func:`prepare_adapter`'s refusal of a row's name.

    Raises:
        ApiError: 400 INVALID_REQUEST (field ``name``, ``details.adapter``).
    """
    if host.applied_adapter_name() != name:
        return
    raise ApiError(
        codes.INVALID_REQUEST,
        f"{name!r} is the served name of the applied adapter (GET /api/weights/adapter);"
        f" /v1 requests naming it reach the adapter, not {taker}: choose another name, or"
        " remove the adapter first (DELETE /api/weights/adapter)",
        param="name",
        details={"field": "name", "adapter": name},
    )


def prepare_save(host: Any, body: Any) -> None:
    """Refuse a save whose name is invalid or taken, before the pause (contract 5).

    A name is taken by a catalogue row, or by a folder ``MISERVER_HOME/checkpoints/<name>``
    that no row names (copied there by hand, or left by a miserver that kept a deleted
    checkpoint's folder): the 409 names the folder and says what to do. Deleting a checkpoint
    row removes its folder (:meth:`~miserver.serving.models.catalogue.Catalogue.delete`), so its name
    can be saved again.

    The applied adapter's served name is refused too (400): while applied, ``/v1`` requests
    naming it reach the adapter, not the checkpoint (the base weights; contract 6).

    Raises:
        ApiError: 400 INVALID_REQUEST (field ``name``), 409 CHECKPOINT_EXISTS. (On a GGUF
            resident the route does not check the name: the table refuses the save, 400
            GGUF_UNSUPPORTED.)
    """
    if body.name is None:
        return
    try:
        checkpoints.validate_name(body.name)
    except checkpoints.CheckpointError as exc:
        raise exc.as_api_error() from None
    refuse_applied_adapter_name(host, body.name, "this checkpoint (the base weights)")
    row = host.catalogue.get_by_name(body.name)
    if row is not None:
        raise ApiError(
            codes.CHECKPOINT_EXISTS,
            f"a catalogue row named {body.name!r} exists (id {row.id}); choose another name,"
            f" or delete that row first (DELETE /api/models/{row.id})",
            details={"name": body.name, "model_id": row.id},
        )
    folder = Path(host.catalogue.home) / CHECKPOINTS_DIR / body.name
    if folder.exists():
        raise ApiError(
            codes.CHECKPOINT_EXISTS,
            f"a folder named {body.name!r} exists in {str(folder.parent)!r} but no catalogue row"
            " names it; choose another name, or move or remove that folder",
            details={"name": body.name, "path": str(folder)},
        )


def prepare_adapter(host: Any, body: Any) -> None:
    """Refuse an adapter request a client got wrong, before the pause (contract 6), as
    :func:`prepare_save` refuses a save: the refusal changes nothing and holds nothing.

    Checked in this order: the served ``name`` (the checkpoint-name rule, and no catalogue row's
    name: while applied it is the served name, and ``/v1`` requests naming that row would reach
    the adapter), the ``path`` (absolute, as ``POST /api/models``), then, when a model is
    resident, the folder against it (:func:`~miserver.serving.models.adapters.inspect_adapter`: config,
    weights file, every tensor's module and shape, and ``target_modules`` matched as PEFT
    matches them).

    Raises:
        ApiError: 400 INVALID_REQUEST (field ``name``
            or ``path``), 400 ADAPTER_INVALID with
            reason ``not_found``, ``no_config``, ``not_lora``, ``unsafe_format`` or
            ``incompatible``.
    """
    try:
        adapters.validate_adapter_name(body.name)
        row = host.catalogue.get_by_name(body.name)
        if row is not None:
            raise ApiError(
                codes.INVALID_REQUEST,
                f"the adapter name {body.name!r} is the name of catalogue row {row.id}; while"
                " the adapter is applied it is the served name, so /v1 requests for that row"
                " would reach the adapter: choose another name",
                param="name",
                details={"field": "name", "model_id": row.id},
            )
        adapters.validate_adapter_path(body.path)
        resident = host.resident
        if resident is None:
            return  # the table answers MODEL_NOT_LOADED
        adapters.inspect_adapter(resident.model, body.path)
    except adapters.AdapterRequestError as exc:
        raise exc.as_api_error() from None


Job = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def _keeping_no_frames(job: Job) -> Job:
    """``job``, except that a failure leaves with the job's finished frames cleared: they hold
    the resident (the runtime keeps the error as the job's answer, past an unload)."""

    @functools.wraps(job)
    async def run(params: dict[str, Any]) -> dict[str, Any]:
        try:
            return await job(params)
        except BaseException as exc:
            clear_traceback_frames(exc)
            raise

    return run


class WeightsJobs:
    """Registers the save, weights-load and adapter jobs with a runtime.

    Args:
        runtime: the :class:`~miserver.serving.weights.runtime.WeightsRuntime`.
        home: ``MISERVER_HOME`` (checkpoints go to ``home/checkpoints``).
    """

    def __init__(self, runtime: Any, home: str) -> None:
        self.runtime = runtime
        self.host = runtime.host
        self.root = Path(home) / CHECKPOINTS_DIR
        self.applied: adapters.AppliedAdapter | None = None
        runtime.register_job("save", _keeping_no_frames(self.save))
        runtime.register_job("weights_load", _keeping_no_frames(self.weights_load))
        runtime.register_job("adapter", _keeping_no_frames(self.adapter))
        self.host.drop_hooks.append(self._forget_adapter)
        if self.root.exists():
            checkpoints.remove_partial_saves(self.root)
            self.register_unregistered()

    def register_unregistered(self) -> list[Any]:
        """Register every complete checkpoint folder under ``root`` that no catalogue row names
        (issue 16, item 3): a server killed between a save's rename and its catalogue row left
        it, and the save it finished is what the trainer expects to find. Each is opened and
        fully verified first (every file and tensor hash, :func:`checkpoints.verify`); its row
        is what the save would have registered (origin ``checkpoint``, as parent the row of the
        manifest's parent checkpoint, else its base row, when it still exists,
        ``checkpoint_sha256``). A folder that fails
        verification, or whose name another row holds, is left as it is and logged with what
        to do. Call at start-up only (no save runs then). Returns the rows registered.
        """
        catalogue = self.host.catalogue
        rows = catalogue.list()
        named = {str(Path(r.path).resolve()) for r in rows if r.path}
        registered = []
        for folder in sorted(self.root.iterdir()):
            if not folder.is_dir() or folder.name.startswith("."):
                continue
            if str(folder.resolve()) in named or not (folder / checkpoints.MANIFEST_NAME).is_file():
                continue
            try:
                handle = checkpoints.open_checkpoint(folder)
                checkpoints.verify(handle)
            except checkpoints.CheckpointError as exc:
                log.error(
                    "checkpoint folder %s is in no catalogue row and does not verify (%s); "
                    "it is left as it is: delete it to free its name",
                    folder,
                    exc,
                )
                continue
            manifest = handle.manifest
            if catalogue.get_by_name(folder.name) is not None:
                log.error(
                    "checkpoint folder %s is in no catalogue row, and its name is another row's;"
                    " it is left as it is: move it away and register it under another name",
                    folder,
                )
                continue
            parent = _manifest_parent(catalogue, manifest)
            try:
                row = catalogue.register(
                    name=folder.name,
                    format="safetensors",
                    dtype=checkpoints._weights_dtype(list(manifest.tensors)),
                    path=str(folder.resolve()),
                    origin="checkpoint",
                    parent_id=parent.id if parent is not None else None,
                    checkpoint_sha256=handle.checkpoint_sha256,
                )
            except Exception as exc:  # noqa: BLE001 - one folder must not stop the start
                log.error("could not register checkpoint folder %s: %s", folder, exc)
                continue
            log.warning(
                "registered checkpoint %s (%s, id %d): its save completed but the server "
                "stopped before registering it",
                row.name,
                handle.checkpoint_sha256[:12],
                row.id,
            )
            registered.append(row)
        return registered

    async def save(self, params: dict[str, Any]) -> dict[str, Any]:
        body = params["body"]
        resident = self.host.resident
        ctx = self.runtime.lifecycle.context
        steps = ctx.steps_since_load or 0
        catalogue = self.host.catalogue
        base = _base_row(catalogue, resident.row)
        parent, parent_sha = _loaded_parent(catalogue, resident.row, base)
        try:
            saved = await run_without_keeping(
                checkpoints.save_checkpoint,
                resident.model,
                resident.tokenizer,
                root=self.root,
                name=body.name,
                base_row_id=base.id,
                base_name=base.name,
                parent_sha256=parent_sha,
                parent_name=parent.name,
                steps_since_load=steps,
                now=time.time(),
            )
        except checkpoints.CheckpointError as exc:
            raise exc.as_api_error() from None
        try:
            row = catalogue.register(
                name=saved.name,
                format="safetensors",
                dtype=saved.dtype,
                path=str(saved.path),
                origin="checkpoint",
                parent_id=parent.id,
                checkpoint_sha256=saved.checkpoint_sha256,
            )
        except Exception:
            import shutil

            shutil.rmtree(saved.path, ignore_errors=True)  # no unregistered checkpoint left
            raise
        self.runtime.last_save = {
            "checkpoint_sha256": saved.checkpoint_sha256,
            "at": saved.saved_at,
            "path": str(saved.path),
        }
        if self.applied is not None:
            # Contract 6: the adapter still computes, so it keeps the served name; the
            # checkpoint holds the base tensors only, and is the name restored when the adapter
            # is removed (the lifecycle records it: Context.before_adapter, at save_done).
            resident.base_served_name = saved.name
        response = {
            "checkpoint_sha256": saved.checkpoint_sha256,
            "name": saved.name,
            "path": str(saved.path),
            "model_id": row.id,
            "parent_id": row.parent_id,
            "steps_since_load": steps,
            "at": saved.saved_at,
        }
        return {"served_name": saved.name, "response": response}

    async def weights_load(self, params: dict[str, Any]) -> dict[str, Any]:
        """Load the plan's checkpoint or row inside the pause (contract 5).

        Everything is read and checked again here, *before* the set is marked ``writing``: the
        manifest (still the one :func:`prepare_load` checked), every file it lists (config,
        tokenizer) and every tensor; an in-place load keeps the verified tensors in memory and
        writes from them. So a checkpoint changed or removed since the request was checked is
        ``400 CHECKPOINT_CORRUPT`` / ``404 CHECKPOINT_NOT_FOUND`` with nothing written and the
        weights still clean, never a torn set.
        """
        plan: LoadPlan = params["plan"]
        mark_writing = params["mark_writing"]
        if plan.in_place:
            resident = self.host.resident  # not before a reload: it would keep the old model
            try:
                tensors = await run_without_keeping(_read_for_load, resident.model, plan.handle)
            except checkpoints.CheckpointError as exc:
                raise exc.as_api_error() from None
            await mark_writing()
            try:
                await run_without_keeping(
                    _write_in_place_without_adapter,
                    model=resident.model,
                    handle=plan.handle,
                    tensors=tensors,
                    applied=self.applied,
                )
            except checkpoints.CheckpointError as exc:
                raise exc.as_api_error() from None
            finally:
                del tensors
            resident.row = msgspec.structs.replace(plan.row, resident=True)
            resident.loaded_at = time.time()  # a load: the weights are the checkpoint's now
            self.host.catalogue.set_resident(plan.row.id)
        else:
            if plan.handle is not None:
                try:
                    await run_without_keeping(_verify_for_reload, plan.handle)
                except checkpoints.CheckpointError as exc:
                    raise exc.as_api_error() from None
            await mark_writing()
            replaced = self.host.resident
            if replaced is not None:  # held requests go on on the reloaded model (issue 32)
                self.runtime.admission.note_reloaded(replaced)
            del replaced
            await self.host.load(plan.row.id, reload=True)
        resident = self.host.resident
        self.applied = None  # a load replaces the adapted model (in place: removed first)
        resident.adapter_block = None
        resident.base_served_name = None
        return {
            "served_name": plan.row.name,
            "origin": "checkpoint" if plan.row.origin == "checkpoint" else "model",
            "response": {"in_place": plan.in_place},
        }

    def _forget_adapter(self, _dropped: Any) -> None:
        """The model host dropped the resident (unload, swap): its adapter went with it, and
        the applied adapter must not keep the dropped model alive (the lifecycle's unload or
        load forgets what was served before it)."""
        self.applied = None

    async def adapter(self, params: dict[str, Any]) -> dict[str, Any]:
        """Apply or remove the adapter inside the pause (contract 6).

        The result names what ``X-miLLM-Model`` says afterwards (weights page: Which weights
        answered), which the lifecycle sets at ``adapter_done``: the adapter's name with origin
        ``adapter`` and commits from 0 when applied (the lifecycle records what was served
        before it, ``Context.before_adapter``); after a removal, the name and origin that
        record holds with its commits and those made while the adapter was applied
        (:func:`~miserver.fsm.context.served_after_removal`); a removal with no adapter
        applied changes nothing.
        """
        body = params["body"]
        resident = self.host.resident
        ctx = self.runtime.lifecycle.context
        try:
            if params["apply"]:
                before = ctx.before_adapter if self.applied is not None else None
                self.applied = await run_without_keeping(
                    adapters.apply_adapter,
                    resident.model,
                    name=body.name,
                    path=body.path,
                    now=time.time(),
                    replacing=self.applied,
                )
                resident.adapter_block = self.applied.block()
                resident.base_served_name = (
                    before.served_name
                    if before is not None
                    else ctx.served_name or resident.served_name
                )
                return {"served_name": body.name, "applied": True}
            if self.applied is None:  # a no-op: the served name, origin and count stay
                return _served(
                    ctx.served_name or resident.served_name,
                    ctx.served_origin,
                    ctx.commits_since_name,
                )
            resident.model = await run_without_keeping(
                adapters.remove_adapter, resident.model, self.applied
            )
        except adapters.AdapterRequestError as exc:  # prepare_adapter checked; PEFT may differ
            raise exc.as_api_error() from None
        self.applied = None
        resident.adapter_block = None
        resident.base_served_name = None
        return _served(*served_after_removal(ctx, resident.base_name))


def _served(name: str | None, origin: str | None, commits: int | None) -> dict[str, Any]:
    """An adapter removal's result: the served name, origin and commit count to restore."""
    return {
        "served_name": name,
        "applied": False,
        "origin": origin if origin in ("model", "checkpoint") else None,
        "commits": commits,
    }


def _read_for_load(model: Any, handle: checkpoints.CheckpointHandle) -> dict[str, Any]:
    """The checked checkpoint's tensors, read again and verified (nothing written)."""
    return checkpoints.read_for_load(model, checkpoints.reopen(handle))


def _verify_for_reload(handle: checkpoints.CheckpointHandle) -> None:
    checkpoints.verify_for_reload(checkpoints.reopen(handle))


def _write_in_place_without_adapter(
    *, model: Any, handle: checkpoints.CheckpointHandle, tensors: Any, applied: Any
) -> None:
    """Write the verified ``tensors`` into ``model``'s base tensors (through any LoRA layers),
    then remove the applied adapter (if any), so that the set served afterwards is exactly the
    checkpoint (a load replaces the adapted model; contract 5 and 6). Reads no file: the
    checkpoint was read and verified before the set was marked ``writing``."""
    checkpoints.write_in_place(model, handle, tensors)
    if applied is not None:
        adapters.remove_adapter(model, applied)
