"""The continuous engine on one card, beside a baseline tree's server, the same requests (issue 34).

For each model shape (``--shapes``) the benchmark starts one ``miserver serve`` per engine, one at
a time, on the same ``MISERVER_HOME`` (``--home``), ``--device`` (default ``cuda``) and
``DECODE_GRAPHS`` (``--decode-graphs``, default ``captured``), each on a port of its own:

- ``baseline`` (with ``--baseline-tree PATH`` only): another source tree (a directory holding a
  ``miserver/`` package, e.g. ``git worktree add /tmp/old <commit>`` of a commit before the
  static batch was removed, whose default was the static batch before the engine issue), started
  from that directory with it first on ``PYTHONPATH`` and ``ENGINE`` unset;
- ``continuous``: this working tree (its continuous engine, the only one).

Without ``--baseline-tree`` only ``continuous`` runs (``--engines``).

Each server answers one untimed chat and one untimed burst (``--warm-chats`` chats of 32 tokens
at once: the first-use captures), then the workloads (``--only``, by number):

1. one chat at a time, streamed: ``--chats`` greedy chats of ``--tokens`` tokens (``min_tokens``
   is not sent: a chat that stops early counts the tokens it made); ms a token, median over the
   chats, of (last token's arrival - first token's) / (tokens - 1); TTFT p50/p99;
2. ``--concurrent`` (default 64) streamed chats at once, ``max_tokens`` long-tailed from 8 to
   ``--max-tokens-high`` (:func:`peers.long_tailed`, the peers benchmark's draw), greedy: tokens
   a second (completion tokens over the wall time from the send to the last answer) and TTFT
   p50/p99 (from the common send);
3. the same with ``--concurrent-large`` (default 256);
4. GRPO groups, non-streamed: ``--grpo-prompts`` prompts at once, each with ``n`` of
   ``--grpo-n`` (default 8 and 32: one row each), temperature 1, ``--grpo-tokens`` tokens,
   seeded: tokens a second.

Around each timed workload the benchmark reads the engine's ``step_times`` (graph and eager
steps, their wall ms) and records the difference as the workload's ``engine_steps`` (where its
time went). After an engine's workloads the benchmark reads ``GET /api/health/detailed`` (its ``kv_cache``
block, whatever it holds) and ``GET /api/weights/status`` (``cuda_memory``). Every server start
and stop and every workload runs under a timeout (``--start-timeout-s``, ``--workload-timeout-s``,
both cut to what is left of ``--budget-s``); a part that fails or times out is printed and
skipped. Before a part starts, its time is estimated from what ran (the slowest server start,
the same workload's time before) and the part is skipped, with a note, when the budget would be
exceeded. Progress lines go to stdout as the run goes; the results go to ``--json`` after every
part; at the end one table: per shape and workload, the baseline, the continuous engine, and
the ratio with above 1 meaning the continuous engine is better (tokens a second: continuous /
baseline; ms a token: baseline / continuous), then TTFT p50/p99 of each.

Settings: both servers get ``MAX_QUEUED_REQUESTS`` 1024 (the 256 chats wait, never 503) and
otherwise their defaults (``MAX_BATCH_SIZE`` auto: 64 sequences on CUDA, an old tree's batch
and the continuous engine's sequences a step alike; ``KV_CACHE_BYTES`` auto);
``--env KEY=VALUE`` adds a setting to both, ``--baseline-env`` / ``--continuous-env`` to one.

Shapes: ``135m`` (the embedded SmolLM2-135M-Instruct, real weights), ``0.5b`` (random
Qwen2.5-0.5B layers, SmolLM2's vocabulary: :data:`bench_models.SHAPE_05B`), ``8b`` (random
Llama-3-8B layers, vocabulary 128256: :data:`bench_models.SHAPE_8B`), ``tiny`` (2 random layers,
for a CPU check). The random models are drawn on ``--device`` in a child process, saved into the
home and registered (once; a later run on the same home reuses them).

Usage (the GPU run; the CPU check in docs/benchmarks.md)::

    git worktree add /tmp/static <commit before the engine issue>
    PYTHONUNBUFFERED=1 python benchmarks/engine_cuda.py --baseline-tree /tmp/static \\
        --shapes 135m,0.5b --budget-s 480 --json $OUT/engine_cuda.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The sibling benchmarks' helpers: the request body and max_tokens draw (peers), the server
# start (serving), the random shapes (bench_models).
from bench_models import SHAPE_05B, SHAPE_8B, make_shape  # noqa: E402
from peers import chat_body, long_tailed, stop  # noqa: E402
from serving import start_server  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

#: shape -> (catalogue name, random shape or None for the embedded default)
SHAPES: dict[str, tuple[str, dict[str, Any] | None]] = {
    "135m": ("smollm2-135m-instruct", None),
    "0.5b": ("qwen2.5-0.5b-shape", SHAPE_05B),
    "8b": ("llama-3-8b-shape", SHAPE_8B),
    "tiny": (
        "tiny-shape",
        dict(
            model_type="llama",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=49408,  # past the tokenizer's 49152: the zeroed rows are exercised
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        ),
    ),
}

STOP_TIMEOUT_S = 60.0  # a server's stop: SIGTERM, then SIGKILL after this


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values``, linearly interpolated; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


# ---- requests -------------------------------------------------------------------------------


async def stream_chat(session: Any, base: str, body: dict[str, Any], t0: float) -> dict[str, Any]:
    """One streamed chat: ``{ttft_s, first_s, last_s, tokens}``, times from ``t0``
    (``time.perf_counter``), ``tokens`` from the last chunk's ``usage``."""
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    tokens = 0
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            if chunk.get("error"):
                raise RuntimeError(f"stream error: {json.dumps(chunk['error'])[:300]}")
            for choice in chunk.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    now = time.perf_counter() - t0
                    first = now if first is None else first
                    last = now
    end = time.perf_counter() - t0
    return {
        "ttft_s": first if first is not None else end,
        "first_s": first if first is not None else end,
        "last_s": last if last is not None else end,
        "tokens": tokens,
    }


