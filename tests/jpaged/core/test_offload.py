"""KV tiers on the host side (no jax): host-tier bookkeeping, offload on eviction, tier prefix
hits, swap preemption, the disk tier behind the host tier, and the ordering hazards of a step's
transfer plan. A fake device pool (one token id per slot) executes every plan the way the runner
does (all gathers, then all loads, then the forward), and core_sim's Sim checks that every
scheduled request reads exactly its own token history."""

from __future__ import annotations

import numpy as np
import pytest
from core_sim import Sim, make_request, reference_output

from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.block_hash import BlockHasher
from jpaged.core.disk_tier import DiskTier
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.offload import HostTier, KVTiers
from jpaged.core.scheduler import Scheduler

BS = 4


def tiers(capacity: int, disk: DiskTier | None = None) -> KVTiers:
    return KVTiers(HostTier(capacity, (BS,), np.int64, disk))


def disk_tier(path, blocks: int) -> DiskTier:
    probe = DiskTier(path / "probe", 10**6, "probe", (BS,), np.int64)
    probe.put(b"\1" * 32, np.zeros(BS, np.int64))
    size = probe.stats["bytes_used"]
    return DiskTier(path / "disk", blocks * size, "fp", (BS,), np.int64)


def scheduler(num_blocks: int, t: KVTiers | None, *, swap: bool = False, caching: bool = True,
              budget: int = 32) -> Scheduler:
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256)
    cc = CacheConfig(block_size=BS, enable_prefix_caching=caching,
                     preemption_mode="swap" if swap else "recompute")
    return Scheduler(sc, cc, num_blocks, t)


class TierSim(Sim):
    """Sim that executes each step's TransferPlan on the fake pool before the forward."""

    def __init__(self, sched: Scheduler, async_scheduling: bool = False) -> None:
        super().__init__(sched, async_scheduling)
        self.tokens_of: dict[bytes, list[int]] = {}  # block hash -> its tokens
        self.refilled = 0  # blocks gathered and re-filled (load or forward) in the same step

    def _note_hashes(self, requests) -> None:
        for r in list(requests):
            for i, h in enumerate(r.block_hashes):
                self.tokens_of[h] = r.all_token_ids[i * BS:(i + 1) * BS]

    def _apply(self, out, sampled) -> None:
        super()._apply(out, sampled)
        # Async: a request may hash its last block and finish before the next schedule().
        self._note_hashes(x.request for x in out.scheduled)

    def on_schedule(self, out) -> None:
        """Execute the step's TransferPlan on the fake pool (before the forward)."""
        kvm = self.sched.kv_cache_manager
        t = kvm.tiers
        plan = out.tier_transfers
        store = t.host.store
        gathered = {b for b, _ in plan.gathers}
        for b, slot in plan.gathers:  # 1: every gather reads the pool as the last step left it
            store[slot] = self.kv[b]
        for slot, b in plan.loads:  # 2: then the loads
            self.kv[b] = store[slot]
        written = set(plan.load_targets)
        for x in out.scheduled:
            end = x.start_pos + x.num_tokens
            written |= {x.block_ids[0][p // BS] for p in range(x.start_pos, end)}
        self.refilled += len(gathered & written)
        # Every host prefix entry holds its block's tokens.
        self._note_hashes(self.sched.requests.values())
        for h, slot in t.host._lru.items():
            assert store[slot].tolist() == self.tokens_of[h], "host entry holds wrong tokens"


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 7) % 900 for i in range(n)]


def check(finished, reqs):
    for r in reqs:
        assert finished[r.request_id].output_token_ids == reference_output(
            r.prompt_token_ids, r.sampling_params, 256), r.request_id


# -- HostTier bookkeeping ----------------------------------------------------------------------


