"""`jpaged tune` end to end on the tiny model, and its workload inputs."""

from __future__ import annotations

import json

import pytest
from helpers import make_llm, tiny, tiny_model_dir
from typer.testing import CliRunner

from jpaged.bench.throughput import run_batch
from jpaged.cli import app
from jpaged.sampling_params import RequestOutputKind, SamplingParams
from jpaged.tune.workload import load_jsonl, parse_synthetic, sample, synthetic

# 33 blocks of 8 tokens: the least pool that holds one max_model_len=256 request (32 usable
# blocks and the null block); the quick ladder goes 33, 66, 132.
BASE = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
        "--block-size", "8"]
SPEC = "n=8,in=100,out=60,seed=3"  # 8 x 20 blocks of 8 tokens: 33 blocks are far too few


def test_quick_tune_on_a_too_small_pool_recommends_more_memory_and_preempts_less():
    res = CliRunner().invoke(app, ["tune", "--model", str(tiny_model_dir()), "--quick",
                                   "--json", "--synthetic", SPEC,
                                   "--num-gpu-blocks-override", "33", *BASE])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    steps, rec = out["steps"], out["recommended"]
    start = steps[0]
    assert start["num_gpu_blocks_override"] == 33 and start["num_preemptions"] > 0
    for key in ("max_num_seqs", "preemption_rate", "prefix_cache_hit_rate", "tokens_per_second",
                "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "phase", "note"):
        assert key in start
    assert rec["num_gpu_blocks_override"] > 33 or rec["max_num_seqs"] < 8
    assert "--num-gpu-blocks-override" in out["command"]
    assert out["command"].startswith("jpaged serve --model ")
    # Replay the recommendation on a fresh engine built from its flags.
    llm = make_llm(tiny(), max_model_len=256, max_num_batched_tokens=64, block_size=8,
                   disable_log_stats=True, **rec)
    reqs = synthetic(parse_synthetic(SPEC), tiny().spec.vocab_size)
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True,
                             output_kind=RequestOutputKind.FINAL_ONLY) for r in reqs]
    replay = run_batch(llm.llm_engine, [r.prompt_token_ids for r in reqs], params, "replay")
    assert replay["num_preemptions"] < start["num_preemptions"]
    assert replay["num_preemptions"] == steps[out["recommended_step"]]["num_preemptions"]


def test_workload_file_and_synthetic_spec_errors(tmp_path):
    tok = tiny().tokenizer
    f = tmp_path / "w.jsonl"
    f.write_text('{"prompt": "hello there", "max_tokens": 5}\n\n'
                 '{"prompt_token_ids": [1, 2, 3]}\n'
                 '{"messages": [{"role": "user", "content": "hi"}], "output_len": 7}\n')
    reqs = load_jsonl(f, tok)
    assert [r.max_tokens for r in reqs] == [5, 128, 7]
    assert reqs[1].prompt_token_ids == (1, 2, 3)
    assert len(sample(reqs, 2)) == 2 and sample(reqs, 2) == sample(reqs, 2)
    f.write_text('{"prompt": "a"}\n{"max_tokens": 3}\n')
    with pytest.raises(ValueError, match=r"w.jsonl:2: needs 'prompt'"):
        load_jsonl(f, tok)
    with pytest.raises(FileNotFoundError, match="--workload"):
        load_jsonl(tmp_path / "missing.jsonl", tok)
    s = parse_synthetic("n=4,in=10,out=2,prefix=6")
    reqs = synthetic(s, 300)
    assert len(reqs) == 4 and all(r.prompt_token_ids[:6] == reqs[0].prompt_token_ids[:6]
                                  for r in reqs)
    assert reqs[0].prompt_token_ids[6:] != reqs[1].prompt_token_ids[6:]
    with pytest.raises(ValueError, match="key=value"):
        parse_synthetic("n=4,bogus=1")
    with pytest.raises(ValueError, match="prefix"):
        parse_synthetic("in=10,prefix=10")
    res = CliRunner().invoke(app, ["tune", "--model", str(tiny_model_dir()), "--synthetic",
                                   "n=2", "--workload", str(f)])
    assert res.exit_code == 2 and "not both" in res.stderr


def test_a_small_workload_never_tries_or_recommends_a_pool_below_one_max_model_len(tmp_path,
                                                                                   caplog):
    """Four short requests need few blocks, but the engine refuses a pool that cannot hold
    one max_model_len request: the ladder starts there (with a warning), so every trial runs
    and the recommended flags build an engine."""
    f = tmp_path / "small.jsonl"
    f.write_text("".join(json.dumps({"prompt_token_ids": [1, 2, 3, 4], "max_tokens": 4}) + "\n"
                         for _ in range(4)))
    with caplog.at_level("WARNING", logger="jpaged.tune"):
        res = CliRunner().invoke(app, ["tune", "--model", str(tiny_model_dir()), "--quick",
                                       "--json", "--workload", str(f),
                                       "--num-gpu-blocks-override", "10", *BASE])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    floor = 256 // 8 + 1  # max_model_len 256 in blocks of 8, plus the null block
    assert all(s["num_gpu_blocks_override"] >= floor for s in out["steps"]), out["steps"]
    assert out["recommended"]["num_gpu_blocks_override"] >= floor
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "cannot hold one request of max_model_len=256" in said
    assert "the workload has 4 requests" in said
    make_llm(tiny(), max_model_len=256, max_num_batched_tokens=64, block_size=8,
             disable_log_stats=True, **out["recommended"])  # starts: the flags can serve
