"""Prometheus metrics of one server process (contract section 9), on its own registry.

One :class:`Metrics` per app (a ``CollectorRegistry`` each, so two apps in one test process never
share counters). ``GET /metrics`` answers :meth:`Metrics.render` in the Prometheus text format.
The request metrics are incremented by the scheduler and ``/v1``; the barrier metrics (holds,
commit durations, watchdog expiries, hold timeouts, attach/detach, pinned bytes) are added by the
weights lifecycle on the same registry through :attr:`Metrics.registry`.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

#: Latency buckets in seconds: a 135M model on a CPU answers in 0.05-5 s, a long stream in ~60 s.
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """The metric families of one app.

    Attributes:
        registry: the app's ``CollectorRegistry`` (register further families on it).
        requests_served: ``miserver_requests_served_total{route}``: answered with a 2xx.
        requests_refused: ``miserver_requests_refused_total{route, code}``: answered with an
            error; ``code`` is the management code (``QUEUE_FULL``, ``WEIGHTS_TORN``, ...).
        requests_held: ``miserver_requests_held_total``: requests that waited behind a barrier.
        queue_depth: ``miserver_queue_depth``: interactive requests waiting or held now.
        request_latency: ``miserver_request_latency_seconds{route}``: admission to last byte.
        generation_failures: ``miserver_generation_failures_total{reason}``: 500
            GENERATION_FAILED answers, reason ``non_finite_logits`` or ``error``.
        model_loads: ``miserver_model_loads_total{outcome}``: loads that ended ``ok`` or
            ``failed``.
        model_unloads: ``miserver_model_unloads_total``.
        model_load_seconds: ``miserver_model_load_seconds``: duration of successful loads.
        resident: ``miserver_model_resident{name}``: 1 for the resident row's name, else absent.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests_served = Counter(
            "miserver_requests_served", "Requests answered with a 2xx status", ["route"], registry=r
        )
        self.requests_refused = Counter(
            "miserver_requests_refused",
            "Requests answered with an error, by code",
            ["route", "code"],
            registry=r,
        )
        self.requests_held = Counter(
            "miserver_requests_held", "Requests that waited behind a barrier hold", registry=r
        )
        self.queue_depth = Gauge(
            "miserver_queue_depth", "Interactive requests waiting or held now", registry=r
        )
        self.request_latency = Histogram(
            "miserver_request_latency_seconds",
            "Request latency from admission to last byte",
            ["route"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.generation_failures = Counter(
            "miserver_generation_failures",
            "Generations that failed (500 GENERATION_FAILED), by reason: non_finite_logits"
            " (the weights hold NaN or infinity) or error",
            ["reason"],
            registry=r,
        )
        self.model_loads = Counter(
            "miserver_model_loads",
            "Model loads, by outcome (ok or failed)",
            ["outcome"],
            registry=r,
        )
        self.model_unloads = Counter(
            "miserver_model_unloads", "Model unloads (including the unload of a swap)", registry=r
        )
        self.model_load_seconds = Histogram(
            "miserver_model_load_seconds",
            "Duration of successful model loads",
            buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
            registry=r,
        )
        self.resident = Gauge(
            "miserver_model_resident",
            "1 for the resident model's catalogue name",
            ["name"],
            registry=r,
        )
        # The weights barrier (contract 9), fed by the lifecycle's outcomes.
        self.barrier_holds = Counter(
            "miserver_barrier_holds",
            "Barrier holds (a quiesce or another pause took it)",
            registry=r,
        )
        self.barrier_hold_seconds = Histogram(
            "miserver_barrier_hold_seconds",
            "How long serving was held, per hold",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
            registry=r,
        )
        self.commit_seconds = Histogram(
            "miserver_commit_seconds",
            "Commit durations (commit-begin to commit-end)",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 2, 10),
            registry=r,
        )
        self.watchdog_expiries = Counter(
            "miserver_watchdog_expiries", "Commits torn by the watchdog", registry=r
        )
        self.hold_timeouts = Counter(
            "miserver_hold_timeouts", "Quiesces that resumed on their own", registry=r
        )
        self.attachments = Counter(
            "miserver_attachments",
            "Attach, detach and clear-stale calls accepted",
            ["event"],
            registry=r,
        )
        self.weights_calls = Counter(
            "miserver_weights_calls",
            "Lifecycle events, by trigger and outcome",
            ["trigger", "outcome", "code"],
            registry=r,
        )
        self.pinned_bytes = Gauge(
            "miserver_pinned_bytes",
            "GPU/shared memory the last export pinned (release.pinned_bytes)",
            registry=r,
        )
        # The attachment's transport (contract 10).
        self.attachment_transport = Gauge(
            "miserver_attachment_transport",
            "1 for the current attachment's transport (cuda_ipc, cpu_shared_memory, "
            "process_group); absent with nothing attached",
            ["transport"],
            registry=r,
        )
        self.process_group_receives = Counter(
            "miserver_process_group_receives",
            "Commit receives through an attachment's process group, by outcome (ok, failed)",
            ["outcome"],
            registry=r,
        )
        self.process_group_received_bytes = Counter(
            "miserver_process_group_received_bytes",
            "Bytes received into the arena through an attachment's process group",
            registry=r,
        )
        # The continuous engine's CUDA decode graphs (issue 13, DECODE_GRAPHS).
        self.decode_graph_pool_bytes = Gauge(
            "miserver_decode_graph_pool_bytes",
            "Bytes the continuous engine's decode graphs allocated when they were captured",
            registry=r,
        )
        self.decode_graph_pool_bytes.set_function(lambda: self._graphs_stat("bytes"))
        self.decode_graphs_captured = Gauge(
            "miserver_decode_graphs_captured",
            "Decode graphs (batch-size x block-table width buckets) captured now",
            registry=r,
        )
        self.decode_graphs_captured.set_function(lambda: self._graphs_stat("captured"))
        self.decode_graph_replays = Gauge(
            "miserver_decode_graph_replays",
            "Decode steps run as a replayed CUDA graph since the resident's engine was built",
            registry=r,
        )
        self.decode_graph_replays.set_function(lambda: self._graphs_stat("replays"))
        # The continuous engine (issue 29): its paged KV cache and what runs in it.
        self._engine_loop: Any = None
        self.kv_cache_bytes = Gauge(
            "miserver_kv_cache_bytes",
            "Bytes of the continuous engine's paged KV cache (KV_CACHE_BYTES; 0: no engine)",
            registry=r,
        )
        self.kv_cache_bytes.set_function(lambda: self._loop_stat("cache_bytes"))
        self.kv_cache_blocks = Gauge(
            "miserver_kv_cache_blocks",
            "Blocks of the paged KV cache, by state (total, free)",
            ["state"],
            registry=r,
        )
        self.kv_cache_blocks.labels(state="total").set_function(
            lambda: self._loop_stat("blocks_total")
        )
        self.kv_cache_blocks.labels(state="free").set_function(
            lambda: self._loop_stat("blocks_free")
        )
        self.engine_sequences = Gauge(
            "miserver_engine_sequences",
            "Sequences in the continuous engine, by state (running, waiting)",
            ["state"],
            registry=r,
        )
        for state in ("running", "waiting"):
            self.engine_sequences.labels(state=state).set_function(
                lambda state=state: self._loop_stat(state)
            )
        self.engine_steps = Gauge(
            "miserver_engine_steps",
            "Steps (scheduler steps) the resident's continuous engine has run",
            registry=r,
        )
        self.engine_steps.set_function(lambda: self._loop_stat("steps"))
        self.engine_prefix_cache_hits = Gauge(
            "miserver_engine_prefix_cache_hits",
            "KV blocks taken from the prefix cache (shared prompt prefixes) since the load",
            registry=r,
        )
        self.engine_prefix_cache_hits.set_function(lambda: self._loop_stat("prefix_cache_hits"))
        self.engine_preemptions = Gauge(
            "miserver_engine_preemptions",
            "Running sequences preempted (blocks freed, recomputed later) since the load",
            registry=r,
        )
        self.engine_preemptions.set_function(lambda: self._loop_stat("preemptions"))
        self._hold_started: float | None = None
        self._call_counters: dict[tuple[str, str, str], Any] = {}  # labels() once per series

    def lifecycle_event(self, out: Any) -> None:
        """Record one lifecycle :class:`~miserver.fsm.machine.Outcome` (contract 9)."""
        code = out.code.name if out.code is not None else ""
        key = (out.trigger, out.kind, code)
        counter = self._call_counters.get(key)
        if counter is None:
            counter = self._call_counters[key] = self.weights_calls.labels(*key)
        counter.inc()
        if out.kind != "accepted":
            return
        before, after = out.before.barrier, out.after.barrier
        if before == "serving" and after != "serving":
            self.barrier_holds.inc()
            self._hold_started = time.monotonic()
        elif before != "serving" and after == "serving" and self._hold_started is not None:
            self.barrier_hold_seconds.observe(time.monotonic() - self._hold_started)
            self._hold_started = None
        commit_ms = out.details.get("commit_ms") if out.details else None
        if commit_ms is not None:
            self.commit_seconds.observe(commit_ms / 1000.0)
        if out.trigger == "watchdog_expired":
            self.watchdog_expiries.inc()
        elif out.trigger == "hold_expired":
            self.hold_timeouts.inc()
        elif out.trigger in ("attach", "detach", "clear_stale"):
            self.attachments.labels(event=out.trigger).inc()

    def set_transport(self, name: str | None) -> None:
        """The current attachment's transport (None: nothing attached), contract 10."""
        self.attachment_transport.clear()
        if name is not None:
            self.attachment_transport.labels(transport=name).set(1)

    def process_group_receive(self, ok: bool, nbytes: int) -> None:
        """Count one commit's receive through a process group (contract 10)."""
        self.process_group_receives.labels(outcome="ok" if ok else "failed").inc()
        if ok:
            self.process_group_received_bytes.inc(nbytes)

    def set_engine_loop(self, loop: Any) -> None:
        """The resident's continuous engine thread, read by the engine gauges (None: none)."""
        self._engine_loop = loop

    def _loop_stat(self, name: str) -> float:
        loop = self._engine_loop
        if loop is None or loop.closed:
            return 0.0
        try:
            return float(loop.stats().get(name, 0))
        except Exception:  # noqa: BLE001 - a scrape never fails for a gauge
            return 0.0

    def _graphs_stat(self, name: str) -> float:
        """A figure of the engine's decode graphs (``stats()["decode_graphs"]``; a list counts
        its entries); 0 without an engine or graphs."""
        loop = self._engine_loop
        if loop is None or loop.closed:
            return 0.0
        try:
            value = (loop.stats().get("decode_graphs") or {}).get(name, 0)
            return float(len(value) if isinstance(value, list | dict) else value)
        except Exception:  # noqa: BLE001 - a scrape never fails for a gauge
            return 0.0

    def set_resident(self, name: str | None) -> None:
        """Record the resident row's name (None: nothing resident)."""
        self.resident.clear()
        if name is not None:
            self.resident.labels(name=name).set(1)

    def render(self) -> tuple[bytes, str]:
        """``(body, content_type)`` of ``GET /metrics`` in the Prometheus text format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
