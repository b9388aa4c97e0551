"""The typed application keys every route family reads (``request.app[keys.HOST]``).

Set by :func:`miserver.http.app.create_app`. ``WEIGHTS_SUMMARY`` is the place the weights
lifecycle (issue 5) plugs the short summary ``/api/health/detailed`` carries (weights page:
Status, last paragraph); until it is set, ``weights`` is null there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from miserver.serving.engine.slot import Scheduler
from miserver.serving.metrics import Metrics
from miserver.serving.models.catalogue import Catalogue
from miserver.serving.models.host import ModelHost
from miserver.serving.weights.runtime import WeightsRuntime
from miserver.spec.settings import Settings

SETTINGS: web.AppKey[Settings] = web.AppKey("settings", Settings)
HOST: web.AppKey[ModelHost] = web.AppKey("host", ModelHost)
SCHEDULER: web.AppKey[Scheduler] = web.AppKey("scheduler", Scheduler)
CATALOGUE: web.AppKey[Catalogue] = web.AppKey("catalogue", Catalogue)
METRICS: web.AppKey[Metrics] = web.AppKey("metrics", Metrics)
#: The weights lifecycle of this process: every load, unload, /v1 admission and weights call
#: goes through it (issue 5).
WEIGHTS: web.AppKey[WeightsRuntime] = web.AppKey("weights", WeightsRuntime)
#: ``() -> dict`` giving ``{weights_state, barrier, attached, attachment_state}``; may raise.
WEIGHTS_SUMMARY: web.AppKey[Callable[[], dict[str, Any]]] = web.AppKey("weights_summary")
#: The start-up task that loads ``DEFAULT_MODEL`` (await it in tests; None when nothing loads).
STARTUP_LOAD: web.AppKey[asyncio.Task[Any] | None] = web.AppKey("startup_load")
