"""A miserver app with no model, for tests of what needs none (errors, auth, audit refusals):
it starts in well under a second."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from miserver.http.app import create_app
from miserver.http.protocol import AppRunner
from miserver.spec.settings import Settings, load_settings


def model_free_settings(tmp_path: Path, tokens: str, **env: str) -> Settings:
    """Settings with ``MISERVER_HOME`` under ``tmp_path``, no DEFAULT_MODEL, the CPU, and
    ``WEIGHTS_TOKENS`` = ``tokens``; ``env`` adds or overrides variables."""
    return load_settings(
        {
            "MISERVER_HOME": str(tmp_path / "home"),
            "DEFAULT_MODEL": "",
            "DEVICE": "cpu",
            "WEIGHTS_TOKENS": tokens,
            **env,
        }
    )


async def model_free_client(settings: Settings) -> TestClient:
    """A started aiohttp test client of the app (close it when done)."""
    client = TestClient(TestServer(create_app(settings)))
    await client.start_server()
    return client


@contextlib.asynccontextmanager
async def served_port(settings: Settings) -> AsyncIterator[int]:
    """The app served on a free loopback port through the runner ``miserver serve`` uses (its
    low-level errors and connection handling); yields the port."""
    runner = AppRunner(create_app(settings))
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
