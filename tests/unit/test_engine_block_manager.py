"""The continuous engine's block manager (issue 29): allocation, reference counts, the prefix
cache's hash chain, copy on write, and DROP_CACHE."""

from __future__ import annotations

import pytest

from miserver.serving.engine.block_manager import BlockManager, NoFreeBlocks
from miserver.serving.engine.generation import SamplingParams
from miserver.serving.engine.sequence import Sequence


def _seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(max_tokens=4, temperature=0))


def test_allocate_covers_positions_and_free_gives_every_block_back() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = _seq(list(range(9)))
    assert bm.blocks_needed(seq, 9) == 3
    bm.allocate(seq, 9)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 1
    with pytest.raises(NoFreeBlocks):
        bm.allocate(_seq([1] * 9, 1), 9)
    assert bm.num_free_blocks == 1  # a refused allocation takes nothing
    bm.free(seq)
    assert bm.num_free_blocks == 4 and seq.block_table == [] and seq.num_computed_tokens == 0


def test_full_computed_blocks_are_shared_by_a_later_sequence_with_the_same_prefix() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    first = _seq(list(range(10)))
    bm.allocate(first, 10)
    first.num_computed_tokens = 10
    bm.register_full_blocks(first)
    assert bm.cached_blocks == 2  # two full blocks; the partial third is not keyed
    second = _seq([*range(8), 99, 98, 97], 1)  # same first 8 tokens, then different
    taken = bm.match_prefix(second)
    assert taken == 8 and second.block_table == first.block_table[:2]
    assert second.num_computed_tokens == 8 and bm.prefix_hits == 2
    assert bm.ref_counts[first.block_table[0]] == 2
    # a prefix that differs in its first block shares nothing (the hash chain)
    third = _seq([5, *range(1, 11)], 2)
    assert bm.match_prefix(third) == 0


def test_a_prompt_that_is_all_cached_still_leaves_its_last_position_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    first = _seq(list(range(8)))
    bm.allocate(first, 8)
    first.num_computed_tokens = 8
    bm.register_full_blocks(first)
    again = _seq(list(range(8)), 1)
    assert bm.match_prefix(again) == 4  # not 8: the forward needs the last token's logits


def test_freed_keyed_blocks_stay_findable_until_reused_and_drop_forgets_them() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    first = _seq([1, 2, 3, 4, 5])
    bm.allocate(first, 5)
    first.num_computed_tokens = 5
    bm.register_full_blocks(first)
    bm.free(first)
    assert bm.num_free_blocks == 3 and bm.cached_blocks == 2
    back = _seq([1, 2, 3, 4, 5], 1)
    assert bm.match_prefix(back) == 4 and bm.num_free_blocks == 1
    bm.free(back)
    assert bm.drop_prefix_cache() == 2
    assert bm.match_prefix(_seq([1, 2, 3, 4, 5], 2)) == 0


def test_fork_shares_blocks_and_a_write_into_the_shared_partial_block_copies_it() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    parent = _seq(list(range(6)))
    bm.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = _seq(list(range(6)), 1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and child.num_computed_tokens == 6
    assert all(bm.ref_counts[b] == 2 for b in parent.block_table)
    assert bm.append_cost(child, 7) == 1  # position 6 is in the shared second block
    shared = child.block_table[1]
    copies = bm.prepare_append(child, 7)
    assert copies == [(shared, child.block_table[1])] and child.block_table[1] != shared
    assert bm.ref_counts[shared] == 1 and child.block_table[0] == parent.block_table[0]
    assert bm.append_cost(parent, 7) == 0  # the parent owns its block alone now


def test_a_sequence_started_before_a_drop_never_keys_its_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    seq = _seq([1, 2, 3, 4, 5])
    bm.allocate(seq, 5)
    seq.num_computed_tokens = 4
    bm.register_full_blocks(seq)
    assert bm.cached_blocks == 2
    bm.drop_prefix_cache()  # the weights changed: blocks 0-1 hold old-weight keys and values
    seq.num_computed_tokens = 5
    seq.output_token_ids.append(6)
    seq.num_computed_tokens = 6
    bm.register_full_blocks(seq)
    # not even the block computed after the drop: it attended to old-weight keys and values
    assert bm.cached_blocks == 0
    bm.free(seq)
    again = _seq([1, 2, 3, 4, 5, 6, 7], 1)  # a sequence started after the drop keys its blocks
    assert bm.match_prefix(again) == 0
    bm.allocate(again, 7)
    again.num_computed_tokens = 7
    bm.register_full_blocks(again)
    assert bm.cached_blocks == 3


def test_keep_prefix_gives_back_matched_blocks_past_a_boundary_which_stay_cached() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    first = _seq(list(range(14)))
    bm.allocate(first, 14)
    first.num_computed_tokens = 14
    bm.register_full_blocks(first)
    bm.free(first)
    free = bm.num_free_blocks
    again = _seq(list(range(14)), 1)
    assert bm.match_prefix(again) == 12
    kept = again.block_table[:1]
    bm.keep_prefix(again, 4)
    assert again.block_table == kept and again.num_computed_tokens == 4
    assert again.num_hashed_blocks == 1 and again.last_block_hash == bm.block_hashes[kept[0]]
    assert bm.num_free_blocks == free - 1 and bm.cached_blocks == 3  # the rest stay findable
    # the kept sequence goes on: its next blocks are keyed on the same chain as before
    bm.allocate(again, 14)
    again.num_computed_tokens = 14
    bm.register_full_blocks(again)
    assert bm.match_prefix(_seq(list(range(14)), 2)) == 12
    with pytest.raises(ValueError, match="cannot keep"):
        bm.keep_prefix(_seq([1, 2, 3], 3), 4)
