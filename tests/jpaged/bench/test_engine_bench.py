"""Compile counting and host-overhead measurement on the tiny model."""

import pytest
from helpers import tiny

from jpaged.bench.engine_bench import count_compiles, host_overhead
from jpaged.bench.workloads import mixed_length_requests
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine


def _engine() -> LLMEngine:
    args = EngineArgs(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                      num_gpu_blocks_override=64, disable_log_stats=True)
    return LLMEngine(args, loaded=tiny())


def test_count_compiles_then_host_overhead():
    engine = _engine()
    res = count_compiles(engine, num_requests=10, seed=3, prompt_range=(4, 40),
                         output_range=(1, 6))
    assert res["compiles_total"] == res["bucket_shapes"] == len(engine.runner.plan.all_shapes())
    assert 1 <= res["compiles_lazy"] <= res["compiles_total"]
    assert res["compiles_after_warmup"] == 0
    longest = max(o for _, o in mixed_length_requests(tiny().spec.vocab_size, 10, 3, (4, 40),
                                                      (1, 6)))
    assert min(res["steps_cold"], res["steps_warm"]) >= longest
    h = host_overhead(engine, batch=4, steps=3)
    assert set(h) >= {"batch", "host_share", "host_ms", "device_ms"}
    assert 0.0 < h["host_share"] < 1.0 and h["device_ms"] > 0.0
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == 63  # nothing leaked


def test_bad_inputs_are_refused():
    engine = _engine()
    with pytest.raises(ValueError, match="max_num_seqs"):
        host_overhead(engine, batch=8)
    engine.runner.warmup([(1, 1)])
    with pytest.raises(ValueError, match="cold engine"):
        count_compiles(engine, num_requests=2)
