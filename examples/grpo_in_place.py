#!/usr/bin/env python3
"""GRPO in place: reinforcement learning on the served SmolLM2-135M-Instruct, the server sampling.

A trainer attaches to the weights the server is serving (``miserver.trainer.WeightsClient``) and
builds the model on the served tensors, as ``train_while_serving.py`` does. Then, every step, it
asks the server for a group of ``n`` answers to each of a few questions (``/v1/completions``
with ``n``, one request a question, sampled at temperature 1 with a ``seed``; the step's requests
are sent together and decode together on the server's engine), scores every
answer with a program, turns the scores into group-relative advantages (GRPO: the reward minus
the group's mean, divided by the group's standard deviation plus 1e-4), computes the
policy-gradient loss ``-(advantage * the sum of the answer's token log-probabilities)`` on its
own graph (reads only: serving goes on), and writes the step into the served weights inside the
commit bracket (``with client.commit(): optimizer.step()``). The next group is sampled from the
weights just written: on-policy, with no copy of the weights anywhere.

The task: single-digit multiplication, asked as a chat ("What is 7 x 8?"). The reward is 1 when
the answer ends (the model's end-of-turn token) within 20 tokens and the last number in it is
the product, else 0. Why this one: untrained, the model knows most of these products but rarely
says one and stops; it explains ("To calculate 7 x 8, you multiply 7 by itself, ..."), digresses
("4 x 2 = 8\n\nIn mathematics, 4 x 2 is a fundamental"), or runs out of tokens. So the reward
starts low but not at zero: with plain transformers before this example was written, 5 of 80
answers at temperature 1 earned it (about 1 in 16, so a group of 8 holds a rewarded answer about
40 % of the time, and a step's four groups usually hold one: a policy gradient needs some);
here the untrained greedy answer earns it on 1 of the 16 held-out questions and the first step's
sampled answers on 1 or 2 of 32. The behaviour to learn, "7 x 8 = 56." and stop, is a small
move for the policy, and the arithmetic is mostly known already. Tasks tried and dropped: sums
of two two-digit numbers, the next term of an arithmetic sequence, counting words, and any
"answer with the number only" variant: 0 or 1 rewarded answer in 64, nothing for a group to
learn from; one-digit sums: the greedy answer was already right on 7 of 8.

Measured with this example on two shared CPU cores (the short schedule, docs/grpo-results.md):
both targets reached at step 10 for the seeds 0, 1 and 2 (held-out greedy 1/16 -> 13-15/16,
sampled reward 0.03-0.06 -> 0.54-0.81), 120-196 s from the start; run on to 30 steps (seed 0)
the sampled reward reaches 0.96 and the held-out score stays at 14-15/16 from step 15. The
optimizer is AdamW (no weight decay) on the bfloat16 served weights themselves, the gradient's
norm clipped to 1: at lr 1e-4 as above; 5e-5 learned too, about half as fast (the exploration);
3e-4 wrecked the model in its first step (every answer "2 x 4." from then on).

The 64 questions (a, b in 2..9) are split once, with a fixed seed: 16 are held out and only
asked greedily in the evaluation, every ``eval_every`` steps; training draws from the other 48.
The served reward is both the mean reward of the sampled answers (each step) and the held-out
greedy score (each evaluation). Every answer names the parameter set it came from
(``X-miLLM-Model``): a step's groups are checked to come from the weights after exactly
``step - 1`` commits, an evaluation's from those after ``step``.

At the end it writes ``results.json`` and ``grpo_in_place.png`` (the rewards against the step,
the answers' length) to ``--out``, and prints a results table.

Run it::

    python examples/grpo_in_place.py                        # CPU: starts its own server
    python examples/grpo_in_place.py --schedule full --device cuda
    python examples/grpo_in_place.py --server http://127.0.0.1:8000 --token-file secret

Without ``--server`` it starts ``miserver serve`` itself (``examples/_shared.py``: a generated
trainer token, ``WEIGHTS_CPU_ATTACH=1`` and the watchdog raised to 30 s on the CPU), with
``MAX_BATCH_SIZE`` set to the answers of a step (questions x ``n``): the step's requests, sent
together, decode together (every answer of the step in the engine's running batch at once).
With ``--server`` that server's ``MAX_BATCH_SIZE`` must be at least the group size (``n`` above
it is refused).

The targets (per schedule): a held-out greedy score and a mean sampled reward (over the steps
since the evaluation before), both reached at the last evaluation; the short schedule stops at
the first evaluation that reaches both.

Exit status: 0 when the served reward reached both targets and no request failed; 1 when not;
2 for a usage or set-up error (130: interrupted).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests
from _shared import (
    MODEL,
    SetupError,
    StopRequest,
    check_attachment,
    check_server_args,
    connect,
    example_parser,
    fmt,
    fused_if_supported,
    json_or_raise,
    out_dir,
    parse_served_by,
    percentile,
    resolve_device,
    run_example,
    table_text,
)

DEFAULT_OUT = "grpo-in-place-out"
#: The factors of the task's questions: every ordered pair (a, b) of them is a question.
FACTORS = tuple(range(2, 10))
#: How many of the 64 questions are held out, and the seed that picks them.
HELD_OUT = 16
SPLIT_SEED = 14
#: The answer's budget, tokens: an answer that has not ended by then earns nothing.
MAX_TOKENS = 20
#: GRPO's epsilon: a group whose answers all earned the same has advantages 0 (no gradient).
ADVANTAGE_EPS = 1e-4
#: The gradient's norm is clipped to this before the step (one bad group cannot wreck the set).
CLIP_NORM = 1.0


# --- the task ----------------------------------------------------------------------------------
def question(a: int, b: int) -> str:
    return f"What is {a} x {b}?"


def split_questions(seed: int = SPLIT_SEED) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(training pairs, held-out pairs): the 64 ordered pairs of :data:`FACTORS`, :data:`HELD_OUT`
    of them held out by ``random.Random(seed)``; each list sorted."""
    pairs = [(a, b) for a in FACTORS for b in FACTORS]
    held = set(random.Random(seed).sample(pairs, HELD_OUT))
    return sorted(set(pairs) - held), sorted(held)