async def post_chat(session: Any, base: str, body: dict[str, Any]) -> int:
    """One non-streamed chat; its completion tokens (every choice's)."""
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {text[:300]}")
        return int(json.loads(text)["usage"]["completion_tokens"])


def _session() -> Any:
    import aiohttp

    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)
    )


async def one_at_a_time(base: str, model: str, chats: int, tokens: int) -> dict[str, Any]:
    """Workload 1: ``chats`` streamed greedy chats one after another."""
    per_token, ttft, counts = [], [], []
    async with _session() as session:
        for i in range(chats):
            t0 = time.perf_counter()
            out = await stream_chat(session, base, chat_body(i, tokens, model=model), t0)
            ttft.append(out["ttft_s"])
            counts.append(out["tokens"])
            if out["tokens"] > 1:
                per_token.append((out["last_s"] - out["first_s"]) / (out["tokens"] - 1))
    return {
        "ms_per_token": statistics.median(per_token) * 1000 if per_token else None,
        "ms_per_token_all": [round(x * 1000, 3) for x in per_token],
        "ttft_p50_ms": _ms(percentile(ttft, 0.5)),
        "ttft_p99_ms": _ms(percentile(ttft, 0.99)),
        "tokens": sum(counts),
    }


async def concurrent_chats(
    base: str, model: str, count: int, high: int, seed: int
) -> dict[str, Any]:
    """Workloads 2 and 3: ``count`` streamed greedy chats sent at once, long-tailed
    ``max_tokens`` from 8 to ``high``."""
    bodies = [chat_body(i, m, model=model) for i, m in enumerate(long_tailed(count, 8, high, seed))]
    async with _session() as session:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(stream_chat(session, base, b, t0) for b in bodies))
        wall = time.perf_counter() - t0
    tokens = sum(o["tokens"] for o in outs)
    ttft = [o["ttft_s"] for o in outs]
    return {
        "tokens_per_s": tokens / wall,
        "tokens": tokens,
        "wall_s": wall,
        "ttft_p50_ms": _ms(percentile(ttft, 0.5)),
        "ttft_p99_ms": _ms(percentile(ttft, 0.99)),
    }


