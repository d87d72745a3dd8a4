"""Mixture-of-experts layers (models/moe.py): the grouped matmul against a plain reference,
the router against HF's rule, the config fields, checkpoints in HF's per-expert layout (read,
refused when wrong, written back), and what is refused for experts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import TINY_CONFIGS, hf_logits, jpaged_logits, make_hf_checkpoint, relative_error

from models import load_model
from models.checkpoint import save_checkpoint, save_hf_dir
from models.config import ModelSpec
from models.gguf_loader import spec_from_gguf
from models.moe import _loop_grouped_matmul, grouped_matmul, route
from models.sharding import plan_layout

torch = pytest.importorskip("torch")
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def reference(x: np.ndarray, w: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Each group of rows times its expert's weight, in float64."""
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for e, n in enumerate(sizes):
        out[start:start + n] = x[start:start + n].astype(np.float64) @ w[e].astype(np.float64)
        start += n
    return out


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 300), e=st.integers(1, 12), k=st.sampled_from([16, 24, 64]),
       n=st.sampled_from([16, 40, 128]), dtype=st.sampled_from(["float32", "bfloat16"]),
       seed=st.integers(0, 2**16))
def test_grouped_matmul_equals_the_reference(m, e, k, n, dtype, seed):
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(m, rng.dirichlet(np.full(e, 0.3)))  # many groups empty
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((e, k, n)).astype(np.float32)
    jx, jw = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    want = reference(np.asarray(jx, np.float32), np.asarray(jw, np.float32), sizes)
    tol = 1e-4 if dtype == "float32" else 2e-2
    scale = max(1.0, float(np.abs(want).max()))
    # The while loop, the Pallas kernel (interpreted) and ragged_dot (XLA:CPU's dense form).
    for impl in ("loop", "interpret", "xla"):
        got = grouped_matmul(jx, jw, jnp.asarray(sizes), impl=impl)
        assert got.dtype == jnp.float32 and got.shape == (m, n)
        assert np.abs(np.asarray(got) - want).max() / scale < tol, impl


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 200), e=st.integers(1, 10), h=st.sampled_from([16, 64]),
       i=st.sampled_from([16, 48, 128]), dtype=st.sampled_from(["float32", "bfloat16"]),
       seed=st.integers(0, 2**16))
def test_the_kernels_swiglu_equals_the_reference(m, e, h, i, dtype, seed):
    """Gate and up in one launch (SiLU product in its epilogue), then down: the rows laid out
    once, against float64 (bf16: the product rounded to bf16 between the launches)."""
    from pallas_kernels.grouped_matmul import grouped_swiglu

    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(m, rng.dirichlet(np.full(e, 0.3)))
    x = jnp.asarray(rng.standard_normal((m, h), np.float32), dtype)
    wg, wu = (jnp.asarray(rng.standard_normal((e, h, i), np.float32) * 0.3, dtype)
              for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((e, i, h), np.float32) * 0.3, dtype)
    f = [np.asarray(a, np.float64) for a in (x, wg, wu, wd)]
    g, u = reference(f[0], f[1], sizes), reference(f[0], f[2], sizes)
    act = g / (1 + np.exp(-g)) * u
    want = reference(act, f[3], sizes)
    got = np.asarray(grouped_swiglu(x, wg, wu, wd, jnp.asarray(sizes), interpret=True))
    assert got.dtype == np.float32 and got.shape == (m, h)
    tol = 1e-4 if dtype == "float32" else 3e-2
    assert np.abs(got - want).max() / max(1.0, np.abs(want).max()) < tol


