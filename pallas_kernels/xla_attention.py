"""Paged attention in plain XLA that skips the key chunks a query tile cannot see (CPU path).

Same inputs and result as `reference.ragged_paged_attention`, but the work is a list of
(query tile, key chunk) items rather than every tile against every chunk up to the step's
longest sequence. The reference pays for that rectangle: a short sequence next to a long one,
and the upper (causal) half of every long prompt, are computed and then masked away. Here a tile
visits only the chunks below its last query position, so a 1,000-token prompt costs about half
the reference's attention and a step mixing short and long sequences pays for each one's own
length. With a sliding window a tile also starts at the first chunk its first query's window
reaches: the pages before it are never gathered (a sliding layer's cost is its window).

Schedule. Tiles are sorted by how many chunks they need (descending), so the tiles that have a
j-th chunk (their start chunk + j) are a prefix of that order. Rank j's tiles are processed in
groups of `group` tiles per loop iteration (the last group padded with a dummy tile), rank 0
first; the loop runs only the iterations the step needs. Within one iteration the tiles are
distinct, so each tile's online-softmax state (running max, sum, accumulator) is gathered,
updated and scattered back without conflicts, and every tile sees its chunks in increasing
order.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.reference import (
    attend_chunk,
    chunked_tables,
    init_tile_state,
    query_tiling,
    tile_queries,
    tiles_to_tokens,
)

# Keys per chunk: smaller chunks waste less on the causal diagonal (a tile's last chunk is only
# partly visible) and on each sequence's last chunk, but make more loop iterations.
CHUNK_TOKENS = 128
# Query rows (tiles x tile size) one loop iteration works on. Decode tiles (one token) take
# smaller groups: then the gathered K/V chunks stay in cache (on the 2-core CPU 16 beat 32 and
# 64 for decode batches), while prefill tiles need larger ones to amortize the iteration.
ROWS_PER_ITER = 128
DECODE_ROWS_PER_ITER = 16


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
    chunk_tokens: int = CHUNK_TOKENS,
    rows_per_iter: int | None = None,
    decode_only: bool | None = None,
) -> Float[Array, "T q_heads head_dim"]:
    """Causal attention of each sequence's new tokens over its paged K/V; see the module doc.
    (`decode_only`: as in `reference.ragged_paged_attention`, ignored here.)"""
    t_total, hq, d = q.shape
    num_seqs, max_blocks = block_tables.shape
    _, bs, hkv, _ = k_pages.shape
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    tile, num_tiles = query_tiling(t_total, num_seqs)
    chunk = max(1, min(max_blocks, chunk_tokens // bs))  # blocks per key chunk
    ck = chunk * bs
    tables, n_chunks_max = chunked_tables(block_tables, chunk)
    if rows_per_iter is None:
        rows_per_iter = DECODE_ROWS_PER_ITER if tile == 1 else ROWS_PER_ITER
    group = max(1, min(num_tiles, rows_per_iter // tile))

    # Tiles: as in the reference, each holds up to `tile` consecutive new tokens of one sequence.
    tq = tile_queries(q, query_start_loc, seq_lens, tile, num_tiles, hkv, sm_scale)
    tseq, row_valid, tok, q_pos, qt = tq.seq, tq.row_valid, tq.tok, tq.q_pos, tq.q

    # Chunks each tile needs: from the first one its first valid query's window reaches (0
    # without a window) through its last valid query position; none for an unused tile.
    last_pos = jnp.max(jnp.where(row_valid, q_pos, -1), axis=1)
    end = jnp.where(last_pos >= 0, jnp.minimum(last_pos // ck + 1, n_chunks_max), 0)
    if sliding_window is None:
        start = jnp.zeros_like(end)
    else:  # keys before first_pos - window + 1 are out of every row's window: never read
        first_pos = jnp.min(jnp.where(row_valid, q_pos, jnp.iinfo(jnp.int32).max), axis=1)
        start = jnp.minimum(jnp.maximum(first_pos - sliding_window + 1, 0) // ck, end)
    need = end - start  # tile t reads chunks start[t] .. end[t]-1, as its j = 0, 1, ...
    order = jnp.argsort(-need, stable=True)  # tiles with a j-th chunk are order[:active[j]]
    active = jnp.sum(need[None, :] > jnp.arange(n_chunks_max)[:, None], axis=1)  # [chunks]
    iters = (active + group - 1) // group
    iter_end = jnp.cumsum(iters)
    num_iters = iter_end[-1]

    slot = jnp.arange(group)

    def body(i, state):
        m, lsum, acc = state
        j = jnp.sum(iter_end <= i)  # this iteration's chunk rank (iter_end is sorted)
        rank = (i - (iter_end[j] - iters[j])) * group + slot
        ok = rank < active[j]
        tiles = order[jnp.minimum(rank, num_tiles - 1)]  # distinct where ok
        c = jnp.minimum(start[tiles] + j, n_chunks_max - 1)  # each tile's own key chunk
        ids = jax.vmap(lambda row, off: jax.lax.dynamic_slice_in_dim(row, off, chunk))(
            tables[tseq[tiles]], c * chunk)
        m_new, l_new, a_new = attend_chunk(
            (m[tiles], lsum[tiles], acc[tiles]), qt[tiles], k_pages, v_pages, ids, c * ck,
            q_pos[tiles], row_valid[tiles] & ok[:, None], soft_cap=soft_cap,
            sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale)
        dst = jnp.where(ok, tiles, num_tiles)  # padding slots write nowhere
        return (m.at[dst].set(m_new, mode="drop"), lsum.at[dst].set(l_new, mode="drop"),
                acc.at[dst].set(a_new, mode="drop"))

    # Its trip count is data: the scope names the loop's static schedule, so that a reader of
    # the compiled program (jpaged/aot/traffic.py) can count the trips of a given step.
    with jax.named_scope(chunk_loop_name(tile, group, ck, n_chunks_max, sliding_window)):
        _, lsum, acc = jax.lax.fori_loop(0, num_iters, body, init_tile_state(qt))
    return tiles_to_tokens(lsum, acc, tok, q)


def chunk_loop_name(tile: int, group: int, chunk_keys: int, num_chunks: int,
                    sliding_window: int | None) -> str:
    """Name scope of the chunk loop: 'xla_chunks_t{tile}_g{group}_ck{keys}_n{chunks}[_w{W}]'."""
    window = "" if sliding_window is None else f"_w{sliding_window}"
    return f"xla_chunks_t{tile}_g{group}_ck{chunk_keys}_n{num_chunks}{window}"
