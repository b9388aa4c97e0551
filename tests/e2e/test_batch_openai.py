"""The Batch API against a live ``miserver serve``, through the official ``openai`` client
(contract 7), with the server killed (SIGKILL) in the middle of the batch and restarted.

What must hold: the batch continues where it stopped; every custom_id is answered exactly once;
a row recorded before the kill is never run again (its output line, ids included, is the one
recorded before the kill); every line carries ``X-miLLM-Model`` (weights page: Which weights
answered). The server loads the default model in the background after it starts, so the first
rows also show a batch waiting (``model_not_resident``) instead of failing or loading a model.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from miserver.http.model_header import parse_model_header  # noqa: E402
from miserver.serving.batches.store import BatchStore  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
ROWS = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``miserver serve`` process on ``home``; ``kill()`` is SIGKILL, nothing graceful."""

    def __init__(self, home: str, log: Path) -> None:
        self.home = home
        self.port = _free_port()
        self.log = log
        env = dict(
            os.environ,
            MISERVER_HOME=home,
            PORT=str(self.port),
            HOST="127.0.0.1",
            DEVICE="cpu",
            LOG_FORMAT="text",
            PYTHONPATH=str(REPO),
        )
        env.pop("WEIGHTS_TOKENS", None)
        self._out = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "miserver.cli", "serve"],
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0, timeout=30
        )
        self._wait_listening()

    def _wait_listening(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.tail()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5),
            ):
                return
            time.sleep(0.1)
        raise AssertionError(f"server did not listen within {timeout_s} s:\n{self.tail()}")

    def tail(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._out.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._out.closed:
            self._out.close()


def _row(i: int, url: str = "/v1/chat/completions") -> dict:
    # Two short rows, then longer ones: the kill lands while a long row runs, whatever the
    # machine's speed (the test polls every 20 ms, a long row takes many decode steps).
    max_tokens = 2 if i < 2 else 12
    if url == "/v1/completions":
        body = {
            "model": MODEL,
            "max_tokens": max_tokens,
            "temperature": 0,
            "prompt": f"{i}, {i + 1}, {i + 2},",
        }
    else:
        body = {
            "model": MODEL,
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [{"role": "user", "content": f"Count from {i} to {i + 20}."}],
        }
    return {"custom_id": f"row-{i}", "method": "POST", "url": url, "body": body}


def _jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in rows)


@pytest.mark.slow
def test_batch_survives_kill_9_and_answers_every_row_exactly_once(
    home_with_default: str, tmp_path: Path
):
    log = tmp_path / "server.log"
    server = Server(home_with_default, log)
    try:
        client = server.client
        # a file mixing endpoints is accepted; a batch must name the endpoint every line uses
        mixed_rows = [_row(0), _row(1, "/v1/completions")]
        mixed = client.files.create(
            file=("mixed.jsonl", io.BytesIO(_jsonl(mixed_rows))), purpose="batch"
        )
        with pytest.raises(openai.BadRequestError) as info:
            client.batches.create(
                input_file_id=mixed.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert info.value.param == "endpoint" and "line 2" in info.value.message

        data = _jsonl([_row(i) for i in range(ROWS)])
        upload = client.files.create(file=("rows.jsonl", io.BytesIO(data)), purpose="batch")
        assert upload.purpose == "batch" and upload.bytes == len(data)
        batch = client.batches.create(
            input_file_id=upload.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"test": "kill-9"},
        )
        assert batch.status == "in_progress" and batch.request_counts.total == ROWS

        deadline = time.monotonic() + 150
        seen_reasons: set[str | None] = set()
        while True:
            now = client.batches.retrieve(batch.id)
            seen_reasons.add(getattr(now, "waiting_reason", None))
            if now.request_counts.completed >= 2:
                break
            assert now.status == "in_progress", now
            assert time.monotonic() < deadline, f"no progress: {now}\n{server.tail()}"
            time.sleep(0.02)
        server.kill()
    finally:
        server.stop()
    assert now.request_counts.completed < ROWS, "the batch ended before the kill; add rows"
    assert seen_reasons <= {None, "model_not_resident", "quiesced"}, seen_reasons

    store = BatchStore(home_with_default)
    before = store.done_results(batch.id)
    store.close()
    assert 2 <= len(before) < ROWS

    server = Server(home_with_default, log)
    try:
        client = server.client
        deadline = time.monotonic() + 400
        while (now := client.batches.retrieve(batch.id)).status != "completed":
            assert now.status in ("in_progress", "finalizing"), now
            assert time.monotonic() < deadline, f"batch did not finish: {now}\n{server.tail()}"
            time.sleep(0.2)
        assert now.request_counts.completed == ROWS and now.request_counts.failed == 0
        assert now.error_file_id is None and now.waiting_reason is None
        assert now.metadata == {"test": "kill-9"}
        lines = [json.loads(x) for x in client.files.content(now.output_file_id).text.splitlines()]
        listed = [b.id for b in client.batches.list(limit=5).data]
        assert batch.id in listed
    finally:
        server.stop()

    assert Counter(x["custom_id"] for x in lines) == Counter(f"row-{i}" for i in range(ROWS))
    for x in lines:
        assert x["error"] is None and x["response"]["status_code"] == 200
        name, origin, _commits = parse_model_header(x["response"]["headers"]["X-miLLM-Model"])
        assert (name, origin) == (MODEL, "model")
        assert x["response"]["body"]["usage"]["completion_tokens"] >= 1
        if x["custom_id"] in before:
            assert x == before[x["custom_id"]], "a row recorded before the kill changed"
