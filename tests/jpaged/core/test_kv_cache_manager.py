"""KVCacheManager with one full-attention group (a plain model's): all-or-nothing allocation,
waste, prefix lookup, commit timing, metrics. Tables and hits come per group: [group 0]."""

from __future__ import annotations

import pytest
from core_sim import make_request

from jpaged.core.block_hash import BlockHasher
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.prefix_cache_stats import RECENT_WINDOW
from jpaged.intmath import cdiv


def req(rid, prompt, bs=4, max_tokens=8, **kw):
    r = make_request(rid, prompt, max_tokens, **kw)
    r.set_block_hasher(BlockHasher(bs))
    return r


def snapshot(m: KVCacheManager):
    pool = m.block_pool
    return (ids_(pool.free_block_queue.get_all_free_blocks()),
            [(b.ref_count, b.block_hash, b.num_tokens) for b in pool.blocks],
            dict(pool.cached_blocks), {rid: m.get_block_ids(rid) for rid in m.request_ids()},
            {rid: m.num_cached_blocks(rid) for rid in m.request_ids()}, m.in_flight_hashes(),
            pool.num_evictions,
            m.stats.queries, m.stats.hits)


def ids_(blocks):
    return [b.block_id for b in blocks]


def run_prefill(m, r, hit=None):
    """Admit r with its prefix hit, compute the whole prompt, commit; returns hit tokens."""
    blocks, n = m.get_computed_blocks(r) if hit is None else hit
    assert m.allocate_slots(r, r.num_tokens - n, blocks, n) is not None
    r.num_computed_tokens = r.num_tokens
    m.commit(r)
    m.check_invariants()
    return n


def test_allocate_grows_on_demand_with_at_most_one_partial_block():
    m = KVCacheManager(4, 20, 200)
    r = req("r", list(range(9)))
    new = m.allocate_slots(r, 9)
    assert len(new) == 3 and [b.num_tokens for b in new] == [4, 4, 1]
    r.num_computed_tokens = 9
    m.commit(r)
    for t in range(9, 30):  # decode one token at a time
        r.append_output_token(t)
        got = m.allocate_slots(r, 1)
        assert len(got) == (1 if r.num_computed_tokens % 4 == 0 else 0)
        r.num_computed_tokens += 1
        m.commit(r)
        held = m.num_blocks_held("r")
        assert held == cdiv(r.num_computed_tokens, 4)  # waste < one block
        assert held * 4 - r.num_computed_tokens < 4
        m.check_invariants()
    m.free(r)
    assert m.usage == 0.0 and m.get_block_ids("r") == [[]]
    m.check_invariants()


def test_exhaustion_returns_none_and_changes_nothing():
    m = KVCacheManager(4, 6, 200)  # 5 usable blocks
    a = req("a", list(range(12)))
    run_prefill(m, a)  # 3 blocks, cached
    m.free(a)  # cached, free
    b = req("b", list(range(12)) + [50] * 6)
    c = req("c", [70] * 8)
    assert m.allocate_slots(c, 8) is not None  # 2 blocks: evicts nothing (2 never-used blocks)
    blocks, n = m.get_computed_blocks(b)
    assert n == 12  # 3 free cached blocks
    before = snapshot(m)
    # b needs its 3 hit blocks (free, cached) + 2 new ones: 5 > 3 free.
    assert m.allocate_slots(b, 6, blocks, n) is None
    assert snapshot(m) == before
    m.check_invariants()
    c2 = req("c2", [1] * 20)
    assert m.allocate_slots(c2, 20) is None and snapshot(m) == before
    m.free(c)
    assert m.allocate_slots(b, 6, blocks, n) is not None
    assert m.get_block_ids("b")[0][:3] == ids_(blocks[0])
    m.check_invariants()


def test_hit_blocks_are_not_evicted_by_the_same_allocation():
    m = KVCacheManager(4, 5, 200)  # 4 usable
    a = req("a", list(range(8)) + [1])
    run_prefill(m, a)
    m.free(a)  # blocks: 2 cached + 1 uncached, all free
    b = req("b", list(range(8)) + [2, 3, 4, 5, 6])
    blocks, n = m.get_computed_blocks(b)
    assert n == 8
    new = m.allocate_slots(b, 5, blocks, n)
    assert new is not None and len(new) == 2
    assert set(ids_(new)).isdisjoint(ids_(blocks[0]))
    assert all(blk.block_hash is not None for blk in blocks[0])
    m.check_invariants()


def test_last_token_always_recomputed():
    m = KVCacheManager(4, 20, 200)
    a = req("a", list(range(12)))  # exactly 3 full blocks
    run_prefill(m, a)
    same = req("same", list(range(12)))
    blocks, n = m.get_computed_blocks(same)
    assert n == 8 and len(blocks[0]) == 2  # (12 - 1) // 4 blocks
    longer = req("longer", list(range(13)))
    assert m.get_computed_blocks(longer)[1] == 12


