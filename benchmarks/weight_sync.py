"""Weight-sync overhead per training step: miserver's barrier against bucketed IPC copies.

The wall time an update adds beyond the trainer's own optimizer step, with the server idle, for
0.5B- and 8B-shaped bfloat16 models (random weights), in one run (docs/benchmarks.md, section
"Weight-sync overhead per training step")::

    python benchmarks/weight_sync.py [--sizes 0.5b,8b] [--steps 500] [--baseline-steps 100]
                                     [--bucket-mib 512] [--block 10] [--profile]
                                     [--no-baseline] [--no-unix]
                                     [--out DIR]                    # DIR defaults to $OUT

Rows (each size in one run; the two modes of a server alternate in blocks of ``--block`` steps,
so a drift of the machine falls on both alike):

- **miserver, pipelined**: a server process runs the real application
  (``miserver.http.app.create_app``: the real lifecycle, scheduler, audit and access logs,
  served as ``miserver serve`` serves it) whose model host loads a random model of the size
  through the real attachable hook (``miserver.serving.models.loader.make_attachable``: one parameter
  arena). This process (the trainer) attaches with :class:`miserver.trainer.WeightsClient` and,
  per step, runs ``with client.commit(): write()``: quiesce + commit-begin pipelined on the
  keep-alive connection, the in-place write of every parameter (a ``torch._foreach_mul_``, then
  a synchronize), commit-end + resume pipelined. The overhead is the two pairs; the write is
  timed apart (both approaches pay it).
- **miserver, sequential**: the same server, the same attachment and write, four calls each
  sent after the previous answer (``http.client`` keep-alive, ``TCP_NODELAY``).
- **miserver, pipelined, Unix socket**: the same server also listens on a ``UNIX_SOCKET``; a
  second ``WeightsClient(..., unix_socket=...)`` with the same attachment runs the pipelined
  step there (left out with ``--no-unix``).
- **baseline** (what other servers do): the trainer holds its own copy of the weights; after its
  optimizer step it flattens the parameters into buckets (``--bucket-mib``), shares each bucket
  with ``torch.multiprocessing.reductions.reduce_tensor`` (a CUDA IPC handle), sends it over a
  pipe to the server process, which rebuilds it, copies it into its own parameters,
  synchronizes and acknowledges; the next bucket follows. The overhead is the whole transfer.
  (A pipe, not HTTP: that favours the baseline.)
- **bare aiohttp** (the machine's floor): the same three modes with the same clients against an
  aiohttp app whose four POST routes only answer a small JSON envelope: back to back, and per
  size around the same write (on a virtual machine a call after an idle gap is slower).

**The server's own cost per call**, three ways: end to end (miserver minus bare, same mode,
same write, over 4 calls), in the server (each barrier call's handler time as aiohttp's access
logger sees it, miserver minus bare), and the server's CPU (its event loop thread's CPU time per
call, ``/proc/<pid>/schedstat``, miserver minus bare: the measure that holds on a shared
machine, where wall times include time spent descheduled). ``--profile`` adds a cProfile of the
miserver server's event loop (CPU time) over more steps after the timed ones, written to
``<out>/profile/``.

Without CUDA (``--sizes tiny`` for a quick check) the same runs use CPU shared memory: miserver
with ``WEIGHTS_CPU_ATTACH=1``, the baseline through PyTorch's file-system sharing strategy.

Memory: per process, what PyTorch's CUDA allocator holds (max allocated during the steps, peak
reset after set-up), and the whole card's use during the steps (``cudaMemGetInfo``); on the CPU,
each process's maximum resident set size. A second copy of the weights shows as a process
holding about one model's size.

Exit status 0 when every run completed and its check passed (miserver: ``steps_since_load``
counted every commit of both modes; baseline: the server's parameters equal the trainer's after
the last step).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import json
import logging
import multiprocessing
import os
import pickle
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from attach import SHAPES as ATTACH_SHAPES  # noqa: E402  (benchmarks/attach.py, beside this file)

#: model_type and config of each size. 0.5b is Qwen2.5-0.5B's shape (tied embeddings), 8b is
#: Llama-3-8B's (untied), as in benchmarks/attach.py; tiny is for a quick check on the CPU.
SIZES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": (
        "llama",
        dict(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=512,
        ),
    ),
    # the 0.5B and 8B shapes are those of the attach benchmark (one definition)
    **ATTACH_SHAPES,
}
#: The trainer token the benchmark's servers are configured with (a throwaway secret).
TOKEN_LABEL = "bench"
TOKEN_SECRET = "bench-secret-0123456789abcdef"
BARRIER = ("quiesce", "commit-begin", "commit-end", "resume")
GIB = 2**30


# --- small shared pieces (serving_under_training.py imports these) ------------------------------
def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear interpolation (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class HttpFailure(RuntimeError):
    """A call answered with a status other than 200 or an envelope with success false."""

    def __init__(self, method: str, path: str, status: int, error: Any) -> None:
        super().__init__(f"{method} {path}: HTTP {status} {error}")
        self.status = status
        self.error = error if isinstance(error, dict) else {}


class KeepAliveClient:
    """One persistent HTTP/1.1 connection to ``127.0.0.1:port`` (``TCP_NODELAY``), as a trainer
    would hold one to its server. :meth:`post` returns the envelope's ``data``."""

    def __init__(self, port: int, token: str | None = None, timeout: float = 120.0) -> None:
        self.port = port
        self.timeout = timeout
        self.base = {"Content-Length": "0"}
        if token is not None:
            self.base["Authorization"] = f"Bearer {token}"
        self.attachment: str | None = None
        self._connect()

    def _connect(self) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        self.conn.connect()
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def request(self, method: str, path: str) -> tuple[int, Any]:
        """(status, decoded JSON body)."""
        headers = (
            self.base
            if self.attachment is None
            else {**self.base, "X-miLLM-Attachment": self.attachment}
        )
        try:
            self.conn.request(method, path, headers=headers)
            resp = self.conn.getresponse()
        except (ConnectionError, http.client.HTTPException):
            self.conn.close()  # the server closed an idle keep-alive connection: once more
            self._connect()
            self.conn.request(method, path, headers=headers)
            resp = self.conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else None

    def post(self, path: str, method: str = "POST") -> Any:
        status, body = self.request(method, path)
        if status != 200 or not isinstance(body, dict) or body.get("success") is False:
            raise HttpFailure(
                method, path, status, body.get("error") if isinstance(body, dict) else body
            )
        return body.get("data", body)

    def close(self) -> None:
        self.conn.close()


