"""The server's half of the process-group transport (contract section 10): one attachment's
own ``torch.distributed`` group, and the receive of a commit straight into the arena.

A trainer on another host cannot open CUDA IPC or shared-memory handles, so it attaches with
``{"transport": "process_group", "init_method": "tcp://HOST:PORT", "world_size": W, "rank": R}``
and writes each commit as one broadcast from rank 0 (the trainer) into every replica's arena:

- :class:`GroupSpec` validates that body (the trainer hosts the ``TCPStore`` at HOST:PORT as
  rank 0; each replica names its own rank 1..W-1).
- :class:`ArenaGroup` is the attachment's group. :meth:`ArenaGroup.start` joins it on a thread
  of its own (an attach answers at once: the group forms only once every rank has joined, and
  the trainer joins last, after attaching to every replica). The group is built from
  ``PrefixStore("miserver", TCPStore(HOST, PORT))`` as ``ProcessGroupGloo`` for a CPU arena and
  ``ProcessGroupNCCL`` for a CUDA arena, never the process's default group.
- :meth:`ArenaGroup.arm` (commit-begin) posts a broadcast from rank 0 into the arena, as a
  ``uint8`` tensor over each storage, or over each byte range the commit-begin body names (in
  that order); no staging buffer, no copy. On CUDA the broadcast is posted on the group's own
  stream (:attr:`ArenaGroup.stream`) and its completion is a CUDA event recorded there.
  The :class:`Receive` it returns answers :meth:`Receive.wait` (commit-end waits on it).
- Every collective of the group runs with the commit watchdog as its timeout
  (``op_timeout_s``): a receive the trainer never finishes fails then, and the measured gloo
  behaviour is that a receive that timed out is never written afterwards
  (``tests/unit/test_process_group.py``: a send after the timeout leaves the arena untouched).
- :meth:`ArenaGroup.destroy` (detach, clear-stale, a tear, an unload, a restart) aborts the
  group: a receive still pending fails; on NCCL the communicator is aborted
  (``ncclCommAbort``). ``ProcessGroupGloo.abort()`` does not cancel a receive already posted
  (measured on torch 2.13: the data still lands after it), so for gloo the bound is the op
  timeout above, and :meth:`ArenaGroup.settled` says when nothing can land any more.

Threads: one joining thread per group, nothing else. The receive's completion is checked by
whoever asks (:meth:`Receive.wait` from commit-end, off the event loop; :meth:`Receive.poll`),
from the backend's works themselves (measured: a ``Future`` callback chain from gloo's threads
cost about 3 ms a step more than a direct ``Work.wait``). Nothing here touches the lifecycle:
the weights runtime arms, waits and destroys as the table's effects say.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import torch

log = logging.getLogger("miserver.ipc.process_group")

#: The ``PrefixStore`` prefix every rank builds the group under (contract section 10).
STORE_PREFIX = "miserver"
#: The transport's name on the wire (attach body, ``storages[].kind``, status, audit).
TRANSPORT = "process_group"
#: How often a CUDA receive's completion is polled (seconds): its event is queried, not waited
#: on, so a stalled trainer never blocks a thread past the watchdog.
CUDA_POLL_S = 0.0002

GroupState = Literal["connecting", "ready", "failed", "destroyed"]


class GroupSpecError(ValueError):
    """The attach body's process-group fields are not usable (400 INVALID_REQUEST): the message
    names the field and what is allowed."""


class RangeError(ValueError):
    """A commit-begin ``ranges`` entry lies outside the arena, is empty, or crosses from one
    storage into the next (400 INVALID_REQUEST)."""


class GroupUnavailable(RuntimeError):
    """The group could not be joined (a timeout, a refused connection), or is destroyed."""


@dataclass(frozen=True)
class GroupSpec:
    """The rendezvous of one attachment (contract section 10).

    Attributes:
        host: the trainer's host (rank 0 serves the ``TCPStore`` there).
        port: its TCP port, 1..65535.
        world_size: ranks in the group, at least 2 (the trainer and one replica).
        rank: this server's rank, 1..world_size-1 (0 is the trainer).
    """

    host: str
    port: int
    world_size: int
    rank: int

    @property
    def init_method(self) -> str:
        """``tcp://HOST:PORT`` (an IPv6 host in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    @classmethod
    def parse(cls, init_method: Any, world_size: Any, rank: Any) -> GroupSpec:
        """Validate the attach body's ``init_method``, ``world_size`` and ``rank``.

        Raises:
            GroupSpecError: ``init_method`` is not ``tcp://HOST:PORT``; ``world_size`` is not an
                integer >= 2; ``rank`` is not an integer in 1..world_size-1.
        """
        if not isinstance(init_method, str) or not init_method.startswith("tcp://"):
            raise GroupSpecError('init_method must be "tcp://HOST:PORT" (the trainer, rank 0)')
        parts = urlsplit(init_method)
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None or not 0 < port < 65536:
            raise GroupSpecError(
                f"init_method {init_method!r}: give a host and a port 1..65535 (tcp://HOST:PORT)"
            )
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
            raise GroupSpecError(f"init_method {init_method!r}: nothing may follow HOST:PORT")
        for name, value in (("world_size", world_size), ("rank", rank)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise GroupSpecError(f"{name} must be an integer")
        if world_size < 2:
            raise GroupSpecError("world_size must be at least 2 (the trainer and this server)")
        if not 0 < rank < world_size:
            raise GroupSpecError(
                f"rank must be in 1..{world_size - 1}: rank 0 is the trainer, which hosts "
                "the rendezvous"
            )
        return cls(parts.hostname, port, world_size, rank)


def resolve_ranges(
    nbytes: Sequence[int], ranges: Sequence[Sequence[int]] | None
) -> list[tuple[int, int, int]]:
    """The byte spans a commit receives, as ``(storage, offset, length)``, in order.

    ``nbytes``: each arena storage's size in bytes. ``ranges``: the commit-begin body's
    ``[[offset, length], ...]`` (contract section 10), offsets in bytes into the arena's
    storages taken one after the other in storage order (with one storage, offsets into it);
    None: every storage whole.

    Raises:
        RangeError: an entry that is not two integers, a negative offset, a length below 1, a
            span past the arena's end or one that crosses from one storage into the next.
    """
    if ranges is None:
        return [(i, 0, int(n)) for i, n in enumerate(nbytes)]
    starts = []
    total = 0
    for n in nbytes:
        starts.append(total)
        total += int(n)
    out = []
    for j, entry in enumerate(ranges):
        if (
            not isinstance(entry, list | tuple)
            or len(entry) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
        ):
            raise RangeError(f"ranges[{j}] must be [offset, length], two integers (bytes)")
        offset, length = entry
        if offset < 0 or length < 1:
            raise RangeError(f"ranges[{j}]: offset must be >= 0 and length >= 1 (bytes)")
        if offset + length > total:
            raise RangeError(
                f"ranges[{j}] = [{offset}, {length}] ends past the arena ({total} bytes)"
            )
        storage = max(i for i, s in enumerate(starts) if s <= offset)
        local = offset - starts[storage]
        if local + length > int(nbytes[storage]):
            raise RangeError(
                f"ranges[{j}] = [{offset}, {length}] crosses from storage {storage} into the "
                "next; give one range per storage"
            )
        out.append((storage, local, length))
    return out


def byte_view(storage: torch.UntypedStorage, offset: int = 0, length: int | None = None):
    """A ``uint8`` tensor over ``length`` bytes of ``storage`` from ``offset`` (no copy)."""
    n = storage.nbytes() - offset if length is None else length
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return t.set_(storage, offset, (n,), (1,))


def _timedelta(seconds: float) -> _dt.timedelta:
    return _dt.timedelta(seconds=float(seconds))


def build_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    device: torch.device,
    *,
    timeout_s: float,
    is_master: bool = False,
    store: Any = None,
) -> tuple[Any, Any]:
    """Join (or, with ``is_master``, host) the rendezvous and build the group of contract
    section 10: ``ProcessGroupGloo`` for a CPU ``device``, ``ProcessGroupNCCL`` for a CUDA one,
    over ``PrefixStore("miserver", store)``. Blocks until every rank has joined, at most
    ``timeout_s`` seconds. Returns ``(group, store)``.

    ``store``: an existing ``TCPStore`` (rank 0 makes it before attaching, so the replicas can
    reach it); None: connect to ``host:port``.

    Raises:
        GroupUnavailable: the rendezvous or the group did not form in time, or the backend is
            missing from this torch build (NCCL on a CPU build).
    """
    import torch.distributed as dist

    timeout = _timedelta(timeout_s)
    try:
        if store is None:
            # A client made with wait_for_workers=True (torch's default) adds itself to the
            # store's worker count and returns (only the master blocks on that count), so a
            # rank 0 that built its TCPStore with torch's defaults, waiting for world_size
            # workers, returns once every replica connected; a rank 0 that does not wait is
            # unaffected (contract section 10). A master here never waits: the group's own
            # join below bounds the wait.
            store = dist.TCPStore(
                host, port, world_size, is_master, timeout, wait_for_workers=not is_master
            )
        prefix = dist.PrefixStore(STORE_PREFIX, store)
        if device.type == "cuda":
            if not dist.is_nccl_available():
                raise GroupUnavailable("this torch build has no NCCL (a CUDA arena needs it)")
            from torch.distributed import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = timeout
            with torch.cuda.device(device):
                group = ProcessGroupNCCL(prefix, rank, world_size, opts)
                # NCCL creates its communicator lazily; a first collective forms it now, so a
                # missing rank fails here (the join), not inside the first commit.
                probe = torch.zeros(1, device=device)
                group.allreduce([probe]).wait()
                torch.cuda.current_stream(device).synchronize()
        else:
            if not dist.is_gloo_available():
                raise GroupUnavailable("this torch build has no gloo")
            from torch.distributed import ProcessGroupGloo

            group = ProcessGroupGloo(prefix, rank, world_size, timeout)
    except GroupUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - any join failure is reported as one error
        raise GroupUnavailable(
            f"could not join the group at tcp://{host}:{port} as rank {rank} of {world_size} "
            f"within {timeout_s:g} s: {exc}"
        ) from exc
    return group, store


