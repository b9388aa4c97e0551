"""Two real processes: a trainer writes the served weights in place under concurrent chat load.

``miserver serve`` (a subprocess) serves the embedded default model on the CPU in shared memory
(``WEIGHTS_CPU_ATTACH=1``, contract section 8). A trainer process attaches with
:class:`miserver.trainer.WeightsClient` and runs commit cycles while a few threads send greedy
chat requests the whole time. Inside each bracket it writes NaN into the weights (every norm and
one projection), waits, and restores them: any response computed on those half-written weights
would be garbage, and none is: every answer equals the reference computed before attach, no
request fails, and ``X-miLLM-Model`` counts exactly the commits made (weights page, The write
cycle; Which weights answered). A control cycle first shows that the poisoned weights do produce
garbage when served, so the check can fail.

Then a trainer is killed (SIGKILL) mid-commit: the watchdog tears the set, ``/v1`` answers 503
``weights_torn`` with ``Retry-After``, and an operator recovers with ``POST /api/weights/load
{"model_id": N}`` (weights page, States).

This file is also the trainer program: ``python test_train_under_load.py train|die URL TOKEN``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TRN = "trainer-secret-e2e-0123456789"
OPS = "operator-secret-e2e-0123456789"
MODEL = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
CYCLES = 20
# The write itself takes a few ms; 5 s is a margin a loaded 2-core runner cannot miss (at 1 s,
# a trainer process descheduled mid-commit would overrun it). The dying trainer's tear below
# waits for it.
WATCHDOG_MS = 5000


def poison_targets(names: list[str]) -> list[str]:
    """Every norm weight and the first layer's down projection: NaN there makes every logit
    NaN, so an answer computed while they are written cannot equal the reference."""
    return [n for n in names if n.endswith("norm.weight")] + ["model.layers.0.mlp.down_proj.weight"]


# --- the trainer process ------------------------------------------------------------------------
def trainer_main(mode: str, url: str, token: str) -> None:
    import torch

    from miserver.trainer import WeightsClient

    client = WeightsClient(url, token, timeout=120)
    if mode == "die":
        print("ready", flush=True)
        sys.stdin.readline()  # started early (its imports overlap the training), attach on "go"
    att = client.attach()
    targets = poison_targets(list(att.tensors))
    backup = {n: att.tensors[n].clone() for n in targets}
    if mode == "die":
        client.quiesce()
        client.commit_begin()
        with torch.no_grad():
            for n in targets:
                att.tensors[n].fill_(float("nan"))
        print("writing", flush=True)
        time.sleep(600)  # killed here, mid-commit
        return
    ends = []
    for i in range(CYCLES):
        with client.commit() as cycle, torch.no_grad():
            for n in targets:
                att.tensors[n].fill_(float("nan"))
            time.sleep(0.01)  # a request computed now would see NaN everywhere
            for n in targets:
                att.tensors[n].copy_(backup[n])
        ends.append(cycle.end)
        time.sleep(0.05 + 0.05 * (i % 3))  # let held requests through between cycles
    del backup
    client.detach()
    print(
        json.dumps(
            {
                "ends": ends,
                "steps": client.steps_since_load,
                "heartbeat_error": repr(client.heartbeat_error),
            }
        ),
        flush=True,
    )


# --- the test side ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )


def chat(session, url: str, timeout: float = 120) -> tuple[int, str | None, str | None, dict]:
    r = session.post(
        url + "/v1/chat/completions",
        timeout=timeout,
        json={"model": MODEL, "messages": PROMPT, "max_tokens": 8, "temperature": 0},
    )
    body = r.json()
    content = body["choices"][0]["message"]["content"] if r.status_code == 200 else None
    return r.status_code, content, r.headers.get("X-miLLM-Model"), {**body, **dict(r.headers)}


def commits_of(header: str | None) -> int | None:
    """``commits`` of ``X-miLLM-Model: "<name>";origin=model;commits=<n>`` (None: omitted)."""
    import http_sfv

    assert header is not None
    item = http_sfv.Item()
    item.parse(header.encode())
    assert item.value == MODEL and item.params["origin"] == "model", header
    return item.params.get("commits")


def wait_resident(proc: subprocess.Popen, url: str, log: Path, deadline: float) -> None:
    """Poll ``url``'s ``/api/health/detailed`` until a model is resident; fails (with the
    server's log tail) if the process exits or ``deadline`` (``time.monotonic()``) passes."""
    import requests

    while True:
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        try:
            data = requests.get(url + "/api/health/detailed", timeout=5).json()["data"]
            if data["resident"]:
                return
        except (requests.RequestException, ValueError):
            pass
        time.sleep(0.3)


