"""What a quiesce that holds running work needs from the engine (contract 4b; issue 30).

The lifecycle table decides when (``PARK_RUNNING``, ``RESUME_PARKED``, ``END_PARKED_TORN``);
:class:`~miserver.serving.weights.effects.EffectPerformer` calls these methods on the resident's
engine when the engine offers them. An engine that does not (the static batch engine) makes a
``{"running": "hold"}`` quiesce a 409 ``BARRIER_UNAVAILABLE`` reason ``hold_unsupported``: a
hold is never faked by a drain.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Parking(Protocol):
    """An engine that can park its running sequences at a step boundary.

    The continuous engine implements it over ``ContinuousEngine.close_admission``,
    ``preempt_all`` and ``open_admission``: parking frees every running sequence's KV blocks
    and keeps its prompt and produced token ids, so a parked sequence is prefilled again (prompt
    plus produced tokens) when it is admitted again, on the weights of that time, and continues;
    the tokens a client was sent are never sent again or changed.
    """

    def park_running(self) -> None:
        """Stop at the next step boundary and park every running sequence. Returns at once
        (called on the event loop, under the weights lock). An engine that also offers
        ``async wait_parked()`` ends the quiesce's drain when that returns (the step in progress
        ended; the parked requests keep their share of the slot, computing nothing); without
        it the drain waits for the slot as a ``finish`` drain does."""

    def parked_sequences(self) -> int:
        """How many sequences are parked now (a request with ``n`` choices counts ``n``)."""

    def resume_parked(self) -> int:
        """Admit the parked sequences again, ahead of new requests; returns how many."""

    def end_parked(self, exc: BaseException) -> int:
        """End every parked sequence with ``exc`` (a torn set's 503 ``WEIGHTS_TORN``: its
        stream ends with one error event); returns how many."""


def parking_of(host: Any) -> Parking | None:
    """The resident's engine when it can park running sequences, else ``None``.

    ``host``: a :class:`~miserver.serving.models.host.ModelHost`: its resident's ``engine_loop``
    (:class:`~miserver.serving.engine.engine_loop.EngineLoop`, ``ENGINE=continuous``), else
    its ``engine``.
    """
    resident = getattr(host, "resident", None)
    if resident is None:
        return None
    for name in ("engine_loop", "engine"):  # the continuous engine's thread parks (issue 30)
        engine = getattr(resident, name, None)
        if isinstance(engine, Parking):
            return engine
    return None
