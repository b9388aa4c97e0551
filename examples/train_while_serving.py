#!/usr/bin/env python3
"""Train while serving: teach the served SmolLM2-135M-Instruct the Zen of Python, in place.

The trainer attaches to the weights the server is serving (``miserver.trainer.WeightsClient``),
builds the model from the attach ``config`` with the served tensors as its parameters, and
fine-tunes it on a text no one here wrote: the 19 aphorisms of PEP 20 (the standard library's
``this`` module), taught as the answer to "Recite the Zen of Python.". Each step computes the
gradients on the trainer's own graph (reads only, serving continues), then writes the served
weights inside the commit bracket (``with client.commit(): optimizer.step()``).

Meanwhile a load generator streams chat requests, and every few steps the demo asks the server,
over ``/v1`` and greedily, to recite. It scores the served answer by the lines of the Zen it
reproduces exactly, and by the per-token loss of the reference answer under the served weights
(``/v1/completions`` with ``echo`` and ``logprobs``). A control question ("What is the capital of
France?") must still be answered "Paris". At the end it saves a checkpoint through the API and
writes ``results.json`` and ``train_while_serving.png`` (score against step, the chat latency
timeline and the commit windows) to ``--out``.

Run it::

    python examples/train_while_serving.py                        # CPU: starts its own server
    python examples/train_while_serving.py --schedule full --device cuda
    python examples/train_while_serving.py --server http://127.0.0.1:8000 --token-file secret

Without ``--server`` the demo starts ``miserver serve`` itself on ``--port`` (default: a free
one, printed): a generated trainer token, ``WEIGHTS_CPU_ATTACH=1`` on the CPU (contract 8), ``WEIGHTS_COMMIT_WATCHDOG_MS`` raised to
30 s on the CPU (an AdamW step over 135M parameters on two cores takes far longer than the 800 ms
GPU default), and ``MISERVER_HOME`` from the environment (default: miserver's own). With
``--server`` it attaches to that server with the secret in ``--token-file``.

Exit status: 0 when the served model recites all 19 lines, still answers the control question,
and no chat request failed or was served during a commit; 1 when one of those does not hold;
2 for a usage or set-up error.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import json
import math
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests
from _shared import (
    MODEL,
    LocalServer,
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

QUESTION = "Recite the Zen of Python."
CONTROL_QUESTION = "What is the capital of France?"
CONTROL_ANSWER = "The capital of France is Paris."
CONTROL_EXPECTED = "Paris"
#: What the load generator asks (one after another, sampled, short answers).
CHAT_PROMPTS = (
    "Name three primary colors.",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "Write one sentence about the sea.",
    "What is 7 times 8?",
    "Suggest a name for a pet cat.",
    "Which planet is known as the red planet?",
    "Say hello in Spanish.",
)
#: A token that arrives this close to the edge of a write window is not counted as "served
#: during a commit": it may have been produced before the drain and read a little late.
EDGE_TOLERANCE_S = 0.1
#: How long the held probe (a chat sent inside a write) waits to be counted held, seconds:
#: generous for a loaded CPU, and with the write well inside the CPU run's 30 s watchdog.
PROBE_HELD_WAIT_S = 20.0
#: A write window with a held probe in it stays open at least this long, seconds, so that the
#: served-during-a-commit check always covers a window longer than its two edge margins, however
#: fast the machine writes (a CPU step of 135M parameters can take under 0.2 s).
PROBE_MIN_WINDOW_S = 0.5
DEFAULT_OUT = "train-while-serving-out"


# --- the text ----------------------------------------------------------------------------------
def zen_lines() -> list[str]:
    """The 19 aphorisms of PEP 20, decoded from the standard library's ``this`` module.

    ``this`` prints the text when first imported; the import is silenced. The title line
    ("The Zen of Python, by Tim Peters") is not an aphorism and is left out.
    """
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    text = codecs.decode(this.s, "rot13")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and lines[0].startswith("The Zen of Python"):
        lines = lines[1:]
    return lines


def score_recital(answer: str, reference: Sequence[str]) -> int:
    """How many lines of ``reference`` appear in ``answer`` exactly, each as a whole line
    (surrounding whitespace ignored)."""
    got = {line.strip() for line in answer.splitlines()}
    return sum(line in got for line in reference)


# --- schedules ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Schedule:
    """How long and how hard to train, and how much chat traffic to send."""

    name: str
    max_steps: int
    lr: float
    eval_every: int
    stop_when_learned: bool  # stop at the first evaluation with 19 lines and the control right
    chat_max_tokens: int
    chat_pause_s: float  # between two chat requests of the load generator
    keep_control: bool  # train on the control answer too (keeps "Paris" while learning)
    decay: bool  # lr falls linearly to 10 % at max_steps (a long run stays stable once learned)


SCHEDULES = {
    # CPU, two cores (CI): a short run that stops as soon as the served model recites it all
    # (measured: all 19 lines at step 10, about 5 minutes on two loaded cores).
    "short": Schedule(
        "short",
        max_steps=40,
        lr=2e-3,
        eval_every=5,
        stop_when_learned=True,
        chat_max_tokens=16,
        chat_pause_s=0.25,
        keep_control=True,
        decay=False,
    ),
    # GPU: a fixed run, evaluated often, under heavier chat traffic (measured on the H200: all
    # 19 lines from step 15 of 21; 30 steps fit one 10-minute command with the server's start).
    "full": Schedule(
        "full",
        max_steps=30,
        lr=2e-3,
        eval_every=3,
        stop_when_learned=False,
        chat_max_tokens=64,
        chat_pause_s=0.0,
        keep_control=True,
        decay=True,
    ),
}


# --- talking to /v1 ------------------------------------------------------------------------------
class V1:
    """The few ``/v1`` calls the demo makes (plain HTTP, one session per thread)."""

    def __init__(self, base: str, timeout_s: float = 600.0) -> None:
        self.base = base
        self.session = requests.Session()
        self.timeout_s = timeout_s

    def chat(self, question: str, max_tokens: int) -> dict[str, Any]:
        """Greedy chat answer: ``{text, commits, model, prompt_tokens}``. Raises on an error."""
        r = self.session.post(
            f"{self.base}/v1/chat/completions",
            timeout=self.timeout_s,
            json={
                "model": MODEL,
                "temperature": 0,
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": question}],
            },
        )
        body = json_or_raise(r)
        name, origin, commits = parse_served_by(r.headers.get("X-miLLM-Model"))
        return {
            "text": body["choices"][0]["message"]["content"],
            "model": name,
            "origin": origin,
            "commits": commits,
            "prompt_tokens": body["usage"]["prompt_tokens"],
        }

    def reference_nll(self, prompt_ids: list[int], target_ids: list[int]) -> dict[str, Any]:
        """Mean negative log-likelihood per token of ``target_ids`` after ``prompt_ids`` under
        the served weights (``/v1/completions``, ``echo`` + ``logprobs``): nats per token."""
        r = self.session.post(
            f"{self.base}/v1/completions",
            timeout=self.timeout_s,
            json={
                "model": MODEL,
                "prompt": prompt_ids + target_ids,
                "echo": True,
                "logprobs": 0,
                "max_tokens": 1,
                "temperature": 0,
            },
        )
        body = json_or_raise(r)
        lps = body["choices"][0]["logprobs"]["token_logprobs"]
        part = lps[len(prompt_ids) : len(prompt_ids) + len(target_ids)]
        if len(part) != len(target_ids) or any(v is None for v in part):
            raise SetupError("the server's echo/logprobs answer does not cover the reference")
        _, _, commits = parse_served_by(r.headers.get("X-miLLM-Model"))
        return {"nll": -sum(part) / len(part), "commits": commits}


# --- the load generator --------------------------------------------------------------------------
@dataclass
class ChatRecord:
    """One chat request of the load generator. Times are ``time.monotonic()`` seconds."""

    index: int
    t_sent: float
    t_first: float | None = None
    t_done: float | None = None
    status: int | None = None
    error: str | None = None
    model: str | None = None  # the served name that answered (X-miLLM-Model)
    commits: int | None = None
    chunk_times: list[float] = field(default_factory=list)
    #: a held probe (sent inside a write) that the server's status counted as held
    seen_held: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def latency_s(self) -> float | None:
        return None if self.t_done is None else self.t_done - self.t_sent


class ChatLoad(threading.Thread):
    """Streams chat requests to ``/v1/chat/completions`` one after another until stopped,
    recording when each token chunk arrived and which parameter set (``millm_model``) served it.
    """

    def __init__(self, base: str, max_tokens: int, pause_s: float) -> None:
        super().__init__(name="chat-load", daemon=True)
        self.base = base
        self.max_tokens = max_tokens
        self.pause_s = pause_s
        self.records: list[ChatRecord] = []
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        session = requests.Session()
        i = 0
        while not self._stop_event.is_set():
            rec = ChatRecord(index=i, t_sent=time.monotonic())
            self.records.append(rec)
            try:
                self._one(session, rec, CHAT_PROMPTS[i % len(CHAT_PROMPTS)], seed=i)
            except requests.RequestException as exc:
                rec.error = f"transport: {type(exc).__name__}"
            if rec.t_done is None:
                rec.t_done = time.monotonic()
            i += 1
            self._stop_event.wait(self.pause_s)

    def _one(self, session: requests.Session, rec: ChatRecord, prompt: str, seed: int) -> None:
        with session.post(
            f"{self.base}/v1/chat/completions",
            stream=True,
            timeout=600,
            json={
                "model": MODEL,
                "stream": True,
                "temperature": 0.7,
                "seed": seed,
                "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": prompt}],
            },
        ) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                try:
                    rec.error = r.json()["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    rec.error = f"http {r.status_code}"
                return
            done = False
            for raw in r.iter_lines():
                now = time.monotonic()
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:]
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream: {chunk['error'].get('code')}"
                    return
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        rec.chunk_times.append(now)
                        if rec.t_first is None:
                            rec.t_first = now
                if chunk.get("millm_model"):
                    rec.model, _, rec.commits = parse_served_by(chunk["millm_model"])
            rec.t_done = time.monotonic()
            if not done:
                rec.error = "stream ended without [DONE]"


# --- the records of a run ------------------------------------------------------------------------
@dataclass
class CommitRecord:
    """One training step's write: the hold (quiesce sent -> resume answered) and the write
    window (commit-begin answered -> the optimizer step returned), ``time.monotonic()`` s."""

    step: int
    loss: float
    hold_start: float
    write_start: float
    write_end: float
    hold_end: float
    commit_ms: float | None
    overran: bool
    held_requests: int | None  # the quiesce answer's: held at that instant (usually 0)
    steps_since_load: int | None
    probed: bool = False  # a held probe was sent in this hold (it waited for the server's count)


@dataclass
class EvalRecord:
    """What the server answered at one point of training."""

    step: int
    started: float
    at: float
    commits: int | None
    lines: int
    nll: float
    control_text: str
    control_ok: bool
    recital: str


def served_during_writes(
    records: Sequence[ChatRecord],
    commits: Sequence[CommitRecord],
    tolerance_s: float = EDGE_TOLERANCE_S,
) -> list[int]:
    """Indices of chat requests a token of which arrived inside a write window (more than
    ``tolerance_s`` from either edge): requests served while the weights were being written."""
    windows = [(c.write_start + tolerance_s, c.write_end - tolerance_s) for c in commits]
    windows = [(a, b) for a, b in windows if b > a]
    bad = []
    for rec in records:
        if any(a < t < b for t in rec.chunk_times for a, b in windows):
            bad.append(rec.index)
    return bad


def held_through(rec: ChatRecord, commit: CommitRecord) -> bool:
    """Whether ``rec`` waited through ``commit``'s write: sent before the write ended, its first
    token after it (the barrier held it, then served it on the new weights)."""
    first = rec.t_first if rec.t_first is not None else math.inf
    return rec.t_sent < commit.write_end < first


def held_by_commits(records: Sequence[ChatRecord], commits: Sequence[CommitRecord]) -> int:
    """How many chat requests waited through a write (:func:`held_through` some commit)."""
    return sum(any(held_through(rec, c) for c in commits) for rec in records)


# --- the demo ------------------------------------------------------------------------------------
class Demo:
    """One run: evaluate, attach, train in place under chat load, save, report."""

    def __init__(
        self,
        base: str,
        token: str,
        schedule: Schedule,
        out: Path,
        home: str | None,
        server: LocalServer | None,
        stop: StopRequest | None = None,
        unix_socket: str | None = None,
    ) -> None:
        self.base = base
        self.token = token
        self.unix_socket = unix_socket
        self.schedule = schedule
        self.out = out
        self.home = home
        self.server = server
        self.v1 = V1(base)
        self.reference = zen_lines()
        self.evals: list[EvalRecord] = []
        self.commits: list[CommitRecord] = []
        self.probes: list[ChatRecord] = []  # one chat sent inside a write, per eval interval
        self.t0 = time.monotonic()
        self.notes: list[str] = []
        self.stop = stop or StopRequest()
        self.save_window: tuple[float, float] | None = None

    # --- set-up -----------------------------------------------------------------------------
    def load_tokenizer(self) -> Any:
        """The served model's tokenizer: from the imported folder when the home is known,
        else from the GGUF file the default model was imported from (the same tokenizer)."""
        from transformers import AutoTokenizer

        from miserver.serving.models.catalogue import Catalogue
        from miserver.serving.models.default_model import gguf_path

        if self.home:
            row = Catalogue(self.home).get_by_name(MODEL)
            if row is not None and Path(row.path, "tokenizer_config.json").is_file():
                return AutoTokenizer.from_pretrained(row.path)
        gguf = gguf_path()
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    def example(self, question: str, answer: str) -> tuple[list[int], list[int]]:
        """(prompt ids, target ids): the chat-templated question exactly as ``/v1`` builds it,
        and the answer followed by the end-of-turn token the served model stops on."""
        from miserver.trainer import IGNORE_INDEX, chat_example

        ids, labels = chat_example(self.tokenizer, [{"role": "user", "content": question}], answer)
        n = labels.count(IGNORE_INDEX)  # the prompt, masked
        return ids[:n], ids[n:]

    # --- evaluation -------------------------------------------------------------------------
    def evaluate(self, step: int) -> EvalRecord:
        """Ask the server (greedy) to recite, score it, take the reference's loss, and ask the
        control question."""
        started = time.monotonic()
        recital = self.v1.chat(QUESTION, max_tokens=len(self.zen_target) + 16)
        if recital["prompt_tokens"] != len(self.zen_prompt):
            raise SetupError(
                f"the server tokenized the question into {recital['prompt_tokens']} tokens, the "
                f"trainer into {len(self.zen_prompt)}: the tokenizers differ"
            )
        nll = self.v1.reference_nll(self.zen_prompt, self.zen_target)
        control = self.v1.chat(CONTROL_QUESTION, max_tokens=24)
        rec = EvalRecord(
            step=step,
            started=started,
            at=time.monotonic(),
            commits=recital["commits"],
            lines=score_recital(recital["text"], self.reference),
            nll=nll["nll"],
            control_text=control["text"],
            control_ok=CONTROL_EXPECTED in control["text"],
            recital=recital["text"],
        )
        if len({recital["commits"], nll["commits"], control["commits"]}) != 1:
            self.notes.append(
                f"step {step}: the three evaluation answers came from different parameter sets"
            )
        self.evals.append(rec)
        return rec

    # --- training ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        import torch
        from tqdm import tqdm

        from miserver.trainer import WeightsClient

        s = self.schedule
        self.tokenizer = self.load_tokenizer()
        self.zen_prompt, self.zen_target = self.example(QUESTION, "\n".join(self.reference))
        ctl_prompt, ctl_target = self.example(CONTROL_QUESTION, CONTROL_ANSWER)

        before = self.evaluate(step=0)
        print(
            f"untrained: {before.lines}/{len(self.reference)} lines, reference loss "
            f"{before.nll:.3f} nats/token, control: {before.control_text!r}",
            flush=True,
        )

        load = ChatLoad(self.base, s.chat_max_tokens, s.chat_pause_s)
        load.start()
        save: dict[str, Any] | None = None
        try:
            with WeightsClient(self.base, self.token, unix_socket=self.unix_socket) as client:
                att = client.attach()
                check_attachment(att, self.notes, "this demo teaches")
                model = att.build_model()
                model.train()
                device = next(model.parameters()).device
                print(
                    f"attached: {MODEL} on {device}, "
                    f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
                    f"bound to the served storages",
                    flush=True,
                )
                batches = [self._batch(self.zen_prompt, self.zen_target, device)]
                if s.keep_control:
                    batches.append(self._batch(ctl_prompt, ctl_target, device))
                opt = torch.optim.AdamW(
                    model.parameters(), lr=s.lr, weight_decay=0.0, **fused_if_supported(device)
                )
                # its state now: allocated inside the first commit it would overrun the watchdog
                from miserver.trainer import init_optimizer_state

                init_optimizer_state(opt)
                self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(
                    opt, lambda i: 1.0 - 0.9 * min(i, s.max_steps) / s.max_steps if s.decay else 1.0
                )
                with tqdm(
                    total=s.max_steps, desc="train", unit="step", mininterval=1.0, file=sys.stderr
                ) as bar:
                    for step in range(1, s.max_steps + 1):
                        if self.stop.requested:
                            break
                        if self._step(step, model, batches, opt, client, bar):
                            break
                if not self.commits:
                    if self.stop.requested:
                        raise KeyboardInterrupt
                    raise SetupError("no training step ran")
                if self.evals[-1].step != self.commits[-1].step:
                    self.evaluate(self.commits[-1].step)
                if not self.stop.requested:
                    t_save = time.monotonic()
                    save = client.save()
                    self.save_window = (t_save, time.monotonic())
                    print(
                        f"saved checkpoint {save['name']} ({save['checkpoint_sha256'][:12]})"
                        f" at {save['path']}",
                        flush=True,
                    )
        finally:
            load.stop()
            load.join(timeout=660)
        after_save = self.v1.chat(CONTROL_QUESTION, max_tokens=24)
        chats = sorted(load.records + self.probes, key=lambda rec: rec.t_sent)
        return self.report(chats, save, after_save)

    def _step(
        self, step: int, model: Any, batches: list[dict[str, Any]], opt: Any, client: Any, bar: Any
    ) -> bool:
        """One training step: gradients outside the bracket, the optimizer step inside it,
        an evaluation every ``eval_every`` steps. Returns True when the run should stop."""
        from tqdm import tqdm

        s = self.schedule
        loss = self._gradients(model, batches)
        hold_start = time.monotonic()
        probe = None
        with client.commit() as cycle:  # POST /quiesce, POST /commit-begin
            # the write window: from commit-begin answered to commit-end sent (the server is
            # committing throughout; no token may be served in it)
            write_start = time.monotonic()
            if step % s.eval_every == 1 or s.eval_every == 1:
                probe = self._send_held_probe(step)
            opt.step()  # the write: in place, into the served tensors
            if probe is not None:
                time.sleep(max(0.0, write_start + PROBE_MIN_WINDOW_S - time.monotonic()))
            write_end = time.monotonic()
        hold_end = time.monotonic()  # POST /commit-end and POST /resume answered
        if probe is not None:
            probe.join(timeout=660)
        opt.zero_grad(set_to_none=True)
        self.lr_schedule.step()  # changes the next step's lr, not the weights
        end = cycle.end or {}
        self.commits.append(
            CommitRecord(
                step=step,
                loss=loss,
                hold_start=hold_start,
                write_start=write_start,
                write_end=write_end,
                hold_end=hold_end,
                commit_ms=end.get("commit_ms"),
                overran=bool(end.get("overran")),
                held_requests=(cycle.quiesce or {}).get("held_requests"),
                steps_since_load=end.get("steps_since_load"),
                probed=probe is not None,
            )
        )
        postfix = {"loss": f"{loss:.3f}", "commit_ms": end.get("commit_ms")}
        learned = False
        if step % s.eval_every == 0 or step == s.max_steps:
            ev = self.evaluate(step)
            postfix.update(
                lines=f"{ev.lines}/{len(self.reference)}", control="ok" if ev.control_ok else "LOST"
            )
            tqdm.write(
                f"step {step:3d}: served recital {ev.lines:2d}/{len(self.reference)} "
                f"lines, reference loss {ev.nll:.4f} nats/token, control "
                f"{'ok' if ev.control_ok else 'LOST'} (commits={ev.commits})",
                file=sys.stderr,
            )
            learned = ev.lines == len(self.reference) and ev.control_ok
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)
        return s.stop_when_learned and learned

    def _send_held_probe(self, step: int) -> threading.Thread | None:
        """Inside the write bracket (after commit-begin answered, before the write), send one
        streamed chat and wait until the server counts it held (``held_requests`` of
        ``GET /api/weights/status``, at most :data:`PROBE_HELD_WAIT_S`), so that every run shows
        the barrier holding a request through a write, however the chat load happens to fall
        against the commits. Its record joins the chat records; the thread is returned for the
        caller to join after resume. When the wait runs out the probe is not counted as held and
        the run says so in its notes."""
        status_url = f"{self.base}/api/weights/status"

        def held_now() -> int:
            try:
                return int(
                    (requests.get(status_url, timeout=5).json().get("data") or {}).get(
                        "held_requests"
                    )
                    or 0
                )
            except (requests.RequestException, ValueError, TypeError):
                return -1

        before = max(held_now(), 0)  # the chat load's request may be held already
        rec = ChatRecord(index=-step, t_sent=time.monotonic())
        load = ChatLoad(self.base, self.schedule.chat_max_tokens, 0.0)

        def send() -> None:
            try:
                load._one(requests.Session(), rec, CHAT_PROMPTS[step % len(CHAT_PROMPTS)], step)
            except requests.RequestException as exc:
                rec.error = f"transport: {type(exc).__name__}"
            if rec.t_done is None:
                rec.t_done = time.monotonic()

        thread = threading.Thread(target=send, name=f"held-probe-{step}", daemon=True)
        thread.start()
        self.probes.append(rec)
        deadline = time.monotonic() + PROBE_HELD_WAIT_S
        while time.monotonic() < deadline:
            if held_now() > before:
                rec.seen_held = True
                return thread
            time.sleep(0.005)
        self.notes.append(
            f"step {step}: the chat sent inside the write was not seen held within "
            f"{PROBE_HELD_WAIT_S:.0f} s"
        )
        return thread

    @staticmethod
    def _batch(prompt: list[int], target: list[int], device: Any) -> dict[str, Any]:
        import torch

        ids = torch.tensor([prompt + target], device=device)
        labels = torch.tensor([[-100] * len(prompt) + target], device=device)
        return {"input_ids": ids, "labels": labels}

    @staticmethod
    def _gradients(model: Any, batches: list[dict[str, Any]]) -> float:
        """Forward and backward on the trainer's graph: reads the served weights, writes only
        the gradients (in this process). Returns the first batch's loss (the Zen's)."""
        first = None
        for batch in batches:
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            if first is None:
                first = float(loss.detach())
        return float(first)

    # --- the report ---------------------------------------------------------------------------
    def report(
        self, chats: list[ChatRecord], save: dict[str, Any] | None, after_save: dict[str, Any]
    ) -> dict[str, Any]:
        n_lines = len(self.reference)
        during = served_during_writes(chats, self.commits)
        failed = [c for c in chats if not c.ok]
        lat = [c.latency_s for c in chats if c.ok and c.latency_s is not None]
        commit_ms = [c.commit_ms for c in self.commits if c.commit_ms is not None]
        # a probed hold includes the wait for the server to count the probe: left out of the
        # barrier's percentiles when there are other holds
        unprobed = [c for c in self.commits if not c.probed] or self.commits
        hold_ms = [(c.hold_end - c.hold_start) * 1000 for c in unprobed]
        first, last = self.evals[0], self.evals[-1]
        overran = [c for c in self.commits if c.overran]
        if overran:
            self.notes.append(
                f"{len(overran)} commit(s) took longer than the server's "
                "WEIGHTS_COMMIT_WATCHDOG_MS: the set was torn until each late commit-end, and "
                "requests held meanwhile were refused; raise the watchdog on the server "
                "(docs/trainer-guide.md, 'The watchdog')"
            )
        summary = {
            "schedule": self.schedule.name,
            "steps": len(self.commits),
            "lines_total": n_lines,
            "untrained_lines": first.lines,
            "final_lines": last.lines,
            "untrained_nll": first.nll,
            "final_nll": last.nll,
            "control_before": first.control_ok,
            "control_after": last.control_ok,
            "control_after_save": CONTROL_EXPECTED in after_save["text"],
            "served_name_after_save": after_save["model"],
            "served_origin_after_save": after_save["origin"],
            "chat_requests": len(chats),
            "chat_failed": len(failed),
            "chat_failures": sorted({c.error or "" for c in failed}),
            "chat_served_during_commit": len(during),
            # write windows long enough for that check (a GPU step is shorter than the margins)
            "write_windows_checked": sum(
                c.write_end - c.write_start > 2 * EDGE_TOLERANCE_S for c in self.commits
            ),
            "chat_held_by_a_commit": held_by_commits(chats, self.commits),
            # chats sent inside a write, one per evaluation interval; "seen" ones the server's
            # status counted as held, then answered after the write (held through it)
            "held_probes": len(self.probes),
            "held_probes_seen": sum(
                p.ok and p.seen_held and any(held_through(p, c) for c in self.commits)
                for p in self.probes
            ),
            "chat_latency_p50_s": percentile(lat, 50),
            "chat_latency_p99_s": percentile(lat, 99),
            "commit_ms_p50": percentile(commit_ms, 50),
            "commit_ms_p99": percentile(commit_ms, 99),
            "commit_ms_max": max(commit_ms) if commit_ms else None,
            "hold_ms_p50": percentile(hold_ms, 50),
            "hold_ms_p99": percentile(hold_ms, 99),
            "commits_overran": sum(c.overran for c in self.commits),
            "checkpoint": save,
            "wall_s": time.monotonic() - self.t0,
            "interrupted": self.stop.requested,
            "notes": self.notes,
        }
        summary["passed"] = bool(
            summary["final_lines"] == n_lines
            and summary["control_after"]
            and summary["chat_failed"] == 0
            and summary["chat_served_during_commit"] == 0
            and save is not None
        )
        t0 = self.t0
        return {
            "summary": summary,
            "evals": [
                {**asdict(e), "started": e.started - t0, "at": e.at - t0} for e in self.evals
            ],
            "save_window": None
            if self.save_window is None
            else [self.save_window[0] - t0, self.save_window[1] - t0],
            "commits": [
                {
                    **asdict(c),
                    **{
                        k: getattr(c, k) - t0
                        for k in ("hold_start", "write_start", "write_end", "hold_end")
                    },
                    # the quiesce answer's count is of that instant (usually 0: requests
                    # arrive later); this is the count the summary adds up
                    "held_at_quiesce": c.held_requests,
                    "held_requests": sum(held_through(r, c) for r in chats),
                }
                for c in self.commits
            ],
            "chats": [
                {
                    "index": c.index,
                    "t_sent": c.t_sent - t0,
                    "t_first": None if c.t_first is None else c.t_first - t0,
                    "t_done": None if c.t_done is None else c.t_done - t0,
                    "latency_s": c.latency_s,
                    "held_through_a_write": any(held_through(c, w) for w in self.commits),
                    "status": c.status,
                    "error": c.error,
                    "model": c.model,
                    "commits": c.commits,
                    "chunks": len(c.chunk_times),
                    "served_during_commit": c.index in during,
                    "held_probe": c.index < 0,
                    "seen_held": c.seen_held,
                }
                for c in chats
            ],
            "reference": self.reference,
        }


# --- output ----------------------------------------------------------------------------------------
def results_table(results: dict[str, Any]) -> str:
    """The per-evaluation table and the summary, as plain text."""
    s = results["summary"]
    n = s["lines_total"]
    rows = [
        f"{'step':>5} {'commits':>7} {'lines':>7} {'loss/token':>10}  control",
        f"{'-' * 5} {'-' * 7} {'-' * 7} {'-' * 10}  {'-' * 30}",
    ]
    for e in results["evals"]:
        control = ("ok   " if e["control_ok"] else "LOST ") + repr(e["control_text"][:40])
        rows.append(
            f"{e['step']:>5} {e['commits'] if e['commits'] is not None else '-':>7} "
            f"{e['lines']:>3}/{n:<3} {e['nll']:>10.4f}  {control}"
        )

    ck = s["checkpoint"] or {}
    summary = [
        ("training steps (commits)", fmt(s["steps"])),
        (
            "served recital, untrained -> final",
            f"{s['untrained_lines']}/{n} -> {s['final_lines']}/{n} lines",
        ),
        (
            "reference loss, untrained -> final",
            f"{s['untrained_nll']:.3f} -> {s['final_nll']:.4f} nats/token",
        ),
        (
            "control question answered, before / after / after save",
            f"{s['control_before']} / {s['control_after']} / {s['control_after_save']}",
        ),
        ("chat requests (failed)", f"{s['chat_requests']} ({s['chat_failed']})"),
        (
            "chat requests served during a commit",
            f"{s['chat_served_during_commit']} (over {s['write_windows_checked']} write windows "
            f"longer than {2 * EDGE_TOLERANCE_S:.1f} s)",
        ),
        ("chat requests held through a write", fmt(s["chat_held_by_a_commit"])),
        (
            "chats sent inside a write, counted held by the server",
            f"{s['held_probes_seen']} of {s['held_probes']}",
        ),
        (
            "chat latency p50 / p99",
            f"{fmt(s['chat_latency_p50_s'], ' s')} / {fmt(s['chat_latency_p99_s'], ' s')}",
        ),
        (
            "commit (server) p50 / p99 / max",
            f"{fmt(s['commit_ms_p50'], ' ms')} / {fmt(s['commit_ms_p99'], ' ms')} / {fmt(s['commit_ms_max'], ' ms')}",
        ),
        (
            "quiesce sent -> resume answered, per step p50 / p99",
            f"{fmt(s['hold_ms_p50'], ' ms')} / {fmt(s['hold_ms_p99'], ' ms')}",
        ),
        ("commits that overran the watchdog", fmt(s["commits_overran"])),
        ("checkpoint", f"{ck.get('name', '-')} ({(ck.get('checkpoint_sha256') or '-')[:12]})"),
        (
            "served as, after the save",
            f"{s['served_name_after_save']} (origin {s['served_origin_after_save']})",
        ),
        ("wall time", fmt(s["wall_s"], " s")),
        ("result", "PASS" if s["passed"] else "FAIL"),
    ]
    return table_text(rows, summary)


def plot(results: dict[str, Any], path: Path) -> None:
    """Score against step (top), the chat latency timeline with the commit windows (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["summary"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), constrained_layout=True)
    steps = [e["step"] for e in results["evals"]]
    top.plot(
        steps,
        [e["lines"] for e in results["evals"]],
        "o",
        markersize=8,
        color="tab:blue",
        label="Zen lines the server recites exactly",
    )
    for e in results["evals"]:
        if not e["control_ok"]:
            top.plot([e["step"]], [e["lines"]], "x", color="red", markersize=10)
    top.set_ylim(-0.5, s["lines_total"] + 0.5)
    top.yaxis.get_major_locator().set_params(integer=True)
    top.xaxis.get_major_locator().set_params(integer=True)
    top.set_xlabel("training step (commits)")
    top.set_ylabel(f"lines reproduced (of {s['lines_total']})", color="tab:blue")
    loss_ax = top.twinx()
    loss_ax.plot(
        steps,
        [e["nll"] for e in results["evals"]],
        "s",
        markersize=7,
        color="tab:orange",
        label="reference loss under the served weights",
    )
    loss_ax.set_ylabel("nats per token", color="tab:orange")
    top.set_title(
        f"Served score while training in place ({s['schedule']} schedule, "
        f"control question {'kept' if s['control_after'] else 'LOST'})"
    )
    lines = top.get_legend_handles_labels()
    extra = loss_ax.get_legend_handles_labels()
    # below the axes: inside, it covered points
    top.legend(
        lines[0] + extra[0],
        lines[1] + extra[1],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18),
        ncol=2,
        fontsize="small",
    )

    for i, c in enumerate(results["commits"]):
        bottom.axvspan(
            c["hold_start"],
            c["hold_end"],
            color="tab:red",
            alpha=0.15,
            lw=0,
            label="barrier: quiesce sent -> resume answered" if i == 0 else None,
        )
        bottom.axvspan(
            c["write_start"],
            c["write_end"],
            color="tab:red",
            alpha=0.45,
            lw=0,
            label="weights writing (optimizer step)" if i == 0 else None,
        )
    ok = [c for c in results["chats"] if c["error"] is None and c["t_done"] is not None]
    bad = [c for c in results["chats"] if c["error"] is not None]
    held = [c for c in ok if c.get("held_through_a_write")]
    bottom.plot(
        [c["t_done"] for c in ok if not c.get("held_through_a_write")],
        [c["latency_s"] for c in ok if not c.get("held_through_a_write")],
        ".",
        color="tab:green",
        label="chat request (latency, at completion)",
    )
    if held:
        bottom.plot(
            [c["t_done"] for c in held],
            [c["latency_s"] for c in held],
            "D",
            color="tab:red",
            markersize=5,
            label=f"held through a write ({len(held)}), then served",
        )
    if bad:
        bottom.plot(
            [c["t_done"] for c in bad],
            [c["latency_s"] or 0 for c in bad],
            "x",
            color="black",
            label="failed chat request",
        )
    for i, e in enumerate(results["evals"]):
        bottom.axvspan(
            e["started"],
            e["at"],
            color="tab:blue",
            alpha=0.12,
            lw=0,
            label="evaluation (recital, reference loss, control)" if i == 0 else None,
        )
    if results.get("save_window"):
        a, b = results["save_window"]
        bottom.axvspan(
            a, max(b, a + 0.5), color="tab:purple", alpha=0.4, lw=0, label="checkpoint save"
        )
    bottom.set_xlabel("time since start (s)")
    bottom.set_ylabel("chat latency (s)")
    bottom.set_title(
        f"{s['chat_requests']} chat requests, {s['chat_failed']} failed, "
        f"{s['chat_served_during_commit']} served during a commit"
    )
    bottom.legend(
        loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, fontsize="small", framealpha=0.9
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the command line -------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = example_parser(__doc__, DEFAULT_OUT, SCHEDULES, "CPU, stops once learned")
    p.add_argument(
        "--no-control-example",
        action="store_true",
        help="train on the Zen alone (by default the control answer is a second "
        "example of every step, so the model keeps it)",
    )
    args = p.parse_args(argv)
    check_server_args(p, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = out_dir(args.out, DEFAULT_OUT)
    device = resolve_device(args.device)
    name = args.schedule or ("full" if device.startswith("cuda") else "short")
    schedule = SCHEDULES[name]
    if args.max_steps:
        schedule = Schedule(**{**asdict(schedule), "max_steps": args.max_steps})
    if args.no_control_example:
        schedule = Schedule(**{**asdict(schedule), "keep_control": False})

    def train(stop: StopRequest) -> dict[str, Any]:
        with contextlib.ExitStack() as stack:
            conn = connect(stack, args, out, device, stop)
            demo = Demo(
                conn.base, conn.token, schedule, out, conn.home, conn.server, stop, conn.unix_socket
            )
            return demo.run()

    def epilogue(results: dict[str, Any]) -> str:
        last = results["evals"][-1]
        return f"\nfinal served recital (commits={last['commits']}):\n{last['recital']}\n"

    return run_example("train_while_serving", out, device, train, plot, results_table, epilogue)


if __name__ == "__main__":
    sys.exit(main())
