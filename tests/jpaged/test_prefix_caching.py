"""Automatic prefix caching through the engine: exact hit counts, identical outputs, salts,
shared prompt blocks for n > 1, reset."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_llm, tiny

from jpaged import SamplingParams
from jpaged.intmath import cdiv

BS = 8


def _llm(**kw):
    args = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                num_gpu_blocks_override=160, block_size=BS)
    args.update(kw)
    return make_llm(tiny(), **args)


@pytest.fixture(scope="module")
def llm():
    return _llm()


def _shared_prompts(n_shared_blocks=3, n=4, suffix=5, seed=0):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, 256, n_shared_blocks * BS).tolist()
    return [prefix + rng.integers(0, 256, suffix).tolist() for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("together", [False, True])
def test_hits_equal_theoretical_count(llm, together):
    llm.reset_prefix_cache()
    before = llm.get_metrics()
    prompts = _shared_prompts(seed=1 if together else 2)
    if together:
        llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    else:
        for p in prompts:
            llm.generate({"prompt_token_ids": p}, GREEDY)
    m = llm.get_metrics()
    hits = m["prefix_cache_hits"] - before["prefix_cache_hits"]
    queries = m["prefix_cache_queries"] - before["prefix_cache_queries"]
    assert hits == 3 * BS * (len(prompts) - 1)  # shared full blocks x later requests
    assert queries == sum(len(p) for p in prompts)


def test_request_output_reports_cached_prompt_tokens(llm):
    llm.reset_prefix_cache()
    first, second = _shared_prompts(seed=3, n=2)
    a = llm.generate({"prompt_token_ids": first}, GREEDY)[0]
    b = llm.generate({"prompt_token_ids": second}, GREEDY)[0]
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 3 * BS  # the shared full blocks


def test_outputs_identical_with_caching_on_and_off():
    prompts = [{"prompt_token_ids": p} for p in _shared_prompts(n=6, suffix=11, seed=3)]
    on, off = _llm(enable_prefix_caching=True), _llm(enable_prefix_caching=False)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in on.generate(prompts, p)]
    a2 = [o.outputs[0].token_ids for o in on.generate(prompts, p)]  # all from the cache
    b = [o.outputs[0].token_ids for o in off.generate(prompts, p)]
    assert a == b == a2
    assert on.get_metrics()["prefix_cache_hits"] > 0
    assert off.get_metrics()["prefix_cache_hits"] == 0


def test_cache_salt_isolates(llm):
    llm.reset_prefix_cache()
    p = _shared_prompts(n=1, seed=4)[0]
    h0 = llm.get_metrics()["prefix_cache_hits"]
    llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-a"}, GREEDY)
    llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-b"}, GREEDY)
    assert llm.get_metrics()["prefix_cache_hits"] == h0
    llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-a"}, GREEDY)
    assert llm.get_metrics()["prefix_cache_hits"] == h0 + 3 * BS


def test_parallel_sampling_shares_prompt_blocks():
    llm = _llm(num_gpu_blocks_override=200)
    eng = llm.llm_engine
    prompt = np.random.default_rng(5).integers(0, 256, 100).tolist()  # 12 full blocks + 4
    gen = 20
    p = SamplingParams(n=8, temperature=1.0, max_tokens=gen, seed=0, ignore_eos=True)
    eng.add_request("par", {"prompt_token_ids": prompt}, p)
    peak = 0
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
        m = eng.get_metrics()
        peak = max(peak, m["num_blocks_total"] - m["num_blocks_free"])
    prompt_blocks = cdiv(len(prompt), BS)
    gen_blocks = cdiv(gen, BS)
    assert peak <= prompt_blocks + 8 * (gen_blocks + 1)
    final = [o for o in outs if o.finished][0]
    assert len(final.outputs) == 8 and all(len(c.token_ids) == gen for c in final.outputs)


def test_reset_prefix_cache(llm):
    p = _shared_prompts(n=1, seed=6)[0]
    llm.generate({"prompt_token_ids": p}, GREEDY)
    assert llm.reset_prefix_cache() is True
    h = llm.get_metrics()["prefix_cache_hits"]
    llm.generate({"prompt_token_ids": p}, GREEDY)
    assert llm.get_metrics()["prefix_cache_hits"] == h
