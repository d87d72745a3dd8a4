"""The tuning flow's decisions, driven by a deterministic engine-free trial runner."""

from __future__ import annotations

import dataclasses

import pytest

from jpaged.tune.driver import recommended_flags, run_tune, serve_command
from jpaged.tune.policy import (
    TrialConfig,
    TrialResult,
    TunePolicy,
    memory_ladder,
    seqs_ladder,
)


@dataclasses.dataclass
class FakeRunner:
    """A capacity model: each request needs `need` blocks; whatever runs concurrently beyond
    what the pool holds is preempted; throughput grows with concurrency up to `saturate`."""

    n: int = 64
    need: int = 10
    saturate: int = 32
    prefix_hit: float = 0.0
    fp8_speed: float = 1.0
    queues: bool = False  # over-subscription queues (full pool) instead of preempting
    calls: list = dataclasses.field(default_factory=list)

    def __call__(self, cfg: TrialConfig) -> TrialResult:
        self.calls.append(cfg)
        blocks = int(cfg.memory) * (2 if cfg.kv_cache_dtype == "fp8" else 1)
        fits = (blocks - 1) // self.need
        if fits < 1:
            return TrialResult(cfg, self.n, error="the pool cannot hold one request")
        conc = min(cfg.max_num_seqs, self.n)
        pre = 0 if self.queues else max(0, conc - fits) * 3
        usage = min(1.0, conc * self.need / (blocks - 1))
        cost = 0.05 if cfg.preemption_mode == "swap" else 1.0
        tps = 100.0 * min(conc, self.saturate, fits) / (1 + cost * pre / self.n)
        if cfg.kv_cache_dtype == "fp8":
            tps *= self.fp8_speed
        hit = self.prefix_hit if cfg.enable_prefix_caching else 0.0
        tps *= 1 + hit
        return TrialResult(cfg, self.n, num_preemptions=pre, prefix_cache_hit_rate=hit,
                           tokens_per_second=tps, num_gpu_blocks=blocks,
                           kv_cache_usage_peak=usage)


def start(memory: int = 100, seqs: int = 256, **kw) -> TrialConfig:
    return TrialConfig("num_gpu_blocks_override", memory, seqs, **kw)


def tune(runner, cfg, ladder, **kw):
    policy = TunePolicy(cfg, ladder, seqs_cap=runner.n, **kw)
    return policy, run_tune(policy, runner, max_seconds=3600)


def test_ladders():
    assert memory_ladder("gpu_memory_utilization", 0.70) == [0.7, 0.75, 0.8, 0.85, 0.9, 0.95]
    assert memory_ladder("gpu_memory_utilization", 0.70, quick=True) == [0.7, 0.8, 0.9, 0.95]
    assert memory_ladder("num_gpu_blocks_override", 32, quick=True, top=121) == [32, 64, 128]
    assert memory_ladder("kv_cache_memory_bytes", 1000, top=2000) == [1000, 1500, 2250]
    assert memory_ladder("kv_cache_memory_bytes", 5000, top=2000) == [5000]
    assert len(memory_ladder("kv_cache_memory_bytes", 10, max_steps=4)) == 4
    assert seqs_ladder(32, 256) == [32, 64, 128, 256]
    assert seqs_ladder(32, 100, quick=True) == [32, 100]
    assert seqs_ladder(32, 8) == [8]
    with pytest.raises(ValueError, match="memory flag"):
        memory_ladder("swap_space", 1.0)
    with pytest.raises(ValueError, match="memory_flag"):
        TrialConfig("swap_space", 1.0, 8)


def test_memory_rises_until_preemptions_are_rare_then_seqs_saturate():
    runner = FakeRunner()  # 64 requests x 10 blocks: 641 blocks hold them all
    ladder = memory_ladder("num_gpu_blocks_override", 100, top=641)
    policy, report = tune(runner, start(), ladder)
    phases = [s["phase"] for s in report.steps]
    mem = [s["num_gpu_blocks_override"] for s in report.steps if s["phase"] == "memory"]
    # 100, 150, 225, 338, 507 preempt; 761 holds all 64 at once.
    assert mem == [100, 150, 225, 338, 507, 761]
    assert report.steps[len(mem) - 1]["note"] == "preemptions rare, pool not full: memory chosen"
    seqs = [s["max_num_seqs"] for s in report.steps if s["phase"] == "seqs"]
    assert seqs == [32, 64]  # 64 is no faster than 32 (saturate=32): stop
    assert report.steps[-1]["note"] == "throughput saturated"
    assert "features" not in phases  # nothing is short of memory, caching already on
    assert report.recommended == {"num_gpu_blocks_override": 761, "max_num_seqs": 32,
                                  "enable_prefix_caching": True}
    assert report.steps[report.recommended_step]["max_num_seqs"] == 32
    assert not report.stopped_early and len(runner.calls) == len(set(runner.calls))


