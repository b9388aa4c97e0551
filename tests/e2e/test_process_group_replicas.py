"""One trainer, two ``miserver serve`` replicas, one process group (contract section 10).

Two real servers serve the embedded default on the CPU; a trainer process (this file, ``train``)
attaches to both with :class:`miserver.trainer.replicas.ReplicaSet` (gloo over loopback, the
trainer rank 0), starts from the model's own safetensors, and trains a few AdamW steps. Its
copy is not served, so each step's optimizer runs outside the bracket; each bracket then sends
two broadcasts into both arenas: first a copy whose norms are NaN, then the real weights. A chat
computed between them would be NaN (a 500 non_finite_logits, or garbage), and a control bracket
that leaves the NaN copy served shows that it would. So: every chat sent to either replica
while training answers 200, both replicas end serving the same, changed answer, and the commit
count rose on both.

Then a trainer (``die``) is killed while it sends: the receives fail, commit-end never comes,
the watchdog tears both sets and destroys both groups, /v1 answers 503 on both, and an operator
recovers each replica with an in-place load of the checkpoint that replica saved after training.

This file is also the trainer program: ``python test_process_group_replicas.py train|die URL1
URL2 TOKEN``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TRN = "trainer-secret-pg-e2e-0123456789"
OPS = "operator-secret-pg-e2e-0123456789"
MODEL = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
TARGET = "The capital of France is Lyon, of course."
STEPS = 4
CONTROL_COMMITS = 2
# A bracket moves the arena (about 258 MiB) twice to two replicas over loopback: about a second
# on two cores; 10 s is a margin a loaded runner cannot miss, and what the killed trainer's
# tear waits for.
WATCHDOG_MS = 10000


def _norms(names) -> list[str]:
    return [n for n in names if n.endswith("norm.weight")]


# --- the trainer process ------------------------------------------------------------------------
def trainer_main(mode: str, urls: list[str], token: str) -> None:
    import requests
    import torch
    from safetensors.torch import load_file

    from miserver.trainer import chat_batch, init_optimizer_state
    from miserver.trainer.replicas import ReplicaSet

    if mode == "die":
        print("ready", flush=True)
        sys.stdin.readline()
    replicas = ReplicaSet(urls, token, timeout_s=120)
    weights = replicas.attach()
    row = next(
        r for r in requests.get(urls[0] + "/api/models").json()["data"] if r["name"] == MODEL
    )
    folder = Path(row["path"])
    state: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(f))
    weights.fill_from(state)
    del state
    n = weights.nbytes[0]
    if mode == "die":
        with replicas.commit() as bracket:
            print("sending", flush=True)
            bracket.send()
            time.sleep(600)  # killed before this ends (or while sending)
        return
    poisoned = replicas.group.layout(replicas.bodies[0])

    def poison() -> None:
        poisoned.buffers[0].copy_(weights.buffers[0])
        with torch.no_grad():
            for name in _norms(poisoned):
                poisoned[name].fill_(float("nan"))

    # control: the NaN copy, served, does not answer 200 with an answer
    poison()
    with replicas.commit() as bracket:
        bracket.send(poisoned)
    r = requests.post(
        urls[1] + "/v1/chat/completions",
        json={"model": MODEL, "messages": PROMPT, "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    control = {"status": r.status_code, "body": r.text[:300]}
    with replicas.commit():
        pass  # the real weights again
    from transformers import AutoTokenizer

    model = replicas.build_model()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = chat_batch(tokenizer, [(PROMPT, TARGET)])
    opt = init_optimizer_state(torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0))
    steps, losses = [], []
    for _ in range(STEPS):
        model.train()
        loss = model(**batch).loss
        loss.backward()
        opt.step()  # the trainer's copy: not served, so outside the bracket
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        poison()
        with replicas.commit(ranges=[[0, n], [0, n]]) as bracket:
            bracket.send(poisoned, [[0, n]])
            time.sleep(0.05)  # the arenas hold NaN norms now: nothing may be served
            bracket.send(weights, [[0, n]])
        steps.append(list(replicas.steps_since_load))
    saves = [s["checkpoint_sha256"] for s in replicas.save()]
    status = replicas.status()
    replicas.close()
    print(
        json.dumps(
            {
                "control": control,
                "steps": steps,
                "losses": losses,
                "saves": saves,
                "transports": [s["attachment"]["transport"] for s in status],
                "groups": [s["attachment"]["process_group"] for s in status],
            }
        ),
        flush=True,
    )


# --- the test side ------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )


def _chat(session, url: str, timeout: float = 120):
    r = session.post(
        url + "/v1/chat/completions",
        timeout=timeout,
        json={"model": MODEL, "messages": PROMPT, "max_tokens": 8, "temperature": 0},
    )
    body = r.json()
    content = body["choices"][0]["message"]["content"] if r.status_code == 200 else None
    return r.status_code, content, r.headers.get("X-miLLM-Model"), body


def _commits(header: str | None) -> int | None:
    import http_sfv

    item = http_sfv.Item()
    item.parse((header or "").encode())
    return item.params.get("commits")


@pytest.fixture
def replicas(default_home: str, tmp_path: Path):

    from tests.conftest import copy_default_rows
    from tests.e2e.test_train_under_load import free_port, wait_resident

    procs, urls, logs = [], [], []
    for i in (1, 2):
        port = free_port()
        log = tmp_path / f"server{i}.log"
        env = _env() | {
            "MISERVER_HOME": copy_default_rows(default_home, tmp_path / f"home{i}"),
            "PORT": str(port),
            "DEVICE": "cpu",
            "WEIGHTS_CPU_ATTACH": "1",
            "WEIGHTS_TOKENS": f"trn:trainer:{TRN},ops:operator:{OPS}",
            "WEIGHTS_COMMIT_WATCHDOG_MS": str(WATCHDOG_MS),
            "WEIGHTS_HEARTBEAT_TIMEOUT_S": "5",
            "WEIGHTS_HEARTBEAT_INTERVAL_HINT_S": "0.5",
            "LOG_FORMAT": "json",
            "WEIGHTS_AUDIT_LOG": str(tmp_path / f"audit{i}.jsonl"),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "miserver.cli", "serve"],
                env=env,
                stdout=log.open("wb"),
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        )
        urls.append(f"http://127.0.0.1:{port}")
        logs.append(log)
    try:
        deadline = time.monotonic() + 240
        for proc, url, log in zip(procs, urls, logs, strict=True):
            wait_resident(proc, url, log, deadline)
        yield urls, tmp_path
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    for log in logs:
        text = log.read_text()
        assert TRN not in text and OPS not in text


# two servers and a trainer on two cores: about 5 minutes alone, much longer beside other jobs
@pytest.mark.timeout(1800)
def test_one_trainer_writes_two_replicas_and_a_killed_one_tears_both(replicas, request):
    import requests

    urls, tmp_path = replicas
    s = requests.Session()
    refs = [_chat(s, u) for u in urls]
    assert all(r[0] == 200 and r[1] for r in refs), refs
    reference = refs[0][1]
    assert refs[1][1] == reference  # the same model, greedy

    stop = threading.Event()
    results: list[tuple[int, int, str | None, str | None]] = []
    lock = threading.Lock()

    def load(k: int) -> None:
        session = requests.Session()
        while not stop.is_set():
            try:
                st, content, header, _ = _chat(session, urls[k])
            except Exception as exc:  # noqa: BLE001 - a failed request is a result
                st, content, header = -1, repr(exc), None
            with lock:
                results.append((k, st, content, header))

    dying = subprocess.Popen(
        [sys.executable, __file__, "die", *urls, TRN],
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    request.addfinalizer(dying.kill)
    threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in (0, 1)]
    proc = subprocess.Popen(
        [sys.executable, __file__, "train", *urls, TRN],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    request.addfinalizer(proc.kill)
    # the load starts once the control brackets are done (their NaN is served on purpose)
    started = False
    deadline = time.monotonic() + 900
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the trainer did not finish"
        if not started:
            status = s.get(urls[0] + "/api/weights/status").json()["data"]
            if (status["steps_since_load"] or 0) >= CONTROL_COMMITS:
                for t in threads:
                    t.start()
                started = True
        time.sleep(0.2)
    out, err = proc.communicate()
    stop.set()
    if started:
        for t in threads:
            t.join(130)
    assert proc.returncode == 0, err[-4000:]
    report = json.loads(out.strip().splitlines()[-1])

    # the control: served NaN norms do not answer 200 with text (the check below can fail)
    assert report["control"]["status"] != 200 or "non_finite" in report["control"]["body"]
    # the commit count rose on both replicas, step by step
    assert report["steps"] == [
        [CONTROL_COMMITS + i, CONTROL_COMMITS + i] for i in range(1, STEPS + 1)
    ]
    assert report["transports"] == ["process_group", "process_group"]
    assert [g["rank"] for g in report["groups"]] == [1, 2]
    assert all(g["backend"] == "gloo" and g["group_state"] == "ready" for g in report["groups"])
    # no chat on either replica was served between the two broadcasts of a bracket
    assert started and len(results) >= 4, results
    failed = [r for r in results if r[1] != 200]
    assert not failed, failed[:5]
    assert {r[0] for r in results} == {0, 1}
    # both serve the same updated answer, and counted every commit
    finals = [_chat(s, u) for u in urls]
    assert all(f[0] == 200 for f in finals), finals
    assert finals[0][1] == finals[1][1] != reference, (finals, reference)
    # the save after training renamed the served set (its commits count from there: 0)
    assert all("origin=checkpoint" in f[2] and _commits(f[2]) == 0 for f in finals), finals
    for k in (0, 1):  # each replica's chats while training (before the save): the count rose
        seen = [_commits(r[3]) for r in results if r[0] == k and "origin=model" in r[3]]
        assert seen == sorted(seen) and seen[-1] >= CONTROL_COMMITS + 1, seen
    trained = finals[0][1]
    for u in urls:
        status = s.get(u + "/api/weights/status").json()["data"]
        assert status["steps_since_load"] == CONTROL_COMMITS + STEPS
        assert status["attached"] is False and status["weights_state"] == "clean"
    audit = [json.loads(x) for x in (tmp_path / "audit1.jsonl").read_text().splitlines()]
    ends = [a for a in audit if a["operation"] == "weights_commit_end"]
    assert len(ends) == CONTROL_COMMITS + STEPS
    assert {a["transport"] for a in ends} == {"process_group"}

    # a trainer killed while it sends tears both sets
    try:
        assert dying.stdout.readline().strip() == "ready", dying.stderr.read()[-4000:]
        dying.stdin.write("go\n")
        dying.stdin.flush()
        line = dying.stdout.readline()
        assert line.strip() == "sending", dying.stderr.read()[-4000:] if dying.poll() else line
    finally:
        dying.send_signal(signal.SIGKILL)
        dying.wait(30)
    deadline = time.monotonic() + 60 + WATCHDOG_MS / 1000
    for u in urls:
        while s.get(u + "/api/weights/status").json()["data"]["weights_state"] != "torn":
            assert time.monotonic() < deadline, f"the watchdog did not tear {u}"
            time.sleep(0.2)
    for u in urls:
        status = s.get(u + "/api/weights/status").json()["data"]
        assert status["attachment"]["process_group"]["group_state"] == "destroyed"
        st, _, _, body = _chat(s, u, timeout=15)
        assert st == 503 and body["error"]["code"] == "weights_torn", body

    # the operator: clear each stale attachment, then load that replica's checkpoint in place
    from miserver.trainer import WeightsClient

    for u, sha in zip(urls, report["saves"], strict=True):
        deadline = time.monotonic() + 60
        while (s.get(u + "/api/weights/status").json()["data"]["attachment"] or {}).get(
            "state"
        ) != "stale":
            assert time.monotonic() < deadline, f"{u}: the killed trainer never went stale"
            time.sleep(0.2)
        with WeightsClient(u, OPS, timeout=120, heartbeat=False) as operator:
            assert operator.clear_stale()["weights_state"] == "torn"
            loaded = operator.load(checkpoint=sha)
        assert loaded["weights_state"] == "clean" and loaded["in_place"] is True, loaded
    recovered = [_chat(s, u) for u in urls]
    assert [r[0] for r in recovered] == [200, 200], recovered
    assert recovered[0][1] == recovered[1][1] == trained


if __name__ == "__main__":
    trainer_main(sys.argv[1], sys.argv[2:4], sys.argv[4])
