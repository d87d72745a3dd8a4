"""Pure-jnp paged attention and KV write: the truth for kernel tests; write_kv is the CPU KV write.

Page layout (one layer, K and V separately):
    pages: [num_blocks, block_size, num_kv_heads, head_dim]
Slot s of the pool is (block s // block_size, offset s % block_size). Block 0 is the null block
that padded block-table entries point at; it is never read unmasked.

The step's tokens form a flattened ragged batch: sequence b owns query tokens
q[query_start_loc[b] : query_start_loc[b + 1]], which are the LAST q_len_b tokens of a sequence of
seq_lens[b] tokens whose K/V (including the new tokens) are already written into the pages.
Padded sequences have q_len 0 and seq_len 0. Tokens past query_start_loc[-1] are padding.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def is_fp8(dtype: jnp.dtype) -> bool:
    """True for the fp8 page dtypes."""
    return jnp.dtype(dtype) in tuple(jnp.dtype(d) for d in FP8_DTYPES)


def bits_dtype(dtype: jnp.dtype) -> jnp.dtype | None:
    """The unsigned type that carries `dtype`'s bits when pages move, or None if none is needed.

    XLA:CPU gathers and scatters fp8 and bfloat16 arrays only after widening the operand (the
    whole pool) to f16 / f32 and narrowing it back; their bit patterns as uint8 / uint16 move
    as they are. float16 and float32 need no such detour.
    """
    dtype = jnp.dtype(dtype)
    if is_fp8(dtype):
        return jnp.dtype(jnp.uint8)
    if dtype == jnp.dtype(jnp.bfloat16):
        return jnp.dtype(jnp.uint16)
    return None


def to_bits(x: Array) -> Array:
    """x as its bit patterns (`bits_dtype`) where it has such a type, else x itself."""
    bits = bits_dtype(x.dtype)
    return x if bits is None else jax.lax.bitcast_convert_type(x, bits)


def from_bits(x: Array, dtype: jnp.dtype) -> Array:
    """The `dtype` view of bit patterns made by `to_bits` (x itself when already `dtype`)."""
    dtype = jnp.dtype(dtype)
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def quantize(x: Float[Array, "..."], dtype: jnp.dtype, scale: Float[Array, ""] | float = 1.0
             ) -> Array:
    """Cast new K/V to the page dtype; fp8 divides by `scale` and saturates to the finite range."""
    if not is_fp8(dtype):
        return x.astype(dtype)
    fmax = float(jnp.finfo(dtype).max)
    y = jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax)
    return y.astype(dtype)


def dequantize(x: Array, scale: Float[Array, ""] | float = 1.0) -> Float[Array, "..."]:
    """Pages back to float32; fp8 multiplies by `scale`."""
    y = x.astype(jnp.float32)
    return y * scale if is_fp8(x.dtype) else y


def gather_blocks(pages: Float[Array, "blocks bs kv_heads head_dim"], ids: Int[Array, "..."]
                  ) -> Float[Array, "... bs kv_heads head_dim"]:
    """pages[ids], in the pages' dtype.

    fp8 and bf16 pages are gathered as their bit patterns (`bits_dtype`): XLA:CPU would widen
    the gather's operand, the WHOLE pool (hoisted out of the attention loop, still a pool-sized
    conversion per layer per step); the bitcasts are free and fold with the caller's.
    """
    return from_bits(to_bits(pages)[ids], pages.dtype)


def write_kv(
    k_pages: Float[Array, "blocks bs kv_heads head_dim"],
    v_pages: Float[Array, "blocks bs kv_heads head_dim"],
    k: Float[Array, "T kv_heads head_dim"],
    v: Float[Array, "T kv_heads head_dim"],
    slot_mapping: Int[Array, " T"],
    k_scale: Float[Array, ""] | float = 1.0,
    v_scale: Float[Array, ""] | float = 1.0,
) -> tuple[Array, Array]:
    """Scatter the step's new K/V into their slots; slot < 0 (padding) writes nothing."""
    nb, bs, h, d = k_pages.shape
    total = nb * bs
    # Out-of-range indices are dropped, so padding never clobbers a real slot.
    idx = jnp.where(slot_mapping < 0, total, slot_mapping)
    kq, vq = quantize(k, k_pages.dtype, k_scale), quantize(v, v_pages.dtype, v_scale)
    if idx.shape[0] == 1:
        # XLA rewrites a one-row scatter as select + dynamic-update-slice, which inside the
        # engine's layer scan copies the whole pool every layer; a dropped second row keeps it
        # an in-place scatter.
        idx = jnp.concatenate([idx, jnp.full((1,), total, idx.dtype)])
        kq, vq = jnp.concatenate([kq, kq]), jnp.concatenate([vq, vq])
    return _scatter_rows(k_pages, idx, kq), _scatter_rows(v_pages, idx, vq)


