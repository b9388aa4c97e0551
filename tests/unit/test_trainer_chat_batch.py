"""miserver.trainer.chat_example / chat_batch: chat messages and a target answer become a
training batch with the served tokenizer: the prompt exactly as /v1/chat/completions builds it,
masked with -100, then the answer and the EOS the served model stops on."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miserver import trainer
from miserver.trainer import IGNORE_INDEX, chat_batch, chat_example

Q = [{"role": "user", "content": "What is the capital of France?"}]
A = "Paris."


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_the_prompt_is_masked_and_the_answer_ends_with_eos(tok):
    ids, labels = chat_example(tok, Q, A)
    served = tok(
        tok.apply_chat_template(Q, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    n = len(served)
    assert ids[:n] == list(served)  # the prompt /v1 serves, token for token
    assert labels[:n] == [IGNORE_INDEX] * n
    assert labels[n:] == ids[n:] and IGNORE_INDEX not in labels[n:]
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids[n:-1]) == A


def test_a_batch_pads_right_and_masks_the_padding(tok):
    long = [{"role": "system", "content": "Be brief."}, *Q]
    batch = chat_batch(tok, [(Q, A), (long, "Paris, on the Seine.")])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    shapes = {v.shape for v in batch.values()}
    assert len(shapes) == 1 and next(iter(shapes))[0] == 2
    assert all(v.dtype == torch.long for v in batch.values())
    first, first_labels = chat_example(tok, Q, A)
    n = len(first)
    assert batch["input_ids"][0, :n].tolist() == first
    assert batch["labels"][0, :n].tolist() == first_labels
    assert batch["attention_mask"][0].tolist() == [1] * n + [0] * (batch["labels"].shape[1] - n)
    assert (batch["labels"][0, n:] == IGNORE_INDEX).all()


def test_the_loss_is_the_answers_and_training_on_it_lowers_it(tok, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = chat_batch(tok, [(Q, A)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = model(**batch).loss.detach()
    for _ in range(10):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert torch.isfinite(first) and float(model(**batch).loss) < float(first)


@pytest.mark.parametrize(
    "messages, answer, match",
    [
        ([], A, "messages"),
        ([{"role": "user"}], A, "messages"),
        (Q, "", "answer"),
    ],
)
def test_bad_examples_are_clear_errors(tok, messages, answer, match):
    with pytest.raises(ValueError, match=match):
        chat_example(tok, messages, answer)
    with pytest.raises(ValueError, match="at least one"):
        chat_batch(tok, [])


def test_a_tokenizer_without_a_chat_template_is_refused(tok):
    class NoTemplate:
        chat_template = None
        eos_token = "</s>"

    with pytest.raises(ValueError, match="chat template"):
        trainer.chat_example(NoTemplate(), Q, A)


@pytest.mark.parametrize(
    "cls, kw",
    [
        (torch.optim.AdamW, {}),
        (torch.optim.Adam, {"amsgrad": True}),
        (torch.optim.AdamW, {"foreach": False}),
    ],
)
def test_optimizer_state_made_before_the_first_commit_changes_no_step(cls, kw, monkeypatch):
    import copy

    torch.manual_seed(0)
    a = torch.nn.Linear(4, 3)
    b = copy.deepcopy(a)
    fresh, early = cls(a.parameters(), lr=1e-2, **kw), cls(b.parameters(), lr=1e-2, **kw)
    before = [p.detach().clone() for p in b.parameters()]
    assert trainer.init_optimizer_state(early) is early
    assert all(torch.equal(x, y) for x, y in zip(before, b.parameters(), strict=True))
    assert all(early.state[p]["exp_avg"].shape == p.shape for p in b.parameters())
    # the first step allocates nothing now
    made = []
    real = torch.zeros_like
    monkeypatch.setattr(torch, "zeros_like", lambda *x, **k: made.append(1) or real(*x, **k))
    for model, opt in ((b, early),):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    monkeypatch.undo()
    assert made == []
    a(torch.ones(2, 4)).sum().backward()
    fresh.step()
    for _ in range(2):
        for model, opt in ((a, fresh), (b, early)):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    with pytest.raises(TypeError, match="Adam"):
        trainer.init_optimizer_state(torch.optim.SGD(a.parameters(), lr=0.1))
