"""The worker threads that run generations (:mod:`miserver.serving.engine.generation`): long-lived
daemon threads, one job at a time each, reused (a fresh thread's first CUDA work is slow)."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("miserver.generation")

_THREAD_IDS = itertools.count(1)


class _WorkerThreads:
    """Long-lived daemon threads that run generations, one at a time each, reused.

    A thread's first CUDA work is slow for a long while: measured on the H200 (2026-11-30,
    torch 2.11, SmolLM2-135M shape), a KV-cache decode loop took 57-67 ms a token in a fresh
    thread against 17.7 ms in a thread that had already run one (and 17-19 ms in the main
    thread); a thread per request made every answer three times slower. Idle threads wait for
    the next job; a job while all are busy gets a new thread (the scheduler bounds how many run).
    A finished job keeps no reference to its generation (an unloaded model can be freed).
    Not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined at interpreter exit,
    so a generation still running at shutdown (nothing cancels it there) would hold the exit;
    these are daemon threads, as the thread per request was.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(
                target=self._serve,
                args=(inbox,),
                daemon=True,
                name=f"miserver-generation-{next(_THREAD_IDS)}",
            ).start()
        inbox.put(job)

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            job = inbox.get()
            try:
                job()
            except BaseException:  # noqa: BLE001 - a job reports its own failures
                log.exception("generation worker: a job raised")
            del job  # hold nothing of a finished generation while idle
            with self._lock:
                self._idle.append(inbox)