def _scatter_rows(pages: Array, idx: Int[Array, " T"], rows: Array) -> Array:
    """pages with token slots `idx` set to `rows` (same dtype); out-of-range slots dropped.

    fp8 and bf16 pages are scattered as their bit patterns (`bits_dtype`): XLA:CPU would widen
    the WHOLE pool and narrow it back around the scatter (a pool-sized copy per layer per step),
    while the bitcasts are free and the integer scatter updates the donated buffer in place.
    """
    bs = pages.shape[1]
    blk, off = idx // bs, idx % bs  # idx == total (dropped) gives blk == num_blocks
    # No reshape between the bitcasts: adjacent bitcast-converts fold away, split by a reshape
    # they become a pool-sized copy.
    return from_bits(to_bits(pages).at[blk, off].set(to_bits(rows), mode="drop"), pages.dtype)


def query_tiling(num_tokens: int, num_seqs: int) -> tuple[int, int]:
    """Static (tile size, tile count) for a step shape; the size is a power of two in [1, 32].

    The size is about the tokens per sequence. Every sequence may leave one partly used tile,
    so the count is an upper bound with num_seqs spare tiles, and the padded query rows stay
    below num_tokens + num_seqs x tile <= 2 x num_tokens. With one-token tiles no tile is
    partial (sum(q_len) <= num_tokens), so no spare tiles.
    """
    ratio = max(1, min(32, num_tokens // max(num_seqs, 1)))
    tile = 1 << (ratio.bit_length() - 1)
    return tile, (num_tokens + tile - 1) // tile + (num_seqs if tile > 1 else 0)


def chunked_tables(block_tables: Int[Array, "B max_blocks"], chunk: int
                   ) -> tuple[Int[Array, "B padded_blocks"], int]:
    """Block tables padded to whole key chunks of `chunk` blocks, and the chunk count."""
    max_blocks = block_tables.shape[1]
    n_chunks = (max_blocks + chunk - 1) // chunk
    return jnp.pad(block_tables, ((0, 0), (0, n_chunks * chunk - max_blocks))), n_chunks


class QueryTiles(NamedTuple):
    """A step's new tokens cut into tiles of `tile` consecutive tokens of one sequence each."""

    seq: Int[Array, " NT"]  # the tile's sequence (clamped to B - 1 for unused tiles)
    row_valid: Bool[Array, "NT tile"]  # a real query token (unused tiles: all False)
    tok: Int[Array, "NT tile"]  # its row in q; T (out of range) for invalid rows
    q_pos: Int[Array, "NT tile"]  # its absolute position in the sequence
    q: Float[Array, "NT tile kv_heads group head_dim"]  # float32 queries times sm_scale


def tile_queries(q: Float[Array, "T q_heads head_dim"], query_start_loc: Int[Array, " B+1"],
                 seq_lens: Int[Array, " B"], tile: int, num_tiles: int, kv_heads: int,
                 sm_scale: float) -> QueryTiles:
    """Cut the flattened batch into query tiles; tiles past the real tokens are unused."""
    t_total, hq, d = q.shape
    num_seqs = seq_lens.shape[0]
    q_len = query_start_loc[1:] - query_start_loc[:-1]  # [B]
    tiles_per_seq = (q_len + tile - 1) // tile
    tile_end = jnp.cumsum(tiles_per_seq)  # [B]
    tile_ids = jnp.arange(num_tiles)
    # == B for unused tiles (compare_all compiles faster than the default scan at these sizes)
    tile_seq = jnp.searchsorted(tile_end, tile_ids, side="right", method="compare_all")
    tseq = jnp.minimum(tile_seq, num_seqs - 1)
    q_off = (tile_ids - (tile_end[tseq] - tiles_per_seq[tseq])) * tile  # in the new tokens
    q_in_seq = q_off[:, None] + jnp.arange(tile)[None, :]  # [NT, tile]
    row_valid = (tile_seq < num_seqs)[:, None] & (q_in_seq < q_len[tseq][:, None])
    tok = jnp.where(row_valid, query_start_loc[tseq][:, None] + q_in_seq, t_total)
    q_pos = seq_lens[tseq][:, None] - q_len[tseq][:, None] + q_in_seq
    qt = jnp.take(q, jnp.minimum(tok, t_total - 1), axis=0).astype(jnp.float32)
    qt = qt.reshape(num_tiles, tile, kv_heads, hq // kv_heads, d) * sm_scale
    return QueryTiles(tseq, row_valid, tok, q_pos, qt)


def init_tile_state(q_tiles: Float[Array, "NT tile kv_heads group head_dim"]
                    ) -> tuple[Array, Array, Array]:
    """Empty online-softmax state per query row: max -inf, sum 0, accumulator 0."""
    nt, tile, hkv, g, d = q_tiles.shape
    return (jnp.full((nt, hkv, g, tile), -jnp.inf, jnp.float32),
            jnp.zeros((nt, hkv, g, tile), jnp.float32),
            jnp.zeros((nt, hkv, g, tile, d), jnp.float32))


def attend_chunk(
    state: tuple[Array, Array, Array],
    q_tiles: Float[Array, "n tile kv_heads group head_dim"],
    k_pages: Array,
    v_pages: Array,
    ids: Int[Array, "n chunk"],
    first_key: Int[Array, ""] | Int[Array, " n"],
    q_pos: Int[Array, "n tile"],
    row_valid: Bool[Array, "n tile"],
    *,
    soft_cap: float | None,
    sliding_window: int | None,
    k_scale: Float[Array, ""] | float,
    v_scale: Float[Array, ""] | float,
) -> tuple[Array, Array, Array]:
    """Fold one key chunk (pages `ids`, keys from `first_key`) into n tiles' softmax state.

    Invariant: acc / sum is the softmax-weighted mean of the visible values seen so far, max
    the running max of visible logits (-inf while none); invisible keys weigh exactly 0.
    """
    m, lsum, acc = state
    n, _, hkv, _, d = q_tiles.shape
    kc = dequantize(gather_blocks(k_pages, ids), k_scale).reshape(n, -1, hkv, d)
    vc = dequantize(gather_blocks(v_pages, ids), v_scale).reshape(n, -1, hkv, d)
    s = jnp.einsum("nqkgd,nskd->nkgqs", q_tiles, kc)  # [n, hkv, g, tile, ck]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    # first_key: one for all n tiles, or each tile's own ([n]).
    k_pos = jnp.reshape(first_key, (-1, 1)) + jnp.arange(kc.shape[1])  # [1 or n, ck]
    mask = k_pos[:, None, :] <= q_pos[:, :, None]  # [n, tile, ck]
    if sliding_window is not None:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    mask = (mask & row_valid[:, :, None])[:, None, None, :, :]
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
    alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
    lsum = lsum * alpha + p.sum(axis=-1)
    acc = acc * alpha[..., None] + jnp.einsum("nkgqs,nskd->nkgqd", p, vc)
    return m_new, lsum, acc


def tiles_to_tokens(lsum: Array, acc: Array, tok: Int[Array, "NT tile"],
                    like: Float[Array, "T q_heads head_dim"]) -> Array:
    """Normalize each row's accumulator and scatter the tiles back to token rows (padding 0)."""
    nt, hkv, g, tile, d = acc.shape
    out = acc / jnp.where(lsum > 0, lsum, 1.0)[..., None]  # [NT, hkv, g, tile, d]
    out = out.transpose(0, 3, 1, 2, 4).reshape(nt * tile, hkv * g, d)
    res = jnp.zeros(like.shape, like.dtype)
    return res.at[tok.reshape(-1)].set(out.astype(like.dtype), mode="drop")


# Keys visited per chunk of the online softmax. The loop runs only as many chunks as the step's
# longest sequence needs, so this (not max_model_len) bounds what a short sequence gathers.
KV_CHUNK_TOKENS = 256


def _kv_chunk_blocks(num_tiles: int, tile: int, block_size: int, kv_heads: int, head_dim: int,
                     max_blocks: int) -> int:
    """Blocks per key chunk: <= KV_CHUNK_TOKENS keys, and one chunk's gathered K <= 32 MiB."""
    budget = 32 * 2**20 // 4
    per_block = max(1, num_tiles * block_size * kv_heads * head_dim * max(1, tile // 8))
    c = max(1, min(max_blocks, budget // per_block, KV_CHUNK_TOKENS // block_size))
    return 1 << (c.bit_length() - 1)  # a power of two


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
    decode_only: bool | None = None,
) -> Float[Array, "T q_heads head_dim"]:
    """Causal attention of each sequence's new tokens over its paged K/V (prefix + new tokens).

    Queries are cut into tiles of one sequence each (so K/V blocks are gathered once per tile, not
    once per token); key blocks are visited in chunks with an online softmax, and only as many
    chunks as the longest sequence needs. `decode_only` (whether every sequence has exactly one
    new token, when the caller knows) lets a backend pick its kernel; the result never depends
    on it, and this one ignores it.
    """
    t_total, hq, d = q.shape
    num_seqs, max_blocks = block_tables.shape
    _, bs, hkv, _ = k_pages.shape
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    tile, num_tiles = query_tiling(t_total, num_seqs)
    chunk = _kv_chunk_blocks(num_tiles, tile, bs, hkv, d, max_blocks)
    tables, n_chunks_max = chunked_tables(block_tables, chunk)

    tq = tile_queries(q, query_start_loc, seq_lens, tile, num_tiles, hkv, sm_scale)
    tseq, row_valid, tok, q_pos, qt = tq.seq, tq.row_valid, tq.tok, tq.q_pos, tq.q
    tile_tables = tables[tseq]  # [NT, padded_blocks]
    ck = chunk * bs

    def body(c, carry):
        ids = jax.lax.dynamic_slice_in_dim(tile_tables, c * chunk, chunk, axis=1)  # [NT, chunk]
        return attend_chunk(carry, qt, k_pages, v_pages, ids, c * ck, q_pos, row_valid,
                            soft_cap=soft_cap, sliding_window=sliding_window, k_scale=k_scale,
                            v_scale=v_scale)

    # Only as many key chunks as the longest sequence of this step needs.
    n_chunks = jnp.minimum((jnp.max(seq_lens) + ck - 1) // ck, n_chunks_max)
    _, lsum, acc = jax.lax.fori_loop(0, n_chunks, body, init_tile_state(qt))
    return tiles_to_tokens(lsum, acc, tok, q)


def dense_attention_contiguous(
    q: Float[Array, "B Q q_heads head_dim"],
    k: Float[Array, "B L kv_heads head_dim"],
    v: Float[Array, "B L kv_heads head_dim"],
    q_positions: Int[Array, "B Q"],
    kv_lens: Int[Array, " B"],
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> Float[Array, "B Q q_heads head_dim"]:
    """Causal attention over a contiguous per-sequence cache (the naive baseline's attention);
    with `sliding_window` a query sees only the last `sliding_window` positions (its own too)."""
    b, nq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    qg = q.astype(jnp.float32).reshape(b, nq, hkv, g, d) * sm_scale
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k.astype(jnp.float32))
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    k_pos = jnp.arange(k.shape[1])
    mask = (k_pos[None, None, :] <= q_positions[:, :, None]) & (
        k_pos[None, None, :] < kv_lens[:, None, None])
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_positions[:, :, None] - sliding_window
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask[:, None, None], p, 0.0)
    o = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(jnp.float32))
    return o.reshape(b, nq, hq, d).astype(q.dtype)


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
) -> Float[Array, "B q_heads head_dim"]:
    """Decode twin of the Pallas decode kernel: sequence b's one token sits at seq_lens[b] - 1.

    A sequence with seq_len 0 attends to nothing and gives zeros.
    """
    b = q.shape[0]
    qsl = jnp.arange(b + 1, dtype=jnp.int32)
    return ragged_paged_attention(q, k_pages, v_pages, qsl, seq_lens, block_tables,
                                  sm_scale=sm_scale, soft_cap=soft_cap,
                                  sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale)


# --- Decode projections (twins of pallas_kernels/decode_matmul.py) -------------------------


def rms_norm(x: Float[Array, "M K"], weight: Float[Array, " K"], eps: float,
             offset: float = 0.0) -> Float[Array, "M K"]:
    """The models' RMSNorm: Llama `w * round(x * r)`, Gemma (offset 1) `round(x * r * (1 + w))`."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def linear(x: Float[Array, "M K"], w: Float[Array, "K N"], b: Array | None = None
           ) -> Float[Array, "M N"]:
    """x @ w (+ b) in x's dtype, float32 accumulation (IEEE products for float32)."""
    prec = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = jnp.dot(x, w, precision=prec, preferred_element_type=jnp.float32).astype(x.dtype)
    return y if b is None else y + b.astype(x.dtype)


def rope_rows(x: Float[Array, "M N"], cos: Array, sin: Array, head_dim: int) -> Array:
    """The models' RoPE (`models.rope.apply_rope`) of [M, heads * head_dim] rows."""
    from models.rope import apply_rope

    return apply_rope(x.reshape(x.shape[0], -1, head_dim), cos, sin).reshape(x.shape)


def projections(x: Float[Array, "M K"], weights: list[Array], biases: list | None = None, *,
                norm_weight: Array | None = None, norm_eps: float = 1e-6,
                norm_offset: float = 0.0, rope: tuple[Array, Array] | None = None,
                rope_outputs: int = 0, head_dim: int | None = None) -> list[Array]:
    """[norm(x) @ w (+ b) for w in weights], the first `rope_outputs` rotated by RoPE."""
    h = x if norm_weight is None else rms_norm(x, norm_weight, norm_eps, norm_offset)
    biases = biases or [None] * len(weights)
    outs = [linear(h, w, b) for w, b in zip(weights, biases, strict=True)]
    return [rope_rows(y, *rope, head_dim) if n < rope_outputs else y
            for n, y in enumerate(outs)]


def gated_up(x: Float[Array, "M K"], w_gate: Array, w_up: Array, b_gate: Array | None = None,
             b_up: Array | None = None, *, act: str = "silu", norm_weight: Array | None = None,
             norm_eps: float = 1e-6, norm_offset: float = 0.0) -> Float[Array, "M N"]:
    """act(norm(x) @ w_gate) * (norm(x) @ w_up); act is silu or tanh-approximated gelu."""
    g, u = projections(x, [w_gate, w_up], [b_gate, b_up], norm_weight=norm_weight,
                       norm_eps=norm_eps, norm_offset=norm_offset)
    f = jax.nn.silu if act == "silu" else (lambda v: jax.nn.gelu(v, approximate=True))
    return f(g) * u


def projection_residual(x: Float[Array, "M K"], w: Array, residual: Array,
                        b: Array | None = None) -> Float[Array, "M N"]:
    """residual + (x @ w (+ b))."""
    return residual + linear(x, w, b)
