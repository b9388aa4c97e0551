"""How a refusal of the weights lifecycle becomes an :class:`ApiError`: the table's code, reason
and status, with the numbers a reader needs and the ``Retry-After`` the row sends.

:class:`Refusals` is the collaborator of :class:`~miserver.serving.weights.runtime.WeightsRuntime`
that words refusals (409 MODEL_BUSY ``drain_timeout``, 503 QUEUE_FULL with its bound) and reads
the ``queue_full`` fact from the scheduler. It decides nothing (the table did) and changes nothing. :class:`WeightsTornError` is the 503 a held request
gets when the set tears.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miserver.fsm.machine import Outcome
from miserver.fsm.table import Answer
from miserver.serving.engine.slot import Priority
from miserver.spec import codes
from miserver.spec.errors import ApiError

#: The ``Retry-After`` value (seconds) of the refusals whose table row sends one (503
#: WEIGHTS_TORN, 503 QUEUE_FULL, 409 MODEL_BUSY when the model changed while a /v1 request waited).
RETRY_AFTER_S = 1


class WeightsTornError(ApiError):
    """503 WEIGHTS_TORN for a request held when the set tore (weights page: States)."""

    def __init__(self) -> None:
        super().__init__(
            codes.WEIGHTS_TORN,
            "The weights are torn. Recover with POST /api/weights/load.",
            details={"recover": "POST /api/weights/load"},
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


class Refusals:
    """The table's refusals as API errors, with the numbers a reader needs.

    Args:
        settings: the validated configuration (the drain timeout it quotes).
        scheduler: :class:`miserver.serving.engine.slot.Scheduler` (the queue bound, the
            waiting count).
        transport: the attachment's :class:`~miserver.serving.weights.transport.AttachmentTransport`
            (the group's state a GROUP_UNAVAILABLE refusal quotes).
        stamp: turns a core time (seconds, the runtime's monotonic clock) into an RFC 3339
            string (the holder's ``attached_at``).
    """

    def __init__(
        self,
        *,
        settings: Any,
        scheduler: Any,
        transport: Any,
        stamp: Callable[[float | None], str | None],
    ) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.transport = transport
        self.stamp = stamp

    def refusal(
        self, out: Outcome, message: str | None = None, headers: dict[str, str] | None = None
    ) -> ApiError:
        """The table's refusal ``out`` as an :class:`ApiError` (``message``: the outcome's own
        unless given; ``headers`` beside ``Retry-After``, which the row decides)."""
        headers = dict(headers or {})
        if out.retry_after:
            headers["Retry-After"] = str(RETRY_AFTER_S)
        message, details = self.with_numbers(out, out.message if message is None else message)
        return ApiError(
            out.code,
            message,
            reason=out.reason,  # type: ignore[arg-type]
            details=details,
            status=out.status,
            headers=headers,
        )

    def drain_timeout_error(self, answer: Answer, running: int, outcome: str) -> ApiError:
        """409 MODEL_BUSY ``drain_timeout`` of a quiesce, a pause or a model transition, worded
        alike (weights page, The write cycle 2): how many requests still ran, the timeout, what
        was left unchanged (``outcome``) and what to do; ``details`` carries the numbers."""
        timeout_s = self.settings.weights_quiesce_drain_timeout_s
        return ApiError(
            answer.code or codes.MODEL_BUSY,
            f"{running} running request(s) did not finish within "
            f"WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S ({timeout_s:g} s); {outcome}. Retry when they end.",
            reason=answer.reason,
            status=answer.status,
            details={"running": running, "drain_timeout_s": timeout_s},
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    def with_numbers(self, out: Outcome, message: str) -> tuple[str, dict[str, Any] | None]:
        """A refusal's message and wire details, with the numbers a reader needs: for 503
        QUEUE_FULL (a quiesce or a held ``/v1`` request) the bound and how many wait, worded
        as the scheduler's own ``/v1`` refusal (issue 16 item 12)."""
        details = self.wire_details(out.details)
        if out.code is codes.QUEUE_FULL:
            bound = self.scheduler.max_queued
            waiting = self.scheduler.interactive_waiting()
            message = (
                f"The request queue is full: MAX_QUEUED_REQUESTS ({bound}) interactive requests"
                f" are already waiting ({waiting} now); retry after Retry-After seconds."
            )
            details = {**(details or {}), "max_queued_requests": bound, "waiting": waiting}
        elif out.code is codes.GROUP_UNAVAILABLE:
            group = self.transport.describe() or {}
            state, error = group.get("group_state"), group.get("error")
            message = f"{message} The group is {state}" + (f": {error}" if error else ".")
            details = {**(details or {}), "group_state": state, "error": error}
        return message, details

    def queue_full(self, priority: Priority = Priority.INTERACTIVE) -> bool:
        """The ``queue_full`` fact of a quiesce or a ``/v1`` request at ``priority``.

        MAX_QUEUED_REQUESTS bounds the interactive requests that wait, queued for a slot or
        held by the barrier (contract 1); batch chunks wait outside that bound (contract 7: a
        batch row waits, it is never refused for a full queue), so they neither count toward
        it nor are refused by it.
        """
        if priority != Priority.INTERACTIVE:
            return False
        return self.scheduler.interactive_waiting() >= self.scheduler.max_queued

    def wire_details(self, details: dict[str, Any]) -> dict[str, Any] | None:
        if not details:
            return None
        out = dict(details)
        holder = out.get("holder")
        if isinstance(holder, dict):
            out["holder"] = {**holder, "attached_at": self.stamp(holder.get("attached_at"))}
        return out
