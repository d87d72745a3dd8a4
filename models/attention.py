"""The attention backend interface the models call, and a dense reference backend.

Models never look inside KV caches: each layer hands RoPE'd q, k, v for the flattened token batch
to an `AttnFn`, together with the backend's opaque `state` pytree, and gets back the attention
output and the updated state. The model threads that state from layer to layer (a Python loop,
unrolled at trace time), so a cache backend keeps e.g. the whole [num_layers, ...] KV pool as
its state and reads/writes layer `layer_idx` of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .config import ModelSpec

# attn_fn(layer_idx, q, k, v, state) -> (out, state)
#   layer_idx: int, the layer's index as a Python int (static: x[layer_idx] is a static slice).
#   q: Float[Array, "T num_heads head_dim"]      RoPE applied, NOT pre-scaled.
#   k, v: Float[Array, "T num_kv_heads head_dim"] RoPE applied to k.
#   state: any pytree of arrays the backend owns (None for stateless backends), passed from
#          layer to layer: the returned state has the same tree structure, shapes and dtypes.
#   out: Float[Array, "T num_heads head_dim"]    in q's dtype.
#   kv_written=True (keyword, only from a layer whose DecodeLinears.qkv_write wrote k and v
#     into the state's cache already; backends that never hand out such linears need not
#     accept it): attend without writing k and v again.
# Cost note: gather/scatter at layer-offset indices into the carried pool (e.g. a flat
# [layers * blocks, ...] pool with block ids + layer_idx * blocks) updates it in place; slicing
# out pool[layer_idx] whole and writing it back would copy the layer's pages.
AttnFn = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def repeat_kv(x: Float[Array, "S kv_heads D"], num_heads: int) -> Float[Array, "S num_heads D"]:
    """Expand kv heads for GQA: query head h reads kv head h // (num_heads // kv_heads)."""
    group = num_heads // x.shape[1]
    return x if group == 1 else jnp.repeat(x, group, axis=1)


def dense_causal_attention(segment_ids: Int[Array, " T"], positions: Int[Array, " T"],
                           spec: ModelSpec | None = None) -> AttnFn:
    """Softmax attention within each segment, causal by position; segment -1 marks padding.

    Token i attends to token j iff segment_ids[i] == segment_ids[j] >= 0 and
    positions[j] <= positions[i] (and, in a sliding layer of `spec`, positions[j] >
    positions[i] - window). Scores are scaled by `spec.attn_scale` (head_dim**-0.5 without a
    spec) and soft-capped when the spec says so. Padding rows return zeros. Softmax runs in
    float32. Stateless: the returned AttnFn passes `state` through unchanged.
    """
    seg = jnp.asarray(segment_ids)
    pos = jnp.asarray(positions)
    same = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
    causal = same & (pos[None, :] <= pos[:, None])  # [T query, T key]
    row_valid = causal.any(axis=-1)  # False only for padding rows

    def attn(
        layer_idx: int,
        q: Float[Array, "T num_heads head_dim"],
        k: Float[Array, "T num_kv_heads head_dim"],
        v: Float[Array, "T num_kv_heads head_dim"],
        state: Any,
    ) -> tuple[Float[Array, "T num_heads head_dim"], Any]:
        num_heads, head_dim = q.shape[1], q.shape[2]
        kf = repeat_kv(k, num_heads).astype(jnp.float32)
        vf = repeat_kv(v, num_heads).astype(jnp.float32)
        scale = 1 / math.sqrt(head_dim) if spec is None else spec.attn_scale
        scores = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), kf) * scale
        cap = None if spec is None else spec.attn_logit_softcapping
        if cap is not None:
            scores = cap * jnp.tanh(scores / cap)
        mask = causal
        window = None if spec is None else spec.window_of(layer_idx)
        if window is not None:
            mask = mask & (pos[None, :] > pos[:, None] - window)
        scores = jnp.where(mask[None], scores, -jnp.inf)
        # Padding rows are all -inf; give them a finite row so softmax stays NaN-free.
        scores = jnp.where(row_valid[None, :, None], scores, 0.0)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("hqk,khd->qhd", probs, vf)
        out = jnp.where(row_valid[:, None, None], out, 0.0)
        return out.astype(q.dtype), state

    return attn
