"""The server owns its CPU shared-memory files (issue 16, items 1 and 4; contract section 8).

Each scenario runs a "server" in a subprocess (an attachable arena, exports as POST /attach makes
them, detach and unload as the runtime does them) so that an abort ("could not unlink the shared
memory file", exit 134) shows as that process's exit status; trainers are further subprocesses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shm in /dev/shm")

TRAINER = textwrap.dedent(
    """
    import json, sys, torch
    from miserver import trainer
    body = json.loads(sys.stdin.read())
    try:
        w = trainer.rebuild(body)
    except trainer.TrainerError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        raise SystemExit(0)
    with torch.no_grad():
        w.unique_tensors()[0].add_(1.0)
    w.release()
    print(json.dumps({"ok": True}))
    """
)

SERVER = textwrap.dedent(
    """
    import gc, json, os, subprocess, sys, torch
    from miserver import trainer
    from miserver.ipc import arena as A, export as X

    TRAINER = sys.argv[1]
    report = {}
    def mine():  # this process's files (torch's own names on a tree without miserver.ipc.shm)
        try:
            from miserver.ipc import shm
            tag = shm.server_id()
        except ImportError:
            tag = f"torch_{os.getpid()}_"
        return sorted(f for f in os.listdir("/dev/shm") if tag in f)
    def in_child(body):
        out = subprocess.run([sys.executable, "-c", TRAINER], input=json.dumps(body),
                             text=True, capture_output=True)
        return {"rc": out.returncode, "out": out.stdout.strip()[-400:],
                "err": out.stderr.strip()[-400:]}
    def here(body):
        try:
            trainer.rebuild(body).release()
            return "rebuilt"
        except trainer.TrainerError as exc:
            return type(exc).__name__ + ": " + str(exc)
        except Exception as exc:
            return "not a TrainerError: " + type(exc).__name__ + ": " + str(exc)

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))
    arena = A.make_attachable(model, cpu_shared=True)
    before = model[0].weight.detach().clone()
    body = X.export_handles(arena, model).to_builtins()          # attach 1
    report["two_processes"] = [in_child(body), in_child(body)]  # both rebuild one body
    report["third_rebuild"] = here(body)
    X.reclaim()                                                  # detach
    report["kept_body_after_detach"] = here(body)
    report["kept_body_in_child"] = in_child(body)
    body2 = X.export_handles(arena, model).to_builtins()        # attach 2
    report["fresh_body"] = here(body2)
    report["writes_seen"] = float((model[0].weight.detach() - before).abs().max())
    X.reclaim()
    report["files_while_loaded"] = len(mine())
    getattr(arena, "release_shared_memory", lambda: None)()  # unload (as the host does)
    report["files_after_unload"] = mine()
    report["after_unload"] = here(body2)
    del arena, model
    gc.collect()
    print(json.dumps(report), flush=True)
    """
)


@pytest.fixture(scope="module")
def server_run() -> tuple[int, dict, str]:
    out = subprocess.run(
        [sys.executable, "-c", SERVER, TRAINER], text=True, capture_output=True, timeout=240
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return out.returncode, (json.loads(lines[-1]) if lines else {}), out.stderr[-2000:]


@pytest.mark.full  # seconds to tens of seconds: left out of make quick
# The two tests of the server process (12 s to start on two cores) run in `make test` only.
@pytest.mark.full
def test_rebuilds_in_two_processes_and_a_kept_body_never_remove_the_servers_file(server_run):
    rc, report, err = server_run
    assert rc == 0, f"the server process ended with {rc}: {err}"
    for child in report["two_processes"]:
        assert child["rc"] == 0 and json.loads(child["out"]) == {"ok": True}, child
    # The file is still served: a third rebuild opens it, and the writes reached the server.
    assert report["third_rebuild"] == "rebuilt"
    assert report["writes_seen"] >= 1.99  # each trainer added 1.0
    # A body kept from before the detach is refused with a TrainerError that says what to do,
    # in this process and in another.
    stale = report["kept_body_after_detach"]
    assert stale.startswith("StaleExport: ") and "attach again" in stale, stale
    assert json.loads(report["kept_body_in_child"]["out"])["error"] == "StaleExport"
    assert report["fresh_body"] == "rebuilt"


@pytest.mark.full
def test_unload_removes_the_arena_and_a_body_of_it_is_refused(server_run):
    rc, report, err = server_run
    assert rc == 0, f"the server process ended with {rc}: {err}"
    assert report["files_while_loaded"] >= 2  # the arena and the lock file
    # Only the lock file remains (it goes at exit); no arena or attach name stays in /dev/shm.
    assert [f for f in report["files_after_unload"] if not f.endswith(".lock")] == []
    assert report["after_unload"].startswith("StaleExport: "), report["after_unload"]


HOLDER = textwrap.dedent(
    """
    import os, sys, time, torch
    from miserver.ipc import arena as A, shm
    model = torch.nn.Linear(16, 16)
    arena = A.make_attachable(model, cpu_shared=True)
    print(shm.server_id(), flush=True)
    if sys.argv[1] == "crash":
        os.kill(os.getpid(), 9)
    time.sleep(120)
    """
)


def _mine(sid: str) -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if sid in f)


@pytest.mark.full  # seconds to tens of seconds: left out of make quick
def test_start_removes_what_a_dead_server_left_and_never_a_live_servers_files():
    dead = subprocess.run(
        [sys.executable, "-c", HOLDER, "crash"], text=True, capture_output=True, timeout=120
    )
    assert dead.returncode == -signal.SIGKILL
    dead_id = dead.stdout.split()[0]
    # checked at once: any miserver process that starts on this machine sweeps a dead server's
    # files, so the check comes before the seconds the live holder takes to start
    assert len(_mine(dead_id)) >= 2, "the crash should have left its files"
    live = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "live"], stdout=subprocess.PIPE, text=True
    )
    try:
        live_id = live.stdout.readline().split()[0]
        from miserver.ipc import shm

        removed = shm.sweep_dead()
        assert _mine(dead_id) == []
        assert {n for n in removed if dead_id in n} >= {f"miserver-{dead_id}.lock"}
        assert not [n for n in removed if live_id in n]
        assert len(_mine(live_id)) >= 2  # a live server's arena and lock are untouched
    finally:
        live.kill()
        live.wait()
        for name in _mine(live_id):  # the killed holder's files, for the next test run
            os.unlink(os.path.join("/dev/shm", name))
