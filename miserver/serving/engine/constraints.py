"""Constrained decoding: the grammar side of the sampler's constraint hook (issue 33).

The engine's sampler sees only the protocol below (docs/ENGINE_API "Constraint hook"): a
:class:`Constraint` is compiled once per request (frozen, shared by its ``n`` choices); each
sequence gets its own :class:`Matcher`, which masks a logits row before the token is chosen and
advances on the chosen token. A terminated matcher ends its sequence with ``finish_reason``
``"stop"``. Logprobs are reported from the model's own (unmasked) distribution, as vLLM does.

The grammars are llguidance's (``llguidance`` on PyPI; the choice and its measurements are in
docs/decisions.md, "Structured outputs: the grammar library"): a JSON schema, any JSON object,
or a Lark grammar (tool calls). llguidance's tokenizer view of a transformers tokenizer costs
seconds to build (the whole vocabulary), so it is built once per tokenizer and vocabulary size
and kept while the tokenizer lives.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch


class Matcher(Protocol):
    """One sequence's position in its grammar (thread-confined: the sampler's thread)."""

    def fill_mask(self, logits: torch.Tensor) -> None:
        """Set the disallowed entries of ``logits`` (float ``[vocab]``, any device) to -inf,
        in place."""

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id`` (the token the sampler chose from the masked row)."""

    def is_terminated(self) -> bool:
        """The grammar is complete: nothing may follow (the sequence ends as ``"stop"``)."""


class Constraint(Protocol):
    """A compiled grammar, immutable, shared by the sequences of a request."""

    def new_matcher(self) -> Matcher:
        """A matcher at the grammar's start."""


class ConstraintError(ValueError):
    """A grammar cannot be compiled for this model's tokenizer, or a matcher reached a state
    where no token is allowed (``str()`` says which)."""


# --- llguidance ---------------------------------------------------------------------------------
_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def llg_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's ``LLTokenizer`` for a transformers ``tokenizer`` whose model's logits have
    ``vocab_size`` entries (ids past the tokenizer's own vocabulary are never allowed). Built
    once per (tokenizer, vocab_size): about 4 s for a 49k vocabulary on a loaded 2-core CPU."""
    import llguidance.hf

    with _TOKENIZERS_LOCK:
        per = _TOKENIZERS.setdefault(tokenizer, {})
        found = per.get(vocab_size)
        if found is None:
            found = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
            per[vocab_size] = found
        return found


def model_vocab_size(model: Any, tokenizer: Any) -> int:
    """Entries in the model's logits row: ``config.vocab_size``, else the tokenizer's length."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    return len(tokenizer)


@dataclass(frozen=True)
class GrammarConstraint:
    """A :class:`Constraint` over an llguidance grammar (built by :func:`json_schema_constraint`,
    :func:`lark_constraint`).

    Attributes:
        grammar: llguidance's serialised grammar (``LLMatcher.grammar_from_*``).
        tokenizer: the ``LLTokenizer`` it runs over.
        vocab_size: entries of the logits rows the matchers mask.
        description: what it enforces, for logs and errors (``json_schema 'person'``).
    """

    grammar: str
    tokenizer: Any = field(repr=False)
    vocab_size: int
    description: str = ""

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self)


class LLGuidanceMatcher:
    """:class:`Matcher` over ``llguidance.LLMatcher``; the mask is computed on the CPU as a
    bitmask (int32 words, ``ceil(vocab / 32)`` of them) and applied on the logits' device."""

    __slots__ = ("_c", "_m", "_bits", "_terminated")

    def __init__(self, constraint: GrammarConstraint) -> None:
        import llguidance

        self._c = constraint
        self._m = llguidance.LLMatcher(constraint.tokenizer, constraint.grammar)
        self._bits = torch.zeros((constraint.vocab_size + 31) // 32, dtype=torch.int32)
        self._terminated = False
        self._check()

    def _check(self) -> None:
        if self._m.is_error():
            raise ConstraintError(f"{self._c.description}: {self._m.get_error()}")

    def fill_mask(self, logits: torch.Tensor) -> None:
        """Raises :class:`ConstraintError` when the grammar allows no token (a failed matcher)."""
        self._check()
        bits = self._bits
        self._m.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        self._check()
        if not bool(bits.any()):  # sampling from nothing would read as non-finite logits
            raise ConstraintError(f"{self._c.description}: the grammar allows no next token")
        allowed = np.unpackbits(bits.numpy().view(np.uint8), bitorder="little")
        allowed = torch.from_numpy(allowed[: logits.shape[-1]])
        if logits.shape[-1] > allowed.shape[0]:  # a row wider than the grammar's vocabulary
            logits[allowed.shape[0] :] = float("-inf")
            logits = logits[: allowed.shape[0]]
        logits.masked_fill_(allowed.to(logits.device, non_blocking=True) == 0, float("-inf"))

    def accept(self, token_id: int) -> None:
        if not self._m.consume_token(int(token_id)):
            self._check()
            raise ConstraintError(
                f"{self._c.description}: token {token_id} is not allowed by the grammar"
            )
        self._terminated = self._m.is_stopped()

    def is_terminated(self) -> bool:
        return self._terminated


def _validated(grammar: str, tokenizer: Any, vocab_size: int, description: str) -> Any:
    import llguidance

    tok = llg_tokenizer(tokenizer, vocab_size)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
    if is_error:
        raise ConstraintError(f"{description}: {messages[0] if messages else 'invalid grammar'}")
    return GrammarConstraint(grammar, tok, vocab_size, description)


#: The JSON compiler's options: whitespace as ``json.dumps`` writes it (one space after ``:`` and
#: ``,``, no newlines), so a model trained on compact JSON is not pushed into odd spacing.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_constraint(
    schema: dict[str, Any], tokenizer: Any, vocab_size: int, description: str = "json_schema"
) -> GrammarConstraint:
    """A constraint whose sequences are JSON documents valid under ``schema`` (JSON Schema,
    draft 2020-12 as llguidance implements it; ``{"type": "object"}`` for any object).

    Raises:
        ConstraintError: llguidance refuses the schema (its message names the keyword).
    """
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=JSON_OPTIONS
        )
    except ValueError as exc:
        raise ConstraintError(f"{description}: {exc}") from None
    return _validated(grammar, tokenizer, vocab_size, description)


def lark_constraint(
    lark: str, tokenizer: Any, vocab_size: int, description: str = "grammar"
) -> GrammarConstraint:
    """A constraint over a Lark grammar in llguidance's dialect (``%json {...}`` embeds a JSON
    schema).

    Raises:
        ConstraintError: the grammar does not compile.
    """
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as exc:
        raise ConstraintError(f"{description}: {exc}") from None
    return _validated(grammar, tokenizer, vocab_size, description)