def last_number(text: str) -> int | None:
    """The last run of decimal digits in ``text`` as an int; None when there is none."""
    found = re.findall(r"\d+", text)
    return int(found[-1]) if found else None


def reward(text: str, finish_reason: str | None, answer: int) -> float:
    """1.0 when the completion ended on its own (``finish_reason`` "stop": the end-of-turn
    token; no stop sequence is sent) and its last number is ``answer``; else 0.0."""
    return float(finish_reason == "stop" and last_number(text) == answer)


def group_advantages(rewards: Sequence[float], eps: float = ADVANTAGE_EPS) -> list[float]:
    """GRPO's group-relative advantages: ``(r - mean) / (std + eps)``, the population standard
    deviation of the group. All equal rewards give all zeros."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [(r - mean) / (std + eps) for r in rewards]


def completion_ids(tokenizer: Any, text: str, tokens: Sequence[str]) -> list[int] | None:
    """The token ids of a completion the server sampled, from its text and its ``logprobs``'
    ``tokens`` (the strings of the sampled tokens; the end-of-turn token is not among them).

    Each of ``tokens`` is looked up in the vocabulary (byte-level BPE: one byte string, one id);
    the ids are taken when they decode to ``text``. The text re-tokenized is not enough: about
    one sampled answer in 16 is not the tokenizer's own split of its text (``" \n\n"`` sampled as
    one token, re-tokenized as two). When a token is not in the vocabulary (part of a
    character, shown as U+FFFD), the re-tokenized text is taken if its tokens decode one by one
    to ``tokens``. None when neither works: the answer is left out of the loss (counted).
    """
    vocab = tokenizer.get_vocab()
    looked_up = [vocab.get(_vocab_form(t)) for t in tokens]
    if None not in looked_up and _decode(tokenizer, looked_up) == text:
        return looked_up
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if [_decode(tokenizer, [i]) for i in ids] == list(tokens):
        return ids
    return None


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _byte_table() -> dict[int, str]:
    """GPT-2's byte-level BPE table: each byte as the character the vocabulary writes it with
    (printable Latin-1 bytes as themselves, the others shifted to U+0100 and up)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in keep]
    return {
        **{b: chr(b) for b in keep},
        **{b: chr(256 + k) for k, b in enumerate(shifted)},
    }


_BYTES = _byte_table()


def _vocab_form(text: str) -> str:
    """A token's text as byte-level BPE writes it in the vocabulary."""
    return "".join(_BYTES[b] for b in text.encode("utf-8"))


def answer_logprobs(
    model: Any, prompt_ids: list[int], answers: list[list[int]], pad_id: int = 0
) -> list[Any]:
    """``log p(token | question, the answer's tokens before it)`` for every token of each answer
    to one question: one float32 tensor ``[len(answer)]`` each, on the model's device, with the
    graph kept for a backward.

    The question is run once and its key/value cache repeated for the answers, which are then
    run together over it (right-padded, masked): a group's answers share their prompt, two
    thirds of the tokens here, so this is about a third of the work of running each
    (question + answer) alone, with the same result (``tests/e2e/test_grpo_cpu.py`` compares).
    """
    import inspect

    import torch
    from transformers import DynamicCache

    device = next(model.parameters()).device
    n, p, width = len(answers), len(prompt_ids), max(len(a) for a in answers)
    # the argument's name: `cache` from transformers 5.2x, `past_key_values` before
    named = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache()
    out = model(input_ids=torch.tensor([prompt_ids], device=device), **{named: cache})
    first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)  # predicts each answer's first
    cache.batch_repeat_interleave(n)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, p + width), dtype=torch.long)
    mask[:, :p] = 1
    for i, a in enumerate(answers):
        ids[i, : len(a)] = torch.tensor(a)
        mask[i, p : p + len(a)] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = torch.arange(p, p + width, device=device).expand(n, width)
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, **{named: cache}
    ).logits
    rest = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return [
        torch.cat([first[a[0]].reshape(1), rest[i, : len(a) - 1]]) for i, a in enumerate(answers)
    ]


