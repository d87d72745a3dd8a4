"""Bucket-fitted token budget: the cost-model choices, and the scheduler fitting steps to buckets
without changing any request's tokens."""

from __future__ import annotations

import functools

import pytest
from core_sim import Sim, make_request
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.scheduler import Scheduler
from jpaged.core.token_budget import fit_token_budget, plan_cost

BUCKETS = [64, 256, 1024, 2048]  # BucketPlan's token buckets for max_num_batched_tokens=2048


def test_demand_at_or_over_budget_takes_the_budget():
    assert fit_token_budget(2048, 2048, BUCKETS, 0) == 2048
    assert fit_token_budget(5000, 2048, BUCKETS, 3) == 2048


def test_demand_exactly_a_bucket_is_not_cut():
    for d in BUCKETS[:-1]:
        assert fit_token_budget(d, 2048, BUCKETS, 0) == 2048  # budget: the whole demand fits


def test_700_fills_256_instead_of_padding_to_1024():
    # Pad: one step of 1024 + 64 overhead = 1088. Fit: 256 | 256 | 188 (padded to 256), each
    # step 256 + 64 = 320, total 960 < 1088. (256 | 444 padded to 1024 costs 320 + 1088.)
    assert fit_token_budget(700, 2048, BUCKETS, 0) == 256
    assert plan_cost(700, 2048, BUCKETS) == 960
    # With the old padding only, the figure would be 1088: overhead 0 makes padding 1024
    # (1024) dearer than 3 x 256 (768) still, so the choice holds without overhead too.
    assert fit_token_budget(700, 2048, BUCKETS, 0, step_overhead_tokens=0) == 256


def test_small_waste_pads_up():
    # 250 -> 256: one step costs 320; 64 + 186 would cost 128 + 320 = 448.
    assert fit_token_budget(250, 2048, BUCKETS, 0) == 2048
    # 1000 -> 1024 costs 1088; 4 x 256 would cost 1280.
    assert fit_token_budget(1000, 2048, BUCKETS, 0) == 2048
    # Tiny demands (decodes plus a short prompt) always pad: no bucket below them.
    assert fit_token_budget(10, 2048, BUCKETS, 8) == 2048


def test_min_tokens_is_never_cut():
    # 700 with 300 decodes: no bucket in [300, 700), so the step takes everything.
    assert fit_token_budget(700, 2048, BUCKETS, 300) == 2048
    assert fit_token_budget(700, 2048, BUCKETS, 100) == 256  # 100 decodes fit in 256
    # 300: 256 | 44 (padded to 64) costs 320 + 128 = 448 < 1088 (1024 padded); but with 257
    # decodes no bucket in [257, 300) is left, so the step pads up.
    assert fit_token_budget(300, 2048, BUCKETS, 0) == 256
    assert fit_token_budget(300, 2048, BUCKETS, 257) == 2048
    for d in range(1, 600, 7):
        for m in (0, 1, 63, 64, 65, 255, 256):
            b = fit_token_budget(d, 2048, BUCKETS, min(m, d))
            assert b >= min(m, d) and (b == 2048 or b in BUCKETS and b < d)


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="demand"):
        fit_token_budget(-1, 2048, BUCKETS, 0)
    with pytest.raises(ValueError, match="budget"):
        fit_token_budget(10, 0, BUCKETS, 0)
    with pytest.raises(ValueError, match="buckets"):
        fit_token_budget(10, 2048, [], 0)
    with pytest.raises(ValueError, match="min_tokens"):
        fit_token_budget(10, 2048, BUCKETS, -1)


def brute_cost(demand: int, buckets: tuple[int, ...], overhead: int) -> int:
    """Cheapest plan by exhaustive search: each step fills any bucket, or takes the rest."""

    @functools.cache
    def go(d: int) -> int:
        if d == 0:
            return 0
        pad = min((b for b in buckets if b >= d), default=d)
        return min([pad + overhead + go(0)] +
                   [b + overhead + go(d - b) for b in buckets if b < d])

    return go(demand)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=4, unique=True),
       st.integers(0, 80), st.integers(1, 600))
