"""The host KV tier on the embedded model: a ~300-token prompt evicted to the host tier and
asked again is served from it, with the same greedy output."""

from __future__ import annotations

import pytest
from helpers import embedded, make_llm

from jpaged import SamplingParams

pytestmark = pytest.mark.slow
TEXT = ("The paged KV cache splits the keys and values of every sequence into fixed-size blocks. "
        "A block table maps each logical block to a physical block in a pool. ") * 9


def test_host_tier_hit_gives_identical_greedy_output():
    loaded = embedded()
    ids = loaded.tokenizer.encode(TEXT)[:300]
    filler = loaded.tokenizer.encode("Once upon a time, " * 40)[:200]
    spec = loaded.spec
    block_bytes = spec.num_layers * 2 * 16 * spec.num_kv_heads * spec.head_dim * 4
    # 26 usable blocks: the 200-token filler (13 blocks) evicts part of the prompt's 18 cached.
    llm = make_llm(loaded, max_model_len=416, num_gpu_blocks_override=27, block_size=16,
                   max_num_batched_tokens=512, max_num_seqs=2,
                   kv_offloading_size=40 * block_bytes / 2**30)
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": ids}, p)[0].outputs[0].token_ids
    llm.generate({"prompt_token_ids": filler}, SamplingParams(temperature=0, max_tokens=1))
    again = llm.generate({"prompt_token_ids": ids}, p)[0].outputs[0].token_ids
    m = llm.get_metrics()
    assert again == first
    # The filler evicts the prompt's tail blocks (a freed chain goes tail first): the re-ask
    # hits its 18 full blocks, the head on the device and the tail on the host tier.
    assert m["prefix_cache_hits"] == 18 * 16
    assert m["offload_hits_blocks"] >= 4 and m["kv_cache_usage"] == 0.0