# --- schedules ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Schedule:
    """How long and how hard to train, and the score to reach."""

    name: str
    max_steps: int
    questions_per_step: int
    group_size: int  # n: answers per question, one request
    lr: float
    eval_every: int
    target: float  # held-out greedy score to reach (fraction of HELD_OUT)
    target_sampled: float  # mean sampled reward to reach over the steps since the evaluation before
    stop_when_reached: bool
    temperature: float = 1.0
    seed: int = 0  # the question draws and, with the step, every request's seed


SCHEDULES = {
    # CPU, two cores (CI): stops at the first evaluation that reaches both targets (measured:
    # at step 10 for the seeds 0, 1 and 2, in 120-196 s; docs/grpo-results.md)
    "short": Schedule(
        "short",
        max_steps=30,
        questions_per_step=4,
        group_size=8,
        lr=1e-4,
        eval_every=5,
        target=0.75,
        target_sampled=0.5,
        stop_when_reached=True,
    ),
    # GPU: a fixed run, four times the answers a step (8 questions x n=16, 128 sequences decoded
    # together), the targets those the CPU run held from step 15 to 30 of 30 (not yet run on the H200)
    "full": Schedule(
        "full",
        max_steps=40,
        questions_per_step=8,
        group_size=16,
        lr=1e-4,
        eval_every=5,
        target=0.8,
        target_sampled=0.85,
        stop_when_reached=False,
    ),
}


# --- talking to /v1 ------------------------------------------------------------------------------
class RequestFailed(RuntimeError):
    """One ``/v1`` request failed (an error answer or no answer): counted, the run goes on."""


class V1:
    """The ``/v1/completions`` calls of the trainer (plain HTTP, one session per thread)."""

    def __init__(self, base: str, timeout_s: float = 600.0) -> None:
        self.base = base
        self.timeout_s = timeout_s
        self._local = threading.local()

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def complete(self, prompt_ids: list[int], **params: Any) -> dict[str, Any]:
        """``POST /v1/completions`` with the prompt as token ids: ``{choices, usage,
        commits}`` (``commits``: of ``X-miLLM-Model``). Raises RequestFailed; SetupError when
        the server refuses ``n`` (it is older than ``n`` support, or its
        ``MAX_BATCH_SIZE`` is below the group size)."""
        try:
            r = self._session().post(
                f"{self.base}/v1/completions",
                timeout=self.timeout_s,
                json={"model": MODEL, "prompt": prompt_ids, **params},
            )
        except requests.RequestException as exc:
            raise RequestFailed(f"transport: {type(exc).__name__}") from exc
        if r.status_code == 400 and (params.get("n") or 1) > 1:
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                err = r.json()["error"]
                if err.get("param") == "n":
                    raise SetupError(
                        f"the server refuses n={params['n']}: {err.get('message')} (start it "
                        f"with MAX_BATCH_SIZE={params['n']} or more, or lower --group-size)"
                    )
        try:
            body = json_or_raise(r)
        except SetupError as exc:
            raise RequestFailed(str(exc)) from None
        _, _, commits = parse_served_by(r.headers.get("X-miLLM-Model"))
        return {**body, "commits": commits}


# --- the records of a run ------------------------------------------------------------------------
@dataclass
class Answer:
    """One sampled answer, as the trainer uses it."""

    text: str
    finish_reason: str | None
    reward: float
    ids: list[int] | None  # the completion's token ids (+ end-of-turn when it ended); None: unknown
    server_logprobs: list[float]  # of the completion's tokens, end-of-turn not reported
    advantage: float = 0.0


@dataclass
class Group:
    """The ``n`` answers to one question, from one request."""

    pair: tuple[int, int]
    prompt_ids: list[int]
    seed: int
    commits: int | None
    answers: list[Answer]


@dataclass
class StepRecord:
    """One training step: what was sampled, the loss, the commit. Times in seconds."""

    step: int
    reward: float  # mean over the step's sampled answers
    group_rewards: list[float]
    ended: float  # share of the answers that ended within MAX_TOKENS
    completion_tokens: float  # mean tokens of the answers' text (the end-of-turn not counted)
    served_commits: list[int | None]  # X-miLLM-Model commits of each group's answer
    in_loss: int  # answers with a nonzero advantage
    left_out: int  # answers whose token ids could not be recovered
    loss: float
    logprob_gap: float | None  # mean |trainer - server| log-probability a token
    sample_s: float
    grad_s: float
    hold_s: float  # quiesce sent -> resume answered
    commit_ms: float | None  # the server's
    overran: bool
    example: str


