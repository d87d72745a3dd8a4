"""A hypothesis state machine over KVCacheManager with KV cache groups over one pool, with
host and disk tiers.

Requests arrive (taking prefix hits every group accepts, on the device and continued on the
host/disk tiers), compute chunks and decode tokens past their windows, are preempted (recompute,
or swap to the host tier and back) and finish. A fake device pool holds one token id per slot:
each step first runs the tiers' transfer plan (gathers, then loads), then writes the request's
new tokens through every group's table, then checks
that every position the step's queries READ (all earlier positions for a full group, the last
W - 1 before the chunk for a sliding one) holds the request's own token. After every rule:
the manager's invariants (ref counts = tables holding a block, no block in two groups, nothing
held behind a window), each cached block's and host entry's content equals its hash's tokens,
and the sliding bound cdiv(W - 1 + chunk, bs) + 1 per request. At teardown every request is
freed: usage is 0.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
from core_sim import make_request
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jpaged.core.block_hash import BlockHasher
from jpaged.core.disk_tier import DiskTier
from jpaged.core.kv_cache_groups import (
    first_needed_block,
    kv_cache_layout,
    sliding_blocks_bound,
)
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.offload import HostTier, KVTiers
from jpaged.intmath import cdiv
from jpaged.kv_events import split_group_key

MAX_LEN = 24
MAX_CHUNK = 6
GROUP_TAG = 1000  # group g writes token + g * GROUP_TAG: a block read in the wrong group shows
LAYOUTS = [(None, "w"), ("w",), (None, "w", "w"), (None, None, "w")]


class GroupsMachine(RuleBasedStateMachine):
    """Random arrive / step / preempt / finish sequences over the manager with groups."""

    @initialize(kinds=st.sampled_from(LAYOUTS), window=st.integers(1, 9),
                block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 48),
                caching=st.booleans() | st.just(True), host=st.just(0) | st.integers(2, 24),
                disk=st.integers(0, 8), swap=st.booleans())
    def setup(self, kinds, window, block_size, num_blocks, caching, host, disk, swap) -> None:
        self.bs = block_size
        self.layout = kv_cache_layout([window if k == "w" else None for k in kinds])
        self.tmp = tempfile.mkdtemp(prefix="groups_sm_")
        tiers = None
        if host:
            store = DiskTier(self.tmp, disk * 4096, "fp", (block_size,), np.int64) if disk \
                else None
            tiers = KVTiers(HostTier(host, (block_size,), np.int64, store))
        self.swap = swap and tiers is not None
        self.m = KVCacheManager(block_size, num_blocks, MAX_LEN, caching, tiers=tiers,
                                layout=self.layout)
        self.fake = np.full((num_blocks, block_size), -1, np.int64)
        self.reqs: dict = {}
        self.running: list[str] = []
        self.tokens_of: dict[bytes, list[int]] = {}
        self.n = 0

    def _need_fits(self, r) -> bool:
        total = 0
        for g in self.layout.groups:
            full = cdiv(MAX_LEN, self.bs)
            w = g.sliding_window
            total += full if w is None else min(full, sliding_blocks_bound(w, MAX_CHUNK, self.bs))
        return total <= self.m.block_pool.num_blocks - 1

    @rule(prompt=st.lists(st.integers(1, 2), min_size=1, max_size=16),
          chunk=st.integers(1, MAX_CHUNK))
    def arrive(self, prompt, chunk) -> None:
        """A request arrives and is admitted with its prefix hit (if the pool allows)."""
        r = make_request(f"r{self.n}", prompt, MAX_LEN - len(prompt))
        self.n += 1
        r.set_block_hasher(BlockHasher(self.bs))
        if not self._need_fits(r):
            return
        self.reqs[r.request_id] = r
        self._admit(r, chunk)

    def _admit(self, r, chunk) -> None:
        m = self.m
        m.begin_step()
        restored = m.swapped_tokens(r.request_id)
        if restored is not None:  # swapped out: its window's blocks come back from the host
            num_new = min(chunk, r.num_tokens - restored)
            if m.swap_in(r, num_new) is None:
                return
            self.running.append(r.request_id)
            self._run(r, restored, num_new)
            return
        hit, n = m.get_computed_blocks(r)
        off = m.get_offloaded_blocks(r, n // self.bs)
        if off is not None:  # the tiers continue the hit
            n = off.num_blocks * self.bs
        num_new = min(chunk, r.num_tokens - n)
        if m.allocate_slots(r, num_new, hit, n, off) is None:
            self._transfers()
            return  # stays waiting
        r.num_computed_tokens = n
        self.running.append(r.request_id)
        self._run(r, n, num_new)

    def _transfers(self) -> None:
        """The step's device moves, as the runner runs them: all gathers, then all loads."""
        plan = self.m.take_tier_transfers()
        if plan is not None:
            store = self.m.tiers.host.store
            for b, slot in plan.gathers:
                store[slot] = self.fake[b]
            for slot, b in plan.loads:
                self.fake[b] = store[slot]

    @precondition(lambda self: any(rid not in self.running for rid in self.reqs))
    @rule(i=st.integers(0, 63), chunk=st.integers(1, MAX_CHUNK))
    def readmit(self, i, chunk) -> None:
        """A waiting (new or preempted) request is admitted again."""
        waiting = [rid for rid in self.reqs if rid not in self.running]
        self._admit(self.reqs[waiting[i % len(waiting)]], chunk)

    @precondition(lambda self: bool(self.running))
    @rule(i=st.integers(0, 63), chunk=st.integers(1, MAX_CHUNK), tok=st.integers(1, 3))
    def step(self, i, chunk, tok) -> None:
        """A running request computes its next chunk (or decodes one token)."""
        r = self.reqs[self.running[i % len(self.running)]]
        self.m.begin_step()
        if r.num_computed_tokens == r.num_tokens:  # prompt done: a new token to compute
            if r.num_tokens >= MAX_LEN:
                self._finish(r)
                return
            r.append_output_token(tok)
        start = r.num_computed_tokens
        num_new = min(chunk, r.num_tokens - start)
        if self.m.allocate_slots(r, num_new) is None:
            self._preempt(r)
            return
        self._run(r, start, num_new)

    def _run(self, r, start, num_new) -> None:
        """The device step: transfers, then write the new tokens through every group, then
        check what is read."""
        self._transfers()
        toks = r.all_token_ids
        ids = self.m.get_block_ids(r.request_id)
        bs = self.bs
        end = start + num_new
        for g, spec in enumerate(self.layout.groups):
            for p in range(start, end):
                b = ids[g][p // bs]
                assert b != 0, "a new token's block is the null block"
                self.fake[b, p % bs] = toks[p] + GROUP_TAG * g  # each group's own KV
            w = spec.sliding_window
            lo = 0 if w is None else max(0, start - w + 1)
            for p in range(lo, end):
                b = ids[g][p // bs]
                assert b != 0 and self.fake[b, p % bs] == toks[p] + GROUP_TAG * g, (
                    f"group {g} reads position {p} from block {b}: not this request's token")
            if w is not None:
                held = sum(1 for x in ids[g] if x)
                assert held <= sliding_blocks_bound(w, num_new, bs) or held <= cdiv(end, bs)
        r.num_computed_tokens = end
        self.m.commit(r)
        h = r.block_hashes
        for k in range(min(end // bs, len(h))):
            self.tokens_of[h[k]] = toks[k * bs:(k + 1) * bs]

    @precondition(lambda self: bool(self.running))
    @rule(i=st.integers(0, 63))
    def preempt(self, i) -> None:
        """Preemption: swap out (when the host tier takes it) or recompute."""
        self.m.begin_step()
        self._preempt(self.reqs[self.running[i % len(self.running)]])

    def _preempt(self, r) -> None:
        if not (self.swap and r.num_computed_tokens and self.m.swap_out(r)):
            self.m.free(r)
        self._transfers()  # a swap-out's gathers run before any later step writes
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        self.running.remove(r.request_id)

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, 63))
    def finish(self, i) -> None:
        """A request finishes (or is aborted) and frees its blocks."""
        rid = list(self.reqs)[i % len(self.reqs)]
        self._finish(self.reqs[rid])

    def _finish(self, r) -> None:
        self.m.free(r)
        if r.request_id in self.running:
            self.running.remove(r.request_id)
        del self.reqs[r.request_id]

    @invariant()
    def consistent(self) -> None:
        """Manager invariants; cached blocks hold their hash's tokens; windows are respected."""
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        for g, cached in enumerate(self.m.block_pool.group_maps):
            for h, b in cached.items():
                assert self.fake[b.block_id].tolist() == self._kv(h, g), (g, b)
        tiers = self.m.tiers
        if tiers is not None:
            host = tiers.host
            pinned = host._pinned
            for key, slot in host._lru.items():  # gathers of this step ran: contents final
                if slot not in pinned:
                    assert host.store[slot].tolist() == self._kv(*split_group_key(key)), key
        for rid in self.running:
            r = self.reqs[rid]
            ids = self.m.get_block_ids(rid)
            for g, spec in enumerate(self.layout.groups):
                if spec.sliding_window is not None:
                    first = first_needed_block(r.num_computed_tokens, spec.sliding_window,
                                               self.bs)
                    assert all(ids[g][first:]), "a block the window needs was freed"

    def _kv(self, block_hash: bytes, group: int) -> list[int]:
        """What group `group`'s block of this hash holds in the fake pool."""
        return [t + GROUP_TAG * group for t in self.tokens_of[block_hash]]

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for r in list(self.reqs.values()):
            self._finish(r)
        assert self.m.usage == 0.0
        self.m.check_invariants()
        if self.m.tiers is not None:
            assert self.m.tiers.host.num_swapped_requests == 0
        shutil.rmtree(self.tmp, ignore_errors=True)


TestGroupsMachine = GroupsMachine.TestCase
TestGroupsMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                      suppress_health_check=list(HealthCheck))