def wait_until(
    predicate: Callable[[], bool], proc: subprocess.Popen | None, what: str, timeout: float = 900.0
) -> None:
    """Poll ``predicate`` (connection errors count as False) until it holds; raise on timeout
    or when ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the server exited with status {proc.returncode}")
        with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
            if predicate():
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what}: not ready after {timeout:.0f} s")


def get_json(port: int, path: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def stop_process(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def child_env(**extra: str) -> dict[str, str]:
    """This environment with the repository on PYTHONPATH and no inherited WEIGHTS_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


# --- models and memory --------------------------------------------------------------------------
def pick_device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def model_config(size: str) -> Any:
    import transformers

    model_type, kw = SIZES[size]
    return transformers.CONFIG_MAPPING[model_type](**kw)


def random_model(size: str, device: str, seed: int = 0) -> Any:
    """A causal LM of ``size``'s shape, bfloat16, random N(0, 0.02) weights, on ``device``
    (for moving weights only: its buffers are left uninitialised)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            model_config(size), dtype=torch.bfloat16
        )
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # buffers stay uninitialised: no forward pass runs
            p.normal_(0.0, 0.02, generator=gen)
    model.eval()
    sync(device)
    return model


def unique_parameters(model: Any) -> list[Any]:
    """Each parameter once (a tied one once), in ``named_parameters`` order."""
    return [p for _, p in model.named_parameters()]


def memory(device: str, reset: bool = False) -> dict[str, float]:
    """This process's memory: CUDA allocator bytes (allocated, peak since the last reset,
    reserved) on CUDA; maximum resident set size on the CPU."""
    import torch

    out: dict[str, float] = {"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.startswith("cuda"):
        out.update(
            allocated=torch.cuda.memory_allocated(device),
            peak=torch.cuda.max_memory_allocated(device),
            reserved=torch.cuda.memory_reserved(device),
        )
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
    return out


def card_used(device: str) -> float | None:
    """Bytes in use on the whole card (every process), or None on the CPU."""
    import torch

    if not device.startswith("cuda"):
        return None
    free, total = torch.cuda.mem_get_info(device)
    return float(total - free)


def in_place_write(params: list[Any], device: str) -> None:
    """The optimizer step both approaches pay: every parameter written in place, then a sync."""
    import torch

    with torch.no_grad():
        torch._foreach_mul_(params, 1.0)
    sync(device)


# --- server roles (child processes) -------------------------------------------------------------
#: Handler times (seconds) of the barrier calls this server answered, recorded by its access
#: logger (aiohttp times a request from its parsed message to its response written: the
#: server's Python work for the call, HTTP parsing and the socket aside).
HANDLER_TIMES: list[float] = []


def _recording(logger_class: type) -> type:
    """``logger_class`` (an aiohttp access logger) that also records each barrier call's time."""

    class Recording(logger_class):  # type: ignore[misc, valid-type]
        def log(self, request: Any, response: Any, time: float) -> None:
            if request.path.rsplit("/", 1)[-1] in BARRIER:
                HANDLER_TIMES.append(time)
            super().log(request, response, time)

        @property
        def enabled(self) -> bool:
            return True  # record also when the access log itself is off (the bare server)

    return Recording


def _bench_routes(app: Any, device: str | None) -> None:
    """``/bench/*`` routes of a benchmark server: its memory, the recorded handler times, and a
    cProfile of its event loop (``POST /bench/profile?start``, ``?stop=<path>``: pstats file)."""
    import cProfile

    from aiohttp import web

    prof: dict[str, Any] = {}

    async def bench_memory(request: web.Request) -> web.Response:
        return web.json_response(memory(device or "cpu", reset="reset" in request.query))

    async def handler_times(request: web.Request) -> web.Response:
        out = list(HANDLER_TIMES)
        HANDLER_TIMES.clear()
        return web.json_response(out)

    async def profile(request: web.Request) -> web.Response:
        if "start" in request.query:
            # CPU time of the event loop's thread: on a shared machine, wall time would also
            # count the time the server sat descheduled
            prof["p"] = cProfile.Profile(time.thread_time)
            prof["p"].enable()
        else:
            p = prof.pop("p")
            p.disable()
            p.dump_stats(request.query["stop"])
        return web.json_response({"ok": True})

    app.router.add_get("/bench/memory", bench_memory)
    app.router.add_get("/bench/handler-times", handler_times)
    app.router.add_post("/bench/profile", profile)


