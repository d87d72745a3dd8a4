"""Bucket-fitted token budget: cut prefill chunks so a step fills a bucket instead of padding.

Every engine step is padded up to a token bucket (`jpaged/runner/batch.py` ``BucketPlan``:
64, 256, 1024, 2048 by default). A step with 700 tokens runs as 1024, wasting ~32 % of its
compute. With chunked prefill the scheduler may instead schedule 256 tokens now and the rest in
later steps, which also carry every running decode (so those steps are not wasted on decodes).

Cost model, in token-equivalents: a step padded to bucket ``T`` costs ``T + overhead``. Measured
on the 2-core CPU with the embedded SmolLM2-135M, ``c(T) ≈ 200 ms + 3.2 ms × T`` (385 ms at
T=64, 1016 ms at T=256, 3,300 ms at T=1024): the fixed per-step cost is worth ~64 tokens, the
default ``step_overhead_tokens``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = ["fit_token_budget", "plan_cost"]

DEFAULT_STEP_OVERHEAD_TOKENS = 64


def _padded(n: int, buckets: Sequence[int]) -> int:
    """The bucket a step of n tokens is padded to (n itself past the largest bucket)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else n


def _check(demand: int, budget: int, buckets: Sequence[int], min_tokens: int,
           step_overhead_tokens: int) -> list[int]:
    if demand < 0:
        raise ValueError(f"demand must be >= 0, got {demand}")
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got {budget}")
    if min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    if step_overhead_tokens < 0:
        raise ValueError(f"step_overhead_tokens must be >= 0, got {step_overhead_tokens}")
    bs = sorted(set(buckets))
    if not bs or bs[0] <= 0:
        raise ValueError(f"buckets must be positive and non-empty, got {list(buckets)}")
    return bs


def _best_plan(demand: int, budget: int, buckets: list[int], min_tokens: int,
               overhead: int) -> tuple[int, int]:
    """(total cost, first step's tokens) of the cheapest way to schedule `demand` < budget
    tokens in steps; the first step takes >= min_tokens, every step <= budget."""
    # Options for a step with d tokens left: fill a bucket b < d (cut), or take all d.
    cuts = [b for b in buckets if b <= budget]
    # The remainders a plan can reach, solved smallest first (iterative: no recursion limit).
    reach, todo = {demand}, [demand]
    while todo:
        d = todo.pop()
        for b in cuts:
            if b >= d:
                break
            if d - b not in reach:
                reach.add(d - b)
                todo.append(d - b)
    cost: dict[int, int] = {0: 0}  # cheapest total cost of d remaining tokens
    for d in sorted(reach):
        best = _padded(d, buckets) + overhead  # take all (d < budget always here)
        for b in cuts:
            if b >= d:
                break
            best = min(best, b + overhead + cost[d - b])
        cost[d] = best

    # First step: ties go to the larger first step (fewer steps, earlier tokens).
    best_cost, best_first = _padded(demand, buckets) + overhead, demand
    for b in cuts:
        if b >= demand:
            break
        if b < min_tokens:
            continue  # decodes cannot be cut
        c = b + overhead + cost[demand - b]
        if c < best_cost or (c == best_cost and b > best_first):
            best_cost, best_first = c, b
    return best_cost, best_first


def plan_cost(demand: int, budget: int, buckets: Sequence[int], min_tokens: int = 0,
              step_overhead_tokens: int = DEFAULT_STEP_OVERHEAD_TOKENS) -> int:
    """Estimated cost (token-equivalents) of the cheapest step plan for `demand` tokens."""
    bs = _check(demand, budget, buckets, min_tokens, step_overhead_tokens)
    if demand == 0:
        return 0
    if demand >= budget:  # full steps of `budget`, then the cheapest plan for the rest
        full, rest = divmod(demand, budget)
        c = full * (_padded(budget, bs) + step_overhead_tokens)
        return c + (_best_plan(rest, budget, bs, 0, step_overhead_tokens)[0] if rest else 0)
    return _best_plan(demand, budget, bs, min_tokens, step_overhead_tokens)[0]


def fit_token_budget(demand: int, budget: int, buckets: Sequence[int], min_tokens: int,
                     step_overhead_tokens: int = DEFAULT_STEP_OVERHEAD_TOKENS) -> int:
    """The token budget for this step: a bucket to fill exactly, or `budget` (no cut).

    `demand`: tokens the step could schedule with an unlimited budget (an estimate; an
    over-estimate only makes fitting rarer). `min_tokens`: tokens that cannot be cut (one per
    running decode); the result is never below it (unless it exceeds `budget`). Returns
    `budget` when demand >= budget or when the cheapest plan takes the whole demand in this
    step (padding up is cheaper than an extra step); otherwise the bucket ``b < demand`` whose
    plan (this step exactly fills ``b``, the rest follows in the cheapest sequence of later
    steps) has the lowest total cost, where a step padded to bucket ``T`` costs
    ``T + step_overhead_tokens`` (module docstring).

    Example (buckets 64/256/1024/2048, overhead 64): demand 700 padded to 1024 costs 1088;
    256 + 256 + 188 (padded to 256) costs 3 × 320 = 960, so the step's budget is 256.
    """
    bs = _check(demand, budget, buckets, min_tokens, step_overhead_tokens)
    if demand >= budget:
        return budget
    first = _best_plan(demand, budget, bs, min_tokens, step_overhead_tokens)[1]
    return budget if first >= demand else max(first, min_tokens)
