"""Management loads and unloads and ``/v1`` admission, decided by the weights lifecycle
(companion contracts 3 and 4).

:class:`AdmissionGate` is the collaborator of
:class:`~miserver.serving.weights.runtime.WeightsRuntime` that checks the catalogue row a load or a ``/v1`` request names (before the lifecycle decides),
lets the table's ``model_load``, ``model_unload``, ``v1``, ``v1_confirm`` and
``settings_change`` rows decide, and waits for the transition the outcome started.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from miserver.fsm.machine import Outcome
from miserver.fsm.state import Event
from miserver.serving.engine.slot import Priority
from miserver.spec import codes
from miserver.spec.errors import ApiError

if TYPE_CHECKING:
    from miserver.serving.models.host import Resident


#: The longest a ``/v1`` request held through a weights load's full reload waits for the
#: reloaded model before it is answered 503 NOT_READY (``model_transition``) with
#: ``Retry-After`` (issue 32, item 2), s: as the start-up load's wait (``v1.STARTUP_LOAD_WAIT_S``).
RELOAD_WAIT_S = 300.0
#: How often a request held through a reload looks whether the reloaded model is resident, s.
RELOAD_POLL_S = 0.02


class AdmissionGate:
    """Loads, unloads and ``/v1`` admission of one runtime.

    Args:
        host: :class:`miserver.serving.models.host.ModelHost` (the resident, the catalogue,
            the file check before a load).
        lifecycle: the :class:`~miserver.fsm.machine.Lifecycle` (read only: its state).
        lock: the runtime's lock, held around every decision.
        decide: the runtime's one entry point, ``decide(event) -> Outcome``.
        effects: the runtime's :class:`~miserver.serving.weights.effects.EffectPerformer` (the
            transition's parameters go there; the transition task comes back from it).
        refusals: the runtime's :class:`~miserver.serving.weights.refusals.Refusals`.
    """

    def __init__(
        self,
        *,
        host: Any,
        lifecycle: Any,
        lock: asyncio.Lock,
        decide: Callable[[Event], Outcome],
        effects: Any,
        refusals: Any,
    ) -> None:
        self.host = host
        self.lifecycle = lifecycle
        self.lock = lock
        self.decide = decide
        self.effects = effects
        self.refusals = refusals
        # Residents a weights load replaced by a full reload (``{"model_id": N}``, or a
        # checkpoint whose layout differs): a request held through it goes on on the reloaded
        # model when that model answers to the name it gave (issue 32, item 2). Weak
        # references (a Resident compares by value, so no set): never keeps a dropped model.
        self._reloaded: list[weakref.ref[Any]] = []

    def _target(self, row_id: int | None, *, check: bool = True) -> bool:
        """Whether ``row_id`` names the resident row. A row that does not exist or cannot be
        loaded is refused here, before the lifecycle sees the load (404 MODEL_NOT_FOUND,
        400 BACKEND_UNAVAILABLE), so a started load fails only for a real load error."""
        from miserver.serving.models.loader import check_loadable

        resident = self.host.resident
        if row_id is None:
            return True
        if resident is not None and resident.row.id == row_id:
            return True
        if resident is None and getattr(self.host, "replacing_row_id", None) == row_id:
            return True  # the row a running swap or unload replaces: resident until it ends
        row = self.host.catalogue.get(row_id)
        if row is None:
            raise ApiError(
                codes.MODEL_NOT_FOUND,
                f"no catalogue row with id {row_id}",
                details={"model_id": row_id},
            )
        if check:
            check_loadable(row)
        return False

    async def _check_files(self, row_id: int | None) -> None:
        """Check the files of the row a load or an auto-load would load, before the lifecycle
        decides and before anything drains or is unloaded (breaker finding F16): a folder that
        cannot be loaded is refused 400 MODEL_LOAD_FAILED and the resident keeps serving."""
        check = getattr(self.host, "check_before_load", None)
        if row_id is not None and check is not None:
            await check(row_id)

    async def model_transition(self, kind: str, row_id: int | None) -> Any:
        """A management load (``model_load``) or unload (``model_unload``) of ``row_id``;
        waits for it and returns what the host returned (the resident, or the unloaded row).

        A load of another row first checks that row's files (:meth:`_check_files`: 400
        MODEL_LOAD_FAILED, nothing changed).

        Raises ApiError with the table's refusal (contract 3), or the load's own error.
        """
        if kind == "model_load":
            targets_resident = self._target(row_id)
            if not targets_resident:
                await self._check_files(row_id)
        else:
            targets_resident = True
            row = self.host.catalogue.get(row_id) if row_id is not None else None
            if row_id is not None and row is None:
                raise ApiError(
                    codes.MODEL_NOT_FOUND,
                    f"no catalogue row with id {row_id}",
                    details={"model_id": row_id},
                )
            resident = self.host.resident
            idle = not self.host.busy and self.lifecycle.state.transition == "none"
            if row is not None and idle and (resident is not None and resident.row.id != row.id):
                # Refused before any drain: an unload of a row that is not resident cannot
                # succeed, and draining for it would stall /v1 for nothing (issue 16, item 6).
                # Nothing resident at all is the table's refusal (MODEL_NOT_LOADED), also
                # before any drain.
                raise ApiError(
                    codes.MODEL_NOT_LOADED,
                    f"catalogue row {row.name!r} is not resident; the resident model is "
                    f"{resident.row.name!r} (id {resident.row.id})",
                    status=409,
                    details={"resident_id": resident.row.id},
                )
        async with self.lock:
            self.effects.transition_params = {"row_id": row_id}
            out = self.decide(Event(kind, target="resident" if targets_resident else "other"))
            task = self.effects.last_outputs.get("transition")
        if out.kind == "refused":
            raise self.refusals.refusal(out)
        if task is not None:
            return await task
        return self.host.resident

    async def admit_v1(
        self,
        *,
        refuse_policy: bool,
        row_id: int | None,
        priority: Priority = Priority.INTERACTIVE,
    ) -> Resident | None:
        """Decide a ``/v1`` request (contract 4) and return the resident it is admitted for.

        ``row_id``: the catalogue row the request names, or ``None`` when it names the resident
        (served or base name). ``priority``: the scheduler priority it will wait at
        (``Priority.BATCH`` for Batch API rows: never refused 503 QUEUE_FULL).

        The table's ``v1`` rows decide: run it, hold it (the scheduler then holds it), refuse,
        or auto-load the named row. An auto-load is awaited; then the table's ``v1_confirm``
        rows decide again, told whether the row it loaded is still the resident.

        Returns None for a request the table holds while a weights load's full reload has
        dropped the resident and not yet made the new one (issue 32, item 2: the request is
        held, as during a quiesce, never refused 409 MODEL_BUSY): the caller waits
        (:meth:`wait_reloaded`) and admits it again, by the name it gave.

        Raises:
            ApiError: the table's refusal (409 MODEL_NOT_LOADED / ALREADY_ATTACHED /
                WEIGHTS_UNSAVED / MODEL_BUSY, 503 WEIGHTS_TORN / QUEUE_FULL; 409 MODEL_BUSY
                ``model_transition`` with ``Retry-After`` when the model changed while the
                request waited for its auto-load), 404 MODEL_NOT_FOUND and 400
                BACKEND_UNAVAILABLE / MODEL_LOAD_FAILED for a row that cannot be loaded
                (checked before the table decides, unless ``refuse_policy``), or the
                auto-load's own error.
        """
        # The refuse policy refuses any swap first (weights page: Unsaved commits), before a
        # check of whether the row could be loaded at all.
        targets_resident = row_id is None or self._target(row_id, check=not refuse_policy)
        if not targets_resident and not refuse_policy:
            await self._check_files(row_id)
        async with self.lock:
            self.effects.transition_params = {"row_id": row_id}
            out = self.decide(
                Event(
                    "v1",
                    target="resident" if targets_resident else "other",
                    refuse_policy=refuse_policy,
                    queue_full=self.refusals.queue_full(priority),
                )
            )
            task = self.effects.last_outputs.get("transition")
            resident = self.host.resident
            reloading = self.reloading()
        if out.kind == "refused":
            raise self.refusals.refusal(out)
        if task is None and resident is not None:
            return resident
        if task is None and reloading:
            return None  # held through the reload: admitted again once it made the model
        if task is not None:
            await task  # the auto-load; its own error propagates
            resident = self.host.resident
            if resident is not None and resident.row.id != row_id:
                resident = None  # another model is resident now, not the row it loaded
        resident = await self.confirm_v1(resident)
        assert resident is not None  # confirmed: it is the resident
        return resident

    def note_reloaded(self, resident: Any) -> None:
        """Record that a weights load is replacing ``resident`` by a full reload (the job calls
        it before the reload drops it); see :meth:`confirm_v1`."""
        self._reloaded = [r for r in self._reloaded if r() is not None]
        self._reloaded.append(weakref.ref(resident))

    def _was_reloaded(self, resident: Any) -> bool:
        return any(r() is resident for r in self._reloaded)

    def reloading(self) -> bool:
        """Whether a weights load's full reload runs and has dropped the resident (the pause
        owner is ``weights_load`` and the host loads with nothing resident)."""
        return (
            self.host.resident is None
            and self.host.busy
            and self.lifecycle.state.owner == "weights_load"
        )

    async def wait_reloaded(self, deadline: float) -> None:
        """Wait while a weights load's full reload has nothing resident (:meth:`reloading`),
        for a ``/v1`` request :meth:`admit_v1` held through it (issue 32, item 2).

        Args:
            deadline: the event loop's time (``loop.time()``) to give up at.

        Raises:
            ApiError: 503 NOT_READY (reason ``model_transition``) with ``Retry-After`` once
                ``deadline`` passed with the reload still running: a request held past its
                deadline is told to retry, never refused 409 as a client's error.
        """
        loop = asyncio.get_running_loop()
        while self.reloading():
            if loop.time() >= deadline:
                raise ApiError(
                    codes.NOT_READY,
                    "a weights load is reloading the model this request names, and it did not "
                    "finish while the request was held; retry (GET /api/weights/status shows "
                    "barrier: serving once it has ended)",
                    reason="model_transition",
                    headers={"Retry-After": "1"},
                )
            await asyncio.sleep(RELOAD_POLL_S)

    async def confirm_v1(
        self,
        resident: Resident | None,
        *,
        adapter: dict[str, Any] | None = None,
        model: str | None = None,
    ) -> Resident | None:
        """A ``/v1`` request admitted for ``resident`` has waited (for its scheduler slot, or
        for its auto-load) and is about to go on: the table's ``v1_confirm`` rows decide, told
        whether ``resident`` is still the resident (``None``: it is known not to be).

        A resident a weights load replaced by a full reload while the request was held counts
        as the same when the reloaded model answers to ``model``, the name the request gave
        (issue 32, item 2: held requests are answered after the load, as after a quiesce);
        the request then goes on on the reloaded model, which this returns. Returns the
        resident the request goes on on.

        ``adapter``: the adapter block the request was admitted for when it named the applied
        adapter; the resident is then the same only while that application is still applied
        (the adapter removed or replaced meanwhile is a model that went away, issue 16 item 8).

        Inside the slot a pause that began meanwhile waits for this request (it holds a slot),
        so a hold is an acceptance there.

        Raises:
            ApiError: 409 MODEL_BUSY ``model_transition`` with ``Retry-After`` (the model was
                unloaded or changed while the request waited), 503 WEIGHTS_TORN (the set tore),
                409 MODEL_BUSY ``model_transition`` (a model transition is in progress).
        """
        async with self.lock:
            now = self.host.resident
            same = resident is not None and now is resident
            if same and adapter is not None:
                same = resident.adapter_block is adapter
            if (
                not same
                and now is not None
                and adapter is None
                and model is not None
                and resident is not None
                and self._was_reloaded(resident)
                and model in now.names()
            ):
                same, resident = True, now  # held through a weights load's reload
            out = self.decide(Event("v1_confirm", same_resident=same))
        if out.kind == "refused":
            raise self.refusals.refusal(out)
        return resident

    def catalogue_delete(self, row_id: int, name: str, *, loads_checking: int = 0) -> None:
        """DELETE /api/models/{id}: may the catalogue row go? The table decides (``catalogue_delete``:
        409 MODEL_BUSY ``model_transition`` while a weights load or a save holds the barrier,
        or while a weights load's checkpoint is being checked before its pause, which this
        runtime counts (``loads_checking``); contract 3). Raises :class:`ApiError` on a
        refusal. Synchronous: the caller deletes the row with no ``await`` in between, and the
        decision changes no lifecycle state (a read of it, as ``GET /api/weights/status``)."""
        event = Event(
            "catalogue_delete", name=name, model_id=row_id, loads_checking=loads_checking > 0
        )
        out = self.decide(event)
        if out.kind == "refused":
            raise self.refusals.refusal(out)

    async def settings_change(self, avail: str) -> Outcome:
        """PATCH /api/settings: the resulting pause availability goes through the table."""
        async with self.lock:
            out = self.decide(Event("settings_change", avail=avail))  # type: ignore[arg-type]
        if out.kind == "refused":
            raise self.refusals.refusal(out)
        return out