def serve_miserver(size: str) -> None:
    """The miserver server process: the real app (``create_app``, ``web.run_app``, logging as
    ``miserver serve`` sets it up) with a model host whose loader builds a random model and makes
    it attachable through the loader's own hook. Settings come from the environment."""
    from miserver.http.app import create_app
    from miserver.http.protocol import run_app
    from miserver.server import AccessLogger, configure_logging
    from miserver.serving.models import loader as loader_module
    from miserver.serving.models.catalogue import Catalogue
    from miserver.serving.models.host import ModelHost
    from miserver.spec.settings import load_settings

    settings = load_settings()
    configure_logging(settings)
    device = settings.resolved_device()
    catalogue = Catalogue(settings.home)
    if catalogue.get_by_name(settings.default_model) is None:
        folder = Path(settings.home) / "models" / settings.default_model
        model_config(size).save_pretrained(folder)  # config.json only: the row's check
        catalogue.register(
            name=settings.default_model, format="safetensors", dtype="bfloat16", path=folder
        )

    def load_random(row: Any, s: Any) -> Any:
        import torch

        model = random_model(size, device)
        arena = loader_module.make_attachable(model, s)
        if device.startswith("cuda"):  # the random copy the arena replaced: give it back
            torch.cuda.empty_cache()
        return loader_module.LoadedModel(
            model=model,
            tokenizer=None,
            device=next(model.parameters()).device,
            attachable=arena is not None,
            arena=arena,
        )

    host = ModelHost(settings, catalogue, loader=load_random)
    app = create_app(settings, host=host)
    _bench_routes(app, device)
    run_app(  # as `miserver serve` runs it, its access logger recording the barrier calls
        app,
        host=settings.host,
        port=settings.port,
        unix_socket=settings.unix_socket,
        shutdown_timeout=10.0,
        access_log=logging.getLogger("miserver.server.access"),
        access_log_class=_recording(AccessLogger),
    )


def serve_bare() -> None:
    """The floor: an aiohttp app whose four POST routes only answer a small JSON envelope."""
    from aiohttp import web
    from aiohttp.abc import AbstractAccessLogger

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(
            {"success": True, "data": {"weights_state": "clean"}, "error": None}
        )

    class NoAccessLog(AbstractAccessLogger):
        """Logs nothing (the recording subclass records the times)."""

        def log(self, request: Any, response: Any, time: float) -> None:
            pass

    app = web.Application()
    for name in BARRIER:
        app.router.add_post(f"/api/weights/{name}", handler)
    app.router.add_get("/ready", handler)
    _bench_routes(app, None)
    web.run_app(
        app,
        host="127.0.0.1",
        port=int(os.environ["PORT"]),
        path=os.environ.get("UNIX_SOCKET") or None,  # with it: TCP and the socket, as miserver
        print=None,
        access_log=logging.getLogger("bare.access"),
        access_log_class=_recording(NoAccessLog),  # times recorded as miserver's, not logged
    )


