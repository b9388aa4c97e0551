"""The GPU benchmarks run end to end on the CPU at tiny sizes, so they cannot rot between GPU
runs: benchmarks/weight_sync.py (miserver's barrier over HTTP against a bucketed shared-memory
copy, CPU shared memory), benchmarks/serving_under_training.py (a real ``miserver serve`` on
the embedded default with a trainer committing) and benchmarks/generation_threads.py (decode time
by thread). Each script checks its own results (commits
counted, copies equal, no failed request, identical greedy answers) and exits non-zero when a
check fails; these tests also read the JSON each one writes. benchmarks/kv_budget.py's core
(:func:`measure`) runs in process on a tiny random Llama.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTS_")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a machine with a GPU
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_weight_sync_runs_every_approach_and_checks_them(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run(
        [
            "benchmarks/weight_sync.py",
            "--sizes",
            "tiny",
            "--steps",
            "15",
            "--baseline-steps",
            "4",
            "--warmup",
            "2",
            "--out",
            str(out),
        ],
        tmp_path,
        300,
    )
    rows = json.loads((out / "weight_sync.json").read_text())
    by = {(r["approach"], r["size"]): r for r in rows}
    assert set(by) == {
        ("bare aiohttp, back to back, pipelined", "-"),
        ("bare aiohttp, back to back, sequential", "-"),
        ("bare aiohttp, same write, pipelined", "tiny"),
        ("bare aiohttp, same write, sequential", "tiny"),
        ("miserver, pipelined", "tiny"),
        ("miserver, sequential", "tiny"),
        ("baseline (bucketed IPC copy)", "tiny"),
        # the pipelined client over each server's Unix socket (UNIX_SOCKET)
        ("bare aiohttp, back to back, pipelined, Unix socket", "-"),
        ("bare aiohttp, same write, pipelined, Unix socket", "tiny"),
        ("miserver, pipelined, Unix socket", "tiny"),
    }
    assert all(r["check"] for r in rows)
    assert by[("miserver, pipelined", "tiny")]["steps"] == 15
    assert by[("miserver, sequential", "tiny")]["steps"] == 15
    assert by[("miserver, pipelined, Unix socket", "tiny")]["steps"] == 15
    assert by[("baseline (bucketed IPC copy)", "tiny")]["steps"] == 4
    for r in rows:
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert len(r["samples_ms"]) == r["steps"]
    # the tiny model's one bucket; the weights are the same size on both sides
    base = by[("baseline (bucketed IPC copy)", "tiny")]
    assert base["buckets"] == 1
    assert base["weight_bytes"] == by[("miserver, pipelined", "tiny")]["weight_bytes"] > 0
    assert "| miserver, pipelined | tiny |" in proc.stdout
    # the fair floor has the same step shape: the write sits between commit-begin and end
    assert by[("bare aiohttp, same write, pipelined", "tiny")]["write_p50_ms"] > 0
    # the pipelined rows time two pairs, the sequential ones four calls
    for key in (("miserver, pipelined", "tiny"), ("miserver, pipelined, Unix socket", "tiny")):
        assert list(by[key]["phase_p50_ms"]) == ["quiesce+commit-begin", "commit-end+resume"]
    assert len(by[("miserver, sequential", "tiny")]["phase_p50_ms"]) == 4
    # the server's own cost: handler times (4 a step, minus a block left out at most) and CPU
    for key in (("miserver, pipelined", "tiny"), ("bare aiohttp, same write, pipelined", "tiny")):
        assert by[key]["handler_p50_ms"] > 0 and by[key]["handler_calls"] >= 4 * 5
        assert by[key]["server_cpu_ms_per_call"] > 0  # nanosecond counters on Linux
    assert "The server's own cost per call" in proc.stdout
    assert "WeightsClient.commit() at most 1.2x four sequential bare calls" in proc.stdout
    assert "WeightsClient.commit() (over the Unix socket) at most 1.2x" in proc.stdout
    assert (out / "weight_sync.png").stat().st_size > 0


def test_weight_sync_refuses_an_unknown_size(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/weight_sync.py", "--sizes", "70b"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown size '70b'" in proc.stderr


@pytest.mark.slow
def test_serving_under_training_serves_every_request_while_committing(
    home_with_default: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    _run(
        [
            "benchmarks/serving_under_training.py",
            "--home",
            home_with_default,
            "--requests",
            "2",
            "--max-tokens",
            "6",
            "--out",
            str(out),
        ],
        tmp_path,
        600,
    )
    result = json.loads((out / "serving_under_training.json").read_text())
    phases, trainer = result["phases"], result["trainer"]
    assert list(phases) == ["no trainer", "trainer committing", "no trainer, after"]
    assert all(p["failed"] == 0 and p["tokens"] > 0 for p in phases.values())
    assert trainer["commits"] > 0 and trainer["steps_since_load"] == trainer["commits"]
    assert trainer["refusals"] == {}
    # one greedy answer throughout: the trainer's writes left the values as they were
    assert len({t for p in phases.values() for t in p["texts"]}) == 1
    # answers during training carry the commit count of the weights that produced them
    assert any(";commits=" in s for s in phases["trainer committing"]["served_by"])


def test_generation_threads_measures_every_path(tmp_path: Path) -> None:
    proc = _run(
        [
            "benchmarks/generation_threads.py",
            "--device",
            "cpu",
            "--layers",
            "2",
            "--tokens",
            "4",
            "--repeats",
            "1",
        ],
        tmp_path,
        300,
    )
    rows = {
        line.split(" | ")[0].lstrip("| "): float(line.split(" | ")[1])
        for line in proc.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| path")
    }
    assert set(rows) == {
        "miserver engine #1 (its engine thread is new)",
        "miserver engine #2..#2 (same engine thread)",
        "transformers generate",
        "decode loop, main thread",
        "decode loop, fresh thread each run",
        "decode loop, fresh thread, after a 1-token warm-up in it",
        "decode loop, fresh thread, after a 8-token warm-up in it",
        *(f"decode loop, fresh thread, 16 tokens: quarter {i}" for i in range(1, 5)),
        "miserver engine on a new engine thread, no warm-up (interleaved)",
        "miserver engine on a new engine thread after a 2-token warm-up request",
    }
    assert all(ms > 0 for ms in rows.values())


def test_request_overhead_measures_every_path(tmp_path: Path) -> None:
    """benchmarks/request_overhead.py (issue 14: the server's own CPU a request): a real
    ``miserver serve`` on a tiny Llama, chats, completions and a Batch API job, the decode loop
    alone, and a profile of the server, at tiny sizes."""
    out = tmp_path / "overhead.json"
    proc = _run(
        [
            "benchmarks/request_overhead.py",
            "--requests",
            "4",
            "--tokens",
            "1,2",
            "--rounds",
            "1",
            "--endpoints",
            "chat,completion",
            "--batch-rows",
            "3",
            "--batch-size",
            "4",
            "--decode-loop",
            "--loop-rows",
            "2",
            "--loop-tokens",
            "4",
            "--profile",
            "--top",
            "5",
            "--cache",
            str(tmp_path / "cache"),
            "--json",
            str(out),
        ],
        tmp_path,
        600,
    )
    result = json.loads(out.read_text())
    rows = {(r["endpoint"], r["max_tokens"]) for r in result["requests"]}
    assert rows == {(e, t) for e in ("chat", "completion", "batch") for t in (1, 2)}
    assert all(r["cpu_ms"] >= 0 and r["batches"] >= 1 for r in result["requests"])
    assert {(r["rows"], r["events"]) for r in result["decode_loop"]} == {
        (2, "streamed"),
        (2, "whole"),
    }
    assert "| chat | 1 | 4 |" in proc.stdout
    assert "top 5 by cumulative time" in proc.stdout and "top 5 by own time" in proc.stdout


ENGINE_CUDA_TINY = [
    "benchmarks/engine_cuda.py",
    "--device",
    "cpu",
    "--decode-graphs",
    "off",
    "--shapes",
    "tiny",
    "--chats",
    "2",
    "--tokens",
    "6",
    "--concurrent",
    "3",
    "--max-tokens-high",
    "12",
    "--grpo-prompts",
    "2",
    "--grpo-n",
    "2",
    "--grpo-tokens",
    "5",
    "--warm-chats",
    "2",
    "--budget-s",
    "400",
]


@pytest.mark.slow
def test_engine_cuda_compares_both_engines_on_every_workload(
    home_with_default: str, tmp_path: Path
) -> None:
    """The issue-34 script on the CPU: a random tiny shape (its output head wider than the
    tokenizer) served by a baseline tree (this one, ``--baseline-tree``: what the script runs
    there is the same code path as an older checkout) then this tree, the same workloads on
    each."""
    out = tmp_path / "engine.json"
    proc = _run(
        [
            *ENGINE_CUDA_TINY,
            "--home",
            home_with_default,
            "--only",
            "1,2,4",
            "--baseline-tree",
            str(REPO),
            "--json",
            str(out),
        ],
        tmp_path,
        400,
    )
    result = json.loads(out.read_text())
    assert result["notes"] == []
    engines = result["results"]["tiny"]
    assert set(engines) == {"baseline", "continuous"}
    for engine in engines.values():
        assert engine["package"] == str(REPO / "miserver")
        work = engine["workloads"]
        assert set(work) == {"1_one_chat", "2_concurrent_3", "4_grpo_n2"}
        assert work["1_one_chat"]["ms_per_token"] > 0
        assert work["1_one_chat"]["tokens"] > 2
        assert work["2_concurrent_3"]["tokens"] > 3
        assert 0 < work["2_concurrent_3"]["ttft_p50_ms"] <= work["2_concurrent_3"]["ttft_p99_ms"]
        assert work["4_grpo_n2"]["tokens"] == 2 * 2 * 5  # sampled over the tokenizer's ids only
        assert work["4_grpo_n2"]["tokens_per_s"] > 0
    for engine in engines.values():  # the paged cache, and where each workload's time went
        assert engine["health"]["kv_cache"]["blocks_total"] > 0
        steps = engine["workloads"]["2_concurrent_3"]["engine_steps"]
        assert steps["eager"]["steps"] + steps["graph"]["steps"] > 0 and steps["slowest_ms"] > 0
    table = [line for line in proc.stdout.splitlines() if line.startswith("| tiny | ")]
    assert len(table) == 3 + 2  # three workload rows, then each engine's start and memory
    cont = engines["continuous"]["workloads"]["2_concurrent_3"]["tokens_per_s"]
    base = engines["baseline"]["workloads"]["2_concurrent_3"]["tokens_per_s"]
    assert f"| {cont / base:.2f} |" in table[1]


@pytest.mark.slow
def test_engine_cuda_reports_a_baseline_that_does_not_start_and_goes_on(
    home_with_default: str, tmp_path: Path
) -> None:
    out = tmp_path / "engine.json"
    proc = _run(
        [
            *ENGINE_CUDA_TINY,
            "--home",
            home_with_default,
            "--only",
            "2",
            "--baseline-tree",
            str(tmp_path / "missing"),
            "--json",
            str(out),
        ],
        tmp_path,
        300,
    )
    result = json.loads(out.read_text())
    assert (
        len(result["notes"]) == 1
        and "tiny/baseline: the server did not start" in result["notes"][0]
    )
    engines = result["results"]["tiny"]
    assert engines["baseline"]["workloads"] == {}
    assert engines["continuous"]["workloads"]["2_concurrent_3"]["tokens"] > 3
    assert "tiny/baseline: the server did not start" in proc.stdout


def test_kv_budget_cache_follows_the_budget_not_rows_times_context() -> None:
    """benchmarks/kv_budget.py's core on a tiny random Llama, in process (a few seconds): each
    budget's cache is as many whole blocks as fit it (never more bytes than the budget), a larger
    budget holds more blocks and more sequences at once, the smallest preempts and every budget
    still completes every request with the largest budget's greedy tokens."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import kv_budget

    from miserver.serving.engine.kv_cache import cache_shape
    from miserver.spec.settings import ConfigError
    from tests.tiny_llama import sharp_tiny_llama

    assert kv_budget.parse_budgets("8MiB, 1.5GiB,2097152") == [8 << 20, 3 << 29, 2 << 20]
    for bad in ("auto", "8MiB,12 parsecs", "512KiB"):
        with pytest.raises(ConfigError):
            kv_budget.parse_budgets(bad)

    model = sharp_tiny_llama(max_position_embeddings=4096)
    block = cache_shape(model).bytes_per_token * 16
    # budgets that are not whole blocks: 6.5, 13.5 and 41.5 blocks' bytes
    budgets = [block * 13 // 2, block * 27 // 2, block * 83 // 2]
    requests = 8
    rows = kv_budget.measure(model, budgets, prompt_len=8, tokens=24, requests=requests, warm=False)

    assert [r["budget"] for r in rows] == budgets
    for r in rows:
        assert r["cache_bytes"] <= r["budget"] < r["cache_bytes"] + block  # whole blocks, floored
        assert r["cache_bytes"] == (r["blocks"] + 1) * block  # the scratch block counts
        assert r["cache_tokens"] == r["blocks"] * 16
        assert r["fit"] == r["blocks"] // 2  # 8 + 24 positions: two blocks a sequence
        assert r["completed"] == requests and r["same_text"] == requests
        assert all(len(ids) == 24 for ids in r["outputs"].values())
        assert r["peak_running"] <= min(r["blocks"], requests)
        assert r["tokens_per_s"] > 0 and r["cpu_s"] > 0
    assert [r["blocks"] for r in rows] == [5, 12, 40]
    assert [r["fit"] for r in rows] == [2, 6, 20]
    small, _, large = rows
    assert small["preemptions"] > 0 and small["peak_running"] < requests
    assert large["preemptions"] == 0 and large["peak_running"] == requests
    # a static cache of 8 rows x 4096 positions would be 2048 blocks, not 40
    table = kv_budget.table(rows, 8, 24).splitlines()
    assert len(table) == 2 + 3
    assert table[2].startswith("| 0.05 MiB | 0.05 MiB | 5 | 80 | 2 |")
    assert table[4].split("|")[10].strip() == "reference"
    assert table[2].split("|")[10].strip() == f"{requests}/{requests}"


def test_cpu_linear_compares_both_paths_with_the_same_tokens() -> None:
    """benchmarks/cpu_linear.py's core on a tiny random Llama in bfloat16, in process: both
    sides (F.linear, weight @ inputᵀ) run every batch size, alternating, and decode the same
    greedy tokens (a batch of 40 takes the 128-row pass, the other side two passes)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import cpu_linear

    from tests.tiny_llama import sharp_tiny_llama

    model = sharp_tiny_llama().to(torch.bfloat16)
    table = cpu_linear.measure(model, [1, 40], list(range(3, 12)), 2, 2, budget=8 << 20)
    assert [row[0] for row in table] == [1, 40]
    for _batch, off, on, same in table:
        assert same
        assert all(t > 0 for t in (*off, *on))