async def grpo_groups(base: str, model: str, prompts: int, n: int, tokens: int) -> dict[str, Any]:
    """Workload 4: ``prompts`` non-streamed requests at once, each ``n`` choices, temperature 1,
    ``tokens`` tokens, seeded."""
    bodies = [
        chat_body(i, tokens, model=model, n=n, temperature=1.0, seed=1000 + i)
        for i in range(prompts)
    ]
    async with _session() as session:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(post_chat(session, base, b) for b in bodies))
        wall = time.perf_counter() - t0
    return {"tokens_per_s": sum(counts) / wall, "tokens": sum(counts), "wall_s": wall}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def get_json(url: str, timeout: float = 10) -> Any:
    """The ``data`` of a management route's ``{success, data, error}`` envelope (the body
    itself where there is no envelope)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = json.loads(r.read())
    if isinstance(body, dict) and "success" in body and "data" in body:
        return body["data"] or {}
    return body


# ---- the run --------------------------------------------------------------------------------


class Run:
    """The results so far (written to ``--json`` after every part) and the budget."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.results: dict[str, dict[str, dict[str, Any]]] = {}
        self.notes: list[str] = []
        self.start_s: list[float] = []
        self.workload_s: dict[str, float] = {}
        self.gpu = _gpu_name()

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def note(self, message: str) -> None:
        log(f"NOTE: {message}")
        self.notes.append(message)
        self.save()

    def engine(self, shape: str, engine: str) -> dict[str, Any]:
        return self.results.setdefault(shape, {}).setdefault(engine, {"workloads": {}})

    def save(self) -> None:
        if not self.args.json:
            return
        data = {
            "args": vars(self.args),
            "gpu": self.gpu,
            "elapsed_s": time.monotonic() - self.t0,
            "results": self.results,
            "notes": self.notes,
        }
        tmp = f"{self.args.json}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, default=str)
        os.replace(tmp, self.args.json)


def _gpu_name() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def workload_plan(args: argparse.Namespace) -> list[tuple[str, str, Any]]:
    """``(key, label, coroutine factory(base, model))`` of the chosen workloads, in order."""
    only = {w.strip() for w in args.only.split(",") if w.strip()}
    plan: list[tuple[str, str, Any]] = []
    if "1" in only:
        plan.append(
            (
                "1_one_chat",
                f"one chat at a time, {args.chats} x {args.tokens} tokens, streamed (ms a token)",
                lambda b, m: one_at_a_time(b, m, args.chats, args.tokens),
            )
        )
    for number, count, seed in (("2", args.concurrent, 1), ("3", args.concurrent_large, 2)):
        if number in only:
            plan.append(
                (
                    f"{number}_concurrent_{count}",
                    f"{count} concurrent chats, max_tokens 8..{args.max_tokens_high} "
                    "long-tailed, streamed (tok/s)",
                    lambda b, m, c=count, s=seed: concurrent_chats(
                        b, m, c, args.max_tokens_high, s
                    ),
                )
            )
    if "4" in only:
        for n in (int(x) for x in args.grpo_n.split(",") if x):
            plan.append(
                (
                    f"4_grpo_n{n}",
                    f"GRPO {args.grpo_prompts} prompts x n={n}, temperature 1, "
                    f"{args.grpo_tokens} tokens (tok/s)",
                    lambda b, m, n=n: grpo_groups(b, m, args.grpo_prompts, n, args.grpo_tokens),
                )
            )
    return plan


def ensure_shape(run: Run, shape: str) -> str | None:
    """The catalogue name of ``shape`` in the home, drawing and saving a random one in a child
    process when missing (under the start timeout); None when that failed."""
    name, spec = SHAPES[shape]
    if spec is None:
        return name
    timeout = min(run.args.shape_timeout_s, max(1.0, run.left()))
    log(f"{shape}: drawing the random model {name} on {run.args.device} (at most {timeout:.0f} s)")
    t0 = time.monotonic()
    cmd = [sys.executable, __file__, "--make-shape", shape, "--home", run.args.home]
    cmd += ["--device", run.args.device]
    try:
        subprocess.run(cmd, check=True, timeout=timeout, env=_env_here())
    except (subprocess.SubprocessError, OSError) as exc:
        run.note(f"{shape}: the random model was not made ({type(exc).__name__}: {exc}); skipped")
        return None
    log(f"{shape}: model ready in {time.monotonic() - t0:.1f} s")
    return name