def bucket_plan(params: list[Any], bucket_bytes: int) -> list[list[int]]:
    """Parameter indices per bucket, greedy in order; a parameter larger than a bucket gets
    one of its own (as SGLang's and vLLM's bucketed updates do)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, p in enumerate(params):
        n = p.numel() * p.element_size()
        if current and used + n > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        buckets.append(current)
    return buckets


def baseline_server(conn: Any, size: str, device: str, bucket_bytes: int) -> None:
    """The baseline server process: holds its own parameters; for each bucket message rebuilds
    the shared tensor, copies it into its parameters, synchronizes and acknowledges."""
    import torch
    import torch.multiprocessing as tmp

    if device == "cpu":
        tmp.set_sharing_strategy("file_system")
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    model = random_model(size, device, seed=1)
    params = unique_parameters(model)
    buckets = bucket_plan(params, bucket_bytes)
    layouts = []  # per bucket: [(param, offset, numel)]
    for idxs in buckets:
        off, entries = 0, []
        for i in idxs:
            entries.append((params[i], off, params[i].numel()))
            off += params[i].numel()
        layouts.append(entries)
    conn.send(("ready", memory(device, reset=True), len(buckets)))
    while True:
        msg = pickle.loads(conn.recv_bytes())
        if msg == "stop":
            conn.send(("stopped", memory(device)))
            return
        if msg == "checksum":
            conn.send([float(params[i].detach().float().sum()) for i in (0, len(params) // 2, -1)])
            continue
        b, fn, args = msg
        flat = fn(*args)
        entries = layouts[b]
        with torch.no_grad():
            torch._foreach_copy_(
                [p for p, _, _ in entries], [flat[o : o + n].view(p.shape) for p, o, n in entries]
            )
        sync(device)
        del flat
        conn.send_bytes(b"ok")


# --- the trainer side (this process) -------------------------------------------------------------
def start_miserver(
    size: str, device: str, workdir: Path, unix_socket: str | None = None
) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    home = workdir / f"home-{size}"
    log_path = workdir / f"miserver-{size}.log"
    env = child_env(
        MISERVER_HOME=str(home),
        HOST="127.0.0.1",
        PORT=str(port),
        DEVICE=device,
        DEFAULT_MODEL=f"random-{size}",
        WEIGHTS_TOKENS=f"{TOKEN_LABEL}:trainer:{TOKEN_SECRET}",
        WEIGHTS_CPU_ATTACH="1" if device == "cpu" else "0",
        # a CPU write on a loaded machine can outlast the GPU-sized 800 ms default
        **({"WEIGHTS_COMMIT_WATCHDOG_MS": "30000"} if device == "cpu" else {}),
        LOG_LEVEL="info",
        LOG_FORMAT="json",
        UNIX_SOCKET=unix_socket or "",
    )
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--role", "miserver", "--sizes", size],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )

    def loaded() -> bool:
        data = get_json(port, "/api/weights/status")["data"]
        return data["resident_model"] is not None

    try:
        wait_until(loaded, proc, f"miserver server ({size}); log {log_path}")
    except BaseException:
        stop_process(proc)
        sys.stderr.write(log_path.read_text(errors="replace")[-4000:])
        raise
    return proc, port, log_path


def timed_barrier(
    client: KeepAliveClient, write: Callable[[], None]
) -> tuple[list[float], float, dict]:
    """One step, four sequential calls: quiesce, commit-begin, ``write()``, commit-end, resume,
    each sent once the previous one has answered. Returns the four calls' seconds, the write's
    seconds and the commit-end answer."""
    t = time.perf_counter()
    client.post("/api/weights/quiesce")
    t1 = time.perf_counter()
    client.post("/api/weights/commit-begin")
    t2 = time.perf_counter()
    write()
    t3 = time.perf_counter()
    end = client.post("/api/weights/commit-end")
    t4 = time.perf_counter()
    client.post("/api/weights/resume")
    t5 = time.perf_counter()
    return [t1 - t, t2 - t1, t4 - t3, t5 - t4], t3 - t2, end


def timed_commit(client: Any, write: Callable[[], None]) -> tuple[list[float], float, dict]:
    """One step through ``WeightsClient.commit()``: two pipelined pairs (quiesce + commit-begin,
    the block's ``write()``, commit-end + resume). Returns the two pairs' seconds, the write's
    seconds and the commit-end answer."""
    t = time.perf_counter()
    with client.commit() as cycle:
        t1 = time.perf_counter()
        write()
        t2 = time.perf_counter()
    t3 = time.perf_counter()
    return [t1 - t, t3 - t2], t2 - t1, cycle.end or {}


#: The modes of a step, and the phases each one times. ``UNIX`` is the pipelined client over
#: the server's ``UNIX_SOCKET`` (left out with ``--no-unix``).
UNIX = "pipelined, Unix socket"
PAIRS = ("quiesce+commit-begin", "commit-end+resume")
MODES = {"sequential": BARRIER, "pipelined": PAIRS, UNIX: PAIRS}


def socket_path(workdir: Path, name: str) -> str:
    """A Unix socket path for a server of this run: under /tmp when ``workdir``'s would not
    fit ``sun_path`` (107 bytes)."""
    path = workdir / f"{name}.sock"
    if len(os.fsencode(str(path))) <= 100:
        return str(path)
    return tempfile.mktemp(prefix=f"ws-{name}-", suffix=".sock", dir="/tmp")


def summarize(
    overhead_s: list[float],
    write_s: list[float],
    calls: list[list[float]] | None,
    phases: tuple[str, ...] = BARRIER,
    handler_s: list[float] | None = None,
    cpu: tuple[float, int] | None = None,
) -> dict[str, Any]:
    ms = [x * 1e3 for x in overhead_s]
    out: dict[str, Any] = {
        "steps": len(ms),
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms),
        "mean_ms": statistics.fmean(ms),
        "samples_ms": ms,
        "write_p50_ms": percentile([x * 1e3 for x in write_s], 50) if write_s else None,
        "phases": list(phases),
    }
    if calls:
        out["phase_p50_ms"] = {
            name: percentile([c[i] * 1e3 for c in calls], 50) for i, name in enumerate(phases)
        }
    if handler_s:
        hs = [x * 1e3 for x in handler_s]
        out.update(handler_calls=len(hs), handler_p50_ms=percentile(hs, 50))
        out["handler_p99_ms"] = percentile(hs, 99)
    if cpu is not None and cpu[1]:
        out["server_cpu_ms_per_call"] = cpu[0] * 1e3 / cpu[1]
    return out


def alternate(
    steps: int,
    warmup: int,
    block: int,
    run_step: dict[str, Callable[[], tuple[list[float], float, dict]]],
    between: Callable[[], None],
    handler_times: Callable[[], list[float]],
    server_cpu: Callable[[], float],
) -> tuple[dict[str, dict[str, Any]], dict]:
    """Run ``warmup`` + ``steps`` steps of each mode, alternating in blocks of ``block`` steps
    (so a drift of the machine falls on every mode alike). ``between`` runs outside the timed
    part after each block; the server's recorded handler times and its process's CPU seconds
    (``server_cpu``) are collected per block. Returns per mode ``{overhead, writes, calls,
    handler, cpu_s, cpu_calls}`` and the last commit-end answer."""
    out: dict[str, dict[str, Any]] = {
        m: {"overhead": [], "writes": [], "calls": [], "handler": [], "cpu_s": 0.0, "cpu_calls": 0}
        for m in run_step
    }
    done = dict.fromkeys(run_step, 0)
    end: dict = {}
    handler_times()  # drop what set-up recorded
    while any(n < warmup + steps for n in done.values()):
        for mode, step in run_step.items():
            n0 = done[mode]
            cpu0 = server_cpu()
            for _ in range(min(block, warmup + steps - n0)):
                times, w, end = step()
                if done[mode] >= warmup:
                    out[mode]["overhead"].append(sum(times))
                    out[mode]["writes"].append(w)
                    out[mode]["calls"].append(times)
                done[mode] += 1
            cpu1 = server_cpu()
            recorded = handler_times()
            if n0 >= warmup:  # a block that straddles the warm-up is left out of the times
                out[mode]["handler"].extend(recorded)
                out[mode]["cpu_s"] += cpu1 - cpu0
                out[mode]["cpu_calls"] += len(BARRIER) * (done[mode] - n0)
            between()
    return out, end


def process_cpu(pid: int) -> Callable[[], float]:
    """A function returning the CPU seconds process ``pid``'s main thread (the server's event
    loop, where every barrier call runs) has used so far: ``/proc/<pid>/schedstat``, in
    nanoseconds (Linux); without it the whole process's user + system time in clock ticks."""
    sched = Path(f"/proc/{pid}/schedstat")
    if sched.exists():
        return lambda: int(sched.read_text().split()[0]) / 1e9
    tick = os.sysconf("SC_CLK_TCK")
    stat = Path(f"/proc/{pid}/stat")

    def cpu() -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    return cpu


