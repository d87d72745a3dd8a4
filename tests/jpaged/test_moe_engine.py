"""Mixture-of-experts models through the paged engine: greedy tokens equal HF transformers'
(float32) for Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE (a dense layer among sparse
ones), through chunked prefill, preemption, prefix-cache hits and the Pallas backend; the
estimate counts every expert."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import hf_cases, make_llm
from helpers import hf_greedy as hf_generate

from jpaged import SamplingParams
from jpaged.estimate import param_counts
from models import load_model

torch = pytest.importorskip("torch")

NEW_TOKENS = 10
BLOCK = 4
POOL = 256
KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    return hf_generate(hf, prompt, NEW_TOKENS)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """kind -> (checkpoint dir, loaded model, prompts, HF's greedy tokens), built once."""
    return hf_cases(tmp_path_factory, 4, NEW_TOKENS)


def tokens(llm, ps: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_hf_with_chunked_prefill(cases, kind):
    _, loaded, ps, want = cases(kind)
    assert loaded.spec.is_moe
    llm = make_llm(loaded, block_size=BLOCK, max_model_len=64, max_num_seqs=4,
                   max_num_batched_tokens=8, num_gpu_blocks_override=POOL)
    assert tokens(llm, ps) == want


def test_greedy_tokens_equal_hf_under_preemption_and_prefix_hits(cases):
    _, loaded, ps, want = cases("qwen3_moe")
    llm = make_llm(loaded, block_size=BLOCK, max_model_len=64, max_num_seqs=4,
                   max_num_batched_tokens=32, num_gpu_blocks_override=14,
                   enable_prefix_caching=True)
    assert tokens(llm, ps) == want
    assert llm.llm_engine.get_metrics()["num_preemptions"] > 0
    shared = [ps[0] + p for p in ps[1:3]]
    assert tokens(llm, shared) == [hf_greedy(cases.hf["qwen3_moe"], p) for p in shared]
    assert llm.llm_engine.get_metrics()["prefix_cache_hits"] > 0


def test_the_pallas_backend_keeps_its_attention_kernels_beside_the_experts(cases):
    """Fused q/k/v and o projections (interpret mode) with the experts on XLA between them."""
    _, loaded, ps, want = cases("mixtral")
    llm = make_llm(loaded, block_size=BLOCK, max_model_len=64, max_num_seqs=4,
                   max_num_batched_tokens=8, attention_backend="pallas",
                   num_gpu_blocks_override=POOL)
    runner = llm.llm_engine.runner
    assert runner.ops.name == "pallas" and runner.linears is not None
    assert tokens(llm, ps[:2]) == want[:2]


def test_estimate_counts_every_expert(cases):
    from typer.testing import CliRunner

    from jpaged.cli import app

    path, loaded, _, _ = cases("qwen2_moe")
    r = CliRunner().invoke(app, ["estimate", "--model", str(path), "--json",
                                 "--dtype", "float32", "--max-model-len", "64"])
    assert r.exit_code == 0, r.output
    n = sum(int(np.prod(x.shape)) for x in _params(loaded))
    assert param_counts(loaded.spec)[0] == n
    assert json.loads(r.output)["param_bytes"] == 4 * n
    # fp8: every expert and projection at a byte and a float32 scale per output channel; the
    # estimate equals the bytes the engine's model holds.
    r = CliRunner().invoke(app, ["estimate", "--model", str(path), "--json", "--dtype",
                                 "float32", "--max-model-len", "64", "--quantization", "fp8"])
    assert r.exit_code == 0, r.output
    fp8 = load_model(str(path), dtype="float32", quantization="fp8")
    assert json.loads(r.output)["param_bytes"] == sum(x.nbytes for x in _params(fp8))


def _params(loaded) -> list:
    import jax
    from flax import nnx

    return jax.tree.leaves(nnx.state(loaded.model, nnx.Param))


def test_a_lora_adapter_on_attention_equals_peft(cases, tmp_path):
    """Qwen3-MoE with a peft adapter on its attention projections, beside the base model in
    the same steps: each request's tokens are peft's (the experts take no adapter)."""
    from lora_fixtures import peft_model, write_peft_adapter

    from jpaged.lora_request import LoRARequest

    _, loaded, ps, want = cases("qwen3_moe")
    hf = cases.hf["qwen3_moe"]
    path = write_peft_adapter(hf, tmp_path / "a", r=4, alpha=8,
                              targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=3)
    adapted = peft_model(hf, path)
    eos = (299,)  # never sampled in 10 tokens here: both sides run to max_tokens
    lora_want = [hf_generate(adapted, p, NEW_TOKENS, eos) for p in ps[:2]]
    assert lora_want != want[:2]  # the adapter changes the answers
    llm = make_llm(loaded, block_size=BLOCK, max_model_len=64, max_num_seqs=4,
                   max_num_batched_tokens=32, num_gpu_blocks_override=POOL, enable_lora=True,
                   max_lora_rank=4)
    lora = LoRARequest("a", 1, str(path))
    outs = llm.generate([{"prompt_token_ids": p} for p in ps[:2] * 2], GREEDY, use_tqdm=False,
                        lora_request=[None, None, lora, lora])
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == want[:2] + lora_want


def test_a_gguf_runs_at_its_own_quantization_through_the_engine(cases, tmp_path):
    """A Qwen3-MoE GGUF (int4 / int8 experts, Q8_0 attention) as a user runs it,
    `LLM(model=file.gguf, quantization="gguf")`: the dequantized GGUF's greedy tokens, on the
    XLA path and beside the Pallas backend's fused attention projections (interpret mode);
    `estimate --quantization gguf` counts the bytes the engine's model holds."""
    from tiny_models import MOE_GGUF_TYPES, write_moe_gguf
    from typer.testing import CliRunner

    from jpaged import LLM
    from jpaged.cli import app

    path, loaded, ps, _ = cases("qwen3_moe")
    gguf = write_moe_gguf(tmp_path / "moe.gguf", path, loaded.spec, "qwen3moe", MOE_GGUF_TYPES)
    sizing = dict(block_size=BLOCK, max_model_len=64, max_num_seqs=4,
                  max_num_batched_tokens=16, num_gpu_blocks_override=POOL)
    want = tokens(make_llm(load_model(str(gguf), dtype="float32"), **sizing), ps)
    llm = LLM(model=str(gguf), quantization="gguf", dtype="float32", **sizing)
    assert tokens(llm, ps) == want
    quant = llm.llm_engine.loaded
    pallas = make_llm(quant, attention_backend="pallas", **sizing)
    assert pallas.llm_engine.runner.linears is not None
    assert tokens(pallas, ps[:2]) == want[:2]
    r = CliRunner().invoke(app, ["estimate", "--model", str(gguf), "--json", "--dtype",
                                 "float32", "--max-model-len", "64", "--quantization", "gguf"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["param_bytes"] == sum(x.nbytes for x in _params(quant))
