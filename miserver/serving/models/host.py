"""The model host: which catalogue row is resident, and loads, unloads, swaps and auto-loads.

One model is resident at a time. A load of another row is a swap: the previous model is dropped
and its memory freed (``gc`` + ``torch.cuda.empty_cache``) before the new one is read, so a card
never needs room for two. Loads and unloads are serialised: while one runs, a second is refused
with 409 MODEL_BUSY (reason ``model_transition``; contract 3). The blocking part of a load runs in
a worker thread, so the event loop keeps answering (``/api/health``, ``/api/weights/status``).
The runtime calls the host only once the generations running on the resident have finished
(the scheduler's drain, :meth:`miserver.serving.weights.runtime.EffectPerformer._run_transition`),
so no generation runs on a model being dropped.

The weights lifecycle's refusals of a load, unload or auto-load (attached: 409 ALREADY_ATTACHED,
torn: 503 WEIGHTS_TORN, unsaved commits: 409 WEIGHTS_UNSAVED, a transition in progress) are
decided by the lifecycle table before the host is called
(:meth:`miserver.serving.weights.runtime.WeightsRuntime.model_transition` and ``admit_v1``).
:meth:`ModelHost._check_transition` keeps what is the host's own: ``X-miLLM-Load-Policy: refuse``
for an auto-load, and a last 409 MODEL_BUSY should a caller reach the host while a transition
runs without going through the table (tests, and the runtime's race between admission and a
slot).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

import msgspec
import torch

from miserver.serving.metrics import Metrics
from miserver.serving.models import loader as loader_module
from miserver.serving.models.catalogue import Catalogue, CatalogueRow
from miserver.serving.models.loader import LoadedModel
from miserver.spec import codes
from miserver.spec.errors import ApiError
from miserver.spec.settings import Settings

log = logging.getLogger("miserver.host")

TransitionKind = Literal["load", "unload", "auto_load"]
LOAD_POLICIES = ("auto", "refuse")
T = TypeVar("T")


def normalize_load_policy(value: str | None) -> str:
    """``X-miLLM-Load-Policy``: absent or ``auto`` (case-insensitive) is ``auto``; ``refuse``.

    Raises:
        ApiError: 400 INVALID_REQUEST for any other value (contract 4).
    """
    policy = (value or "").strip().lower() or "auto"
    if policy not in LOAD_POLICIES:
        raise ApiError(
            codes.INVALID_REQUEST,
            f"X-miLLM-Load-Policy must be auto or refuse, got {value[:64]!r}",
            param="X-miLLM-Load-Policy",
        )
    return policy


@dataclass
class Resident:
    """The resident model.

    Attributes:
        row: its catalogue row.
        model: the ``torch.nn.Module`` (eval mode) on ``device``.
        tokenizer: its transformers tokenizer (with the chat template).
        device: where its parameters live.
        base_name: the catalogue name of the base model (a checkpoint's root model row).
        served_name: the name ``X-miLLM-Model`` and ``/v1/models`` report; a save or an adapter
            changes it (weights page: Which weights answered).
        base_served_name: while an adapter is applied, the name the base tensors are served
            under once it is removed (the served name before it, or the checkpoint a save made
            while it was applied); None otherwise. A ``/v1`` request naming it is served by the
            resident (contract 5), whose header names the adapter (contract 6).
        origin: ``model``, ``checkpoint`` or ``adapter``.
        commits: commit-ends since ``served_name`` was set; None when not known.
        attachable: whether the load placed the parameters in one shared allocation.
        loaded_at: ``time.time()`` when the load finished.
    """

    row: CatalogueRow
    model: torch.nn.Module
    tokenizer: Any
    device: torch.device
    base_name: str
    served_name: str
    origin: Literal["model", "checkpoint", "adapter"]
    commits: int | None
    attachable: bool
    loaded_at: float = 0.0
    arena: Any = None  # the miserver.ipc ParameterArena of an attachable load
    adapter_block: dict[str, Any] | None = None  # contract 6, while an adapter is applied
    base_served_name: str | None = None
    #: The continuous engine's thread (:class:`~miserver.serving.engine.engine_loop.EngineLoop`)
    #: that runs every forward pass of requests on a transformers resident (its CUDA decode
    #: graphs included); None on a GGUF resident (llama.cpp decodes).
    engine_loop: Any = None

    @property
    def kind(self) -> Literal["transformers", "gguf"]:
        """``gguf`` for a GGUF row served through llama.cpp (contract 4a), else
        ``transformers``."""
        return "gguf" if self.row.format == "gguf" else "transformers"

    def names(self) -> tuple[str, ...]:
        """The names a request may use for this model: served name and base name, and while an
        adapter is applied the name of the base tensors (``base_served_name``)."""
        if self.base_served_name is None:
            return (self.served_name, self.base_name)
        return (self.served_name, self.base_name, self.base_served_name)


def clear_traceback_frames(exc: BaseException | None) -> None:
    """Clear the local variables of every finished frame in ``exc``'s tracebacks, following
    ``__cause__`` and ``__context__``: a failed load's frames hold the half-built model (on the
    card), and the exception outlives the load (it becomes the HTTP answer)."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)  # a frame still running is skipped
        stack += (current.__cause__, current.__context__)


