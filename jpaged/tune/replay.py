"""Runs tuning trials on the real engine: the workload sample replayed under each TrialConfig.

Trials that differ only in host-side settings (pool depth, max_num_seqs, prefix caching) share
one engine, so they share its compiled steps: the engine's KV array is allocated for the top of
the memory ladder, and each trial gets a fresh scheduler whose pool holds exactly the trial's
block count. Block ids past the trial's pool are never handed out, so the trial schedules,
preempts and hits the prefix cache exactly as an engine built with that pool would; the device
step reads only the blocks in its block tables. Settings that change device state (KV dtype,
host-RAM offloading) get their own engine; one engine is alive at a time.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from typing import Any

from jpaged.bench.throughput import run_batch
from jpaged.config import EngineArgs
from jpaged.core.scheduler import Scheduler
from jpaged.engine import LLMEngine
from jpaged.intmath import cdiv
from jpaged.runner.kv_cache import bytes_per_block, device_memory_bytes, kv_dtype
from jpaged.runner.tier_setup import build_host_tier
from jpaged.sampling_params import RequestOutputKind, SamplingParams
from jpaged.tune.policy import TrialConfig, TrialResult
from jpaged.tune.workload import WorkloadRequest
from models.loader import LoadedModel

logger = logging.getLogger("jpaged.tune")


def reset_host_state(engine: LLMEngine, num_blocks: int, max_num_seqs: int,
                     enable_prefix_caching: bool) -> None:
    """Give an idle engine a fresh scheduler (and host tier) with this pool and these limits.

    `num_blocks` (null block included) must not exceed the engine's allocated KV blocks.
    """
    if engine.has_unfinished_requests():
        raise ValueError("reset_host_state needs an idle engine")
    allocated = engine.runner.kv.num_blocks
    if not 2 <= num_blocks <= allocated:
        raise ValueError(f"num_blocks must be in [2, {allocated}] (the allocated pool), got "
                         f"{num_blocks}")
    core = engine.core  # the host state lives in the core: its config, tiers and scheduler
    cfg = core.config
    cache = dataclasses.replace(cfg.cache, num_gpu_blocks=num_blocks,
                                enable_prefix_caching=enable_prefix_caching)
    sched = dataclasses.replace(cfg.scheduler, max_num_seqs=max_num_seqs)
    core.config = dataclasses.replace(cfg, cache=cache, scheduler=sched)
    core.tiers = build_host_tier(cache, core.spec, core.kv_dtype, core.kv_layout.num_slots)
    core.scheduler = Scheduler(sched, cache, num_blocks, core.tiers,
                               token_buckets=core.runner.plan.token_buckets,
                               kv_layout=core.kv_layout)


class EngineReplayer:
    """`replayer(config) -> TrialResult`: the workload sample through the engine once."""

    def __init__(self, loaded: LoadedModel, base: EngineArgs, requests: list[WorkloadRequest],
                 memory_top: float, max_num_seqs_top: int) -> None:
        self.loaded = loaded
        self.base = base
        self.requests = requests
        self.memory_top = memory_top
        self.max_num_seqs_top = max_num_seqs_top
        self._engine: LLMEngine | None = None
        self._key: tuple | None = None
        self._key_error: str | None = None
        self._count = 0

    def _args(self, cfg: TrialConfig) -> EngineArgs:
        mem = {"gpu_memory_utilization": None, "kv_cache_memory_bytes": None,
               "num_gpu_blocks_override": None}
        mem[cfg.memory_flag] = (self.memory_top if cfg.memory_flag == "gpu_memory_utilization"
                                else int(self.memory_top))
        return dataclasses.replace(
            self.base, **mem, max_num_seqs=max(self.max_num_seqs_top, cfg.max_num_seqs),
            enable_prefix_caching=cfg.enable_prefix_caching, kv_cache_dtype=cfg.kv_cache_dtype,
            kv_offloading_size=cfg.kv_offloading_size, preemption_mode=cfg.preemption_mode,
            swap_space=0.0, disable_log_stats=True)

    def engine_for(self, cfg: TrialConfig) -> LLMEngine:
        """The engine for this trial's device settings (built, or kept from the last trial)."""
        key = (cfg.memory_flag, cfg.kv_cache_dtype, cfg.kv_offloading_size, cfg.preemption_mode)
        if key != self._key:
            self._engine = None
            gc.collect()  # free the previous KV pool before allocating the next one
            self._key, self._key_error = key, None
            try:
                self._engine = LLMEngine(self._args(cfg), loaded=self.loaded)
            except (ValueError, FileNotFoundError) as e:
                self._key_error = str(e)
        if self._engine is None:
            raise ValueError(self._key_error or "no engine")
        return self._engine

    def blocks_for(self, engine: LLMEngine, cfg: TrialConfig) -> int:
        """The pool (null block included) this trial's memory setting gives on this engine."""
        top = engine.runner.kv.num_blocks
        if cfg.memory_flag == "num_gpu_blocks_override":
            return min(int(cfg.memory), top)
        per_block = bytes_per_block(engine.spec, engine.config.cache.block_size, engine.kv_dtype,
                                    engine.config.parallel.tensor_parallel_size,
                                    engine.kv_layout.num_slots)
        if cfg.memory_flag == "kv_cache_memory_bytes":
            return min(int(cfg.memory) // per_block, top)
        # budget(u) = device x u - params - activations - margin: linear in u.
        fewer = int((self.memory_top - cfg.memory) * device_memory_bytes()) // per_block
        return max(top - max(fewer, 0), 0)

    def _params(self) -> list[SamplingParams]:
        return [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=r.max_tokens,
                               ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY,
                               seed=i) for i, r in enumerate(self.requests)]

    def __call__(self, cfg: TrialConfig) -> TrialResult:
        """Replay the sample under `cfg`; a setting that cannot run gives a failed result."""
        n = len(self.requests)
        t0 = time.monotonic()
        try:
            engine = self.engine_for(cfg)
        except ValueError as e:
            return TrialResult(cfg, n, error=str(e), elapsed_s=time.monotonic() - t0)
        blocks = self.blocks_for(engine, cfg)
        bs = engine.config.cache.block_size
        longest = max(cdiv(len(r.prompt_token_ids) + r.max_tokens - 1, bs)
                      for r in self.requests)
        if blocks - 1 < longest:
            return TrialResult(cfg, n, num_gpu_blocks=blocks, elapsed_s=time.monotonic() - t0,
                               error=f"a request needs {longest} blocks, the pool has "
                                     f"{max(blocks - 1, 0)}")
        prompts = [r.prompt_token_ids for r in self.requests]
        params = self._params()
        for _ in range(2):  # a run that compiled a new step shape is timed again, warm
            reset_host_state(engine, blocks, cfg.max_num_seqs, cfg.enable_prefix_caching)
            compiled = engine.runner.num_compiled
            self._count += 1
            r = run_batch(engine, prompts, params, f"tune-{self._count}")
            if engine.runner.num_compiled == compiled:
                break
        return self.result(cfg, r, blocks, time.monotonic() - t0)

    @staticmethod
    def result(cfg: TrialConfig, r: dict[str, Any], blocks: int, elapsed: float) -> TrialResult:
        """A TrialResult from run_batch's dict."""
        return TrialResult(
            cfg, r["num_requests"], num_preemptions=r["num_preemptions"],
            prefix_cache_hit_rate=r["prefix_cache_hit_rate"],
            tokens_per_second=r["tokens_per_second"], ttft_p50_ms=r["median_ttft_ms"],
            ttft_p99_ms=r["p99_ttft_ms"], tpot_p50_ms=r["median_tpot_ms"],
            tpot_p99_ms=r["p99_tpot_ms"], num_gpu_blocks=blocks,
            kv_cache_usage_peak=r["kv_cache_usage_peak"], elapsed_s=elapsed)

    def close(self) -> None:
        """Drop the engine (and its KV pool)."""
        self._engine = None
        self._key = None
        gc.collect()


def kv_dtype_for(loaded: LoadedModel, cache_dtype: str) -> Any:
    """The page dtype `cache_dtype` gives for this model."""
    return kv_dtype(cache_dtype, loaded.model.dtype)
