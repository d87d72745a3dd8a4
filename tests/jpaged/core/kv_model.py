"""A driver and oracle for KVCacheManager with one full-attention group (+ prefix cache, host
and disk tiers), used by the state machine in test_block_manager_state_machine.py. The manager's
tables and hits come per group: this model reads group 0's, the only one.

``KVModel`` drives the manager the way the scheduler does, one engine step at a time, and keeps
its own record of what should be true: which requests run / wait / are swapped out, what each
was scheduled this step, and the tokens every block hash stands for. ``end_step`` runs the
step's TransferPlan against a fake device pool (one token id per slot; all gathers, then all
loads) as the runner would, checks that every scheduled request READS its own tokens, writes its
new tokens, commits and samples. ``check_*`` compare the manager with that record.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from jpaged.core.disk_tier import SUFFIX, DiskTier
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.offload import HostTier, KVTiers
from jpaged.intmath import cdiv
from jpaged.kv_events import BlockStored, CacheIndex, KVEventCollector
from jpaged.request import Request
from jpaged.sampling_params import SamplingParams

ALPHABET = 3  # prompt tokens 1..3: short prompts share prefixes (and whole blocks) often
MAX_LEN = 64  # max_model_len; a request reaching it finishes
STATS: Counter[str] = Counter()  # what a run explored (rule steps, hits, swaps, ...)


@functools.cache
def disk_block_bytes(block_size: int) -> int:
    """Bytes one (block_size,) int64 block takes in a DiskTier (header included)."""
    tmp = tempfile.mkdtemp(prefix="h6_probe_")
    try:
        probe = DiskTier(tmp, 10**6, "probe", (block_size,), np.int64)
        probe.put(b"\1" * 32, np.zeros(block_size, np.int64))
        return probe.stats["bytes_used"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class KVModel:
    """The manager under test, a fake device pool, and the expected state of every request."""

    def build(self, block_size: int, num_blocks: int, host: int, disk: int,
              caching: bool) -> None:
        """A manager of num_blocks blocks; a host tier of `host` slots (0: none) with a disk
        tier of `disk` blocks behind it (0: none), in a fresh temporary directory."""
        self.bs = block_size
        self.tmp = tempfile.mkdtemp(prefix="h6_sm_")
        self.disk: DiskTier | None = None
        tiers = None
        if host:
            if disk:
                self.disk = DiskTier(self.tmp, disk * disk_block_bytes(block_size), "fp",
                                     (block_size,), np.int64)
            tiers = KVTiers(HostTier(host, (block_size,), np.int64, self.disk))
        self.m = KVCacheManager(block_size, num_blocks, MAX_LEN, caching, tiers=tiers)
        # KV cache events, replayed into an index as a router would (check_events).
        self.events = KVEventCollector(block_size)
        self.index = CacheIndex()
        if caching:
            self.m.set_events(self.events)
        self.fake = np.full((num_blocks, block_size), -1, np.int64)  # the device pool
        self.reqs: dict[str, Request] = {}  # live requests
        self.where: dict[str, str] = {}  # rid -> "waiting" | "running" | "swapped"
        self.sched: dict[str, tuple[int, int]] = {}  # this step: rid -> (start, num_tokens)
        self.seed: dict[str, int] = {}
        self.tokens_of: dict[bytes, list[int]] = {}  # block hash -> the tokens of its block
        self.chain_of: dict[bytes, list[int]] = {}  # block hash -> all tokens up to its end
        self.next_id = 0

    def close(self) -> None:
        """Delete the temporary directory."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _new(self, prompt: list[int], seed: int, max_tokens: int = 4) -> Request:
        rid = f"r{self.next_id}"
        self.next_id += 1
        r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens))
        if self.m.block_hasher is not None:
            r.set_block_hasher(self.m.block_hasher)
        self.reqs[rid], self.where[rid], self.seed[rid] = r, "waiting", seed
        self._learn(r)
        return r

    def _learn(self, r: Request) -> None:
        bs, toks = self.bs, r.all_token_ids
        for i, h in enumerate(r.block_hashes):
            self.tokens_of.setdefault(h, toks[i * bs:(i + 1) * bs])
            self.chain_of.setdefault(h, toks[:(i + 1) * bs])

    def _then(self, then: bool) -> None:
        """A scheduler-like step if `then`."""
        if then:
            self._schedule_all(4)

    def _ids(self, state: str) -> list[str]:
        return [rid for rid, w in self.where.items() if w == state]

    def _pick(self, state: str, i: int, cond=lambda r: True) -> Request | None:
        cands = [self.reqs[rid] for rid in self._ids(state) if cond(self.reqs[rid])]
        return cands[i % len(cands)] if cands else None

    def _admit(self, r: Request, chunk: int) -> tuple[int, int] | None:
        """Lookup (device, then tiers) + allocate_slots, as Scheduler._admit; (device hit
        blocks, tier hit blocks) or None when the pool is short (then nothing changed)."""
        m, rid = self.m, r.request_id
        hit_blocks, hit = m.get_computed_blocks(r)
        blocks = hit_blocks[0]
        tier = m.get_offloaded_blocks(r, len(blocks))
        extra = tier.extra_blocks if tier is not None else 0
        hit += extra * self.bs
        n = min(chunk, r.num_tokens - hit)
        assert n >= 1, "a lookup must leave the last token to compute"
        free_before = m.num_free_blocks
        if m.allocate_slots(r, n, hit_blocks, hit, tier) is None:
            assert m.num_blocks_held(rid) == 0 and m.num_free_blocks == free_before
            STATS["~admit_short"] += 1
            return None
        STATS["~admitted"] += 1
        table = m.get_blocks(rid)[0]
        assert table[:len(blocks)] == blocks, "hit blocks head the table"
        if extra:
            loaded = table[len(blocks):len(blocks) + extra]
            assert {b.block_id for b in loaded} <= m.tiers.plan.load_targets
        r.num_computed_tokens = hit
        self.where[rid] = "running"
        self.sched[rid] = (hit, n)
        return len(blocks), extra

    # -- operations --------------------------------------------------------------------------------

    def grow_one(self, r: Request, chunk: int) -> None:
        """allocate_slots for the next chunk of a running request; all or nothing."""
        rid, m = r.request_id, self.m
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        before = (m.num_free_blocks, m.get_block_ids(rid))
        if m.allocate_slots(r, n) is None:
            assert (m.num_free_blocks, m.get_block_ids(rid)) == before
            return
        self.sched[rid] = (r.num_computed_tokens, n)

    def _preempt(self, r: Request) -> None:
        """Swap out (with a host tier and computed tokens) or recompute, as Scheduler._preempt."""
        rid, m = r.request_id, self.m
        if m.tiers is not None and r.num_computed_tokens > 0 and m.swap_out(r):
            assert m.swapped_tokens(rid) == r.num_computed_tokens
            self.where[rid] = "swapped"
            STATS["swapped_out"] += 1
        else:
            m.free(r)
            self.where[rid] = "waiting"
        assert m.num_blocks_held(rid) == 0
        self.sched.pop(rid, None)
        r.num_computed_tokens = 0
        r.num_preemptions += 1

    def _swap_in(self, r: Request, chunk: int) -> None:
        rid, m = r.request_id, self.m
        restored = m.swapped_tokens(rid)
        assert restored is not None and restored < r.num_tokens
        free0 = m.num_free_blocks
        if m.swap_in(r, min(chunk, r.num_tokens - restored)) is None:
            assert m.num_free_blocks == free0 and m.swapped_tokens(rid) == restored
            return
        assert r.num_computed_tokens == restored and m.swapped_tokens(rid) is None
        self.where[rid] = "running"
        self.sched[rid] = (restored, min(chunk, r.num_tokens - restored))

    def _free(self, rid: str) -> None:
        self.m.free(self.reqs.pop(rid))
        del self.where[rid], self.seed[rid]
        self.sched.pop(rid, None)
        assert self.m.num_blocks_held(rid) == 0 and self.m.swapped_tokens(rid) is None

    def _schedule_all(self, chunk: int, admit: bool = False) -> None:
        for rid in self._ids("running"):
            if rid not in self.sched:
                self.grow_one(self.reqs[rid], chunk)
        if admit:  # then swapped-out and waiting requests, as the scheduler's admission
            for rid in self._ids("swapped"):
                self._swap_in(self.reqs[rid], chunk)
            for rid in self._ids("waiting"):
                self._admit(self.reqs[rid], chunk)
        self.end_step()

    def _progress(self) -> dict[str, tuple]:
        return {rid: (self.where[rid], r.num_computed_tokens, r.num_tokens)
                for rid, r in self.reqs.items()}

    def end_step(self) -> None:
        """Run the step: transfers (gathers, then loads), reads, forward writes, commit, sample."""
        STATS["~engine_steps"] += 1
        m, bs, fake = self.m, self.bs, self.fake
        plan = m.take_tier_transfers()
        if plan is not None:
            store = m.tiers.host.store
            for b, slot in plan.gathers:  # all gathers read the pool as the last step left it
                store[slot] = fake[b]
            for slot, b in plan.loads:
                fake[b] = store[slot]
        for rid, (start, n) in self.sched.items():
            r, ids = self.reqs[rid], m.get_block_ids(rid)[0]
            toks = r.all_token_ids
            assert len(ids) == cdiv(start + n, bs)
            got = [int(fake[ids[p // bs], p % bs]) for p in range(start)]
            assert got == toks[:start], f"{rid} reads KV that is not its own"
            for p in range(start, start + n):
                blk = m.block_pool.blocks[ids[p // bs]]
                assert blk.ref_count == 1 and blk.block_hash is None, "write into a shared block"
                fake[blk.block_id, p % bs] = toks[p]
        for rid, (start, n) in list(self.sched.items()):
            r = self.reqs[rid]
            r.num_computed_tokens = start + n
            m.commit(r)
            if start + n == r.num_tokens:  # the step samples a token
                h = sum(r.all_token_ids[-3:]) + self.seed[rid]
                r.append_output_token(h % ALPHABET + 1)
                self._learn(r)
                if r.num_tokens >= MAX_LEN or r.num_output_tokens >= r.max_tokens:
                    self._free(rid)
        self.sched.clear()
        m.begin_step()

    # -- checks ------------------------------------------------------------------------------------

    def check_blocks(self) -> None:
        """Free/used/ref counts, hash map, tables and the null block, counted independently."""
        m, pool, bs = self.m, self.m.block_pool, self.bs
        m.check_invariants()
        free = pool.free_block_queue.get_all_free_blocks()
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free) == m.num_free_blocks
        refs: Counter[int] = Counter()
        running = self._ids("running")
        assert len(m.request_ids()) == len(running)
        for rid in running:
            r, table = self.reqs[rid], m.get_blocks(rid)[0]
            ids = [b.block_id for b in table]
            assert 0 not in ids and len(set(ids)) == len(ids), "null or repeated block in a table"
            start, n = self.sched.get(rid, (r.num_computed_tokens, 0))
            total = start + n
            assert len(ids) == cdiv(total, bs) >= 1
            for k, b in enumerate(table):
                assert b.num_tokens == min(bs, total - k * bs), "slot count of a table block"
            refs.update(ids)
        for rid in self._ids("waiting") + self._ids("swapped"):
            assert m.num_blocks_held(rid) == 0
            assert (m.swapped_tokens(rid) is not None) == (self.where[rid] == "swapped")
        null = pool.null_block
        assert null.ref_count == 0 and null.block_id not in free_ids and null.block_hash is None
        for b in pool.blocks[1:]:
            if b.block_id in free_ids:
                assert b.ref_count == 0 and refs[b.block_id] == 0, f"free block {b} is held"
            else:
                assert b.ref_count == refs[b.block_id] > 0, f"{b}: ref_count != holders"
            if b.block_hash is not None:  # the hash's primary, or one of its duplicates
                assert pool.cached_blocks[b.block_hash] is b or pool.dups[0].get(
                    b.block_hash, {}).get(b.block_id) is b
        assert len(free_ids) + len(refs) == pool.num_blocks - 1, "free + used != total"
        for h, b in pool.cached_blocks.items():
            assert b.block_hash == h
        if not m.enable_caching:
            assert not pool.cached_blocks

    def check_content(self) -> None:
        """Cached device blocks, host entries and swap entries hold the tokens they stand for."""
        m, pool, fake = self.m, self.m.block_pool, self.fake
        t = m.tiers
        loading = t.plan.load_targets if t is not None else set()
        for h, b in pool.cached_blocks.items():
            if b.block_id not in loading:  # a load target is filled when the plan runs
                assert fake[b.block_id].tolist() == self.tokens_of[h], f"cached {b} is stale"
        if t is None:
            return
        host = t.host
        # A slot a pending gather targets is filled from its source block when the plan runs.
        source = {slot: b for b, slot in t.plan.gathers}

        def content(slot: int) -> list[int]:
            return (fake[source[slot]] if slot in source else host.store[slot]).tolist()

        for h, slot in host._lru.items():
            assert content(slot) == self.tokens_of[h], "host prefix entry holds wrong tokens"
        for rid, e in host._swap.items():
            toks = self.reqs[rid].all_token_ids
            assert len(e.slots) == cdiv(e.num_tokens, self.bs)
            for k, slot in enumerate(e.slots):
                n = min(self.bs, e.num_tokens - k * self.bs)
                assert content(slot)[:n] == toks[k * self.bs:k * self.bs + n], "swap entry"
        if self.disk is not None:
            assert all(h in self.tokens_of for h in self.disk._index)

    def check_events(self) -> None:
        """Replaying the events so far gives every tier's hashes exactly; stored blocks carry
        their own tokens and their chain's parent."""
        bs = self.bs
        for e in self.events.take():
            if isinstance(e, BlockStored):
                assert e.block_size == bs and e.medium in ("GPU", "CPU", "DISK")
                if e.medium == "GPU":  # device blocks are always stated with their tokens
                    assert len(e.token_ids) == bs * len(e.block_hashes)
                for k, h in enumerate(e.block_hashes):
                    if e.token_ids:
                        assert e.token_ids[k * bs:(k + 1) * bs] == self.tokens_of[h]
                        parent = e.parent_block_hash if k == 0 else e.block_hashes[k - 1]
                        chain = self.chain_of[h]
                        assert (parent is None) == (len(chain) == bs)
                        if parent is not None:
                            assert self.chain_of[parent] == chain[:-bs]
            self.index.apply(e)
        assert self.index.blocks == self.m.cached_hashes(), "events replay != the pool's state"

    def check_drained(self) -> None:
        """Free everything: every block returns to the free queue, no host slot leaks."""
        for rid in list(self.reqs):
            self._free(rid)
        self.end_step()
        m = self.m
        assert m.usage == 0.0 and m.num_free_blocks == m.block_pool.num_blocks - 1
        assert not m.in_flight_hashes()
        m.check_invariants()
        ts = m.tier_stats()
        for k in ("offload_hits_blocks", "num_swapped_in", "num_swap_fallbacks",
                  "offload_dropped", "disk_hits_blocks"):
            STATS["~" + k] += ts[k]
        STATS["~prefix_hits_tokens"] += m.stats.hits
        if m.tiers is not None:
            host = m.tiers.host
            assert host.num_swapped_requests == 0
            assert host.num_used == host.num_prefix_entries, "host slots leaked"
        if self.disk is not None:
            files = list(Path(self.disk.directory).glob("*" + SUFFIX))
            assert len(files) == len(self.disk)
