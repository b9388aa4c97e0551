"""Helpers of the training loop: a chat conversation as input ids and labels (the prompt
masked), a padded batch of them, and an AdamW's state made before the first commit.
Re-exported by :mod:`miserver.trainer`.
"""

from __future__ import annotations

from typing import Any

import torch

#: The label of a position the loss ignores (transformers' and PyTorch's ``ignore_index``).
IGNORE_INDEX = -100


def chat_example(
    tokenizer: Any, messages: list[dict[str, str]], answer: str
) -> tuple[list[int], list[int]]:
    """One supervised chat example: ``(input_ids, labels)``, lists of ints of one length.

    The prompt is ``messages`` through the tokenizer's chat template with the generation prompt,
    tokenized exactly as ``/v1/chat/completions`` does (so the model learns on the prompt it is
    served) whenever no message's content holds a special-token string such as ``<|im_end|>``:
    ``/v1`` tokenizes such a string in content as text, here it stays the control token (the
    examples are the trainer's own data; docs/decisions.md). Then the answer and the end-of-turn token the served model stops on
    (``tokenizer.eos_token``), so that after training it also stops. ``labels`` is
    ``input_ids`` with every prompt position set to -100 (:data:`IGNORE_INDEX`): the loss is the
    answer's alone.

    Args:
        tokenizer: the served model's tokenizer (:meth:`WeightsClient.tokenizer`), a
            transformers tokenizer with a chat template.
        messages: OpenAI-style ``[{"role": "system"|"user"|"assistant", "content": str}]``,
            ending before the answer.
        answer: the assistant's target reply.

    Raises:
        ValueError: no chat template, no EOS token, an empty answer, or messages that are not
            a list of ``{role, content}`` dicts.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: use it for completions instead")
    eos = getattr(tokenizer, "eos_token", None)
    if not eos:
        raise ValueError("the tokenizer has no eos_token: the model could not learn to stop")
    if not isinstance(answer, str) or not answer:
        raise ValueError("answer must be a non-empty string")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ValueError('messages must be a non-empty list of {"role": str, "content": str}')
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    target = list(tokenizer(answer + eos, add_special_tokens=False)["input_ids"])
    return prompt + target, [IGNORE_INDEX] * len(prompt) + target


def chat_batch(
    tokenizer: Any,
    examples: list[tuple[list[dict[str, str]], str]],
    *,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """A training batch from chat examples, ready for ``model(**batch).loss``.

    Each example is ``(messages, answer)`` (see :func:`chat_example`: chat template, prompt
    masked with -100, EOS after the answer). Shorter examples are padded on the right with the
    tokenizer's pad token (EOS when it has none), masked out of the attention and the loss.

    Returns:
        ``{"input_ids", "attention_mask", "labels"}``: int64 tensors of shape
        ``[len(examples), longest]`` on ``device`` (default: the CPU; pass the served weights'
        device, ``next(model.parameters()).device``).

    Raises:
        ValueError: no examples, or a bad example (:func:`chat_example`).
    """
    if not examples:
        raise ValueError("examples must hold at least one (messages, answer) pair")
    rows = [chat_example(tokenizer, messages, answer) for messages, answer in examples]
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id
    input_ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[i, : len(lab)] = torch.tensor(lab, dtype=torch.long)
        attention[i, : len(ids)] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention, "labels": labels}
    if device is not None:
        batch = {k: v.to(device) for k, v in batch.items()}
    return batch


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Create the state of an Adam or AdamW optimizer now, before the first commit, exactly as
    its first ``step()`` would (``step`` 0, zero moments), so that step, inside the commit
    bracket, allocates nothing: AdamW over 135M parameters on a CPU took 4.4 s to allocate its
    state in the first commit, past the watchdog. Touches no parameter. Returns ``optimizer``.

    Raises:
        TypeError: an optimizer other than ``torch.optim.Adam`` or ``AdamW`` (others: take one
            step on a copy of the model, or raise WEIGHTS_COMMIT_WATCHDOG_MS for the first).
    """
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(f"init_optimizer_state supports Adam and AdamW, not {type(optimizer)}")
    for group in optimizer.param_groups:
        on_device = bool(group.get("capturable") or group.get("fused"))
        for p in group["params"]:
            if not p.requires_grad or optimizer.state.get(p):
                continue
            # as torch.optim's _get_scalar_dtype: float32 when fused, else the default dtype
            step_dtype = torch.float32 if group.get("fused") else torch.get_default_dtype()
            state: dict[str, torch.Tensor] = {
                "step": torch.zeros((), dtype=step_dtype, device=p.device if on_device else None),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state
    return optimizer
