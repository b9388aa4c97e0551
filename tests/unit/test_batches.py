"""The Batch API store, validation, runner and routes (contract 7), with a fake runtime seam.

The seam (``waiting_reason`` / ``execute_row``) stands in for the generation runtime here; the
real path runs in tests/e2e/test_batch_openai.py against a live server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from miserver.http import batches as batch_routes
from miserver.http.errors import json_errors_middleware
from miserver.serving.batches.input_file import BatchRequestError, parse_batch_input
from miserver.serving.batches.runner import BatchRunner, RowDeferred
from miserver.serving.batches.store import BatchStore
from miserver.serving.engine.slot import HeldCounts
from tests.waiting import eventually

MODEL = "smollm2-135m-instruct"
HEADER = '"smollm2-135m-instruct";origin=model;commits=0'


def line(
    cid: str, *, url: str = "/v1/chat/completions", model: str = MODEL, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": cid}]}
    body.update(extra)
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def jsonl(rows: list[Any]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


class FakeExecutor:
    """The runtime seam: echoes the prompt, refuses ``max_tokens < 1``, counts every call."""

    def __init__(self) -> None:
        self.reasons: dict[str, str | None] = {}
        self.global_reason: str | None = None
        self.calls: Counter[str] = Counter()
        self.crash_after: int | None = None
        self.respond: tuple[int, dict[str, Any]] | None = None
        self.defer: str | None = None

    def waiting_reason(self, model: str) -> str | None:
        return self.global_reason or self.reasons.get(model)

    async def execute_row(
        self, method: str, url: str, body: dict[str, Any], *, unit: Any = None
    ) -> tuple[int, dict[str, str], dict[str, Any]]:
        assert method == "POST"
        prompt = body["messages"][0]["content"]
        if self.defer is not None:
            raise RowDeferred(self.defer)
        if self.crash_after is not None and sum(self.calls.values()) >= self.crash_after:
            self.calls[prompt] += 1
            raise SimulatedCrash(prompt)
        self.calls[prompt] += 1
        if self.respond is not None:
            return 200 if self.respond[0] == 200 else self.respond[0], {}, self.respond[1]
        if body.get("max_tokens", 1) < 1:
            return (
                400,
                {},
                {
                    "error": {
                        "message": "max_tokens must be at least 1",
                        "type": "invalid_request_error",
                        "param": "max_tokens",
                        "code": "invalid_request",
                    }
                },
            )
        return (
            200,
            {"X-miLLM-Model": HEADER},
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "echo " + prompt},
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            },
        )


class SimulatedCrash(BaseException):
    """The process dies in the middle of a row (not an Exception: nothing may catch it)."""


@pytest.fixture
def store(tmp_path: Path) -> BatchStore:
    s = BatchStore(tmp_path)
    yield s
    s.close()


def new_batch(store: BatchStore, rows: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    f = store.create_file(jsonl(rows), filename="in.jsonl", purpose="batch")
    return store.create_batch(
        {
            "input_file_id": f["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            **kw,
        }
    )


def output(store: BatchStore, batch: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    def read(fid: str | None) -> list[dict]:
        if fid is None:
            return []
        return [json.loads(x) for x in store.file_content(fid).decode().splitlines()]

    b = store.get_batch(batch["id"])
    return read(b["output_file_id"]), read(b["error_file_id"])


# -- validation --------------------------------------------------------------------------------


def test_valid_file_parses_in_order_and_skips_blank_lines():
    rows = parse_batch_input(jsonl([line("a"), line("b", url="/v1/completions")]) + b"\n\n")
    assert [(r.line, r.custom_id, r.url, r.model) for r in rows] == [
        (1, "a", "/v1/chat/completions", MODEL),
        (2, "b", "/v1/completions", MODEL),
    ]


@pytest.mark.parametrize(
    "bad, words",
    [
        ('{"custom_id": "x"', "line 2: is not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "line 2: nests arrays or objects too deeply"),
        ('{"custom_id": "x", "n": 1e999}', "line 2: is not valid JSON (Number out of range"),
        ("[1, 2]", "line 2: must be a JSON object"),
        (
            json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions"}),
            "line 2: missing body",
        ),
        (json.dumps({**line("x"), "extra": 1}), "line 2: unknown field extra"),
        (json.dumps({**line("x"), "method": "GET"}), 'line 2: method must be "POST"'),
        (json.dumps(line("x", url="/v1/embeddings")), "line 2: url must be one of"),
        (json.dumps({**line("x"), "custom_id": ""}), "line 2: custom_id must be a non-empty"),
        (json.dumps({**line("x"), "custom_id": 7}), "line 2: custom_id must be a non-empty"),
        (json.dumps({**line("x"), "body": []}), "line 2: body must be a JSON object"),
        (json.dumps(line("x", model="")), "line 2: body.model must be a non-empty string"),
        (json.dumps(line("x", stream=True)), "line 2: body.stream must be false"),
        (json.dumps(line("a")), 'line 2: custom_id "a" repeats line 1'),
    ],
)
def test_each_bad_line_is_named_by_number(bad: str, words: str):
    data = jsonl([line("a")]) + bad.encode() + b"\n"
    with pytest.raises(BatchRequestError) as info:
        parse_batch_input(data)
    assert words in info.value.message
    assert info.value.code.status == 400 and info.value.param == "file"


def test_many_bad_lines_are_summarised():
    data = b"x\n" * 9
    with pytest.raises(BatchRequestError) as info:
        parse_batch_input(data)
    assert "line 1:" in info.value.message and "line 5:" in info.value.message
    assert "line 6:" not in info.value.message and "(and 4 more)" in info.value.message


@pytest.mark.parametrize(
    "data, words", [(b"", "no requests"), (b"\n  \n", "no requests"), (b"\xff\xfe", "not UTF-8")]
)
def test_empty_or_undecodable_files_are_refused(data: bytes, words: str):
    with pytest.raises(BatchRequestError, match=words):
        parse_batch_input(data)


# -- the store ---------------------------------------------------------------------------------


def test_file_round_trip_and_refusals_store_nothing(store: BatchStore, tmp_path: Path):
    data = jsonl([line("a")])
    f = store.create_file(data, filename="in.jsonl", purpose="batch")
    assert f["id"].startswith("file-") and f["object"] == "file" and f["bytes"] == len(data)
    assert (f["purpose"], f["filename"], f["status"]) == ("batch", "in.jsonl", "processed")
    assert store.get_file(f["id"]) == f and store.file_content(f["id"]) == data
    for kwargs in ({"purpose": "fine-tune"}, {"purpose": "batch", "data": b"nope\n"}):
        with pytest.raises(BatchRequestError):
            store.create_file(kwargs.pop("data", data), filename="x", **kwargs)
    assert [x["id"] for x in store.list_files()["data"]] == [f["id"]]
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [f["id"] + ".jsonl"]
    with pytest.raises(BatchRequestError) as info:
        store.get_file("file-nope")
    assert info.value.code.status == 404
    assert store.delete_file(f["id"]) == {"id": f["id"], "object": "file", "deleted": True}
    assert store.list_files()["data"] == [] and not list((tmp_path / "files").iterdir())


def test_batch_object_has_openai_fields(store: BatchStore):
    b = new_batch(store, [line("a"), line("b")], metadata={"run": "7"})
    assert b["id"].startswith("batch_") and b["object"] == "batch"
    assert (b["status"], b["endpoint"], b["completion_window"]) == (
        "in_progress",
        "/v1/chat/completions",
        "24h",
    )
    assert b["request_counts"] == {"total": 2, "completed": 0, "failed": 0}
    assert b["expires_at"] - b["created_at"] == 24 * 3600 and b["in_progress_at"] is not None
    assert b["metadata"] == {"run": "7"} and b["model"] == MODEL and b["waiting_reason"] is None
    for key in (
        "errors",
        "output_file_id",
        "error_file_id",
        "finalizing_at",
        "completed_at",
        "failed_at",
        "expired_at",
        "cancelling_at",
        "cancelled_at",
    ):
        assert b[key] is None, key


@pytest.mark.parametrize(
    "change, param",
    [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
        ({"input_file_id": "file-missing"}, "input_file_id"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"surprise": True}, "surprise"),
        ({"endpoint": None}, "endpoint"),
        ({"endpoint": "/v1/completions"}, "endpoint"),  # the lines say chat/completions
    ],
)
def test_bad_batch_requests_are_refused_and_create_nothing(store: BatchStore, change, param):
    f = store.create_file(jsonl([line("a")]), filename="in.jsonl", purpose="batch")
    req = {
        "input_file_id": f["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        **change,
    }
    with pytest.raises(BatchRequestError) as info:
        store.create_batch(req)
    assert info.value.param == param
    assert store.list_batches()["data"] == []


def test_output_files_cannot_start_a_batch(store: BatchStore):
    b = new_batch(store, [line("a")])
    runner = BatchRunner(store, FakeExecutor())
    asyncio.run(runner.run_until_idle())
    out_id = store.get_batch(b["id"])["output_file_id"]
    with pytest.raises(BatchRequestError, match="purpose batch_output"):
        store.create_batch(
            {
                "input_file_id": out_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            }
        )


def test_list_batches_pages_newest_first(store: BatchStore):
    ids = [new_batch(store, [line("a")])["id"] for _ in range(5)]
    page = store.list_batches(limit=2)
    assert [b["id"] for b in page["data"]] == ids[::-1][:2] and page["has_more"]
    page2 = store.list_batches(limit=2, after=page["last_id"])
    assert [b["id"] for b in page2["data"]] == ids[::-1][2:4] and page2["has_more"]
    page3 = store.list_batches(limit=2, after=page2["last_id"])
    assert [b["id"] for b in page3["data"]] == ids[:1] and not page3["has_more"]
    with pytest.raises(BatchRequestError):
        store.list_batches(limit=0)


# -- the runner --------------------------------------------------------------------------------


async def test_rows_complete_with_openai_output_lines(store: BatchStore):
    b = new_batch(store, [line("a"), line("bad", max_tokens=0), line("c")])
    ex = FakeExecutor()
    await BatchRunner(store, ex, chunk_size=2).run_until_idle()
    done = store.get_batch(b["id"])
    assert done["status"] == "completed" and done["completed_at"] is not None
    assert done["finalizing_at"] is not None
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert done["usage"]["input_tokens"] == 6 and done["usage"]["total_tokens"] == 10
    out, err = output(store, b)
    assert [x["custom_id"] for x in out] == ["a", "c"] and [x["custom_id"] for x in err] == ["bad"]
    first = out[0]
    assert first["id"].startswith("batch_req_") and first["error"] is None
    assert first["response"]["status_code"] == 200
    assert first["response"]["headers"] == {"X-miLLM-Model": HEADER}
    assert first["response"]["body"]["choices"][0]["message"]["content"] == "echo a"
    assert err[0]["response"]["status_code"] == 400
    assert err[0]["response"]["body"]["error"]["param"] == "max_tokens"
    assert store.get_file(done["output_file_id"])["purpose"] == "batch_output"
    assert ex.calls == Counter({"a": 1, "bad": 1, "c": 1})


@pytest.mark.parametrize("reason", ["weights_torn", "model_not_resident"])
async def test_a_waiting_batch_runs_nothing_and_fails_nothing(store: BatchStore, reason: str):
    b = new_batch(store, [line("a"), line("b")])
    ex = FakeExecutor()
    ex.global_reason = reason
    runner = BatchRunner(store, ex)
    await runner.run_until_idle()
    now = store.get_batch(b["id"], runner.waiting_reason(b["id"]))
    assert now["status"] == "in_progress" and now["waiting_reason"] == reason
    assert now["request_counts"] == {"total": 2, "completed": 0, "failed": 0} and not ex.calls
    ex.global_reason = None
    await runner.run_until_idle()
    assert store.get_batch(b["id"])["request_counts"]["completed"] == 2
    assert runner.waiting_reason(b["id"]) is None


async def test_rows_for_a_model_not_resident_wait_while_others_run(store: BatchStore):
    b = new_batch(store, [line("x1", model="other"), line("a"), line("x2", model="other")])
    ex = FakeExecutor()
    ex.reasons["other"] = "model_not_resident"
    runner = BatchRunner(store, ex)
    await runner.run_until_idle()
    assert ex.calls == Counter({"a": 1})
    assert runner.waiting_reason(b["id"]) == "model_not_resident"
    assert store.get_batch(b["id"])["status"] == "in_progress"
    ex.reasons.clear()
    await runner.run_until_idle()
    assert store.get_batch(b["id"])["status"] == "completed"
    assert ex.calls == Counter({"a": 1, "x1": 1, "x2": 1})


async def test_quiesced_rows_still_go_to_the_scheduler_and_report_it(store: BatchStore):
    b = new_batch(store, [line("a")])
    ex = FakeExecutor()
    gate = asyncio.Event()
    seen: list[str | None] = []
    runner = BatchRunner(store, ex)

    async def held(method: str, url: str, body: dict[str, Any], unit: Any = None):
        seen.append(runner.waiting_reason(b["id"]))
        await gate.wait()  # the scheduler holds the chunk until resume
        return await FakeExecutor.execute_row(ex, method, url, body)

    ex.global_reason = "quiesced"
    ex.execute_row = held  # type: ignore[method-assign]
    task = asyncio.create_task(runner.run_until_idle())
    await eventually(lambda: seen, "the runner offered the row")
    assert seen == ["quiesced"]
    assert store.get_batch(b["id"], runner.waiting_reason(b["id"]))["waiting_reason"] == "quiesced"
    ex.global_reason = None
    gate.set()
    await task
    assert store.get_batch(b["id"])["status"] == "completed"


@pytest.mark.parametrize(
    "code, reason",
    [
        ("weights_torn", "weights_torn"),
        ("model_not_loaded", "model_not_resident"),
        ("model_busy", "model_not_resident"),
        ("queue_full", None),
    ],
)
async def test_runtime_refusals_that_mean_not_now_defer_the_row(store: BatchStore, code, reason):
    b = new_batch(store, [line("a")])
    ex = FakeExecutor()
    ex.respond = (
        503,
        {"error": {"message": "m", "type": "server_error", "param": None, "code": code}},
    )
    runner = BatchRunner(store, ex)
    await runner.run_until_idle()
    assert runner.waiting_reason(b["id"]) == reason
    assert store.get_batch(b["id"])["request_counts"] == {"total": 1, "completed": 0, "failed": 0}
    assert store.get_batch(b["id"])["status"] == "in_progress"
    ex.respond = None
    await runner.run_until_idle()
    assert store.get_batch(b["id"])["request_counts"] == {"total": 1, "completed": 1, "failed": 0}


async def test_row_deferred_by_the_seam_waits(store: BatchStore):
    b = new_batch(store, [line("a")])
    ex = FakeExecutor()
    ex.defer = "weights_torn"
    runner = BatchRunner(store, ex)
    await runner.run_until_idle()
    assert runner.waiting_reason(b["id"]) == "weights_torn"
    assert store.get_batch(b["id"])["status"] == "in_progress"


async def test_a_seam_exception_fails_only_that_row(store: BatchStore):
    b = new_batch(store, [line("boom"), line("a")])
    ex = FakeExecutor()
    real = ex.execute_row

    tries: Counter[str] = Counter()

    async def flaky(method, url, body, unit=None):
        if body["messages"][0]["content"] == "boom":
            tries["boom"] += 1
            raise RuntimeError("bug")
        return await real(method, url, body)

    ex.execute_row = flaky  # type: ignore[method-assign]
    await BatchRunner(store, ex, retry_s=0).run_until_idle()
    out, err = output(store, b)
    assert [x["custom_id"] for x in out] == ["a"]
    assert err[0]["response"]["status_code"] == 500
    assert err[0]["response"]["body"]["error"]["code"] == "internal_error"
    assert tries == {"boom": 3}  # MAX_ATTEMPTS, then the error line


async def test_a_transient_seam_fault_is_retried_not_failed(store: BatchStore):
    b = new_batch(store, [line(c) for c in "abc"])
    ex = FakeExecutor()
    real = ex.execute_row
    faults = [RuntimeError("blip"), RuntimeError("blip")]

    async def blip(method, url, body, unit=None):
        if faults:
            raise faults.pop()
        return await real(method, url, body)

    ex.execute_row = blip  # type: ignore[method-assign]
    await BatchRunner(store, ex, retry_s=0).run_until_idle()
    assert store.get_batch(b["id"])["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert ex.calls == Counter("abc")


async def test_cancel_keeps_results_so_far(store: BatchStore):
    b = new_batch(store, [line(c) for c in "abcd"])
    ex = FakeExecutor()
    runner = BatchRunner(store, ex)
    real = ex.execute_row

    async def cancel_after_b(method, url, body, unit=None):
        result = await real(method, url, body)
        if body["messages"][0]["content"] == "b":
            assert store.cancel_batch(b["id"])["status"] == "cancelling"
        return result

    ex.execute_row = cancel_after_b  # type: ignore[method-assign]
    await runner.run_until_idle()
    done = store.get_batch(b["id"])
    assert done["status"] == "cancelled" and done["cancelled_at"] and done["cancelling_at"]
    assert [x["custom_id"] for x in output(store, b)[0]] == ["a", "b"]
    assert store.cancel_batch(b["id"])["status"] == "cancelled"  # idempotent
    other = new_batch(store, [line("z")])
    await runner.run_until_idle()
    with pytest.raises(BatchRequestError, match="completed and cannot be cancelled"):
        store.cancel_batch(other["id"])


async def test_a_chunks_rows_run_concurrently_each_recorded_as_it_finishes(store: BatchStore):
    """The rows of a chunk are inside execute_row together, in one Unit of the chunk's size;
    a row's result is recorded as soon as it finishes, while the others still run."""
    cids = [f"r{i}" for i in range(5)]
    b = new_batch(store, [line(c) for c in cids])
    ex = FakeExecutor()
    real = ex.execute_row
    inside: set[str] = set()
    most = [0]
    units: dict[str, Any] = {}
    gates = {c: asyncio.Event() for c in cids}

    async def gated(method, url, body, unit=None):
        cid = body["messages"][0]["content"]
        inside.add(cid)
        most[0] = max(most[0], len(inside))
        units[cid] = unit
        try:
            await asyncio.wait_for(gates[cid].wait(), 30)
        finally:
            inside.discard(cid)
        return await real(method, url, body)

    ex.execute_row = gated  # type: ignore[method-assign]
    runner = BatchRunner(store, ex, chunk_size=4)
    task = asyncio.create_task(runner.run_until_idle())
    await eventually(lambda: len(inside) == 4, "the chunk's four rows inside execute_row at once")
    gates["r2"].set()  # the third row ends first
    await eventually(lambda: "r2" in store.done_results(b["id"]), "r2 recorded")
    assert inside == {"r0", "r1", "r3"}  # recorded while the rest of its chunk still runs
    assert store.get_batch(b["id"])["request_counts"]["completed"] == 1
    for gate in gates.values():
        gate.set()
    await asyncio.wait_for(task, 30)
    assert most[0] == 4 and ex.calls == Counter(cids)
    first = units["r0"]
    assert all(units[c] is first for c in cids[:4]) and first.members == 4
    assert units["r4"] is not first and units["r4"].members == 1  # the second chunk
    out, err = output(store, b)
    assert err == [] and [x["custom_id"] for x in out] == cids  # in file order


