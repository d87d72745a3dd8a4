"""Every architecture's decoder layers on the fused decode kernels (`DecodeLinears`, Pallas
interpreter) compute what their nnx.Linear modules compute: Llama, Qwen2's biases, Qwen3's
q/k norms (RoPE after the kernel), Gemma 2/3's (1 + w) norms, post norms, GELU and soft-caps,
float32 and bf16. Random weights (norm weights near 1, biases nonzero), a dense attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import tiny_spec

from jpaged.runner.linears import kernel_linears
from models.attention import dense_causal_attention
from models.registry import get_model_class

SHAPES = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=32)
CASES = {
    "llama": {},
    "qwen2_bias": {"architecture": "Qwen2ForCausalLM", "attention_bias": True},
    "qwen3_qk_norm": {"architecture": "Qwen3ForCausalLM", "qk_norm": True},
    "gemma2": {"architecture": "Gemma2ForCausalLM", "hidden_act": "gelu_pytorch_tanh",
               "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0},
    "gemma3": {"architecture": "Gemma3ForCausalLM", "hidden_act": "gelu_pytorch_tanh",
               "qk_norm": True, "tie_word_embeddings": True},
}


def _random_model(spec, dtype):
    model = get_model_class(spec.architecture)(spec, dtype=dtype, rngs=nnx.Rngs(0))
    graph, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    new = []
    for key, (path, x) in zip(keys, jax.tree_util.tree_leaves_with_path(state), strict=True):
        noise = 0.2 * jax.random.normal(key, x.shape)
        is_norm = "norm" in jax.tree_util.keystr(path)
        gemma = spec.architecture.startswith("Gemma")
        new.append((noise + (1.0 if is_norm and not gemma else 0.0)).astype(x.dtype))
    return nnx.merge(graph, jax.tree.unflatten(tree, new))


@pytest.mark.parametrize("case,dtype", [(c, jnp.float32) for c in CASES]
                         + [("llama", jnp.bfloat16), ("gemma3", jnp.bfloat16)],
                         ids=lambda x: getattr(x, "__name__", x))
def test_fused_layers_compute_what_the_modules_compute(case, dtype):
    spec = tiny_spec(**SHAPES, **CASES[case])
    model = _random_model(spec, dtype)
    ids = jnp.asarray([5, 17, 3, 99, 42, 7, 8, 250, 1, 64], jnp.int32)
    pos = jnp.asarray([0, 1, 2, 3, 4, 5, 0, 1, 2, 3], jnp.int32)
    attn = dense_causal_attention(jnp.asarray([0] * 6 + [1] * 4), pos, spec)
    want, _ = model(ids, pos, attn)
    got, _ = model(ids, pos, attn, linears=kernel_linears(interpret=True))
    tol = 2e-4 if dtype == jnp.float32 else 0.1
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)
