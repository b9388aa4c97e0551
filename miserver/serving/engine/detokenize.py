"""Text of generated tokens, released only when it is final (companion contract 4).

- :class:`IncrementalDetokenizer` never splits a UTF-8 character (a byte-level token may end in
  the middle of one; that text waits for the next token);
- :class:`StopMatcher` holds back any tail that could still become a stop sequence, and never
  releases any part of a matched one;
- :func:`token_bytes` and :func:`token_text`: one token's raw bytes and its text on its own (the
  logprobs' ``bytes`` and ``token``).

Used by :class:`miserver.serving.engine.generation.Generation`.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import tokenizers

#: Tokens of prompt context the incremental detokenizer decodes along (vLLM uses the same).
_DETOKENIZE_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    ``context_ids`` (the prompt's last tokens) give the first generated tokens their left
    context, so tokenizers that drop a leading space when decoding alone (SentencePiece) decode
    as they would in place. Special tokens are skipped.
    """

    def __init__(self, tokenizer: Any, context_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(context_ids[-_DETOKENIZE_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self._backend = backend_decoder(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend(ids, skip_special_tokens=True)
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Add one token; returns the text that became final (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix = self._read
            self._read = len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """The text still held. An incomplete UTF-8 character at the very end (the generation
        stopped inside it, e.g. at ``max_tokens``) is dropped, not sent as U+FFFD: a completion
        never holds part of a character (contract 4)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        held = self._ids[self._read :]
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        text = new_text[len(prefix_text) :]
        if text.endswith("\ufffd") and _ends_inside_a_character(
            b"".join(token_bytes(self._tok, i) for i in held)
        ):
            text = text[:-1]
        return text


def backend_decoder(tokenizer: Any) -> Any:
    """The ``tokenizers`` backend's own ``decode`` when it is exactly what
    ``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`` runs
    (a transformers ``TokenizersBackend`` whose ``decode`` and ``_decode`` are not overridden),
    else None. Calling it directly skips transformers' per-call argument conversion (a scan of
    the ids, several microseconds), which the detokenizer pays twice a token for every sequence
    of a batch, inside the decode loop. Takes ``(ids: list[int], skip_special_tokens: bool)``."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # pragma: no cover - another transformers layout: the public decode
        return None
    kind = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and isinstance(backend, tokenizers.Tokenizer)
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is TokenizersBackend._decode
    ):
        return backend.decode
    return None


def _ends_inside_a_character(raw: bytes) -> bool:
    """Whether ``raw`` ends with the start of a UTF-8 character whose last bytes are missing."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return err.end == len(raw) and err.reason == "unexpected end of data"
    return False


class StopMatcher:
    """Holds back text that could still start a stop sequence (contract 4).

    :meth:`feed` returns ``(releasable_text, stopped)``; after ``stopped`` the completion is
    over and nothing of the stop sequence was released.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._buf = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        self._buf += text
        first = -1
        for stop in self._stops:
            i = self._buf.find(stop)
            if i != -1 and (first == -1 or i < first):
                first = i
        if first != -1:
            out, self._buf = self._buf[:first], ""
            return out, True
        hold = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._buf)), hold, -1):
                if self._buf.endswith(stop[:k]):
                    hold = k
                    break
        cut = len(self._buf) - hold
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out, False

    def flush(self) -> str:
        """At the end without a match, the held tail is ordinary text."""
        out, self._buf = self._buf, ""
        return out


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character -> byte table, which byte-level BPE vocabularies use
    (``transformers``' ``bytes_to_unicode``, inverted)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


_byte_level_cache: weakref.WeakKeyDictionary[Any, tuple[bool, dict[int, str]]] = (
    weakref.WeakKeyDictionary()
)
_byte_level_lock = threading.Lock()


def _is_byte_level_decoder(decoder: Any) -> bool:
    if decoder is None:
        return False
    if isinstance(decoder, tokenizers.decoders.ByteLevel):
        return True
    # A Sequence decoder does not expose its members: its repr names them.
    return isinstance(decoder, tokenizers.decoders.Sequence) and "ByteLevel" in repr(decoder)


def _token_kinds(tokenizer: Any) -> tuple[bool, dict[int, str]]:
    """``(byte_level, added)``: whether the vocabulary is byte-level BPE (its pieces are bytes
    written through GPT-2's table, read back by the ``tokenizers`` ``ByteLevel`` decoder), and
    the added tokens' ids and contents (written as themselves, not through the table). Cached
    per tokenizer."""
    with _byte_level_lock:
        cached = _byte_level_cache.get(tokenizer)
    if cached is not None:
        return cached
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = _is_byte_level_decoder(getattr(backend, "decoder", None))
    added = {
        int(i): t.content
        for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
        if isinstance(getattr(t, "content", None), str)
    }
    result = (byte_level, added)
    with _byte_level_lock:
        _byte_level_cache[tokenizer] = result
    return result


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw bytes of one token (a byte-level BPE token may hold part of a character).

    Byte-level BPE: the token's piece mapped through GPT-2's byte table (``[148]`` for the
    continuation byte 0x94, where its decoded text is U+FFFD); an added token: its content in
    UTF-8; any other tokenizer (no byte-level table): the UTF-8 of the token decoded alone.
    """
    token_id = int(token_id)
    byte_level, added = _token_kinds(tokenizer)
    content = added.get(token_id)
    if content is not None:
        return content.encode("utf-8")
    if byte_level:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        table = _byte_decoder()
        if isinstance(piece, str) and piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
    return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token decoded on its own (a partial character shows as U+FFFD)."""
    return tokenizer.decode(
        [int(token_id)], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
