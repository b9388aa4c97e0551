"""Weight-sync overhead per training step: miserver's barrier against bucketed IPC copies.

The wall time an update adds beyond the trainer's own optimizer step, with the server idle, for
0.5B- and 8B-shaped bfloat16 models (random weights), in one run (docs/benchmarks.md, section
"Weight-sync overhead per training step")::

    python benchmarks/weight_sync.py [--sizes 0.5b,8b] [--steps 500] [--baseline-steps 100]
                                     [--bucket-mib 512] [--out DIR]

Rows:

- **miserver**: a server process runs the real application (``miserver.http.app.create_app``,
  the real lifecycle, scheduler, audit and access logs, ``web.run_app`` on loopback) whose model
  host loads a random model of the size through the real attachable hook
  (``miserver.serving.loader.make_attachable``: one parameter arena). This process (the trainer)
  attaches over HTTP, rebuilds the weights with :func:`miserver.trainer.rebuild` and, per step,
  calls quiesce and commit-begin, writes every parameter in place (the optimizer step, a
  ``torch._foreach_mul_``), synchronizes, then calls commit-end and resume. The overhead is the
  time of the four HTTP calls; the write is timed apart (both approaches pay it).
- **baseline** (what other servers do): the trainer holds its own copy of the weights; after its
  optimizer step it flattens the parameters into buckets (``--bucket-mib``), shares each bucket
  with ``torch.multiprocessing.reductions.reduce_tensor`` (a CUDA IPC handle), sends it over a
  pipe to the server process, which rebuilds it, copies it into its own parameters,
  synchronizes and acknowledges; the next bucket follows. The overhead is the whole transfer.
  (A pipe, not HTTP: that favours the baseline.)
- **bare aiohttp**: four sequential POSTs to an aiohttp app whose handlers only return a small
  JSON body, with the same client: the floor any HTTP barrier pays.

Without CUDA (``--sizes tiny`` for a quick check) the same runs use CPU shared memory: miserver
with ``WEIGHTS_CPU_ATTACH=1``, the baseline through PyTorch's file-system sharing strategy.

Memory: per process, what PyTorch's CUDA allocator holds (max allocated during the steps, peak
reset after set-up), and the whole card's use during the steps (``cudaMemGetInfo``); on the CPU,
each process's maximum resident set size. A second copy of the weights shows as a process
holding about one model's size.

Exit status 0 when every run completed and its check passed (miserver: ``steps_since_load``
counted every commit; baseline: the server's parameters equal the trainer's after the last step).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import json
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
def serve_miserver(size: str) -> None:
    """The miserver server process: the real app (``create_app``, ``web.run_app``, logging as
    ``miserver serve`` sets it up) with a model host whose loader builds a random model and makes
    it attachable through the loader's own hook. Settings come from the environment."""
    from aiohttp import web

    from miserver.http.app import create_app
    from miserver.serving import loader as loader_module
    from miserver.serving.catalogue import Catalogue
    from miserver.serving.host import ModelHost
    from miserver.serving.server import AccessLogger, configure_logging
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

    async def bench_memory(request: web.Request) -> web.Response:
        return web.json_response(memory(device, reset="reset" in request.query))

    app.router.add_get("/bench/memory", bench_memory)
    web.run_app(
        app,
        host=settings.host,
        port=settings.port,
        print=None,
        handle_signals=True,
        shutdown_timeout=10.0,
        access_log=__import__("logging").getLogger("miserver.server.access"),
        access_log_class=AccessLogger,  # as `miserver serve` runs it
    )


def serve_bare() -> None:
    """The floor: an aiohttp app whose four POST routes only answer a small JSON envelope."""
    from aiohttp import web

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(
            {"success": True, "data": {"weights_state": "clean"}, "error": None}
        )

    app = web.Application()
    for name in BARRIER:
        app.router.add_post(f"/api/weights/{name}", handler)
    app.router.add_get("/ready", handler)
    web.run_app(app, host="127.0.0.1", port=int(os.environ["PORT"]), print=None, access_log=None)


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
def start_miserver(size: str, device: str, workdir: Path) -> tuple[subprocess.Popen, int, Path]:
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
    """One step: quiesce, commit-begin, ``write()``, commit-end, resume. Returns the four calls'
    seconds, the write's seconds and the commit-end answer."""
    times = []
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
    times = [t1 - t, t2 - t1, t4 - t3, t5 - t4]
    return times, t3 - t2, end


def summarize(
    overhead_s: list[float], write_s: list[float], calls: list[list[float]] | None
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
    }
    if calls:
        for i, name in enumerate(BARRIER):
            out[f"{name}_p50_ms"] = percentile([c[i] * 1e3 for c in calls], 50)
    return out


