"""The GRPO example on the CPU (issue 14): ``examples/grpo_in_place.py``, short schedule, its own
``miserver serve`` in CPU shared-memory mode, each group of answers one request with ``n``.

The slow test runs the example as a user would (a subprocess, the real default model) and
asserts the issue's point from its ``results.json``: the served reward rises from its untrained
value to the stated target (the held-out greedy score, and the sampled reward with it), with one
commit a step, every group sampled from the weights of the step before, every evaluation from
the weights of its step, and no failed request.

``MISERVER_HOME`` is ``home_with_default`` (a fresh home over the shared imported default), as
for the demo: the server writes into its home.

The fast tests check the example's parts on made-up values: the reward, the advantages, the
question split, the token ids of a sampled answer (against the tokenizer), the loss's
arithmetic (against a hand computation on a tiny model), the table and the plot, so that none
of them could pass while wrong.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.example_scripts import load_example, run_short_on_cpu

grpo = load_example("grpo_in_place")


# --- the task ----------------------------------------------------------------------------------
def test_the_reward_wants_the_product_as_the_last_number_of_an_ended_answer() -> None:
    assert grpo.reward("7 x 8 = 56", "stop", 56) == 1.0
    assert grpo.reward("The answer is 56.", "stop", 56) == 1.0
    assert grpo.reward("7 x 8 = 56", "length", 56) == 0.0  # ran out of tokens
    assert grpo.reward("56 is 7 x 8", "stop", 56) == 0.0  # the last number is 8
    assert grpo.reward("7 x 8 = 54", "stop", 56) == 0.0
    assert grpo.reward("fifty-six", "stop", 56) == 0.0
    assert grpo.reward("7 x 8 = 560", "stop", 56) == 0.0
    assert grpo.last_number("a 12, b 3.") == 3 and grpo.last_number("none") is None


def test_advantages_are_relative_to_the_group() -> None:
    adv = grpo.group_advantages([1.0, 0.0, 0.0, 0.0])
    # mean 0.25, population std sqrt(3)/4
    std = math.sqrt(3) / 4
    assert adv[0] == pytest.approx(0.75 / (std + 1e-4))
    assert adv[1:] == [pytest.approx(-0.25 / (std + 1e-4))] * 3
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    assert grpo.group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]  # nothing to prefer
    assert grpo.group_advantages([0.0, 0.0]) == [0.0, 0.0]


def test_the_held_out_questions_are_fixed_and_never_trained_on() -> None:
    train, held = grpo.split_questions()
    assert len(held) == grpo.HELD_OUT == 16 and len(train) == 64 - 16
    assert not set(train) & set(held)
    assert set(train) | set(held) == {(a, b) for a in range(2, 10) for b in range(2, 10)}
    assert grpo.split_questions() == (train, held)  # the same split every run
    assert grpo.split_questions(seed=1) != (train, held)
    assert grpo.question(7, 8) == "What is 7 x 8?"


@pytest.fixture(scope="module")
def tokenizer(default_home: str):
    from transformers import AutoTokenizer

    from miserver.serving.models.catalogue import Catalogue

    row = Catalogue(default_home).get_by_name(grpo.MODEL)
    return AutoTokenizer.from_pretrained(row.path)


@pytest.mark.slow
def test_the_sampled_token_ids_are_recovered_also_when_not_the_tokenizers_own_split(
    tokenizer,
) -> None:
    def piece(i: int) -> str:
        return tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    text = "6 x 6 = 36.\n\n6"
    own = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert grpo.completion_ids(tokenizer, text, [piece(i) for i in own]) == own
    # sampled as " \n\n" (one token) where the tokenizer splits " \n" + "\n"
    sampled = tokenizer.convert_tokens_to_ids(["Ġ", "ĊĊ"])
    text = "".join(piece(i) for i in sampled)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] != sampled
    assert grpo.completion_ids(tokenizer, text, [piece(i) for i in sampled]) == sampled
    # tokens that do not make the text: unknown
    assert grpo.completion_ids(tokenizer, "7 x 8", ["7", " x", " 9"]) is None


def _tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).float()


def _alone(model, prompt: list[int], answer: list[int]):
    """log p of each answer token with (prompt + answer) run alone, no cache, no padding."""
    import torch

    ids = torch.tensor([prompt + answer])
    lp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1], dim=-1)
    return torch.stack([lp[len(prompt) - 1 + k, t] for k, t in enumerate(answer)])


def test_the_answers_over_the_shared_question_cache_score_as_each_run_alone() -> None:
    import torch

    model = _tiny_llama()
    prompt = [1, 3, 4, 9]
    answers = [[5, 6, 2], [7, 8, 9, 10, 11], [12]]  # of three lengths: padding and masking
    got = grpo.answer_logprobs(model, prompt, answers, pad_id=0)
    for a, lp in zip(answers, got, strict=True):
        assert lp.shape == (len(a),) and lp.dtype == torch.float32
        assert torch.allclose(lp, _alone(model, prompt, a), atol=1e-5), a
    # the gradient too: through the repeated cache into the question's forward
    sum(lp.sum() for lp in got).backward()
    shared = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    sum(_alone(model, prompt, a).sum() for a in answers).backward()
    for n, p in model.named_parameters():
        assert torch.allclose(shared[n], p.grad, atol=1e-5), n


def test_the_loss_is_minus_advantage_times_the_answers_log_probability() -> None:
    """The gradient of the example's loss equals the one of the formula computed by hand; an
    answer of advantage 0 or unknown ids is not in it, and the mean is over all answers."""
    import torch

    model = _tiny_llama()

    class Tok:
        pad_token_id = 0

    run = grpo.Run.__new__(grpo.Run)
    run.tokenizer = Tok()
    answers = [
        grpo.Answer("a", "stop", 1.0, [5, 6, 2], [-1.0, -1.0], advantage=1.5),
        grpo.Answer("b", "length", 0.0, [7, 8, 9, 10], [-1.0] * 4, advantage=-0.5),
        grpo.Answer("c", "length", 0.0, [11], [-1.0], advantage=0.0),  # adds nothing
        grpo.Answer("d", "stop", 0.0, None, [], advantage=-0.5),  # ids unknown: left out
        grpo.Answer("e", "stop", 1.0, [13, 2], [-2.0], advantage=0.7),
    ]
    groups = [
        grpo.Group((2, 3), [1, 3, 4], 0, 0, answers[:2]),
        grpo.Group((4, 5), [1, 3], 0, 0, answers[2:]),
    ]
    loss, in_loss, gap = run.gradients(model, groups)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    want = 0.0
    for g in groups:
        for a in g.answers:
            if a.ids is not None:
                want = want - a.advantage * _alone(model, g.prompt_ids, a.ids).sum() / 5
    want.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grpo.CLIP_NORM)
    assert in_loss == 3 and loss == pytest.approx(float(want), rel=1e-4)
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, atol=1e-6), n
    # the made-up server log-probs are not the model's: the gap is theirs, token by token
    mine = [
        _alone(model, [1, 3, 4], [5, 6, 2])[:2],
        _alone(model, [1, 3, 4], [7, 8, 9, 10]),
        _alone(model, [1, 3], [13, 2])[:1],
    ]
    served = [[-1.0, -1.0], [-1.0] * 4, [-2.0]]
    pairs = [
        (float(x), y) for m, s in zip(mine, served, strict=True) for x, y in zip(m, s, strict=True)
    ]
    diffs = [abs(x - y) for x, y in pairs]
    assert gap == pytest.approx(sum(diffs) / len(diffs), rel=1e-4)


# --- talking to the server ------------------------------------------------------------------
def _answer(status: int, body: dict, header: str | None = None):
    import requests

    r = requests.Response()
    r.status_code = status
    r._content = json.dumps(body).encode()
    r.url = "http://127.0.0.1:1/v1/completions"
    r.request = requests.Request("POST", r.url).prepare()
    if header:
        r.headers["X-miLLM-Model"] = header
    return r


def test_a_refused_n_is_a_setup_error_and_another_refusal_a_failed_request(monkeypatch) -> None:
    v1 = grpo.V1("http://127.0.0.1:1")
    sent = []

    class Session:
        def __init__(self, answer):
            self.answer = answer

        def post(self, url, timeout, json):
            sent.append(json)
            return self.answer

    def answering(answer):
        monkeypatch.setattr(v1, "_session", lambda: Session(answer))

    refused_n = {"error": {"code": "INVALID_REQUEST", "param": "n", "message": "n must be..."}}
    answering(_answer(400, refused_n))
    with pytest.raises(grpo.SetupError, match="MAX_BATCH_SIZE=8"):
        v1.complete([1, 2], n=8, max_tokens=20)
    assert sent[-1] == {"model": grpo.MODEL, "prompt": [1, 2], "n": 8, "max_tokens": 20}
    other = {"error": {"code": "INVALID_REQUEST", "param": "max_tokens", "message": "too many"}}
    answering(_answer(400, other))
    with pytest.raises(grpo.RequestFailed, match="400"):
        v1.complete([1, 2], n=8)
    answering(_answer(503, {"error": {"code": "MODEL_NOT_LOADED", "message": "x"}}))
    with pytest.raises(grpo.RequestFailed, match="503"):
        v1.complete([1, 2])
    ok = {"choices": [{"index": 0, "text": "6", "finish_reason": "stop"}], "usage": {}}
    answering(_answer(200, ok, '"smollm2-135m-instruct";origin=model;commits=7'))
    body = v1.complete([1, 2], n=1)
    assert body["commits"] == 7 and body["choices"] == ok["choices"]


# --- the report ----------------------------------------------------------------------------------
def _results() -> dict:
    steps = [
        {
            "step": k,
            "reward": r,
            "group_rewards": [r, r],
            "ended": e,
            "completion_tokens": 20 - 2 * k,
        }
        for k, r, e in ((1, 0.1, 0.2), (2, 0.3, 0.5), (3, 0.6, 0.8), (4, 0.8, 0.9))
    ]
    evals = [
        {
            "step": k,
            "commits": [k] * 16,
            "correct": c,
            "total": 16,
            "ended": c,
            "score": c / 16,
            "sampled": w,
            "answers": [{"question": "What is 2 x 3?", "answer": "2 x 3 = 6", "reward": 1.0}],
        }
        for k, c, w in ((0, 1, None), (2, 7, 0.2), (4, 13, 0.7))
    ]
    summary = {
        "schedule": "short",
        "task": "t",
        "reward_rule": "r",
        "held_out": 16,
        "target": 0.75,
        "target_sampled": 0.5,
        "steps": 4,
        "commits": 4,
        "untrained_held_out": 1 / 16,
        "final_held_out": 13 / 16,
        "reached_target_at_step": 4,
        "untrained_sampled_reward": 0.1,
        "final_sampled_reward": 0.7,
        "answers_sampled": 64,
        "answers_left_out": 0,
        "groups_off_policy": 0,
        "requests": 60,
        "requests_failed": 0,
        "logprob_gap_mean": 0.01,
        "logprob_gap_max": 0.2,
        "sample_s_p50": 1.0,
        "grad_s_p50": 2.0,
        "hold_s_p50": 0.5,
        "commit_ms_p50": 400.0,
        "commit_ms_max": 900.0,
        "commits_overran": 0,
        "wall_s": 100.0,
        "passed": True,
    }
    return {"summary": summary, "steps": steps, "evals": evals}


def test_the_table_has_a_row_per_evaluation_with_the_sampled_reward_since_the_last() -> None:
    table = grpo.results_table(_results())
    rows = [ln.split() for ln in table.splitlines()[2:5]]
    assert [r[0] for r in rows] == ["0", "2", "4"]
    assert rows[1][2] == "7/16" and rows[1][3] == "0.20"  # steps 1-2: (0.1 + 0.3) / 2
    assert rows[2][3] == "0.70"  # steps 3-4
    assert rows[0][3] == "-"  # before training
    assert "0.06 -> 0.81 (0.75)" in table and "0.10 -> 0.70 (0.50)" in table
    assert table.rstrip().endswith("PASS")


def test_the_plot_draws_both_rewards_and_the_target(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))
    grpo.plot(_results(), tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    top = fig.axes[0]
    labels = {ln.get_label(): ln for ln in top.get_lines()}
    held = next(ln for k, ln in labels.items() if k.startswith("held-out greedy score"))
    assert list(held.get_ydata()) == [1 / 16, 7 / 16, 13 / 16]
    assert list(labels["sampled reward"].get_ydata()) == [0.1, 0.3, 0.6, 0.8]
    target = next(ln for k, ln in labels.items() if k.startswith("held-out target"))
    assert list(target.get_ydata()) == [0.75, 0.75]
    target = next(ln for k, ln in labels.items() if k.startswith("sampled target"))
    assert list(target.get_ydata()) == [0.5, 0.5]


def test_usage_errors_exit_2() -> None:
    for bad in (
        ["--server", "http://127.0.0.1:1"],
        ["--token-file", "t"],
        ["--group-size", "1"],
        ["--max-steps", "0"],
        ["--schedule", "long"],
    ):
        with pytest.raises(SystemExit) as exc:
            grpo.parse_args(bad)
        assert exc.value.code == 2, bad


def test_the_self_started_server_decodes_a_steps_answers_in_one_pass(tmp_path: Path) -> None:
    short = grpo.SCHEDULES["short"]
    from _shared import LocalServer

    settings = grpo.server_settings(short)
    assert settings == {"MAX_BATCH_SIZE": str(short.questions_per_step * short.group_size)}
    server = LocalServer(
        device="cpu",
        home=str(tmp_path),
        log_path=tmp_path / "log",
        watchdog_ms=None,
        audit_path=tmp_path / "audit.jsonl",
        extra_env=settings,
    )
    assert server._env["MAX_BATCH_SIZE"] == "32" and server._env["WEIGHTS_CPU_ATTACH"] == "1"
    assert server._env["MAX_CONCURRENT_REQUESTS"] == "1"  # the barrier needs it


# --- the run -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_cpu_grpo_raises_the_served_reward_to_the_target(
    home_with_default: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc, log, results = run_short_on_cpu("grpo_in_place", home_with_default, out)
    s = results["summary"]
    steps, evals = results["steps"], results["evals"]
    target = s["target"]

    # the served reward rises from its untrained value to the stated target
    assert target == grpo.SCHEDULES["short"].target == 0.75
    assert evals[0]["step"] == 0 and evals[0]["score"] == s["untrained_held_out"] < target, log
    assert s["final_held_out"] >= target, log
    assert s["reached_target_at_step"] == evals[-1]["step"] == s["steps"], log  # stops there
    assert s["final_sampled_reward"] > s["untrained_sampled_reward"] + 0.2, log
    # the task gives a group something to learn: sampled answers of the untrained model earn
    # a reward within the first steps (about 1 in 16 does; the first step's 32 may all miss)
    assert any(r["reward"] > 0 for r in steps[:5]), log

    # one commit a step; every group sampled from the weights after `step - 1` commits, every
    # evaluation answer from those after `step`
    assert s["commits"] == s["steps"] == len(steps) <= grpo.SCHEDULES["short"].max_steps, log
    assert [r["step"] for r in steps] == list(range(1, s["steps"] + 1))
    for r in steps:
        assert r["served_commits"] == [r["step"] - 1] * 4, r
        # a group of mixed rewards puts every answer in the loss (binary rewards: none is at
        # the mean); a group of equal ones none
        mixed = 8 * sum(0 < g < 1 for g in r["group_rewards"])
        assert mixed - r["left_out"] <= r["in_loss"] <= mixed, r
    for e in evals:
        assert e["commits"] == [e["step"]] * e["total"], e
    assert s["groups_off_policy"] == 0 and s["eval_answers_off"] == 0
    assert s["answers_sampled"] == s["steps"] * 4 * 8
    assert s["answers_left_out"] <= s["answers_sampled"] // 100, log
    # the trainer's log-probabilities are the server's (the same weights, other numerics)
    assert s["logprob_gap_mean"] is not None and s["logprob_gap_mean"] < 0.1, log

    # no failed request, no commit past the watchdog
    assert s["requests_failed"] == 0, (s["failures"], log)
    assert s["commits_overran"] == 0

    assert proc.returncode == 0, log
    assert s["passed"] is True
    png = out / "grpo_in_place.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "PASS" in proc.stdout
    audit = [json.loads(line) for line in (out / "audit.jsonl").read_text().splitlines()]
    ends = [a for a in audit if a["operation"] == "weights_commit_end"]
    assert len(ends) == s["steps"] and all(a["outcome"] == "accepted" for a in ends)
