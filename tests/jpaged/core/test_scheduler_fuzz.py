"""Scheduler fuzz: seeded random workloads (arrivals between steps, prompt/output lengths,
priorities, aborts) against a tiny pool, with and without prefix caching, recompute, recompute
with a host/disk offload tier, and swap; chunked prefill on/off; fcfs/priority/lpm policies.

Every step is checked by core_sim's Sim (TierSim with tiers: the step's TransferPlan runs on a
fake pool first). On top of that, each step's preemptions are checked FROM OUTSIDE against the
documented preemption order, using only what the scheduler shows (its running/waiting requests
before the step, and the step's output): victims come from the requests running at the step's
start, the prompt-phase ones before any decoding one, least important first within each phase,
each strictly less important than some request that could have needed the memory; and they are
requeued at the front of their priority class. At the end: every non-aborted request finished
with the tokens of an unconstrained run (reference_output) and no block or host slot leaked.

JPAGED_FUZZ_SEEDS raises the number of workloads per configuration for a long local run;
JPAGED_FUZZ_REPORT=1 prints the figures (requests, preemptions, swaps, aborts).
"""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest
from core_sim import Sim, make_request, reference_output
from test_offload import TierSim, disk_tier, tiers

from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.scheduler import Scheduler, is_decoding
from jpaged.intmath import cdiv
from jpaged.request import Request, RequestStatus

MAX_LEN = 40
SEEDS = int(os.environ.get("JPAGED_FUZZ_SEEDS", "40"))
FIGURES: Counter[str] = Counter()  # summed over every workload of the run
BASES = [[(b * 41 + i * 7) % 900 for i in range(MAX_LEN)] for b in range(3)]


def importance(policy: str, r: Request) -> tuple:
    """The scheduler's order of importance (smaller = more important), by policy."""
    return (r.arrival_time, r.seq) if policy == "fcfs" else (r.priority, r.arrival_time, r.seq)


def check_preemptions(s: Scheduler, running: list[tuple[Request, bool]], waiting: list[Request],
                      preempted: list[str]) -> None:
    """The documented preemption order, from the running (request, decoding?) pairs and the waiting
    requests seen before a step and the ids the step preempted."""
    if not preempted:
        return
    key = lambda r: importance(s.policy, r)  # noqa: E731
    by_id = {r.request_id: (r, dec) for r, dec in running}
    assert all(rid in by_id for rid in preempted), "a victim was not running at the step start"
    victims = [by_id[rid] for rid in preempted]
    for phase in (False, True):  # prompt phase, then decoding
        members = sorted((r for r, dec in running if dec == phase), key=key, reverse=True)
        chosen = [r for r, dec in victims if dec == phase]
        assert chosen == members[:len(chosen)], "victims must be the least important first"
    gone: set[str] = set()
    for v, dec in victims:
        if dec:  # a decoding victim: every prompt-phase request still running is more important
            assert all(key(u) < key(v) for u, d in running
                       if not d and u.request_id not in gone), "prompt phase must go first"
        # Someone strictly more important could have asked for the memory: a running request,
        # or (priority/lpm admission) a waiting one of a strictly smaller priority value.
        assert any(key(q) < key(v) for q, _ in running) or (
            s.policy != "fcfs" and any(q.priority < v.priority for q in waiting)), \
            f"{v.request_id} preempted by nobody more important"
        gone.add(v.request_id)
    # Requeued at the front of their class: only more important victims of this step are ahead.
    cls = (lambda r: 0) if s.policy == "fcfs" else (lambda r: r.priority)
    order = list(s.waiting)
    ids = set(preempted)
    for pos, v in enumerate(order):
        if v.request_id in ids:
            for u in order[:pos]:
                assert cls(u) < cls(v) or (u.request_id in ids and key(u) < key(v)), \
                    f"{v.request_id} is not at the front of its class"