async def run_without_keeping(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``await asyncio.to_thread(fn, *args, **kwargs)``, except that no future keeps the result.

    ``asyncio.to_thread`` stores the result in a ``concurrent.futures.Future`` and an asyncio
    future that reference each other; the wake-up handle of the awaiting task holds the latter
    for the rest of that step, and the pair lives on until a garbage collection. For a load the
    result is the model: an unload or a swap in the same step then freed nothing (the CUDA
    unload test kept one model, 269 MB, allocated). Here the thread hands the result over in a
    box the futures never see, and a failure's frames are cleared before it leaves the thread.
    The thread takes ``fn`` and its arguments out of a second box: a failure's traceback keeps
    the thread's function (a frame holds its function, whose closure clearing cannot empty), so
    that function must not hold the arguments (a model, an adapter).
    """
    box: list[T] = []
    work = [functools.partial(fn, *args, **kwargs)]

    def call() -> None:
        try:
            box.append(work.pop()())
        except BaseException as exc:
            clear_traceback_frames(exc)
            raise

    await asyncio.to_thread(call)
    return box.pop()


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim(0)``, every
    arena). A dropped model's KV cache and weights are freed into the arenas of the threads
    that held them, and glibc keeps them there: a trial saw a CPU server's RSS rise from 2.1 to
    5.3 GB over 9 swaps between two models, 58 arena heaps of about 52 MB each, and fall to
    1.9 GB when trimmed. Returns False where the C library has no ``malloc_trim`` (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def free_memory(*, nothing_resident: bool = False) -> None:
    """Collect garbage and return cached CUDA blocks to the driver. With ``nothing_resident``
    (after a model is dropped: no engine, no captured graph, no forward pass in flight) also
    cuBLAS's per-stream workspaces (32 MiB each on an H200, allocator memory that
    ``empty_cache`` keeps; the next matmul makes its stream's again), so an unload gives the
    card back what the load took."""
    gc.collect()
    trim_heap()
    if torch.cuda.is_available():
        if nothing_resident:
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
        torch.cuda.empty_cache()


class ModelHost:
    """Holds at most one resident model of one catalogue.

    Args:
        settings: the server's settings (device, tokens for attachable loads).
        catalogue: the catalogue rows are loaded from; its ``resident`` view is kept in step.
        metrics: optional; loads and unloads are counted there.
        loader: the blocking load function (default :func:`miserver.serving.models.loader.load_model`).
        preflight: the blocking check of a row before anything is unloaded (default: with the
            default loader :func:`miserver.serving.models.loader.preflight`, with another loader
            :func:`miserver.serving.models.loader.check_loadable`).
    """

    def __init__(
        self,
        settings: Settings,
        catalogue: Catalogue,
        *,
        metrics: Metrics | None = None,
        loader: Callable[[CatalogueRow, Settings], LoadedModel] | None = None,
        preflight: Callable[[CatalogueRow], None] | None = None,
    ) -> None:
        self.settings = settings
        self.catalogue = catalogue
        self.metrics = metrics
        self._loader = loader or loader_module.load_model
        if preflight is None:
            preflight = loader_module.preflight if loader is None else loader_module.check_loadable
        self._preflight = preflight
        self._lock = asyncio.Lock()
        self._busy: TransitionKind | None = None
        self._replacing: tuple[int, tuple[str, ...]] | None = None
        self.resident: Resident | None = None
        #: Called with the resident being dropped (unload, swap, reload, shutdown) before its
        #: memory is freed: a part that keeps state about the served model (an applied adapter
        #: holds the model) forgets it here, or the unload frees nothing.
        self.drop_hooks: list[Callable[[Resident], None]] = []
        #: The server's scheduler (set by the app): counts the engine's waiting requests.
        self.scheduler: Any = None
        catalogue.set_resident(None)

    # --- state ---------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether a load or unload is in progress."""
        return self._busy is not None

    @property
    def transition(self) -> TransitionKind | None:
        """The kind of transition in progress (``load``, ``unload``, ``auto_load``) or None."""
        return self._busy

    def resolve(self, name: str) -> CatalogueRow | None:
        """The catalogue row called ``name``, or None."""
        return self.catalogue.get_by_name(name)

    def resolve_or_not_found(self, name: str) -> CatalogueRow:
        """The catalogue row called ``name`` (a ``/v1`` request's ``model``).

        Raises:
            ApiError: 404 MODEL_NOT_FOUND naming the catalogue's rows (contract 4).
        """
        row = self.resolve(name)
        if row is None:
            raise ApiError(
                codes.MODEL_NOT_FOUND,
                f"model {name!r} is neither resident nor in the catalogue",
                details={"model": name, "available": [r.name for r in self.catalogue.list()]},
                param="model",
            )
        return row

    def serves(self, name: str) -> bool:
        """Whether the resident answers to ``name`` (its served name or its base name)."""
        return self.resident is not None and name in self.resident.names()

    def applied_adapter_name(self) -> str | None:
        """The served name of the adapter applied to the resident, or None (contract 6)."""
        block = self.resident.adapter_block if self.resident is not None else None
        return block.get("name") if block else None

    @property
    def replacing_row_id(self) -> int | None:
        """The catalogue row id of the model a running swap or unload is replacing (already
        dropped from memory), or None."""
        return self._replacing[0] if self._replacing is not None else None

    def answers_to(self, name: str) -> bool:
        """Whether ``name`` names the resident as the weights lifecycle counts it: the resident's
        served or base name, or, while a swap or unload runs, the served or base name of the
        model it is replacing. The host drops that model before the new one is read, but the
        lifecycle counts it resident until the transition ends, so a ``/v1`` request naming it
        is a request for the resident during a transition (409 MODEL_BUSY, contract 4), not an
        auto-load of another model (weights page: Unsaved commits and the auto-load)."""
        if self.serves(name):
            return True
        return self._replacing is not None and name in self._replacing[1]

    # --- the one refusal decision ---------------------------------------------------------------
    def _check_transition(
        self, kind: TransitionKind, row: CatalogueRow | None, *, load_policy: str | None = None
    ) -> None:
        """Refuse a load, unload or auto-load, or return to let it run. Changes nothing.

        Order: ``X-miLLM-Load-Policy: refuse`` first (weights page: Unsaved commits), then a
        transition already in progress (409 MODEL_BUSY, reason ``model_transition``; contract
        3). The lifecycle's refusals come from the table, before the host is called.

        Raises:
            ApiError: the refusal.
        """
        if kind == "auto_load" and normalize_load_policy(load_policy) == "refuse":
            assert row is not None
            resident = self.resident.served_name if self.resident else None
            raise ApiError(
                codes.MODEL_NOT_LOADED,
                f"model {row.name!r} is not resident and X-miLLM-Load-Policy is refuse"
                + (f" (resident: {resident!r})" if resident else " (nothing is resident)")
                + f"; load it with POST /api/models/{row.id}/load or drop the header",
                status=409,
                details={"model": row.name, "model_id": row.id, "resident": resident},
                param="model",
            )
        if self._busy is not None:
            raise ApiError(
                codes.MODEL_BUSY,
                f"a model {self._busy.replace('_', '-')} is in progress; retry when it finishes",
                reason="model_transition",
                details={"transition": self._busy},
                headers={"Retry-After": "1"},
            )

    # --- transitions ----------------------------------------------------------------------------
    async def check_before_load(self, row_id: int) -> None:
        """Check catalogue row ``row_id``'s files before a load of it is decided, while the
        resident still serves (breaker finding F16): config, tokenizer, safetensors headers,
        shapes (:func:`miserver.serving.models.loader.preflight`), in a worker thread.

        Raises:
            ApiError: 404 MODEL_NOT_FOUND, 400 BACKEND_UNAVAILABLE, 400 MODEL_LOAD_FAILED (the
                folder or GGUF file is not loadable; nothing changed).
        """
        row = self._row_or_404(row_id)
        await asyncio.to_thread(self._preflight, row)

    def _row_or_404(self, row_id: int) -> CatalogueRow:
        row = self.catalogue.get(row_id)
        if row is None:
            raise ApiError(
                codes.MODEL_NOT_FOUND,
                f"no catalogue row with id {row_id}",
                details={"model_id": row_id},
            )
        return row

    def _base_name(self, row: CatalogueRow) -> str:
        seen: set[int] = set()
        current = row
        while current.origin == "checkpoint" and current.parent_id is not None:
            if current.id in seen:
                break
            seen.add(current.id)
            parent = self.catalogue.get(current.parent_id)
            if parent is None:
                break
            current = parent
        return current.name

    async def load(
        self,
        row_id: int,
        *,
        kind: TransitionKind = "load",
        load_policy: str | None = None,
        reload: bool = False,
    ) -> Resident:
        """Make catalogue row ``row_id`` resident (a swap if another is; contract 3).

        Loading the resident row is a no-op that returns the resident unchanged, unless
        ``reload`` (a weights load of ``{"model_id": N}``, contract 5, run inside the barrier).

        A swap whose load fails after the previous model was dropped (memory does not hold
        both) loads the previous row back from its files (breaker finding F16), unless
        ``reload`` (a weights load: its failure tears the set, contract 5): the error then says
        so and the log has a warning; that model is resident afresh (its commits since it was
        loaded and its adapter are not restored). :attr:`resident` tells the caller which
        happened: the same object (nothing was dropped), another one (loaded back), None.

        Raises:
            ApiError: 404 MODEL_NOT_FOUND (no such row), 400 BACKEND_UNAVAILABLE (a gguf row
                without the llama.cpp binding),
                409 MODEL_BUSY (a transition runs), a lifecycle refusal, 500 MODEL_LOAD_FAILED
                (the files could not be loaded; ``details.restored`` names the previous row
                when it was loaded back, else nothing is resident afterwards).
        """
        row = self._row_or_404(row_id)
        self._check_transition(kind, row, load_policy=load_policy)
        if self.resident is not None and self.resident.row.id == row.id and not reload:
            return self.resident
        loader_module.check_loadable(row)  # refuse before the resident is dropped
        self._busy = kind
        try:
            async with self._lock:
                previous_row = self.resident.row if self.resident else None
                previous = previous_row.name if previous_row else None
                self._note_replacing()
                self._drop_resident()
                log.info(
                    "loading model %s (id %s)%s",
                    row.name,
                    row.id,
                    f", replacing {previous}" if previous else "",
                )
                started = time.perf_counter()
                try:
                    await self._load_resident(row)
                except BaseException as exc:
                    if self.metrics:
                        self.metrics.model_loads.labels(outcome="failed").inc()
                    free_memory(nothing_resident=self.resident is None)
                    if reload or previous_row is None or not isinstance(exc, Exception):
                        raise
                    raise await self._load_back(previous_row, row, exc) from exc
                elapsed = time.perf_counter() - started
                if self.metrics:
                    self.metrics.model_loads.labels(outcome="ok").inc()
                    self.metrics.model_load_seconds.observe(elapsed)
                log.info(
                    "model %s resident on %s in %.1f s (attachable: %s)",
                    row.name,
                    self.resident.device,
                    elapsed,
                    self.resident.attachable,
                )
                return self.resident
        finally:
            self._busy = None
            self._replacing = None

    async def _load_resident(self, row: CatalogueRow) -> Resident:
        """Read ``row`` (worker threads), build its continuous engine, make it :attr:`resident`.

        Raises:
            EngineUnavailable: the continuous engine cannot hold the model (the load fails;
                :func:`~miserver.serving.engine.engine_setup.build`).
        """
        loaded = await run_without_keeping(self._loader, row, self.settings)
        engine_loop = None
        if row.format != "gguf":  # a GGUF resident: llama.cpp decodes (contract 4a)
            engine_loop = await run_without_keeping(
                self._build_engine_loop, loaded.model, loaded.tokenizer, row.name
            )
        origin = "checkpoint" if row.origin == "checkpoint" else "model"
        self.resident = Resident(
            row=msgspec.structs.replace(row, resident=True),
            model=loaded.model,
            tokenizer=loaded.tokenizer,
            device=loaded.device,
            base_name=self._base_name(row),
            served_name=row.name,
            origin=origin,
            commits=0,
            attachable=loaded.attachable,
            loaded_at=time.time(),
            arena=getattr(loaded, "arena", None),
            engine_loop=engine_loop,
        )
        del loaded, engine_loop
        self.catalogue.set_resident(row.id)
        if self.metrics:
            self.metrics.set_resident(row.name)
        return self.resident

    async def _load_back(
        self, previous: CatalogueRow, failed: CatalogueRow, exc: Exception
    ) -> ApiError:
        """After the load of ``failed`` raised ``exc`` with ``previous`` already dropped: load
        ``previous`` back (breaker finding F16). Returns the error to raise, which says whether
        it is resident again (``details.restored``) or nothing is."""
        if isinstance(exc, ApiError):
            base = exc
        else:
            base = ApiError(
                codes.MODEL_LOAD_FAILED,
                f"catalogue row {failed.name!r} could not be loaded: {type(exc).__name__}: "
                f"{str(exc)[:500]}",
                details={"model_id": failed.id, "name": failed.name},
            )
        clear_traceback_frames(exc)
        row = self.catalogue.get(previous.id) or previous
        log.warning(
            "loading model %s failed; loading the previous model %s (id %s) back",
            failed.name,
            row.name,
            row.id,
        )
        try:
            await self._load_resident(row)
        except Exception as again:  # noqa: BLE001 - reported in the error and the log
            clear_traceback_frames(again)
            free_memory(nothing_resident=self.resident is None)
            log.error(
                "loading the previous model %s back failed too: nothing is resident (%s: %s)",
                row.name,
                type(again).__name__,
                str(again)[:300],
            )
            suffix = (
                f"; loading the previous model {row.name!r} back failed too "
                f"({type(again).__name__}), so nothing is resident: load a row "
                "(POST /api/models/{id}/load)"
            )
            restored = None
        else:
            log.warning(
                "model %s is resident again after the failed load of %s (its commits since "
                "its load and its adapter, if any, were not restored)",
                row.name,
                failed.name,
            )
            suffix = (
                f"; the previous model {row.name!r} was loaded back from its files and serves "
                "(commits since its load and an applied adapter, if any, are not restored)"
            )
            restored = row.name
        return ApiError(
            base.code,
            base.message.rstrip(".") + suffix,
            reason=base.reason,
            details={**(base.details or {}), "restored": restored},
            status=base.status,
            param=base.param,
            headers=base.headers,
        )

    def _build_engine_loop(self, model: torch.nn.Module, tokenizer: Any, name: str) -> Any:
        """The continuous engine's thread for a freshly loaded model
        (:func:`~miserver.serving.engine.engine_setup.build`; raises ``EngineUnavailable``)."""
        from miserver.serving.engine.engine_setup import build

        return build(model, tokenizer, name, self.settings, self.scheduler, self.metrics)

    def _note_replacing(self) -> None:
        """Remember the resident's row id and names (not the model) for :meth:`answers_to`."""
        if self.resident is not None:
            self._replacing = (self.resident.row.id, self.resident.names())

    def _drop_resident(self, *, drained: bool = True) -> None:
        """Drop the resident and free its memory. ``drained``: no forward pass can be running
        (a load or an unload, after the transition drained), so cuBLAS's workspaces go too
        (:func:`free_memory`); not at process shutdown, whose grace may have ended mid-pass."""
        if self.resident is None:
            return
        dropped = self.resident
        name = dropped.row.name
        self.resident = None
        self.catalogue.set_resident(None)
        if self.metrics:
            self.metrics.model_unloads.inc()
            self.metrics.set_resident(None)
        if getattr(dropped, "engine_loop", None) is not None:  # a GGUF resident has none
            # its cache goes too; at shutdown a short wait lets the thread end (and free the
            # cache) before the interpreter does, whose teardown would abort a thread still
            # freeing it
            dropped.engine_loop.close(wait_s=5.0 if drained else 2.0)
            dropped.engine_loop = None
            if self.metrics:
                self.metrics.set_engine_loop(None)
        if getattr(dropped.row, "format", None) == "gguf":
            close = getattr(dropped.model, "close", None)
            if close is not None:
                close()  # llama.cpp's server, its model and cache go now (contract 4a)
        for hook in self.drop_hooks:
            try:
                hook(dropped)
            except Exception:  # a hook's bug must not keep the model resident
                log.exception("a drop hook failed for model %s", name)
        if dropped.arena is not None:
            try:  # the server no longer serves it: its shared-memory files go (issue 16, 4)
                dropped.arena.release_shared_memory()
            except OSError as exc:
                log.warning("could not remove the shared memory of model %s: %s", name, exc)
        del dropped
        free_memory(nothing_resident=drained)
        log.info("model %s unloaded", name)

    def shutdown(self) -> None:
        """Drop the resident model without any check (process shutdown only)."""
        self._drop_resident(drained=False)

    async def unload(self, row_id: int | None = None) -> CatalogueRow:
        """Unload the resident model and free its memory; returns its row.

        ``row_id``: when given, it must be the resident row (``POST /api/models/{id}/unload``).

        Raises:
            ApiError: 404 MODEL_NOT_FOUND (no such row), 409 MODEL_NOT_LOADED (the row, or
                anything, is not resident), 409 MODEL_BUSY, a lifecycle refusal.
        """
        row = self._row_or_404(row_id) if row_id is not None else None
        # Before the resident check: during a swap nothing is resident yet, and that is busy.
        self._check_transition("unload", row)
        resident = self.resident
        if resident is None or (row is not None and resident.row.id != row.id):
            where = (
                f"; the resident model is {resident.row.name!r} (id {resident.row.id})"
                if resident
                else "; nothing is resident"
            )
            raise ApiError(
                codes.MODEL_NOT_LOADED,
                f"catalogue row {row.name!r} is not resident{where}"
                if row
                else "nothing is resident",
                status=409,
                details={"resident_id": resident.row.id if resident else None},
            )
        self._busy = "unload"
        try:
            async with self._lock:
                unloaded = resident.row
                del resident
                self._note_replacing()
                self._drop_resident()
                return unloaded
        finally:
            self._busy = None
            self._replacing = None

    async def ensure_for_request(self, name: str, load_policy: str | None = None) -> Resident:
        """The resident that serves ``name``, auto-loading the catalogue row of that name.

        Contract 4: ``name`` is the resident's served name or base name (served at once), or a
        catalogue row's name (a swap), unless ``X-miLLM-Load-Policy: refuse``.

        Raises:
            ApiError: 404 MODEL_NOT_FOUND (no resident or row of that name), 409
                MODEL_NOT_LOADED (policy refuse), 400 INVALID_REQUEST (an unknown policy), and
                every refusal of :meth:`load`.
        """
        normalize_load_policy(load_policy)
        if self.resident is not None and self.serves(name):
            return self.resident
        row = self.resolve_or_not_found(name)
        return await self.load(row.id, kind="auto_load", load_policy=load_policy)

    def describe(self) -> dict[str, Any] | None:
        """A JSON-ready summary of the resident (for ``/api/health/detailed``), or None."""
        r = self.resident
        if r is None:
            return None
        return {
            "model_id": r.row.id,
            "name": r.row.name,
            "served_name": r.served_name,
            "base_name": r.base_name,
            "origin": r.origin,
            "commits": r.commits,
            "dtype": r.row.dtype,
            "device": str(r.device),
            "attachable": r.attachable,
            "loaded_at": datetime.fromtimestamp(r.loaded_at, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
        }
