"""The train-while-serving demo on the CPU (issue 8): ``examples/train_while_serving.py``, short
schedule, its own ``miserver serve`` in CPU shared-memory mode.

The slow test runs the demo as a user would (a subprocess, the real default model) and asserts
the issue's points from its ``results.json``: the served recital rises from the untrained 0 of
19 lines to all 19, the control question is still answered, and no chat request failed or was
served during a commit, while chat requests really did arrive during the commits.

``MISERVER_HOME`` is ``home_with_default`` (a fresh home over the shared imported default), not
``default_home`` itself: the demo saves a checkpoint, which writes a folder and a catalogue row
into the home, and ``default_home`` is shared read-only by the other tests.

The fast tests check the demo's scoring and its "served during a commit" detector on made-up
records, so a detector that could never fire would fail here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.example_scripts import load_example, run_short_on_cpu

demo = load_example("train_while_serving")


# --- the demo's parts --------------------------------------------------------------------------
def test_the_text_is_the_19_aphorisms_of_pep_20(capsys: pytest.CaptureFixture[str]) -> None:
    lines = demo.zen_lines()
    assert len(lines) == 19
    assert lines[0] == "Beautiful is better than ugly."
    assert lines[-1] == "Namespaces are one honking great idea -- let's do more of those!"
    assert "Readability counts." in lines
    assert capsys.readouterr().out == ""  # importing `this` printed nothing


def test_a_line_counts_only_when_reproduced_exactly_and_whole() -> None:
    ref = demo.zen_lines()
    assert demo.score_recital("\n".join(ref), ref) == 19
    assert demo.score_recital("  " + "\n ".join(ref) + "\n", ref) == 19  # indentation ignored
    assert demo.score_recital("The Zen of Python is a simple yet profound text.", ref) == 0
    assert demo.score_recital("Beautiful is better than ugly", ref) == 0  # no full stop
    assert demo.score_recital("beautiful is better than ugly.", ref) == 0  # case matters
    assert demo.score_recital("Readability counts. Beautiful is better than ugly.", ref) == 0
    assert demo.score_recital("Readability counts.\nReadability counts.\n", ref) == 1


def _commit(start: float, end: float) -> object:
    return demo.CommitRecord(
        step=1,
        loss=1.0,
        hold_start=start - 0.05,
        write_start=start,
        write_end=end,
        hold_end=end + 0.05,
        commit_ms=(end - start) * 1e3,
        overran=False,
        held_requests=0,
        steps_since_load=1,
    )


def test_a_token_inside_a_write_window_is_flagged_and_one_at_its_edge_is_not() -> None:
    commits = [_commit(10.0, 11.0)]
    inside = demo.ChatRecord(
        index=0, t_sent=9.0, t_first=9.5, t_done=12.0, status=200, chunk_times=[9.5, 10.5, 11.5]
    )
    edges = demo.ChatRecord(
        index=1,
        t_sent=9.0,
        t_first=9.9,
        t_done=12.0,
        status=200,
        chunk_times=[9.9, 10.05, 10.95, 11.2],
    )
    held = demo.ChatRecord(
        index=2, t_sent=10.5, t_first=11.3, t_done=11.9, status=200, chunk_times=[11.3, 11.8]
    )
    after = demo.ChatRecord(
        index=3, t_sent=11.2, t_first=11.3, t_done=11.9, status=200, chunk_times=[11.3, 11.8]
    )
    records = [inside, edges, held, after]
    assert demo.served_during_writes(records, commits) == [0]
    # waited through the write: sent before it ended, first token after it
    assert demo.held_by_commits(records, commits) == 1


def test_percentile_is_nearest_rank() -> None:
    assert demo.percentile([], 50) is None
    assert demo.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert demo.percentile(list(range(1, 101)), 99) == 99
    assert demo.percentile([5.0], 99) == 5.0


def test_usage_errors_exit_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.parse_args(["--server", "http://127.0.0.1:1"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        demo.parse_args(["--token-file", str(tmp_path / "t")])
    with pytest.raises(SystemExit) as exc:  # the self-started server has no socket
        demo.parse_args(["--unix-socket", str(tmp_path / "m.sock")])
    assert exc.value.code == 2
    args = demo.parse_args(
        ["--server", "http://x:1", "--token-file", "t", "--unix-socket", "/run/m.sock"]
    )
    assert args.unix_socket == "/run/m.sock"


def test_the_self_started_server_serves_on_the_port_asked_for(tmp_path: Path) -> None:
    assert demo.parse_args([]).port == 0  # a free one
    args = demo.parse_args(["--port", "18123"])
    server = demo.LocalServer(
        device="cpu",
        home=str(tmp_path),
        log_path=tmp_path / "log",
        watchdog_ms=None,
        audit_path=tmp_path / "audit.jsonl",
        port=args.port,
    )
    assert server.base == "http://127.0.0.1:18123" and server._env["PORT"] == "18123"
    for bad in (
        ["--port", "70000"],
        ["--port", "1", "--server", "http://x:1", "--token-file", "t"],
    ):
        with pytest.raises(SystemExit) as exc:
            demo.parse_args(bad)
        assert exc.value.code == 2


# --- the run -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_cpu_demo_teaches_the_served_model_all_19_lines_under_chat_load(
    home_with_default: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc, log, results = run_short_on_cpu("train_while_serving", home_with_default, out)
    s = results["summary"]
    evals = results["evals"]
    ck = s["checkpoint"]
    assert ck is not None, log

    # the served score rises from the untrained 0 of 19 lines to all 19
    assert s["lines_total"] == 19
    assert evals[0]["step"] == 0 and evals[0]["lines"] == 0, log
    assert s["untrained_lines"] == 0 and s["final_lines"] == 19, log
    assert s["final_nll"] < s["untrained_nll"] / 4, log
    # every evaluation was served by the parameter set after exactly `step` commits
    assert [e["commits"] for e in evals] == [e["step"] for e in evals], log
    assert s["steps"] == evals[-1]["step"] and s["steps"] <= 40

    # the control question is still answered
    assert s["control_before"] and s["control_after"] and s["control_after_save"], log

    # no chat request failed or was served during a commit ...
    assert s["chat_failed"] == 0, (s["chat_failures"], log)
    assert s["chat_served_during_commit"] == 0, log
    assert s["commits_overran"] == 0
    # ... while chat traffic really did meet the commits (otherwise the check says nothing)
    assert s["chat_requests"] >= 10
    # one chat per evaluation interval is sent inside a write: the server counted each held,
    # then answered it on the new weights (however the load happened to fall against commits)
    assert s["held_probes"] >= 1, log
    assert s["held_probes_seen"] == s["held_probes"], (s["notes"], log)
    assert s["chat_held_by_a_commit"] >= s["held_probes_seen"], log
    assert s["write_windows_checked"] >= 1, log
    # each chat answer names the parameter set it came from; the sets only move forward, and
    # after the save the checkpoint's name serves, its commits counted from 0
    served_by = [(c["model"], c["commits"]) for c in results["chats"]]
    assert {m for m, _ in served_by} <= {"smollm2-135m-instruct", ck["name"]}, served_by
    base = [n for m, n in served_by if m == "smollm2-135m-instruct"]
    assert base == sorted(base) and base[0] == 0 and base[-1] <= s["steps"], served_by
    after = served_by[len(base) :]
    assert served_by[: len(base)] == [("smollm2-135m-instruct", n) for n in base], served_by
    assert all(n == 0 for _, n in after), served_by

    # the checkpoint was saved through the API and now names what is served
    assert len(ck["checkpoint_sha256"]) == 64
    assert ck["steps_since_load"] == s["steps"]
    assert Path(ck["path"]).is_dir() and Path(ck["path"], "manifest.json").is_file()
    assert Path(ck["path"]).is_relative_to(home_with_default)
    assert s["served_name_after_save"] == ck["name"]
    assert s["served_origin_after_save"] == "checkpoint"

    assert proc.returncode == 0, log
    assert s["passed"] is True
    png = out / "train_while_serving.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "PASS" in proc.stdout
    audit = [json.loads(line) for line in (out / "audit.jsonl").read_text().splitlines()]
    ends = [a for a in audit if a["operation"] == "weights_commit_end"]
    assert len(ends) == s["steps"] and all(a["outcome"] == "accepted" for a in ends)


def test_held_requests_per_commit_add_up_to_the_summary_and_the_plot_marks_them(
    tmp_path: Path, monkeypatch
) -> None:
    commits = [_commit(10.0, 11.0), _commit(20.0, 21.0)]
    chats = [
        demo.ChatRecord(index=0, t_sent=10.5, t_first=11.3, t_done=11.9, status=200),
        demo.ChatRecord(index=1, t_sent=20.2, t_first=21.1, t_done=21.5, status=200),
        demo.ChatRecord(index=2, t_sent=20.4, t_first=21.2, t_done=21.6, status=200),
        demo.ChatRecord(index=3, t_sent=30.0, t_first=30.1, t_done=30.5, status=200),
    ]
    per_commit = [sum(demo.held_through(r, c) for r in chats) for c in commits]
    assert per_commit == [1, 2] and sum(per_commit) == demo.held_by_commits(chats, commits)

    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))
    results = {
        "summary": {
            "lines_total": 19,
            "schedule": "short",
            "control_after": True,
            "chat_requests": 4,
            "chat_failed": 0,
            "chat_served_during_commit": 0,
        },
        "evals": [
            {
                "step": s,
                "lines": n,
                "nll": 2.0 - s / 10,
                "control_ok": True,
                "started": t,
                "at": t + 1,
            }
            for s, n, t in ((0, 0, 1.0), (5, 9, 15.0), (10, 19, 25.0))
        ],
        "commits": [{**demo.asdict(c)} for c in commits],
        "chats": [
            {
                "t_done": r.t_done,
                "latency_s": r.t_done - r.t_sent,
                "error": None,
                "held_through_a_write": any(demo.held_through(r, c) for c in commits),
            }
            for r in chats
        ],
        "save_window": None,
    }
    demo.plot(results, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    (fig,) = figures
    top, _loss, bottom = fig.axes[0], fig.axes[2], fig.axes[1]
    evals = [ln for ln in top.get_lines() if ln.get_label().startswith("Zen lines")]
    assert evals and evals[0].get_linestyle() in ("None", "") and evals[0].get_marker() == "o"
    held = [ln for ln in bottom.get_lines() if ln.get_label().startswith("held through a write")]
    assert held and len(held[0].get_xdata()) == 3
    for ax in (top, bottom):  # the legends sit below the axes, covering no point
        legend = ax.get_legend()
        assert legend is not None and legend.get_bbox_to_anchor().y0 < ax.bbox.y0
