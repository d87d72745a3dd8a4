"""Sliding-window and soft-capped models through the paged engine: greedy tokens equal HF
transformers' (eager attention, float32) with prompts longer than the window and decoding past
it, through chunked prefill, preemption and prefix-cache hits across a window boundary."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_llm
from tiny_models import make_hf_checkpoint

from jpaged import SamplingParams
from models import load_model

torch = pytest.importorskip("torch")

NEW_TOKENS = 12
# Windows 4 (Gemma 3, Gemma 2, Mistral) and 5 (Qwen2) against 4-token blocks: a window of one
# block, and one that is not a multiple of the block size; prompts span many windows.
BLOCK = 4


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(k)).tolist() for k in rng.integers(9, 30, size=n)]


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])  # an explicit mask: token 0 is not padding here
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                      do_sample=False, eos_token_id=None, pad_token_id=299)
    return out[0, len(prompt):].tolist()


KINDS = ["gemma3", "gemma2", "mistral_sliding", "qwen2_sliding_upper_layers"]
# Memory pressure on two of them (suite time): mixed layers (unrolled on XLA:CPU) and
# uniform ones (scanned).
PRESSURE_KINDS = ["gemma3", "mistral_sliding"]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """kind -> (kind, loaded model, prompts, HF's greedy tokens), built once per kind."""
    built: dict[str, tuple] = {}

    def get(kind: str) -> tuple:
        if kind not in built:
            path = tmp_path_factory.mktemp(kind)
            hf = make_hf_checkpoint(kind, path)
            hf.generation_config.eos_token_id = None
            ps = prompts(5)
            built[kind] = (kind, load_model(str(path), dtype="float32"), ps,
                           [hf_greedy(hf, p) for p in ps])
        return built[kind]

    return get


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def tokens(llm, ps: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_hf_with_chunked_prefill(cases, kind):
    kind, loaded, ps, want = cases(kind)
    assert any(w is not None for w in loaded.spec.layer_windows), kind
    llm = make_llm(loaded, block_size=BLOCK, max_model_len=64, max_num_seqs=4,
                   max_num_batched_tokens=8)  # 8-token chunks: prompts cross windows mid-chunk
    assert tokens(llm, ps) == want


@pytest.mark.parametrize("kind", PRESSURE_KINDS)
def test_greedy_tokens_equal_hf_under_preemption_and_prefix_hits(cases, kind):
    kind, loaded, ps, want = cases(kind)
    # 14 blocks of 4 tokens for 5 sequences of up to 41 tokens: requests are preempted
    # (recompute) and resumed; then the same prompts again hit the prefix cache.
    llm = make_llm(loaded, block_size=BLOCK, max_model_len=64, max_num_seqs=5,
                   max_num_batched_tokens=32, num_gpu_blocks_override=14,
                   enable_prefix_caching=True)
    assert tokens(llm, ps) == want
    metrics = llm.llm_engine.get_metrics()
    assert metrics["num_preemptions"] > 0, metrics
    shared = [ps[0] + p for p in ps[1:3]]  # a shared 4+-block prefix, then a different tail
    assert tokens(llm, shared) == tokens(make_llm(loaded, block_size=BLOCK, max_model_len=96,
                                                  max_num_seqs=4), shared)
    assert llm.llm_engine.get_metrics()["prefix_cache_hits"] > 0
