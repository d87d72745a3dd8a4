"""Pallas kernel for the engine's mixed token batches: chunked prefill and decode in one launch.

The flattened ragged batch is cut (in jnp, before the kernel) into query tiles of `q_tile`
consecutive new tokens of ONE sequence; only the tiles' metadata is built there. Grid (tile,
kv_head): a program loads the tile's tokens times the G query heads of one kv head straight
from the flat q (a masked load of those rows: the padding is never in memory) as a
[q_tile * Gp, head_dim] block (row r = token r // Gp, head r % Gp with Gp = G padded to a power
of two) and walks the sequence's
pages from the first key any of its rows may see (sliding window) to the last one (causal), with
an online softmax. Unused tiles (the static tile count is an upper bound) do no work. A tile
stores only its real rows (valid tokens x G heads), in the model's dtype unless the pages are
fp8 (then float32: v_scale is applied after the kernel).

When every sequence of the step has at most one new token (a decode step), the split-K decode
kernel does the work instead. The engine knows which kind a step is when it packs it and says so
(`decode_only`, static: one program per kind), so a step launches one kernel and none of the
other's glue. A caller that does not know (`decode_only=None`) gets both kernels launched, the
inactive one with every length zeroed so that its programs exit at once, and the result
selected with `jnp.where`: decided on device, without a host round trip (a `lax.cond` would
make XLA copy the predicate to the host and wait, once per layer). `decode_fast_path=False`
launches only the tiled kernel.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from jpaged.intmath import cdiv
from pallas_kernels import reference
from pallas_kernels._compat import (
    check_dot_tiles,
    compute_dtype,
    next_pow2,
    pallas_call,
    scale_array,
    triton_unsupported,
    window_suffix,
)
from pallas_kernels._online_softmax import init_carry, load_kv_block, softmax_step
from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.reference import to_bits

# Tile metadata columns: [sequence, absolute position of the tile's first token, valid tokens,
# index of the tile's first token in the flat batch]; four, a power of two.
_META_SEQ, _META_POS, _META_VALID, _META_TOK, _META_COLS = 0, 1, 2, 3, 4


def _ragged_kernel(scale_ref, meta_ref, tables_ref, q_ref, k_ref, v_ref,  # inputs
                   o_ref,  # output
                   *, heads: int, heads_pad: int, q_tile: int, pages_per_block: int,
                   soft_cap: float | None, sliding_window: int | None,
                   page_dtype: jnp.dtype, dtype: jnp.dtype, q_heads: int) -> None:
    """One (query tile, kv head): causal attention of the tile's rows over their keys.

    A tile with no valid row (padding tiles, and every tile of a launch made inactive) loads
    and stores nothing: its key loop is empty, its q load is all masked, its output store is
    skipped, and no valid token maps to its (unwritten) output block. The branch touches only
    the output block, never the pool: under the interpreter a branch that read the pool would
    copy it. The q load is masked, not branched (a branch with a result spilled).
    """
    head_dim = q_ref.shape[1]
    rows = q_tile * heads_pad
    block_size = k_ref.shape[1]
    bk = pages_per_block * block_size
    seq = meta_ref[_META_SEQ]
    pos0 = meta_ref[_META_POS]
    n_valid = meta_ref[_META_VALID]
    active = n_valid > 0
    # Keys [first, last] are the union of what the tile's valid rows may see.
    last = pos0 + n_valid - 1
    hi = jnp.where(active, pl.cdiv(last + 1, bk), 0)
    lo = 0
    if sliding_window is not None:
        lo = jnp.clip((pos0 - sliding_window + 1) // bk, 0, hi)
    head = pl.program_id(1)
    # The tile's q rows, read in place from the flat [T * Hq, D] q: row r is token
    # first_tok + r // Gp, head kv_head * G + r % Gp. Rows past the tile's valid tokens and the
    # Gp - G padding heads are masked (zero, no memory touched; their index is clamped to 0).
    # A row gather, not a [q_tile, Gp, D] block reshaped: the reshape cost 34 more registers
    # and a shared-memory round trip on sm_90a.
    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    real = (r // heads_pad < n_valid) & (r % heads_pad < heads)
    row = jnp.where(real, (meta_ref[_META_TOK] + r // heads_pad) * q_heads + head * heads
                    + r % heads_pad, 0)
    col = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
    q = plt.load(q_ref.at[row[:, None], col], mask=real[:, None], other=0).astype(dtype)
    tok = lax.broadcasted_iota(jnp.int32, (rows, bk), 0) // heads_pad
    q_pos = pos0 + tok  # [rows, bk]
    row_ok = tok < n_valid

    def body(i, carry):
        ids = tables_ref[seq, pl.ds(i * pages_per_block, pages_per_block)]
        k = load_kv_block(k_ref, ids, head, page_dtype, q.dtype)
        v = load_kv_block(v_ref, ids, head, page_dtype, q.dtype)
        k_pos = i * bk + lax.broadcasted_iota(jnp.int32, (rows, bk), 1)
        mask = row_ok & (k_pos <= q_pos)
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        return softmax_step(carry, q, k, v, mask, qk_scale=scale_ref[0], soft_cap=soft_cap)

    _, lsum, acc = lax.fori_loop(lo, hi, body, init_carry(rows, head_dim))

    @pl.when(active)
    def _store() -> None:
        # Real rows only: the tile's valid tokens times its G real heads (the rest of the
        # block is never read, so it is not written).
        row = lax.broadcasted_iota(jnp.int32, (rows, head_dim), 0)
        real = (row // heads_pad < n_valid) & (row % heads_pad < heads)
        out = (acc / jnp.where(lsum > 0, lsum, 1.0)[:, None]).astype(o_ref.dtype)
        plt.store(o_ref, out, mask=real)


def tile_metadata(query_start_loc: Int[Array, " B+1"], seq_lens: Int[Array, " B"], q_tile: int,
                  num_tiles: int) -> Int[Array, "NT 4"]:
    """Per tile: [sequence, first token's position, valid tokens, first token's index in the
    flat batch].

    Tiles of sequence b are numbered consecutively; unused tiles have 0 valid tokens.
    """
    num_seqs = seq_lens.shape[0]
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    tiles_per_seq = (q_len + q_tile - 1) // q_tile
    tile_end = jnp.cumsum(tiles_per_seq)
    tile_ids = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_seq = jnp.searchsorted(tile_end, tile_ids, side="right")  # == B for unused tiles
    used = tile_seq < num_seqs
    seq = jnp.minimum(tile_seq, num_seqs - 1)
    q_off = (tile_ids - (tile_end[seq] - tiles_per_seq[seq])) * q_tile
    n_valid = jnp.where(used, jnp.clip(q_len[seq] - q_off, 0, q_tile), 0)
    pos0 = seq_lens[seq] - q_len[seq] + q_off
    first_tok = query_start_loc[seq] + q_off
    return jnp.stack([seq, pos0, n_valid, first_tok], axis=1).astype(jnp.int32)


# Most float32 accumulator elements (rows x head_dim) one program keeps in registers: 64 rows
# of head_dim 128. At head_dim 256 (Gemma 3) 64 rows spilled ~360 bytes a thread on sm_90a.
_ACC_ELEMENTS = 64 * 128


def _default_q_tile(rows_per_token: int, num_tokens: int, head_dim: int = 128) -> int:
    """Tokens per tile: about 64 rows, fewer for wide heads so the accumulator stays in
    registers (16 rows at least, the smallest tensor-core M)."""
    rows = min(64, max(16, _ACC_ELEMENTS // head_dim))
    return max(next_pow2(cdiv(16, rows_per_token)),
               min(next_pow2(num_tokens), max(1, rows // rows_per_token)))


def ragged_kernel_attention(
    q: Float[Array, "T q_heads head_dim"],
    k_pages: Float[Array, "blocks bs kv_heads head_dim"],
    v_pages: Float[Array, "blocks bs kv_heads head_dim"],
    query_start_loc: Int[Array, " B+1"],
    seq_lens: Int[Array, " B"],
    block_tables: Int[Array, "B max_blocks"],
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    k_scale: Float[Array, ""] | float,
    v_scale: Float[Array, ""] | float,
    q_tile: int | None,
    pages_per_block: int | None,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    active: Array | bool = True,
) -> Float[Array, "T q_heads head_dim"]:
    """The tiled ragged kernel alone; `active` False (traced) makes every program skip its work
    (no load, no store) and the result zero."""
    t_total, hq, d = q.shape
    nb, bs, hkv, _ = k_pages.shape
    num_seqs, max_blocks = block_tables.shape
    g = hq // hkv
    gp = next_pow2(g)
    if q_tile is None:
        q_tile = _default_q_tile(gp, t_total, d)
    if pages_per_block is None:
        pages_per_block = max(1, 64 // bs)
    pages_per_block = next_pow2(min(pages_per_block, next_pow2(max_blocks)))
    if not interpret:  # a tensor-core product needs >= 16 keys per step
        pages_per_block = max(pages_per_block, next_pow2(cdiv(16, bs)))
    rows = q_tile * gp
    check_dot_tiles(rows, pages_per_block * bs, interpret)
    # Each sequence adds at most one partial tile.
    num_tiles = cdiv(t_total, q_tile) + num_seqs
    tables, _ = reference.chunked_tables(block_tables.astype(jnp.int32), pages_per_block)
    padded_blocks = tables.shape[1]
    meta = tile_metadata(query_start_loc.astype(jnp.int32), seq_lens.astype(jnp.int32), q_tile,
                         num_tiles)
    meta = meta.at[:, _META_VALID].multiply(jnp.asarray(active, jnp.int32))

    fp8 = reference.is_fp8(k_pages.dtype)
    dt = compute_dtype(q.dtype, k_pages.dtype)
    kernel = functools.partial(_ragged_kernel, heads=g, heads_pad=gp, q_tile=q_tile,
                               pages_per_block=pages_per_block,
                               soft_cap=soft_cap, sliding_window=sliding_window,
                               page_dtype=k_pages.dtype, dtype=dt, q_heads=hq)
    page_spec = pl.BlockSpec((nb, bs, hkv, d), lambda t, h: (0, 0, 0, 0))  # whole pool
    out_tiles = pallas_call(
        kernel,
        grid=(num_tiles, hkv),
        in_specs=[
            pl.BlockSpec((1,), lambda t, h: (0,)),  # sm_scale * k_scale
            pl.BlockSpec((None, _META_COLS), lambda t, h: (t, 0)),  # tile metadata
            pl.BlockSpec((num_seqs, padded_blocks), lambda t, h: (0, 0)),  # all block tables
            pl.BlockSpec((t_total * hq, d), lambda t, h: (0, 0)),  # all of q, read in place
            page_spec, page_spec,
        ],
        out_specs=pl.BlockSpec((None, None, rows, d), lambda t, h: (t, h, 0, 0)),
        # In the model's dtype, unless fp8 pages' v_scale is still to be applied (in f32).
        out_shape=jax.ShapeDtypeStruct((num_tiles, hkv, rows, d),
                                       jnp.float32 if fp8 else q.dtype),
        interpret=interpret, num_warps=num_warps, num_stages=num_stages,
        name=f"ragged_paged_qt{q_tile}_ppb{pages_per_block}{window_suffix(sliding_window)}",
    )(scale_array(sm_scale * k_scale if fp8 else sm_scale), meta, tables,
      q.reshape(t_total * hq, d), to_bits(k_pages), to_bits(v_pages))

    # Token t of sequence b sits in tile first_tile[b] + (t - qsl[b]) // q_tile.
    qsl = query_start_loc.astype(jnp.int32)
    t_ids = jnp.arange(t_total, dtype=jnp.int32)
    b_of_t = jnp.minimum(jnp.searchsorted(qsl[1:], t_ids, side="right"), num_seqs - 1)
    # Tokens past the batch, and all of an inactive launch, read unwritten tiles: zeroed.
    tok_valid = (t_ids < qsl[-1]) & jnp.asarray(active, bool)
    q_len = qsl[1:] - qsl[:-1]
    first_tile = jnp.cumsum((q_len + q_tile - 1) // q_tile) - (q_len + q_tile - 1) // q_tile
    rel = t_ids - qsl[b_of_t]
    tile_of_t = jnp.clip(first_tile[b_of_t] + rel // q_tile, 0, num_tiles - 1)
    out = out_tiles.reshape(num_tiles, hkv, q_tile, gp, d)[tile_of_t, :, rel % q_tile, :g]
    if reference.is_fp8(v_pages.dtype):
        out = out * jnp.asarray(v_scale, jnp.float32)
    out = jnp.where(tok_valid[:, None, None, None], out, 0.0)
    return out.reshape(t_total, hq, d).astype(q.dtype)


def _decode_path(q, k_pages, v_pages, query_start_loc, seq_lens, block_tables, active, **kw):
    """A step whose sequences have <= 1 new token each, through the split-K decode kernel.

    `active` False (traced) zeroes every length, so the kernel reads nothing.
    """
    t_total = q.shape[0]
    qsl = query_start_loc.astype(jnp.int32)
    has_tok = (qsl[1:] - qsl[:-1]) > 0  # [B]
    tok = jnp.where(has_tok, qsl[:-1], t_total)  # token of each sequence; t_total = none
    qd = q[jnp.minimum(tok, t_total - 1)]  # [B, Hq, D]; rows without a token are ignored
    lens = jnp.where(has_tok & active, seq_lens, 0)
    out = paged_decode_attention(qd, k_pages, v_pages, lens, block_tables, **kw)
    res = jnp.zeros_like(q)
    return res.at[tok].set(out, mode="drop")


def ragged_paged_attention(
    q: Float[Array, "T q_heads head_dim"],
    k_pages: Float[Array, "blocks bs kv_heads head_dim"],
    v_pages: Float[Array, "blocks bs kv_heads head_dim"],
    query_start_loc: Int[Array, " B+1"],
    seq_lens: Int[Array, " B"],
    block_tables: Int[Array, "B max_blocks"],
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: Float[Array, ""] | float = 1.0,
    v_scale: Float[Array, ""] | float = 1.0,
    q_tile: int | None = None,
    pages_per_block: int | None = None,
    decode_fast_path: bool = True,
    decode_only: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> Float[Array, "T q_heads head_dim"]:
    """Pallas twin of `reference.ragged_paged_attention` (same arguments and result).

    Extra static tuning: `q_tile` tokens per query tile, `pages_per_block` pages per inner step,
    Triton `num_warps`/`num_stages`; `decode_fast_path` routes decode-only steps to the split-K
    decode kernel. `decode_only` (static) says which kind the step is when the caller knows: True
    launches only the split-K decode kernel (no sequence may have more than one new token;
    with T == B, as the engine's pure decode steps, sequence b's token must be row b and the
    sequences without one must come last), False only the tiled kernel; None decides on
    device, launching both.
    """
    t_total, hq, d = q.shape
    bs = k_pages.shape[1]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    common = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                  k_scale=k_scale, v_scale=v_scale)
    if not interpret and triton_unsupported(k_pages, v_pages, dims=(d, bs)):
        # Shapes the Triton lowering cannot take run on the XLA path.
        return reference.ragged_paged_attention(q, k_pages, v_pages, query_start_loc, seq_lens,
                                                block_tables, **common)
    ragged = functools.partial(
        ragged_kernel_attention, **common, q_tile=q_tile, pages_per_block=pages_per_block,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    if not decode_fast_path or decode_only is False:
        return ragged(q, k_pages, v_pages, query_start_loc, seq_lens, block_tables)
    decode = functools.partial(_decode_path, **common, num_warps=num_warps,
                               num_stages=num_stages, interpret=interpret)
    if decode_only and t_total == seq_lens.shape[0]:
        # The engine's pure decode step (T == B): sequence b's one token is row b, padding
        # sequences (no token) come last and their rows are padding tokens. The decode kernel
        # takes q as it lies and its rows are the result: no gather, no scatter (each was an
        # XLA pass per layer). A sequence without a token gets length 0: zeros, as the padding.
        qsl = query_start_loc.astype(jnp.int32)
        lens = jnp.where(qsl[1:] > qsl[:-1], seq_lens, 0)
        return paged_decode_attention(q, k_pages, v_pages, lens, block_tables, **common,
                                      num_warps=num_warps, num_stages=num_stages,
                                      interpret=interpret)
    if decode_only:  # no tiled launch, no q tiles gathered for it, no select
        return decode(q, k_pages, v_pages, query_start_loc, seq_lens, block_tables, active=True)
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    is_decode = jnp.max(q_len) <= 1
    args = (q, k_pages, v_pages, query_start_loc, seq_lens, block_tables)
    out_dec = decode(*args, active=is_decode)
    out_rag = ragged(*args, active=jnp.logical_not(is_decode))
    return jnp.where(is_decode, out_dec, out_rag)