@dataclass
class EvalRecord:
    """The held-out questions asked greedily at one point of training."""

    step: int
    commits: list[int | None]
    correct: int
    total: int
    ended: int
    #: the mean sampled reward of the steps since the evaluation before (None before training)
    sampled: float | None = None
    answers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def score(self) -> float:
        return self.correct / self.total if self.total else 0.0

    def reached(self, schedule: Schedule) -> bool:
        """Both targets met: the held-out greedy score and the sampled reward."""
        return (
            self.score >= schedule.target
            and self.sampled is not None
            and self.sampled >= schedule.target_sampled
        )


# --- the run -------------------------------------------------------------------------------------
class Run:
    """One run: attach, evaluate, sample, score, step in place, repeat; report."""

    def __init__(
        self,
        base: str,
        token: str,
        schedule: Schedule,
        stop: StopRequest | None = None,
        unix_socket: str | None = None,
        running: str = "finish",
    ) -> None:
        self.base = base
        #: what each commit's quiesce does with running generations (contract 4b)
        self.running = running
        self.token = token
        self.unix_socket = unix_socket
        self.schedule = schedule
        self.v1 = V1(base)
        self.stop = stop or StopRequest()
        self.train_pairs, self.held_pairs = split_questions()
        self.rng = random.Random(schedule.seed)
        self.steps: list[StepRecord] = []
        self.evals: list[EvalRecord] = []
        self.failures: list[str] = []
        self.requests = 0
        self.notes: list[str] = []
        self.t0 = time.monotonic()
        self._prompts: dict[tuple[int, int], list[int]] = {}

    def prompt_ids(self, pair: tuple[int, int]) -> list[int]:
        """The chat-templated question with the generation prompt, as ``/v1/chat/completions``
        would build it (:func:`miserver.trainer.chat_example`)."""
        if pair not in self._prompts:
            from miserver.trainer import IGNORE_INDEX, chat_example

            ids, labels = chat_example(
                self.tokenizer, [{"role": "user", "content": question(*pair)}], "-"
            )
            self._prompts[pair] = ids[: labels.count(IGNORE_INDEX)]
        return self._prompts[pair]

    def _requests(self, calls: list[tuple[list[int], dict[str, Any]]]) -> list[dict | None]:
        """Send the requests concurrently (the server batches what waits, up to its
        ``MAX_BATCH_SIZE``); a failed one is None and recorded."""
        self.requests += len(calls)

        def one(call: tuple[list[int], dict[str, Any]]) -> dict | None:
            try:
                return self.v1.complete(call[0], **call[1])
            except RequestFailed as exc:
                self.failures.append(str(exc))
                return None

        with ThreadPoolExecutor(max_workers=min(16, len(calls))) as pool:
            return list(pool.map(one, calls))

    # --- evaluation -------------------------------------------------------------------------
    def evaluate(self, step: int) -> EvalRecord:
        """Ask every held-out question greedily and score the answers; record the sampled
        reward of the steps since the evaluation before with them."""
        bodies = self._requests(
            [
                (self.prompt_ids(p), {"max_tokens": MAX_TOKENS, "temperature": 0})
                for p in self.held_pairs
            ]
        )
        since = self.evals[-1].step if self.evals else 0
        window = [r.reward for r in self.steps if r.step > since]
        rec = EvalRecord(
            step=step,
            commits=[],
            correct=0,
            total=0,
            ended=0,
            sampled=statistics.fmean(window) if window else None,
        )
        for pair, body in zip(self.held_pairs, bodies, strict=True):
            if body is None:
                continue
            choice = body["choices"][0]
            r = reward(choice["text"], choice["finish_reason"], pair[0] * pair[1])
            rec.total += 1
            rec.correct += int(r)
            rec.ended += choice["finish_reason"] == "stop"
            rec.commits.append(body["commits"])
            rec.answers.append({"question": question(*pair), "answer": choice["text"], "reward": r})
        if rec.total == 0:
            raise SetupError(f"every evaluation request at step {step} failed: {self.failures[-1]}")
        rec.total = len(self.held_pairs)  # a failed question counts as not answered
        self.evals.append(rec)
        return rec

    # --- sampling -----------------------------------------------------------------------------
    def sample(self, step: int) -> list[Group]:
        """The step's questions, each asked ``group_size`` times in one request (``n``), the
        request's seed ``seed * 10**6 + 1000 * step + j`` for the step's ``j``-th question (the
        server derives each choice's seed from it)."""
        s = self.schedule
        pairs = self.rng.sample(self.train_pairs, s.questions_per_step)
        seeds = [s.seed * 1_000_000 + 1000 * step + j for j in range(len(pairs))]
        bodies = self._requests(
            [
                (
                    self.prompt_ids(p),
                    {
                        "n": s.group_size,
                        "max_tokens": MAX_TOKENS,
                        "temperature": s.temperature,
                        "seed": seed,
                        "logprobs": 0,
                    },
                )
                for p, seed in zip(pairs, seeds, strict=True)
            ]
        )
        groups = []
        for pair, seed, body in zip(pairs, seeds, bodies, strict=True):
            if body is None:
                continue
            choices = sorted(body["choices"], key=lambda c: c["index"])
            if len(choices) != s.group_size:
                self.failures.append(
                    f"asked for n={s.group_size} answers, got {len(choices)} choices"
                )
                continue
            answers = [self._answer(c, pair[0] * pair[1]) for c in choices]
            for a, adv in zip(answers, group_advantages([a.reward for a in answers]), strict=True):
                a.advantage = adv
            groups.append(Group(pair, self.prompt_ids(pair), seed, body["commits"], answers))
        if not groups:
            raise SetupError(f"every sampling request of step {step} failed: {self.failures[-1]}")
        return groups

    def _answer(self, choice: dict[str, Any], product: int) -> Answer:
        lp = choice.get("logprobs") or {}
        tokens = lp.get("tokens") or []
        ids = completion_ids(self.tokenizer, choice["text"], tokens)
        if ids is not None and choice["finish_reason"] == "stop":
            ids = ids + [self.tokenizer.eos_token_id]  # the model learns to stop too
        return Answer(
            text=choice["text"],
            finish_reason=choice["finish_reason"],
            reward=reward(choice["text"], choice["finish_reason"], product),
            ids=ids,
            server_logprobs=list(lp.get("token_logprobs") or []),
        )

    # --- the gradient ---------------------------------------------------------------------------
    def gradients(self, model: Any, groups: list[Group]) -> tuple[float, int, float | None]:
        """Backward of ``-(sum over answers of advantage * log p(answer | question)) / answers``
        on the trainer's graph (reads the served weights, writes only gradients here), the
        gradient's norm then clipped to :data:`CLIP_NORM`. An answer with advantage 0 adds
        nothing and is left out; so is one whose token ids are unknown.

        Returns (the loss, the answers in it, the mean |trainer - server| log-probability per
        token of those answers: the two computed on the same weights, so it is only the
        numerics of the trainer's forward against the server's decode)."""
        import torch

        total = sum(len(g.answers) for g in groups)
        loss_sum, in_loss = 0.0, 0
        gaps: list[float] = []
        for g in groups:
            rows = [a for a in g.answers if a.advantage and a.ids]
            if not rows:
                continue
            per_answer = answer_logprobs(
                model, g.prompt_ids, [a.ids for a in rows], self.tokenizer.pad_token_id or 0
            )
            adv = torch.tensor([a.advantage for a in rows], device=per_answer[0].device)
            loss = -(adv * torch.stack([lp.sum() for lp in per_answer])).sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
            in_loss += len(rows)
            for a, lp in zip(rows, per_answer, strict=True):
                served = a.server_logprobs[: len(a.ids)]  # the end-of-turn token is not reported
                mine = lp[: len(served)].detach().float().cpu().tolist()
                gaps.extend(abs(x - y) for x, y in zip(mine, served, strict=True))
        if in_loss:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        return loss_sum, in_loss, (statistics.fmean(gaps) if gaps else None)

    # --- the loop -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        import torch
        from tqdm import tqdm

        from miserver.trainer import WeightsClient, init_optimizer_state

        s = self.schedule
        with WeightsClient(
            self.base, self.token, unix_socket=self.unix_socket, running=self.running
        ) as client:
            att = client.attach()
            check_attachment(att, self.notes, "this example trains")
            self.tokenizer = client.tokenizer()
            model = att.build_model()
            model.train()
            device = next(model.parameters()).device
            print(
                f"attached: {MODEL} on {device}, "
                f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters bound to "
                f"the served storages; {s.questions_per_step} questions x n={s.group_size} a step",
                flush=True,
            )
            before = self.evaluate(step=0)
            print(
                f"untrained: held-out greedy {before.correct}/{before.total} (targets: "
                f"held-out {s.target:.2f}, sampled {s.target_sampled:.2f}), e.g. "
                f"{before.answers[0]['question']!r} -> {before.answers[0]['answer']!r}",
                flush=True,
            )
            opt = torch.optim.AdamW(
                model.parameters(), lr=s.lr, weight_decay=0.0, **fused_if_supported(device)
            )
            init_optimizer_state(opt)  # made inside the first commit it could overrun the watchdog
            with tqdm(
                total=s.max_steps, desc="grpo", unit="step", mininterval=1.0, file=sys.stderr
            ) as bar:
                for step in range(1, s.max_steps + 1):
                    if self.stop.requested:
                        break
                    if self._step(step, model, opt, client, bar):
                        break
            if not self.steps:
                if self.stop.requested:
                    raise KeyboardInterrupt
                raise SetupError("no training step ran")
            if self.evals[-1].step != self.steps[-1].step:
                self.evaluate(self.steps[-1].step)
        return self.report()

    def _step(self, step: int, model: Any, opt: Any, client: Any, bar: Any) -> bool:
        """Sample, score, gradients (outside the bracket), the optimizer step inside it, an
        evaluation every ``eval_every`` steps. Returns True when the run should stop."""
        from tqdm import tqdm

        s = self.schedule
        t = time.monotonic()
        groups = self.sample(step)
        sampled = time.monotonic()
        loss, in_loss, gap = self.gradients(model, groups)
        graded = time.monotonic()
        with client.commit() as cycle:  # POST /quiesce (running: finish|hold), /commit-begin
            opt.step()  # the write: in place, into the served tensors
        held = time.monotonic() - graded  # POST /commit-end and POST /resume answered
        opt.zero_grad(set_to_none=True)
        answers = [a for g in groups for a in g.answers]
        end = cycle.end or {}
        rec = StepRecord(
            step=step,
            reward=statistics.fmean(a.reward for a in answers),
            group_rewards=[statistics.fmean(a.reward for a in g.answers) for g in groups],
            ended=statistics.fmean(a.finish_reason == "stop" for a in answers),
            completion_tokens=statistics.fmean(len(a.server_logprobs) for a in answers),
            served_commits=[g.commits for g in groups],
            in_loss=in_loss,
            left_out=sum(a.ids is None for a in answers),
            loss=loss,
            logprob_gap=gap,
            sample_s=sampled - t,
            grad_s=graded - sampled,
            hold_s=held,
            commit_ms=end.get("commit_ms"),
            overran=bool(end.get("overran")),
            example=f"{question(*groups[0].pair)} -> {groups[0].answers[0].text!r}",
        )
        self.steps.append(rec)
        postfix = {"reward": f"{rec.reward:.2f}", "commit_ms": rec.commit_ms}
        reached = False
        if step % s.eval_every == 0 or step == s.max_steps:
            ev = self.evaluate(step)
            reached = ev.reached(s)
            postfix["held_out"] = f"{ev.correct}/{ev.total}"
            tqdm.write(
                f"step {step:3d}: sampled reward {ev.sampled:.2f} (since the last evaluation), "
                f"held-out greedy {ev.correct}/{ev.total} (commits={ev.commits[0]}), e.g. "
                f"{ev.answers[0]['answer']!r}",
                file=sys.stderr,
            )
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)
        return s.stop_when_reached and reached

    # --- the report ---------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        s = self.schedule
        first, last = self.evals[0], self.evals[-1]
        reached = next((e.step for e in self.evals if e.reached(s)), None)
        off_policy = sum(
            c != r.step - 1 for r in self.steps for c in r.served_commits
        )  # a group not sampled from the weights the gradient was computed on
        evals_off = sum(c != e.step for e in self.evals for c in e.commits)
        gaps = [r.logprob_gap for r in self.steps if r.logprob_gap is not None]
        commit_ms = [r.commit_ms for r in self.steps if r.commit_ms is not None]
        if any(r.overran for r in self.steps):
            self.notes.append(
                "a commit took longer than the server's WEIGHTS_COMMIT_WATCHDOG_MS: raise the "
                "watchdog on the server (docs/trainer-guide.md, 'The watchdog')"
            )
        if off_policy or evals_off:
            self.notes.append(
                f"{off_policy} group(s) and {evals_off} evaluation answer(s) came from another "
                "parameter set than the step's (another writer?)"
            )
        summary = {
            "schedule": s.name,
            "task": "single-digit multiplication: 'What is a x b?', a and b in 2..9",
            "reward_rule": f"1 when the answer ends within {MAX_TOKENS} tokens and its last "
            "number is the product, else 0",
            "held_out": len(self.held_pairs),
            "target": s.target,
            "target_sampled": s.target_sampled,
            "steps": len(self.steps),
            "commits": sum(r.commit_ms is not None for r in self.steps),
            "untrained_held_out": first.score,
            "final_held_out": last.score,
            "best_held_out": max(e.score for e in self.evals),
            "reached_target_at_step": reached,
            "untrained_sampled_reward": self.steps[0].reward,
            "final_sampled_reward": last.sampled,
            "answers_sampled": sum(len(r.group_rewards) for r in self.steps) * s.group_size,
            "answers_left_out": sum(r.left_out for r in self.steps),
            "groups_off_policy": off_policy,
            "eval_answers_off": evals_off,
            "requests": self.requests,
            "requests_failed": len(self.failures),
            "failures": sorted(set(self.failures)),
            "logprob_gap_mean": statistics.fmean(gaps) if gaps else None,
            "logprob_gap_max": max(gaps) if gaps else None,
            "commit_ms_p50": percentile(commit_ms, 50),
            "commit_ms_max": max(commit_ms) if commit_ms else None,
            "commits_overran": sum(r.overran for r in self.steps),
            "sample_s_p50": percentile([r.sample_s for r in self.steps], 50),
            "grad_s_p50": percentile([r.grad_s for r in self.steps], 50),
            "hold_s_p50": percentile([r.hold_s for r in self.steps], 50),
            "running": self.running,
            "step_s_p50": percentile([r.sample_s + r.grad_s + r.hold_s for r in self.steps], 50),
            "wall_s": time.monotonic() - self.t0,
            "interrupted": self.stop.requested,
            "notes": self.notes,
        }
        summary["passed"] = bool(
            last.reached(s) and summary["requests_failed"] == 0 and not summary["interrupted"]
        )
        return {
            "summary": summary,
            "schedule": asdict(s),
            "held_out_questions": [question(*p) for p in self.held_pairs],
            "steps": [asdict(r) for r in self.steps],
            "evals": [{**asdict(e), "score": e.score} for e in self.evals],
        }