def test_theoretical_hits_four_requests_share_three_blocks():
    bs = 16
    m = KVCacheManager(bs, 64, 512)
    shared = list(range(3 * bs))
    reqs = [req(f"r{i}", shared + [1000 + i] * 5, bs=bs) for i in range(4)]
    for r in reqs:
        run_prefill(m, r)
    assert m.stats.hits == 3 * bs * 3
    assert m.stats.queries == 4 * (3 * bs + 5)
    assert m.stats.requests == 4
    assert m.stats.hit_rate == pytest.approx(m.stats.hits / m.stats.queries)
    assert m.stats.recent_hit_rate == pytest.approx(m.stats.hit_rate)
    # Shared blocks are referenced by all four tables.
    first = m.get_block_ids("r0")[0][:3]
    assert all(m.get_block_ids(r.request_id)[0][:3] == first for r in reqs)
    assert all(m.block_pool.blocks[i].ref_count == 4 for i in first)
    for r in reqs:
        m.free(r)
    assert m.usage == 0.0
    m.check_invariants()


def test_blocks_shareable_only_after_commit_and_in_flight_tracking():
    m = KVCacheManager(4, 20, 200)
    a = req("a", list(range(10)))
    b = req("b", list(range(10)))
    assert m.allocate_slots(a, 10) is not None
    # a computes blocks 0, 1 this step: not cached yet, but in flight.
    assert m.get_computed_blocks(b) == ([[]], 0)
    assert m.is_prefix_in_flight(b, 0)
    a.num_computed_tokens = 10
    m.commit(a)
    assert not m.is_prefix_in_flight(b, 0)
    blocks, n = m.get_computed_blocks(b)
    assert n == 8 and blocks == [m.get_blocks("a")[0][:2]]
    # A freed request clears its in-flight marks.
    c = req("c", [5] * 9)
    m.allocate_slots(c, 9)
    assert m.is_prefix_in_flight(req("d", [5] * 9), 0)
    m.free(c)
    assert not m.in_flight_hashes()


def test_preempted_lookups_counted_apart_and_recent_window():
    m = KVCacheManager(4, 8, 200)
    a = req("a", list(range(9)))
    run_prefill(m, a)
    m.free(a)
    a.num_computed_tokens = 0
    a.num_preemptions = 1  # re-admission after a preemption
    assert run_prefill(m, a) == 8
    assert (m.stats.queries, m.stats.hits) == (9, 0)
    assert (m.stats.preempted_queries, m.stats.preempted_hits) == (9, 8)
    m.free(a)
    s = m.stats
    for _ in range(RECENT_WINDOW):
        s.record(10, 10, preempted=False)
    assert s.recent_hit_rate == 1.0 and s.hit_rate < 1.0


def test_prompt_logprobs_requests_are_no_prefix_cache_queries():
    """vLLM's test_prefill_plp: a request that skips the lookup (prompt_logprobs) is neither
    a query nor a hit, so the hit rate is of the requests that could hit."""
    m = KVCacheManager(4, 20, 200)
    run_prefill(m, req("plp0", list(range(13)), prompt_logprobs=1))
    assert (m.stats.requests, m.stats.queries, m.stats.hits) == (0, 0, 0)
    assert run_prefill(m, req("r1", list(range(13)))) == 12
    assert run_prefill(m, req("plp2", list(range(13)), prompt_logprobs=1)) == 0
    assert (m.stats.requests, m.stats.queries, m.stats.hits) == (1, 13, 12)
    assert m.stats.recent_hit_rate == 12 / 13


def test_reset_prefix_cache_restarts_the_recent_hit_rate_only():
    """vLLM's reset: the logged (recent) hit rate starts over, the totals keep counting; a
    refused reset (blocks in use) changes neither."""
    m = KVCacheManager(4, 20, 200)
    a = req("a", list(range(9)))
    run_prefill(m, a)
    b = req("b", list(range(9)))
    run_prefill(m, b)
    before = (m.stats.queries, m.stats.hits, m.stats.recent_hit_rate)
    assert before[2] > 0
    assert not m.reset_prefix_cache()  # a and b hold blocks
    assert m.stats.recent_hit_rate == before[2]
    m.free(a)
    m.free(b)
    assert m.reset_prefix_cache()
    assert m.stats.recent_hit_rate == 0.0
    assert (m.stats.queries, m.stats.hits) == before[:2]
    run_prefill(m, req("c", list(range(9))))  # nothing cached any more: a miss
    assert m.stats.recent_hit_rate == 0.0 and m.stats.queries == before[0] + 9


def test_caching_disabled_no_hits_no_hashes_needed():
    m = KVCacheManager(4, 20, 200, enable_caching=False)
    a = make_request("a", list(range(12)))
    run_prefill(m, a)
    b = make_request("b", list(range(12)))
    assert m.get_computed_blocks(b) == ([[]], 0)
    run_prefill(m, b)
    assert m.stats.queries == 0 and not m.block_pool.cached_blocks
    m.free(a)
    m.free(b)
    m.check_invariants()


def test_guards():
    m = KVCacheManager(4, 20, 16)
    r = req("r", list(range(10)))
    with pytest.raises(ValueError):
        m.allocate_slots(r, 11)  # more than the known tokens
    r2 = req("r2", list(range(17)))
    with pytest.raises(ValueError):
        m.allocate_slots(r2, 17)  # beyond max_model_len
    m.allocate_slots(r, 10)
    with pytest.raises(ValueError):
        m.allocate_slots(r, 0, [m.get_blocks("r")[0][:1]], 4)  # hits only on admission
