"""`jpaged estimate`: the LLaMA-13B figure, GQA, fp8, tensor parallelism, bad input -> exit 2."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from typer.testing import CliRunner

from jpaged.cli import app
from jpaged.estimate import EstimateError, estimate_capacity, param_counts, parse_memory, rows
from models.config import ModelSpec

LLAMA_13B = {  # huggyllama/llama-13b: 40 layers, hidden 5120, 40 heads, no GQA
    "architectures": ["LlamaForCausalLM"], "hidden_size": 5120, "intermediate_size": 13824,
    "num_attention_heads": 40, "num_hidden_layers": 40, "vocab_size": 32000,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "torch_dtype": "float16",
    "hidden_act": "silu", "tie_word_embeddings": False,
}
LLAMA3_8B = {  # meta-llama/Meta-Llama-3-8B: 8 KV heads of 128
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16", "hidden_act": "silu",
}

GEMMA3_27B = {  # google/gemma-3-27b-it's text model (Gemma 3 report): 62 layers, 5 local : 1
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 5376,
    "intermediate_size": 21504, "num_attention_heads": 32, "num_key_value_heads": 16,
    "head_dim": 128, "num_hidden_layers": 62, "vocab_size": 262208,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "sliding_window": 1024,
    "query_pre_attn_scalar": 168, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "torch_dtype": "bfloat16",
    "hidden_activation": "gelu_pytorch_tanh",
}


@pytest.fixture
def cfg13(tmp_path):
    path = tmp_path / "llama-13b" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA_13B))
    return path


@pytest.fixture
def cfg8(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    return path


def run(*args: str):
    return CliRunner().invoke(app, ["estimate", *args])


def test_llama_13b_bf16_is_819200_bytes_per_token(cfg13):
    est = estimate_capacity(str(cfg13.parent), dtype="bfloat16", max_model_len=2048, avg_len=500)
    assert est.bytes_per_token == 819_200 == 2 * 40 * 40 * 128 * 2
    assert est.bytes_per_block == 16 * 819_200  # a block holds 16 TOKENS: 13.1 MB, not 16 KB
    assert est.param_count == 13_015_864_320  # the published LLaMA-13B parameter count
    assert est.param_bytes == 2 * est.param_count
    assert est.kv_budget_bytes == (int(80 * 2**30 * 0.9) - est.param_bytes
                                   - est.activation_bytes - est.margin_bytes)
    assert est.num_blocks == est.kv_budget_bytes // est.bytes_per_block
    assert est.blocks_per_seq == 128 and est.blocks_per_avg_seq == 32  # ceil(500 / 16)
    assert est.max_concurrent_seqs == (est.num_blocks - 1) // 128  # block 0 is the null block
    assert est.max_concurrent_seqs_at_avg_len == (est.num_blocks - 1) // 32
    r = run("--model", str(cfg13), "--dtype", "bfloat16", "--max-model-len", "2048")
    assert r.exit_code == 0, r.output
    assert "819,200 B" in r.output and "13,107,200 B" in r.output
    assert f"{est.num_blocks:,}" in r.output


def test_gqa_fp8_and_model_dtype(cfg8):
    est = estimate_capacity(str(cfg8), max_model_len=8192)
    assert est.dtype == "bfloat16" == est.kv_cache_dtype  # auto = the config's torch_dtype
    assert est.bytes_per_token == 131_072 == 2 * 32 * 8 * 128 * 2
    assert est.param_count == 8_030_261_248  # the published Llama-3-8B parameter count
    fp8 = estimate_capacity(str(cfg8), max_model_len=8192, kv_cache_dtype="fp8")
    assert fp8.kv_cache_dtype == "fp8_e4m3"
    assert fp8.bytes_per_token == 65_536 and fp8.bytes_per_block == est.bytes_per_block // 2
    assert fp8.param_bytes == est.param_bytes
    assert 2 * est.num_blocks <= fp8.num_blocks <= 2 * est.num_blocks + 1
    f32 = estimate_capacity(str(cfg8), dtype="float32", max_model_len=8192)
    assert f32.param_bytes == 2 * est.param_bytes and f32.bytes_per_token == 262_144


def test_tensor_parallel_splits_heads_and_replicates_kv_heads(cfg8):
    one = estimate_capacity(str(cfg8))
    two = estimate_capacity(str(cfg8), tensor_parallel_size=2)
    assert two.bytes_per_token == one.bytes_per_token  # model-wide figure unchanged
    assert two.kv_heads_per_device == 4 and two.bytes_per_token_per_device == 65_536
    # Everything is split in two except the 2 x 32 + 1 RMSNorm weights, held by both devices.
    assert 2 * two.param_bytes_per_device - one.param_bytes == 2 * (2 * 32 + 1) * 4096
    assert two.num_blocks > 2 * one.num_blocks  # half the weights per device, half the KV
    sixteen = estimate_capacity(str(cfg8), tensor_parallel_size=16)
    assert sixteen.kv_heads_per_device == 1  # 8 KV heads over 16 devices: each holds one
    assert sixteen.bytes_per_token_per_device == 2 * 32 * 1 * 128 * 2
    r = run("--model", str(cfg8), "--tensor-parallel-size", "2", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["kv_heads_per_device"] == 4
    r = run("--model", str(cfg8), "--tensor-parallel-size", "3")
    assert r.exit_code == 2 and "--tensor-parallel-size" in r.output


def test_param_count_matches_the_models_jpaged_builds():
    import jax.numpy as jnp
    from flax import nnx
    from tiny_models import TINY_CONFIGS

    from models.registry import get_model_class

    # Biases, tied embeddings, explicit head_dim and qk norms: every supported architecture.
    for kind, (cls_name, kwargs) in TINY_CONFIGS.items():
        arch = cls_name.removesuffix("Config").removesuffix("Text") + "ForCausalLM"
        spec = ModelSpec.from_hf_config({**kwargs, "architectures": [arch]})
        model = nnx.eval_shape(lambda s=spec, a=arch: get_model_class(a)(
            s, dtype=jnp.float32, rngs=nnx.Rngs(0)))
        want = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert param_counts(spec)[0] == want, kind


def test_embedded_default_model_and_json_keys():
    r = run("--json", "--max-model-len", "4096", "--avg-len", "1000",
            "--gpu-memory", "16GiB", "--kv-cache-dtype", "float32")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert {"bytes_per_token", "bytes_per_block", "param_bytes", "num_blocks",
            "max_concurrent_seqs", "max_concurrent_seqs_at_avg_len", "kv_budget_bytes",
            "blocks_per_seq", "activation_bytes"} <= set(out)
    # SmolLM2-135M from its GGUF metadata: 30 layers, 3 KV heads of 64, tied embeddings.
    assert out["bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert out["param_bytes"] == 2 * 134_515_008  # bf16 weights by default
    assert out["bytes_per_block"] == 16 * out["bytes_per_token"]
    assert out["max_concurrent_seqs"] == (out["num_blocks"] - 1) // 256
    assert out["max_concurrent_seqs_at_avg_len"] == (out["num_blocks"] - 1) // 63


def test_parse_memory():
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("80GB") == 80 * 10**9
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("1.5 tib") == int(1.5 * 2**40)
    assert parse_memory("123456") == 123456
    for bad in ("80 gigs", "", "-1GB", "0"):
        with pytest.raises(EstimateError, match="--gpu-memory"):
            parse_memory(bad)


@pytest.mark.parametrize("args,flag,needle", [
    (["--model", "/nonexistent/h1b/config.json"], "--model", "not found"),
    (["--model", "jpaged-test/no-such-repo-h1b"], "--model", "local"),
    (["--gpu-memory", "80 gigs"], "--gpu-memory", "80GiB"),
    (["--block-size", "12"], "--block-size", "power of two"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization", "(0, 1]"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization", "(0, 1]"),
    (["--kv-cache-dtype", "int4"], "--kv-cache-dtype", "fp8_e5m2"),
    (["--max-model-len", "9000"], "--max-model-len", "8192"),
    (["--avg-len", "4000", "--max-model-len", "2048"], "--avg-len", "2048"),
    (["--gpu-memory", "300MiB"], "--gpu-memory", "not two blocks"),
])
def test_bad_input_exits_2_naming_the_flag(args, flag, needle):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert flag in r.output and needle in r.output


def test_too_small_for_one_sequence_names_the_largest_max_model_len(cfg13):
    est = estimate_capacity(str(cfg13), gpu_memory="30GB", max_model_len=256)
    fits = (est.num_blocks - 1) * 16
    assert 256 < fits < 2048
    r = run("--model", str(cfg13), "--gpu-memory", "30GB", "--max-model-len", "2048")
    assert r.exit_code == 2 and "--max-model-len" in r.output
    assert f"largest max_model_len that fits is {fits}" in r.output
    assert estimate_capacity(str(cfg13), gpu_memory="30GB", max_model_len=fits).num_blocks
    with pytest.raises(EstimateError, match="--max-model-len"):
        estimate_capacity(str(cfg13), gpu_memory="30GB", max_model_len=fits + 1)


def test_unreadable_model_files_exit_2(tmp_path):
    bad_gguf = tmp_path / "model.gguf"
    bad_gguf.write_bytes(b"GGUF\x03\x00\x00\x00\x01")  # truncated header
    bad_json = tmp_path / "bad" / "config.json"
    bad_json.parent.mkdir()
    bad_json.write_text("{not json")
    foreign = tmp_path / "gpt2.json"
    foreign.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_layer": 12}))
    for path, needle in ((bad_gguf, "truncated GGUF"), (bad_json.parent, "JSON"),
                         (foreign, "unsupported architecture")):
        r = run("--model", str(path))
        assert r.exit_code == 2 and "--model" in r.output and needle in r.output, r.output


def test_hybrid_gemma3_27b_at_128k_against_the_full_layout(tmp_path):
    """Sliding layers need their window plus a chunk: cdiv(1024 - 1 + 2048, 16) + 1 = 193
    blocks against 8192 for a 131072-token sequence; the dense figures are untouched."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA3_27B))
    est = estimate_capacity(str(path), gpu_memory="141GiB", max_model_len=131072,
                            max_num_batched_tokens=2048)
    assert est.bytes_per_token == 2 * 62 * 16 * 128 * 2
    assert (est.sliding_layers, est.sliding_window) == (52, 1024)  # 62 - 10 global layers
    per_layer_block = 16 * 2 * 16 * 128 * 2
    # The engine's groups: gcd(52, 10) = 2 layers a block id, 5 full + 26 sliding groups.
    assert est.bytes_per_block_per_device == 2 * per_layer_block
    assert est.blocks_per_seq == 5 * 8192 + 26 * 193
    assert est.full_layout_bytes_per_seq == 62 * 8192 * per_layer_block
    assert est.hybrid_bytes_per_seq == (10 * 8192 + 52 * 193) * per_layer_block
    assert est.hybrid_capacity_ratio == pytest.approx(62 * 8192 / (10 * 8192 + 52 * 193))
    assert est.hybrid_capacity_ratio > 5  # ~5.4x: a full layout holds ~5x what is ever read
    assert est.max_concurrent_seqs >= 5 * max(est.full_layout_max_concurrent_seqs, 1)
    r = run("--model", str(path), "--gpu-memory", "141GiB", "--max-model-len", "131072")
    assert r.exit_code == 0, r.output
    assert "hybrid layout" in r.output and "52 (window 1,024) / 10" in r.output
    # 80 GiB: the full layout could not hold one 131072-token sequence (the estimate refused
    # it before), the engine's hybrid layout holds it.
    small = estimate_capacity(str(path), gpu_memory="80GiB", max_model_len=131072)
    assert small.max_concurrent_seqs >= 1 and small.full_layout_max_concurrent_seqs == 0
    dense = estimate_capacity(str(path.parent), gpu_memory="141GiB", max_model_len=2048)
    assert dense.hybrid_capacity_ratio < est.hybrid_capacity_ratio  # short contexts gain less


