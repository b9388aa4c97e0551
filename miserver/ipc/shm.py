"""The server's CPU shared-memory files (contract section 8): owned, named, removed by the server.

PyTorch's file-system sharing strategy keeps a reference count in each file's 64-byte header and
makes whoever brings it to zero ``shm_unlink`` the file; a close that finds the name already gone
aborts the process ("could not unlink the shared memory file", exit 134). That count is shared
with every trainer: two processes rebuilding one attach body, or a body rebuilt after detach,
moved it to zero while the server still served the file. So the server owns its files instead:

- :func:`adopt` pins a storage's header count far from zero (no close in any process ever
  unlinks it) and renames the file ``miserver-<server id>-a<n>``; the server's mapping is kept.
- :func:`export_name` gives each attach its own hard link (``...-a<n>-e<k>``), the name the body
  carries; :func:`revoke_exports` (detach, clear-stale, heartbeat loss, unload) removes those
  links, so a body kept from an earlier attach is refused when rebuilt (``ENOENT``), while a
  trainer that still maps it keeps its pages.
- :func:`release` (unload) removes the arena's name and its links: the memory is freed once the
  last process that maps it unmaps it.
- Each server holds an ``flock`` on ``miserver-<server id>.lock`` for its life;
  :func:`sweep_dead` (at start) removes the files of every server whose lock is free (it died),
  also across PID namespaces that share /dev/shm (the Kubernetes ``hostIPC`` component).

Linux only (POSIX shared memory under :data:`SHM_DIR`); elsewhere nothing is renamed or swept.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import itertools
import logging
import os
import re
import secrets
import threading

import torch

log = logging.getLogger("miserver.ipc.shm")

SHM_DIR = "/dev/shm"
PREFIX = "miserver-"
#: The header count each adopted file is set to: no sequence of closes reaches zero from it.
PIN = 1 << 30
_NAME = re.compile(r"^miserver-([0-9a-f]{16})(?:\.lock|-a\d+(?:-e\d+)?)$")

_lock = threading.Lock()
_server_id: str | None = None
_lock_fd: int | None = None
_arenas = itertools.count(1)
_exports = itertools.count(1)
#: arena name -> export link names still present
_links: dict[str, list[str]] = {}


def available() -> bool:
    """Whether POSIX shared memory lives in :data:`SHM_DIR` here (Linux)."""
    return os.path.isdir(SHM_DIR)


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name.lstrip("/"))


def server_id() -> str:
    """This process's id (16 hex digits), taking its lock file on first use."""
    global _server_id, _lock_fd
    with _lock:
        if _server_id is None:
            sid = secrets.token_hex(8)
            fd = os.open(_path(f"{PREFIX}{sid}.lock"), os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            _server_id, _lock_fd = sid, fd
            atexit.register(release_all)
        return _server_id


def adopt(storage: torch.UntypedStorage) -> str:
    """Take ownership of a storage already in shared memory (``_share_filename_cpu_``).

    Returns the file's name as a shm handle (``/miserver-<id>-a<n>``). Without
    :func:`available` the storage's own torch name is returned unchanged.
    """
    _manager, handle, _size = storage._share_filename_cpu_()
    name = handle.decode()
    if not available():
        return name
    path = _path(name)
    fd = os.open(path, os.O_RDWR)
    try:
        count = int.from_bytes(os.pread(fd, 4, 0), "little", signed=True)
        if not 0 < count < PIN:  # not the header layout this module knows: leave it alone
            log.warning("shared-memory file %s has an unexpected header; not adopted", name)
            return name
        os.pwrite(fd, PIN.to_bytes(4, "little", signed=True), 0)
    finally:
        os.close(fd)
    new = f"/{PREFIX}{server_id()}-a{next(_arenas)}"
    os.rename(path, _path(new))
    with _lock:
        _links[new] = []
    return new


def export_name(arena_name: str) -> str:
    """A fresh name for one attach of ``arena_name`` (a hard link), valid until
    :func:`revoke_exports`. Returns ``arena_name`` itself for a file this module did not adopt."""
    with _lock:
        links = _links.get(arena_name)
        if links is None:
            return arena_name
        name = f"{arena_name}-e{next(_exports)}"
        os.link(_path(arena_name), _path(name))
        links.append(name)
        return name


def revoke_exports(arena_name: str | None = None) -> int:
    """Remove the attach names of one arena (or of all): a body carrying one can no longer be
    rebuilt; processes that mapped it keep their pages. Returns how many were removed."""
    with _lock:
        arenas = list(_links) if arena_name is None else [arena_name]
        names = [n for a in arenas for n in _links.get(a, [])]
        for a in arenas:
            if a in _links:
                _links[a] = []
    for n in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path(n))
    return len(names)


def release(arena_name: str) -> None:
    """Remove an arena's file and its attach names (the server no longer serves it)."""
    revoke_exports(arena_name)
    with _lock:
        owned = _links.pop(arena_name, None) is not None
    if owned:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path(arena_name))


def release_all() -> None:
    """Remove every file this process owns, its lock last (at exit, whatever was resident)."""
    global _server_id, _lock_fd
    for name in list(_links):
        release(name)
    with _lock:
        sid, fd = _server_id, _lock_fd
        _server_id = _lock_fd = None
    if sid is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path(f"{PREFIX}{sid}.lock"))
    if fd is not None:
        os.close(fd)


def sweep_dead() -> list[str]:
    """Remove the files of miserver processes that died (their lock is free). Returns the names
    removed. Files of live servers (lock held, in any PID namespace) are never touched."""
    if not available():
        return []
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    by_server: dict[str, list[str]] = {}
    for entry in entries:
        m = _NAME.match(entry)
        if m:
            by_server.setdefault(m.group(1), []).append(entry)
    removed: list[str] = []
    for sid, names in by_server.items():
        if sid == _server_id:
            continue
        lock_name = f"{PREFIX}{sid}.lock"
        fd = None
        if lock_name in names:
            try:
                fd = os.open(_path(lock_name), os.O_RDWR)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: that server is alive
                if fd is not None:
                    os.close(fd)
                continue
        try:
            for n in sorted(names, key=lambda n: n.endswith(".lock")):  # the lock last
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_path(n))
                    removed.append(n)
        finally:
            if fd is not None:
                os.close(fd)
    if removed:
        log.info("removed %d shared-memory file(s) left by a stopped miserver", len(removed))
    return removed
