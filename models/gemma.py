"""Gemma 2 and Gemma 3 (text) as HF transformers defines them, on the Llama modules.

What differs from Llama (the rest is `models/llama.py`):
- RMSNorm scales by (1 + w), computed in float32 and cast back after the product.
- A block has four norms: input, post-attention (on the attention output, before the
  residual), pre-feedforward and post-feedforward (on the MLP output).
- Embeddings are multiplied by sqrt(hidden_size), rounded to the parameter dtype.
- GeGLU feed-forward (tanh gelu), attention scale query_pre_attn_scalar**-0.5.
- Layers alternate sliding-window and global attention (`ModelSpec.layer_types`); Gemma 2
  soft-caps attention scores and logits, Gemma 3 adds q/k norms and a RoPE base of its own
  for sliding layers (`rope_local_base_freq`). The attention backend reads the window, scale
  and cap of each layer from the spec; the model only computes q, k, v.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from .attention import AttnFn
from .config import ModelSpec
from .linear_ops import DecodeLinears
from .llama import MLP, Attention, LlamaForCausalLM, LlamaModel, _bias, _weight, residual_sum
from .lora import LoraBatch


class GemmaRMSNorm(nnx.Module):
    """x / rms(x) * (1 + weight), in float32 then cast back (HF Gemma3RMSNorm order)."""

    offset = 1.0  # the fused kernels' name for the (1 + weight) form

    def __init__(self, dim: int, eps: float, *, dtype: Any = jnp.float32):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))  # HF's init: the identity
        self.eps = eps

    def __call__(self, x: Float[Array, "... dim"]) -> Float[Array, "... dim"]:
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GemmaDecoderLayer(nnx.Module):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(self, spec: ModelSpec, *, dtype: Any, rngs: nnx.Rngs, layer_idx: int = 0):
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)
        self.self_attn = Attention(spec, dtype=dtype, rngs=rngs, norm_cls=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)
        self.mlp = MLP(spec, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)

    def __call__(
        self,
        x: Float[Array, "T hidden"],
        cos: Float[Array, "T half"],
        sin: Float[Array, "T half"],
        layer_idx: int,
        attn_fn: AttnFn,
        attn_state: Any,
        linears: DecodeLinears | None = None,
        lora: LoraBatch | None = None,
    ) -> tuple[Float[Array, "T hidden"], Any]:
        """One layer; returns (x, attn_state after this layer). With `linears`, the
        projections run on the fused kernels (input and pre-feedforward norms in their
        prologues); the post norms sit between a projection and its residual add, so they and
        the adds stay XLA's. `lora`: LoRA adapters' deltas on the projections (no linears)."""
        if linears is not None:
            assert lora is None, "LoRA runs on XLA's GEMMs (the runner passes no linears)"
            attn = self.self_attn
            out, attn_state = attn.fused_attention(x, self.input_layernorm, cos, sin,
                                                   layer_idx, attn_fn, attn_state, linears)
            o = linears.out(out, _weight(attn.o_proj), _bias(attn.o_proj), None)
            x = residual_sum(x, self.post_attention_layernorm(o))
            ff = self.mlp.fused(x, self.pre_feedforward_layernorm, linears, None)
            return residual_sum(x, self.post_feedforward_layernorm(ff)), attn_state
        attn_out, attn_state = self.self_attn(
            self.input_layernorm(x), cos, sin, layer_idx, attn_fn, attn_state, lora)
        x = residual_sum(x, self.post_attention_layernorm(attn_out))
        ff = self.mlp(self.pre_feedforward_layernorm(x), lora, layer_idx)
        return residual_sum(x, self.post_feedforward_layernorm(ff)), attn_state


class GemmaModel(LlamaModel):
    """Gemma's embedding scale, blocks and (1 + w) final norm (HF `model.*`)."""

    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def scale_embeddings(self, x: Float[Array, "T hidden"]) -> Float[Array, "T hidden"]:
        """Embeddings * sqrt(hidden_size), the factor rounded to their dtype as HF does."""
        return x * jnp.asarray(self.spec.hidden_size ** 0.5, x.dtype)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: alternating sliding (4096) and global layers, soft-capped scores and logits."""

    model_class = GemmaModel


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text: five sliding layers per global one, q/k norms, a local RoPE base."""

    model_class = GemmaModel
