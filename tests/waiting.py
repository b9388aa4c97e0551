"""Waiting for something a timer or another thread does, without betting on how long it takes.

A fixed ``sleep`` before an assertion is a bet on the machine's speed: on a loaded 2-core runner
the timer or thread may not have run yet. ``wait_until`` polls a condition instead and gives up
only after ``timeout`` seconds (30 by default, a margin no healthy run comes near); a condition
that must *not* happen is still checked after a fixed sleep, which load cannot make fail.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Seconds before a wait gives up: far above any timer the tests set (at most a few seconds).
TIMEOUT_S = 30.0


def wait_until(
    condition: Callable[[], T], what: str, *, timeout: float = TIMEOUT_S, interval: float = 0.02
) -> T:
    """Call ``condition`` every ``interval`` seconds until it returns something truthy, and
    return that. Raises AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what} (last: {value!r})")
        time.sleep(interval)


async def eventually(
    condition: Callable[[], Awaitable[T] | T],
    what: str,
    *,
    timeout: float = TIMEOUT_S,
    interval: float = 0.02,
) -> T:
    """``wait_until`` for a test running on the event loop: ``condition`` may be a coroutine
    function; the loop keeps running (timers fire) between the calls."""
    deadline = time.monotonic() + timeout
    while True:
        value: Any = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what} (last: {value!r})")
        await asyncio.sleep(interval)
