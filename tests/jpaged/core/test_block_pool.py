"""BlockPool and FreeKVCacheBlockQueue: order, ref counts, null block, LRU eviction, invariants."""

from __future__ import annotations

import pytest

from jpaged.core.block_hash import hash_request_blocks
from jpaged.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_ops_and_order():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 6 and ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    assert q.popleft().block_id == 0
    q.remove(blocks[3])  # from the middle
    assert ids(q.get_all_free_blocks()) == [1, 2, 4, 5]
    q.append(blocks[3])
    q.appendleft(blocks[0])
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 4, 5, 3]
    assert ids(q.popleft_n(3)) == [0, 1, 2]
    q.append_n([blocks[1], blocks[0]])
    assert ids(q.get_all_free_blocks()) == [4, 5, 3, 1, 0] and len(q) == 5
    with pytest.raises(ValueError):
        q.append(blocks[4])  # already queued
    for _ in range(5):
        q.popleft()
    assert q.num_free_blocks == 0
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.remove(blocks[2])


def test_free_queue_is_constant_time():
    n = 200_000
    blocks = [KVCacheBlock(i) for i in range(n)]
    q = FreeKVCacheBlockQueue(blocks)
    for b in blocks[::7]:
        q.remove(b)  # O(1) each: this loop would be quadratic on a list
    assert q.num_free_blocks == n - len(blocks[::7])


def test_null_block_and_usage():
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.get_num_free_blocks() == 4
    got = pool.get_new_blocks(4)
    assert 0 not in ids(got) and pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block])  # ignored, never queued
    pool.touch([pool.null_block])
    pool.check_invariants()
    pool.free_blocks(got)
    assert pool.get_usage() == 0.0
    pool.check_invariants()
    with pytest.raises(ValueError):
        BlockPool(1, True)


def test_ref_counts_and_double_free():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    assert a.ref_count == b.ref_count == 1
    pool.touch([a])  # a second table holds a
    assert a.ref_count == 2
    pool.free_blocks([a])
    assert a.ref_count == 1 and pool.get_num_free_blocks() == 1
    pool.check_invariants()
    pool.free_blocks([a, b])
    assert pool.get_num_free_blocks() == 3
    pool.check_invariants()
    with pytest.raises(ValueError):
        pool.free_blocks([a])


def _cache(pool, blocks, tokens, bs=2):
    hashes = hash_request_blocks(tokens, bs)
    pool.cache_full_blocks(hashes, blocks, 0, len(blocks))
    return hashes


def test_tail_first_free_evicts_tail_before_head():
    pool = BlockPool(5, enable_caching=True)
    chain = pool.get_new_blocks(3)
    hashes = _cache(pool, chain, [1, 2, 3, 4, 5, 6])
    pool.free_blocks(reversed(chain))  # tail first
    pool.check_invariants()
    # Eviction order is tail, middle, head; the never-used block 4 goes first of all.
    order = [pool.get_new_blocks(1)[0] for _ in range(4)]
    assert ids(order) == [4, chain[2].block_id, chain[1].block_id, chain[0].block_id]
    assert pool.num_evictions == 3 and not pool.cached_blocks
    assert all(pool.get_cached_block(h) is None for h in hashes)
    pool.check_invariants()


def test_lru_among_cached_blocks_and_touch_revives():
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    ha = _cache(pool, [a], [1, 1])[0]
    hb = _cache(pool, [b], [2, 2])[0]
    hc = _cache(pool, [c], [3, 3])[0]
    for blk in (b, a, c):  # freed in this order: LRU = b, a, c
        pool.free_blocks([blk])
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [b.block_id, a.block_id, c.block_id]
    pool.touch([pool.get_cached_block(hb)])  # reuse of a cached free block
    assert b.ref_count == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([b])  # most recently used again
    new = pool.get_new_blocks(1)[0]
    assert new is a and pool.get_cached_block(ha) is None
    assert pool.get_cached_block(hb) is b and pool.get_cached_block(hc) is c
    pool.check_invariants()


def test_block_in_use_never_evicted():
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    ha = _cache(pool, [a], [7, 7])[0]
    pool.free_blocks([b, c])
    got = pool.get_new_blocks(2)
    assert set(ids(got)) == {b.block_id, c.block_id}
    assert pool.get_cached_block(ha) is a and a.ref_count == 1 and pool.num_evictions == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.check_invariants()


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    _cache(pool, [a], [5, 5])
    pool.free_blocks([a])
    pool.free_blocks([b])  # uncached: goes to the front
    assert pool.get_new_blocks(1)[0] is b and pool.num_evictions == 0


def test_duplicate_blocks_stay_findable_until_the_last_copy_goes():
    """A block computed again with a cached block's content is cached too (vLLM): the first
    copy stays the primary; evicting it promotes the duplicate, so the content is findable
    until its last copy is evicted; events and the lower tier see the hash only once."""
    from jpaged.kv_events import BlockRemoved, BlockStored, KVEventCollector

    pool = BlockPool(3, enable_caching=True)  # blocks 1 and 2
    pool.events = KVEventCollector(block_size=2)
    offloaded = []
    pool.on_evict = lambda block_id, h: offloaded.append((block_id, h))
    a, b = pool.get_new_blocks(2)
    h = _cache(pool, [a], [9, 9])[0]
    _cache(pool, [b], [9, 9])
    assert pool.get_cached_block(h) is a and b.block_hash == h and pool.dups[0][h] == {2: b}
    pool.check_invariants()
    pool.free_blocks([a, b])  # a is evicted first, then b
    assert pool.get_new_blocks(1) == [a]
    assert pool.get_cached_block(h) is b and not pool.dups[0] and a.block_hash is None
    assert offloaded == []  # the content is still on the device
    pool.check_invariants()
    assert pool.get_new_blocks(1) == [b]
    assert pool.get_cached_block(h) is None and offloaded == [(2, h)]
    events = pool.events.take()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved]
    assert pool.num_evictions == 2
    pool.check_invariants()


def test_reset_prefix_cache_refused_while_in_use():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = _cache(pool, [a], [4, 4])[0]
    assert pool.reset_prefix_cache() is False and pool.get_cached_block(h) is a
    pool.free_blocks([b, a])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h) is None and a.block_hash is None
    pool.check_invariants()


def test_caching_disabled_registers_nothing():
    pool = BlockPool(3, enable_caching=False)
    a, = pool.get_new_blocks(1)
    _cache(pool, [a], [1, 2])
    assert not pool.cached_blocks and a.block_hash is None


def test_check_invariants_detects_corruption():
    pool = BlockPool(3, enable_caching=True)
    a, = pool.get_new_blocks(1)
    a.ref_count = 0  # in use but claims to be free
    with pytest.raises(AssertionError):
        pool.check_invariants()
