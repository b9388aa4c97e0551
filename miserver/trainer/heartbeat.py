"""The trainer's heartbeat thread: POST /api/weights/heartbeat every interval on its own
connection, keeping the attachment active (weights page, Timers). A failure is logged and kept
in the client's ``heartbeat_error``; a refusal that cannot heal stops the thread (the next
commit raises it). Run by :meth:`miserver.trainer.client.WeightsClient.start_heartbeat`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from miserver.trainer.errors import NotAttachedHere, WeightsError

log = logging.getLogger("miserver.trainer")

#: Codes after which a heartbeat can never succeed again: the thread stops.
HEARTBEAT_TERMINAL = frozenset(
    {"NOT_ATTACHED", "NOT_ATTACHMENT_HOLDER", "WEIGHTS_UNAUTHORIZED", "WEIGHTS_FORBIDDEN"}
)


def answer_timeout(client: Any) -> float:
    """Seconds one heartbeat may wait for its answer: the server's staleness window (an answer
    within it still keeps the attachment active; a busy server is slow, not gone), at least two
    intervals, at most the client's ``timeout``."""
    interval = client.heartbeat_interval_s or 5.0
    return min(client.timeout, max(2 * interval, client.heartbeat_window_s or 0.0))


def keep_alive(client: Any, stop: threading.Event) -> None:
    """The thread's body: heartbeat every ``client.heartbeat_interval_s`` (the server's
    ``interval_hint_s``, updated from each answer) until ``stop`` is set or a refusal that
    cannot heal (:data:`HEARTBEAT_TERMINAL`) ends it. ``client`` is the
    :class:`~miserver.trainer.client.WeightsClient` (its ``_request`` and ``_hb_session``)."""
    session = client._hb_session
    last_ok = time.monotonic()
    while not stop.wait(client.heartbeat_interval_s or 5.0):
        try:
            data = client._request(
                "POST",
                "/api/weights/heartbeat",
                holder=True,
                session=session,
                timeout=answer_timeout(client),
            )
        except NotAttachedHere:
            return
        except Exception as exc:  # noqa: BLE001 - logged and surfaced, never swallowed
            if stop.is_set():
                return
            client.heartbeat_error = exc
            if isinstance(exc, WeightsError) and exc.code in HEARTBEAT_TERMINAL:
                log.error(
                    "heartbeat refused (%s); the heartbeat stops, and the next commit raises it",
                    exc,
                )
                return
            log.warning(
                "heartbeat failed (%s); retrying in %.1f s",
                exc,
                client.heartbeat_interval_s or 5.0,
            )
            continue
        client.heartbeats_sent += 1
        client.heartbeat_error = None
        hint = data.get("interval_hint_s")
        if isinstance(hint, int | float) and hint > 0:
            client.heartbeat_interval_s = float(hint)
        window = data.get("timeout_s")
        if isinstance(window, int | float) and window > 0:
            client.heartbeat_window_s = float(window)
        gap = time.monotonic() - last_ok
        last_ok = time.monotonic()
        if gap > float(data.get("timeout_s") or float("inf")):
            log.warning(
                "%.1f s since the last heartbeat answered, beyond the server's "
                "%.1f s staleness window: the attachment was stale until now",
                gap,
                data.get("timeout_s"),
            )