def test_the_loop_reads_only_chosen_experts_without_a_weight_sized_temporary():
    """Two decode rows against 64 experts: the loop's temporaries stay far below the experts'
    bytes (the ragged_dot fallback on XLA:CPU widens the rows per expert instead)."""
    m, e, k, n = 2, 64, 256, 512
    x = jax.ShapeDtypeStruct((m, k), jnp.float32)
    w = jax.ShapeDtypeStruct((e, k, n), jnp.float32)
    sizes = jax.ShapeDtypeStruct((e,), jnp.int32)
    compiled = jax.jit(lambda a, b, c: _loop_grouped_matmul(a, b, c, None)).lower(
        x, w, sizes).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < e * k * n * 4 / 16, temp  # under 4 experts' bytes of 64
    sizes_np = np.zeros(e, np.int32)
    sizes_np[[5, 40]] = 1
    rng = np.random.default_rng(0)
    xv, wv = rng.standard_normal((m, k), np.float32), rng.standard_normal((e, k, n), np.float32)
    got = compiled(jnp.asarray(xv), jnp.asarray(wv), jnp.asarray(sizes_np))
    np.testing.assert_allclose(np.asarray(got), reference(xv, wv, sizes_np), rtol=1e-4,
                               atol=1e-3)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_follows_hf(renormalize):
    logits = np.random.default_rng(2).standard_normal((7, 10)).astype(np.float32)
    weights, experts = route(jnp.asarray(logits), 3, renormalize)
    probs = torch.softmax(torch.tensor(logits), dim=-1)
    top, idx = torch.topk(probs, 3, dim=-1)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    np.testing.assert_array_equal(np.asarray(experts), idx.numpy())
    np.testing.assert_allclose(np.asarray(weights), top.numpy(), rtol=1e-6)


QWEN_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 300, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 256, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def test_config_fields_of_each_family():
    spec = ModelSpec.from_hf_config({**QWEN_MOE, "decoder_sparse_step": 2,
                                     "mlp_only_layers": [3], "norm_topk_prob": True})
    assert spec.sparse_layers == (False, True, False, False, False, True)
    assert [spec.layer_is_sparse(i) for i in range(6)] == list(spec.sparse_layers)
    assert spec.is_moe and spec.norm_topk_prob and spec.qk_norm
    assert ModelSpec.from_hf_config(QWEN_MOE).sparse_layers is None  # every layer sparse
    # transformers 5 writes Qwen3-MoE's count as num_local_experts.
    v5 = {k: v for k, v in QWEN_MOE.items() if k != "num_experts"} | {"num_local_experts": 8}
    assert ModelSpec.from_hf_config(v5).num_experts == 8
    mixtral = ModelSpec.from_hf_config({**QWEN_MOE, "architectures": ["MixtralForCausalLM"],
                                        "num_local_experts": 8})
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (
        8, 96, True)
    qwen2 = ModelSpec.from_hf_config({**QWEN_MOE, "architectures": ["Qwen2MoeForCausalLM"],
                                      "shared_expert_intermediate_size": 48})
    assert qwen2.attention_bias and qwen2.shared_expert_intermediate_size == 48
    assert not qwen2.norm_topk_prob  # HF's default for Qwen
    dense = ModelSpec.from_hf_config({**QWEN_MOE, "architectures": ["Qwen3ForCausalLM"]})
    assert not dense.is_moe and not dense.layer_is_sparse(0)
    # A Qwen MoE class with no experts is dense in every layer, as HF builds it.
    none = ModelSpec.from_hf_config({**QWEN_MOE, "num_experts": 0})
    assert none.architecture == "Qwen3MoeForCausalLM" and not none.is_moe
    assert not any(none.layer_is_sparse(i) for i in range(6))


@pytest.mark.parametrize("change,needle", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok (9) exceeds num_experts (8)"),
    ({"num_experts": -1}, "'num_experts' must be an int >= 1"),
    ({"moe_intermediate_size": None}, "'moe_intermediate_size' must be an int >= 1"),
    ({"mlp_only_layers": [6]}, "'mlp_only_layers' must list layer indices in [0, 6)"),
    ({"decoder_sparse_step": 0}, "'decoder_sparse_step' must be an int >= 1"),
    ({"norm_topk_prob": "yes"}, "'norm_topk_prob' must be true or false"),
])
def test_bad_expert_configs_are_refused_by_field(change, needle):
    with pytest.raises(ValueError) as e:
        ModelSpec.from_hf_config({**QWEN_MOE, **change})
    assert needle in str(e.value)


def test_tensor_parallel_must_split_the_experts_width():
    spec = ModelSpec.from_hf_config({**QWEN_MOE, "moe_intermediate_size": 30})
    plan_layout(spec, 2)
    with pytest.raises(ValueError, match="moe_intermediate_size=30 does not split 4 ways"):
        plan_layout(spec, 4)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_moe")
    return path, make_hf_checkpoint("qwen2_moe", path, seed=3)


