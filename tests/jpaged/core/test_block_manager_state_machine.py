"""A hypothesis state machine over BlockPool + KVCacheManager + prefix cache + host/disk tiers.

Rules drive the manager (through kv_model.KVModel) the way the scheduler does: requests arrive
and are admitted (device and host/disk prefix hits), grow, fork (n > 1: same prompt), touch
cached prefixes, evict (fill the pool with fresh tokens: offload), swap out / swap in, free,
reset the prefix cache, and steps end (the TransferPlan runs on a fake pool; reads checked).

After every rule the invariants of the brief are checked from outside (own counts, not only
``check_invariants``): each block is free with ref_count 0 or held with ref_count == the number
of tables holding it, never both; hash map and block hashes agree; free + used = total; no table
holds the null block; table sizes; host-tier slot ownership; and the CONTENT of every cached
device block, host entry and swap entry equals the tokens its hash/request stands for.

JPAGED_SM_EXAMPLES / JPAGED_SM_STEPS raise the budget for a long local run; with
JPAGED_SM_REPORT=1 the number of rule steps explored is printed at the end (pytest -s).
"""

from __future__ import annotations

import math
import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_model import ALPHABET, MAX_LEN, STATS, KVModel

tokens_st = st.lists(st.integers(1, ALPHABET), min_size=1, max_size=14)
pick_st = st.integers(0, 63)  # index into a list of candidates, taken modulo its length
chunk_st = st.integers(1, 24)
then_st = st.booleans()  # run a scheduler-like step right after the operation


