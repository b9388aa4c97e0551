"""The weights lifecycle: one table (``table``), compiled into a ``transitions.Machine``
(``compiled``), driven by a sans-IO core (``machine.Lifecycle``), checked exhaustively
(``check``) and drawn into docs/state-machine.md (``diagram``)."""

from miserver.fsm.machine import Lifecycle, Outcome, Snapshot, TableError
from miserver.fsm.state import Caller, Event, LifecycleState
from miserver.fsm.table import Effect

__all__ = [
    "Caller",
    "Effect",
    "Event",
    "Lifecycle",
    "LifecycleState",
    "Outcome",
    "Snapshot",
    "TableError",
]