def _env_here() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def server_env(args: argparse.Namespace, engine: str, model: str) -> tuple[dict, str]:
    """``(extra_env, cwd)`` of the server for ``engine`` (``baseline`` or ``continuous``)."""
    env: dict[str, str | None] = {
        "DEFAULT_MODEL": model,
        "MAX_QUEUED_REQUESTS": str(max(1024, 4 * args.concurrent_large)),
        "PYTHONUNBUFFERED": "1",
    }
    for item in [*args.env, *(args.baseline_env if engine == "baseline" else args.continuous_env)]:
        key, _, value = item.partition("=")
        env[key] = value
    if engine == "baseline" and args.baseline_tree:
        tree = str(Path(args.baseline_tree).resolve())
        env["ENGINE"] = None
        inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(
            [tree] + [p for p in inherited if p and Path(p).resolve() != REPO]
        )
        return env, tree
    env["ENGINE"] = "continuous"
    env["PYTHONPATH"] = _env_here()["PYTHONPATH"]
    return env, str(REPO)


def which_miserver(env: dict[str, str | None], cwd: str) -> str:
    """The ``miserver`` package a server with ``env`` and ``cwd`` imports (a check, printed)."""
    full = dict(os.environ)
    for key, value in env.items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import miserver, os; print(os.path.dirname(miserver.__file__))",
            ],
            env=full,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return out.stdout.strip() or out.stderr.strip()[-300:]
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"


