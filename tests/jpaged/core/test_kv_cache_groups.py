"""KV cache groups: the layout, sliding groups freeing behind the window, hits from the right."""

from __future__ import annotations

import pytest
from core_sim import make_request

from jpaged.core.block_hash import BlockHasher
from jpaged.core.kv_cache_groups import (
    blocks_needed,
    first_needed_block,
    kv_cache_layout,
    sliding_blocks_bound,
)
from jpaged.core.kv_cache_manager import KVCacheManager

GEMMA3 = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))


def req(rid, prompt, bs=4, max_tokens=64):
    r = make_request(rid, prompt, max_tokens)
    r.set_block_hasher(BlockHasher(bs))
    return r


def test_layout_groups_layers_by_kind_with_equal_sizes():
    lay = kv_cache_layout(GEMMA3)
    assert lay.num_groups == 6 and lay.num_slots == 3 and lay.is_hybrid
    assert [g.kind for g in lay.groups] == ["full"] + ["sliding"] * 5
    assert lay.groups[0].layers == (5, 11, 17)
    # every layer has exactly one (group, slot), slots 0..2 within each group
    assert sorted(zip(lay.group_of, lay.slot_of, strict=True)) == [
        (g, j) for g in range(6) for j in range(3)]
    alt = kv_cache_layout([4096, None] * 3)  # Gemma 2: alternating
    assert alt.num_groups == 2 and alt.num_slots == 3
    mistral = kv_cache_layout([64] * 4)
    assert mistral.num_groups == 1 and mistral.is_hybrid and mistral.num_slots == 4
    odd = kv_cache_layout([None] * 3 + [8] * 2)  # gcd 1: one layer per group
    assert odd.num_groups == 5 and odd.num_slots == 1


def test_layout_without_sliding_layers_or_disabled_is_one_full_group():
    for lay in (kv_cache_layout([None] * 4), kv_cache_layout(GEMMA3, hybrid=False)):
        assert lay.num_groups == 1 and not lay.is_hybrid
        assert lay.slot_of == tuple(range(lay.num_layers)) and set(lay.group_of) == {0}


@pytest.mark.parametrize("bad", [[0, None], [-3], [None, "x"]])
def test_layout_refuses_bad_windows(bad):
    with pytest.raises(ValueError, match="sliding window"):
        kv_cache_layout(bad)


def test_sliding_group_frees_behind_the_window_and_stays_bounded():
    bs, w = 4, 6
    lay = kv_cache_layout([None, w])
    m = KVCacheManager(bs, 64, 512, layout=lay)
    r = req("r", list(range(1, 11)), bs)
    chunk = 3
    while r.num_computed_tokens < r.num_tokens:
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        assert m.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
        m.commit(r)
        m.check_invariants()
    for t in range(40):  # decode past the window many times over
        r.append_output_token(100 + t)
        assert m.allocate_slots(r, 1) is not None
        full, sliding = m.live_block_ids("r")
        assert 0 not in full  # the full group keeps everything
        held = [b for b in sliding if b]
        assert len(held) <= sliding_blocks_bound(w, 1, bs)
        # every position a query of this step reads holds a real block
        first = first_needed_block(r.num_computed_tokens, w, bs)
        assert all(sliding[first:]) and not any(sliding[:first])
        r.num_computed_tokens += 1
        m.commit(r)
        m.check_invariants()
    assert m.num_freed_out_of_window > 0
    m.free(r)
    assert m.usage == 0.0
    m.check_invariants()


def test_hit_needs_only_the_window_blocks_found_from_the_right():
    bs, w = 4, 6  # a hit at block boundary k needs blocks covering tokens >= 4k - 5
    lay = kv_cache_layout([None, w])
    m = KVCacheManager(bs, 64, 512, layout=lay)
    prompt = list(range(1, 26))  # 6 full blocks + 1 token
    a = req("a", prompt, bs)
    assert m.allocate_slots(a, a.num_tokens) is not None
    a.num_computed_tokens = a.num_tokens
    m.commit(a)
    m.free(a)
    b = req("b", prompt, bs)
    hit, n = m.get_computed_blocks(b)
    assert n == 24
    full, sliding = hit
    assert len(full) == len(sliding) == 6 and all(not x.is_null for x in full)
    # the next query is at 24: it sees 19..24, blocks 4 and 5 only
    assert [x.is_null for x in sliding] == [True] * 4 + [False] * 2
    # Evict sliding block 5 from the map: the longest hit ending before it is at block 5 (n=20)
    # if blocks 3..4 are cached for it (they are).
    pool = m.block_pool
    blk = pool.group_maps[1][b.block_hashes[5]]
    pool.free_block_queue.remove(blk)
    pool._evict(blk)
    blk.ref_count = 0
    pool.free_block_queue.appendleft(blk)
    hit, n = m.get_computed_blocks(b)
    assert n == 20 and [x.is_null for x in hit[1]] == [True] * 3 + [False] * 2
    assert m.allocate_slots(b, b.num_tokens - n, hit, n) is not None
    b.num_computed_tokens = b.num_tokens
    m.commit(b)
    m.check_invariants()
    m.free(b)
    assert m.usage == 0.0


def test_hit_length_is_the_longest_every_group_accepts():
    bs = 2
    lay = kv_cache_layout([None, 3, 3])  # gcd 1: full, sliding, sliding
    m = KVCacheManager(bs, 64, 512, layout=lay)
    prompt = list(range(1, 12))
    a = req("a", prompt, bs)
    assert m.allocate_slots(a, a.num_tokens) is not None
    a.num_computed_tokens = a.num_tokens
    m.commit(a)
    m.free(a)
    pool = m.block_pool
    # drop block 4 from the second sliding group only: that group's hits end at 4 or before
    blk = pool.group_maps[2][a.block_hashes[4]]
    pool.free_block_queue.remove(blk)
    pool._evict(blk)
    pool.free_block_queue.appendleft(blk)
    hit, n = m.get_computed_blocks(req("b", prompt, bs))
    assert n == 8
    assert [len(h) for h in hit] == [4, 4, 4]


def test_blocks_needed_bounds_a_request():
    lay = kv_cache_layout(GEMMA3)
    # 8k tokens, block 16, chunk 512: 512 full blocks + 5 x (cdiv(511 + 512, 16) + 1) = 65
    assert blocks_needed(8192, lay, 16, 512) == 512 + 5 * 65
    assert blocks_needed(100, lay, 16, 512) == 6 * 7  # short: every group holds it all


def test_bad_flag_is_refused_by_name_and_tiers_work_with_groups():
    import numpy as np

    from jpaged.config import CacheConfig, SchedulerConfig
    from jpaged.core.offload import HostTier, KVTiers
    from jpaged.core.scheduler import Scheduler

    with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager"):
        CacheConfig(disable_hybrid_kv_cache_manager="yes")
    tiers = KVTiers(HostTier(4, (4,), np.int64))
    sched = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4), 32, tiers,
                      kv_layout=kv_cache_layout(GEMMA3))
    assert sched.kv_cache_manager.num_groups == 6
    assert sched.kv_cache_manager.tiers is tiers
    # no sliding layer: the flag changes nothing, the one manager runs one full group
    sched = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4), 32, tiers,
                      kv_layout=kv_cache_layout([None] * 4))
    assert sched.kv_cache_manager.num_groups == 1
