"""Pallas decode kernel: one new token per sequence over a paged KV cache, split-K.

Grid (batch, kv_head, partition). A program takes the G = q_heads / kv_heads query heads that share
one kv head as a [rows, head_dim] block (G zero-padded to `rows`, a power of two >= `min_rows`, 16
by default, the smallest M of a tensor-core product; a masked load of its G rows of the flat q,
so the per-head padding is never in memory) and walks the pages of one partition of the
context (`pages_per_partition` pages) in steps of `pages_per_block` pages with an online softmax.
It writes the unnormalised partial (acc, m, l) of the G real rows only (a masked store: the padding
rows move no bytes). Partitions past a sequence's length (or wholly before its sliding window) do
no work and store nothing. With one partition a jnp pass normalises the partial; with several a
second kernel, grid (batch, kv_head), merges them by log-sum-exp (`_merge_kernel`): it walks only
the partitions that hold a visible key, which it knows from the lengths as the decode kernel does
(`partition_active` says the same for arrays), so unwritten partials are never read, and it
writes the G rows in the model's dtype. One launch instead of XLA's several small passes over
every partition's partials.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Bool, Float, Int

from jpaged.intmath import cdiv
from pallas_kernels import reference
from pallas_kernels._compat import (
    MASK_VALUE,
    check_dot_tiles,
    compute_dtype,
    next_pow2,
    pallas_call,
    scale_array,
    triton_unsupported,
    window_suffix,
)
from pallas_kernels._online_softmax import init_carry, load_kv_block, softmax_step
from pallas_kernels.reference import to_bits

# Aim for at least this many programs, so that a small batch still fills an H200's 132 SMs.
_TARGET_PROGRAMS = 1024


def _decode_kernel(scale_ref, lens_ref, tables_ref, q_ref, k_ref, v_ref,  # inputs
                   acc_ref, m_ref, l_ref,  # outputs
                   *, pages_per_block: int, soft_cap: float | None,
                   sliding_window: int | None, page_dtype: jnp.dtype, heads: int,
                   rows: int) -> None:
    """One (sequence, kv head, partition): partial attention of G heads over <= P pages.

    Stores only when the partition holds a key it may see (`hi > lo`, `step_range`), and then
    only the `heads` real rows of the padded block."""
    part = pl.program_id(2)
    head_dim = q_ref.shape[1]
    block_size = k_ref.shape[1]
    part_pages = tables_ref.shape[0]
    bk = pages_per_block * block_size  # keys per step
    seq_len = lens_ref[0]
    start = part * (part_pages * block_size)  # first key position of this partition
    lo, hi = step_range(seq_len, start, part_pages * block_size, bk, sliding_window)
    qk_scale = scale_ref[0]

    head = pl.program_id(1)
    # The G query heads of this kv head are G consecutive rows of the flat q; the block holds
    # `rows` (a tensor-core product's M), the rows past G masked: zero, and never read.
    real = lax.broadcasted_iota(jnp.int32, (rows,), 0) < heads
    first = (pl.program_id(0) * pl.num_programs(1) + head) * heads
    q = plt.load(q_ref.at[pl.ds(first, rows), :], mask=real[:, None], other=0)

    def body(i, carry):
        ids = tables_ref[pl.ds(i * pages_per_block, pages_per_block)]
        k = load_kv_block(k_ref, ids, head, page_dtype, q.dtype)
        v = load_kv_block(v_ref, ids, head, page_dtype, q.dtype)
        k_pos = start + i * bk + lax.broadcasted_iota(jnp.int32, (rows, bk), 1)
        mask = k_pos < seq_len
        if sliding_window is not None:
            mask &= k_pos >= seq_len - sliding_window
        return softmax_step(carry, q, k, v, mask, qk_scale=qk_scale, soft_cap=soft_cap)

    m, lsum, acc = lax.fori_loop(lo, hi, body, init_carry(rows, head_dim))

    @pl.when(hi > lo)
    def _store() -> None:
        plt.store(acc_ref, acc, mask=jnp.broadcast_to(real[:, None], (rows, head_dim)))
        plt.store(m_ref, m, mask=real)
        plt.store(l_ref, lsum, mask=real)


def _merge_kernel(scale_ref, lens_ref, acc_ref, m_ref, l_ref,  # inputs
                  o_ref,  # output
                  *, part_keys: int, sliding_window: int | None, heads: int,
                  chunk: int) -> None:
    """One (sequence, kv head): the log-sum-exp merge of its G rows' partials over the
    partitions holding a visible key, times the V scale, in the output's dtype.

    Partitions are taken `chunk` at a time (aligned chunks: `chunk` divides the partition
    count), so a long context is a short chain of loads. Invariant, as `merge_partitions`: a
    partition that holds no visible key was never stored and is never loaded (masked lanes
    load nothing); a sequence of length 0 comes out 0."""
    parts, _, head_dim = acc_ref.shape
    gp = next_pow2(heads)  # the rows loaded: G, padded to a power of two (masked)
    seq_len = lens_ref[0]
    first = 0 if sliding_window is None else jnp.maximum(seq_len - sliding_window, 0)
    # Partitions [p_lo, p_hi) hold a key in [first, seq_len) (see `partition_active`).
    p_lo = first // part_keys
    p_hi = jnp.minimum(pl.cdiv(seq_len, part_keys), parts)
    real = lax.broadcasted_iota(jnp.int32, (gp,), 0) < heads

    def body(c, carry):
        mx, den, num = carry  # running max [gp], sum [gp], weighted values [gp, D]
        p = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk,), 0)
        on = ((p >= p_lo) & (p < p_hi))[:, None] & real[None, :]  # [chunk, gp]
        rows = (pl.ds(c * chunk, chunk), pl.ds(0, gp))
        m_c = plt.load(m_ref.at[rows], mask=on, other=MASK_VALUE)
        l_c = plt.load(l_ref.at[rows], mask=on, other=0.0)
        a_c = plt.load(acc_ref.at[(*rows, slice(None))], mask=on[:, :, None], other=0.0)
        new = jnp.maximum(mx, m_c.max(axis=0))
        alpha, w = jnp.exp(mx - new), jnp.exp(m_c - new[None, :])
        return (new, den * alpha + (l_c * w).sum(axis=0),
                num * alpha[:, None] + (a_c * w[:, :, None]).sum(axis=0))

    init = (jnp.full((gp,), MASK_VALUE, jnp.float32), jnp.zeros((gp,), jnp.float32),
            jnp.zeros((gp, head_dim), jnp.float32))
    _, den, num = lax.fori_loop(p_lo // chunk, pl.cdiv(p_hi, chunk), body, init)
    out = num * (scale_ref[0] / jnp.where(den > 0, den, 1.0))[:, None]
    # The G real rows of this (sequence, kv head) in the flat [B * kv_heads * G, D] output:
    # a window of gp rows from its first, the rows past G masked (never stored).
    first_row = (pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)) * heads
    plt.store(o_ref.at[pl.ds(first_row, gp), :], out.astype(o_ref.dtype), mask=real[:, None])


def merge_chunk(parts: int, heads: int, head_dim: int, budget: int = 8192) -> int:
    """Partitions the merge kernel loads at once: a power of two <= 8 that divides `parts`,
    with chunk x G (padded) x head_dim <= `budget` f32 values (registers)."""
    c = 8
    while c > 1 and (parts % c or c * next_pow2(heads) * head_dim > budget):
        c //= 2
    return c


def merge_partials(acc: Float[Array, "B K P R D"], m: Float[Array, "B K P R"],
                   lsum: Float[Array, "B K P R"], seq_lens: Int[Array, " B"], *,
                   heads: int, part_keys: int, sliding_window: int | None,
                   v_scale: Float[Array, ""] | float, out_dtype: jnp.dtype,
                   interpret: bool = False) -> Float[Array, "B K G D"]:
    """The decode kernel's partials merged by `_merge_kernel`: [B, K, G, D] in `out_dtype`.

    The kernel stores each (sequence, kv head)'s G rows into a flat [B * K * G, D] output
    (masked windows of next_pow2(G) rows), so the result is its output as it lies for every G:
    no slice copy of padded rows (SmolLM2's G = 3 had one a layer until 2026-12-05)."""
    b, hkv, parts, rows, d = acc.shape
    kernel = functools.partial(_merge_kernel, part_keys=part_keys,
                               sliding_window=sliding_window, heads=heads,
                               chunk=merge_chunk(parts, heads, d))
    part_spec = pl.BlockSpec((None, None, parts, rows), lambda i, h: (i, h, 0, 0))
    out = pallas_call(
        kernel,
        grid=(b, hkv),
        in_specs=[
            pl.BlockSpec((1,), lambda i, h: (0,)),  # v_scale (1 for other pages)
            pl.BlockSpec((1,), lambda i, h: (i,)),  # seq_lens
            pl.BlockSpec((None, None, parts, rows, d), lambda i, h: (i, h, 0, 0, 0)),
            part_spec, part_spec,
        ],
        out_specs=pl.BlockSpec((b * hkv * heads, d), lambda i, h: (0, 0)),  # whole, flat
        out_shape=jax.ShapeDtypeStruct((b * hkv * heads, d), out_dtype),
        interpret=interpret, num_warps=4, num_stages=2,
        name=f"paged_merge_pk{part_keys}{window_suffix(sliding_window)}",
    )(scale_array(v_scale), seq_lens.astype(jnp.int32), acc, m, lsum)
    return out.reshape(b, hkv, heads, d)


def step_range(seq_len: jax.Array, start: jax.Array, part_keys: int, step_keys: int,
               sliding_window: int | None) -> tuple[jax.Array, jax.Array]:
    """Steps [lo, hi) of `step_keys` keys that the partition starting at key `start` walks: hi
    covers the keys < seq_len, lo skips the steps wholly before the window. The kernel's loop
    bounds (scalars) and `partition_active` (arrays) both come from here."""
    hi = jnp.maximum(pl.cdiv(jnp.minimum(seq_len - start, part_keys), step_keys), 0)
    lo = 0
    if sliding_window is not None:
        lo = jnp.clip((seq_len - sliding_window - start) // step_keys, 0, hi)
    return lo, hi


def partition_active(seq_lens: Int[Array, " B"], parts: int, part_keys: int, step_keys: int,
                     sliding_window: int | None) -> jax.Array:
    """[B, parts] bool: which partitions of each sequence the decode kernel runs (and stores),
    by the kernel's own loop bounds (`step_range`)."""
    lens = seq_lens.astype(jnp.int32)[:, None]
    start = jnp.arange(parts, dtype=jnp.int32)[None, :] * part_keys
    lo, hi = step_range(lens, start, part_keys, step_keys, sliding_window)
    return hi > lo


def default_pages_per_partition(batch: int, kv_heads: int, max_blocks: int,
                                pages_per_block: int) -> int:
    """Pages per split-K partition: enough partitions for ~_TARGET_PROGRAMS programs."""
    want = max(1, cdiv(_TARGET_PROGRAMS, max(1, batch * kv_heads)))
    ppp = next_pow2(cdiv(max_blocks, want))
    return max(ppp, pages_per_block)


def merge_partitions(acc: Float[Array, "B K P G D"], m: Float[Array, "B K P G"],
                     lsum: Float[Array, "B K P G"], active: Bool[Array, "B P"]
                     ) -> Float[Array, "B K G D"]:
    """Log-sum-exp merge of split-K partials; partitions not `active` were never written (any
    bits there are ignored), and rows that saw no key come out 0."""
    on = active[:, None, :, None]
    m = jnp.where(on, m, MASK_VALUE)
    m_max = m.max(axis=2, keepdims=True)
    w = jnp.where(on, jnp.exp(m - m_max), 0.0)
    den = jnp.where(on, lsum, 0.0) * w
    num = jnp.where(on[..., None], acc, 0.0) * w[..., None]
    den, num = den.sum(axis=2), num.sum(axis=2)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


def paged_decode_attention(
    q: Float[Array, "B q_heads head_dim"],
    k_pages: Float[Array, "blocks bs kv_heads head_dim"],
    v_pages: Float[Array, "blocks bs kv_heads head_dim"],
    seq_lens: Int[Array, " B"],
    block_tables: Int[Array, "B max_blocks"],
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: Float[Array, ""] | float = 1.0,
    v_scale: Float[Array, ""] | float = 1.0,
    pages_per_partition: int | None = None,
    pages_per_block: int | None = None,
    min_rows: int = 16,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> Float[Array, "B q_heads head_dim"]:
    """Attention of each sequence's last token (position seq_len - 1) over its paged K/V.

    seq_len 0 gives zeros. Equals `reference.paged_decode_attention`. Tuning (static):
    `pages_per_block` pages per inner step (default: 128 keys), `pages_per_partition` pages per
    split-K program (default: see `default_pages_per_partition`), Triton `num_warps`/`num_stages`.
    """
    b, hq, d = q.shape
    nb, bs, hkv, _ = k_pages.shape
    max_blocks = block_tables.shape[1]
    g = hq // hkv
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    if not interpret and triton_unsupported(k_pages, v_pages, dims=(d, bs)):
        # Shapes the Triton lowering cannot take run on the XLA path.
        return reference.paged_decode_attention(
            q, k_pages, v_pages, seq_lens, block_tables, sm_scale=sm_scale, soft_cap=soft_cap,
            sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale)
    if pages_per_block is None:
        pages_per_block = max(1, 128 // bs)
    pages_per_block = next_pow2(min(pages_per_block, next_pow2(max_blocks)))
    if not interpret:  # a tensor-core product needs >= 16 keys per step
        pages_per_block = max(pages_per_block, next_pow2(cdiv(16, bs)))
    if pages_per_partition is None:
        pages_per_partition = default_pages_per_partition(b, hkv, max_blocks, pages_per_block)
    if pages_per_partition % pages_per_block:
        raise ValueError(f"pages_per_partition={pages_per_partition} must be a multiple of "
                         f"pages_per_block={pages_per_block}")
    parts = cdiv(max_blocks, pages_per_partition)
    # Padded table entries point at block 0; they lie past seq_len and are masked.
    tables = jnp.pad(block_tables.astype(jnp.int32),
                     ((0, 0), (0, parts * pages_per_partition - max_blocks)))
    rows = next_pow2(max(g, min_rows))
    check_dot_tiles(rows, pages_per_block * bs, interpret)
    # Scales apply to fp8 pages only (as in reference.dequantize); both are folded out of the
    # loop: k_scale into the logit scale, v_scale into the merged output.
    fp8 = reference.is_fp8(k_pages.dtype)
    qk_scale = sm_scale * k_scale if fp8 else sm_scale
    dt = compute_dtype(q.dtype, k_pages.dtype)
    # Flat q rows (sequence-major, then kv head, then its G heads), as they lie: a program's
    # rows-long window may run past the end, and its masked load reads only its G rows (the
    # interpreter fills masked lanes past the end too). Until 2026-12-05 q was padded by
    # `rows` spare rows first: one more XLA pass (and launch) per layer.
    qf = q.reshape(b * hq, d).astype(dt)
    kernel = functools.partial(_decode_kernel, pages_per_block=pages_per_block,
                               soft_cap=soft_cap, sliding_window=sliding_window,
                               page_dtype=k_pages.dtype, heads=g, rows=rows)
    page_spec = pl.BlockSpec((nb, bs, hkv, d), lambda i, h, p: (0, 0, 0, 0))  # whole pool
    part_spec = pl.BlockSpec((None, None, None, rows), lambda i, h, p: (i, h, p, 0))
    acc, m, lsum = pallas_call(
        kernel,
        grid=(b, hkv, parts),
        in_specs=[
            pl.BlockSpec((1,), lambda i, h, p: (0,)),  # sm_scale * k_scale
            pl.BlockSpec((1,), lambda i, h, p: (i,)),  # seq_lens
            pl.BlockSpec((None, pages_per_partition), lambda i, h, p: (i, p)),  # tables
            pl.BlockSpec(qf.shape, lambda i, h, p: (0, 0)),  # all q rows (read in place)
            page_spec, page_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, d), lambda i, h, p: (i, h, p, 0, 0)),
            part_spec, part_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, parts, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, parts, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, parts, rows), jnp.float32),
        ],
        interpret=interpret, num_warps=num_warps, num_stages=num_stages,
        name=f"paged_decode_ppb{pages_per_block}_ppp{pages_per_partition}"
             f"{window_suffix(sliding_window)}",
    )(scale_array(qk_scale), seq_lens.astype(jnp.int32), tables, qf, to_bits(k_pages),
      to_bits(v_pages))
    vs = v_scale if reference.is_fp8(v_pages.dtype) else 1.0
    if parts > 1:  # one kernel walks each sequence's partitions that hold keys
        out = merge_partials(acc, m, lsum, seq_lens, heads=g,
                             part_keys=pages_per_partition * bs, sliding_window=sliding_window,
                             v_scale=vs, out_dtype=q.dtype, interpret=interpret)
        return out.reshape(b, hq, d)
    # One partition: normalising its partial is one elementwise pass (fused by XLA). Padded
    # head rows (never stored) are dropped first: it reads the G real rows.
    active = partition_active(seq_lens, parts, pages_per_partition * bs, pages_per_block * bs,
                              sliding_window)
    out = merge_partitions(acc[:, :, :, :g], m[:, :, :, :g], lsum[:, :, :, :g], active)
    return (out * jnp.asarray(vs, jnp.float32)).reshape(b, hq, d).astype(q.dtype)