class BlockManagerMachine(KVModel, RuleBasedStateMachine):
    """Random admit/grow/fork/touch/evict/swap/free/reset sequences over the KV block manager."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 16),
                host=st.just(0) | st.integers(2, 12), disk=st.integers(0, 6),
                caching=st.booleans() | st.just(True))
    def setup(self, block_size: int, num_blocks: int, host: int, disk: int,
              caching: bool) -> None:
        self.build(block_size, num_blocks, host, disk, caching)
        STATS["examples"] += 1

    @rule(prompt=tokens_st, seed=st.integers(0, 3), max_tokens=st.integers(1, 4),
          chunk=st.none() | chunk_st, then=then_st)
    def arrive(self, prompt: list[int], seed: int, max_tokens: int, chunk: int | None,
               then: bool) -> None:
        """A new request arrives; admitted at once unless chunk is None (then it waits)."""
        STATS["arrive"] += 1
        r = self._new(prompt, seed, max_tokens)
        if chunk is not None:
            self._admit(r, chunk)
        self._then(then)

    @precondition(lambda self: "waiting" in self.where.values())
    @rule(i=pick_st, chunk=chunk_st, then=then_st)
    def admit(self, i: int, chunk: int, then: bool) -> None:
        """Admit a waiting (new or recompute-preempted) request, reusing cached prefixes."""
        STATS["admit"] += 1
        r = self._pick("waiting", i)
        assert r is not None
        self._admit(r, chunk)
        self._then(then)

    @precondition(lambda self: any(w == "running" and rid not in self.sched
                                   for rid, w in self.where.items()))
    @rule(i=pick_st, chunk=chunk_st)
    def grow(self, i: int, chunk: int) -> None:
        """Schedule the next chunk (or decode token) of a running request."""
        STATS["grow"] += 1
        r = self._pick("running", i, lambda r: r.request_id not in self.sched)
        assert r is not None
        self.grow_one(r, chunk)

    @precondition(lambda self: bool(self.reqs))
    @rule(i=pick_st, seed=st.integers(0, 3), then=then_st)
    def fork(self, i: int, seed: int, then: bool) -> None:
        """n > 1: a sibling with the same prompt, admitted at once, sharing the prefix blocks."""
        STATS["fork"] += 1
        parent = list(self.reqs.values())[i % len(self.reqs)]
        self._admit(self._new(parent.prompt_token_ids, seed, parent.max_tokens), MAX_LEN)
        self._then(then)

    @precondition(lambda self: self.m.enable_caching and (
        self.m.block_pool.cached_blocks or self.m.tiers is not None))
    @rule(i=pick_st, suffix=tokens_st, seed=st.integers(0, 3), tier=st.sampled_from([0, 1, 2]),
          after=st.sampled_from(["none", "step", "preempt", "free"]))
    def touch_cached_prefix(self, i: int, suffix: list[int], seed: int, tier: int,
                            after: str) -> None:
        """A request whose prompt continues a chain cached on the device (tier 0), only on the
        host (1) or only on disk (2) is admitted: a reload through the tiers. `after`: what
        follows in the same step (preempt/free: before its loads have run)."""
        STATS["touch"] += 1
        m = self.m
        tiers: list[list[bytes]] = [list(m.block_pool.cached_blocks), [], []]
        if m.tiers is not None:
            tiers[1] = [h for h in m.tiers.host._lru if h not in m.block_pool.cached_blocks]
            if self.disk is not None:
                tiers[2] = [h for h in self.disk._index
                            if h not in m.block_pool.cached_blocks and h not in m.tiers.host]
        known = tiers[tier] or [h for t in tiers for h in t]
        if not known:
            return
        chain = self.chain_of[known[i % len(known)]]
        r = self._new(chain[:MAX_LEN - len(suffix)] + suffix, seed)
        hashes = r.block_hashes[:m.max_cache_hit_blocks(r)]
        dev = next((k for k, h in enumerate(hashes) if h not in m.block_pool.cached_blocks),
                   len(hashes))
        host = m.tiers.host if m.tiers is not None else None
        on_host = 0
        while host is not None and dev + on_host < len(hashes) and hashes[dev + on_host] in host:
            on_host += 1
        got = self._admit(r, MAX_LEN)
        if got is not None:
            assert got[0] == dev, "device lookup must return the longest cached chain"
            assert got[1] >= on_host, "host-tier entries continuing the chain must be hits"
            STATS["touch_hit_blocks"] += got[0] + got[1]
            if after == "preempt":
                self._preempt(r)
            elif after == "free":
                self._free(r.request_id)
        self._then(after == "step")

    @precondition(lambda self: self.m.num_free_blocks > 0)
    @rule(seed=st.integers(0, 10**6), frac=st.sampled_from([0.25, 0.5, 1.0, 1.0]),
          then=then_st, keep=st.booleans())
    def evict(self, seed: int, frac: float, then: bool, keep: bool) -> None:
        """Fill free blocks with fresh tokens: cached free blocks are evicted, and offloaded
        to the host tier (a gather), unless already there or every host slot is pinned.
        Unless `keep`, the filler is computed and freed at once (its blocks become cached)."""
        STATS["evict"] += 1
        m, pool = self.m, self.m.block_pool
        n = min(math.ceil(m.num_free_blocks * frac) * self.bs, MAX_LEN - 1)
        free_cached = {b.block_id: b.block_hash for b in pool.free_block_queue.get_all_free_blocks()
                       if b.block_hash is not None}
        ev0 = pool.num_evictions
        t = m.tiers
        on_host = set(t.host._lru) if t is not None else set()
        g0 = len(t.plan.gathers) if t is not None else 0
        dropped0 = m.tier_stats()["offload_dropped"]
        # A first token no other request has: the chain shares nothing with anything cached.
        rng = np.random.default_rng(seed)
        prompt = [1000 + self.next_id] + [int(x) for x in rng.integers(100, 900, n)]
        r = self._new(prompt, seed % 4, 1)
        if self._admit(r, n) is None:
            return
        ids = m.get_block_ids(r.request_id)[0]
        evicted = [b for b in ids if b in free_cached]
        assert pool.num_evictions - ev0 == len(evicted)
        # An evicted hash is gone from the device unless another copy of it (a duplicate the
        # eviction did not take) still holds its content.
        for b in evicted:
            kept = pool.cached_blocks.get(free_cached[b])
            assert kept is None or (kept.block_id not in evicted
                                    and kept.block_hash == free_cached[b])
        gone = [b for b in evicted if free_cached[b] not in pool.cached_blocks]
        if t is not None and m.enable_caching:
            # Each evicted hash not on the host yet is gathered into a host slot, or counted as
            # dropped (every slot pinned). A hash on the host may be spilled by a later alloc
            # of the same allocation and then dropped as well, hence <=.
            # (By hash: a content evicted in several copies is offloaded once, with its last.)
            need = {free_cached[b] for b in gone} - on_host
            gathers = dict(t.plan.gathers[g0:])
            assert set(gathers) <= set(evicted)
            for b, slot in gathers.items():
                assert t.host._lru[free_cached[b]] == slot and slot in t.host._pinned
            dropped = m.tier_stats()["offload_dropped"] - dropped0
            lost = need - {free_cached[b] for b in gathers}
            assert len(lost) <= dropped, "evicted block lost"
        STATS["evicted_blocks"] += len(evicted)
        if not keep:
            self.end_step()
            if r.request_id in self.reqs:
                self._free(r.request_id)
        self._then(then)

    @precondition(lambda self: self.m.tiers is not None and any(
        w == "running" and self.reqs[rid].num_computed_tokens > 0
        for rid, w in self.where.items()))
    @rule(i=pick_st)
    def swap_out(self, i: int) -> None:
        """Preempt a running request by swap (recompute fallback when the host tier is full)."""
        STATS["swap_out"] += 1
        r = self._pick("running", i, lambda r: r.num_computed_tokens > 0)
        assert r is not None
        self._preempt(r)

    @precondition(lambda self: "swapped" in self.where.values())
    @rule(i=pick_st, chunk=chunk_st)
    def swap_in(self, i: int, chunk: int) -> None:
        """Re-admit a swapped-out request: its blocks are loaded back from the host tier."""
        STATS["swap_in"] += 1
        r = self._pick("swapped", i)
        assert r is not None
        self._swap_in(r, chunk)

    @precondition(lambda self: bool(self.reqs))
    @rule(i=pick_st, then=then_st)
    def free(self, i: int, then: bool) -> None:
        """Finish or abort any live request (waiting, running or swapped out)."""
        STATS["free"] += 1
        self._free(list(self.reqs)[i % len(self.reqs)])
        self._then(then)

    @precondition(lambda self: self.m.block_pool.cached_blocks or (
        self.m.tiers is not None and self.m.tiers.host.num_prefix_entries))
    @rule()
    def reset_prefix_cache(self) -> None:
        """Refused while any block is in use; otherwise forgets every (unpinned) cached hash."""
        STATS["reset"] += 1
        m = self.m
        idle = m.num_free_blocks == m.block_pool.num_blocks - 1
        assert m.reset_prefix_cache() == idle
        if idle:
            assert not m.block_pool.cached_blocks
            assert all(b.block_hash is None for b in m.block_pool.blocks)
            if m.tiers is not None:
                assert set(m.tiers.host._lru.values()) <= m.tiers.host._pinned

    @precondition(lambda self: self.disk is not None and len(self.disk) > 0)
    @rule()
    def read_disk(self) -> None:
        """Every disk-tier block reads back (verified) as the tokens of its hash."""
        STATS["read_disk"] += 1
        for h in list(self.disk._index):
            data = self.disk.get(h)
            assert data is not None and data.tolist() == self.tokens_of[h]

    @precondition(lambda self: "running" in self.where.values())
    @rule(chunk=chunk_st)
    def schedule_all(self, chunk: int) -> None:
        """One scheduler-like step: every running request gets its next chunk; then end_step."""
        STATS["schedule_all"] += 1
        self._schedule_all(chunk)

    @precondition(lambda self: bool(self.reqs))
    @rule(chunk=chunk_st)
    def drain(self, chunk: int) -> None:
        """Scheduler-like steps (running, then swapped, then waiting requests) until every
        request finished; when nothing moves, the newest running request is preempted (swap or
        recompute) as memory pressure would, or a request that cannot fit is aborted."""
        STATS["drain"] += 1
        for _ in range(4 * MAX_LEN):
            if not self.reqs:
                return
            before = self._progress()
            self._schedule_all(chunk, admit=True)
            if self._progress() == before:
                running = self._ids("running")
                if running:
                    self._preempt(self.reqs[running[-1]])
                else:
                    self._free(next(iter(self.reqs)))
        for rid in list(self.reqs):  # a livelock between two requests too large together
            self._free(rid)

    @rule()
    def step(self) -> None:
        """End the step as it is."""
        STATS["end_step"] += 1
        self.end_step()

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def blocks_are_consistent(self) -> None:
        """Free/used/ref counts, hash map, tables and the null block, counted independently."""
        self.check_blocks()
        if hasattr(self, "m"):  # duplicates of a cached hash (the invariants above cover them)
            STATS["~states_with_duplicates"] += bool(self.m.block_pool.dups[0])

    @invariant()
    def content_matches_hashes(self) -> None:
        """Cached device blocks, host entries and swap entries hold the tokens they stand for."""
        self.check_content()

    @invariant()
    def events_replay_the_cache(self) -> None:
        """The KV cache events so far, replayed, give each tier's cached hashes exactly."""
        self.check_events()

    def teardown(self) -> None:
        """Free everything: every block returns to the free queue, no host slot leaks."""
        if hasattr(self, "m"):
            try:
                self.check_drained()
            finally:
                self.close()


TestBlockManagerStateMachine = BlockManagerMachine.TestCase
TestBlockManagerStateMachine.settings = settings(
    max_examples=int(os.environ.get("JPAGED_SM_EXAMPLES", "150")),
    stateful_step_count=int(os.environ.get("JPAGED_SM_STEPS", "50")),
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def teardown_module() -> None:
    """Print the exploration counts for the reliability doc (JPAGED_SM_REPORT=1, pytest -s)."""
    if os.environ.get("JPAGED_SM_REPORT"):
        steps = sum(v for k, v in STATS.items() if k not in (
            "examples", "touch_hit_blocks", "evicted_blocks", "swapped_out") and k[0] != "~")
        print(f"\nstate machine: {STATS['examples']} examples, {steps} rule steps; {dict(STATS)}")
