"""What one step of the continuous engine computes (issue 29).

Per step, under a token budget (``max_num_batched_tokens``):

1. **Running sequences first**, in priority order (interactive before batch, then arrival):
   a decoding sequence computes one token; a sequence still prefilling computes its next chunk.
   When the free blocks do not cover a running sequence's next positions, the running sequence
   that comes last in that order is **preempted** (recompute: its blocks are freed, it goes back
   to waiting with its prompt and generated tokens, and re-prefills when admitted again; the
   prefix cache usually gives most of its blocks back). A step never fails for lack of blocks.
2. **Waiting sequences next**, in the same order, while the budget, ``max_num_seqs`` and the
   free blocks allow: a new sequence takes the prefix cache's blocks for its leading full
   blocks, then its first chunk. Admission never preempts. Siblings of a request whose prompt
   is being prefilled wait: they fork from it (share its blocks) when that prefill ends.

Chunks. A prompt is computed in chunks of ``prefill_chunk`` tokens, counted from the sequence's
first uncached position, whatever else runs: a chunk that does not fit the step's budget waits
for the next step rather than being cut, so a sequence's computation never depends on its
neighbours (issue 29, CPU invariance) and a long prompt costs running decodes at most one chunk
a step.

Recompute. A preempted sequence computes again exactly what it computed before: its prompt in
the same chunks (a prefix-cache match is cut back to a chunk boundary, so the chunks after it
start where the first computation's did), then its generated tokens as one-query rows, as
their decodes were (up to ``prefill_chunk`` rows a step, cut to the step's budget: rows do not
depend on each other's shapes). Positions before ``Sequence.num_prefill_tokens`` are prefill,
the rest decode rows. A sequence parked by ``preempt_all`` (issue 30's hold) is admitted again
as a fresh prompt of its prompt plus its generated tokens: its whole length becomes prefill.

Admission closed (quiesce): new sequences and sequences parked by ``preempt_all`` wait;
running sequences and those preempted for blocks go on (the drain finishes them).
"""

from __future__ import annotations

from dataclasses import dataclass

from miserver.serving.engine.block_manager import BlockManager
from miserver.serving.engine.model_runner import ScheduledSeq
from miserver.serving.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Step limits.

    Attributes:
        max_num_seqs: the most running sequences.
        max_num_batched_tokens: the most tokens one forward pass computes.
        prefill_chunk: the most prompt tokens of one sequence in one step.
        prefix_cache: whether an admitted sequence takes blocks from the prefix cache (the
            ``n`` choices of a request fork from the first either way). Off on the CPU: a
            prompt whose head comes from the cache is computed in other shapes than the whole
            prompt and rounds otherwise (issue 29, CPU invariance).

    Raises:
        ValueError: a limit below 1, or a chunk larger than the budget.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefill_chunk: int = 256
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.prefill_chunk) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and prefill_chunk must be >= 1")
        if self.prefill_chunk > self.max_num_batched_tokens:
            raise ValueError("prefill_chunk must not exceed max_num_batched_tokens")


