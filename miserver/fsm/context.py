"""What the lifecycle keeps beside its abstract state: deadlines, counters, identities, times.

All times are seconds on the caller's clock (whatever ``now`` the HTTP layer passes, typically
``time.monotonic()`` for deadlines); wall-clock stamps for status fields are passed in as
``wall`` by the caller. The value is frozen and hashable, so ``snapshot()`` is too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Provenance:
    """What ``X-miLLM-Model`` said just before the first adapter was applied (weights page:
    Which weights answered; contract 6), or the checkpoint a save made while it was applied:
    the served name, its origin and commit count, and ``steps_since_load`` then, so that
    removing the adapter restores the name and origin and counts the commits made while it
    was applied (the base tensors carry them)."""

    served_name: str | None
    origin: str | None
    commits: int | None
    steps_since_load: int | None

    def after(self, steps_since_load: int | None) -> int | None:
        """The commit count of the restored name once ``steps_since_load`` commits exist."""
        if self.commits is None or self.steps_since_load is None or steps_since_load is None:
            return None
        return self.commits + max(0, steps_since_load - self.steps_since_load)


@dataclass(frozen=True, slots=True)
class Context:
    """Concrete values beside a :class:`~miserver.fsm.state.LifecycleState`.

    Attributes:
        hold_deadline, watchdog_deadline, heartbeat_deadline, drain_deadline: when each timer
            fires (seconds, the ``now`` clock), ``None`` when not armed.
        attachment_id: the holder's attachment ID (never reported, logged or echoed).
        attachment_label, attachment_role: the token that attached.
        attached_at, last_heartbeat_at, stale_since: attachment times (``now`` clock).
        quiesced_at: when the current hold began.
        commit_began_at: when the open (or torn) commit began.
        commit_torn_at: when that commit tore (the watchdog, a detach while writing, a moved
            address), or ``None`` while it has not.
        commit_timed_out: the watchdog tore that commit (it was open longer than
            WEIGHTS_COMMIT_WATCHDOG_MS); status ``commit.overran``.
        commit_overran: when the watchdog last tore a commit.
        last_overrun: ``(at, commit_ms)`` of the last late commit-end.
        last_hold_timeout_at: when a hold last timed out.
        steps_since_load: completed commits since the parameter set became resident (``None``
            when nothing is resident).
        saved_steps: ``steps_since_load`` recorded by the last save (unsaved = steps - saved).
        commits_since_name: commit-ends since the served name was set.
        served_name, served_origin: the ``X-miLLM-Model`` name and origin
            (``model``, ``checkpoint`` or ``adapter``).
        saves: how many saves completed since start.
        exports: how many attaches exported handles since start.
        before_adapter: while an adapter is applied, the :class:`Provenance` an adapter
            removal restores (the name served before it, or a save made under it); ``None``
            while none is applied.
    """

    hold_deadline: float | None = None
    watchdog_deadline: float | None = None
    heartbeat_deadline: float | None = None
    drain_deadline: float | None = None
    attachment_id: str | None = None
    attachment_label: str | None = None
    attachment_role: str | None = None
    attached_at: float | None = None
    last_heartbeat_at: float | None = None
    stale_since: float | None = None
    quiesced_at: float | None = None
    commit_began_at: float | None = None
    commit_torn_at: float | None = None
    commit_timed_out: bool = False
    commit_overran: float | None = None
    last_overrun: tuple[float, float] | None = None
    last_hold_timeout_at: float | None = None
    steps_since_load: int | None = None
    saved_steps: int = 0
    commits_since_name: int | None = None
    served_name: str | None = None
    served_origin: str | None = None
    saves: int = 0
    exports: int = 0
    before_adapter: Provenance | None = None

    def __repr__(self) -> str:  # never show the attachment ID
        return f"Context(label={self.attachment_label!r}, steps={self.steps_since_load})"


def served_after_removal(c: Context, base_name: str | None) -> tuple[str | None, str | None, int]:
    """What ``X-miLLM-Model`` says once the applied adapter is removed (weights page: Which
    weights answered; contract 6): ``(name, origin, commits)``. The name and origin recorded
    before the adapter (``c.before_adapter``: the name served before it, or a save made under
    it; ``base_name`` when it names none), its commits plus those made while the adapter was
    applied (they are in the base tensors). When the context no longer serves the adapter's
    name or holds no record, the name (``base_name`` when none), origin and count stay.
    ``origin`` is ``model`` or ``checkpoint`` (``None``: inferred, ``model``)."""
    before = c.before_adapter
    if before is None or c.served_origin != "adapter":
        name, origin, commits = c.served_name or base_name, c.served_origin, c.commits_since_name
    else:
        name = before.served_name or base_name
        origin, commits = before.origin, before.after(c.steps_since_load)
    return (
        name,
        origin if origin in ("model", "checkpoint") else None,
        commits,  # type: ignore[return-value]
    )
