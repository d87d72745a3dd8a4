"""ModelSpec parsing and validation, registry lookups and the attention reference."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import hf_config_dict, tiny_spec

from models import ModelSpec, dense_causal_attention, get_model_class
from models.config import SUPPORTED_ARCHITECTURES
from models.rope import inverse_frequencies


def test_spec_is_frozen_hashable_and_sizes_kv():
    spec = tiny_spec(rope_scaling=(("factor", 2.0), ("rope_type", "linear")))
    assert hash(spec) == hash(tiny_spec(rope_scaling=(("factor", 2.0), ("rope_type", "linear"))))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_layers = 3
    assert spec.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2
    assert spec.rope_type == "linear"


def test_from_hf_config_round_trips_and_reads_v4_rope_keys():
    spec = tiny_spec(rope_scaling=(("factor", 4.0), ("rope_type", "linear")))
    assert ModelSpec.from_hf_config(hf_config_dict(spec)) == spec
    v4 = hf_config_dict(spec)
    del v4["rope_parameters"]
    v4.update(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0})
    assert ModelSpec.from_hf_config(v4) == spec
    del v4["architectures"]  # falls back to model_type
    assert ModelSpec.from_hf_config(v4).architecture == "LlamaForCausalLM"


def test_arch_flags():
    cfg = hf_config_dict(tiny_spec())
    qwen2 = ModelSpec.from_hf_config({**cfg, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    qwen3 = ModelSpec.from_hf_config({**cfg, "architectures": ["Qwen3ForCausalLM"]})
    assert qwen3.qk_norm and not qwen3.attention_bias
    llama = ModelSpec.from_hf_config({**cfg, "attention_bias": True, "mlp_bias": True})
    assert llama.attention_bias and llama.o_proj_bias and llama.mlp_bias


def test_unknown_architecture_is_named():
    cfg = {**hf_config_dict(tiny_spec()), "architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelSpec.from_hf_config(cfg)
    with pytest.raises(ValueError, match="FooForCausalLM.*Qwen3ForCausalLM"):
        get_model_class("FooForCausalLM")
    for arch in SUPPORTED_ARCHITECTURES:
        assert get_model_class(arch).__name__ == arch


def test_sliding_window_layer_types_as_hf_derives_them():
    cfg = {**hf_config_dict(tiny_spec()), "architectures": ["MistralForCausalLM"]}
    mistral = ModelSpec.from_hf_config({**cfg, "sliding_window": 128})
    assert mistral.layer_windows == (128, 128) and mistral.uniform_layers
    # A window as long as the context never binds: full attention.
    assert ModelSpec.from_hf_config({**cfg, "sliding_window": 256}).layer_windows == (None,) * 2
    assert ModelSpec.from_hf_config({**cfg, "sliding_window": None}).layer_types is None
    qwen = {**cfg, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64,
            "use_sliding_window": False}
    assert ModelSpec.from_hf_config(qwen).layer_windows == (None, None)
    qwen_sw = ModelSpec.from_hf_config({**qwen, "use_sliding_window": True,
                                        "max_window_layers": 1})
    assert qwen_sw.layer_windows == (None, 64) and not qwen_sw.uniform_layers
    gemma3 = {**cfg, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 12,
              "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 16,
              "rope_local_base_freq": 10.0, "query_pre_attn_scalar": 64}
    del gemma3["tie_word_embeddings"]  # Gemma's default: tied
    g3 = ModelSpec.from_hf_config(gemma3)
    assert g3.layer_windows == ((16,) * 5 + (None,)) * 2  # every sixth layer global
    assert g3.qk_norm and g3.is_gemma and g3.tie_word_embeddings and g3.attn_scale == 1 / 8
    assert g3.rope_local_base_freq == 10.0 and g3.attn_logit_softcapping is None
    g2 = ModelSpec.from_hf_config({**gemma3, "architectures": ["Gemma2ForCausalLM"]})
    assert g2.layer_windows == (16, None) * 6 and not g2.qk_norm
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)


@pytest.mark.parametrize("change,message", [
    ({"sliding_window": 0}, "'sliding_window' must be an int >= 1"),
    ({"sliding_window": -4}, "'sliding_window' must be an int >= 1"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "unknown layer type.*chunked"),
    ({"layer_types": ["sliding_attention"]}, "'layer_types' must list num_hidden_layers=2"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern"),
    ({"hidden_activation": "silu"}, "hidden_act must be 'gelu_pytorch_tanh'"),
])
def test_bad_sliding_window_config_names_the_field(change, message):
    cfg = {**hf_config_dict(tiny_spec()), "architectures": ["Gemma3ForCausalLM"],
           "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 8, **change}
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(cfg)


@pytest.mark.parametrize("change,field", [
    ({"num_kv_heads": 3}, "num_kv_heads"),
    ({"head_dim": 15}, "head_dim"),
    ({"num_layers": 0}, "num_layers"),
    ({"rope_scaling": (("rope_type", "yarn"),)}, "rope_type"),
    ({"rope_scaling": (("rope_type", "llama3"), ("factor", 8.0))}, "low_freq_factor"),
    ({"layer_types": ("sliding_attention", "full_attention")}, "sliding_window is None"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping"),
])
def test_invalid_spec_names_field(change, field):
    with pytest.raises(ValueError, match=field):
        tiny_spec(**change)


def test_unsupported_hf_config_values():
    cfg = hf_config_dict(tiny_spec())
    with pytest.raises(ValueError, match="hidden_act"):
        ModelSpec.from_hf_config({**cfg, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="dynamic"):
        ModelSpec.from_hf_config({**cfg, "rope_parameters": {"rope_type": "dynamic", "factor": 2}})
    with pytest.raises(ValueError, match="hidden_size"):
        ModelSpec.from_hf_config({**cfg, "hidden_size": None})


def test_llama3_rope_keeps_high_and_scales_low_frequencies():
    scaling = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
               ("original_max_position_embeddings", 64), ("rope_type", "llama3"))
    plain = inverse_frequencies(tiny_spec())
    scaled = inverse_frequencies(tiny_spec(rope_scaling=scaling))
    wavelen = 2 * np.pi / plain
    assert np.array_equal(scaled[wavelen < 16], plain[wavelen < 16])
    np.testing.assert_allclose(scaled[wavelen > 64], plain[wavelen > 64] / 8, rtol=1e-6)
    mid = (wavelen >= 16) & (wavelen <= 64)
    assert mid.any() and np.all(scaled[mid] < plain[mid]) and np.all(scaled[mid] > plain[mid] / 8)


def test_dense_attention_masks_segments_causality_and_padding():
    rng = np.random.default_rng(0)
    t, h, kvh, d = 7, 4, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((t, n, d)), jnp.float32) for n in (h, kvh, kvh))
    seg = jnp.array([0, 0, 0, 1, 1, -1, -1])
    pos = jnp.array([0, 1, 2, 0, 1, 0, 0])
    state = {"untouched": jnp.arange(3)}
    out, state_out = dense_causal_attention(seg, pos)(jnp.int32(0), q, k, v, state)
    assert state_out is state  # stateless backend: state passes through unchanged
    out = np.asarray(out)
    assert out.shape == (t, h, d) and np.all(out[5:] == 0)
    # token 3 is the first of its segment: it sees only itself
    np.testing.assert_allclose(out[3], np.repeat(np.asarray(v[3]), 2, axis=0), rtol=1e-6)
    # token 2 sees tokens 0..2; check against an explicit softmax for head 3 (kv head 1)
    s = np.asarray(q[2, 3]) @ np.asarray(k[:3, 1]).T / np.sqrt(d)
    p = np.exp(s - s.max())
    p /= p.sum()
    np.testing.assert_allclose(out[2, 3], p @ np.asarray(v[:3, 1]), rtol=1e-5)