def test_choice_is_the_first_step_of_a_cheapest_plan(buckets, overhead, demand):
    buckets = sorted(buckets)
    budget = max(buckets) + 1
    demand = min(demand, budget - 1)
    best = brute_cost(demand, tuple(buckets), overhead)
    assert plan_cost(demand, budget, buckets, 0, overhead) == best
    b = fit_token_budget(demand, budget, buckets, 0, overhead)
    if b == budget:  # whole demand now
        pad = min((x for x in buckets if x >= demand), default=demand)
        assert pad + overhead == best
    else:
        assert b in buckets and b < demand
        assert b + overhead + brute_cost(demand - b, tuple(buckets), overhead) == best


# -- the scheduler ------------------------------------------------------------------------------

SMALL = [16, 64, 256, 1024]  # token buckets of a 1024-token budget (BucketPlan's, from 16)


def scheduler(token_buckets, chunked: bool = True) -> Scheduler:
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=512,
                         enable_chunked_prefill=chunked)
    cc = CacheConfig(block_size=4, enable_prefix_caching=False)
    return Scheduler(sc, cc, 400, token_buckets=token_buckets)


def run(sched: Scheduler, late_at: int = 3) -> tuple[Sim, dict[str, list[int]]]:
    """Five prompts (700 tokens) at once, a sixth arriving at step `late_at`; Sim checks every
    step (KV reads, block tables, limits)."""
    lens = [(140, 5), (150, 3), (130, 9), (160, 2), (120, 6), (100, 4)]
    reqs = [make_request(f"r{i}", [(i * 37 + j * 11) % 900 for j in range(n)], max_tokens=m)
            for i, (n, m) in enumerate(lens)]
    for r in reqs[:5]:
        sched.add_request(r)
    sim = Sim(sched)
    while sched.has_unfinished_requests() or len(sim.outputs) <= late_at:
        if len(sim.outputs) == late_at:
            sched.add_request(reqs[5])
        out = sim.step()
        if out.num_scheduled_tokens not in SMALL:
            # Not a full bucket: the step took everything it could (no cut was made).
            assert all(x.sample for x in out.scheduled) and sched.num_waiting == 0
    sim.assert_drained()
    return sim, {rid: r.output_token_ids for rid, r in sim.finished.items()}


def padded_cost(sim: Sim) -> int:
    """The cost model's figure for a run: each step's bucket plus 64."""
    return sum(min(b for b in SMALL if b >= o.num_scheduled_tokens) + 64
               for o in sim.outputs if o.num_scheduled_tokens)


def test_scheduler_fills_buckets_and_tokens_are_unchanged():
    plain, plain_tokens = run(scheduler(None))
    fitted, fitted_tokens = run(scheduler(SMALL))
    assert fitted_tokens == plain_tokens and len(plain_tokens) == 6
    totals = [o.num_scheduled_tokens for o in plain.outputs]
    ftotals = [o.num_scheduled_tokens for o in fitted.outputs]
    assert totals[0] == 700  # without buckets: every prompt at once, padded to 1024
    # With buckets: 700 -> 256 (r0 140 + r1 116; see test_700_...). Step 2: r0 decodes (1),
    # 34 of r1 and 130 + 160 + 120 are left: 445 -> 256 | 189 (2 x 320) beats 1024 (1088).
    # Step 3: 189 + 3 decodes = 192, padded to 256 (320) rather than 64 | 64 | 64 (384).
    assert ftotals[:3] == [256, 256, 192]
    assert padded_cost(fitted) < padded_cost(plain)


def test_buckets_are_ignored_without_chunked_prefill():
    off, _ = run(scheduler(None, chunked=False))
    off_fitted, _ = run(scheduler(SMALL, chunked=False))
    assert ([o.num_scheduled_tokens for o in off.outputs]
            == [o.num_scheduled_tokens for o in off_fitted.outputs])
