"""The KV block pool: reference counts, the least recently freed block handed out first, full blocks found again by
their tokens only through the chain of blocks before them.

    pytest -q tests/test_block_pool.py
"""

from __future__ import annotations

import pytest

from gptopt.infer.block_pool import NULL_BLOCK, BlockPool, NoFreeBlocks


def test_blocks_are_counted_out_and_back() -> None:
    pool = BlockPool(4, 2)
    a = pool.allocate(3)
    assert NULL_BLOCK not in a and len(set(a)) == 3 and pool.free == 1
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    pool.take(a[:1])  # shared by a second sequence
    pool.release(a)
    assert pool.free == 3  # a[0] still held once
    pool.release(a[:1])
    pool.check_idle()
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(a[:1])


def test_a_prompt_finds_the_full_blocks_of_a_finished_sequence_and_shares_them() -> None:
    pool = BlockPool(8, 2)
    blocks = pool.allocate(3)
    pool.register(blocks, [1, 2, 3, 4, 5], 0)  # two full blocks, the third holds one token
    pool.release(blocks)
    assert pool.lookup([1, 2, 3, 4, 9, 9]) == blocks[:2]
    assert pool.lookup([1, 2, 3, 5]) == blocks[:1]
    assert pool.lookup([2, 2, 3, 4]) == []  # the second block's tokens, but after another first block
    hit = pool.lookup([1, 2, 3, 4])
    pool.take(hit)
    pool.take(hit)  # two sequences, one copy
    assert pool.refs[hit[0]] == 2 and pool.free == 8 - 2


def test_the_least_recently_freed_blocks_go_first_and_lose_their_prefix() -> None:
    pool = BlockPool(4, 2)
    old, new = pool.allocate(2), pool.allocate(2)
    pool.register(old, [1, 1, 2, 2], 0)
    pool.register(new, [3, 3, 4, 4], 0)
    pool.release(old)
    pool.release(new)
    pool.allocate(2)  # reclaims the older sequence's blocks, its last block first
    assert pool.lookup([1, 1, 2, 2]) == []
    assert pool.lookup([3, 3, 4, 4]) == new


def test_a_cached_block_is_not_found_after_a_reclaimed_parent_holding_other_tokens() -> None:
    pool = BlockPool(2, 2)
    parent, child = pool.allocate(2)
    pool.register([parent, child], [1, 1, 2, 2], 0)
    pool.release([parent])  # the parent is freed first: it is reclaimed first, the child stays cached
    pool.release([child])
    assert pool.allocate(1) == [parent]
    pool.register([parent], [5, 5], 0)
    # the child's keys were computed after [1, 1]: a prompt [5, 5, 2, 2] must not take them
    assert pool.lookup([5, 5, 2, 2]) == [parent]
    assert pool.lookup([1, 1, 2, 2]) == []


def test_a_prefix_computed_twice_at_once_is_cached_once() -> None:
    pool = BlockPool(4, 2)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.register(a, [7, 7], 0)
    pool.register(b, [7, 7], 0)
    assert pool.lookup([7, 7]) == a and pool.cached == 1
    pool.release(a)
    pool.release(b)
    pool.check_idle()


def test_without_caching_nothing_is_found() -> None:
    pool = BlockPool(2, 2, caching=False)
    blocks = pool.allocate(1)
    pool.register(blocks, [1, 2], 0)
    assert pool.lookup([1, 2, 3]) == [] and pool.cached == 0


def test_blocks_chained_on_a_duplicate_are_not_found_once_its_registered_copy_holds_other_tokens() -> None:
    """Two sequences computed P at once (the second copy chains on the first); the first copy is reclaimed for X:
    the second sequence's next block, computed after P, must not be found after X."""
    P, X, T = [1, 2, 3, 4], [9, 9, 9, 9], [5, 6, 7, 8]
    pool = BlockPool(4, 4)
    a = pool.allocate(1)
    pool.register(a, P, 0)
    b = pool.allocate(2)
    pool.register(b, P, 0)  # a duplicate of a
    pool.release(a)
    pool.allocate(1)
    assert pool.allocate(1) == a  # a, reclaimed
    pool.register(a, X, 0)
    pool.register(b, P + T, 1)
    assert pool.lookup(X + T) == a