def run_engine(run: Run, shape: str, model: str, engine: str, plan: list, share_s: float) -> None:
    """Start one server, warm it, run the plan's workloads, read its health, stop it; all
    within ``share_s`` seconds (its share of what is left of the budget, so that a slow
    baseline leaves the continuous engine its time), the stop aside."""
    args = run.args
    slot = run.engine(shape, engine)
    est_start = max(run.start_s, default=args.start_estimate_s)
    if min(run.left(), share_s) < est_start + 15:
        run.note(
            f"{shape}/{engine}: skipped (budget: {run.left():.0f} s left, share {share_s:.0f} s)"
        )
        return
    deadline = time.monotonic() + min(share_s, run.left() - STOP_TIMEOUT_S / 4)
    slot["share_s"] = share_s
    log(f"{shape}/{engine}: {share_s:.0f} s of the {run.left():.0f} s left")
    env, cwd = server_env(args, engine, model)
    slot["package"] = which_miserver(env, cwd)
    log(f"{shape}/{engine}: starting (miserver from {slot['package']}, ENGINE={env['ENGINE']})")
    timeout = min(args.start_timeout_s, max(5.0, deadline - time.monotonic()))
    t0 = time.monotonic()
    try:
        proc, base = start_server(
            args.home,
            args.device,
            decode_graphs=args.decode_graphs,
            extra_env=env,
            ready_timeout_s=timeout,
            log_path=args.server_log,
            cwd=cwd,
        )
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a part's failure is printed
        run.note(f"{shape}/{engine}: the server did not start: {exc}; see {args.server_log}")
        return
    slot["start_s"] = time.monotonic() - t0
    run.start_s.append(slot["start_s"])
    log(f"{shape}/{engine}: ready at {base} in {slot['start_s']:.1f} s")
    try:
        warm(run, shape, engine, base, model, deadline)
        for index, (key, label, factory) in enumerate(plan):
            est = run.workload_s.get(key, args.workload_estimate_s)
            left = deadline - time.monotonic()
            if left < est:
                run.note(
                    f"{shape}/{engine}/{key}: skipped (budget: {left:.0f} s, est. {est:.0f} s)"
                )
                continue
            later = sum(run.workload_s.get(k, args.workload_estimate_s) for k, *_ in plan[index:])
            warmed = None
            if args.warm_workloads and not key.startswith("1_"):
                if left < est + later:
                    run.note(f"{shape}/{engine}/{key}: timed cold (no budget for a run before)")
                else:  # the captures its first use makes (both engines' graphs) left untimed
                    t1 = time.monotonic()
                    limit = min(args.workload_timeout_s, left - later)
                    try:
                        asyncio.run(asyncio.wait_for(factory(base, model), limit))
                        warmed = time.monotonic() - t1
                        log(f"{shape}/{engine}: {key}: untimed first run {warmed:.1f} s")
                    except Exception as exc:  # noqa: BLE001
                        run.note(f"{shape}/{engine}/{key}: untimed first run: {exc!r}"[:300])
                    left = deadline - time.monotonic()
            limit = min(args.workload_timeout_s, left)
            log(f"{shape}/{engine}: {label} (at most {limit:.0f} s)")
            before = step_times(base)
            t1 = time.monotonic()
            try:
                out = asyncio.run(asyncio.wait_for(factory(base, model), limit))
            except Exception as exc:  # noqa: BLE001
                kind = "timed out" if isinstance(exc, TimeoutError) else "failed"
                spent = time.monotonic() - t1
                run.workload_s[key] = max(run.workload_s.get(key, 0.0), spent)
                slot["workloads"][key] = {"error": f"{kind}: {type(exc).__name__}: {exc}"[:400]}
                run.note(f"{shape}/{engine}/{key}: {kind}: {type(exc).__name__}: {exc}"[:400])
                if proc.poll() is not None:
                    run.note(f"{shape}/{engine}: the server exited ({proc.returncode})")
                    break
                continue
            spent = time.monotonic() - t1
            run.workload_s[key] = max(run.workload_s.get(key, 0.0), spent)
            out["label"] = label
            out["run_s"] = spent
            out["untimed_first_s"] = warmed
            steps = steps_between(before, step_times(base))
            if steps is not None:
                out["engine_steps"] = steps
            slot["workloads"][key] = out
            log(f"{shape}/{engine}: {key}: {_brief(out)}")
            run.save()
        slot["health"] = health(base)
        log(f"{shape}/{engine}: kv_cache {json.dumps(slot['health'].get('kv_cache'))}")
        log(f"{shape}/{engine}: cuda_memory {json.dumps(slot['health'].get('cuda_memory'))}")
    finally:
        t2 = time.monotonic()
        try:
            _stop(proc)
        except Exception as exc:  # noqa: BLE001
            run.note(f"{shape}/{engine}: stop failed: {exc}")
        log(f"{shape}/{engine}: stopped in {time.monotonic() - t2:.1f} s")
        run.save()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT_S`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop(proc)  # peers.stop: kill and wait


def warm(run: Run, shape: str, engine: str, base: str, model: str, deadline: float) -> None:
    """One untimed chat, then ``--warm-chats`` chats of 32 tokens at once (the captures a
    burst's first use makes); their times are recorded, a failure noted."""
    args = run.args
    slot = run.engine(shape, engine)

    async def go() -> tuple[float, float]:
        async with _session() as session:
            t0 = time.perf_counter()
            await post_chat(session, base, chat_body(0, 16, model=model))
            t1 = time.perf_counter()
            bodies = [chat_body(i, 32, model=model) for i in range(args.warm_chats)]
            await asyncio.gather(*(post_chat(session, base, b) for b in bodies))
            return t1 - t0, time.perf_counter() - t1

    limit = min(args.workload_timeout_s, max(5.0, (deadline - time.monotonic()) / 3))
    try:
        one, burst = asyncio.run(asyncio.wait_for(go(), limit))
    except Exception as exc:  # noqa: BLE001
        run.note(f"{shape}/{engine}: warm-up failed: {type(exc).__name__}: {exc}"[:400])
        return
    slot["warm_s"] = {"one_chat": one, "burst": burst}
    log(f"{shape}/{engine}: warm-up chat {one:.2f} s, burst of {args.warm_chats} {burst:.2f} s")


def step_times(base: str) -> dict[str, Any] | None:
    """The engine's ``step_times`` (``kv_cache`` of ``/api/health/detailed``), None where the
    server has none (an older tree's engine without them) or the read failed."""
    try:
        cache = get_json(f"{base}/api/health/detailed").get("kv_cache")
    except Exception:  # noqa: BLE001 - a diagnostic; the workload's numbers stand without it
        return None
    return cache.get("step_times") if isinstance(cache, dict) else None


def steps_between(
    before: dict[str, Any] | None, after: dict[str, Any] | None
) -> dict[str, Any] | None:
    """What the engine's steps did during one workload: per kind (``graph``, ``eager``) the
    steps and their wall ms (``after`` - ``before``), and the slowest step so far."""
    if not before or not after:
        return None
    out: dict[str, Any] = {}
    for kind in ("graph", "eager"):
        b, a = before.get(kind) or {}, after.get(kind) or {}
        out[kind] = {
            "steps": a.get("steps", 0) - b.get("steps", 0),
            "ms": round(a.get("ms", 0.0) - b.get("ms", 0.0), 1),
        }
    out["slowest_ms"] = after.get("slowest_ms")
    return out


def health(base: str) -> dict[str, Any]:
    """``kv_cache`` of ``/api/health/detailed`` and ``cuda_memory`` of ``/api/weights/status``
    (None where absent; an error string where the read failed)."""
    out: dict[str, Any] = {}
    try:
        detailed = get_json(f"{base}/api/health/detailed")
        out["kv_cache"] = detailed.get("kv_cache")
        out["device"] = detailed.get("device")
    except Exception as exc:  # noqa: BLE001
        out["kv_cache"] = f"error: {exc}"
    try:
        out["cuda_memory"] = get_json(f"{base}/api/weights/status").get("cuda_memory")
    except Exception as exc:  # noqa: BLE001
        out["cuda_memory"] = f"error: {exc}"
    return out


def _brief(out: dict[str, Any]) -> str:
    keys = ("ms_per_token", "tokens_per_s", "tokens", "wall_s", "ttft_p50_ms", "ttft_p99_ms")
    text = ", ".join(f"{k} {_fmt(out[k])}" for k in keys if k in out)
    steps = out.get("engine_steps")
    if steps:
        text += ", engine steps " + ", ".join(
            f"{kind} {steps[kind]['steps']} in {steps[kind]['ms']} ms"
            for kind in ("graph", "eager")
        )
    return text


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(run: Run, plan: list) -> str:
    """The one table: shape x workload rows; baseline, continuous, better x, TTFT p50/p99."""
    base_name = f"the server of {run.args.baseline_tree}" if run.args.baseline_tree else "none"
    lines = [
        f"baseline: {base_name}; continuous: ENGINE=continuous of this tree; "
        f"device {run.args.device} ({run.gpu or 'no nvidia-smi'}), "
        f"DECODE_GRAPHS={run.args.decode_graphs}",
        "better x: above 1 = the continuous engine is better (tok/s: continuous / baseline; "
        "ms a token: baseline / continuous)",
        "| shape | workload | baseline | continuous | better x | TTFT p50 ms base / cont "
        "| TTFT p99 ms base / cont |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape, engines in run.results.items():
        base = engines.get("baseline", {}).get("workloads", {})
        cont = engines.get("continuous", {}).get("workloads", {})
        for key, label, _ in plan:
            b, c = base.get(key, {}), cont.get(key, {})
            metric = "ms_per_token" if key.startswith("1_") else "tokens_per_s"
            unit = "ms/tok" if metric == "ms_per_token" else "tok/s"
            bv, cv = b.get(metric), c.get(metric)
            ratio = "-"
            if bv and cv:
                ratio = f"{(bv / cv if metric == 'ms_per_token' else cv / bv):.2f}"
            lines.append(
                f"| {shape} | {label} | {_cell(b, metric, unit)} | {_cell(c, metric, unit)} "
                f"| {ratio} | {_fmt(b.get('ttft_p50_ms'), 0)} / {_fmt(c.get('ttft_p50_ms'), 0)} "
                f"| {_fmt(b.get('ttft_p99_ms'), 0)} / {_fmt(c.get('ttft_p99_ms'), 0)} |"
            )
        for engine in ("baseline", "continuous"):
            slot = engines.get(engine, {})
            h = slot.get("health") or {}
            lines.append(
                f"| {shape} | {engine}: start {_fmt(slot.get('start_s'))} s | kv_cache "
                f"{json.dumps(h.get('kv_cache'))} | cuda_memory {json.dumps(h.get('cuda_memory'))}"
                " | | | |"
            )
    if run.notes:
        lines.append("notes:")
        lines.extend(f"- {n}" for n in run.notes)
    return "\n".join(lines)


def _cell(out: dict[str, Any], metric: str, unit: str) -> str:
    if "error" in out:
        return out["error"].split(":")[0]
    value = out.get(metric)
    digits = 2 if metric == "ms_per_token" else 1
    return "-" if value is None else f"{value:.{digits}f} {unit}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--home",
        default=os.environ.get("MISERVER_HOME"),
        help="MISERVER_HOME (default: $MISERVER_HOME, else a temporary one)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--decode-graphs", default="captured", help="DECODE_GRAPHS of both servers")
    ap.add_argument(
        "--baseline-tree", help="the baseline: another source tree (a miserver/ package inside)"
    )
    ap.add_argument("--shape", default="135m", choices=sorted(SHAPES))
    ap.add_argument("--shapes", help="comma-separated shapes run in turn (overrides --shape)")
    ap.add_argument("--only", default="1,2,3,4", help="workload numbers, e.g. 1,2,4")
    ap.add_argument(
        "--engines",
        default=None,
        help="which servers run (default: baseline,continuous with --baseline-tree, else "
        "continuous; continuous alone: against a baseline measured in an earlier run on the same "
        "card kind)",
    )
    ap.add_argument("--chats", type=int, default=4, help="workload 1: chats one after another")
    ap.add_argument("--tokens", type=int, default=128, help="workload 1: tokens a chat")
    ap.add_argument("--concurrent", type=int, default=64, help="workload 2: chats at once")
    ap.add_argument("--concurrent-large", type=int, default=256, help="workload 3: chats at once")
    ap.add_argument("--max-tokens-high", type=int, default=192, help="workloads 2-3: top draw")
    ap.add_argument("--grpo-prompts", type=int, default=8, help="workload 4: requests at once")
    ap.add_argument("--grpo-n", default="8,32", help="workload 4: n of each row")
    ap.add_argument("--grpo-tokens", type=int, default=64, help="workload 4: tokens a choice")
    ap.add_argument("--warm-chats", type=int, default=16, help="untimed burst before the timing")
    ap.add_argument(
        "--no-warm-workloads",
        dest="warm_workloads",
        action="store_false",
        help="time workloads 2-4 on their first run (default: each runs once untimed first, "
        "where the budget allows, so first-use captures are not timed)",
    )
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for both servers")
    ap.add_argument("--baseline-env", action="append", default=[], help="KEY=VALUE, baseline")
    ap.add_argument(
        "--continuous-env",
        action="append",
        default=[],
        help="KEY=VALUE for the continuous engine's server (e.g. MAX_BATCH_SIZE=256)",
    )
    ap.add_argument("--budget-s", type=float, default=480.0, help="total wall-clock budget, s")
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--shape-timeout-s", type=float, default=300.0, help="drawing a random model")
    ap.add_argument("--workload-timeout-s", type=float, default=180.0)
    ap.add_argument("--start-estimate-s", type=float, default=30.0, help="before any start ran")
    ap.add_argument("--workload-estimate-s", type=float, default=10.0, help="before it ran once")
    ap.add_argument("--json", help="write the results here (after every part)")
    ap.add_argument("--server-log", help="append the servers' logs here (default: in the home)")
    ap.add_argument("--make-shape", help=argparse.SUPPRESS)  # the child that draws a model
    args = ap.parse_args()
    if args.engines is None:
        args.engines = "baseline,continuous" if args.baseline_tree else "continuous"
    if "baseline" in args.engines.split(",") and not args.baseline_tree:
        ap.error("the baseline is another source tree: give --baseline-tree PATH")

    if args.make_shape:
        name, spec = SHAPES[args.make_shape]
        make_shape(args.home, name, spec, "cuda:0" if args.device == "cuda" else args.device)
        return 0

    # A SIGTERM (the command's timeout) runs the finally blocks that stop the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run = Run(args)
    if args.home is None:
        args.home = tempfile.mkdtemp(prefix="miserver-engine-cuda-")
    args.server_log = args.server_log or str(Path(args.home) / "engine_cuda.log")
    log(f"home {args.home}, server log {args.server_log}, gpu {run.gpu}, budget {args.budget_s} s")
    try:  # the embedded default (once a home): every shape's tokenizer comes from it
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from miserver.serving.models.default_model import import_default;"
                " import_default(sys.argv[1], progress=False)",
                args.home,
            ],
            check=True,
            timeout=min(300.0, max(1.0, run.left())),
            env=_env_here(),
        )
    except (subprocess.SubprocessError, OSError) as exc:
        run.note(f"the default model was not imported: {exc}")
    plan = workload_plan(args)
    shapes = [s for s in (args.shapes or args.shape).split(",") if s]
    models: dict[str, str] = {}
    for shape in shapes:  # every random model first: the budget's shares are then the servers'
        if shape not in SHAPES:
            run.note(f"unknown shape {shape!r} (of {', '.join(SHAPES)}); skipped")
            continue
        model = ensure_shape(run, shape)
        if model is not None:
            models[shape] = model
    try:
        chosen = [e for e in ("baseline", "continuous") if e in args.engines.split(",")]
        for index, (shape, model) in enumerate(models.items()):
            for turn, engine in enumerate(chosen):
                engines_left = len(chosen) * (len(models) - index) - turn
                run_engine(run, shape, model, engine, plan, run.left() / engines_left)
    finally:
        run.save()
        log(f"done in {time.monotonic() - run.t0:.0f} s")
        print(table(run, plan), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
