"""Fixed-size KV blocks: who holds which, and the cross-request prefix cache (issue 29).

The paged cache (:mod:`~miserver.serving.engine.kv_cache`) holds ``num_blocks`` blocks of
``block_size`` token positions each. A sequence's ``block_table`` lists its blocks in order:
position ``p`` lives in block ``block_table[p // block_size]`` at offset ``p % block_size``.

- **Reference counts.** A block is free at count 0. The ``n`` choices of one request share the
  prompt's blocks (count ``n``); a sequence that writes into a shared block copies it first
  (copy on write: :meth:`BlockManager.prepare_append` returns the ``(src, dst)`` pairs the cache
  must copy before the forward).
- **Prefix cache.** A full block, once its positions are computed, is keyed by a hash chain of
  its tokens (``hash((parent_hash, tokens))``), so another sequence whose tokens start the same
  (a repeated system prompt, a preempted sequence coming back) takes the block instead of
  recomputing it. A freed block keeps its key until it is reused for something else.
  :meth:`BlockManager.drop_prefix_cache` forgets every key (the weights table's ``DROP_CACHE``
  effect: nothing computed on old weights is reused).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq

from miserver.serving.engine.sequence import Sequence


class NoFreeBlocks(RuntimeError):
    """An allocation was asked for with no free block (callers check ``can_*`` first)."""


def block_hash(parent: int | None, tokens: Seq[int]) -> int:
    """The prefix-cache key of a full block: its tokens and every token before them (through
    ``parent``, the previous block's key; None for the first block)."""
    return hash((parent, tuple(tokens)))


class BlockManager:
    """Allocation of ``num_blocks`` blocks of ``block_size`` positions (module docstring).

    Not thread-safe: the engine thread alone calls it.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Free blocks, least recently freed first: a freed block with a key stays findable as
        # long as possible.
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.epoch = 0  # drop_prefix_cache() calls so far
        self.prefix_hits = 0  # blocks taken from the prefix cache
        self.prefix_queries = 0  # full blocks looked up

    # --- counts -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs for its table to cover ``num_tokens`` positions."""
        need = -(-num_tokens // self.block_size)
        return max(0, need - len(seq.block_table))

    def can_allocate(self, blocks: int) -> bool:
        return blocks <= len(self.free_blocks)

    # --- allocation ---------------------------------------------------------------------------
    def _take(self) -> int:
        if not self.free_blocks:
            raise NoFreeBlocks("no free KV block")
        block = self.free_blocks.popleft()
        old = self.block_hashes[block]
        if old is not None:  # reused for something else: its cached contents are gone
            if self.hash_to_block.get(old) == block:
                del self.hash_to_block[old]
            self.block_hashes[block] = None
        self.ref_counts[block] = 1
        return block

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:  # a free block with a key: out of the free list
            self.free_blocks.remove(block)
        self.ref_counts[block] += 1

    def match_prefix(self, seq: Sequence) -> int:
        """For a sequence with no blocks: take the cached full blocks its tokens start with
        (always leaving at least one position to compute, so the forward has a last token).
        Sets its table and ``num_computed_tokens`` / ``num_cached_tokens``; returns the number
        of positions taken."""
        if seq.block_table:
            raise ValueError("match_prefix needs a sequence with no blocks")
        tokens = seq.token_ids()
        bs = self.block_size
        parent: int | None = None
        taken = 0
        for index in range((len(tokens) - 1) // bs):
            start = index * bs
            key = block_hash(parent, tokens[start : start + bs])
            self.prefix_queries += 1
            block = self.hash_to_block.get(key)
            if block is None:
                break
            self._ref(block)
            seq.block_table.append(block)
            self.prefix_hits += 1
            taken += bs
            parent = key
        seq.num_computed_tokens = taken
        seq.num_cached_tokens = taken
        seq.num_hashed_blocks = taken // bs
        seq.last_block_hash = parent
        seq.hash_epoch = self.epoch
        return taken

    def keep_prefix(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks a :meth:`match_prefix` took past the first ``num_tokens``
        positions (a multiple of ``block_size``); they stay in the prefix cache.

        Raises:
            ValueError: ``num_tokens`` is not a multiple of ``block_size`` or exceeds the match.
        """
        bs = self.block_size
        if num_tokens % bs or num_tokens > seq.num_cached_tokens:
            raise ValueError(
                f"cannot keep {num_tokens} of {seq.num_cached_tokens} matched positions"
            )
        keep = num_tokens // bs
        for block in reversed(seq.block_table[keep:]):
            self.ref_counts[block] -= 1
            self.prefix_hits -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)  # keyed: findable until reused
        del seq.block_table[keep:]
        seq.num_computed_tokens = seq.num_cached_tokens = num_tokens
        seq.num_hashed_blocks = keep
        seq.last_block_hash = self.block_hashes[seq.block_table[-1]] if keep else None

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s table to cover ``num_tokens`` positions.

        Raises:
            NoFreeBlocks: fewer free blocks than needed (nothing is taken then).
        """
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_blocks):
            raise NoFreeBlocks(f"{need} blocks needed, {len(self.free_blocks)} free")
        if not seq.block_table:
            seq.hash_epoch = self.epoch
        for _ in range(need):
            seq.block_table.append(self._take())

    def cow_needed(self, seq: Sequence) -> bool:
        """Whether writing ``seq``'s next position hits a block another sequence shares."""
        pos = seq.num_computed_tokens
        index = pos // self.block_size
        return index < len(seq.block_table) and self.ref_counts[seq.block_table[index]] > 1

    def prepare_append(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Make ``seq``'s positions ``num_computed_tokens .. num_tokens - 1`` writable: new
        blocks at the end, and a private copy of a shared block they would write into. Returns
        ``(src, dst)`` block pairs whose contents the cache must copy before the forward.

        Raises:
            NoFreeBlocks: not enough free blocks (callers check :meth:`append_cost` first).
        """
        copies: list[tuple[int, int]] = []
        bs = self.block_size
        first = seq.num_computed_tokens // bs
        last = min((num_tokens - 1) // bs, len(seq.block_table) - 1)
        for index in range(first, last + 1):
            block = seq.block_table[index]
            if self.ref_counts[block] > 1:
                new = self._take()
                self.ref_counts[block] -= 1
                seq.block_table[index] = new
                copies.append((block, new))
        self.allocate(seq, num_tokens)
        return copies

    def append_cost(self, seq: Sequence, num_tokens: int) -> int:
        """Free blocks :meth:`prepare_append` would take."""
        bs = self.block_size
        first = seq.num_computed_tokens // bs
        last = min((num_tokens - 1) // bs, len(seq.block_table) - 1)
        shared = sum(1 for i in range(first, last + 1) if self.ref_counts[seq.block_table[i]] > 1)
        return shared + self.blocks_needed(seq, num_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (no blocks) shares every block of ``parent`` and its computed positions."""
        if child.block_table:
            raise ValueError("fork needs a child with no blocks")
        for block in parent.block_table:
            self._ref(block)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_hashed_blocks = parent.num_hashed_blocks
        child.last_block_hash = parent.last_block_hash
        child.hash_epoch = parent.hash_epoch

    def register_full_blocks(self, seq: Sequence) -> None:
        """Key ``seq``'s newly computed full blocks in the prefix cache. Each block is looked at
        once (``seq.num_hashed_blocks``). A sequence that started before the last
        :meth:`drop_prefix_cache` keys nothing more: its blocks hold, or attended to, keys and
        values of the old weights."""
        if seq.hash_epoch != self.epoch:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        start = seq.num_hashed_blocks
        if full <= start:
            return
        tokens = seq.token_ids()
        parent = seq.last_block_hash if start else None
        for index in range(start, full):
            key = block_hash(parent, tokens[index * bs : (index + 1) * bs])
            block = seq.block_table[index]
            if self.block_hashes[block] is None and key not in self.hash_to_block:
                self.hash_to_block[key] = block
                self.block_hashes[block] = key
            parent = key
        seq.num_hashed_blocks = full
        seq.last_block_hash = parent

    def free(self, seq: Sequence) -> None:
        """Give back every block of ``seq`` (a keyed block stays in the prefix cache until
        reused)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hashes[block] is None:
                    self.free_blocks.appendleft(block)  # nothing cached: reuse it first
                else:
                    self.free_blocks.append(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.num_hashed_blocks = 0
        seq.last_block_hash = None

    def drop_prefix_cache(self) -> int:
        """Forget every key (``DROP_CACHE``); returns how many blocks were keyed."""
        dropped = len(self.hash_to_block)
        self.epoch += 1
        self.hash_to_block.clear()
        self.block_hashes = [None] * self.num_blocks
        return dropped

    @property
    def cached_blocks(self) -> int:
        """Blocks keyed in the prefix cache."""
        return len(self.hash_to_block)
