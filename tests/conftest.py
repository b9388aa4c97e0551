"""Shared fixtures.

``default_home``: a ``MISERVER_HOME`` with the embedded default imported (session-scoped; the
import takes ~35 s on two cores, so it happens once per session, and is reused across sessions
from ``/tmp`` while ``default_model.py`` and transformers do not change). Treat it as read-only.

``home_with_default``: a fresh ``MISERVER_HOME`` per test whose catalogue has the two default rows,
pointing at the shared imported folder (no copy). Use it when a test registers rows, saves
checkpoints or writes batch files.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import pytest


def _cache_key() -> str:
    import transformers

    import miserver.serving.default_model as dm

    source = Path(dm.__file__).read_bytes()
    return hashlib.sha256(source + transformers.__version__.encode()).hexdigest()[:12]


@pytest.fixture(scope="session")
def default_home() -> str:
    """Path of a ``MISERVER_HOME`` holding the imported default (rows ``smollm2-135m-instruct``
    and ``smollm2-135m-instruct-q4``). Override the location with ``MISERVER_TEST_HOME``."""
    from miserver.serving.default_model import import_default

    home = os.environ.get("MISERVER_TEST_HOME") or str(
        Path(tempfile.gettempdir()) / f"miserver-test-default-{os.getuid()}-{_cache_key()}")
    import_default(home, progress=False)
    return home


@pytest.fixture
def home_with_default(default_home: str, tmp_path: Path) -> str:
    """A fresh ``MISERVER_HOME`` (under ``tmp_path``) registering the shared default's rows."""
    from miserver.serving.catalogue import Catalogue

    shared = Catalogue(default_home)
    home = tmp_path / "home"
    fresh = Catalogue(home)
    for row in shared.list():
        fresh.register(name=row.name, format=row.format, dtype=row.dtype, path=row.path,
                       quantization=row.quantization, origin=row.origin)
    return str(home)
