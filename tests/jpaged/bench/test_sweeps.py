"""The block-size and pool-depth sweeps on the tiny model with a tiny grid."""

from __future__ import annotations

import json

from helpers import tiny

from jpaged.bench import report
from jpaged.bench.sweeps import plot_block_size, plot_pool_depth, run_sweeps

POINT_KEYS = {"prefix_cache_hit_rate", "prefix_cache_hits", "num_preemptions", "num_evictions",
              "kv_waste", "tokens_per_second", "elapsed_s", "computed_prompt_tokens",
              "kv_cache_usage_peak", "num_gpu_blocks", "block_size"}


def test_sweeps_json_keys_and_deterministic_trends(tmp_path):
    # The engine shape of tests/jpaged/test_engine.py (KV array of 128 blocks of 8), so the
    # compiled steps are shared through the persistent cache.
    data = run_sweeps(tiny(), bs_prefix_tokens=40, bs_per_group=3, bs_max_tokens=3,
                      prefix_tokens=40, pool_groups=2, pool_per_group=2, max_tokens=24,
                      pool_fracs=(0.95, 0.5), max_num_seqs=8,
                      block_sizes=(8,), pool_block_size=8, max_model_len=256,
                      max_num_batched_tokens=64, min_kv_blocks=128)
    assert set(data) == {"workload", "block_size", "pool_depth"}
    (bs8,) = data["block_size"]
    assert POINT_KEYS | {"theoretical_hit_rate"} <= set(bs8)
    # Three prompts share a 40+ token prefix: requests 2 and 3 hit its full blocks, exactly.
    assert bs8["prefix_cache_hit_rate"] == bs8["theoretical_hit_rate"] > 0.3
    assert bs8["num_preemptions"] == 0 and 0 < bs8["kv_waste"] < 1
    big, small = data["pool_depth"]
    assert POINT_KEYS <= set(big) and big["num_gpu_blocks"] > small["num_gpu_blocks"]
    assert big["num_preemptions"] == 0 and small["num_preemptions"] > 0
    assert small["prefix_cache_hit_rate"] <= big["prefix_cache_hit_rate"]
    report.write(tmp_path / "s.json", data)
    assert json.loads((tmp_path / "s.json").read_text())["pool_depth"][0] == big
    plot_block_size(data["block_size"], tmp_path / "bs.png", "t")
    plot_pool_depth(data["pool_depth"], tmp_path / "pool.png", "t")
    assert (tmp_path / "bs.png").stat().st_size > 0 and (tmp_path / "pool.png").stat().st_size > 0
