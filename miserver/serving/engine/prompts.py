"""Prompts to token ids: the chat template with message content kept as text, and the cheap
length bound that refuses a text too long for the context window before it is tokenized
(companion contract 4; issue 16, breaker findings F15 and F11).

**Message content is text.** A transformers tokenizer parses its special tokens (``<|im_end|>``,
``<|im_start|>``, ...) wherever their strings occur in the text it is given, so a chat
template's output tokenized as one string lets a user message that holds ``<|im_end|>`` close
its own turn and open a forged system turn. :func:`chat_prompt_ids` tokenizes the template's
own markers as control tokens and every message's content as text:

- when no message's content holds a special-token string (the normal case), the prompt is
  tokenized exactly as before: ``tokenizer(apply_chat_template(...), add_special_tokens=False)``
  (the trainer side, :func:`miserver.trainer.training.chat_example`, tokenizes the same way, so
  the two stay token-identical);
- otherwise each occurrence of a special-token string inside content is replaced by a unique
  sentinel, the template is rendered, the rendered text is split at the special tokens that are
  left (the template's own), and each piece between them is tokenized with
  ``split_special_tokens=True`` after the sentinels are put back: the pieces are exactly those the
  tokenizer would have produced had the content's markers been plain text. A template that
  changes the sentinels (so that the rendering with them, put back, is not the rendering of the
  real content) is refused with :class:`PromptError` rather than tokenized wrongly.

Only *special* added tokens are guarded (the ones ``split_special_tokens`` affects); ordinary
added tokens are vocabulary words and are tokenized as any text would be.

**The length bound.** A token covers at most :func:`max_token_chars` characters of text (the
longest piece of the vocabulary, in characters), so a text longer than
``context * max_token_chars`` characters needs more than ``context`` tokens: it cannot fit, and is
refused without tokenizing (tokenizing ~8 MB costs ~10 CPU-seconds). The bound is only claimed
for BPE vocabularies (byte-level or SentencePiece-style), whose tokens always cover their own
text; for other models (WordPiece's ``[UNK]`` covers a whole word) :func:`max_token_chars`
returns None and no early refusal is made.
"""

from __future__ import annotations

import re
import secrets
import threading
import weakref
from collections.abc import Sequence
from typing import Any

__all__ = [
    "PromptError",
    "chat_prompt_ids",
    "max_token_chars",
    "render_chat",
    "special_token_strings",
]


class PromptError(ValueError):
    """The messages cannot be made into a prompt (the template refused them, or it alters
    message content in a way that hides where a special-token string in it went)."""