def profile_server(
    port: int, step: Callable[[], Any], steps: int, path: Path, top: int = 30
) -> str:
    """cProfile the server's event loop over ``steps`` more steps (after the timed ones, so the
    profiler's own cost is in no timed row); the top functions by own time, as text."""
    import io
    import pstats
    import urllib.request

    def post(query: str) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/bench/profile?{query}", b"")
        urllib.request.urlopen(req, timeout=30).read()

    post("start")
    for _ in range(steps):
        step()
    post(f"stop={path}")
    buf = io.StringIO()
    stats = pstats.Stats(str(path), stream=buf)
    buf.write(f"{steps} steps ({steps * len(BARRIER)} barrier calls) profiled\n")
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def run_miserver(
    size: str,
    device: str,
    steps: int,
    warmup: int,
    workdir: Path,
    block: int = 10,
    profile_dir: Path | None = None,
    unix: bool = True,
) -> list[dict[str, Any]]:
    """The miserver rows of ``size``: through ``WeightsClient.commit()`` (pipelined pairs, over
    TCP and, with ``unix``, over the server's ``UNIX_SOCKET``) and four sequential calls on a
    bare keep-alive connection, alternating, on one server."""
    import torch

    from miserver.trainer import WeightsClient

    before = card_used(device)
    path = socket_path(workdir, f"miserver-{size}") if unix else None
    proc, port, log_path = start_miserver(size, device, workdir, path)
    profile_text = None
    try:
        wc = WeightsClient(f"http://127.0.0.1:{port}", TOKEN_SECRET, heartbeat=False)
        att = wc.attach()
        seq = KeepAliveClient(port, TOKEN_SECRET)
        seq.attachment = wc._attachment_id  # the same attachment, for the sequential calls
        modes: dict[str, Any] = {}
        if path is not None:  # the same attachment again, its calls over the socket
            wcu = WeightsClient(
                f"http://127.0.0.1:{port}", TOKEN_SECRET, heartbeat=False, unix_socket=path
            )
            wcu._attachment_id = wc._attachment_id
        params = att.weights.unique_tensors()
        n_params = sum(p.numel() for p in params)
        weight_bytes = sum(p.numel() * p.element_size() for p in params)
        start_steps = att.steps_since_load
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(device)
        get_json(port, "/bench/memory?reset=1")
        write = functools.partial(in_place_write, params, device)
        modes["pipelined"] = functools.partial(timed_commit, wc, write)
        modes["sequential"] = functools.partial(timed_barrier, seq, write)
        if path is not None:
            modes[UNIX] = functools.partial(timed_commit, wcu, write)
        results, end = alternate(
            steps,
            warmup,
            block,
            modes,
            between=wc.heartbeat,
            handler_times=lambda: get_json(port, "/bench/handler-times"),
            server_cpu=process_cpu(proc.pid),
        )
        counted = end.get("steps_since_load") == start_steps + len(modes) * (warmup + steps)
        card = card_used(device)
        trainer_mem = memory(device)
        server_mem = get_json(port, "/bench/memory")
        if profile_dir is not None:
            profile_dir.mkdir(parents=True, exist_ok=True)
            profile_text = profile_server(
                port,
                functools.partial(timed_commit, wc, write),
                max(steps, 200),
                profile_dir / f"miserver-{size}.pstats",
            )
            (profile_dir / f"miserver-{size}.txt").write_text(profile_text)
        del params, write
        seq.close()
        if path is not None:
            wcu._attachment_id = None  # the attachment is wc's: wc detaches
            wcu.close()
        wc.close()  # detaches
    finally:
        stop_process(proc)
    rows = []
    for mode in modes:
        r = results[mode]
        out = summarize(
            r["overhead"],
            r["writes"],
            r["calls"],
            MODES[mode],
            r["handler"],
            (r["cpu_s"], r["cpu_calls"]),
        )
        out.update(
            approach=f"miserver, {mode}",
            mode=mode,
            size=size,
            params=n_params,
            weight_bytes=weight_bytes,
            trainer_mem=trainer_mem,
            server_mem=server_mem,
            card_delta=None if card is None else card - before,
            check=bool(counted),
            check_what="steps_since_load counted every commit",
            server_log=str(log_path),
        )
        rows.append(out)
    if profile_text is not None:
        rows[0]["profile"] = str(profile_dir / f"miserver-{size}.txt")
    return rows


