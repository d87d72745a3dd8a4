"""Paged vs naive at equal KV memory on the tiny model: concurrency, waste, sharing."""

from helpers import tiny

from jpaged.bench.vs_naive import (
    kv_budget_bytes,
    paged_engine,
    parallel_sampling_blocks,
    run_naive,
    run_paged,
)
from jpaged.bench.workloads import mixed_length_requests
from jpaged.naive import NaiveEngine


def test_paged_fits_more_and_wastes_less_at_equal_memory():
    loaded = tiny()
    max_len = 128
    budget = kv_budget_bytes(loaded, 2, max_len)
    paged = paged_engine(loaded, budget, max_len, max_num_seqs=8)
    naive = NaiveEngine(loaded, max_len, budget)
    assert naive.rows == 2 and paged.config.cache.num_gpu_blocks == 2 * max_len // 16
    # <= 24 tokens each: 2 blocks, so all 7 fit in the 15 usable blocks. The prompts (~80
    # tokens) take two steps (the first one fills the 64-token bucket); outputs of >= 4 tokens
    # keep the first-step requests running until the rest are admitted.
    work = mixed_length_requests(loaded.spec.vocab_size, 7, 0, (8, 16), (4, 8))
    p = run_paged(paged, work, "p")
    n = run_naive(naive, work, "n")
    want = sum(o for _, o in work)
    assert p["tokens"] == n["tokens"] == want
    assert n["max_concurrency"] == 2 and p["max_concurrency"] == 7
    assert 0.0 <= p["waste"] < 0.5 < n["waste"] < 1.0
    assert p["tokens_per_s"] > 0 and n["tokens_per_s"] > 0
    assert p["compile_s"] >= 0.0 and p["wall_s"] >= p["compile_s"]


def test_parallel_sampling_shares_prompt_blocks():
    loaded = tiny()
    prompts = [p for p, _ in mixed_length_requests(loaded.spec.vocab_size, 2, 1, (48, 48),
                                                   (1, 1))]
    res = parallel_sampling_blocks(loaded, prompts, max_tokens=4, max_model_len=64, n=4)
    # Between steps a live sequence holds at most 48 + 4 - 2 = 50 tokens of KV. Unshared:
    # 8 sequences x 4 blocks. Shared: the first 2 prompt blocks once per
    # prompt (the block holding the last prompt token is always recomputed), 2 per sequence.
    assert res["unshared"] == 8 * 4
    assert res["shared"] == 2 * (2 + 4 * 2)
