"""BlockPool: allocation and free order, LRU eviction of free cached blocks, hash checks."""

import hashlib
import struct

import pytest

from services.worker.engine.block_pool import (
    NULL_BLOCK_ID,
    BlockHash,
    BlockPool,
    hash_block_tokens,
    hash_full_blocks,
)

BLOCK_SIZE = 16


def free_ids(pool: BlockPool) -> list[int]:
    return list(pool.free_queue)


def block_hashes(num_blocks: int, first_token: int = 0) -> list[BlockHash]:
    tokens = list(range(first_token, first_token + num_blocks * BLOCK_SIZE))
    return hash_full_blocks(tokens, BLOCK_SIZE)


def test_new_pool_reserves_null_block_and_queues_the_rest_in_id_order():
    pool = BlockPool(num_blocks=11, block_size=BLOCK_SIZE)
    assert pool.num_usable_blocks == 10
    assert pool.num_free_blocks == 10
    assert free_ids(pool) == list(range(1, 11))
    assert NULL_BLOCK_ID not in pool.free_queue
    assert pool.usage == 0.0


def test_allocate_pops_from_head_with_ref_cnt_one():
    pool = BlockPool(num_blocks=11, block_size=BLOCK_SIZE)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert free_ids(pool) == list(range(4, 11))
    assert pool.usage == pytest.approx(0.3)


def test_allocate_more_than_free_raises_and_takes_nothing():
    pool = BlockPool(num_blocks=11, block_size=BLOCK_SIZE)
    pool.allocate(8)
    assert not pool.can_allocate(3)
    with pytest.raises(ValueError):
        pool.allocate(3)
    assert free_ids(pool) == [9, 10]


def test_null_block_is_never_handed_out():
    pool = BlockPool(num_blocks=3, block_size=BLOCK_SIZE)
    assert [b.block_id for b in pool.allocate(2)] == [1, 2]
    assert not pool.can_allocate(1)


def test_free_puts_cached_blocks_at_tail_in_given_order_and_uncached_at_head():
    pool = BlockPool(num_blocks=11, block_size=BLOCK_SIZE)
    blocks = pool.allocate(3)
    hashes = block_hashes(2)
    assert pool.cache_full_block(blocks[0], hashes[0])
    assert pool.cache_full_block(blocks[1], hashes[1])
    # A request frees its blocks tail first; block 3 (a partial block) has no hash.
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    assert all(b.ref_cnt == 0 for b in blocks)


def test_free_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(num_blocks=11, block_size=BLOCK_SIZE)
    blocks = pool.allocate(10)
    hashes = block_hashes(3)
    for block, block_hash in zip(blocks[:3], hashes):
        pool.cache_full_block(block, block_hash)
    pool.free_blocks([blocks[2]])  # freed first: evicted first
    pool.free_blocks([blocks[0]])
    pool.free_blocks([blocks[1]])
    assert free_ids(pool) == [3, 1, 2]

    (evicted,) = pool.allocate(1)
    assert evicted.block_id == 3
    assert evicted.block_hash is None
    assert pool.get_cached_block(hashes[2]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.num_evicted_blocks == 1
    assert pool.num_cached_blocks == 2


def test_touch_takes_a_free_cached_block_off_the_queue_and_counts_refs():
    pool = BlockPool(num_blocks=11, block_size=BLOCK_SIZE)
    (block,) = pool.allocate(1)
    (block_hash,) = block_hashes(1)
    pool.cache_full_block(block, block_hash)
    pool.free_blocks([block])
    assert 1 in pool.free_queue

    hit = pool.get_cached_block(block_hash)
    assert hit is block
    pool.touch([hit])
    pool.touch([hit])
    assert block.ref_cnt == 2
    assert 1 not in pool.free_queue
    assert pool.num_free_blocks == 9

    pool.free_blocks([block])
    assert 1 not in pool.free_queue
    pool.free_blocks([block])
    assert free_ids(pool)[-1] == 1
    assert pool.get_cached_block(block_hash) is block  # still cached while free


def test_forged_hash_with_other_tokens_misses():
    pool = BlockPool(num_blocks=11, block_size=BLOCK_SIZE)
    (block,) = pool.allocate(1)
    (real,) = block_hashes(1)
    pool.cache_full_block(block, real)
    forged = BlockHash(real.value, tuple(range(100, 100 + BLOCK_SIZE)))
    assert pool.get_cached_block(forged) is None
    assert pool.get_cached_block(real) is block


def test_second_block_with_same_hash_is_not_cached():
    pool = BlockPool(num_blocks=11, block_size=BLOCK_SIZE)
    first, second = pool.allocate(2)
    (block_hash,) = block_hashes(1)
    assert pool.cache_full_block(first, block_hash)
    assert not pool.cache_full_block(second, block_hash)
    assert second.block_hash is None
    assert pool.get_cached_block(block_hash) is first


def test_only_full_blocks_are_cached():
    pool = BlockPool(num_blocks=11, block_size=BLOCK_SIZE)
    (block,) = pool.allocate(1)
    partial = hash_block_tokens(None, [1, 2, 3])
    with pytest.raises(ValueError):
        pool.cache_full_block(block, partial)


def test_caching_disabled_caches_nothing():
    pool = BlockPool(num_blocks=11, block_size=BLOCK_SIZE, enable_caching=False)
    (block,) = pool.allocate(1)
    (block_hash,) = block_hashes(1)
    assert not pool.cache_full_block(block, block_hash)
    assert pool.get_cached_block(block_hash) is None


def test_double_free_raises():
    pool = BlockPool(num_blocks=11, block_size=BLOCK_SIZE)
    (block,) = pool.allocate(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError):
        pool.free_blocks([block])


def test_reset_prefix_cache_forgets_every_hash():
    pool = BlockPool(num_blocks=11, block_size=BLOCK_SIZE)
    blocks = pool.allocate(2)
    hashes = block_hashes(2)
    for block, block_hash in zip(blocks, hashes):
        pool.cache_full_block(block, block_hash)
    pool.free_blocks([blocks[0]])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert all(pool.get_cached_block(h) is None for h in hashes)
    assert blocks[1].block_hash is None


def test_block_hash_is_sha256_of_parent_and_int64_tokens():
    tokens = list(range(BLOCK_SIZE))
    root = hash_block_tokens(None, tokens)
    expected = hashlib.sha256(struct.pack(f"<{BLOCK_SIZE}q", *tokens)).digest()
    assert root.value == expected
    child = hash_block_tokens(root, tokens)
    assert child.value == hashlib.sha256(expected + struct.pack(f"<{BLOCK_SIZE}q", *tokens)).digest()
    assert child.token_ids == tuple(tokens)


def test_chained_hash_depends_on_the_whole_prefix():
    a = hash_full_blocks([1] * 16 + [2] * 16, BLOCK_SIZE)
    b = hash_full_blocks([3] * 16 + [2] * 16, BLOCK_SIZE)
    assert a[1].token_ids == b[1].token_ids
    assert a[1].value != b[1].value
    assert hash_full_blocks([1] * 16 + [2] * 16, BLOCK_SIZE) == a


def test_hash_full_blocks_skips_partial_tail():
    assert len(hash_full_blocks(list(range(40)), BLOCK_SIZE)) == 2
    assert hash_full_blocks(list(range(15)), BLOCK_SIZE) == []