def run_workload(seed: int, mode: str, policy: str, tmp_path) -> None:
    """One random workload through one scheduler configuration; asserts everything."""
    rng = random.Random(seed)
    caching, chunked = bool(seed & 1), bool(seed & 2)
    bs = 4 if mode != "recompute" else rng.choice([1, 2, 4, 8])
    n_req = rng.randint(3, 12)
    specs = []
    for i in range(n_req):
        plen = rng.randint(1, 24)
        share = rng.randint(0, plen)
        prompt = BASES[rng.randrange(3)][:share] + [rng.randrange(900) for _ in range(plen - share)]
        specs.append((f"s{seed}r{i}", prompt, rng.randint(1, 12), rng.randint(0, 2),
                      rng.randint(0, 12),  # arrival step
                      rng.choice([None, None, None, rng.randint(0, 20)])))  # abort after k steps
    need = max(cdiv(min(MAX_LEN, len(p) + mt) - 1, bs) for _, p, mt, *_ in specs)
    num_blocks = 1 + need + rng.choice([0, 0, 1, 2, 4, 8])
    budget = rng.randint(1, 32) if chunked else MAX_LEN + rng.randint(0, 8)
    threshold = rng.choice([None, rng.randint(1, 8)])
    max_num_seqs = rng.randint(1, 6)
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         max_model_len=MAX_LEN, enable_chunked_prefill=chunked,
                         long_prefill_token_threshold=threshold, scheduling_policy=policy)
    cc = CacheConfig(block_size=bs, enable_prefix_caching=caching,
                     preemption_mode="swap" if mode == "swap" else "recompute")
    async_scheduling = rng.random() < 0.5  # the overlapped loop's order of updates
    FIGURES["async_runs"] += async_scheduling
    if mode == "recompute":
        s = Scheduler(sc, cc, num_blocks)
        sim: Sim = Sim(s, async_scheduling)
    else:  # TierSim's fake pool has blocks of 4 tokens
        disk = disk_tier(tmp_path / f"d{seed}", rng.randint(1, 8)) if rng.random() < 0.4 else None
        s = Scheduler(sc, cc, num_blocks, tiers(rng.randint(1, 3 * need), disk))
        sim = TierSim(s, async_scheduling)

    pending = sorted(specs, key=lambda x: x[4])
    objs: dict[str, Request] = {}
    aborted: set[str] = set()
    step = 0
    while pending or s.has_unfinished_requests():
        while pending and pending[0][4] <= step:
            rid, p, mt, prio, arrive, _ = pending.pop(0)
            objs[rid] = make_request(rid, p, mt, priority=prio, arrival=step + rng.random())
            s.add_request(objs[rid])
        for rid, _, _, _, arrive, abort in specs:
            if abort is not None and arrive + abort == step and rid in s.requests:
                s.abort_requests(rid)
                aborted.add(rid)
        if s.has_unfinished_requests():
            running = [(r, is_decoding(r)) for r in s.running]
            waiting = list(s.waiting)
            out = sim.step()
            check_preemptions(s, running, waiting, out.preempted)
            FIGURES["steps"] += 1
            FIGURES["preemptions"] += len(out.preempted)
            FIGURES["preemptions_of_decoding"] += sum(
                1 for r, dec in running if dec and r.request_id in out.preempted)
        step += 1
        assert step < 3000, "no progress"

    sim.assert_drained()
    stats = s.get_stats()
    assert stats["num_swapped_requests"] == 0
    if mode != "recompute":
        host = s.kv_cache_manager.tiers.host
        host.begin_step()  # the last plan has run
        assert host.num_used == host.num_prefix_entries, "host slots leaked"
        FIGURES["swapped_out"] += stats["num_swapped_out"]
        FIGURES["swap_fallbacks"] += stats["num_swap_fallbacks"]
        FIGURES["offload_hit_blocks"] += stats["offload_hits_blocks"]
    for rid, r in objs.items():
        if rid in aborted:
            assert r.status is RequestStatus.FINISHED_ABORTED
            continue
        assert r.is_finished() and r.output_token_ids == reference_output(
            r.prompt_token_ids, r.sampling_params, MAX_LEN), rid
    FIGURES["workloads"] += 1
    FIGURES["requests"] += len(objs)
    FIGURES["aborted"] += len(aborted)


@pytest.mark.parametrize("policy", ["priority", "fcfs", "lpm"])
@pytest.mark.parametrize("mode", ["recompute", "offload", "swap"])
def test_scheduler_fuzz(mode, policy, tmp_path):
    """SEEDS workloads per (mode, policy); seeds cycle through caching x chunked prefill."""
    base = {"recompute": 0, "offload": 10**4, "swap": 2 * 10**4}[mode]
    base += {"priority": 0, "fcfs": 1000, "lpm": 2000}[policy]
    for seed in range(base, base + SEEDS):
        run_workload(seed, mode, policy, tmp_path)


def teardown_module() -> None:
    """Print the fuzz figures for docs/reliability.md (JPAGED_FUZZ_REPORT=1, pytest -s)."""
    if os.environ.get("JPAGED_FUZZ_REPORT"):
        print(f"\nscheduler fuzz: {dict(FIGURES)}")
