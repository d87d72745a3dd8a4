"""The in-kernel step shared by the attention kernels: one key block of an online softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._compat import MASK_VALUE, mm


def load_kv_block(pages_ref, ids: jax.Array, head: jax.Array, page_dtype: jnp.dtype,
                  dtype: jnp.dtype) -> jax.Array:
    """Gather pages `ids` ([pages]) of kv head `head` as [pages * block_size, head_dim] in `dtype`.

    `pages_ref` is the whole pool [num_blocks, block_size, kv_heads, head_dim]: its BlockSpec is
    the full array, so the Pallas interpreter passes it through without copying (a per-head
    block would be sliced out of the pool and written back by every program). fp8 and bf16
    pools arrive as their bit patterns (`reference.bits_dtype`) and are bitcast to `page_dtype`
    after the gather. fp8 pages widen exactly to bf16 here; their scale is applied outside the
    product.
    """
    blk = pages_ref[ids, :, head, :]  # [pages, block_size, head_dim]
    if blk.dtype != page_dtype:
        blk = jax.lax.bitcast_convert_type(blk, page_dtype)
    n, bs, d = blk.shape
    return blk.reshape(n * bs, d).astype(dtype)


def softmax_step(
    carry: tuple[jax.Array, jax.Array, jax.Array],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    qk_scale: jax.Array,
    soft_cap: float | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold one key block into (m [rows], l [rows], acc [rows, head_dim]), all float32.

    q: [rows, head_dim]; k, v: [keys, head_dim] (same dtype as q); mask: [rows, keys] bool.
    Invariant: acc / l is the softmax-weighted mean of the unmasked values seen so far, m the
    running max of unmasked logits (MASK_VALUE while none); masked keys get weight exactly 0.
    """
    m_prev, l_prev, acc_prev = carry
    s = mm(q, k, trans_b=True) * qk_scale  # [rows, keys] float32
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, s.max(axis=-1))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    l_new = l_prev * alpha + p.sum(axis=-1)
    acc_new = acc_prev * alpha[:, None] + mm(p.astype(v.dtype), v)
    return m_new, l_new, acc_new


def init_carry(rows: int, head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Empty online-softmax state: m = MASK_VALUE, l = 0, acc = 0."""
    return (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
