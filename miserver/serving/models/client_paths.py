"""Checks on a filesystem path a client sends (``POST /api/models``, ``POST /api/weights/adapter``).

A path in a request names a file on the *server*. Anything about it a client can get wrong is a
``400 INVALID_REQUEST`` naming the field, never a 500 from the operating system: empty, holding
a NUL, relative (it would resolve against the server's working directory, which is not the
caller's), longer than the server's limits (``ENAMETOOLONG``), a symlink loop (``ELOOP``), or a
path the server may not look at (``EACCES``). A path that does not exist passes: each route says
so in its own words.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

#: Linux's limits (``PATH_MAX`` and ``NAME_MAX``, in bytes); the operating system's own answer
#: is checked as well, so another system's smaller limits are reported the same way.
PATH_MAX = 4096
NAME_MAX = 255
#: The longest path accepted, in bytes: room is left for one more name (a file inside the
#: folder, such as ``adapter_config.json``), so no later look inside fails for its length.
MAX_PATH_BYTES = PATH_MAX - NAME_MAX - 2


class ClientPathError(ValueError):
    """A client's path cannot be used; ``str(exc)`` is the message (it starts with ``path``)."""


def _shown(raw: str) -> str:
    return repr(raw[:200] + "..." if len(raw) > 200 else raw)


def check_path_syntax(raw: object) -> Path:
    """The checks of :func:`check_client_path` that do not look at the server's files: a
    non-empty absolute path without NUL, within ``MAX_PATH_BYTES`` and ``NAME_MAX``. What they
    say depends only on the string sent, so any caller may be told (issue 32, item 13).

    Raises:
        ClientPathError: as :func:`check_client_path` for these cases.
    """
    if not isinstance(raw, str) or not raw or "\x00" in raw:
        raise ClientPathError("path must be a non-empty absolute path")
    path = Path(raw)
    if not path.is_absolute():
        raise ClientPathError(
            f"path must be absolute (the server's working directory is not yours): {_shown(raw)}"
        )
    try:
        encoded = os.fsencode(raw)
    except UnicodeError:
        raise ClientPathError(f"path cannot be encoded on the server: {_shown(raw)}") from None
    if len(encoded) > MAX_PATH_BYTES:
        raise ClientPathError(
            f"path is too long: {len(encoded)} bytes, the server's limit is {MAX_PATH_BYTES}:"
            f" {_shown(raw)}"
        )
    longest = max(len(part) for part in encoded.split(b"/"))
    if longest > NAME_MAX:
        raise ClientPathError(
            f"path has a name of {longest} bytes, the server's limit is {NAME_MAX}: {_shown(raw)}"
        )
    return path


def check_client_path(raw: object) -> Path:
    """Check a client's absolute ``path`` and look it up once; returns ``Path(raw)``.

    The path is resolved (symlinks followed) and ``stat``-ed, so that a caller's later
    ``exists()`` / ``is_dir()`` on it cannot raise: a path that does not exist is returned as is.

    Raises:
        ClientPathError: empty, holding a NUL, not absolute, too long (over ``MAX_PATH_BYTES``
            bytes, or one name over ``NAME_MAX``), a symlink loop, or not readable by the server. The
            message names ``path`` and shows at most 200 characters of it.
    """
    path = check_path_syntax(raw)
    try:
        resolved = path.resolve()
        resolved.stat()
    except RuntimeError:  # Python 3.11's resolve() reports a loop this way
        raise ClientPathError(f"path is a symlink loop on the server: {_shown(raw)}") from None
    except FileNotFoundError:
        return path
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ClientPathError(f"path is a symlink loop on the server: {_shown(raw)}") from None
        if exc.errno == errno.ENAMETOOLONG:
            raise ClientPathError(
                f"path is too long once its symlinks are followed: {_shown(raw)}"
            ) from None
        if exc.errno == errno.ENOTDIR:
            return path  # a file named as a folder on the way: it does not exist
        raise ClientPathError(
            f"path cannot be read on the server ({exc.strerror or exc}): {_shown(raw)}"
        ) from None
    return path