def broadcast_options() -> Any:
    """Broadcast from rank 0, tensor 0 (the trainer's buffer)."""
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return opts


def set_op_timeout(group: Any, timeout_s: float) -> None:
    """Make every later collective of ``group`` fail after ``timeout_s`` seconds."""
    setter = getattr(group, "set_timeout", None) or getattr(group, "_set_default_timeout", None)
    if setter is not None:
        with contextlib.suppress(Exception):  # a backend without it keeps its join timeout
            setter(_timedelta(timeout_s))


class Receive:
    """One commit's receive into the arena (armed by commit-begin, awaited by commit-end).

    Attributes:
        spans: ``(storage, offset, length)`` per broadcast, in order (bytes).
        nbytes: the bytes it receives in all.
        armed_at: ``time.monotonic()`` when commit-begin armed it.
        completed_at: when it completed (or failed), or None while pending.
        error: why it failed (a string), or None.

    The completion check (:meth:`wait`, :meth:`poll`) asks the backend's works themselves: on
    gloo ``Work.wait``/``is_completed``; on CUDA a query of the event recorded on the group's
    stream after the broadcasts (never a host-blocking synchronize, so a stalled trainer never
    holds a thread past the deadline).
    """

    def __init__(self, spans: list[tuple[int, int, int]], deadline_s: float) -> None:
        self.spans = spans
        self.nbytes = sum(n for _, _, n in spans)
        self.armed_at = time.monotonic()
        self.deadline = self.armed_at + deadline_s
        self.completed_at: float | None = None
        self.error: str | None = None
        self._done = threading.Event()
        self._posted = threading.Event()
        self._lock = threading.Lock()
        self._works: list[Any] = []
        self._event: Any = None  # the CUDA event after the broadcasts

    @property
    def pending(self) -> bool:
        """Whether it has neither completed nor failed (as last checked: see :meth:`poll`)."""
        return not self._done.is_set()

    @property
    def ok(self) -> bool:
        """Whether every byte arrived."""
        return self._done.is_set() and self.error is None

    def _set_posted(self, works: list[Any], event: Any = None) -> None:
        self._works, self._event = works, event
        self._posted.set()

    def poll(self) -> bool | None:
        """Check without blocking: True (every byte arrived), False (it failed), None
        (still in flight)."""
        if self._done.is_set():
            return self.error is None
        if not self._posted.is_set():
            return None
        if self._event is not None:
            if self._event.query():
                self._finish(None)
                return True
        elif all(w.is_completed() for w in self._works):
            return self.wait(0)
        if time.monotonic() > self.deadline:
            self._finish("the receive did not complete before the commit watchdog")
            return False
        return None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until it completed or failed, at most ``timeout`` seconds (None: until its
        deadline, the op timeout); returns :attr:`ok`. A wait that ends first leaves it
        pending."""
        end = self.deadline if timeout is None else time.monotonic() + max(0.0, timeout)
        if self._done.is_set():
            return self.ok
        if not self._posted.wait(max(0.0, end - time.monotonic())):
            return self.ok
        if self._done.is_set():
            return self.ok
        if self._event is not None:
            while not self._event.query():
                if time.monotonic() > min(end, self.deadline):
                    if time.monotonic() > self.deadline:
                        self._finish("the receive did not complete before the commit watchdog")
                    return self.ok
                time.sleep(CUDA_POLL_S)
            self._finish(None)
            return self.ok
        for w in self._works:
            left = end - time.monotonic()
            try:
                if w.is_completed():
                    w.wait()  # raises the work's own error
                elif left <= 0:
                    return self.ok
                else:
                    w.wait(_timedelta(left))
            except Exception as exc:  # noqa: BLE001 - gloo reports a failure as an exception
                if w.is_completed():
                    self._finish(str(exc))
                return self.ok  # else: only this wait timed out; the work goes on
        self._finish(None)
        return self.ok

    def _finish(self, error: str | None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self.error = error
            self.completed_at = time.monotonic()
            self._done.set()
        self._posted.set()


class ArenaGroup:
    """One attachment's process group over the arena's storages (contract section 10).

    Args:
        spec: the rendezvous (:class:`GroupSpec`).
        storages: the arena's storages, in storage order (all on one device).
        connect_timeout_s: how long joining may take (the trainer must join within it).
        op_timeout_s: every collective's timeout once joined: the commit watchdog.
        builder: what builds the group (tests pass a fake); :func:`build_group` by default.

    Thread-safe: the runtime calls :meth:`arm` and :meth:`destroy` from the event loop while
    the joining thread and the backend's threads finish work.
    """

    def __init__(
        self,
        spec: GroupSpec,
        storages: Sequence[torch.UntypedStorage],
        *,
        connect_timeout_s: float,
        op_timeout_s: float,
        builder: Callable[..., tuple[Any, Any]] = build_group,
    ) -> None:
        if not storages:
            raise ValueError("an arena group needs at least one storage")
        devices = {st.device for st in storages}
        if len(devices) != 1:
            raise GroupSpecError(
                "the process-group transport serves an arena on one device; this arena spans "
                + ", ".join(sorted(map(str, devices)))
            )
        self.spec = spec
        self.storages = list(storages)
        self.nbytes = [st.nbytes() for st in self.storages]
        self.device: torch.device = self.storages[0].device
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.connect_timeout_s = float(connect_timeout_s)
        self.op_timeout_s = float(op_timeout_s)
        self._builder = builder
        # Reentrant: a gloo future that is already done runs its callback at once, inside
        # the post that holds the lock.
        self._lock = threading.RLock()
        self._state: GroupState = "connecting"
        self.error: str | None = None
        self._group: Any = None
        self._store: Any = None
        self._queued: list[Receive] = []
        self._pending: list[Receive] = []
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        #: The CUDA stream the receives are posted on (None for a CPU arena).
        self.stream: Any = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.receives = 0

    # --- state ------------------------------------------------------------------------------
    @property
    def state(self) -> GroupState:
        """``connecting`` (joining), ``ready``, ``failed`` (the join failed: :attr:`error`) or
        ``destroyed``."""
        return self._state

    def describe(self) -> dict[str, Any]:
        """What status shows of the group: ``{transport, backend, init_method, world_size,
        rank, group_state, error}``."""
        return {
            "transport": TRANSPORT,
            "backend": self.backend,
            "init_method": self.spec.init_method,
            "world_size": self.spec.world_size,
            "rank": self.spec.rank,
            "group_state": self._state,
            "error": self.error,
        }

    def start(self) -> ArenaGroup:
        """Start joining the group on a thread of its own; returns at once."""
        with self._lock:
            if self._thread is not None:
                return self
            self._thread = threading.Thread(
                target=self._join, name=f"miserver-pg-rank{self.spec.rank}", daemon=True
            )
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the join ended (at most ``timeout`` s); returns whether it is ready."""
        self._ready.wait(timeout)
        return self._state == "ready"

    def _join(self) -> None:
        try:
            group, store = self._builder(
                self.spec.host,
                self.spec.port,
                self.spec.rank,
                self.spec.world_size,
                self.device,
                timeout_s=self.connect_timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - reported through state and error
            with self._lock:
                if self._state == "connecting":
                    self._state, self.error = "failed", str(exc)
                queued, self._queued = self._queued, []
            log.warning("process group: %s", exc)
            for r in queued:
                r._finish(f"the group was not joined: {exc}")
            self._ready.set()
            return
        set_op_timeout(group, self.op_timeout_s)
        with self._lock:
            if self._state != "connecting":  # destroyed while joining
                queued = []
                self._shutdown(group)
            else:
                self._group, self._store, self._state = group, store, "ready"
                queued, self._queued = self._queued, []
                for r in queued:
                    self._post(r)
        self._ready.set()
        log.info(
            "process group: joined %s as rank %d of %d (%s)",
            self.spec.init_method,
            self.spec.rank,
            self.spec.world_size,
            self.backend,
        )

    # --- receives ---------------------------------------------------------------------------
    def arm(self, ranges: Sequence[Sequence[int]] | None = None) -> Receive:
        """Post the receive of one commit (commit-begin): a broadcast from rank 0 into each
        span, in order. Returns at once; the :class:`Receive` completes when the bytes landed.
        While the group is still joining, the receive is posted as soon as it is joined; a
        failed or destroyed group fails it at once.

        Raises:
            RangeError: ``ranges`` does not fit the arena (:func:`resolve_ranges`).
        """
        spans = resolve_ranges(self.nbytes, ranges)
        receive = Receive(spans, self.op_timeout_s)
        with self._lock:
            self.receives += 1
            if self._state == "ready":
                self._post(receive)
                return receive
            if self._state == "connecting":
                self._queued.append(receive)
                return receive
            state, error = self._state, self.error
        receive._finish(f"the group is {state}" + (f": {error}" if error else ""))
        return receive

    def _post(self, receive: Receive) -> None:
        """Post every broadcast of ``receive`` (under :attr:`_lock`, the group ready)."""
        group, opts = self._group, broadcast_options()
        works: list[Any] = []
        try:
            if self.stream is not None:
                # ordered after everything already queued on the device's default stream (the
                # last forward pass's kernels may still read the weights)
                self.stream.wait_stream(torch.cuda.default_stream(self.device))
                with torch.cuda.stream(self.stream):
                    for i, off, n in receive.spans:
                        works.append(group.broadcast([byte_view(self.storages[i], off, n)], opts))
                    for w in works:
                        w.wait()  # the stream waits for NCCL's own stream (no host block)
                    event = torch.cuda.Event()
                    event.record(self.stream)
                receive._set_posted(works, event)
            else:
                for i, off, n in receive.spans:
                    works.append(group.broadcast([byte_view(self.storages[i], off, n)], opts))
                receive._set_posted(works)
        except Exception as exc:  # noqa: BLE001 - a post that fails fails the receive
            receive._finish(f"the receive could not be posted: {exc}")
            return
        self._pending.append(receive)

    def settled(self) -> bool:
        """Whether no receive is in flight any more (nothing can still land in the arena)."""
        with self._lock:
            self._pending = [r for r in self._pending if r.poll() is None]
            return not self._pending and not self._queued

    # --- teardown ---------------------------------------------------------------------------
    def destroy(self) -> None:
        """Tear the group down (detach, clear-stale, a tear, an unload, a restart). A receive
        still queued fails at once; one in flight fails when the backend gives it up (NCCL:
        aborted now; gloo: at its op timeout, :attr:`op_timeout_s`). Idempotent."""
        with self._lock:
            if self._state == "destroyed":
                return
            self._state = "destroyed"
            group, self._group = self._group, None
            queued, self._queued = self._queued, []
            self._store = None
        for r in queued:
            r._finish("the group was destroyed")
        if group is not None:
            self._shutdown(group)
        self._ready.set()

    def _shutdown(self, group: Any) -> None:
        if self.backend == "nccl":
            with contextlib.suppress(Exception):
                group.abort()
        # gloo: dropping the last reference closes the pairs once its pending works end (their
        # futures hold it); abort() would not cancel them (see the module docstring).

    def __repr__(self) -> str:
        return (
            f"ArenaGroup({self.spec.init_method}, rank={self.spec.rank}/{self.spec.world_size}, "
            f"{self.backend}, {self._state})"
        )
