"""attention_backend='pallas' runs the Pallas kernels (interpret mode on CPU) inside the engine
and gives the same greedy tokens as the reference backend."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import embedded, make_llm, tiny

from jpaged import SamplingParams
from jpaged.runner.sampler import SamplingFlags


def _compare(loaded, lengths, max_tokens, kv_in_qkv=False):
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 256, n).tolist()} for n in lengths]
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    res = {}
    for backend in ("reference", "pallas"):
        llm = make_llm(loaded, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                       num_gpu_blocks_override=40, block_size=16, attention_backend=backend)
        assert llm.llm_engine.ops.name == backend
        # Pallas: the decode matmuls run the steps (all <= 64 tokens here), and where RoPE fits
        # in their epilogue the q/k/v launch writes K/V too.
        runner = llm.llm_engine.runner
        assert (runner.linears is not None) == (backend == "pallas")
        assert runner.write_kv_in_qkv == (kv_in_qkv and backend == "pallas")
        res[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
        # Pure decode steps say so (a program of their own on Pallas); the others do not.
        pure = SamplingFlags(decode_only=True)
        assert llm.llm_engine.runner.static_flags(pure).decode_only == (backend == "pallas")
    assert res["pallas"] == res["reference"]


def test_pallas_backend_equals_reference_tiny():
    _compare(tiny(), (5, 17, 40), 6)  # head_dim 16: RoPE (and the K/V write) after the launch


@pytest.mark.slow
def test_pallas_backend_equals_reference_embedded():
    _compare(embedded(), (5, 20), 4, kv_in_qkv=True)  # interpret mode: keep it short


def test_pallas_verifies_proposals_in_ragged_steps():
    """Speculative decoding on the Pallas kernels (interpret mode): a verifying request is one
    sequence of k + 1 tokens through the tiled ragged kernel (not the decode kernel), sampled
    at each, and the greedy tokens equal the reference backend's without speculation."""
    rng = np.random.default_rng(2)  # a pattern whose continuation the proposer finds
    pattern = rng.integers(3, 200, 5).tolist()
    prompts = [{"prompt_token_ids": (pattern * 6)[:n]} for n in (12, 17, 23)]
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
            "prompt_lookup_max": 3}
    res = {}
    for backend, sc in (("reference", None), ("pallas", spec)):
        llm = make_llm(tiny(), max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32,
                       num_gpu_blocks_override=40, block_size=8, attention_backend=backend,
                       speculative_config=sc, async_scheduling=False)
        res[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    m = llm.llm_engine.get_metrics()
    assert m["spec_decode_num_drafts"] > 0 and m["spec_decode_num_accepted_tokens"] > 0, m
    assert res["pallas"] == res["reference"]