@pytest.fixture
def server(home_with_default: str, tmp_path: Path):

    port = free_port()
    log = tmp_path / "server.log"
    env = child_env() | {
        "MISERVER_HOME": home_with_default,
        "PORT": str(port),
        "DEVICE": "cpu",
        "WEIGHTS_CPU_ATTACH": "1",
        "WEIGHTS_TOKENS": f"trn:trainer:{TRN},ops:operator:{OPS}",
        "WEIGHTS_COMMIT_WATCHDOG_MS": str(WATCHDOG_MS),
        "WEIGHTS_HEARTBEAT_TIMEOUT_S": "2",
        "WEIGHTS_HEARTBEAT_INTERVAL_HINT_S": "0.5",
        "LOG_FORMAT": "json",
        "WEIGHTS_AUDIT_LOG": str(tmp_path / "audit.jsonl"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "miserver.cli", "serve"],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_resident(proc, url, log, time.monotonic() + 180)
        yield url, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = log.read_text()
    assert TRN not in text and OPS not in text


def test_train_under_load_never_serves_half_written_weights_and_recovers_from_a_kill(
    server, request
):
    import requests
    import torch

    from miserver.trainer import WeightsClient

    url, log = server
    t0 = time.monotonic()
    s = requests.Session()
    # the reference answer, before anything attaches (greedy: deterministic)
    st, reference, header, _ = chat(s, url)
    assert st == 200 and reference, reference
    assert chat(s, url)[1] == reference
    assert commits_of(header) in (0, None)

    # control: served poisoned weights do produce garbage (the check below can fail)
    with WeightsClient(url, TRN) as control:
        att = control.attach()
        targets = poison_targets(list(att.tensors))
        backup = {n: att.tensors[n].clone() for n in targets}
        with control.commit(), torch.no_grad():
            for n in targets:
                att.tensors[n].fill_(float("nan"))
        st, poisoned, _, _ = chat(s, url)
        assert not (st == 200 and poisoned == reference), "NaN weights answered correctly"
        with control.commit(), torch.no_grad():
            for n in targets:
                att.tensors[n].copy_(backup[n])
        del backup
        st, restored, header, _ = chat(s, url)
        assert st == 200 and restored == reference
        assert commits_of(header) == 2
    control_commits = 2

    # the load: a few threads sending the same greedy request the whole time
    stop = threading.Event()
    results: list[tuple[int, float, int, str | None, str | None]] = []
    lock = threading.Lock()

    def load(k: int) -> None:
        session = requests.Session()
        while not stop.is_set():
            try:
                st, content, header, body = chat(session, url)
            except Exception as exc:  # noqa: BLE001 - a failed request is a result
                st, content, header = -1, repr(exc), None
            with lock:
                results.append((k, time.monotonic(), st, content, header))

    # the trainer that will be killed starts now: its imports overlap the training phase
    dying = subprocess.Popen(
        [sys.executable, __file__, "die", url, TRN],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    request.addfinalizer(dying.kill)  # also when an assertion fails before the kill
    phase = {"control": time.monotonic() - t0}
    threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, __file__, "train", url, TRN],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    finished = time.monotonic()
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join(130)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    steps = [e["steps_since_load"] for e in report["ends"]]
    assert steps == list(range(control_commits + 1, control_commits + CYCLES + 1))
    assert not any(e["overran"] for e in report["ends"])
    assert report["steps"] == control_commits + CYCLES

    failed = [r for r in results if r[2] != 200]
    assert not failed, failed[:5]
    garbage = [r for r in results if r[3] != reference]
    assert not garbage, garbage[:5]
    during = [r for r in results if started <= r[1] <= finished]
    assert len(during) >= 10, f"only {len(during)} responses while training"
    seen = [commits_of(r[4]) for r in results]
    assert all(control_commits <= c <= control_commits + CYCLES for c in seen)
    assert len({commits_of(r[4]) for r in during}) >= 3  # served between the cycles
    for k in range(len(threads)):  # each client sees the count only go up
        mine = [commits_of(r[4]) for r in results if r[0] == k]
        assert mine == sorted(mine)
    st, content, header, _ = chat(s, url)
    assert st == 200 and content == reference
    assert commits_of(header) == control_commits + CYCLES
    status = s.get(url + "/api/weights/status").json()["data"]
    assert status["steps_since_load"] == control_commits + CYCLES
    assert status["attached"] is False and status["weights_state"] == "clean"

    phase["train"] = time.monotonic() - t0

    # a trainer killed mid-commit: the watchdog tears the set
    try:
        assert dying.stdout.readline().strip() == "ready", dying.stderr.read()[-4000:]
        dying.stdin.write("go\n")
        dying.stdin.flush()
        line = dying.stdout.readline()
        assert line.strip() == "writing", dying.stderr.read()[-4000:] if dying.poll() else line
    finally:
        dying.send_signal(signal.SIGKILL)
        dying.wait(30)
    deadline = time.monotonic() + 30 + WATCHDOG_MS / 1000
    while s.get(url + "/api/weights/status").json()["data"]["weights_state"] != "torn":
        assert time.monotonic() < deadline, "the watchdog did not tear the set"
        time.sleep(0.1)
    status = s.get(url + "/api/weights/status").json()["data"]
    assert status["commit"]["overran"] is True and status["commit_overran"] is not None
    st, _, _, detail = chat(s, url, timeout=15)
    assert st == 503 and detail["error"]["code"] == "weights_torn", detail
    assert int(detail["Retry-After"]) >= 1

    # the operator: clear the dead trainer's (stale) attachment, then reload the model row
    operator = WeightsClient(url, OPS, timeout=120)
    deadline = time.monotonic() + 30
    while (s.get(url + "/api/weights/status").json()["data"]["attachment"] or {}).get(
        "state"
    ) != "stale":
        assert time.monotonic() < deadline, "the killed trainer's attachment never went stale"
        time.sleep(0.2)
    assert operator.clear_stale()["weights_state"] == "torn"  # torn survives clear-stale
    rows = s.get(url + "/api/models").json()["data"]
    model_id = next(r["id"] for r in rows if r["name"] == MODEL)
    loaded = operator.load(model_id=model_id)
    assert loaded["weights_state"] == "clean" and loaded["steps_since_load"] == 0
    st, content, header, _ = chat(s, url)
    assert st == 200 and content == reference, content
    status = s.get(url + "/api/weights/status").json()["data"]
    assert status["weights_state"] == "clean" and status["barrier"] == "serving"
    assert status["steps_since_load"] == 0
    phase["recovered"] = time.monotonic() - t0
    print(
        "phases (s since the server answered):",
        {k: round(v, 1) for k, v in phase.items()},
        f"{len(results)} chat responses, {len(during)} while training",
    )


if __name__ == "__main__":
    trainer_main(sys.argv[1], sys.argv[2], sys.argv[3])