async def test_a_cancel_stops_every_row_in_flight_and_only_that_batch(store: BatchStore):
    """The rows of a chunk held in the scheduler (or generating) when their batch is cancelled
    all stop at once: no result, the batch ends cancelled with the rows finished before; a
    cancel of another batch touches none of them."""
    b = new_batch(store, [line("quick"), line("held1"), line("held2")])
    ex = FakeExecutor()
    runner = BatchRunner(store, ex, poll_s=0.01)
    started: list[str] = []
    stopped: list[str] = []
    real = ex.execute_row

    async def held(method, url, body, unit=None):
        cid = body["messages"][0]["content"]
        if cid.startswith("held"):
            started.append(cid)
            try:
                await asyncio.Event().wait()  # a quiesce that never ends
            except asyncio.CancelledError:
                stopped.append(cid)
                raise
        return await real(method, url, body)

    ex.execute_row = held  # type: ignore[method-assign]
    task = asyncio.create_task(runner.run_until_idle())
    await eventually(lambda: len(started) == 2, "both held rows inside execute_row")
    await eventually(lambda: store.done_results(b["id"]), "the quick row recorded")
    runner.cancel("batch_other")  # another batch's cancel leaves the rows running
    await asyncio.sleep(0.05)
    assert not stopped and not task.done()
    assert store.cancel_batch(b["id"])["status"] == "cancelling"
    runner.cancel(b["id"])
    await asyncio.wait_for(task, 30)
    assert sorted(stopped) == ["held1", "held2"]
    done = store.get_batch(b["id"])
    assert done["status"] == "cancelled"
    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    assert [x["custom_id"] for x in output(store, b)[0]] == ["quick"]
    assert ex.calls == Counter({"quick": 1})  # neither held row produced an answer
    other = new_batch(store, [line("z")])
    await runner.run_until_idle()
    assert store.get_batch(other["id"])["status"] == "completed"


