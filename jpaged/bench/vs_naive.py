"""Paged KV cache vs the naive contiguous cache (`jpaged.naive`) at equal KV memory.

The naive engine reserves max_model_len slots per row, so a budget of R rows admits R
sequences; the paged engine gets the same bytes as blocks and admits what fits. Both run the
same seeded mixed-length workload (greedy, ignore_eos, fixed output lengths) side by side.
Waste is (allocated − used) / allocated KV slots over the requests holding KV, averaged over
steps; throughput is generated tokens per second of wall time net of XLA compilation
(`jpaged.bench.timing`), so lazily compiled shapes do not count against either engine.
"""

from __future__ import annotations

from typing import Any

from jpaged.bench.timing import stopwatch
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.intmath import cdiv
from jpaged.naive import NaiveEngine
from jpaged.runner.kv_cache import bytes_per_block, kv_dtype
from jpaged.sampling_params import RequestOutputKind, SamplingParams
from models.loader import LoadedModel


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def kv_budget_bytes(loaded: LoadedModel, rows: int, max_model_len: int) -> int:
    """Bytes of `rows` contiguous max_model_len rows: the naive engine's whole cache."""
    dtype = kv_dtype("auto", loaded.model.dtype)
    per_token = bytes_per_block(loaded.spec, 1, dtype)
    return rows * max_model_len * per_token


def paged_engine(loaded: LoadedModel, budget_bytes: int, max_model_len: int,
                 block_size: int = 16, max_num_seqs: int = 256,
                 enable_prefix_caching: bool = False) -> LLMEngine:
    """A paged engine whose pool (null block included) fits in `budget_bytes`."""
    dtype = kv_dtype("auto", loaded.model.dtype)
    blocks = budget_bytes // bytes_per_block(loaded.spec, block_size, dtype)
    args = EngineArgs(max_model_len=max_model_len, block_size=block_size,
                      num_gpu_blocks_override=int(blocks), max_num_seqs=max_num_seqs,
                      enable_prefix_caching=enable_prefix_caching, disable_log_stats=True)
    return LLMEngine(args, loaded=loaded)


def run_paged(engine: LLMEngine, requests: list[tuple[list[int], int]], tag: str
              ) -> dict[str, Any]:
    """Run the workload to completion; concurrency, waste and net throughput."""
    sched = engine.scheduler
    kv = sched.kv_cache_manager
    bs = engine.config.cache.block_size
    for i, (prompt, out_len) in enumerate(requests):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, _greedy(out_len))
    max_conc, waste_sum, waste_steps, tokens = 0, 0.0, 0, 0
    with stopwatch() as sw:
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += len(out.outputs[0].token_ids)
            holders = [r for r in sched.running if kv.num_blocks_held(r.request_id)]
            max_conc = max(max_conc, len(sched.running))
            if holders:
                allocated = bs * len({b for r in holders for ids in kv.get_block_ids(r.request_id)
                                      for b in ids if b})
                used = sum(r.num_computed_tokens for r in holders)
                waste_sum += max(allocated - used, 0) / allocated
                waste_steps += 1
    return {"max_concurrency": max_conc, "waste": waste_sum / max(waste_steps, 1),
            "tokens": tokens, "tokens_per_s": tokens / sw.net_s, "wall_s": sw.wall_s,
            "compile_s": sw.compile_s, "steps": waste_steps,
            "preemptions": sched.num_preemptions}


def run_naive(engine: NaiveEngine, requests: list[tuple[list[int], int]], tag: str
              ) -> dict[str, Any]:
    """The same workload through the contiguous-cache baseline."""
    before = engine.stats.generated_tokens
    ids = [f"{tag}-{i}" for i in range(len(requests))]
    for rid, (prompt, out_len) in zip(ids, requests, strict=True):
        engine.add_request(rid, prompt, _greedy(out_len))
    with stopwatch() as sw:
        while engine.has_unfinished_requests():
            engine.step()
    for rid in ids:
        engine.finished.pop(rid)
    tokens = engine.stats.generated_tokens - before
    st = engine.stats
    return {"max_concurrency": st.max_concurrency, "waste": st.waste, "tokens": tokens,
            "tokens_per_s": tokens / sw.net_s, "wall_s": sw.wall_s, "compile_s": sw.compile_s,
            "steps": st.steps}


def parallel_sampling_blocks(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int,
                             max_model_len: int, n: int = 4, block_size: int = 16
                             ) -> dict[str, int]:
    """Peak KV blocks in use for `n` samples per prompt, with and without block sharing."""
    out = {}
    need = len(prompts) * n * (cdiv(max(map(len, prompts)) + max_tokens, block_size)) + 1
    for share in (True, False):
        args = EngineArgs(max_model_len=max_model_len, block_size=block_size,
                          num_gpu_blocks_override=need, enable_prefix_caching=share,
                          disable_log_stats=True)
        engine = LLMEngine(args, loaded=loaded)
        params = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=max_tokens,
                                ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
        for i, p in enumerate(prompts):
            engine.add_request(f"ps-{i}", {"prompt_token_ids": p}, params)
        peak = 0
        kv = engine.scheduler.kv_cache_manager
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, kv.block_pool.num_blocks - 1 - kv.num_free_blocks)
        out["shared" if share else "unshared"] = peak
    return out