def run_miserver(size: str, device: str, steps: int, warmup: int, workdir: Path) -> dict[str, Any]:
    import torch

    from miserver import trainer

    before = card_used(device)
    proc, port, log_path = start_miserver(size, device, workdir)
    try:
        client = KeepAliveClient(port, TOKEN_SECRET)
        body = client.post("/api/weights/attach")
        client.attachment = body["attachment_id"]
        with trainer.rebuild(body) as weights:
            params = weights.unique_tensors()
            n_params = sum(p.numel() for p in params)
            weight_bytes = sum(p.numel() * p.element_size() for p in params)
            start_steps = body["steps_since_load"]
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats(device)
            get_json(port, "/bench/memory?reset=1")
            overhead, writes, calls = [], [], []
            last_beat = time.monotonic()
            end: dict = {}
            write = functools.partial(in_place_write, params, device)
            for i in range(warmup + steps):
                if time.monotonic() - last_beat > 2.0:  # outside the timed part
                    client.post("/api/weights/heartbeat")
                    last_beat = time.monotonic()
                times, w, end = timed_barrier(client, write)
                if i >= warmup:
                    overhead.append(sum(times))
                    writes.append(w)
                    calls.append(times)
            card = card_used(device)
            trainer_mem = memory(device)
            server_mem = get_json(port, "/bench/memory")
            del params, write
        client.attachment = body["attachment_id"]
        client.post("/api/weights/detach")
        client.close()
        counted = end.get("steps_since_load") == start_steps + warmup + steps
    finally:
        stop_process(proc)
    out = summarize(overhead, writes, calls)
    out.update(
        approach="miserver",
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
    return out


def run_bare(
    device: str, steps: int, warmup: int, workdir: Path, size: str | None = None
) -> dict[str, Any]:
    """Four POSTs per step to the bare aiohttp server. With ``size``, the step has the same
    shape as miserver's: the same in-place write of a ``size``-shaped model (the trainer's own
    tensors here) between commit-begin and commit-end. On a virtual machine a call that follows an
    idle gap (the write) is slower than one sent back to back, whatever the server does, so this
    is the fair floor for each size; without ``size`` the calls go back to back."""
    write: Callable[[], None] = lambda: None  # noqa: E731
    params = None
    if size is not None:
        model = random_model(size, device, seed=3)
        params = unique_parameters(model)
        del model
        write = functools.partial(in_place_write, params, device)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--role", "bare"],
        env=child_env(PORT=str(port)),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: get_json(port, "/ready")["success"], proc, "bare aiohttp server")
        client = KeepAliveClient(port)
        overhead, writes, calls = [], [], []
        for i in range(warmup + steps):
            times, w, _ = timed_barrier(client, write)
            if i >= warmup:
                overhead.append(sum(times))
                writes.append(w)
                calls.append(times)
        client.close()
    finally:
        stop_process(proc)
        del write, params
        if device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
    out = summarize(overhead, writes if size else [], calls)
    out.update(
        approach="bare aiohttp, same write" if size else "bare aiohttp, back to back",
        size=size or "-",
        check=True,
        check_what="four 200s per step",
    )
    return out


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


def render(rows: list[dict[str, Any]], device: str, head: str) -> str:
    lines = [
        head,
        "",
        "| approach | size | params (B) | weights GiB | p50 ms | p99 ms | max ms | "
        "baseline / miserver p50 (p99) | optimizer step p50 ms (both pay) | "
        "server peak GiB | trainer peak GiB | card used GiB | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ms = {r["size"]: r for r in rows if r["approach"] == "miserver"}
    for r in rows:
        ratio = "-"
        if r["approach"].startswith("baseline") and r["size"] in ms:
            m = ms[r["size"]]
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
    lines += [
        "",
        "Per call, p50 ms:",
        "",
        "| approach | size | " + " | ".join(BARRIER) + " |",
        "|---|---|" + "---|" * len(BARRIER),
    ]
    for r in rows:
        if f"{BARRIER[0]}_p50_ms" in r:
            lines.append(
                f"| {r['approach']} | {r['size']} | "
                + " | ".join(f"{r[f'{n}_p50_ms']:.3f}" for n in BARRIER)
                + " |"
            )
    floors = {r["size"]: r for r in rows if r["approach"] == "bare aiohttp, same write"}
    if floors:
        lines += [
            "",
            "The server's own cost: miserver minus four bare calls around the same write, p50 ms:",
            "",
            "| size | miserver | bare, same write | miserver - bare | per call |",
            "|---|---|---|---|---|",
        ]
        for size, m in ms.items():
            if size in floors:
                d = m["p50_ms"] - floors[size]["p50_ms"]
                lines.append(
                    f"| {size} | {m['p50_ms']:.3f} | {floors[size]['p50_ms']:.3f} | {d:.3f} | "
                    f"{d / len(BARRIER):.3f} |"
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
    ap.add_argument("--out", default=None, help="folder for weight_sync.md/.json/.png")
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
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    try:
        rows.append(run_bare(device, args.steps, args.warmup, workdir))
        for size in sizes:
            rows.append(run_bare(device, args.steps, args.warmup, workdir, size))
            rows.append(run_miserver(size, device, args.steps, args.warmup, workdir))
            rows.append(
                run_baseline(
                    size, device, args.baseline_steps, args.warmup, int(args.bucket_mib * 2**20)
                )
            )
            print(
                f"[{time.perf_counter() - started:.0f} s] {size}: miserver p50 "
                f"{rows[-2]['p50_ms']:.3f} ms, bare with the same write "
                f"{rows[-3]['p50_ms']:.3f} ms, baseline p50 {rows[-1]['p50_ms']:.3f} ms",
                file=sys.stderr,
                flush=True,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        where = f"{props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    else:
        where = f"CPU ({os.cpu_count()} cores), torch {torch.__version__}, CPU shared memory"
    head = (
        f"{where}; one run; miserver and bare: {args.steps} timed steps, baseline: "
        f"{args.baseline_steps}, each after {args.warmup} warm-ups; buckets of "
        f"{args.bucket_mib:g} MiB; {time.perf_counter() - started:.0f} s in all."
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