def run_bare(
    device: str,
    steps: int,
    warmup: int,
    workdir: Path,
    size: str | None = None,
    block: int = 10,
    unix: bool = True,
) -> list[dict[str, Any]]:
    """The bare aiohttp rows: the same step shapes (``WeightsClient.commit()``'s pipelined
    pairs, four sequential calls) against a server whose handlers only answer a small JSON
    envelope. With ``size``, the same in-place write of a ``size``-shaped model (the trainer's
    own tensors here) sits between commit-begin and commit-end: on a virtual machine a call
    that follows an idle gap (the write) is slower than one sent back to back, whatever the
    server does, so this is the fair floor for each size; without ``size`` the calls go back to
    back."""
    from miserver.trainer import WeightsClient

    write: Callable[[], None] = lambda: None  # noqa: E731
    params = None
    if size is not None:
        model = random_model(size, device, seed=3)
        params = unique_parameters(model)
        del model
        write = functools.partial(in_place_write, params, device)
    port = free_port()
    path = socket_path(workdir, f"bare-{size or 'b2b'}") if unix else None
    proc = subprocess.Popen(
        [sys.executable, __file__, "--role", "bare"],
        env=child_env(PORT=str(port), UNIX_SOCKET=path or ""),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: get_json(port, "/ready")["success"], proc, "bare aiohttp server")
        wc = WeightsClient(f"http://127.0.0.1:{port}", TOKEN_SECRET, heartbeat=False)
        wc._attachment_id = "bench"  # no attach on the bare server: the holder header only
        seq = KeepAliveClient(port)
        modes: dict[str, Any] = {
            "pipelined": functools.partial(timed_commit, wc, write),
            "sequential": functools.partial(timed_barrier, seq, write),
        }
        if path is not None:
            wcu = WeightsClient(
                f"http://127.0.0.1:{port}", TOKEN_SECRET, heartbeat=False, unix_socket=path
            )
            wcu._attachment_id = "bench"
            modes[UNIX] = functools.partial(timed_commit, wcu, write)
        results, _ = alternate(
            steps,
            warmup,
            block,
            modes,
            between=lambda: None,
            handler_times=lambda: get_json(port, "/bench/handler-times"),
            server_cpu=process_cpu(proc.pid),
        )
        wc._attachment_id = None
        if path is not None:
            wcu._attachment_id = None
            wcu.close()
        seq.close()
    finally:
        stop_process(proc)
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)  # aiohttp leaves its socket file
        del write, params
        if device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
    rows = []
    for mode in modes:
        r = results[mode]
        out = summarize(
            r["overhead"],
            r["writes"] if size else [],
            r["calls"],
            MODES[mode],
            r["handler"],
            (r["cpu_s"], r["cpu_calls"]),
        )
        where = "same write" if size else "back to back"
        out.update(
            approach=f"bare aiohttp, {where}, {mode}",
            mode=mode,
            floor=where,
            size=size or "-",
            check=True,
            check_what="four 200s per step",
        )
        rows.append(out)
    return rows


