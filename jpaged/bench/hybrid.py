"""The hybrid KV cache against the full-attention layout at one KV byte budget.

Two engines over the same model and the same `kv_cache_memory_bytes`: the hybrid layout
(sliding-window layers keep only their window; the default) and one full-attention group
(`disable_hybrid_kv_cache_manager=True`, vLLM's flag). Measured:

* capacity for 8k-token requests: how many run at once before the first preemption. The
  engine's own Scheduler (its pool size, layout and token budget) is driven step by step with
  the requests' real block demand; the model is not run for this part, since what fits is a
  property of the block manager alone and an 8k-token prefill of many requests takes the CPU
  most of an hour;
* throughput on a long-context batch (the model runs): tokens/s of both engines;
* the greedy tokens of that batch (identical either way);
* prefix-cache hit tokens on a shared-prefix workload against the block-count theory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jpaged.bench.workloads import add_greedy, theoretical_prefix_hits
from jpaged.config import EngineArgs
from jpaged.core.scheduler import Scheduler
from jpaged.engine import LLMEngine
from jpaged.request import Request
from jpaged.sampling_params import SamplingParams
from models.loader import LoadedModel

BLOCK_SIZE = 16


def make_engine(loaded: LoadedModel, hybrid: bool, kv_bytes: int, max_model_len: int,
                max_num_batched_tokens: int, max_num_seqs: int = 64) -> LLMEngine:
    """An engine over `loaded` with a KV budget of `kv_bytes`, hybrid layout or not."""
    args = EngineArgs(kv_cache_memory_bytes=kv_bytes, block_size=BLOCK_SIZE,
                      max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                      max_num_seqs=max_num_seqs, disable_hybrid_kv_cache_manager=not hybrid,
                      disable_log_stats=True)
    return LLMEngine(args, loaded=loaded)


def max_concurrent(engine: LLMEngine, prompt_len: int, num_requests: int,
                   max_tokens: int) -> dict[str, int]:
    """Requests of `prompt_len` tokens decoding at once, at most, before the first preemption.

    A fresh Scheduler with the engine's config, pool and layout is driven as the engine drives
    it; each step's sampled tokens are a fixed token (the block demand does not depend on
    them). Stops at the first preemption or when every request decodes.
    """
    cfg = engine.config
    num_blocks = cfg.cache.num_gpu_blocks
    assert num_blocks is not None
    sched = Scheduler(cfg.scheduler, cfg.cache, num_blocks, None,
                      token_buckets=engine.runner.plan.token_buckets, kv_layout=engine.kv_layout)
    rng = np.random.default_rng(0)
    for i in range(num_requests):
        prompt = rng.integers(10, 1000, size=prompt_len).tolist()
        sched.add_request(Request(f"c{i}", prompt, SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    peak = steps = 0
    while sched.has_unfinished_requests() and sched.num_preemptions == 0:
        out = sched.schedule()
        steps += 1
        sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled
                                       if s.sample})
        decoding = sum(1 for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens)
        peak = max(peak, decoding)
        if peak == num_requests:
            break
    return {"max_concurrent": peak, "steps": steps, "num_blocks": num_blocks - 1,
            "preempted": int(sched.num_preemptions > 0)}


def run_batch(engine: LLMEngine, prompts: Sequence[Sequence[int]], max_tokens: int,
              tag: str) -> tuple[float, list[list[int]], dict[str, Any]]:
    """Greedy generation of every prompt at once: (seconds, tokens per prompt, metric deltas)."""
    before = engine.get_metrics()
    t0 = time.perf_counter()
    add_greedy(engine, prompts, max_tokens, tag)
    done: dict[str, list[int]] = {}
    peak = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
        peak = max(peak, engine.scheduler.num_running)
    dt = time.perf_counter() - t0
    after = engine.get_metrics()
    keys = ("prefix_cache_hits", "prefix_cache_queries", "num_preemptions",
            "generation_tokens_total", "prompt_tokens_total", "num_blocks_freed_out_of_window")
    deltas: dict[str, Any] = {k: after[k] - before[k] for k in keys}
    deltas["peak_running"] = peak
    return dt, [done[f"{tag}-{i}"] for i in range(len(prompts))], deltas


def shared_prefix(prefix_len: int, num: int, tail: int, seed: int = 1,
                  vocab: int = 1000) -> list[list[int]]:
    """`num` prompts: one shared prefix of `prefix_len` random tokens (ids 10..vocab-1), then
    `tail` of their own."""
    rng = np.random.default_rng(seed)
    head = rng.integers(10, vocab, size=prefix_len).tolist()
    return [head + rng.integers(10, vocab, size=tail).tolist() for _ in range(num)]


def prefix_hits(engine: LLMEngine, prompts: Sequence[Sequence[int]]) -> dict[str, int]:
    """Hit tokens when the prompts run one after another, against the block-count theory."""
    hits = 0
    for i, p in enumerate(prompts):
        _, _, d = run_batch(engine, [p], 1, f"px{i}")
        hits += d["prefix_cache_hits"]
    return {"hits": hits, "theory": theoretical_prefix_hits(prompts, BLOCK_SIZE),
            "queries": sum(len(p) for p in prompts)}
