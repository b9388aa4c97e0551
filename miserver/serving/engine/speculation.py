"""Prompt-lookup speculation for greedy sequences (issue 29, CPU speed).

A decode step on the CPU reads every weight once whatever its row count (SmolLM2-135M: 211
products over 270 MB of bfloat16, about 28 ms of a 44 ms one-sequence step on one core), so a
few more rows of the same sequence cost little. When few sequences run, the engine appends to
each greedy sequence up to :data:`DRAFT_TOKENS` draft tokens: the tokens that followed the
latest earlier occurrence of its last :data:`NGRAM_MAX` (down to :data:`NGRAM_MIN`) tokens, in
its prompt or its own output (:func:`propose`; no second model), on free blocks only (never by
preempting another sequence). The step computes the sequence's last token
and its drafts as one-query rows (as a preempted sequence recomputes its generated positions),
and the engine keeps the drafts the model itself would have produced: draft ``j`` stays while
the greedy token of the row before it equals it; the first row that disagrees gives the next
token, as does the last row when every draft stays.

Exactness. Each row is a one-query row over the sequence's own cached positions, computed as a
decode of that position computes it (the rows' bits do not depend on how many rows a pass holds:
:mod:`~miserver.serving.engine.cpu_linear`, :mod:`~miserver.serving.engine.model_runner`), so
a kept draft is the token a plain decode would have sampled, and greedy text is unchanged (the
engine's tests compare it with the engine without speculation). Only sequences sampled greedily
without logprobs, echo or a constraint are drafted (their tokens are the argmax alone).

When. Only in steps where every running sequence decodes, nothing waits, and at most
:data:`MAX_SEQS` run (the tail of a batch, a lone chat): there a step is bound by reading the
weights, and the drafts' rows are nearly free; a full batch is not. Measured: docs/decisions.md,
"Prompt-lookup speculation".
"""

from __future__ import annotations

from miserver.serving.engine.sequence import Sequence
from miserver.spec.settings import DEFAULT_SPECULATIVE_TOKENS

#: The most draft tokens a sequence gets a step on the CPU (``SPECULATIVE_TOKENS=auto``).
DRAFT_TOKENS = DEFAULT_SPECULATIVE_TOKENS["cpu"]

#: The longest suffix looked up (then shorter ones, down to :data:`NGRAM_MIN` tokens).
NGRAM_MAX = 3

#: The shortest suffix whose recurrence proposes drafts: a lone recurring token was right about
#: as often but cost twice the rows (docs/decisions.md, "Prompt-lookup speculation").
NGRAM_MIN = 2

#: Speculation runs only while at most this many sequences run.
MAX_SEQS = 8

#: A lone sequence (the step's extra rows nearly free) gets twice the drafts, from a recurrence
#: of at least this many tokens.
NGRAM_MIN_ALONE = 1


def propose(
    tokens: list[int], limit: int, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN
) -> list[int]:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of the longest suffix
    of ``tokens`` (``ngram_max`` tokens, then fewer, down to ``ngram_min``) found earlier in
    ``tokens``; ``[]`` when no such suffix recurs or ``limit`` < 1."""
    n = len(tokens)
    if limit < 1 or n < 2:
        return []
    longest = min(ngram_max, n - 1)
    last = tokens[-1]
    best_at, best_len = -1, 0
    for i in range(n - 2, -1, -1):  # i: the end of an earlier occurrence of the suffix
        if tokens[i] != last:
            continue
        length = 1
        while length < longest and i - length >= 0 and tokens[i - length] == tokens[-1 - length]:
            length += 1
        if length > best_len:
            best_at, best_len = i, length
            if length == longest:
                break
    if best_len < max(ngram_min, 1):
        return []
    return tokens[best_at + 1 : best_at + 1 + limit]


def eligible(seq: Sequence) -> bool:
    """Whether ``seq`` may be drafted this step: greedy, no logprobs, no echo, no constraint,
    and decoding (its prompt done, exactly its last token left to compute)."""
    params = seq.params
    return (
        params.temperature == 0
        and params.logprobs is None
        and not params.echo
        and seq.matcher is None
        and seq.num_computed_tokens >= seq.num_prefill_tokens
        and seq.num_computed_tokens == seq.num_tokens - 1
    )
