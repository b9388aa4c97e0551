"""Text of generated tokens, released only when it is final (companion contract 4).

- :class:`IncrementalDetokenizer` never splits a UTF-8 character (a byte-level token may end in
  the middle of one; that text waits for the next token);
- :class:`StopMatcher` holds back any tail that could still become a stop sequence, and never
  releases any part of a matched one;
- :func:`token_bytes` and :func:`token_text`: one token's raw bytes and its text on its own (the
  logprobs' ``bytes`` and ``token``).

Used by :class:`miserver.serving.generation.Generation`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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

    def _decode(self, ids: Sequence[int]) -> str:
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


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character -> byte table (byte-level BPE vocabularies use it)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _byte_decoder()


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw bytes of one token (a byte-level BPE token may hold part of a character)."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if isinstance(piece, str) and piece and all(c in _BYTE_DECODER for c in piece):
        return bytes(_BYTE_DECODER[c] for c in piece)
    return tokenizer.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token decoded on its own (a partial character shows as U+FFFD)."""
    return tokenizer.decode(
        [int(token_id)], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
