"""The grammar-library choice for structured outputs (issue 33): llguidance, xgrammar and
outlines-core side by side on the CPU, with the default model's tokenizer::

    python benchmarks/grammar_libraries.py --model-dir MISERVER_HOME/models/smollm2-135m-instruct

For each installed library (a missing one is reported and skipped) and each JSON schema below,
the script compiles the schema once (``compile ms``), builds a matcher and masks the first token (``1st token
ms``: where a lazy library does its work) and then walks a valid answer of that schema
token by token, as the sampler does: compute the allowed-token mask, apply it to a ``[vocab]``
float32 logits row (disallowed -> -inf), check the next token is allowed, accept it. The table
gives microseconds per token for that mask + apply + accept (p50 and mean over the answer's
tokens, three walks), and which schema features each library refused. The decision this fed is
recorded in docs/decisions.md ("Structured outputs: the grammar library").

Only llguidance is a dependency of miserver; to compare, install the other two beside it
(``pip install xgrammar outlines-core``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

# The schemas: a Pydantic-style object (strings, integers, enum, array, nested object), and one
# schema per feature the libraries differ on.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
PERSON_ANSWER = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "role": "admin",
        "tags": ["math", "engines", "poetry"],
        "address": {"city": "London", "zip": "W1"},
    }
)
# feature -> (schema, an instance the feature forbids: a library that lets it through ignores it)
FEATURES = {
    "anyOf": ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "true"),
    "$ref/$defs (recursive)": (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["v", "children"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        '{"v": 1, "children": [{"v": 2, "children": [{"v": "x", "children": []}]}]}',
    ),
    "pattern": ({"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"}, '"abc-x1"'),
    "format: date-time": ({"type": "string", "format": "date-time"}, '"yesterday"'),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 5}, '"abcdefgh"'),
    "minimum/maximum": ({"type": "integer", "minimum": 3, "maximum": 99}, "100"),
    "minItems/maxItems": (
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        "[1, 2, 3, 4]",
    ),
    "const": ({"const": "x"}, '"y"'),
    "additionalProperties schema": (
        {"type": "object", "additionalProperties": {"type": "integer"}},
        '{"a": "b"}',
    ),
    "not": ({"not": {"type": "string"}}, '"s"'),
    "if/then/else": (
        {"if": {"type": "string"}, "then": {"minLength": 3}, "else": {"type": "integer"}},
        '"a"',
    ),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table (byte-level BPE vocabularies use it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[i]`` (``[vocab]`` float) to -inf where bit ``i`` of ``bitmask`` (int32 words,
    bit ``i % 32`` of word ``i // 32``) is 0. One apply for every library (llguidance's own
    ``apply_token_bitmask_inplace`` goes through ``torch.compile``, which on a CPU build costs
    milliseconds a call; xgrammar's CPU kernel costs about what this does)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[: logits.shape[0]]
    logits.masked_fill_(torch.from_numpy(bits) == 0, float("-inf"))


class Llguidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        is_error, messages = self.ll.LLMatcher.validate_grammar_with_warnings(grammar, self.tok)
        if is_error:
            raise ValueError(messages[0])
        return grammar

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tok, compiled)

    def step(self, m, logits: torch.Tensor, token: int) -> bool:
        self.ll.torch.fill_next_token_bitmask(m, self.bitmask, 0)
        apply_bitmask(logits, self.bitmask[0])
        allowed = logits[token].item() != float("-inf")
        m.consume_token(token)
        return allowed


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def step(self, m, logits: torch.Tensor, token: int) -> bool:
        m.fill_next_token_bitmask(self.bitmask)
        apply_bitmask(logits, self.bitmask[0])
        allowed = logits[token].item() != float("-inf")
        m.accept_token(token)
        return allowed


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, hf_tokenizer, vocab_size: int):
        import outlines_core
        from outlines_core import json_schema

        self.oc = outlines_core
        self.json_schema = json_schema
        # Byte-level BPE: map the tokenizer's unicode stand-ins back to bytes.
        decoder = {v: k for k, v in _bytes_to_unicode().items()}
        vocab: dict[bytes, list[int]] = {}
        eos = hf_tokenizer.eos_token_id
        for text, idx in hf_tokenizer.get_vocab().items():
            if idx == eos or idx >= vocab_size:
                continue
            try:
                raw = bytes(decoder[c] for c in text)
            except KeyError:
                raw = text.encode()
            vocab.setdefault(raw, []).append(idx)
        self.vocab = outlines_core.Vocabulary(eos, vocab)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        regex = self.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def step(self, m, logits: torch.Tensor, token: int) -> bool:
        allowed_ids = m.get_tokens()
        mask = torch.full_like(logits, float("-inf"))
        mask[torch.tensor(allowed_ids, dtype=torch.long)] = 0
        logits.add_(mask)
        allowed = logits[token].item() != float("-inf")
        m.advance(token)
        return allowed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True, help="a model folder (its tokenizer)")
    parser.add_argument("--walks", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig, AutoTokenizer

    hf = AutoTokenizer.from_pretrained(args.model_dir)
    vocab_size = AutoConfig.from_pretrained(args.model_dir).vocab_size
    answer_ids = hf.encode(PERSON_ANSWER, add_special_tokens=False)
    print(f"tokenizer {args.model_dir}: vocab {vocab_size}; answer {len(answer_ids)} tokens")
    rows = []
    for cls in (Llguidance, Xgrammar, OutlinesCore):
        try:
            t = time.perf_counter()
            lib = cls(hf, vocab_size)
            setup_ms = (time.perf_counter() - t) * 1e3
        except ImportError as exc:
            print(f"{cls.name}: not installed ({exc})")
            continue
        t = time.perf_counter()
        compiled = lib.compile(PERSON)
        compile_ms = (time.perf_counter() - t) * 1e3
        per_token, first = [], []
        for _ in range(args.walks):
            t = time.perf_counter()
            m = lib.matcher(compiled)
            for i, token in enumerate(answer_ids):
                logits = torch.randn(vocab_size)
                t = time.perf_counter() if i else t
                allowed = lib.step(m, logits, token)
                (per_token if i else first).append((time.perf_counter() - t) * 1e6)
                if not allowed:
                    raise SystemExit(f"{cls.name}: the valid answer's token {token} was masked")
        refused, ignored = [], []
        for feature, (schema, invalid) in FEATURES.items():
            try:
                compiled_feature = lib.compile(schema)
                m = lib.matcher(compiled_feature)
            except Exception:  # noqa: BLE001 -- any refusal counts
                refused.append(feature)
                continue
            try:
                through = all(
                    lib.step(m, torch.zeros(vocab_size), t)
                    for t in hf.encode(invalid, add_special_tokens=False)
                )
            except Exception:  # noqa: BLE001 -- a matcher that raises on the token rejected it
                through = False
            if through:
                ignored.append(feature)
        rows.append(
            (
                cls.name,
                setup_ms,
                compile_ms,
                statistics.median(first) / 1e3,
                statistics.median(per_token),
                statistics.fmean(per_token),
                refused,
                ignored,
            )
        )
    print()
    print(
        f"{'library':<14} {'tokenizer ms':>12} {'compile ms':>11} {'1st token ms':>12} "
        f"{'us/token p50':>13} {'us/token mean':>14}"
    )
    for name, setup_ms, compile_ms, first_ms, p50, mean, _, _ in rows:
        print(
            f"{name:<14} {setup_ms:>12.1f} {compile_ms:>11.1f} {first_ms:>12.1f} "
            f"{p50:>13.1f} {mean:>14.1f}"
        )
    print()
    for name, *_, refused, ignored in rows:
        print(
            f"{name}: refuses {', '.join(refused) or '-'}; lets through {', '.join(ignored) or '-'}"
        )


if __name__ == "__main__":
    main()
