"""One sequence of the continuous engine: its tokens, its place in the paged cache, its state.

A request with ``n`` choices is ``n`` :class:`Sequence` s sharing one ``group`` (issue 29): the
first of the group to be admitted prefills the prompt, the others fork from it (its blocks,
shared with copy on write: :class:`~miserver.serving.engine.block_manager.BlockManager`).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from miserver.serving.engine.sampling import SamplingParams, SeedStream

_ARRIVALS = itertools.count()


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life (the engine's own states, not the weights table's)."""

    WAITING = "waiting"  # queued, never admitted
    RUNNING = "running"  # holds blocks; prefilling (in chunks) or decoding
    PREEMPTED = "preempted"  # was running; blocks freed; recomputes prompt + generated tokens
    FINISHED = "finished"  # ended (finish_reason says why); holds nothing


#: Lower values are admitted first (the values of :class:`~miserver.serving.engine.slot.Priority`).
INTERACTIVE = 1
BATCH = 2


@dataclass(frozen=True)
class TokenLogprobIds:
    """A sampled token's log-probability under the model's own (unmasked) distribution
    (natural log), with the ``top`` alternatives as ``(token_id, logprob)``, best first.
    Token text is left to the caller (it owns the tokenizer)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)
class Sequence:
    """One sequence (one choice of one request).

    Args:
        seq_id: the caller's id (any hashable; unique among live sequences of an engine).
        prompt_token_ids: the prompt (at least one token).
        params: sampling (:class:`~miserver.serving.engine.generation.SamplingParams`; its
            ``seed`` is this choice's own seed, see :func:`~miserver.serving.engine.sampling.choice_seed`).
        priority: :data:`INTERACTIVE` (1) before :data:`BATCH` (2); FCFS within a priority.
        group: an object shared by the ``n`` choices of one request (the prompt is prefilled
            once for the group); None for a lone sequence.
        stop_token_ids: token ids that end the sequence (finish_reason ``stop``; the token is
            reported and counted, as ``Generation`` counts an end token).
    """

    seq_id: Any
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = INTERACTIVE
    group: object | None = None
    stop_token_ids: frozenset[int] = frozenset()
    # --- state (the engine's) ---
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # positions whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, taken from the prefix cache at admission
    num_hashed_blocks: int = 0  # leading full blocks the prefix cache has looked at
    last_block_hash: int | None = None  # the hash chain's value after those blocks
    hash_epoch: int = 0  # the block manager's drop count when its first block was taken
    finish_reason: str | None = None
    parked: bool = False  # preempted by preempt_all: waits for open admission
    arrival: int = field(default_factory=lambda: next(_ARRIVALS))
    generator: SeedStream | None = None
    matcher: Any = None  # the constraint's matcher (SamplingParams.constraint), if any
    prompt_logprobs_done: bool = False
    # Positions computed as prefill chunks; every later position is computed as a one-query
    # (decode) row, also when a preempted sequence recomputes it, so a recompute repeats the
    # arithmetic of the first computation exactly (issue 29). The prompt's length at first; a
    # parked sequence's whole length when it is admitted again (issue 30: its re-prefill is a
    # fresh request's prefill of prompt + produced tokens).
    num_prefill_tokens: int = 0

    def __post_init__(self) -> None:
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        if not self.prompt_token_ids:
            raise ValueError("the prompt has no tokens")
        self.num_prefill_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)
        if self.params.seed is not None and self.params.temperature > 0:
            self.generator = SeedStream(self.params.seed)
        constraint = getattr(self.params, "constraint", None)
        if constraint is not None:
            self.matcher = constraint.new_matcher()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        """Prompt plus generated tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """``echo`` with ``logprobs``: the prompt's own positions are scored once."""
        return bool(self.params.echo and self.params.logprobs is not None)

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)


@dataclass
class SequenceOutput:
    """What one step produced for one sequence.

    Attributes:
        seq_id: the sequence's id.
        new_token_ids: tokens this step produced (usually 0 or 1; more when speculation kept
            drafts: :mod:`~miserver.serving.engine.speculation`; an end token included).
        logprobs: one :class:`TokenLogprobIds` per new token when ``params.logprobs`` is set.
        prompt_logprobs: for ``echo`` with ``logprobs``, once, when the prompt is prefilled:
            entry ``i`` scores prompt token ``i + 1`` (the first prompt token has none).
        finished: the sequence ended; ``finish_reason`` is ``stop``, ``length``, ``cancelled``
            (or the reason given to ``abort``), or ``error`` (``error`` set).
        first: this step ended the sequence's (first) prefill.
    """

    seq_id: Any
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobIds] | None = None
    prompt_logprobs: list[TokenLogprobIds] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: BaseException | None = None
    first: bool = False