def run_baseline(
    size: str, device: str, steps: int, warmup: int, bucket_bytes: int
) -> dict[str, Any]:
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing as tmp
    from torch.multiprocessing.reductions import reduce_tensor

    if device == "cpu":
        tmp.set_sharing_strategy("file_system")
    before = card_used(device)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=baseline_server, args=(child, size, device, bucket_bytes), daemon=True
    )
    proc.start()
    try:
        model = random_model(size, device, seed=2)
        params = unique_parameters(model)
        del model
        buckets = bucket_plan(params, bucket_bytes)
        if not parent.poll(900):
            raise RuntimeError("the baseline server did not start")
        _, _, n_buckets = parent.recv()
        assert n_buckets == len(buckets), (n_buckets, len(buckets))
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(device)

        def transfer(ps: list[torch.Tensor]) -> None:
            for b, idxs in enumerate(buckets):
                with torch.no_grad():
                    flat = torch.cat([ps[i].reshape(-1) for i in idxs])
                fn, args = reduce_tensor(flat)
                parent.send_bytes(ForkingPickler.dumps((b, fn, args)))
                if parent.recv_bytes() != b"ok":
                    raise RuntimeError("the baseline server did not acknowledge a bucket")
                del flat, fn, args

        overhead, writes = [], []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            in_place_write(params, device)
            t1 = time.perf_counter()
            transfer(params)
            t2 = time.perf_counter()
            if i >= warmup:
                overhead.append(t2 - t1)
                writes.append(t1 - t0)
        card = card_used(device)
        trainer_mem = memory(device)
        parent.send_bytes(pickle.dumps("checksum"))
        theirs = parent.recv()
        ours = [float(params[i].detach().float().sum()) for i in (0, len(params) // 2, -1)]
        parent.send_bytes(pickle.dumps("stop"))
        _, server_mem = parent.recv()
        n_params = sum(p.numel() for p in params)
        weight_bytes = sum(p.numel() * p.element_size() for p in params)
        del params
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.ipc_collect()
    out = summarize(overhead, writes, None)
    out.update(
        approach="baseline (bucketed IPC copy)",
        size=size,
        params=n_params,
        weight_bytes=weight_bytes,
        buckets=len(buckets),
        bucket_mib=bucket_bytes / 2**20,
        trainer_mem=trainer_mem,
        server_mem=server_mem,
        card_delta=None if card is None else card - before,
        check=ours == theirs,
        check_what="server parameters equal the trainer's",
    )
    return out


# --- report -------------------------------------------------------------------------------------
def _mem(m: dict[str, float] | None, device: str) -> str:
    if not m:
        return "-"
    if device.startswith("cuda"):
        return f"{m['peak'] / GIB:.2f}"
    return f"{m['maxrss'] / GIB:.2f} (RSS)"


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def render(rows: list[dict[str, Any]], device: str, head: str) -> str:
    """The run's tables (markdown): every row; the phases per step; the server's own cost per
    call; the targets of issue 15."""
    lines = [
        head,
        "",
        "| approach | size | params (B) | weights GiB | p50 ms | p99 ms | max ms | "
        "baseline / miserver pipelined p50 (p99) | optimizer step p50 ms (both pay) | "
        "server peak GiB | trainer peak GiB | card used GiB | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    pipe = {r["size"]: r for r in rows if r["approach"] == "miserver, pipelined"}
    for r in rows:
        ratio = "-"
        if r["approach"].startswith("baseline") and r["size"] in pipe:
            m = pipe[r["size"]]
            ratio = f"{r['p50_ms'] / m['p50_ms']:.1f}x ({r['p99_ms'] / m['p99_ms']:.1f}x)"
        params = f"{r['params'] / 1e9:.3f}" if "params" in r else "-"
        wgib = f"{r['weight_bytes'] / GIB:.2f}" if "weight_bytes" in r else "-"
        write = f"{r['write_p50_ms']:.2f}" if r.get("write_p50_ms") is not None else "-"
        card = f"{r['card_delta'] / GIB:.2f}" if r.get("card_delta") is not None else "-"
        lines.append(
            f"| {r['approach']} | {r['size']} | {params} | {wgib} | {r['p50_ms']:.3f} | "
            f"{r['p99_ms']:.3f} | {r['max_ms']:.3f} | {ratio} | {write} | "
            f"{_mem(r.get('server_mem'), device)} | {_mem(r.get('trainer_mem'), device)} | "
            f"{card} | {'pass' if r['check'] else 'FAIL'} |"
        )
    for mode, phases in MODES.items():
        these = [r for r in rows if r.get("mode") == mode and "phase_p50_ms" in r]
        if not these:
            continue
        lines += [
            "",
            f"Per {'call' if mode == 'sequential' else 'pipelined pair'} ({mode}), p50 ms:",
            "",
            "| approach | size | " + " | ".join(phases) + " |",
            "|---|---|" + "---|" * len(phases),
        ]
        for r in these:
            lines.append(
                f"| {r['approach']} | {r['size']} | "
                + " | ".join(f"{r['phase_p50_ms'][n]:.3f}" for n in phases)
                + " |"
            )
    by = {(r["approach"], r["size"]): r for r in rows}
    cost: dict[tuple[str, str], float] = {}
    sizes = [r["size"] for r in rows if r["approach"] == "miserver, pipelined"]
    if sizes:
        lines += [
            "",
            "The server's own cost per call, p50 ms: end to end (miserver minus bare aiohttp, "
            "same client, same write, divided by 4 calls), and in the server (each barrier "
            "call's handler time, the access logger's: miserver minus bare):",
            "",
            "| size | mode | miserver step | bare step | per call, end to end | "
            "handler miserver | handler bare | per call, in the server | "
            "server CPU ms a call, miserver / bare | per call, CPU |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
    for size in sizes:
        for mode in MODES:
            m = by.get((f"miserver, {mode}", size))
            f = by.get((f"bare aiohttp, same write, {mode}", size))
            if m is None or f is None:
                continue
            e2e = (m["p50_ms"] - f["p50_ms"]) / len(BARRIER)
            hm, hf = m.get("handler_p50_ms"), f.get("handler_p50_ms")
            inside = hm - hf if hm is not None and hf is not None else None
            if mode != "sequential":
                cost[(size, mode)] = e2e
            cm, cf = m.get("server_cpu_ms_per_call"), f.get("server_cpu_ms_per_call")
            lines.append(
                f"| {size} | {mode} | {m['p50_ms']:.3f} | {f['p50_ms']:.3f} | {e2e:.3f} | "
                + (
                    f"{hm:.3f} | {hf:.3f} | {inside:.3f} | "
                    if inside is not None
                    else "- | - | - | "
                )
                + (f"{cm:.3f} / {cf:.3f} | {cm - cf:.3f} |" if cm and cf else "- | - |")
            )
    if sizes:
        lines += [
            "",
            "Targets (issue 15):",
            "",
            "| target | size | measured | |",
            "|---|---|---|---|",
        ]
    for size in sizes:
        for mode in ("pipelined", UNIX):
            m = by.get((f"miserver, {mode}", size))
            if m is None:
                continue
            how = "" if mode == "pipelined" else " (over the Unix socket)"
            seq_floor = by.get(("bare aiohttp, same write, sequential", size))
            if seq_floor is not None:
                x = m["p50_ms"] / seq_floor["p50_ms"]
                lines.append(
                    f"| a cycle through WeightsClient.commit(){how} at most 1.2x four sequential "
                    f"bare calls over TCP (p50) | {size} | {m['p50_ms']:.3f} / "
                    f"{seq_floor['p50_ms']:.3f} ms = {x:.2f}x | {_verdict(x <= 1.2)} |"
                )
            lines.append(
                f"| miserver{how} p50 at most 1.5 ms, p99 at most 3 ms | {size} | "
                f"{m['p50_ms']:.3f} / {m['p99_ms']:.3f} ms | "
                f"{_verdict(m['p50_ms'] <= 1.5 and m['p99_ms'] <= 3.0)} |"
            )
            if (size, mode) in cost:
                c = cost[(size, mode)]
                lines.append(
                    f"| the server's own cost at most 0.1 ms a call{how} (p50, end to end) | "
                    f"{size} | {c:.3f} ms | {_verdict(c <= 0.1)} |"
                )
            base = next(
                (r for r in rows if r["approach"].startswith("baseline") and r["size"] == size),
                None,
            )
            if base is not None and size == "8b":
                x = base["p50_ms"] / m["p50_ms"]
                lines.append(
                    f"| at least 30x below the baseline{how} (p50) | {size} | {x:.1f}x | "
                    f"{_verdict(x >= 30)} |"
                )
            floor = by.get((f"bare aiohttp, same write, {mode}", size))
            if floor is not None:
                lines.append(
                    f"| (the machine's floor{how}: bare aiohttp, same client, same write) | "
                    f"{size} | {floor['p50_ms']:.3f} / {floor['p99_ms']:.3f} ms (p50 / p99) | |"
                )
    return "\n".join(lines) + "\n"


def plot(samples: dict[str, list[float]], path: Path) -> None:
    """Cumulative distribution of the per-step overhead of each row (log time axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, xs in samples.items():
        ys = sorted(xs)
        ax.plot(ys, [(i + 1) / len(ys) for i in range(len(ys))], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("weight-sync overhead per step (ms, log scale)")
    ax.set_ylabel("fraction of steps")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Weight-sync overhead per training step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0.5b,8b", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--steps", type=int, default=500, help="timed miserver and bare steps")
    ap.add_argument("--baseline-steps", type=int, default=100, help="timed baseline steps")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--bucket-mib", type=float, default=512.0)
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT"),
        help="folder for weight_sync.md/.json/.png (default: $OUT when set)",
    )
    ap.add_argument("--block", type=int, default=10, help="steps per block when alternating modes")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, cProfile the miserver server over more steps; the top "
        "functions go to <out>/profile-<size>.txt",
    )
    ap.add_argument("--no-baseline", action="store_true", help="skip the bucketed-copy rows")
    ap.add_argument(
        "--no-unix",
        action="store_true",
        help="skip the pipelined mode over a Unix socket (UNIX_SOCKET) on both servers",
    )
    ap.add_argument("--role", choices=("miserver", "bare"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "miserver":
        serve_miserver(args.sizes)
        return 0
    if args.role == "bare":
        serve_bare()
        return 0
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown size {unknown[0]!r}; choose from {', '.join(SIZES)}")

    import torch

    device = pick_device()
    workdir = Path(tempfile.mkdtemp(prefix="miserver-weight-sync-"))
    profile_dir = Path(args.out or workdir) / "profile" if args.profile else None
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    try:
        unix = not args.no_unix and hasattr(socket, "AF_UNIX")
        rows += run_bare(device, args.steps, args.warmup, workdir, block=args.block, unix=unix)
        for size in sizes:
            floor = run_bare(
                device, args.steps, args.warmup, workdir, size, block=args.block, unix=unix
            )
            ours = run_miserver(
                size,
                device,
                args.steps,
                args.warmup,
                workdir,
                block=args.block,
                profile_dir=profile_dir,
                unix=unix,
            )
            rows += floor + ours
            base = None
            if not args.no_baseline:
                base = run_baseline(
                    size, device, args.baseline_steps, args.warmup, int(args.bucket_mib * 2**20)
                )
                rows.append(base)
            print(
                f"[{time.perf_counter() - started:.0f} s] {size}: miserver pipelined p50 "
                f"{ours[0]['p50_ms']:.3f} ms (sequential {ours[1]['p50_ms']:.3f}), bare with the "
                f"same write {floor[0]['p50_ms']:.3f} ms (sequential {floor[1]['p50_ms']:.3f})"
                + (
                    f"; over the Unix socket {ours[2]['p50_ms']:.3f} ms, bare "
                    f"{floor[2]['p50_ms']:.3f} ms"
                    if len(ours) > 2 and len(floor) > 2
                    else ""
                )
                + (f", baseline p50 {base['p50_ms']:.3f} ms" if base else ""),
                file=sys.stderr,
                flush=True,
            )
            if profile_dir is not None and ours[0].get("profile"):
                print(Path(ours[0]["profile"]).read_text()[:6000], file=sys.stderr)
    finally:
        if profile_dir is None or args.out:
            shutil.rmtree(workdir, ignore_errors=True)
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        where = f"{props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    else:
        where = f"CPU ({os.cpu_count()} cores), torch {torch.__version__}, CPU shared memory"
    head = (
        f"{where}; one run; miserver and bare: {args.steps} timed steps of each mode "
        f"(alternating in blocks of {args.block}), baseline: {args.baseline_steps}, each after "
        f"{args.warmup} warm-ups; buckets of {args.bucket_mib:g} MiB; "
        f"{time.perf_counter() - started:.0f} s in all."
    )
    table = render(rows, device, head)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "weight_sync.md").write_text(table)
        (out / "weight_sync.json").write_text(json.dumps(rows, indent=1, default=str))
        plot(
            {f"{r['approach']} {r['size']}": r["samples_ms"] for r in rows}, out / "weight_sync.png"
        )
    failed = [f"{r['approach']} {r['size']}" for r in rows if not r["check"]]
    if failed:
        print(f"check FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