def test_host_tier_lru_pins_and_deferred_release():
    h = HostTier(3, (BS,), np.int64)
    slots = [h.alloc_slot() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and h.alloc_slot() is None
    for i, s in enumerate(slots):
        h.insert(bytes([i]), s)
    assert h.lookup(b"\0") == slots[0]  # refresh: b"\1" is now the LRU entry
    h.pin(slots[1])
    assert h.num_available() == 2
    assert h.alloc_slot() == slots[2]  # LRU b"\1" is pinned: the next one goes
    assert b"\2" not in h and b"\1" in h
    h.release(slots[2])
    h.begin_step()
    assert h.num_available() == 3
    h.pin(slots[2])
    with pytest.raises(AssertionError):
        h.check_invariants()  # a free slot may not be pinned
    h.begin_step()
    h.check_invariants()
    with pytest.raises(ValueError, match="capacity"):
        HostTier(0, (BS,), np.int64)


def test_host_tier_spills_lru_victims_to_disk(tmp_path):
    disk = disk_tier(tmp_path, 8)
    h = HostTier(2, (BS,), np.int64, disk)
    for i in range(3):
        s = h.alloc_slot()
        h.store[s] = np.arange(BS) + 10 * i
        h.insert(bytes([i]) * 32, s)
    assert len(disk) == 1 and disk.get(b"\0" * 32).tolist() == list(range(BS))
    assert h.num_spilled == 1 and h.num_prefix_entries == 2


# -- scripted hazards at the KVCacheManager level ----------------------------------------------


def _run(m, fake, r, n=None):
    """Admit r (device + tier hits), run the plan then its forward, commit."""
    blocks, hit = m.get_computed_blocks(r)
    tier = m.get_offloaded_blocks(r, len(blocks[0]))
    extra = tier.extra_blocks if tier is not None else 0
    hit += extra * BS
    n = r.num_tokens - hit if n is None else n
    assert m.allocate_slots(r, n, blocks, hit, tier) is not None
    execute(m, fake)
    ids = m.get_block_ids(r.request_id)[0]
    for p in range(hit, hit + n):
        fake[ids[p // BS], p % BS] = r.all_token_ids[p]
    r.num_computed_tokens = hit + n
    m.commit(r)
    return extra


def execute(m, fake):
    plan = m.tiers.plan
    store = m.tiers.host.store
    for b, slot in plan.gathers:
        store[slot] = fake[b]
    for slot, b in plan.loads:
        fake[b] = store[slot]


def _req(rid, toks):
    r = make_request(rid, toks, 4)
    r.set_block_hasher(BlockHasher(BS))
    return r


def _reads(m, fake, r):
    ids = m.get_block_ids(r.request_id)[0]
    return [int(fake[ids[p // BS], p % BS]) for p in range(r.num_computed_tokens)]


def test_loaded_slot_is_pinned_and_not_reused_for_an_offload():
    t = tiers(2)
    m = KVCacheManager(BS, 5, 256, tiers=t)  # 4 usable blocks
    fake = np.full((5, BS), -1, np.int64)
    a = _req("a", prompt(1, 9))  # 2 full blocks + 1
    _run(m, fake, a)
    m.free(a)
    m.begin_step()
    c = _req("c", prompt(2, 16))  # 4 blocks: evicts a's 2 cached blocks -> host
    _run(m, fake, c)
    assert len(t.plan.gathers) == 2 and t.host.num_prefix_entries == 2
    m.free(c)  # c's 4 cached blocks free; host full with a's blocks
    m.begin_step()
    a2 = _req("a2", prompt(1, 9))
    # a2 loads both host slots (pinned); its 3 new blocks evict 3 of c's blocks, which find
    # every host slot pinned: their offload is dropped, the slots being read are not reused.
    assert _run(m, fake, a2) == 2
    loads = {s for s, _ in t.plan.loads}
    assert loads and not loads & {s for _, s in t.plan.gathers}
    assert t.stats["offload_dropped"] == 3 and t.stats["offload_hits_blocks"] == 2
    assert _reads(m, fake, a2) == a2.all_token_ids[:a2.num_computed_tokens]
    m.check_invariants()


def test_block_loaded_this_step_whose_owner_is_preempted():
    t = tiers(4)
    m = KVCacheManager(BS, 5, 256, tiers=t)
    fake = np.full((5, BS), -1, np.int64)
    a = _req("a", prompt(1, 9))
    _run(m, fake, a)
    m.free(a)
    m.begin_step()
    _run(m, fake, c := _req("c", prompt(2, 16)))  # evicts a's blocks to the host
    m.free(c)
    m.begin_step()
    a2 = _req("a2", prompt(1, 9))
    blocks, hit = m.get_computed_blocks(a2)
    tier = m.get_offloaded_blocks(a2, len(blocks[0]))
    assert tier is not None and tier.extra_blocks == 2
    slots = [x for x in tier.entries[0] if isinstance(x, int)]  # the host slots to load
    assert m.allocate_slots(a2, 1, blocks, hit + 2 * BS, tier) is not None
    a2.num_computed_tokens = 2 * BS
    loaded = set(t.plan.load_targets)
    # Preempted in the same schedule: its loaded blocks hold nothing yet, so swap falls back.
    assert not m.swap_out(a2) and t.stats["num_swap_fallbacks"] == 1
    m.free(a2)
    # A new request reuses the (cached, free) loaded blocks in the same step: their content is
    # on the host already, so nothing is gathered from them.
    before = len(t.plan.gathers)  # a2's own allocation evicted (and gathered) c's blocks
    d = _req("d", prompt(3, 16))
    assert m.allocate_slots(d, 16) is not None
    assert set(m.get_block_ids("d")[0]) & loaded
    assert not loaded & {b for b, _ in t.plan.gathers[before:]}
    execute(m, fake)
    for h, s in t.host._lru.items():
        assert s in slots or h not in a2.block_hashes
    m.check_invariants()


# -- whole workloads through the scheduler -------------------------------------------------------


def _workload(n=8):
    return [make_request(f"r{i}", prompt(i % 3, 9 + 5 * i) + [i], 8 + 3 * (i % 4),
                         arrival=float(i)) for i in range(n)]


def test_reasked_prompt_is_served_from_the_host_tier():
    s = scheduler(9, tiers(16))  # 8 usable blocks
    sim = TierSim(s)
    long = prompt(7, 22)  # 5 full blocks
    first = make_request("a", long, 4)
    s.add_request(first)
    sim.run()
    others = [make_request(f"o{i}", prompt(20 + i, 20), 6) for i in range(3)]
    for r in others:  # evict a's cached blocks
        s.add_request(r)
    sim.run()
    h0 = s.get_stats()["offload_hits_blocks"]
    again = make_request("b", long, 4)
    s.add_request(again)
    sim.run()
    st = s.get_stats()
    assert st["offload_hits_blocks"] - h0 == 5
    assert st["offload_hits_tokens"] == BS * st["offload_hits_blocks"]
    assert st["prefix_cache_hits"] >= 20 and st["offload_bytes_to_host"] > 0
    assert sim.refilled > 0  # some block was gathered and re-filled in one step
    check(sim.finished, [first, again, *others])


@pytest.mark.parametrize("caching", [True, False])
def test_swap_matches_recompute(caching):
    results = {}
    for mode in ("recompute", "swap"):
        s = scheduler(18, tiers(64), swap=mode == "swap", caching=caching)
        reqs = _workload()
        for r in reqs:
            s.add_request(r)
        sim = TierSim(s)
        results[mode] = {k: v.output_token_ids for k, v in sim.run().items()}
        check(sim.finished, reqs)
        st = s.get_stats()
        assert st["num_preemptions"] > 0 and st["num_swapped_requests"] == 0
        if mode == "swap":
            assert st["num_swapped_out"] == st["num_swapped_in"] > 0
            swap_prompt_tokens = st["prompt_tokens_total"]
        else:
            recompute_prompt_tokens = st["prompt_tokens_total"]
        if not caching:  # nothing is offloaded on eviction: only swapped blocks move
            assert st["offload_hits_blocks"] == 0 and st["host_tier_blocks"] == 0
    assert results["swap"] == results["recompute"]
    assert swap_prompt_tokens < recompute_prompt_tokens  # swapped KV is not recomputed


def test_swap_falls_back_to_recompute_when_the_host_tier_is_full():
    s = scheduler(18, tiers(1), swap=True)
    reqs = _workload()
    for r in reqs:
        s.add_request(r)
    sim = TierSim(s)
    sim.run()
    check(sim.finished, reqs)
    assert s.get_stats()["num_swap_fallbacks"] > 0


def test_swapped_out_request_aborted_frees_its_host_slots():
    s = scheduler(18, tiers(64), swap=True)
    reqs = _workload()
    for r in reqs:
        s.add_request(r)
    sim = TierSim(s)
    while not s.kv_cache_manager.tiers.host.num_swapped_requests:
        sim.step()
    rid = next(iter(s.kv_cache_manager.tiers.host._swap))
    s.abort_requests(rid)
    sim.run()
    host = s.kv_cache_manager.tiers.host
    assert s.get_stats()["num_swapped_requests"] == 0 and rid not in sim.finished
    host.begin_step()
    assert host.num_used == host.num_prefix_entries == s.get_stats()["host_tier_blocks"]


def test_disk_tier_behind_host_tier_and_corrupt_file(tmp_path):
    disk = disk_tier(tmp_path, 64)
    s = scheduler(9, tiers(4, disk))
    sim = TierSim(s)
    long = prompt(7, 22)
    reqs = [make_request("a", long, 4)] + [make_request(f"o{i}", prompt(20 + i, 20), 6)
                                           for i in range(3)]
    for r in reqs:
        s.add_request(r)
        sim.run()
    assert len(disk) >= 5
    # Corrupt one of a's blocks on disk (not the first: the chain stops there).
    path = disk.directory / (reqs[0].block_hashes[3].hex() + ".kvb")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    again = make_request("b", long, 4)
    s.add_request(again)
    sim.run()
    st = s.get_stats()
    assert st["disk_hits_blocks"] == 3 and st["offload_hits_blocks"] == 3
    assert st["disk_corrupt_skipped"] == 1 and st["disk_bytes_read"] > 0
    check(sim.finished, reqs + [again])


def test_offload_hit_tokens_count_each_prompt_position_once_in_a_hybrid_layout():
    """One full and one sliding group: a tier hit of 5 positions loads 7 block copies (the
    sliding group only its window's) and covers 20 prompt tokens, not 28 (found by vLLM's
    metrics tests, which count external hits in prompt tokens)."""
    from jpaged.core.kv_cache_groups import kv_cache_layout

    bs = 4

    def req(rid, prompt):
        r = make_request(rid, list(prompt), 8)
        r.set_block_hasher(BlockHasher(bs))
        return r

    m = KVCacheManager(bs, 16, 1024, layout=kv_cache_layout([None, 2 * bs]),
                       tiers=KVTiers(HostTier(64, (4,), np.int64)))
    prompt = list(range(1, 22))  # 21 tokens: 5 full blocks
    a = req("a", prompt)
    m.allocate_slots(a, 21)
    a.num_computed_tokens = 21
    m.commit(a)
    m.free(a)
    b = req("b", range(1000, 1000 + bs * (m.num_free_blocks // 2)))  # evicts a's: offloaded
    m.allocate_slots(b, b.num_tokens)
    m.free(b)
    m.begin_step()
    c = req("c", prompt)
    _, n = m.get_computed_blocks(c)
    hit = m.get_offloaded_blocks(c, n // bs)
    assert (n, hit.num_blocks) == (0, 5)
    m.allocate_slots(c, 21 - 20, offloaded=hit, num_new_computed_tokens=20)
    stats = m.tier_stats()
    assert (stats["offload_hits_blocks"], stats["offload_hits_tokens"]) == (7, 20)
    assert m.stats.hits == 20