def test_a_full_pool_that_queues_instead_of_preempting_still_gets_more_memory():
    runner = FakeRunner(n=8, queues=True)  # 8 x 10 blocks; no preemption, a queue instead
    _, report = tune(runner, start(20, 8), [20, 40, 80, 160])
    mem = [(s["num_gpu_blocks_override"], s["note"]) for s in report.steps
           if s["phase"] == "memory"]
    assert mem == [(20, "pool full: more memory"), (40, "pool full: more memory"),
                   (80, "pool full: more memory"),
                   (160, "preemptions rare, pool not full: memory chosen")]
    assert report.recommended["num_gpu_blocks_override"] == 160
    _, report = tune(runner, start(20, 8), [20, 40])
    assert report.steps[1]["note"] == "pool full at every setting: the fastest one kept"
    assert report.recommended["num_gpu_blocks_override"] == 40


def test_memory_exhausted_lowers_seqs_then_tries_fp8_and_offload():
    runner = FakeRunner(fp8_speed=1.0)
    cfg = TrialConfig("num_gpu_blocks_override", 150, 64)
    policy, report = tune(runner, cfg, [150, 200])
    notes = [(s["phase"], s["max_num_seqs"], s["note"]) for s in report.steps]
    assert notes[1][2] == "top of the memory ladder still preempts: fewer sequences next"
    assert policy.memory_exhausted
    seqs = [s["max_num_seqs"] for s in report.steps if s["phase"] == "seqs"]
    assert seqs == [32, 16]  # 200 blocks hold 19: 32 preempts, 16 does not
    feats = [s for s in report.steps if s["phase"] == "features"]
    assert [(s["kv_cache_dtype"], s["preemption_mode"]) for s in feats] == [
        ("fp8", "recompute"), ("auto", "swap")]
    # fp8 doubles the pool to 39 requests: at the starting 64 seqs it still preempts often, so
    # it is dropped; offloading makes preemptions cheap (swap), and 64 seqs beat 16: kept.
    assert feats[0]["note"] == "fp8: no gain, dropped"
    assert feats[1]["note"] == "offload: helps, kept"
    rec = report.recommended
    assert rec["kv_offloading_size"] == 4.0 and rec["preemption_mode"] == "swap"
    assert rec["max_num_seqs"] == 64 and "kv_cache_dtype" not in rec


def test_fp8_kept_when_it_makes_the_starting_concurrency_fit():
    runner = FakeRunner(n=16)
    policy, report = tune(runner, start(100, 16), [100, 120], try_fp8=True)
    feats = [s["note"] for s in report.steps if s["phase"] == "features"]
    # 239 fp8 blocks hold 16 x 10; offloading on top of that adds nothing.
    assert feats == ["fp8: helps, kept", "offload: no gain, dropped"]
    assert report.recommended["kv_cache_dtype"] == "fp8"
    assert report.recommended["max_num_seqs"] == 16


def test_prefix_caching_is_tried_when_off_and_kept_when_it_hits():
    runner = FakeRunner(n=8, prefix_hit=0.4)
    _, report = tune(runner, start(200, 8, enable_prefix_caching=False), [200])
    last = report.steps[-1]
    assert last["phase"] == "features" and last["enable_prefix_caching"] is True
    assert last["note"] == "prefix: helps, kept"
    assert report.recommended["enable_prefix_caching"] is True
    runner = FakeRunner(n=8, prefix_hit=0.0)
    _, report = tune(runner, start(200, 8, enable_prefix_caching=False), [200])
    assert report.steps[-1]["note"] == "prefix: no gain, dropped"


def test_failed_trials_count_as_frequent_preemption():
    runner = FakeRunner(n=4)
    _, report = tune(runner, start(8, 4), [8, 16, 64])
    assert report.steps[0]["error"] and report.steps[0]["preemption_rate"] is None
    assert report.steps[0]["note"].startswith("failed: ")
    assert report.recommended["num_gpu_blocks_override"] == 64


def test_time_limit_stops_with_the_best_so_far():
    runner = FakeRunner()
    clock = [0.0]

    def slow(cfg):
        clock[0] += 100.0  # every trial takes 100 s of fake time
        return runner(cfg)

    ladder = memory_ladder("num_gpu_blocks_override", 100, top=641)
    policy = TunePolicy(start(), ladder, seqs_cap=runner.n)
    report = run_tune(policy, slow, max_seconds=350, clock=lambda: clock[0])
    assert report.stopped_early and len(report.steps) == 3  # a 4th would end past 350 s
    # Still preempting at 225 blocks, but the least: that is the best so far.
    assert report.recommended["num_gpu_blocks_override"] == 225
    assert report.recommended_step == 2
    with pytest.raises(ValueError, match="max_seconds"):
        run_tune(policy, slow, max_seconds=0)


def test_recommended_flags_and_serve_command():
    cfg = TrialConfig("gpu_memory_utilization", 0.85, 128, True, "fp8", 4.0, "swap")
    flags = recommended_flags(cfg)
    assert flags == {"gpu_memory_utilization": 0.85, "max_num_seqs": 128,
                     "enable_prefix_caching": True, "kv_cache_dtype": "fp8",
                     "kv_offloading_size": 4.0, "preemption_mode": "swap"}
    cmd = serve_command({**flags, "enable_prefix_caching": False},
                        {"model": "m.gguf", "max_model_len": None, "block_size": 32})
    assert cmd == ("jpaged serve --model m.gguf --block-size 32 --gpu-memory-utilization 0.85 "
                   "--max-num-seqs 128 --no-enable-prefix-caching --kv-cache-dtype fp8 "
                   "--kv-offloading-size 4 --preemption-mode swap")