async def test_stopping_the_runner_is_not_a_cancel(store: BatchStore):
    b = new_batch(store, [line("a")])
    ex = FakeExecutor()
    runner = BatchRunner(store, ex)
    started = asyncio.Event()

    async def held(method, url, body, unit=None):
        started.set()
        await asyncio.Event().wait()

    ex.execute_row = held  # type: ignore[method-assign]
    runner.start()
    await asyncio.wait_for(started.wait(), 5)
    await runner.stop()
    assert store.get_batch(b["id"])["status"] == "in_progress"  # runs again after a restart


async def test_the_completion_window_expires_waiting_rows(tmp_path: Path):
    now = [1_000_000.0]
    store = BatchStore(tmp_path, clock=lambda: now[0])
    b = new_batch(store, [line("a"), line("b", model="gone")])
    ex = FakeExecutor()
    ex.reasons["gone"] = "model_not_resident"
    runner = BatchRunner(store, ex)
    await runner.run_until_idle()
    assert store.get_batch(b["id"])["status"] == "in_progress"
    now[0] += 24 * 3600
    await runner.run_until_idle()
    done = store.get_batch(b["id"])
    assert done["status"] == "expired" and done["expired_at"] == int(now[0])
    assert done["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    out, err = output(store, b)
    assert [x["custom_id"] for x in out] == ["a"]
    assert err[0]["custom_id"] == "b" and err[0]["error"]["code"] == "batch_expired"
    store.close()


async def test_exactly_once_across_a_crash_and_a_reopen(tmp_path: Path):
    cids = [f"r{i}" for i in range(12)]
    store = BatchStore(tmp_path)
    b = new_batch(store, [line(c) for c in cids])
    ex = FakeExecutor()
    ex.crash_after = 5
    with pytest.raises(SimulatedCrash):
        await BatchRunner(store, ex, chunk_size=4).run_until_idle()
    recorded = store.done_results(b["id"])
    assert list(recorded) == cids[:5]
    store.close()

    store = BatchStore(tmp_path)  # the restart
    ex2 = FakeExecutor()
    await BatchRunner(store, ex2, chunk_size=4).run_until_idle()
    out, err = output(store, b)
    assert err == [] and sorted(x["custom_id"] for x in out) == sorted(cids)
    assert Counter(x["custom_id"] for x in out) == Counter(cids)
    for x in out[:5]:  # the lines recorded before the crash, untouched
        assert x == recorded[x["custom_id"]]
    # rows finished before the crash never ran again; the one running at the crash ran again
    assert ex.calls == Counter({c: 1 for c in cids[:6]})
    assert ex2.calls == Counter({c: 1 for c in cids[5:]})
    assert store.get_batch(b["id"])["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    store.close()


async def test_a_cancel_survives_a_restart(tmp_path: Path):
    store = BatchStore(tmp_path)
    b = new_batch(store, [line("a"), line("b")])
    ex = FakeExecutor()
    ex.crash_after = 1
    with pytest.raises(SimulatedCrash):
        await BatchRunner(store, ex).run_until_idle()
    store.cancel_batch(b["id"])
    store.close()
    store = BatchStore(tmp_path)
    await BatchRunner(store, FakeExecutor()).run_until_idle()
    done = store.get_batch(b["id"])
    assert done["status"] == "cancelled"
    assert [x["custom_id"] for x in output(store, b)[0]] == ["a"]
    store.close()


async def test_a_crash_while_finalizing_is_finished_after_the_restart(tmp_path: Path):
    store = BatchStore(tmp_path)
    b = new_batch(store, [line("a"), line("bad", max_tokens=0)])
    writes = []

    def dying_write(file_id: str, data: bytes) -> Path:
        path = BatchStore._write_blob(store, file_id, data)
        writes.append(file_id)
        if len(writes) == 2:  # both blobs written, nothing committed
            raise SimulatedCrash
        return path

    store._write_blob = dying_write  # type: ignore[method-assign]
    with pytest.raises(SimulatedCrash):
        await BatchRunner(store, FakeExecutor()).run_until_idle()
    assert store.get_batch(b["id"])["status"] == "finalizing"
    store.close()
    store = BatchStore(tmp_path)
    assert store.active_batches()[0]["id"] == b["id"]  # opening removed the orphan blobs
    assert not any((tmp_path / "files" / f"{w}.jsonl").exists() for w in writes)
    await BatchRunner(store, FakeExecutor()).run_until_idle()
    out, err = output(store, b)
    assert [x["custom_id"] for x in out] == ["a"] and [x["custom_id"] for x in err] == ["bad"]
    assert len(store.list_files(purpose="batch_output")["data"]) == 2
    store.close()


def test_record_result_counts_a_row_once(store: BatchStore):
    b = new_batch(store, [line("a")])
    row = store.pending_rows(b["id"], MODEL, 10)[0]
    assert store.record_result(row, ok=True, line={"custom_id": "a"})
    assert not store.record_result(row, ok=True, line={"custom_id": "a", "again": 1})
    assert store.get_batch(b["id"])["request_counts"]["completed"] == 1
    assert store.done_results(b["id"]) == {"a": {"custom_id": "a"}}


_CHILD = textwrap.dedent("""
    import asyncio, os, sys
    from miserver.serving.batches.runner import BatchRunner
    from miserver.serving.batches.store import BatchStore
    home, log = sys.argv[1], sys.argv[2]

    class Slow:
        def waiting_reason(self, model):
            return None
        async def execute_row(self, method, url, body, unit=None):
            cid = body["messages"][0]["content"]
            with open(log, "a") as fh:
                fh.write(cid + "\\n"); fh.flush(); os.fsync(fh.fileno())
            await asyncio.sleep(0.02)
            return 200, {"X-miLLM-Model": '"m";origin=model'}, {"echo": cid}

    asyncio.run(BatchRunner(BatchStore(home), Slow(), chunk_size=3).run_until_idle())
""")


def test_kill_9_mid_batch_then_restart_runs_every_row_exactly_once(tmp_path: Path):
    cids = [f"k{i}" for i in range(60)]
    store = BatchStore(tmp_path)
    b = new_batch(store, [line(c) for c in cids])
    log = tmp_path / "executed.log"
    cmd = [sys.executable, "-c", _CHILD, str(tmp_path), str(log)]
    child = subprocess.Popen(cmd)
    deadline = time.monotonic() + 30
    while len(store.done_results(b["id"])) < 10:
        assert time.monotonic() < deadline and child.poll() is None, "the child did not progress"
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    before = store.done_results(b["id"])
    assert 10 <= len(before) < len(cids)
    subprocess.run(cmd, check=True, timeout=60)
    out, err = output(store, b)
    assert err == [] and Counter(x["custom_id"] for x in out) == Counter(cids)
    for x in out:
        assert x["response"]["body"] == {"echo": x["custom_id"]}
        if x["custom_id"] in before:
            assert x == before[x["custom_id"]]  # recorded before the kill: never run again
    executed = Counter(log.read_text().split())
    assert all(executed[c] == 1 for c in before)
    # at most the rows that were running at the kill: one chunk (chunk_size=3), run together
    assert sum(executed.values()) - len(cids) <= 3
    store.close()


# -- the routes --------------------------------------------------------------------------------


@pytest.fixture
async def client(tmp_path: Path):
    app = web.Application(middlewares=[json_errors_middleware])
    ex = FakeExecutor()
    batch_routes.setup_routes(
        app, home=str(tmp_path), executor=lambda _app: ex, max_upload_bytes=4096, poll_s=0.02
    )
    async with TestClient(TestServer(app)) as c:
        c.fake = ex  # type: ignore[attr-defined]
        yield c


def _form(data: bytes, purpose: str = "batch") -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("purpose", purpose)
    form.add_field("file", data, filename="in.jsonl", content_type="application/jsonl")
    return form


async def _wait_done(client: TestClient, batch_id: str) -> dict[str, Any]:
    async def ended():
        b = await (await client.get(f"/v1/batches/{batch_id}")).json()
        return b if b["status"] not in ("in_progress", "finalizing", "cancelling") else None

    return await eventually(ended, f"batch {batch_id} ended")


async def test_routes_run_a_batch_end_to_end(client: TestClient):
    r = await client.post("/v1/files", data=_form(jsonl([line("a"), line("b")])))
    assert r.status == 200
    f = await r.json()
    r = await client.post(
        "/v1/batches",
        json={
            "input_file_id": f["id"],
            "completion_window": "24h",
            "endpoint": "/v1/chat/completions",
        },
    )
    assert r.status == 200
    b = await r.json()
    assert b["status"] == "in_progress" and "waiting_reason" in b
    done = await _wait_done(client, b["id"])
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 2
    r = await client.get(f"/v1/files/{done['output_file_id']}/content")
    lines = [json.loads(x) for x in (await r.read()).decode().splitlines()]
    assert [x["custom_id"] for x in lines] == ["a", "b"]
    assert (await (await client.get(f"/v1/files/{done['output_file_id']}")).json())[
        "purpose"
    ] == "batch_output"
    listing = await (await client.get("/v1/batches?limit=1")).json()
    assert listing["object"] == "list" and listing["data"][0]["id"] == b["id"]
    files = await (await client.get("/v1/files?purpose=batch")).json()
    assert [x["id"] for x in files["data"]] == [f["id"]]


@pytest.mark.parametrize(
    "method, path, kwargs, status, param",
    [
        ("post", "/v1/files", {"data": b"x"}, 400, "file"),
        ("post", "/v1/batches", {"data": b"{not json"}, 400, None),
        (
            "post",
            "/v1/batches",
            {
                "json": {
                    "input_file_id": "file-x",
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                }
            },
            404,
            "input_file_id",
        ),
        ("get", "/v1/batches/batch_nope", {}, 404, "batch_id"),
        ("post", "/v1/batches/batch_nope/cancel", {}, 404, "batch_id"),
        ("get", "/v1/files/file-nope/content", {}, 404, "file_id"),
        ("get", "/v1/batches?limit=abc", {}, 400, "limit"),
        ("get", "/v1/batches?after=batch_nope", {}, 400, "after"),
    ],
)
async def test_route_errors_are_openai_shaped(
    client: TestClient, method, path, kwargs, status, param
):
    r = await getattr(client, method)(path, **kwargs)
    assert r.status == status
    body = await r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and body["error"]["message"]


async def test_upload_refusals_name_the_problem(client: TestClient):
    r = await client.post("/v1/files", data=_form(jsonl([line("a")]), purpose="fine-tune"))
    assert r.status == 400 and (await r.json())["error"]["param"] == "purpose"
    r = await client.post("/v1/files", data=_form(jsonl([line("a"), line("a")])))
    err = (await r.json())["error"]
    assert r.status == 400 and "line 2" in err["message"] and err["code"] == "invalid_request"
    r = await client.post("/v1/files", data=_form(b"x" * 5000))
    assert r.status == 413 and (await r.json())["error"]["code"] == "payload_too_large"
    r = await client.post("/v1/files", data=_form(jsonl([line("a")]), purpose="b" * 2000))
    assert r.status == 413 and (await r.json())["error"]["param"] == "purpose"
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    r = await client.post("/v1/files", data=form)
    assert r.status == 400 and (await r.json())["error"]["param"] == "file"
    assert (await (await client.get("/v1/files")).json())["data"] == []


def test_an_unused_home_gets_no_database(tmp_path: Path):
    s = BatchStore(tmp_path / "home")
    assert s.active_batches() == [] and not s.exists()
    assert not (tmp_path / "home").exists()
    f = s.create_file(jsonl([line("a")]), filename="in.jsonl", purpose="batch")
    assert s.exists() and s.file_content(f["id"]) == jsonl([line("a")])  # the blob survived
    s.close()


# -- the real seam: a live app with a tiny real model ------------------------------------------

TINY = "tiny"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.unit.v1_fixtures import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.getbasetemp().parent / "miserver-v1-cache")


@pytest.fixture
async def live(tiny_folder: Path, tmp_path: Path):
    """A real app (create_app) serving the tiny model; ``app.weights_state`` fakes the lifecycle
    summary so a torn set can be shown without a trainer."""
    from miserver.http import keys
    from miserver.http.app import create_app
    from miserver.serving.models.catalogue import Catalogue
    from miserver.spec.settings import Settings

    home = tmp_path / "home"
    cat = Catalogue(home)
    for name in (TINY, "other"):
        cat.register(name=name, format="safetensors", dtype="float32", path=str(tiny_folder))
    app = create_app(Settings(home=str(home), default_model=TINY, device="cpu", log_format="text"))
    state = {
        "weights_state": "clean",
        "barrier": "serving",
        "attached": False,
        "attachment_state": None,
    }
    app[keys.WEIGHTS_SUMMARY] = lambda: dict(state)
    client = TestClient(TestServer(app))
    await client.start_server()
    await app[keys.STARTUP_LOAD]
    assert app[keys.HOST].resident is not None
    app[batch_routes.BATCH_RUNNER].poll_s = 0.02
    client.weights = state  # type: ignore[attr-defined]
    yield client
    await client.close()


def _tiny_chat(cid: str, model: str = TINY, **kw: Any) -> dict[str, Any]:
    body = {
        "model": model,
        "temperature": 0,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": f"Say {cid}"}],
        **kw,
    }
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


async def _start(
    client: TestClient, rows: list[dict[str, Any]], endpoint: str = "/v1/chat/completions"
) -> dict[str, Any]:
    r = await client.post("/v1/files", data=_form(jsonl(rows)))
    assert r.status == 200, await r.text()
    r = await client.post(
        "/v1/batches",
        json={
            "input_file_id": (await r.json())["id"],
            "endpoint": endpoint,
            "completion_window": "24h",
        },
    )
    assert r.status == 200, await r.text()
    return await r.json()


async def _poll(client: TestClient, batch_id: str, until: Any, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        b = await (await client.get(f"/v1/batches/{batch_id}")).json()
        if until(b):
            return b
        assert time.monotonic() < deadline, b
        await asyncio.sleep(0.02)


async def _lines(client: TestClient, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [
        json.loads(x)
        for x in (await (await client.get(f"/v1/files/{file_id}/content")).read()).splitlines()
    ]


async def test_real_rows_carry_the_model_header_and_refusals_become_error_lines(live):
    from miserver.http.model_header import parse_model_header

    b = await _start(
        live,
        [
            _tiny_chat("a"),
            _tiny_chat("long", max_tokens=10**6),
            _tiny_chat("ghost", model="no-such-model"),
            _tiny_chat("c"),
        ],
    )
    done = await _poll(live, b["id"], lambda x: x["status"] == "completed")
    assert done["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    out = await _lines(live, done["output_file_id"])
    err = {x["custom_id"]: x for x in await _lines(live, done["error_file_id"])}
    assert [x["custom_id"] for x in out] == ["a", "c"]
    for x in out:
        assert parse_model_header(x["response"]["headers"]["X-miLLM-Model"]) == (TINY, "model", 0)
        assert x["response"]["body"]["object"] == "chat.completion"
        assert x["response"]["body"]["usage"]["completion_tokens"] >= 1
    assert err["long"]["response"]["status_code"] == 400
    assert err["long"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert err["ghost"]["response"]["status_code"] == 404
    assert done["usage"]["output_tokens"] == sum(
        x["response"]["body"]["usage"]["completion_tokens"] for x in out
    )


async def test_completions_endpoint_runs_too(live):
    row = {
        "custom_id": "p",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": TINY, "prompt": "1, 2, 3,", "max_tokens": 3, "temperature": 0},
    }
    b = await _start(live, [row], endpoint="/v1/completions")
    done = await _poll(live, b["id"], lambda x: x["status"] == "completed")
    (line_,) = await _lines(live, done["output_file_id"])
    assert line_["response"]["body"]["object"] == "text_completion"


async def test_a_batch_never_loads_a_model(live):
    from miserver.http import keys

    host = live.server.app[keys.HOST]
    b = await _start(live, [_tiny_chat("x", model="other"), _tiny_chat("a")])
    waiting = await _poll(
        live,
        b["id"],
        lambda x: (
            x["request_counts"]["completed"] == 1 and x["waiting_reason"] == "model_not_resident"
        ),
    )
    assert waiting["status"] == "in_progress" and waiting["request_counts"]["failed"] == 0
    await asyncio.sleep(0.1)
    assert host.resident.row.name == TINY  # "other" was never auto-loaded
    r = await live.post(f"/v1/batches/{b['id']}/cancel")
    assert (await r.json())["status"] in ("cancelling", "cancelled")
    done = await _poll(live, b["id"], lambda x: x["status"] == "cancelled")
    assert [x["custom_id"] for x in await _lines(live, done["output_file_id"])] == ["a"]


def _spy_arrivals(scheduler: Any) -> list[Any]:
    """The ``unit`` of every batch-priority waiter that reaches ``scheduler.acquire``."""
    from miserver.serving.engine.slot import Priority

    arrived: list[Any] = []
    real = scheduler.acquire

    async def spy(priority: Any, **kw: Any) -> Any:
        if priority == Priority.BATCH:
            arrived.append(kw.get("unit"))
        return await real(priority, **kw)

    scheduler.acquire = spy
    return arrived


@pytest.fixture
def engine_batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sequences of every batch that starts (a busy period of the continuous engine)."""
    from tests.unit.v1_fixtures import spy_batch_starts

    return spy_batch_starts(monkeypatch)


async def test_a_chunks_rows_join_the_engine_together_on_an_idle_server(live, engine_batches):
    """The chunk's rows reach the scheduler at different moments (each tokenizes in a thread);
    the chunk's Unit keeps the free slot from the first until all are waiting, so they join the
    engine together, not the first alone and the rest after. Each answer is the one the same row
    gets alone over /v1 (greedy)."""
    from miserver.http import keys

    assert live.server.app[batch_routes.BATCH_RUNNER].chunk_size >= 5
    assert live.server.app[keys.SCHEDULER].max_batch_size >= 5
    rows = [_tiny_chat(f"r{i}", max_tokens=2 + i) for i in range(5)]
    b = await _start(live, rows)
    done = await _poll(live, b["id"], lambda x: x["status"] == "completed")
    assert engine_batches == [5], (
        engine_batches
    )  # one busy period of the engine took the whole chunk
    out = await _lines(live, done["output_file_id"])
    assert [x["custom_id"] for x in out] == [f"r{i}" for i in range(5)]
    for row, x in zip(rows, out, strict=True):
        alone = await (await live.post("/v1/chat/completions", json=row["body"])).json()
        got = x["response"]["body"]["choices"][0]
        assert got["message"] == alone["choices"][0]["message"]
        assert got["finish_reason"] == alone["choices"][0]["finish_reason"]


async def test_a_quiesce_holds_the_next_chunk_in_the_scheduler(live):
    from miserver.http import keys

    scheduler = live.server.app[keys.SCHEDULER]
    arrived = _spy_arrivals(scheduler)
    await scheduler.barrier_acquire(5.0)
    try:
        b = await _start(live, [_tiny_chat("a"), _tiny_chat("b")])
        held = await _poll(live, b["id"], lambda x: x["waiting_reason"] == "quiesced")
        await eventually(lambda: len(arrived) == 2, "both rows of the chunk wait for the slot")
        assert scheduler.counts().held_batch == 1  # held_batch_chunks of POST /quiesce
        assert held["request_counts"]["completed"] == 0
    finally:
        scheduler.barrier_release()
    done = await _poll(live, b["id"], lambda x: x["status"] == "completed")
    assert done["request_counts"]["completed"] == 2 and done["waiting_reason"] is None


async def test_a_cancel_releases_a_chunk_held_by_a_quiesce(live):
    """The held row leaves the scheduler's queue at once; the batch ends cancelled while the
    barrier is still held (it does not wait for resume)."""
    from miserver.http import keys

    scheduler = live.server.app[keys.SCHEDULER]
    await scheduler.barrier_acquire(5.0)
    try:
        b = await _start(live, [_tiny_chat("a"), _tiny_chat("b")])
        await _poll(live, b["id"], lambda x: x["waiting_reason"] == "quiesced")
        await _poll(live, b["id"], lambda _x: scheduler.counts().held_batch == 1)
        r = await live.post(f"/v1/batches/{b['id']}/cancel")
        assert r.status == 200
        done = await _poll(live, b["id"], lambda x: x["status"] == "cancelled")
        assert scheduler.barrier_held and scheduler.counts().held_batch == 0
        assert done["request_counts"] == {"total": 2, "completed": 0, "failed": 0}
    finally:
        scheduler.barrier_release()
    assert scheduler.counts().running == 0


async def test_a_cancel_stops_every_row_of_a_chunk_held_by_a_quiesce(live):
    """All five rows of the chunk wait in the scheduler; a cancel removes every one of them from
    the queue at once (nothing left waiting, nothing run), and the slot is free after."""
    from miserver.http import keys

    scheduler = live.server.app[keys.SCHEDULER]
    arrived = _spy_arrivals(scheduler)
    await scheduler.barrier_acquire(5.0)
    try:
        b = await _start(live, [_tiny_chat(f"r{i}") for i in range(5)])
        await eventually(lambda: len(arrived) == 5, "the five rows wait for the slot")
        assert scheduler.counts().held_batch == 1
        assert (await live.post(f"/v1/batches/{b['id']}/cancel")).status == 200
        done = await _poll(live, b["id"], lambda x: x["status"] == "cancelled")
        assert scheduler.counts() == HeldCounts(0, 0, 0, 0)  # no row left in the queue
        assert done["request_counts"] == {"total": 5, "completed": 0, "failed": 0}
    finally:
        scheduler.barrier_release()
    assert scheduler.counts().running == 0


async def test_torn_weights_make_the_batch_wait_not_fail(live):
    live.weights["weights_state"] = "torn"
    b = await _start(live, [_tiny_chat("a")])
    waiting = await _poll(live, b["id"], lambda x: x["waiting_reason"] == "weights_torn")
    await asyncio.sleep(0.1)
    again = await (await live.get(f"/v1/batches/{b['id']}")).json()
    assert waiting["status"] == again["status"] == "in_progress"
    assert again["request_counts"] == {"total": 1, "completed": 0, "failed": 0}
    live.weights["weights_state"] = "clean"  # a weights load recovered the set
    done = await _poll(live, b["id"], lambda x: x["status"] == "completed")
    assert done["request_counts"]["completed"] == 1


async def test_the_official_sdk_speaks_every_route(client: TestClient):
    import openai

    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    try:
        up = await sdk.files.create(
            file=("in.jsonl", jsonl([line("a"), line("b")])), purpose="batch"
        )
        assert (await sdk.files.retrieve(up.id)).bytes == up.bytes
        ids = []
        for _ in range(3):
            b = await sdk.batches.create(
                input_file_id=up.id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                metadata={"k": "v"},
            )
            ids.append(b.id)
        paged = [b.id async for b in sdk.batches.list(limit=1)]  # follows has_more / after
        assert paged == ids[::-1]
        client.fake.reasons["held"] = "model_not_resident"
        held_file = await sdk.files.create(
            file=("h.jsonl", jsonl([line("h", model="held")])), purpose="batch"
        )
        held = await sdk.batches.create(
            input_file_id=held_file.id, completion_window="24h", endpoint="/v1/chat/completions"
        )
        assert (await sdk.batches.cancel(held.id)).status in ("cancelling", "cancelled")

        async def completed():
            b = await sdk.batches.retrieve(ids[0])
            return b if b.status == "completed" else None

        done = await eventually(completed, "the first batch completed")
        assert done.request_counts.completed == 2 and done.metadata == {"k": "v"}
        text = (await sdk.files.content(done.output_file_id)).text
        assert [json.loads(x)["custom_id"] for x in text.splitlines()] == ["a", "b"]
        listed = [f.id async for f in sdk.files.list(purpose="batch")]
        assert listed == [held_file.id, up.id]
        assert (await sdk.files.delete(up.id)).deleted is True
        with pytest.raises(openai.NotFoundError):
            await sdk.files.retrieve(up.id)
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.batches.create(
                input_file_id=done.output_file_id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
            )
        assert info.value.param == "input_file_id"
    finally:
        await sdk.close()


async def test_the_real_lifecycle_quiesce_then_torn_then_recovered(
    tmp_path: Path, tiny_model_dir: str
):
    """Weights page, States: batch rows do not fail on torn; the batch waits with
    waiting_reason weights_torn and resumes once the weights are restored."""
    from miserver.http import keys
    from miserver.http.app import create_app
    from miserver.http.model_header import parse_model_header
    from miserver.serving.models.catalogue import Catalogue
    from miserver.spec.settings import load_settings

    secret = "trainer-secret-0123456789"
    home = tmp_path / "home"
    Catalogue(str(home)).register(
        name="tiny", format="safetensors", dtype="bfloat16", path=tiny_model_dir
    )
    app = create_app(
        load_settings(
            {
                "MISERVER_HOME": str(home),
                "DEFAULT_MODEL": "tiny",
                "DEVICE": "cpu",
                "WEIGHTS_TOKENS": f"trn:trainer:{secret}",
                "WEIGHTS_CPU_ATTACH": "1",
                "WEIGHTS_COMMIT_WATCHDOG_MS": "100",
                "WEIGHTS_HOLD_TIMEOUT_S": "60",
            }
        )
    )
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        await app[keys.STARTUP_LOAD]
        app[batch_routes.BATCH_RUNNER].poll_s = 0.02
        auth = {"Authorization": f"Bearer {secret}"}
        r = await client.post("/api/weights/attach", headers=auth)
        assert r.status == 200, await r.text()
        h = {**auth, "X-miLLM-Attachment": (await r.json())["data"]["attachment_id"]}
        assert (await client.post("/api/weights/quiesce", headers=h)).status == 200

        b = await _start(client, [_tiny_chat("a", model="tiny"), _tiny_chat("b", model="tiny")])
        await _poll(client, b["id"], lambda x: x["waiting_reason"] == "quiesced")
        await eventually(lambda: app[keys.SCHEDULER].counts().held_batch == 1, "the chunk is held")

        assert (await client.post("/api/weights/commit-begin", headers=h)).status == 200
        torn = await _poll(client, b["id"], lambda x: x["waiting_reason"] == "weights_torn")
        assert (await client.post("/api/weights/resume", headers=h)).status == 200
        await asyncio.sleep(0.3)  # the released chunk sees torn and waits; nothing fails
        again = await (await client.get(f"/v1/batches/{b['id']}")).json()
        for x in (torn, again):
            assert x["status"] == "in_progress", x
            assert x["request_counts"] == {"total": 2, "completed": 0, "failed": 0}
        assert again["waiting_reason"] == "weights_torn"

        r = await client.post("/api/weights/commit-end", headers=h)  # late: clean, overran
        assert r.status == 200 and (await r.json())["data"]["weights_state"] == "clean"
        done = await _poll(client, b["id"], lambda x: x["status"] == "completed")
        assert done["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
        for x in await _lines(client, done["output_file_id"]):
            name, origin, commits = parse_model_header(x["response"]["headers"]["X-miLLM-Model"])
            assert (name, origin, commits) == ("tiny", "model", 1)
    finally:
        await client.close()


async def test_a_quiesce_reports_a_held_chunk_of_five_rows_as_one(
    tmp_path: Path, tiny_model_dir: str, engine_batches: list[int]
):
    """POST /api/weights/quiesce sent while a chunk of five rows waits for the slot answers
    held_batch_chunks 1 (chunks, not rows; companion contract 7); after resume the five rows
    join the engine together."""
    from miserver.http import keys
    from miserver.serving.engine.slot import Priority
    from tests.unit.test_weights_routes import TRN, make_client

    client = await make_client(
        tmp_path, tiny_model_dir, MAX_BATCH_SIZE="8", WEIGHTS_HOLD_TIMEOUT_S="60"
    )
    app = client.server.app
    try:
        app[batch_routes.BATCH_RUNNER].poll_s = 0.02
        scheduler = app[keys.SCHEDULER]
        arrived = _spy_arrivals(scheduler)
        auth = {"Authorization": f"Bearer {TRN}"}
        r = await client.post("/api/weights/attach", headers=auth)
        assert r.status == 200, await r.text()
        h = {**auth, "X-miLLM-Attachment": (await r.json())["data"]["attachment_id"]}

        running = await scheduler.acquire(Priority.INTERACTIVE)  # a request holds the slot
        b = await _start(client, [_tiny_chat(f"r{i}", model="tiny") for i in range(5)])
        await eventually(lambda: len(arrived) == 5, "the chunk's five rows wait for the slot")
        assert len({id(u) for u in arrived}) == 1  # one unit: the chunk
        quiesce = asyncio.create_task(client.post("/api/weights/quiesce", headers=h))
        await eventually(lambda: scheduler.barrier_draining, "the quiesce drains")
        scheduler.release(running)  # the running request ends; the barrier holds
        r = await asyncio.wait_for(quiesce, 30)
        assert r.status == 200, await r.text()
        data = (await r.json())["data"]
        assert (data["held_batch_chunks"], data["held_requests"]) == (1, 0)
        health = await (await client.get("/api/health/detailed")).json()
        assert health["data"]["queue"]["held_batch_chunks"] == 1
        assert engine_batches == []  # nothing ran inside the hold
        assert (await client.post("/api/weights/resume", headers=h)).status == 200
        done = await _poll(client, b["id"], lambda x: x["status"] == "completed")
        assert done["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
        assert engine_batches == [5]
    finally:
        await client.close()


async def test_two_runners_on_one_home_never_run_a_row_twice(tmp_path: Path):
    first_store, second_store = BatchStore(tmp_path), BatchStore(tmp_path)
    b = new_batch(first_store, [line(c) for c in "abcdef"])
    ex1, ex2 = FakeExecutor(), FakeExecutor()
    one = BatchRunner(first_store, ex1, poll_s=0.01)
    two = BatchRunner(second_store, ex2, poll_s=0.01)
    one.start()
    await eventually(lambda: ex1.calls, "the first runner took the lock and runs")
    two.start()
    await eventually(
        lambda: first_store.get_batch(b["id"])["status"] == "completed", "the batch completed"
    )
    assert ex1.calls == Counter("abcdef") and not ex2.calls  # the second waits for the lock
    await one.stop()  # the lock is released: the second takes over new work
    later = new_batch(first_store, [line("z")])
    await eventually(
        lambda: second_store.get_batch(later["id"])["status"] == "completed",
        "the second runner took over",
    )
    assert ex2.calls == Counter("z")
    await two.stop()
    first_store.close()
    second_store.close()