# --- output ----------------------------------------------------------------------------------------
def results_table(results: dict[str, Any]) -> str:
    """The per-evaluation table and the summary, as plain text."""
    s = results["summary"]
    rows = [
        f"{'step':>5} {'commits':>7} {'held-out':>9} {'sampled':>8} {'ended':>6}  example answer",
        f"{'-' * 5} {'-' * 7} {'-' * 9} {'-' * 8} {'-' * 6}  {'-' * 36}",
    ]
    for e in results["evals"]:
        sampled = "-" if e["sampled"] is None else f"{e['sampled']:.2f}"
        commits = e["commits"][0] if e["commits"] else "-"
        example = e["answers"][0]["answer"] if e["answers"] else ""
        rows.append(
            f"{e['step']:>5} {commits!s:>7} {e['correct']:>4}/{e['total']:<4} {sampled:>8} "
            f"{e['ended']:>3}/{e['total']:<2}  {example[:36]!r}"
        )

    summary = [
        ("task", s["task"]),
        ("reward", s["reward_rule"]),
        ("training steps (commits)", f"{s['steps']} ({s['commits']})"),
        (
            "held-out greedy score, untrained -> final (target)",
            f"{s['untrained_held_out']:.2f} -> {s['final_held_out']:.2f} ({s['target']:.2f})",
        ),
        (
            "sampled reward, first step -> last evaluation's steps (target)",
            f"{s['untrained_sampled_reward']:.2f} -> {fmt(s['final_sampled_reward'], digits=2)} "
            f"({s['target_sampled']:.2f})",
        ),
        ("both targets reached at step", fmt(s["reached_target_at_step"])),
        (
            "answers sampled (left out: token ids unknown)",
            f"{s['answers_sampled']} ({s['answers_left_out']})",
        ),
        ("groups not from the step's weights", fmt(s["groups_off_policy"])),
        ("requests (failed)", f"{s['requests']} ({s['requests_failed']})"),
        (
            "|trainer - server| log-prob a token, mean / max",
            f"{fmt(s['logprob_gap_mean'], digits=4)} / {fmt(s['logprob_gap_max'], digits=4)}",
        ),
        (
            "per step p50: sampling / gradients / commit (held)",
            f"{fmt(s['sample_s_p50'], ' s', 2)} / {fmt(s['grad_s_p50'], ' s', 2)} / "
            f"{fmt(s['hold_s_p50'], ' s', 2)}",
        ),
        (
            "commit (server) p50 / max",
            f"{fmt(s['commit_ms_p50'], ' ms', 1)} / {fmt(s['commit_ms_max'], ' ms', 1)}",
        ),
        ("commits that overran the watchdog", fmt(s["commits_overran"])),
        (
            f"step time p50 (quiesce running={s.get('running', 'finish')})",
            fmt(s.get("step_s_p50"), " s", 2),
        ),
        ("wall time", fmt(s["wall_s"], " s", 1)),
        ("result", "PASS" if s["passed"] else "FAIL"),
    ]
    return table_text(rows, summary)


