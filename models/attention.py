"""The attention backend interface the models call, and a dense reference backend.

Models never see KV caches: each layer hands RoPE'd q, k, v for the flattened token batch to an
`AttnFn`, which owns caching (paged, contiguous or none) and returns the attention output.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# attn_fn(layer_idx, q, k, v) -> out
#   layer_idx: Python int (static), selects the layer's cache.
#   q: Float[Array, "T num_heads head_dim"]      RoPE applied, NOT pre-scaled.
#   k, v: Float[Array, "T num_kv_heads head_dim"] RoPE applied to k.
#   out: Float[Array, "T num_heads head_dim"]    in q's dtype.
AttnFn = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def repeat_kv(x: Float[Array, "S kv_heads D"], num_heads: int) -> Float[Array, "S num_heads D"]:
    """Expand kv heads for GQA: query head h reads kv head h // (num_heads // kv_heads)."""
    group = num_heads // x.shape[1]
    return x if group == 1 else jnp.repeat(x, group, axis=1)


def dense_causal_attention(segment_ids: Int[Array, " T"], positions: Int[Array, " T"]) -> AttnFn:
    """Softmax attention within each segment, causal by position; segment -1 marks padding.

    Token i attends to token j iff segment_ids[i] == segment_ids[j] >= 0 and
    positions[j] <= positions[i]. Padding rows return zeros. Softmax runs in float32.
    """
    seg = jnp.asarray(segment_ids)
    pos = jnp.asarray(positions)
    same = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
    mask = same & (pos[None, :] <= pos[:, None])  # [T query, T key]
    row_valid = mask.any(axis=-1)  # False only for padding rows

    def attn(
        layer_idx: int,
        q: Float[Array, "T num_heads head_dim"],
        k: Float[Array, "T num_kv_heads head_dim"],
        v: Float[Array, "T num_kv_heads head_dim"],
    ) -> Float[Array, "T num_heads head_dim"]:
        del layer_idx  # stateless: no cache
        num_heads, head_dim = q.shape[1], q.shape[2]
        kf = repeat_kv(k, num_heads).astype(jnp.float32)
        vf = repeat_kv(v, num_heads).astype(jnp.float32)
        scores = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), kf) / math.sqrt(head_dim)
        scores = jnp.where(mask[None], scores, -jnp.inf)
        # Padding rows are all -inf; give them a finite row so softmax stays NaN-free.
        scores = jnp.where(row_valid[None, :, None], scores, 0.0)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("hqk,khd->qhd", probs, vf)
        out = jnp.where(row_valid[:, None, None], out, 0.0)
        return out.astype(q.dtype)

    return attn