def _copy_without(src: Path, dst: Path, drop: str | None = None,
                  reshape: str | None = None) -> Path:
    """`src`'s checkpoint in `dst`, one tensor dropped or one cut by a row."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_checkpoints_missing_or_misshapen_experts_are_refused_by_name(qwen2_moe, tmp_path):
    path, _ = qwen2_moe
    name = "model.layers.1.mlp.experts.4.up_proj.weight"
    with pytest.raises(ValueError, match=f"lacks tensor '{name}'"):
        load_model(str(_copy_without(path, tmp_path / "a", drop=name)), dtype="float32")
    with pytest.raises(ValueError, match=rf"tensor '{name}' .* has shape \(39, 64\), "
                                         r"expected \(40, 64\)"):
        load_model(str(_copy_without(path, tmp_path / "b", reshape=name)), dtype="float32")


def test_written_back_in_hfs_layout_and_through_a_jpaged_checkpoint(qwen2_moe, tmp_path):
    """save_hf_dir writes one tensor per expert (transformers loads it and gives the same
    logits); a jpaged (orbax) checkpoint loads back to the same model."""
    import transformers

    path, hf = qwen2_moe
    loaded = load_model(str(path), dtype="float32")
    seqs = [[256, 7, 99, 12, 150, 3, 42], [256, 1, 2]]
    want = hf_logits(hf, seqs)
    out = save_hf_dir(loaded, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_experts"] == 6 and cfg["shared_expert_intermediate_size"] == 72
    again = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    for a, b in zip(hf_logits(again, seqs), want, strict=True):
        assert relative_error(a, b) < 1e-5
    ckpt = save_checkpoint(loaded, tmp_path / "ckpt")
    back = load_model(str(ckpt), dtype="float32")
    assert back.spec == loaded.spec
    for a, b in zip(jpaged_logits(back.model, seqs), want, strict=True):
        assert relative_error(a, b) < 1e-3


def test_what_experts_do_not_take_is_refused(qwen2_moe, tmp_path):
    path, _ = qwen2_moe
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    shutil.copytree(path, tmp_path / "q")
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    # (says gptq, holds no packed tensor: refused, not loaded as a float model)
    with pytest.raises(ValueError, match=r"quantization_config says gptq, but no linear of .* "
                                         r"holds its packed tensors"):
        load_model(str(tmp_path / "q"), dtype="float32")
    cfg["quantization_config"] = {"quant_method": "fp8"}  # says fp8, holds no F8_E4M3 tensor
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no linear weight of .* is F8_E4M3"):
        load_model(str(tmp_path / "q"), dtype="float32")
    with pytest.raises(ValueError, match=r"a mixture-of-experts 'gemma3' model "
                                         r"\(gemma3.expert_count=8\) is not supported"):
        spec_from_gguf({"general.architecture": "gemma3", "gemma3.expert_count": 8}, set(),
                       Path("moe.gguf"))


def test_lora_on_an_expert_layers_mlp_is_refused(qwen2_moe, tmp_path):
    from safetensors.numpy import save_file

    from models.lora import read_lora_adapter

    path, _ = qwen2_moe
    spec = load_model(str(path), dtype="float32").spec
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"r": 2, "lora_alpha": 4, "peft_type": "LORA",
         "target_modules": ["q_proj", "gate_proj"]}))
    a = np.zeros((2, 64), np.float32)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
                   np.zeros((64, 2), np.float32),
               "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight": a,
               "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight":
                   np.zeros((96, 2), np.float32)},
              str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="adapts layer 0's gate_proj, but that layer is a "
                                         "mixture of experts"):
        read_lora_adapter(adapter, spec, "a", 8)


def test_every_family_is_a_tiny_config():
    """The HF-logit and engine tests cover each mixture-of-experts family."""
    archs = {cls for cls, _ in TINY_CONFIGS.values()}
    assert {"MixtralConfig", "Qwen2MoeConfig", "Qwen3MoeConfig"} <= archs


def test_the_kernel_in_the_model_gives_hfs_logits(tmp_path):
    """The tiny Mixtral with its experts on the Pallas kernel (interpreted) and on the loop."""
    from models.moe import experts_run_as

    hf = make_hf_checkpoint("mixtral", tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32")
    seqs = [[256, 7, 99, 12, 150, 3, 42], [256, 1, 2]]
    want = hf_logits(hf, seqs)
    for impl in ("interpret", "loop"):
        with experts_run_as(impl):
            got = jpaged_logits(loaded.model, seqs)
        for a, b in zip(got, want, strict=True):
            assert relative_error(a, b) < 1e-3, impl


def test_each_platform_runs_its_own_grouped_matmul():
    from models.moe import expert_impl, experts_run_as

    assert expert_impl("cpu") == "loop"
    assert expert_impl("gpu") == "pallas" and expert_impl("cuda") == "pallas"
    assert expert_impl("tpu") == "xla"
    with pytest.raises(ValueError, match="expert impl must be one of"), experts_run_as("fast"):
        pass


@pytest.mark.parametrize("kind,arch", [("mixtral", "llama"), ("qwen2_moe", "qwen2moe"),
                                       ("qwen3_moe", "qwen3moe")])
def test_a_gguf_mixture_of_experts_gives_hfs_logits(kind, arch, tmp_path):
    """llama.cpp's layout (experts stacked [E, out, in], the router as ffn_gate_inp, Qwen2-MoE's
    shared expert and its gate vector, a dense layer among sparse ones) loads dequantized."""
    from tiny_models import write_moe_gguf

    hf = make_hf_checkpoint(kind, tmp_path / "hf")
    spec = load_model(str(tmp_path / "hf"), dtype="float32").spec
    path = write_moe_gguf(tmp_path / f"{kind}.gguf", tmp_path / "hf", spec, arch)
    loaded = load_model(str(path), dtype="float32")
    got = loaded.spec
    assert (got.architecture, got.num_experts, got.num_experts_per_tok, got.norm_topk_prob,
            got.moe_intermediate_size, got.shared_expert_intermediate_size,
            got.sparse_layers) == (
        spec.architecture, spec.num_experts, spec.num_experts_per_tok, spec.norm_topk_prob,
        spec.moe_intermediate_size, spec.shared_expert_intermediate_size, spec.sparse_layers)
    seqs = [[256, 7, 99, 12, 150, 3, 42], [256, 1, 2]]
    for a, b in zip(jpaged_logits(loaded.model, seqs), hf_logits(hf, seqs), strict=True):
        assert relative_error(a, b) < 1e-3
    # fp8 at load quantizes the GGUF's stacked experts as it does HF's per-expert tensors.
    fp8 = load_model(str(path), dtype="float32", quantization="fp8")
    ref = load_model(str(tmp_path / "hf"), dtype="float32", quantization="fp8")
    for a, b in zip(jpaged_logits(fp8.model, seqs), jpaged_logits(ref.model, seqs), strict=True):
        assert relative_error(a, b) < 1e-6


@pytest.mark.parametrize("kind,arch", [("mixtral", "llama"), ("qwen2_moe_even", "qwen2moe"),
                                       ("qwen3_moe", "qwen3moe")])
def test_a_gguf_mixture_of_experts_runs_at_its_own_quantization(kind, arch, tmp_path):
    """`quantization="gguf"`: the stacked experts stay int4 / int8 on the device (QuantExperts)
    and give the dequantized model's logits on every way of the grouped matmul; the experts
    hold under 0.3x of their float32 bytes; `convert` writes them and they load back."""
    from flax import nnx
    from tiny_models import MOE_GGUF_TYPES, write_moe_gguf

    from models.checkpoint import load_checkpoint, save_checkpoint
    from models.moe import QuantExperts, experts_run_as

    make_hf_checkpoint(kind, tmp_path / "hf")
    spec = load_model(str(tmp_path / "hf"), dtype="float32").spec
    path = write_moe_gguf(tmp_path / f"{kind}.gguf", tmp_path / "hf", spec, arch,
                          MOE_GGUF_TYPES)
    floats = load_model(str(path), dtype="float32")
    quant = load_model(str(path), dtype="float32", quantization="gguf")
    experts = [x for _, x in nnx.iter_graph(quant.model) if isinstance(x, QuantExperts)]
    sparse = sum(spec.layer_is_sparse(i) for i in range(spec.num_layers))
    assert len(experts) == 3 * sparse
    assert {x.kind for x in experts} == {"int4", "int8"}
    held = sum(x.qweight.get_value().nbytes + x.scales.get_value().nbytes
               + (0 if x.mins is None else x.mins.get_value().nbytes) for x in experts)
    float_bytes = 3 * sparse * spec.num_experts * spec.hidden_size \
        * spec.moe_intermediate_size * 4
    assert held < 0.3 * float_bytes, held / float_bytes
    seqs = [[256, 7, 99, 12, 150, 3, 42], [256, 1, 2]]
    want = jpaged_logits(floats.model, seqs)
    for impl in ("loop", "interpret", "xla"):
        with experts_run_as(impl):
            got = jpaged_logits(quant.model, seqs)
        for a, b in zip(got, want, strict=True):
            assert relative_error(a, b) < 1e-5, impl
    save_checkpoint(quant, tmp_path / "orbax")
    back = load_checkpoint(tmp_path / "orbax")
    assert {type(x) for _, x in nnx.iter_graph(back.model)} >= {QuantExperts}
    for a, b in zip(jpaged_logits(back.model, seqs), want, strict=True):
        assert relative_error(a, b) < 1e-5


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_fp8_experts_give_the_float_models_logits_on_their_rounded_weights(kind, tmp_path):
    """`quantization="fp8"`: every expert fp8 per expert and output channel (the router and the
    shared expert's gate kept in the model's dtype); on the loop, the kernel (interpreted) and
    the logits are the float model's with each planned weight
    replaced by its fp8 rounding, and the experts hold a quarter of their float32 bytes."""
    import jax
    from flax import nnx

    from models.llama import stack_layers
    from models.moe import QuantExperts, experts_run_as
    from models.quant import dequantize_np, quantize_fp8
    from models.quant_layers import plan_of

    make_hf_checkpoint(kind, tmp_path)
    ref = load_model(str(tmp_path), dtype="float32")
    got = load_model(str(tmp_path), dtype="float32", quantization="fp8")
    plan = plan_of(got.model)
    moe = "block_sparse_moe" if kind == "mixtral" else "mlp"
    assert f"model.layers.0.{moe}.experts.gate_proj" in plan
    assert not any(p.endswith((".gate", "shared_expert_gate")) for p in plan)
    layer = got.model.model.layers[0]
    assert isinstance(getattr(layer, moe).experts.down_proj, QuantExperts)
    for module in plan:
        parent = ref.model
        *path, leaf = module.split(".")
        for part in path:
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        if leaf in ("gate_proj", "up_proj", "down_proj") and path[-1] == "experts":
            param = getattr(parent, leaf)
            w = np.asarray(param[...])
            param.set_value(jnp.asarray(np.stack([dequantize_np(quantize_fp8(x)) for x in w])))
        else:
            kernel = getattr(parent, leaf).kernel
            kernel.set_value(jnp.asarray(dequantize_np(quantize_fp8(np.asarray(kernel[...])))))
    seqs = [[256, 7, 99, 12, 150, 3, 42], [256, 1, 2]]
    want = jpaged_logits(ref.model, seqs)
    for impl in ("loop", "interpret"):
        with experts_run_as(impl):
            for a, b in zip(jpaged_logits(got.model, seqs), want, strict=True):
                assert relative_error(a, b) < 1e-5, impl
    # XLA:CPU's layer scan would copy every expert of a layer out of the stack each step.
    assert stack_layers(got.model) is got.model
    quantized = [x for _, x in nnx.iter_graph(got.model) if isinstance(x, QuantExperts)]
    floats = [x for p, x in nnx.iter_graph(ref.model)
              if isinstance(x, nnx.Param) and "experts" in map(str, p)]
    held = sum(a.nbytes for x in quantized for a in jax.tree.leaves(nnx.state(x)))
    assert held / sum(x.get_value().nbytes for x in floats) < 0.27  # values + scales


@pytest.mark.parametrize("method", ["compressed-tensors", "fp8"])
def test_an_fp8_checkpoint_of_a_mixture_of_experts_loads_its_own_scales(method, tmp_path):
    """llm-compressor's and AutoFP8's layout: every linear (each expert's w1/w2/w3 too) F8_E4M3
    with a per-tensor scale, the router left in float (compressed-tensors: ignored by name);
    the model gives the logits of the float checkpoint holding the same values, its experts
    stacked as fp8 with the checkpoint's scales."""
    from safetensors.numpy import load_file, save_file

    from models.moe import QuantExperts

    make_hf_checkpoint("mixtral", tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    quant, rounded = {}, {}
    rng = np.random.default_rng(0)
    for name, w in tensors.items():
        linear = name.endswith("proj.weight") or ".experts." in name
        if not linear:
            quant[name] = rounded[name] = w
            continue
        scale = np.float32(np.abs(w).max() / 448 * rng.uniform(1.0, 1.5))
        q = np.clip(w / scale, -448, 448).astype(FP8)
        quant[name], quant[name.replace(".weight", ".weight_scale")] = q, np.array(scale)
        rounded[name] = q.astype(np.float32) * scale
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    for d, ts, qc in (("q", quant, _fp8_config(method)), ("f", rounded, None)):
        shutil.copytree(tmp_path / "hf", tmp_path / d)
        save_file(ts, str(tmp_path / d / "model.safetensors"))
        (tmp_path / d / "config.json").write_text(json.dumps(
            cfg if qc is None else {**cfg, "quantization_config": qc}))
    got = load_model(str(tmp_path / "q"), dtype="float32")
    assert got.quantization == method
    experts = got.model.model.layers[1].block_sparse_moe.experts
    assert isinstance(experts.up_proj, QuantExperts)
    assert experts.up_proj.scales.get_value().shape == (8, 1, 96)
    want = load_model(str(tmp_path / "f"), dtype="float32")
    seqs = [[256, 7, 99, 12, 150, 3, 42], [256, 1, 2]]
    for a, b in zip(jpaged_logits(got.model, seqs), jpaged_logits(want.model, seqs),
                    strict=True):
        assert relative_error(a, b) < 1e-5
    # One expert left in float among fp8 ones is refused by name.
    bad = dict(quant)
    name = "model.layers.0.block_sparse_moe.experts.5.w3.weight"
    bad[name] = rounded[name]
    del bad[name.replace(".weight", ".weight_scale")]
    save_file(bad, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.5\.w3\.weight' .* (is not F8_E4M3|expected "
                                         r"F8_E4M3|but quantization_config quantizes)"):
        load_model(str(tmp_path / "q"), dtype="float32")


def _fp8_config(method: str) -> dict:
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head", "re:.*block_sparse_moe\\.gate$"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                "dynamic": False}}}}


def test_padding_tokens_go_to_no_expert():
    """A bucket's padding tokens (no KV slot) are routed nowhere: the real tokens' outputs are
    unchanged, the padding's are finite, and fewer rows reach the experts (each way: rows past
    the groups come out zero)."""
    from jpaged.bench.fixtures import random_model
    from models.moe import SparseMoeBlock, experts_run_as

    spec = ModelSpec.from_hf_config(QWEN_MOE)
    block = random_model(spec, jnp.float32, seed=1).model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 64), np.float32))
    valid = jnp.asarray([True, True, True, False, True, False])
    for impl in ("loop", "interpret", "xla"):
        with experts_run_as(impl):
            whole = np.asarray(block(x))
        with experts_run_as(impl, valid=valid):
            masked = np.asarray(block(x))
        np.testing.assert_allclose(masked[np.asarray(valid)], whole[np.asarray(valid)],
                                   rtol=1e-5, atol=1e-6, err_msg=impl)
        assert np.isfinite(masked).all()
    sizes = jnp.asarray([2, 0, 3])  # 5 of 7 rows in groups
    rows = jnp.ones((7, 16), jnp.float32)
    w = jnp.ones((3, 16, 16), jnp.float32)
    for impl in ("loop", "interpret", "xla"):
        got = np.asarray(grouped_matmul(rows, w, sizes, impl=impl))
        assert (got[:5] == 16).all() and (got[5:] == 0).all(), impl