def plot(results: dict[str, Any], path: Path) -> None:
    """The rewards against the step (top), the answers' length and ending (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["summary"]
    steps = results["steps"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), constrained_layout=True)
    xs = [r["step"] for r in steps]
    for r in steps:
        top.plot([r["step"]] * len(r["group_rewards"]), r["group_rewards"], ".", color="0.75", ms=4)
    top.plot([], [], ".", color="0.75", label="one group's mean reward (sampled, n answers)")
    top.plot(xs, [r["reward"] for r in steps], "-", color="tab:blue", label="sampled reward")
    top.plot(
        [e["step"] for e in results["evals"]],
        [e["score"] for e in results["evals"]],
        "o-",
        color="tab:orange",
        markersize=8,
        label=f"held-out greedy score ({s['held_out']} questions)",
    )
    top.axhline(
        s["target"], ls="--", color="tab:orange", lw=1, label=f"held-out target {s['target']:.2f}"
    )
    top.axhline(
        s["target_sampled"],
        ls=":",
        color="tab:blue",
        lw=1,
        label=f"sampled target {s['target_sampled']:.2f} (mean since the evaluation before)",
    )
    top.set_ylim(-0.05, 1.05)
    top.xaxis.get_major_locator().set_params(integer=True)
    top.set_xlabel("training step (commits)")
    top.set_ylabel("reward")
    final_sampled = s["final_sampled_reward"]
    top.set_title(
        f"GRPO in place, the served reward ({s['schedule']} schedule): held-out greedy "
        f"{s['untrained_held_out']:.2f} -> {s['final_held_out']:.2f}, sampled "
        f"{s['untrained_sampled_reward']:.2f} -> "
        + ("-" if final_sampled is None else f"{final_sampled:.2f}")
    )
    top.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize="small")

    bottom.plot(
        xs,
        [r["completion_tokens"] for r in steps],
        "s-",
        color="tab:purple",
        markersize=4,
        label="answer length (tokens, mean)",
    )
    bottom.set_xlabel("training step (commits)")
    bottom.set_ylabel("tokens", color="tab:purple")
    bottom.xaxis.get_major_locator().set_params(integer=True)
    share = bottom.twinx()
    share.plot(
        xs,
        [r["ended"] for r in steps],
        "^-",
        color="tab:red",
        markersize=4,
        label=f"answers that ended within {MAX_TOKENS} tokens",
    )
    share.set_ylim(-0.05, 1.05)
    share.set_ylabel("share", color="tab:red")
    lines = bottom.get_legend_handles_labels()
    extra = share.get_legend_handles_labels()
    bottom.legend(
        lines[0] + extra[0],
        lines[1] + extra[1],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.14),
        ncol=2,
        fontsize="small",
    )
    bottom.set_title("The sampled answers")
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the command line -------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = example_parser(__doc__, DEFAULT_OUT, SCHEDULES, "CPU, stops at the targets")
    p.add_argument("--group-size", type=int, help="override the schedule's n (2 or more)")
    p.add_argument("--lr", type=float, help="override the schedule's AdamW learning rate")
    p.add_argument(
        "--seed",
        type=int,
        help="override the schedule's seed (the questions drawn and every request's seed)",
    )
    p.add_argument(
        "--running",
        choices=("finish", "hold"),
        default="finish",
        help="what each commit's quiesce does with running generations (contract 4b): finish "
        "them first (default) or hold them (parked at the next decode step, continued on the "
        "new weights); the summary shows the step time with it",
    )
    p.add_argument(
        "--no-early-stop",
        action="store_true",
        help="run every step of the schedule (the short one stops when both targets are met)",
    )
    args = p.parse_args(argv)
    check_server_args(p, args)
    if args.max_steps is not None and args.max_steps < 1:
        p.error(f"--max-steps {args.max_steps}: at least 1")
    if args.group_size is not None and args.group_size < 2:
        p.error(f"--group-size {args.group_size}: at least 2 (a group of one has no advantage)")
    if args.lr is not None and not args.lr > 0:
        p.error(f"--lr {args.lr}: must be positive")
    return args


def server_settings(schedule: Schedule) -> dict[str, str]:
    """The settings of the server the example starts: ``MAX_BATCH_SIZE`` the answers of a
    step (``n`` may be up to it), so the step's concurrent requests decode together (measured
    before the continuous engine, on two cores: 4 groups of 8 in 6.1-6.5 s at 32, 8.1-9.7 s at
    8, one group a pass)."""
    return {"MAX_BATCH_SIZE": str(schedule.questions_per_step * schedule.group_size)}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = out_dir(args.out, DEFAULT_OUT)
    device = resolve_device(args.device)
    schedule = SCHEDULES[args.schedule or ("full" if device.startswith("cuda") else "short")]
    overrides = {
        "max_steps": args.max_steps,
        "group_size": args.group_size,
        "lr": args.lr,
        "seed": args.seed,
        "stop_when_reached": False if args.no_early_stop else None,
    }
    schedule = Schedule(
        **{**asdict(schedule), **{k: v for k, v in overrides.items() if v is not None}}
    )

    def train(stop: StopRequest) -> dict[str, Any]:
        with contextlib.ExitStack() as stack:
            conn = connect(stack, args, out, device, stop, server_settings(schedule))
            return Run(
                conn.base, conn.token, schedule, stop, conn.unix_socket, running=args.running
            ).run()

    return run_example("grpo_in_place", out, device, train, plot, results_table)


if __name__ == "__main__":
    sys.exit(main())
