"""KV pool sizing: the budget arithmetic, when the step probe runs, the start-up error naming the
largest max_model_len that fits, the override, per-device heads, and XLA's memory analysis."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest
from helpers import tiny
from tiny_models import tiny_spec

from jpaged.config import CacheConfig, EngineArgs
from jpaged.engine import LLMEngine
from jpaged.runner.batch import BucketPlan
from jpaged.runner.kv_cache import (
    CPU_DEFAULT_KV_BYTES,
    MEMORY_MARGIN_BYTES,
    bytes_per_block,
    num_blocks_for,
    plan_kv_pool,
)
from jpaged.runner.memory_probe import largest_shape, step_activation_bytes
from pallas_kernels.backend import select_backend

SPEC = tiny_spec()  # 2 layers, 2 KV heads, head_dim 16
GIB, MIB = 2**30, 2**20
F32 = jnp.float32


class Probe:
    """An activation figure that records whether sizing asked for it."""

    def __init__(self, value: int | None) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> int | None:
        self.calls += 1
        return self.value


def test_bytes_per_block_and_head_split():
    # 2 layers x 16 tokens x (K, V) x 2 heads x 16 dims x 4 bytes
    assert bytes_per_block(SPEC, 16, F32) == 2 * 16 * 2 * 2 * 16 * 4 == 8192
    assert bytes_per_block(SPEC, 16, jnp.float8_e4m3fn) == 2048
    assert bytes_per_block(SPEC, 16, F32, kv_head_shards=2) == 4096  # one head per device
    assert bytes_per_block(SPEC, 16, F32, kv_head_shards=4) == 4096  # replicated, not 0.5
    with pytest.raises(ValueError, match="kv_head_shards"):
        bytes_per_block(SPEC, 16, F32, kv_head_shards=0)


def test_budget_is_fraction_minus_params_activations_margin(caplog):
    probe = Probe(100 * MIB)
    cache = CacheConfig(block_size=16, gpu_memory_utilization=0.5)
    with caplog.at_level(logging.INFO, logger="jpaged"):
        plan = plan_kv_pool(cache, SPEC, F32, param_bytes=GIB, max_model_len=1024,
                            activation_bytes=probe, device_bytes=8 * GIB, platform="gpu")
    want = 4 * GIB - GIB - 100 * MIB - MEMORY_MARGIN_BYTES
    assert probe.calls == 1
    assert plan.source == "gpu_memory_utilization" and plan.kv_budget_bytes == want
    assert plan.num_blocks == want // 8192
    assert plan.max_concurrent_seqs == (plan.num_blocks - 1) // 64  # 64 blocks per sequence
    text = caplog.text
    for part in ("device memory 8.000 GiB", "utilization 0.5", "params 1.000 GiB",
                 "activations 0.098 GiB", "8192 B/block", f"{plan.num_blocks} blocks",
                 f"{plan.max_concurrent_seqs} concurrent sequences of max_model_len=1024"):
        assert part in text, part
    # Per device under tensor parallelism: half the heads, twice the blocks.
    split = plan_kv_pool(cache, SPEC, F32, GIB, 1024, activation_bytes=100 * MIB,
                         device_bytes=8 * GIB, platform="gpu", kv_head_shards=2)
    assert split.num_blocks == want // 4096


def test_gpu_default_utilization_is_0_9():
    plan = plan_kv_pool(CacheConfig(), SPEC, F32, 0, 256, activation_bytes=0,
                        device_bytes=10 * GIB, platform="gpu")
    assert plan.utilization == 0.9
    assert plan.kv_budget_bytes == 9 * GIB - MEMORY_MARGIN_BYTES


def test_cpu_default_is_2gib_capped_by_ram():
    big = plan_kv_pool(CacheConfig(), SPEC, F32, 0, 256, activation_bytes=0,
                       device_bytes=64 * GIB, platform="cpu")
    assert big.source == "cpu_default" and big.kv_budget_bytes == CPU_DEFAULT_KV_BYTES
    small = plan_kv_pool(CacheConfig(), SPEC, F32, GIB // 2, 256, activation_bytes=GIB // 4,
                         device_bytes=2 * GIB, platform="cpu")
    assert small.kv_budget_bytes == int(2 * GIB * 0.9) - GIB // 2 - GIB // 4 - MEMORY_MARGIN_BYTES
    explicit = plan_kv_pool(CacheConfig(gpu_memory_utilization=0.5), SPEC, F32, 0, 256,
                            activation_bytes=0, device_bytes=64 * GIB, platform="cpu")
    assert explicit.source == "gpu_memory_utilization"
    assert explicit.kv_budget_bytes == 32 * GIB - MEMORY_MARGIN_BYTES


def test_cpu_devices_split_the_machines_ram_and_default(monkeypatch):
    """On CPU, host_devices devices share the RAM and the 2 GiB default; a GPU ignores it."""
    import jpaged.runner.kv_cache as kc

    monkeypatch.setattr(kc, "device_memory_bytes", lambda: 30 * GIB)
    one = plan_kv_pool(CacheConfig(), SPEC, F32, GIB, 256, activation_bytes=0,
                       platform="cpu")
    three = plan_kv_pool(CacheConfig(), SPEC, F32, GIB // 3, 256, activation_bytes=0,
                         kv_head_shards=3, platform="cpu", host_devices=3)
    assert one.kv_budget_bytes == CPU_DEFAULT_KV_BYTES
    assert three.kv_budget_bytes == CPU_DEFAULT_KV_BYTES // 3 and three.host_devices == 3
    assert three.device_bytes == 10 * GIB + GIB // 3  # its share of the RAM, plus its weights
    tight = plan_kv_pool(CacheConfig(gpu_memory_utilization=0.5), SPEC, F32, 0, 256,
                         activation_bytes=0, platform="cpu", host_devices=3)
    assert tight.kv_budget_bytes == 5 * GIB - MEMORY_MARGIN_BYTES
    gpu = plan_kv_pool(CacheConfig(), SPEC, F32, 0, 256, activation_bytes=0,
                       device_bytes=10 * GIB, platform="gpu", host_devices=3)
    assert gpu.kv_budget_bytes == 9 * GIB - MEMORY_MARGIN_BYTES and gpu.host_devices == 1
    with pytest.raises(ValueError, match="host_devices"):
        plan_kv_pool(CacheConfig(), SPEC, F32, 0, 256, platform="cpu", host_devices=0)


def test_missing_memory_analysis_counts_zero_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="jpaged"):
        plan = plan_kv_pool(CacheConfig(gpu_memory_utilization=0.5), SPEC, F32, 0, 256,
                            activation_bytes=Probe(None), device_bytes=2 * GIB, platform="gpu")
    assert plan.activation_bytes is None and plan.kv_budget_bytes == GIB - MEMORY_MARGIN_BYTES
    assert "no memory analysis" in caplog.text


def test_explicit_budget_and_override_skip_the_probe():
    probe = Probe(10 * GIB)  # would leave nothing if it were counted
    kv_bytes = CacheConfig(block_size=16, kv_cache_memory_bytes=100 * 8192)
    assert num_blocks_for(kv_bytes, SPEC, F32, 5 * GIB, 64, activation_bytes=probe,
                          device_bytes=GIB) == 100
    override = CacheConfig(block_size=16, num_gpu_blocks_override=7, gpu_memory_utilization=0.01)
    assert num_blocks_for(override, SPEC, F32, 5 * GIB, 4096, activation_bytes=probe,
                          device_bytes=GIB) == 7  # wins even though 4096 tokens do not fit
    assert probe.calls == 0


def test_too_small_for_one_request_names_the_largest_fitting_len():
    cache = CacheConfig(block_size=16, kv_cache_memory_bytes=10 * 8192)  # 10 blocks, 9 usable
    with pytest.raises(ValueError, match=r"max_model_len=1024.*largest max_model_len that fits "
                                         r"is 144"):
        num_blocks_for(cache, SPEC, F32, 0, 1024)
    assert num_blocks_for(cache, SPEC, F32, 0, 144) == 10
    starved = CacheConfig(gpu_memory_utilization=0.1)
    with pytest.raises(ValueError, match="not even one block fits"):
        num_blocks_for(starved, SPEC, F32, GIB, 64, activation_bytes=0, device_bytes=GIB,
                       platform="gpu")


@pytest.mark.parametrize("chunk", [2048, None])
def test_hybrid_model_error_names_a_length_that_fits(chunk):
    """Gemma 3's 5 sliding : 1 global layers: a request's blocks do not grow in proportion
    to its length (the sliding groups' are capped), so the length the error names is found
    by bisection: it fits, one token more does not (vLLM's estimate_max_model_len). Found
    by vLLM's kv_cache_utils tests: the proportional figure named lengths that failed again."""
    from types import SimpleNamespace

    from jpaged.core.kv_cache_groups import blocks_by_length, kv_cache_layout

    windows = [512] * 5 + [None]
    spec = SimpleNamespace(num_layers=6, num_kv_heads=2, head_dim=64, layer_windows=windows)
    layout = kv_cache_layout(windows)
    blocks = blocks_by_length(layout, 16, chunk)
    budget = 2001 * bytes_per_block(spec, 16, F32, kv_layers=layout.num_slots)
    cache = CacheConfig(block_size=16, kv_cache_memory_bytes=budget)

    def plan(n: int):
        return plan_kv_pool(cache, spec, F32, 0, n, platform="cpu",
                            kv_layers=layout.num_slots, request_blocks=blocks)

    with pytest.raises(ValueError, match=r"fits is (\d+)") as e:
        plan(32768)
    fits = int(str(e.value).split("fits is ")[1].split(".")[0])
    assert plan(fits).num_blocks == 2001
    with pytest.raises(ValueError):
        plan(fits + 1)


def test_engine_start_up_error_and_override():
    with pytest.raises(ValueError, match="largest max_model_len that fits is 64"):
        LLMEngine(EngineArgs(max_model_len=256, block_size=16,
                             kv_cache_memory_bytes=bytes_per_block(tiny().spec, 16, F32) * 5),
                  loaded=tiny())
    eng = LLMEngine(EngineArgs(max_model_len=256, block_size=16, num_gpu_blocks_override=9,
                               kv_cache_memory_bytes=10**9, max_num_seqs=4,
                               max_num_batched_tokens=64), loaded=tiny())
    assert eng.config.cache.num_gpu_blocks == 9 and eng.runner.kv.num_blocks == 9


def test_gpu_memory_utilization_default_and_validation():
    assert EngineArgs().gpu_memory_utilization is None
    assert CacheConfig().gpu_memory_utilization is None
    assert CacheConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            CacheConfig(gpu_memory_utilization=bad)


def test_memory_analysis_probe_is_positive_on_cpu():
    loaded = tiny()
    plan = BucketPlan(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                      block_size=16)
    assert largest_shape(plan) == (64, 4)
    temp = step_activation_bytes(loaded.model, loaded.spec, plan, 16, F32,
                                 select_backend("reference"))
    # The [T, intermediate] MLP activation of 64 float32 tokens alone is a floor.
    assert temp is not None and temp >= 64 * loaded.spec.intermediate_size * 4
