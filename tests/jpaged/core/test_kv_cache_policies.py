"""The per-kind block policies and the cross-group hit search: what each kind needs, when it
frees, which hits it accepts; and one rule for a tier fetch that fails, whatever the groups."""

from __future__ import annotations

import numpy as np
import pytest
from core_sim import make_request

from jpaged.core.block_hash import BlockHasher
from jpaged.core.block_pool import BlockPool
from jpaged.core.kv_cache_groups import kv_cache_layout
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.kv_cache_policies import (
    NEVER,
    FullAttention,
    SlidingWindow,
    longest_common_hit,
)
from jpaged.core.offload import HostTier, KVTiers
from jpaged.intmath import cdiv
from jpaged.kv_events import group_key

HASHES = [bytes([i]) * 32 for i in range(12)]


def test_full_attention_needs_every_block_and_frees_nothing():
    p = FullAttention(4)
    assert p.first_held(1000) == 0 and p.release_point(0) == NEVER and not p.frees_behind
    held = set(HASHES[:5]) | {HASHES[7]}
    assert p.longest_hit(HASHES, held, 12) == 5  # from the left: 7 is past the gap
    assert p.longest_hit(HASHES, held, 3) == 3
    assert p.max_blocks(17, 8) == 5


def test_sliding_window_needs_the_window_and_frees_what_left_it():
    p = SlidingWindow(6, 4)  # a query at t reads keys from t - 5
    assert [p.first_held(t) for t in (0, 5, 6, 9, 10, 13)] == [0, 0, 0, 1, 1, 2]
    # release_point(s) is the fewest tokens at which position s is behind the window
    for s in range(5):
        t = p.release_point(s)
        assert p.first_held(t) > s and p.first_held(t - 1) <= s
    # a hit of m blocks needs blocks first_held(4m) .. m-1 only, found from the right
    held = set(HASHES[4:8])
    assert p.longest_hit(HASHES, held, 12) == 8  # 8 blocks: needs 6, 7
    held.discard(HASHES[6])
    assert p.longest_hit(HASHES, held, 12) == 6  # 6: needs blocks 4, 5
    assert p.max_blocks(1000, 3) == cdiv(6 - 1 + 3, 4) + 1
    pool = BlockPool(8)  # release_behind on a table
    table = pool.get_new_blocks(4)
    ids = [b.block_id for b in table]
    start, gone = p.release_behind(table, ids, 0, 13, pool.null_block)  # first_held(13) = 2
    assert start == 2 and len(gone) == 2 and ids[:2] == [0, 0] and table[0].is_null


def test_common_hit_rechecks_windows_whatever_the_group_order():
    """A full group after a sliding one shortens the hit: the window is asked again."""
    full, slide = FullAttention(4), SlidingWindow(6, 4)
    full_held = set(HASHES[:7])  # the full group's hits end at 7 blocks
    # The window accepts 9 blocks (needs 7, 8) and 5 (needs 3, 4), not 7 (needs 5, 6).
    slide_held = {HASHES[i] for i in (3, 4, 6, 7, 8)}
    assert slide.longest_hit(HASHES, slide_held, 12) == 9
    assert slide.longest_hit(HASHES, slide_held, 7) == 5
    for order in ((slide, full), (full, slide)):
        held = [slide_held if p is slide else full_held for p in order]
        assert longest_common_hit(order, HASHES, held, 12) == 5


@pytest.mark.parametrize("windows", [[None], [None, 6], [6]], ids=["plain", "hybrid", "slide"])
def test_a_failed_tier_fetch_ends_the_hit_before_it(windows):
    """Blocks only on the host tier; the fetch of position 4 fails (no host slot, a corrupt
    disk file): the hit is the longest ending at or before it, for one group or several (a
    window alone never needs it: its 8-block hit reads blocks 6 and 7 only)."""
    bs = 4
    tiers = KVTiers(HostTier(64, (bs,), np.int64))
    m = KVCacheManager(bs, 64, 128, tiers=tiers, layout=kv_cache_layout(windows))
    r = make_request("r", list(range(1, 34)), 4)  # 8 full blocks + 1 token
    r.set_block_hasher(BlockHasher(bs))
    for i, h in enumerate(r.block_hashes):
        for g in range(m.num_groups):
            tiers.on_device_evict(i + 1, group_key(h, g))
    bad = {group_key(r.block_hashes[4], g) for g in range(m.num_groups)}
    fetch = tiers.fetch
    tiers.fetch = lambda key: None if key in bad else fetch(key)
    assert m.get_computed_blocks(r)[1] == 0
    hit = m.get_offloaded_blocks(r, 0)
    n = 4 if None in windows else 8
    assert hit is not None and hit.num_blocks == hit.extra_blocks == n
    assert all(len(row) == n for row in hit.entries)
    assert m.allocate_slots(r, r.num_tokens - n * bs, [[] for _ in windows], n * bs,
                            hit) is not None
    assert len(tiers.plan.loads) == sum(n - p.first_held(n * bs) for p in m.policies)
    m.check_invariants()