def test_a_draft_model_counts_its_weights_and_blocks():
    from models.loader import embedded_gguf_path

    plain = estimate_capacity(None, gpu_memory="4GiB")
    both = estimate_capacity(None, gpu_memory="4GiB", draft_model=str(embedded_gguf_path()))
    assert both.draft_bytes_per_block == plain.bytes_per_block_per_device
    assert both.draft_param_bytes == plain.param_bytes
    assert both.kv_budget_bytes == plain.kv_budget_bytes - plain.param_bytes
    assert both.num_blocks == both.kv_budget_bytes // (2 * plain.bytes_per_block_per_device)
    assert any(name == "draft model (speculative)" for name, _ in rows(both))


def test_gptq_int4_counts_its_groups_and_a_quantized_head(cfg8):
    """Llama-3-8B as a GPTQ 4-bit checkpoint in groups of 128: half a byte a weight and a
    float16 scale and min a group; GPTQ's `lm_head` flag quantizes the head the same way."""
    cfg = json.loads(cfg8.read_text())
    bf16 = estimate_capacity(str(cfg8)).param_bytes
    head = 4096 * 128_256  # the untied head's elements

    def gptq(**extra) -> int:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, **extra}
        cfg8.write_text(json.dumps({**cfg, "quantization_config": qc}))
        return estimate_capacity(str(cfg8)).param_bytes

    linears = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
    plain = gptq()
    assert bf16 - plain == linears * 2 - (linears // 2 + linears // 128 * 4)
    assert plain - gptq(lm_head=True) == head * 2 - (head // 2 + head // 128 * 4)


def test_lora_slots_come_out_of_the_kv_budget():
    """--enable-lora: max_loras slots of max_lora_rank on every projection, per device."""
    from jpaged.estimate import load_spec
    from models.lora import lora_slot_bytes

    base = estimate_capacity(None, dtype="bfloat16")
    lora = estimate_capacity(None, dtype="bfloat16", enable_lora=True, max_loras=4,
                             max_lora_rank=64)
    want = lora_slot_bytes(load_spec(None)[0], 4, 64, 2)
    assert lora.lora_slot_bytes == want and base.lora_slot_bytes == 0
    assert base.kv_budget_bytes - lora.kv_budget_bytes == want
    assert lora.num_blocks < base.num_blocks
    with pytest.raises(EstimateError, match="--max-loras"):
        estimate_capacity(None, enable_lora=True, max_loras=0)
