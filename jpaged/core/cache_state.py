"""A read-only, JSON-serialisable snapshot of the KV block pool and the block tables.

Built from host state only (the scheduler, its KVCacheManager and BlockPool): nothing is mutated
and nothing touches the device, so it is cheap enough to take between any two engine steps.
"""

from __future__ import annotations

from typing import Any

from jpaged.core.scheduler import Scheduler

# Per-block status codes of `cache_state()["status"]`.
NULL, FREE, CACHED_FREE, IN_USE = 0, 1, 2, 3
STATUS_NAMES = ("null", "free", "cached_free", "in_use")
HASH_HEX_CHARS = 16  # cached hashes are shown truncated to their first 8 bytes
SCHEMA_VERSION = 1


def block_status(ref_count: int, cached: bool, is_null: bool) -> int:
    """Status code of one block: NULL, FREE, CACHED_FREE or IN_USE."""
    if is_null:
        return NULL
    if ref_count > 0:
        return IN_USE
    return CACHED_FREE if cached else FREE


def snapshot(scheduler: Scheduler) -> dict[str, Any]:
    """The pool and the running requests' block tables as plain lists/dicts (see LLMEngine)."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    n = pool.num_blocks
    status = [0] * n
    ref_counts = [0] * n
    num_tokens = [0] * n
    cached = [False] * n
    owners: list[list[str]] = [[] for _ in range(n)]
    for b in pool.blocks:
        i = b.block_id
        ref_counts[i] = b.ref_count
        num_tokens[i] = b.num_tokens
        cached[i] = b.block_hash is not None
        status[i] = block_status(b.ref_count, cached[i], b.is_null)

    running = {r.request_id: r for r in scheduler.running}
    requests: dict[str, dict[str, Any]] = {}
    # Tables exist exactly for requests holding blocks (running, possibly stalled this step).
    # Each request has one table per KV cache group (0: a windowed group's freed position);
    # "block_table" is group 0's.
    for rid in kv.request_ids():
        per_group = kv.get_block_ids(rid)
        for ids in per_group:
            for i in ids:  # a table never holds a block twice, nor two groups one block
                if i:
                    owners[i].append(rid)
        held = scheduler.held_requests.get(rid)  # a producer's, kept for its consumer
        req = running.get(rid) or scheduler.requests.get(rid) or held
        entry: dict[str, Any] = {"block_table": per_group[0], "block_tables": per_group}
        if held is not None:
            entry["held_for_kv_transfer"] = True
        if req is not None:
            entry.update(num_tokens=req.num_tokens, num_computed_tokens=req.num_computed_tokens,
                         num_prompt_tokens=req.num_prompt_tokens,
                         num_output_tokens=req.num_output_tokens, priority=req.priority,
                         status=req.status.name,
                         # Speculative decoding: proposals waiting for slots (a request the
                         # last schedule stalled). Slots given to proposals never outlive
                         # their step: verification trims them, so a table holds verified
                         # tokens only.
                         spec_token_ids=list(req.spec_token_ids))
        requests[rid] = entry

    waiting = [rid for rid in scheduler.requests if rid not in requests]
    # Swap preemption parks a request's KV in the host tier: {request id: tokens it gets back}.
    swapped = {rid: t for rid, t in ((r, kv.swapped_tokens(r)) for r in waiting)
               if t is not None}
    cached_blocks = {h.hex()[:HASH_HEX_CHARS]: b.block_id for h, b in pool.cached_blocks.items()}
    groups = kv.layout.describe()
    for g, m in enumerate(pool.group_maps):
        groups[g]["num_cached_blocks"] = len(m)
    stats = kv.stats
    return {
        "version": SCHEMA_VERSION,
        "num_blocks": n,
        "block_size": kv.block_size,
        "status_names": list(STATUS_NAMES),
        "status": status,
        "ref_counts": ref_counts,
        "num_tokens": num_tokens,
        "cached": cached,
        "owners": owners,
        "requests": requests,
        "waiting": waiting,
        "swapped": swapped,
        "cached_blocks": cached_blocks,  # group 0's
        # KV cache groups (one unless the model has sliding layers): kind, window, layers, and
        # how many blocks each group's prefix map holds; "block_group" is the group a cached
        # or held block belongs to.
        "kv_cache_groups": groups,
        "block_group": [b.group for b in pool.blocks],
        "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "num_free_blocks": pool.get_num_free_blocks(),
        "num_cached_free_blocks": status.count(CACHED_FREE),
        "num_in_use_blocks": status.count(IN_USE),
        "usage": pool.get_usage(),
        "prefix_caching": kv.enable_caching,
        "prefix_cache_hit_rate": stats.hit_rate,
        "prefix_cache_hits": stats.hits,
        "prefix_cache_queries": stats.queries,
    }


TIER_KEY_WORDS = ("tier", "offload", "swap")  # metric names of the host/disk KV tiers


def tier_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """The KV-tier entries of get_metrics() (host/disk usage, offload hits, swaps), if any."""
    return {k: v for k, v in metrics.items() if any(w in k for w in TIER_KEY_WORDS)}
