"""`jpaged bench` and jpaged.bench.throughput on the tiny model: counts, timings, engine metrics."""

from __future__ import annotations

import json

import pytest
from helpers import make_llm, tiny, tiny_model_dir
from typer.testing import CliRunner

from jpaged.bench.throughput import random_prompts, run_throughput, summary_line
from jpaged.cli import app

# The engine shape of tests/jpaged/test_engine.py, so the compiled steps are shared.
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              num_gpu_blocks_override=128, block_size=8)
FLAGS = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
         "--num-gpu-blocks-override", "128", "--block-size", "8"]
TIMING_KEYS = {"elapsed_time", "requests_per_second", "tokens_per_second",
               "output_tokens_per_second", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
               "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms"}


@pytest.fixture(scope="module")
def llm():
    return make_llm(tiny(), **ENGINE)


def test_random_prompts_are_seeded_and_in_vocab():
    a = random_prompts(300, 5, 17, seed=3)
    assert a == random_prompts(300, 5, 17, seed=3) != random_prompts(300, 5, 17, seed=4)
    assert len(a) == 5 and all(len(p) == 17 and all(0 <= t < 300 for t in p) for p in a)
    with pytest.raises(ValueError, match="input_len"):
        random_prompts(300, 5, 0, seed=0)


def test_counts_and_timings(llm):
    r = run_throughput(llm, num_prompts=4, input_len=24, output_len=6, seed=0, warmup=False)
    assert (r["num_requests"], r["total_prompt_tokens"], r["total_output_tokens"]) == (4, 96, 24)
    assert r["total_num_tokens"] == 120
    assert r["requests_per_second"] * r["elapsed_time"] == pytest.approx(4)
    assert r["output_tokens_per_second"] * r["elapsed_time"] == pytest.approx(24)
    assert 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"] <= r["elapsed_time"] * 1e3
    assert 0 < r["mean_tpot_ms"] < r["elapsed_time"] * 1e3
    assert r["num_preemptions"] == 0 and 0 < r["kv_cache_usage_peak"] <= 1
    assert r["num_steps"] >= 6  # at least one step per generated token
    assert llm.get_metrics()["kv_cache_usage"] == 0.0
    assert summary_line(r).startswith("Throughput: ") and "output tokens/s" in summary_line(r)


def test_oversubscribed_pool_preempts_and_is_reported(llm):
    # 8 x (150 + 40) tokens need 8 x 24 blocks; the pool has 127.
    r = run_throughput(llm, num_prompts=8, input_len=150, output_len=40, seed=1, warmup=False)
    assert r["total_output_tokens"] == 8 * 40
    assert r["num_preemptions"] > 0 and r["kv_cache_usage_peak"] > 0.9


def test_cli_json_and_out(tmp_path):
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, ["bench", "--model", str(tiny_model_dir()), "--num-prompts",
                                   "3", "--input-len", "16", "--output-len", "4", "--json",
                                   "--out", str(out), *FLAGS])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert TIMING_KEYS <= set(r)
    assert {"num_preemptions", "prefix_cache_hit_rate", "kv_cache_usage_peak", "warmup",
            "num_gpu_blocks", "block_size", "max_num_seqs"} <= set(r)
    assert r["warmup"] is True and r["num_gpu_blocks"] == 128 and r["total_output_tokens"] == 12
    saved = json.loads(out.read_text())
    assert saved["num_requests"] == 3 and "machine" in saved


def test_cli_rejects_too_long_requests():
    res = CliRunner().invoke(app, ["bench", "--model", str(tiny_model_dir()), "--input-len",
                                   "250", "--output-len", "10", *FLAGS])
    assert res.exit_code == 2
    assert "max_model_len" in res.stderr and "Traceback" not in res.output


def test_cli_names_the_flag_of_a_size_below_one():
    for flag in ("--num-prompts", "--input-len", "--output-len"):
        res = CliRunner().invoke(app, ["bench", "--model", "/nonexistent", flag, "0", *FLAGS])
        # Refused before the model loads: the missing model is never reached.
        assert res.exit_code == 2 and f"{flag} must be >= 1" in res.stderr, res.output