class StepScheduler:
    """The waiting and running sequences of one engine, and the choice of each step's work."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.admission_open = True
        self.preemptions = 0
        #: Sequences set aside by :meth:`schedule` because the whole cache cannot hold their
        #: next position (:meth:`overflows`); the engine ends them (``length``) and clears this.
        self.overlong: list[Sequence] = []

    # --- membership ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out (finished or aborted), freeing its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.blocks.free(seq)

    def preempt(self, seq: Sequence, parked: bool = False) -> None:
        """Free ``seq``'s blocks and send it back to waiting (recompute later)."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.parked = parked
        self.waiting.append(seq)
        self.preemptions += 1

    def preempt_all(self) -> int:
        """Park every running sequence (issue 30's hold); returns how many."""
        victims = list(self.running)
        for seq in victims:
            self.preempt(seq, parked=True)
        return len(victims)

    def _admissible(self, seq: Sequence) -> bool:
        if self.admission_open:
            return True
        return seq.status is SequenceStatus.PREEMPTED and not seq.parked

    def has_work(self) -> bool:
        """Whether a step would compute anything (running, or admissible waiting)."""
        return bool(self.running) or any(self._admissible(s) for s in self.waiting)

    # --- the step -----------------------------------------------------------------------------
    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Positions ``seq`` computes this step: a prefill chunk (never cut: it waits when it
        exceeds ``budget``, the caller checks) or decode rows (cut to ``budget``)."""
        start = seq.num_computed_tokens
        if start < seq.num_prefill_tokens:
            return min(seq.num_prefill_tokens - start, self.config.prefill_chunk)
        rows = min(seq.num_tokens - start, self.config.prefill_chunk)
        return max(1, min(rows, budget))

    def _align_match(self, seq: Sequence) -> None:
        """Cut a preempted sequence's prefix-cache match back to a prefill-chunk boundary (and
        a block boundary) before its prefill end, so its prefill chunks are the ones it computed
        first (module docstring, Recompute). A match reaching past the prefill end is kept: its
        blocks are prefill chunks and decode rows, as the sequence computed them."""
        taken = seq.num_computed_tokens
        if taken == 0 or taken >= seq.num_prefill_tokens:
            return
        chunk, bs = self.config.prefill_chunk, self.blocks.block_size
        keep = taken // chunk * chunk
        while keep % bs:
            keep -= chunk
        if keep < taken:
            self.blocks.keep_prefix(seq, keep)

    def overflows(self, seq: Sequence, target: int) -> bool:
        """Whether ``target`` positions of ``seq`` need more blocks than the whole cache has:
        alone in the cache it could never run (preempting it and recomputing it would loop
        for ever), so it ends as at the end of a context (``length``)."""
        return -(-target // self.blocks.block_size) > self.blocks.num_blocks

    def _set_aside(self, seq: Sequence) -> None:
        self.remove(seq)
        self.overlong.append(seq)

    def _prefilling_sibling(self, seq: Sequence) -> bool:
        if seq.group is None or seq.output_token_ids:
            return False
        return any(
            r.group is seq.group and not r.output_token_ids and r.num_computed_tokens < r.num_tokens
            for r in self.running
        )

    def schedule(self) -> tuple[list[ScheduledSeq], list[tuple[int, int]]]:
        """This step's work, and the ``(src, dst)`` block copies (copy on write) to do before
        the forward. Blocks for every scheduled position are allocated on return."""
        budget = self.config.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        order = sorted(self.running, key=Sequence.sort_key)
        i = 0
        while i < len(order):
            seq = order[i]
            n = self._chunk(seq, budget)
            if n > budget:
                i += 1
                continue
            target = seq.num_computed_tokens + n
            if self.overflows(seq, target):
                order.pop(i)
                self._set_aside(seq)
                continue
            while self.blocks.append_cost(seq, target) > self.blocks.num_free_blocks:
                victim = order.pop()
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                copies += self.blocks.prepare_append(seq, target)
                batch.append(self._item(seq, n))
                budget -= n
                i += 1
        for seq in sorted(self.waiting, key=Sequence.sort_key):
            if len(self.running) >= self.config.max_num_seqs or budget <= 0:
                break
            if not self._admissible(seq):
                continue
            if self._prefilling_sibling(seq):
                continue
            if seq.parked:  # a hold's re-prefill: a fresh prompt of everything it has
                seq.num_prefill_tokens = seq.num_tokens
            if self.config.prefix_cache and not (
                seq.wants_prompt_logprobs and not seq.prompt_logprobs_done
            ):
                self.blocks.match_prefix(seq)  # (an echo's prompt positions are all scored)
                if seq.status is SequenceStatus.PREEMPTED:
                    self._align_match(seq)
            n = self._chunk(seq, budget)
            target = seq.num_computed_tokens + n
            if self.overflows(seq, max(target, seq.num_tokens)):
                self._set_aside(seq)
                continue
            if n > budget or self.blocks.append_cost(seq, target) > self.blocks.num_free_blocks:
                self.blocks.free(seq)
                break
            copies += self.blocks.prepare_append(seq, target)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            seq.parked = False
            self.running.append(seq)
            batch.append(self._item(seq, n))
            budget -= n
        return batch, copies

    def _item(self, seq: Sequence, n: int) -> ScheduledSeq:
        end = seq.num_computed_tokens + n
        prompt_logits = (
            seq.wants_prompt_logprobs
            and not seq.prompt_logprobs_done
            and seq.num_computed_tokens < seq.num_prompt_tokens - 1
        )
        return ScheduledSeq(seq, n, sample=end == seq.num_tokens, prompt_logits=prompt_logits)
