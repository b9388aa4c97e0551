"""The effects of the weights lifecycle, performed on the server (the runtime's hands).

:class:`EffectPerformer` is the collaborator of
:class:`~miserver.serving.weights.runtime.WeightsRuntime` that translates each
:class:`~miserver.fsm.table.Effect` of an accepted outcome into calls on the scheduler (hold,
drain, release, refuse the held), the model host (a model load or unload, the decode engine's
cache and graphs) and the IPC layer (export, reclaim, the address check), and runs the pauses'
jobs (save, weights load, adapter change). No rule is decided here: the table decided; this module
performs. It owns what performing needs between two decisions (the pending answer of a pause, the
registered jobs and their parameters and result, the drain task, the spawned tasks) and reports
back through the runtime's ``decide`` under the runtime's ``lock``, both passed in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from miserver.fsm.machine import Outcome
from miserver.fsm.state import Event
from miserver.fsm.table import Answer, Effect
from miserver.serving.engine.parking import parking_of
from miserver.serving.engine.slot import DrainTimeout, Priority
from miserver.serving.weights.refusals import WeightsTornError
from miserver.spec import codes
from miserver.spec.errors import ApiError, disk_full_error, is_disk_full

log = logging.getLogger("miserver.weights")


PauseJob = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def decode_engine_effect(host: Any, effect: Effect) -> None:
    """What a lifecycle effect means for the resident's continuous engine (issue 29):
    ``DROP_CACHE`` forgets its prefix cache, so nothing computed on old weights is reused (the
    engine's only state between requests); the effects below drop its CUDA decode graphs.

    The graphs replay kernels over the served storages, which never move: a commit, a save
    and an in-place weights load keep them (``BEGIN_SAVE``, ``BEGIN_WEIGHTS_LOAD``; a full
    reload makes a new resident, whose engine is new, and the old one is closed by the
    host). An adapter change (``BEGIN_ADAPTER_CHANGE``) changes which modules compute,
    and a model transition (``START_MODEL_LOAD``, ``START_MODEL_UNLOAD``) and the fence of a
    holder removed without its own detach (``FENCE_ARENA``, issue 32 item 8: the served set
    moved to fresh storages) the storages: their graphs are dropped, captured again at next
    use over the model of that time (at the engine's next step boundary: a step in flight may
    finish on them). The engine keeps nothing else that addresses the old storages.
    ``host``: the :class:`~miserver.serving.models.host.ModelHost` (its resident's engine).
    """
    resident = host.resident
    loop = getattr(resident, "engine_loop", None) if resident is not None else None
    if loop is None:  # nothing resident, or a GGUF resident (llama.cpp keeps its own)
        return
    if effect is Effect.DROP_CACHE:
        loop.drop_prefix_cache()
    elif effect in (
        Effect.BEGIN_ADAPTER_CHANGE,
        Effect.START_MODEL_LOAD,
        Effect.START_MODEL_UNLOAD,
        Effect.FENCE_ARENA,
    ):
        loop.drop_graphs()


class EffectPerformer:
    """Performs the lifecycle's effects for one runtime.

    Args:
        settings: the validated configuration (the drain timeout, the home for a disk-full
            error, the CPU-attach switch).
        scheduler: :class:`miserver.serving.engine.slot.Scheduler` (the slots and the barrier).
        host: :class:`miserver.serving.models.host.ModelHost` (the resident model).
        transport: the attachment's :class:`~miserver.serving.weights.transport.AttachmentTransport`.
        lifecycle: the :class:`~miserver.fsm.machine.Lifecycle` (read only: its context and state).
        lock: the runtime's lock; every report back (``decide``) is made under it.
        decide: the runtime's one entry point, ``decide(event) -> Outcome`` (caller holds ``lock``).
        refusals: the runtime's :class:`~miserver.serving.weights.refusals.Refusals`.
        metrics: the app's metrics object, or None.
    """

    def __init__(
        self,
        *,
        settings: Any,
        scheduler: Any,
        host: Any,
        transport: Any,
        lifecycle: Any,
        lock: asyncio.Lock,
        decide: Callable[[Event], Outcome],
        refusals: Any,
        metrics: Any = None,
    ) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.host = host
        self.transport = transport
        self.lifecycle = lifecycle
        self.lock = lock
        self.decide = decide
        self.refusals = refusals
        self.metrics = metrics
        #: The answer a gated call that started a pause waits for (settled by an effect).
        self.pending: asyncio.Future[Answer] | None = None
        self.pending_failure: Answer | None = None
        #: The work each pause performs once it holds the barrier, by owner.
        self.jobs: dict[str, PauseJob] = {}
        self.job_params: dict[str, Any] = {}
        self.job_result: dict[str, Any] = {}
        #: ``START_DRAIN`` found nothing running: ``drained`` follows in the same decision.
        self.drained_now = False
        #: The engine a ``PARK_RUNNING`` just asked to park (its row's ``START_DRAIN`` reads it).
        self.parking: Any = None
        #: ``FENCE_ARENA`` could not move the set: ``fence_failed`` follows in the same decision.
        self.fence_failed_now = False
        self.drain_task: asyncio.Task[None] | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        #: The parameters of the next model transition (the row a load or an unload names).
        self.transition_params: dict[str, Any] = {}
        #: What the last decision's effects produced (``export``, ``transition``, ...).
        self.last_outputs: dict[str, Any] = {}
        self.last_export: Any = None

    def open_pending(self, params: dict[str, Any] | None) -> None:
        """An accepted pause trigger: a new pending answer, its job's parameters."""
        self.pending = asyncio.get_running_loop().create_future()
        self.pending_failure = None
        self.job_params = dict(params or {})
        self.job_result = {}

    async def event(self, event: Event) -> Outcome:
        """Lock and decide ``event`` (a job's own report)."""
        async with self.lock:
            return self.decide(event)

    # --- effects ----------------------------------------------------------------------------
    def perform(self, out: Outcome, outputs: dict[str, Any]) -> None:
        """Perform the effects of ``out`` in order (nothing for a refusal or a hold)."""
        if out.kind != "accepted":
            return
        for effect in out.effects:
            self._effect(effect, out, outputs)

    def _effect(self, effect: Effect, out: Outcome, outputs: dict[str, Any]) -> None:
        sched = self.scheduler
        if effect is Effect.EXPORT_HANDLES:
            outputs["export"] = self._export()
        elif effect is Effect.RELEASE_EXPORTS:
            from miserver.ipc.export import reclaim

            reclaim()
            self.transport.ended()
        elif effect is Effect.HOLD_ADMISSIONS:
            sched.barrier_begin()
        elif effect is Effect.START_DRAIN:
            parked, self.parking = self.parking, None
            wait_parked = getattr(parked, "wait_parked", None)
            if wait_parked is not None and not sched.barrier_hold_if_drained():
                # contract 4b: the parked requests keep their share of the slot but compute
                # nothing: the drain ends once the engine stopped at its step boundary
                self.drain_task = self._spawn(self._drain_parked(wait_parked))
            elif wait_parked is not None:
                self.drained_now = True
            elif sched.barrier_hold_if_drained():
                self.drained_now = True  # nothing runs: `drained` follows in this decision
            else:
                self.drain_task = self._spawn(self._drain())
        elif effect is Effect.CANCEL_DRAIN:
            if self.drain_task is not None and not self.drain_task.done():
                self.drain_task.cancel()
            self.drain_task = None
            sched.barrier_abandon()
        elif effect is Effect.DROP_CACHE:
            sched.drop_caches()
            decode_engine_effect(self.host, effect)
        elif effect is Effect.RELEASE_HELD:
            sched.barrier_release()
        elif effect is Effect.REFUSE_HELD_TORN:
            sched.fail_held(WeightsTornError(), priorities=(Priority.INTERACTIVE,))
        elif effect is Effect.PARK_RUNNING:
            parking = parking_of(self.host)
            if parking is None:  # the table accepts a hold only when the engine can park
                raise RuntimeError("PARK_RUNNING with an engine that cannot park")
            if hasattr(parking, "served_weights"):  # the set each token is stamped with
                parking.served_weights = lambda: self.host.resident
            parking.park_running()
            self.parking = parking  # START_DRAIN (next in the row) waits for it to stop
        elif effect is Effect.RESUME_PARKED:
            parking = parking_of(self.host)
            if parking is not None:
                parking.resume_parked()
        elif effect is Effect.END_PARKED_TORN:
            parking = parking_of(self.host)
            if parking is not None:
                parking.end_parked(WeightsTornError())
        elif effect is Effect.ANSWER_PENDING:
            self._settle(out.pending or Answer(200))
        elif effect is Effect.FAIL_PENDING:
            self._settle(self.pending_failure or Answer(500, codes.INTERNAL_ERROR))
        elif effect in (Effect.BEGIN_SAVE, Effect.BEGIN_WEIGHTS_LOAD, Effect.BEGIN_ADAPTER_CHANGE):
            decode_engine_effect(self.host, effect)
            owner = {
                Effect.BEGIN_SAVE: "save",
                Effect.BEGIN_WEIGHTS_LOAD: "weights_load",
                Effect.BEGIN_ADAPTER_CHANGE: "adapter",
            }[effect]
            self._spawn(self._run_job(owner))
        elif effect in (Effect.START_MODEL_LOAD, Effect.START_MODEL_UNLOAD):
            decode_engine_effect(self.host, effect)
            # The row is bound now: a later event may set other parameters before the task runs.
            outputs["transition"] = self._spawn(
                self._run_transition(effect, dict(self.transition_params))
            )
        elif effect in (Effect.ADMIT, Effect.HOLD_REQUEST):
            outputs["admission"] = effect
        elif effect is Effect.APPLY_SETTINGS:
            outputs["apply_settings"] = True
        elif effect is Effect.ARM_RECEIVE:
            self.transport.arm()
        elif effect is Effect.DESTROY_GROUP:
            self.transport.destroy()
        elif effect is Effect.FENCE_ARENA:
            self._fence()
        elif effect in (
            Effect.RECORD_OVERRUN,
            Effect.RECORD_WATCHDOG,
            Effect.RECORD_HOLD_TIMEOUT,
            Effect.RECORD_STALE,
        ):
            log.warning("weights: %s", self._record_message(effect))
        else:  # pragma: no cover - a new effect the runtime does not know
            raise RuntimeError(f"unknown effect {effect}")

    def _record_message(self, effect: Effect) -> str:
        """The log line of a timer's or a late commit's record effect: what happened, and what
        to do (the on-call runbook, docs/operations.md, has the same advice)."""
        c = self.lifecycle.context
        who = f"attachment {c.attachment_label or '?'} (role {c.attachment_role or '?'})"
        st = self.settings
        if effect is Effect.RECORD_WATCHDOG:
            return (
                f"the commit of {who} stayed open longer than WEIGHTS_COMMIT_WATCHDOG_MS "
                f"({st.weights_commit_watchdog_ms:g} ms): the weights are torn, and every /v1 "
                "request is 503 weights_torn until recovered: by the trainer's late commit-end "
                "(recorded as an overrun) or by POST /api/weights/load with a checkpoint or "
                '{"model_id": N}. If the trainer\'s steps take this long, raise '
                "WEIGHTS_COMMIT_WATCHDOG_MS (on a CPU, 30000), and create the optimizer state "
                "before the first commit"
            )
        if effect is Effect.RECORD_HOLD_TIMEOUT:
            return (
                f"{who} quiesced but sent neither commit-begin nor resume within "
                f"WEIGHTS_HOLD_TIMEOUT_S ({st.weights_hold_timeout_s:g} s): serving resumed on "
                "its own, held requests were let through, and nothing was written. If the "
                "trainer needs longer between quiesce and commit-begin, raise "
                "WEIGHTS_HOLD_TIMEOUT_S"
            )
        if effect is Effect.RECORD_STALE:
            return (
                f"{who} sent no heartbeat for WEIGHTS_HEARTBEAT_TIMEOUT_S "
                f"({st.weights_heartbeat_timeout_s:g} s) and is stale. Serving continues; a new "
                "attach and every model load are refused until it heartbeats again or an "
                "operator clears it (POST /api/weights/clear-stale, operator token). Check "
                "whether the trainer process is still alive"
            )
        return (
            f"a commit-end from {who} came after the watchdog "
            f"(WEIGHTS_COMMIT_WATCHDOG_MS, {st.weights_commit_watchdog_ms:g} ms) had torn the "
            "set: the weights are clean again (GET /api/weights/status: last_overrun). If "
            "steps take this long, raise WEIGHTS_COMMIT_WATCHDOG_MS"
        )

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _settle(self, answer: Answer) -> None:
        if self.pending is not None and not self.pending.done():
            self.pending.set_result(answer)

    async def _drain_parked(self, wait_parked: Callable[[], Awaitable[None]]) -> None:
        """A hold's drain (contract 4b): wait for the engine to stop at its step boundary,
        then hold the barrier over the parked requests' shares and report ``drained``."""
        try:
            await wait_parked()
        except asyncio.CancelledError:
            return
        async with self.lock:
            if self.drain_task is not asyncio.current_task():
                return  # cancelled in the meantime
            self.drain_task = None
            # a hold's drain ends with the parked requests still holding their shares
            self.scheduler.barrier_hold_if_drained(parked=True)
            self.decide(Event("drained"))

    async def _drain(self) -> None:
        """Wait for the running forward passes, then report ``drained`` (the drain timer, a
        core deadline, decides a drain that takes too long)."""
        try:
            await self.scheduler.barrier_wait_drained()
        except asyncio.CancelledError:
            return
        async with self.lock:
            if self.drain_task is not asyncio.current_task():
                return  # cancelled in the meantime
            self.drain_task = None
            self.decide(Event("drained"))

    async def _run_job(self, owner: str) -> None:
        """Run a pause's work (save, weights load, adapter change) and report its end."""
        job = self.jobs.get(owner)
        done, failed = f"{owner}_done", f"{owner}_failed"
        try:
            if job is None:
                raise ApiError(codes.INTERNAL_ERROR, f"no {owner} job is registered")
            params = dict(self.job_params)
            params["mark_writing"] = self._mark_writing
            result = await job(params)
        except ApiError as err:
            async with self.lock:
                self.pending_failure = Answer(err.status, err.code, err.reason)
                self.job_result = {"error": err}
                self.decide(Event(failed))
            return
        except Exception as exc:  # noqa: BLE001 - any failure of the job is reported, not lost
            if is_disk_full(exc):  # one line, no traceback: 507 saying what to do (item 16)
                log.error("weights: the %s failed: the disk is full (%s)", owner, exc)
                err = disk_full_error(f"the {owner}", self.settings.home)
            else:
                log.exception("weights: the %s failed", owner)
                err = ApiError(codes.INTERNAL_ERROR, f"the {owner} failed: {exc}")
            async with self.lock:
                self.pending_failure = Answer(err.status, err.code, err.reason)
                self.job_result = {"error": err}
                self.decide(Event(failed))
            return
        async with self.lock:
            self.job_result = result
            self.decide(
                Event(
                    done,
                    name=result.get("served_name"),
                    applied=result.get("applied", True),
                    origin=result.get("origin"),
                    commits=result.get("commits"),
                )
            )

    async def _mark_writing(self) -> None:
        """A weights load is about to write: the set is ``writing`` from here (contract 5)."""
        await self.event(Event("weights_load_write"))

    async def _run_transition(self, effect: Effect, params: dict[str, Any]) -> Any:
        """Perform a model load or unload for the core and report its end.

        First the generations running on the resident finish: the scheduler takes every slot
        ahead of the queue (new ones are held) for at most WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S, the
        drain the weights page names for quiesce and the pauses. So an unload or swap answers
        once nothing runs on the old model, and a card never holds two models (contract 3).
        Then the host loads or unloads, and the slots are released after the core has seen
        the end (a request held meanwhile is then told its model changed, ``v1_confirm``).

        Raises:
            ApiError: 409 MODEL_BUSY ``drain_timeout`` when running generations did not finish
                in time (the table's ``transition_abandoned``: nothing loaded or unloaded),
                the host's own error (the table's ``transition_failed``, told whether the
                resident was kept, the previous row loaded back, or nothing is resident).
        """
        timeout_s = self.settings.weights_quiesce_drain_timeout_s
        try:
            await self.scheduler.barrier_acquire(timeout_s)
        except BaseException as exc:
            async with self.lock:
                out = self.decide(Event("transition_abandoned"))
            if isinstance(exc, DrainTimeout) and out.pending is not None:
                raise self.refusals.drain_timeout_error(
                    out.pending, exc.running, "nothing was loaded or unloaded"
                ) from None
            raise
        try:
            before = self.host.resident
            try:
                if effect is Effect.START_MODEL_LOAD:
                    resident = await self.host.load(params["row_id"])
                    name, result = resident.served_name, resident
                    # The row's origin: a checkpoint row is origin=checkpoint (finding N4).
                    origin = resident.origin if resident.origin == "checkpoint" else "model"
                else:
                    result = await self.host.unload(params.get("row_id"))
                    name = origin = None
            except BaseException as exc:
                after = self.host.resident
                if after is None:
                    event = Event("transition_failed")
                elif after is before:  # refused before anything was dropped
                    event = Event("transition_failed", after_failure="kept")
                else:  # the previous row was loaded back (breaker finding F16)
                    origin = "checkpoint" if after.origin == "checkpoint" else "model"
                    event = Event(
                        "transition_failed",
                        after_failure="reloaded",
                        name=after.served_name,
                        origin=origin,
                    )
                async with self.lock:
                    self.decide(event)
                if isinstance(exc, ApiError | asyncio.CancelledError):
                    raise
                raise ApiError(codes.INTERNAL_ERROR, f"the model transition failed: {exc}") from exc
            async with self.lock:
                self.decide(Event("transition_done", name=name, origin=origin))
            return result
        finally:
            self.scheduler.barrier_release()

    # --- the fence (issue 32 item 8) ----------------------------------------------------------
    def _fence(self) -> None:
        """``FENCE_ARENA``: move the served set to fresh storages (:func:`miserver.ipc.arena
        .relocate`), so a holder removed without its own detach (clear-stale) writes through its
        old handles into storages nothing serves; the old arena is dropped (its shared-memory
        file removed; a CUDA allocation stays pinned while the removed process maps it) and the
        decode engine's graphs follow the move. A move that cannot allocate reports
        ``fence_failed`` in this decision (the table tears the set)."""
        from miserver.ipc import arena as arena_module

        resident = self.host.resident
        arena = getattr(resident, "arena", None) if resident is not None else None
        if arena is None:
            return
        t0 = time.perf_counter()
        try:
            fresh = arena_module.relocate(arena, resident.model)
        except Exception as exc:  # noqa: BLE001 - no room for the copy: the table decides
            log.error(
                "weights: the fence could not move the served weights to fresh storages (%s): "
                "the cleared attachment's process could still write them, so the set is torn. "
                'Recover with POST /api/weights/load {"model_id": N} where a second copy fits, '
                "else restart miserver",
                exc,
            )
            self.fence_failed_now = True
            return
        resident.arena = fresh
        try:
            arena.release_shared_memory()
        except OSError as exc:
            log.warning("weights: could not remove the old shared memory: %s", exc)
        decode_engine_effect(self.host, Effect.FENCE_ARENA)
        log.warning(
            "weights: fenced out the cleared attachment: the served weights moved to fresh "
            "storages (%.1f MiB in %.1f ms); its old handles reach nothing served",
            fresh.total_bytes / 2**20,
            (time.perf_counter() - t0) * 1e3,
        )

    # --- export -----------------------------------------------------------------------------
    def _export(self) -> Any:
        resident = self.host.resident
        arena = getattr(resident, "arena", None)
        if resident is None or arena is None:  # the core checked attachability: a bug
            raise ApiError(codes.INTERNAL_ERROR, "the resident model has no parameter arena")
        body = self.transport.export(arena, resident.model)  # the attach's transport
        self.last_export = body
        if self.metrics is not None:
            self.metrics.pinned_bytes.set(body.release.pinned_bytes)
        return body

    def can_park(self) -> bool:
        """``quiesce``'s ``hold_supported`` fact: the resident's engine can park running
        sequences (:class:`~miserver.serving.engine.parking.Parking`; contract 4b)."""
        return parking_of(self.host) is not None

    def parked_sequences(self) -> int:
        """How many sequences a hold parked now (0 when the engine cannot park)."""
        parking = parking_of(self.host)
        return parking.parked_sequences() if parking is not None else 0

    def not_attachable_reason(self) -> str | None:
        """The resident's own NOT_ATTACHABLE reason (gguf, quantized, dtype, not_on_gpu,
        allocator), or None. The serving-wide reasons are the core's."""
        from miserver.ipc.arena import parameter_devices, parameter_dtypes
        from miserver.ipc.attachability import not_attachable_reason

        resident = self.host.resident
        if resident is None:
            return None
        row = resident.row
        if row.format == "gguf":  # llama.cpp holds the weights: no torch parameters to read
            return "gguf"
        reason = not_attachable_reason(
            fmt=row.format,
            quantization=row.quantization,
            param_dtypes=parameter_dtypes(resident.model),
            devices=parameter_devices(resident.model),
            arena=getattr(resident, "arena", None),
            continuous_batching=False,
            max_concurrent=1,
            model_transition=False,
            weights_writing=False,
            cpu_attach=self.settings.weights_cpu_attach,
        )
        return (
            reason if reason in ("gguf", "quantized", "dtype", "not_on_gpu", "allocator") else None
        )

    def check_addresses(self, *, full: bool = False) -> list[str]:
        """Compare every parameter's address with the export; a move tears the set
        (weights page: States). ``full`` also walks the module tree (new parameters); the
        per-commit check reads the recorded parameters only. Call under :attr:`lock`."""
        from miserver.ipc.export import moved_parameters, moved_parameters_fast

        resident = self.host.resident
        arena = getattr(resident, "arena", None) if resident is not None else None
        if arena is None or self.lifecycle.state.attachment == "none":
            return []
        moved = (
            moved_parameters(arena, resident.model)
            if full or not arena.watch
            else moved_parameters_fast(arena)
        )
        if moved:
            log.error("weights: %d parameter(s) moved since export: %s", len(moved), moved[:3])
            self.decide(Event("address_moved"))
        return moved