_lock = threading.Lock()
_specials_cache: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()
_max_chars_cache: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def special_token_strings(tokenizer: Any) -> tuple[str, ...]:
    """The strings the tokenizer parses as *special* tokens, longest first (cached per
    tokenizer): every added token marked special, and the named special tokens."""
    with _lock:
        cached = _specials_cache.get(tokenizer)
    if cached is not None:
        return cached
    found: set[str] = set()
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for added in decoder.values():
        content = getattr(added, "content", None)
        if isinstance(content, str) and content and getattr(added, "special", False):
            found.add(content)
    for token in getattr(tokenizer, "all_special_tokens", None) or ():
        if isinstance(token, str) and token:
            found.add(token)
    result = tuple(sorted(found, key=lambda s: (-len(s), s)))
    with _lock:
        _specials_cache[tokenizer] = result
    return result


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters of text one token can cover, or None when no such bound holds.

    The longest piece of the vocabulary in characters (a byte-level piece has one character per
    byte of the text it stands for, a SentencePiece piece one per character), times 4 when the
    tokenizer normalizes text first (composition can shrink it). Computed once per tokenizer.
    None for tokenizers without a fast (``tokenizers``) backend or whose model is not BPE or
    Unigram.
    """
    with _lock:
        if tokenizer in _max_chars_cache:
            return _max_chars_cache[tokenizer]
    result = _compute_max_token_chars(tokenizer)
    with _lock:
        _max_chars_cache[tokenizer] = result
    return result


def _compute_max_token_chars(tokenizer: Any) -> int | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if type(model).__name__ not in ("BPE", "Unigram"):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    if not vocab:
        return None
    # A piece's length in characters bounds the text it covers: a byte-level piece has one
    # character per byte, a SentencePiece piece one per character ("\u2581" for a space), a
    # byte-fallback piece ("<0xF0>") covers at most one character, an added token its content.
    longest = max(len(piece) for piece in vocab)
    # A normalizer may compose characters (NFC: a base and its combining marks become one,
    # Hangul jamo up to three into one): allow for text that shrinks before it is tokenized.
    if backend.normalizer is not None:
        longest *= 4
    return max(longest, 1)


def _encode(tokenizer: Any, text: str, **kwargs: Any) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, **kwargs)["input_ids"])


def _render(
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> str:
    extra = {"tools": tools} if tools else {}
    try:
        return tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False, **extra
        )
    except Exception as exc:  # noqa: BLE001 - a template may refuse a conversation (jinja)
        raise PromptError(f"the chat template refused the messages: {str(exc)[:300]}") from None


def render_chat(
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> str:
    """The chat template's text for ``messages`` with the generation prompt (no tokenizing).
    ``tools``: OpenAI-shaped tool definitions, passed to the template as ``tools`` (issue 33).

    Raises:
        PromptError: the template refused the messages (its message, cut to 300 characters).
    """
    return _render(tokenizer, messages, tools)


def chat_prompt_ids(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    text: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt token ids of a conversation: template markers as control tokens, message
    content as text (see the module's docstring).

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        messages: ``[{"role": str, "content": str}]`` as the template takes them.
        text: :func:`render_chat` of the same messages when the caller has it already.
        tools: as :func:`render_chat`'s.

    Returns:
        The token ids (list of int), without the tokenizer's own BOS/EOS additions
        (``add_special_tokens=False``: the template writes what the model needs).

    Raises:
        PromptError: the template refused the messages, or altered content holding a
            special-token string so that it cannot be kept as text.
    """
    if text is None:
        text = _render(tokenizer, messages, tools)
    specials = special_token_strings(tokenizer)
    if not specials or not any(s in m["content"] for m in messages for s in specials):
        return _encode(tokenizer, text)
    return _protected_ids(tokenizer, messages, text, specials, tools)


def _protected_ids(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    text: str,
    specials: tuple[str, ...],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    special_re = re.compile("|".join(re.escape(s) for s in specials))
    contents = [m["content"] for m in messages]
    while True:  # a nonce no content (and no rendering) holds
        nonce = secrets.token_hex(8)
        if not any(nonce in c for c in contents) and nonce not in text:
            break
    sentinels: dict[str, str] = {}

    def protect(match: re.Match[str]) -> str:
        sentinel = f"\ue000{nonce}.{len(sentinels)}\ue001"
        sentinels[sentinel] = match.group(0)
        return sentinel

    guarded = [{**m, "content": special_re.sub(protect, m["content"])} for m in messages]
    rendered = _render(tokenizer, guarded, tools)
    sentinel_re = re.compile(f"\ue000{nonce}\\.\\d+\ue001")

    def restore(piece: str) -> str:
        return sentinel_re.sub(lambda m: sentinels[m.group(0)], piece)

    if restore(rendered) != text:
        raise PromptError(
            "a message's content holds a special-token string "
            f"({', '.join(sorted(set(sentinels.values())))[:200]}) and this model's chat template "
            "transforms message content, so it cannot be kept as text: remove the string"
        )
    ids: list[int] = []
    position = 0
    for match in special_re.finditer(rendered):  # the template's own markers
        if match.start() > position:
            piece = restore(rendered[position : match.start()])
            ids.extend(_encode(tokenizer, piece, split_special_tokens=True))
        ids.extend(_encode(tokenizer, match.group(0)))
        position = match.end()
    if position < len(rendered):
        ids.extend(_encode(tokenizer, restore(rendered[position:]), split_special_tokens=True))
    return ids
