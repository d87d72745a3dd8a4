"""Trade-off sweeps (seed 4.3): block size on a shared-prefix workload, and pool depth.

Block size: small blocks reuse prefixes more finely (a hit is counted in whole blocks) but
need longer block tables; large blocks waste more of each sequence's last block. Measured per
size: prefix hit rate, KV waste (empty slots in held blocks, averaged over steps) and tokens/s.

Pool depth: the same engine with fewer and fewer blocks. Once the pool is smaller than the
working set of cached prefixes, cached blocks are evicted before reuse (hit rate falls); once
it is smaller than what the running batch needs, requests are preempted and recomputed
(tokens/s falls). The depth points share one engine (and its compiled steps): each gets a
fresh scheduler whose pool holds exactly that many blocks (see jpaged/tune/replay.py).

Hit rate, waste and preemptions are deterministic for a workload; tokens/s depends on the
machine and its load.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from jpaged.bench.workloads import (
    QUESTIONS,
    add_greedy,
    system_prompt,
    theoretical_prefix_hits,
)
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.intmath import cdiv
from jpaged.tune.replay import reset_host_state
from models.loader import LoadedModel

BLOCK_SIZES = (8, 16, 32, 64, 128)


def kv_waste(engine: LLMEngine) -> tuple[int, int]:
    """(empty slots, slots) over the distinct blocks the running requests hold now.

    Shared blocks are full (only full blocks are cached), so every empty slot sits in some
    request's own last block: empty = sum(len(table) x block_size - computed tokens).
    """
    sched = engine.scheduler
    kv = sched.kv_cache_manager
    bs = sched.block_size
    blocks: set[int] = set()
    empty = 0
    for req in sched.running:
        for ids in kv.get_block_ids(req.request_id):  # per KV cache group
            blocks.update(b for b in ids if b)
            empty += max(len(ids) * bs - req.num_computed_tokens, 0)
    return empty, len(blocks) * bs


def run_workload(engine: LLMEngine, prompts: Sequence[Sequence[int]], max_tokens: int,
                 tag: str) -> dict[str, Any]:
    """All prompts at once, greedy, `max_tokens` each; counters as deltas, waste per step."""
    before = engine.get_metrics()
    t0 = time.perf_counter()
    add_greedy(engine, prompts, max_tokens, tag)
    empty = slots = 0
    peak = 0.0
    while engine.has_unfinished_requests():
        engine.step()
        e, s = kv_waste(engine)
        empty, slots = empty + e, slots + s
        peak = max(peak, engine.scheduler.kv_cache_manager.usage)
    dt = time.perf_counter() - t0
    after = engine.get_metrics()
    d = {k: after[k] - before[k] for k in ("prefix_cache_hits", "prefix_cache_queries",
                                           "num_preemptions", "num_evictions",
                                           "prompt_tokens_total", "generation_tokens_total")}
    total = sum(len(p) for p in prompts) + max_tokens * len(prompts)
    return {
        "elapsed_s": dt, "tokens_per_second": total / dt,
        "prefix_cache_hit_rate": d["prefix_cache_hits"] / max(d["prefix_cache_queries"], 1),
        "prefix_cache_hits": d["prefix_cache_hits"], "num_preemptions": d["num_preemptions"],
        "num_evictions": d["num_evictions"], "computed_prompt_tokens": d["prompt_tokens_total"],
        "kv_waste": empty / slots if slots else 0.0, "kv_cache_usage_peak": peak,
    }


def _timed(engine: LLMEngine, prompts: Sequence[Sequence[int]],
           warm: Sequence[Sequence[int]] | None, max_tokens: int, tag: str,
           num_blocks: int) -> dict:
    """Warm-up on `warm` (same shapes, other tokens; None: none), then the timed run on a fresh
    scheduler with `num_blocks`; timed again when the timed run still compiled a step shape."""
    seqs = engine.config.scheduler.max_num_seqs
    caching = engine.config.cache.enable_prefix_caching
    if warm is not None:
        reset_host_state(engine, num_blocks, seqs, caching)
        run_workload(engine, warm, max_tokens, f"{tag}-warm")
    for i in range(2):
        reset_host_state(engine, num_blocks, seqs, caching)
        compiled = engine.runner.num_compiled
        r = run_workload(engine, prompts, max_tokens, f"{tag}-{i}")
        if engine.runner.num_compiled == compiled:
            break
    return r


def blocks_for(prompts: Sequence[Sequence[int]], max_tokens: int, block_size: int) -> int:
    """Blocks (null block included) that hold every request at full length at once."""
    return 1 + sum(cdiv(len(p) + max_tokens - 1, block_size) for p in prompts)


def block_size_sweep(loaded: LoadedModel, prompts: Sequence[Sequence[int]],
                     warm: Sequence[Sequence[int]], block_sizes: Sequence[int],
                     max_tokens: int, engine_kw: dict[str, Any], min_kv_blocks: int = 0
                     ) -> list[dict[str, Any]]:
    """One point per block size, on a pool that holds the whole workload (no preemption).

    `min_kv_blocks` pads the allocated KV array (not the pool), to reuse compiled shapes.
    """
    out = []
    for bs in block_sizes:
        blocks = max(blocks_for(prompts, max_tokens, bs), blocks_for(warm, max_tokens, bs)) + 1
        engine = LLMEngine(EngineArgs(block_size=bs,
                                      num_gpu_blocks_override=max(blocks, min_kv_blocks),
                                      disable_log_stats=True, **engine_kw), loaded=loaded)
        r = _timed(engine, prompts, warm, max_tokens, f"bs{bs}", blocks)
        out.append({"block_size": bs, "num_gpu_blocks": blocks,
                    "theoretical_hit_rate": theoretical_prefix_hits(prompts, bs) /
                    sum(len(p) for p in prompts), **r})
        del engine
    return out


def pool_depth_sweep(loaded: LoadedModel, prompts: Sequence[Sequence[int]],
                     warm: Sequence[Sequence[int]], pool_blocks: Sequence[int],
                     max_tokens: int, block_size: int, engine_kw: dict[str, Any],
                     min_kv_blocks: int = 0) -> list[dict[str, Any]]:
    """One point per pool size (blocks, null block included), largest first, one engine."""
    sizes = sorted(set(pool_blocks), reverse=True)
    engine = LLMEngine(EngineArgs(block_size=block_size,
                                  num_gpu_blocks_override=max(sizes[0], min_kv_blocks),
                                  disable_log_stats=True, **engine_kw), loaded=loaded)
    out = []
    for i, n in enumerate(sizes):  # one warm-up per engine; later compiles are caught by _timed
        r = _timed(engine, prompts, warm if i == 0 else None, max_tokens, f"pool{n}", n)
        out.append({"num_gpu_blocks": n, "block_size": block_size, **r})
    return out


def interleave(groups: Sequence[Sequence[Sequence[int]]]) -> list[list[int]]:
    """Round-robin over groups: g0[0], g1[0], ..., g0[1], g1[1], ... (prefixes compete)."""
    out = []
    for i in range(max(len(g) for g in groups)):
        out += [list(g[i]) for g in groups if i < len(g)]
    return out


def plot_block_size(points: list[dict[str, Any]], path: Any, title: str) -> None:
    """Three panels over block size: hit rate (with theory), KV waste, tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = [p["block_size"] for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    axes[0].plot(bs, [p["prefix_cache_hit_rate"] for p in points], "o-", label="measured")
    if "theoretical_hit_rate" in points[0]:
        axes[0].plot(bs, [p["theoretical_hit_rate"] for p in points], "x--", color="gray",
                     label="block-granular theory")
        axes[0].legend(fontsize=7)
    axes[0].set_ylabel("prefix hit rate")
    axes[1].plot(bs, [100 * p["kv_waste"] for p in points], "o-", color="#c0504d")
    axes[1].set_ylabel("KV waste: empty slots in held blocks (%)")
    axes[2].plot(bs, [p["tokens_per_second"] for p in points], "o-", color="#2a7ab9")
    axes[2].set_ylabel("tokens/s (indicative)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.set_xlabel("block size (tokens)")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_pool_depth(points: list[dict[str, Any]], path: Any, title: str) -> None:
    """Three panels over pool size: hit rate, preemptions, tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [p["num_gpu_blocks"] for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    axes[0].plot(n, [p["prefix_cache_hit_rate"] for p in points], "o-")
    axes[0].set_ylabel("prefix hit rate")
    axes[1].plot(n, [p["num_preemptions"] for p in points], "o-", color="#c0504d")
    axes[1].set_ylabel("preemptions")
    axes[2].plot(n, [p["tokens_per_second"] for p in points], "o-", color="#2a7ab9")
    axes[2].set_ylabel("tokens/s (indicative)")
    for ax in axes:
        ax.set_xlabel("KV pool (blocks)")
        ax.invert_xaxis()  # the pool shrinks left to right
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _chat(tokenizer: Any, system: str, question: str) -> list[int]:
    if getattr(tokenizer, "has_chat_template", False):
        text = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": question}])
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(f"{system}\n{question}")


def sweep_prompts(tokenizer: Any, prefix_tokens: int, groups: int, per_group: int,
                  variant: int = 0) -> list[list[int]]:
    """`groups` distinct system prompts x `per_group` questions each, interleaved round-robin
    (so prefixes compete for the pool); `variant` changes every token-level prefix."""
    out = []
    for g in range(groups):
        system = f"Team {g + 1 + 100 * variant} handbook. " + system_prompt(
            tokenizer, prefix_tokens)
        out.append([_chat(tokenizer, system, QUESTIONS[(g + q * groups) % len(QUESTIONS)])
                    for q in range(per_group)])
    return interleave(out)


# Workload and grid of each mode; "quick" fits in < 3 min on 2 CPU cores (embedded model).
# (The embedded tokenizer gives a 104-token common prefix for bs_prefix_tokens=60, 152 for
# 110: not a multiple of the larger block sizes, so their coarser hits show.)
PRESETS: dict[str, dict[str, Any]] = {
    "quick": dict(bs_prefix_tokens=60, bs_per_group=6, bs_max_tokens=4, prefix_tokens=60,
                  pool_groups=3, pool_per_group=3, max_tokens=12,
                  pool_fracs=(1.0, 0.5, 0.3, 0.2, 0.12), max_num_seqs=4),
    "full": dict(bs_prefix_tokens=110, bs_per_group=16, bs_max_tokens=16, prefix_tokens=200,
                 pool_groups=4, pool_per_group=6, max_tokens=32,
                 pool_fracs=(1.0, 0.6, 0.4, 0.3, 0.2, 0.14, 0.1), max_num_seqs=8),
}


def run_sweeps(loaded: LoadedModel, *, bs_prefix_tokens: int, bs_per_group: int,
               bs_max_tokens: int, prefix_tokens: int, pool_groups: int, pool_per_group: int,
               max_tokens: int,
               pool_fracs: Sequence[float], max_num_seqs: int,
               block_sizes: Sequence[int] = BLOCK_SIZES, pool_block_size: int = 16,
               max_model_len: int = 1024, max_num_batched_tokens: int = 512,
               min_kv_blocks: int = 0) -> dict[str, Any]:
    """Both sweeps; returns {"block_size": [...], "pool_depth": [...], "workload": {...}}."""
    tok = loaded.tokenizer
    kw = dict(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens)
    bs_prompts = sweep_prompts(tok, bs_prefix_tokens, 1, bs_per_group)
    bs_warm = sweep_prompts(tok, bs_prefix_tokens, 1, bs_per_group, variant=1)
    pool_prompts = sweep_prompts(tok, prefix_tokens, pool_groups, pool_per_group)
    pool_warm = sweep_prompts(tok, prefix_tokens, pool_groups, pool_per_group, variant=1)
    need = blocks_for(pool_prompts, max_tokens, pool_block_size)
    floor = 2 + max(cdiv(len(p) + max_tokens, pool_block_size) for p in pool_prompts)
    pools = [max(floor, int(round(f * need))) for f in pool_fracs]
    return {
        "workload": {"block_size_common_prefix_tokens": len(os.path.commonprefix(bs_prompts)),
                     "block_size_max_tokens": bs_max_tokens, "prefix_tokens": prefix_tokens,
                     "max_tokens": max_tokens, "block_size_requests": len(bs_prompts),
                     "block_size_prompt_tokens": sum(len(p) for p in bs_prompts),
                     "pool_requests": len(pool_prompts), "pool_groups": pool_groups,
                     "pool_prompt_tokens": sum(len(p) for p in pool_prompts),
                     "pool_blocks_all_at_once": need, "max_num_seqs": max_num_seqs},
        "block_size": block_size_sweep(loaded, bs_prompts, bs_warm, block_sizes,
                                       bs_max_tokens, kw, min_kv_blocks),
        "pool_depth": pool_depth_sweep(loaded, pool_prompts, pool_warm, pools, max_tokens,
                                       pool_block_size, kw, min_kv_blocks),
    }