def _random_quant_experts(rng: np.random.Generator, kind: str, group: int, mins: bool, e: int,
                          k: int, n: int, scale_dtype: str = "float32"):
    """A stacked QuantWeight of random values (k_axis 1) and the float64 matrix it stands
    for."""
    from models.quant import QuantWeight, dequantize_np, pack_int4

    if kind == "fp8":
        q = rng.standard_normal((e, k, n)).astype(FP8)
        scales = rng.uniform(0.01, 0.1, (e, 1, n)).astype(np.float32)
        w = QuantWeight("fp8", q, scales, None, 1)
        return w, q.astype(np.float64) * scales
    lo, hi = (0, 16) if kind == "int4" else (-128, 128)
    values = rng.integers(lo, hi, (e, k, n))
    scales = rng.uniform(0.005, 0.05, (e, k // group, n)).astype(scale_dtype)
    low = rng.uniform(-0.2, 0.0, (e, k // group, n)).astype(scale_dtype) if mins else None
    q = np.stack([pack_int4(v, group) for v in values]) if kind == "int4" \
        else values.astype(np.int8)
    w = QuantWeight(kind, q, scales, low, 1)
    w.check("experts")
    dense = np.stack([dequantize_np(QuantWeight(kind, q[i], scales[i],
                                                None if low is None else low[i]))
                      for i in range(e)]).astype(np.float64)
    return w, dense


QUANT_FORMATS = [("int4", 32, True), ("int8", 16, False), ("int8", 32, True), ("fp8", 0, False)]


@settings(max_examples=8, deadline=None)
@given(m=st.integers(1, 120), e=st.integers(1, 8), fmt=st.sampled_from(QUANT_FORMATS),
       dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**16))
def test_quantized_experts_equal_their_dequantized_weights(m, e, fmt, dtype, seed):
    """A GGUF's experts at its own quantization (int4 groups with mins, int8 groups with or
    without) and fp8: each way of the grouped matmul, and the kernel's SwiGLU, against the
    float64 product of the dequantized weights."""
    from jax.tree_util import tree_map

    from pallas_kernels.grouped_matmul import grouped_swiglu

    kind, group, mins = fmt
    rng = np.random.default_rng(seed)
    h, i = 64, 96
    sizes = rng.multinomial(m, rng.dirichlet(np.full(e, 0.3)))
    x = jnp.asarray(rng.standard_normal((m, h), np.float32), dtype)
    xf = np.asarray(x, np.float64)
    (wg, dg), (wu, du) = (_random_quant_experts(rng, kind, group or h, mins, e, h, i)
                          for _ in range(2))
    wd, dd = _random_quant_experts(rng, kind, group or i, mins, e, i, h)
    wg, wu, wd = (tree_map(jnp.asarray, w) for w in (wg, wu, wd))
    want = reference(xf, dg, sizes)
    tol = 1e-4 if dtype == "float32" else 2e-2
    scale = max(1.0, float(np.abs(want).max()))
    for impl in ("loop", "interpret", "xla"):
        got = np.asarray(grouped_matmul(x, wg, jnp.asarray(sizes), impl=impl))
        assert got.shape == (m, i) and np.abs(got - want).max() / scale < tol, impl
    g, u = reference(xf, dg, sizes), reference(xf, du, sizes)
    act = g / (1 + np.exp(-g)) * u
    if dtype == "bfloat16":  # the kernel writes the SiLU product in the rows' dtype
        act = np.asarray(jnp.asarray(act, jnp.bfloat16), np.float64)
    want = reference(act, dd, sizes)
    got = np.asarray(grouped_swiglu(x, wg, wu, wd, jnp.asarray(sizes), interpret=True))
    assert np.abs(got - want).max() / max(1.0, np.abs(want).max()) < (1e-4 if dtype ==
                                                                         "float32" else 3e-2)


@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (4, 8, 2), (16, 128, 8), (16, 64, 4),
                                   (2, 16, 3), (8, 16, 6)])
def test_the_routing_kernel_lays_out_what_route_chooses(t, e, k):
    """`moe_route` (interpreted): each valid token's k experts and weights as `route` gives
    them, each pair in a tile of its expert at a row that holds its token, rows in token
    order within an expert, every other padded row empty, padding tokens in no tile."""
    from pallas_kernels.grouped_matmul import BLOCK_M, route_layout, routing_fits

    assert routing_fits(t, e, k)
    rng = np.random.default_rng(t * 1000 + e + k)
    logits = jnp.asarray(rng.standard_normal((t, e)).astype(np.float32))
    valid = rng.random(t) > 0.25
    w, dst, layout = route_layout(logits, jnp.asarray(valid), k, k % 2 == 0, interpret=True)
    want_w, want_e = (np.asarray(a) for a in route(logits, k, k % 2 == 0))
    w, dst = np.asarray(w), np.asarray(dst)
    te, src = np.asarray(layout.tile_expert), np.asarray(layout.src)
    assert (dst[:, k:] == -1).all() and (w[:, k:] == 0).all()
    rows_of: dict[int, list[int]] = {}
    for i in range(t):
        if not valid[i]:
            assert (dst[i] == -1).all()
            continue
        np.testing.assert_allclose(w[i, :k], want_w[i], rtol=1e-6)
        for j in range(k):
            q = dst[i, j]
            assert te[q // BLOCK_M] == want_e[i, j] and src[q] == i
            rows_of.setdefault(int(want_e[i, j]), []).append(int(q))
    for rows in rows_of.values():  # an expert's rows: consecutive from a tile boundary
        assert rows[0] % BLOCK_M == 0 and rows == list(range(rows[0], rows[0] + len(rows)))
    used = {int(q) for q in dst.reshape(-1) if q >= 0}
    assert all((src[q] >= 0) == (q in used) for q in range(src.shape[0]))
    assert not routing_fits(64, 128, 8) and not routing_fits(3, 8, 2)
    assert not routing_fits(4, 60, 4)  # (Qwen1.5-MoE's 60 experts: the sorted path)


@pytest.mark.parametrize("kind,arch", [("qwen3_moe", "qwen3moe"), ("mixtral", "llama")])
def test_a_small_steps_fused_routing_gives_the_sorted_paths_outputs(kind, arch, tmp_path):
    """Steps of 1, 4 and 16 tokens on the kernels take the one-launch routing (padding tokens
    included) and give the sorted path's outputs, float and int4 experts alike; other sizes
    keep the sorted path (as do expert counts that are no power of two: routing_fits)."""
    from tiny_models import MOE_GGUF_TYPES, write_moe_gguf

    from models.moe import SparseMoeBlock, experts_run_as
    from pallas_kernels import grouped_matmul as gmm

    make_hf_checkpoint(kind, tmp_path / "hf")
    spec = load_model(str(tmp_path / "hf"), dtype="float32").spec
    gguf = write_moe_gguf(tmp_path / "m.gguf", tmp_path / "hf", spec, arch, MOE_GGUF_TYPES)
    calls = []
    real = gmm.route_layout

    def counted(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)

    rng = np.random.default_rng(0)
    for loaded in (load_model(str(tmp_path / "hf"), dtype="float32"),
                   load_model(str(gguf), dtype="float32", quantization="gguf")):
        layer = loaded.model.model.layers[0]
        block = getattr(layer, "block_sparse_moe", None) or layer.mlp  # Mixtral's name, Qwen's
        assert isinstance(block, SparseMoeBlock)
        for t in (1, 4, 16, 6):
            x = jnp.asarray(rng.standard_normal((t, spec.hidden_size)).astype(np.float32))
            valid = jnp.asarray(rng.random(t) > 0.3)
            with experts_run_as("loop", valid=valid):
                want = np.asarray(block(x))
            gmm.route_layout = counted
            try:
                with experts_run_as("interpret", valid=valid):
                    got = np.asarray(block(x))
            finally:
                gmm.route_layout = real
            np.testing.assert_allclose(got[np.asarray(valid)], want[np.asarray(valid)],
                                       rtol=1e-5, atol=1e-5)
    assert calls == [1, 4, 16] * 2  # (6 tokens: not a power of two, the sorted path)
