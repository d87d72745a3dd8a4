"""Grouped matmul for mixture-of-experts layers (Pallas, Triton backend on GPU).

Rows sorted by expert, `x [M, K]`, each times its own expert's weight `w[e] [K, N]`. jax's
`ragged_dot` lowers on XLA:GPU (jax 0.10) to one dense GEMM over every expert (the rows widened
to [M, E * K], masked): a decode step would read all E experts' weights where its tokens chose a
few, and a prefill's temporary grows to M * E * K. This kernel reads only the chosen experts.

Layout: each expert's rows are laid out from a tile boundary (`block_m` rows a tile), so every
row tile belongs to one expert and no two programs write the same output rows. Tile t's expert
is `tile_expert[t]` (E past the last used tile: such programs write zeros and read nothing).
A program (t, j) reads its tile of rows and column block j of its expert's weight, block_k rows
at a time, and writes [block_m, block_n] of the output. A SwiGLU layer (`grouped_swiglu`) lays
its rows out once and launches twice: gate and up in one kernel (both weights' blocks, the
SiLU product in its epilogue, written in the weights' dtype), then down. Tiles: at most
ceil(M / block_m) + min(E, M) (each non-empty expert adds at most one partial tile).

Quantized experts (models/quant.py's forms, stacked): fp8 values widen to the rows' dtype and
each product is scaled per column after the K loop. Integer groups (a GGUF's experts at its
own quantization) step along K one group at a time: the step loads the group's values (int4:
group / 2 packed rows, whose low nibbles are the group's first half of input rows and high
nibbles its second half, so each half multiplies a contiguous run of x's columns) and the
group's row of scales and mins, dequantizes the tile in registers and multiplies it. Gate and
up share one format (they come from one checkpoint); the kernel refuses a pair that does not.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from models.quant import QuantWeight
from pallas_kernels._compat import is_pow2, mm, pallas_call

__all__ = ["TileLayout", "grouped_matmul", "grouped_swiglu", "pad_rows", "tile_layout",
           "tiled_matmul", "unsupported"]

# One matrix of a layer's experts: [E, K, N], or a stacked QuantWeight (k_axis 1): fp8 values
# [E, K, N] with scales [E, 1, N], or int8 / int4 values with scales and mins [E, K / g, N].
Weight = jax.Array | QuantWeight

BLOCK_M = 16  # Triton's smallest dot tile; a decode step's expert holds a row or two
BLOCK_N_MAX = 128
BLOCK_K_MAX = 64


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n."""
    b = cap
    while b > 1 and n % b:
        b //= 2
    return b


def _format(w: Weight) -> tuple[str, int, bool] | None:
    """(kind, group size, has mins) of a quantized weight; None for a float one."""
    if not isinstance(w, QuantWeight):
        return None
    return w.kind, w.group_size, w.mins is not None


def _dims(w: Weight) -> tuple[int, int]:
    """(K, N) of one expert's matrix."""
    if isinstance(w, QuantWeight):
        return w.k, w.q.shape[2]
    return w.shape[1], w.shape[2]


def unsupported(*weights: Weight) -> str | None:
    """Why the kernel cannot take these expert weights in one launch (each [E, K, N], float or
    a stacked QuantWeight), or None."""
    k, n = _dims(weights[0])
    if _pow2_divisor(k, BLOCK_K_MAX) < 16 or _pow2_divisor(n, BLOCK_N_MAX) < 16:
        return f"expert weight {k} x {n} has no power-of-two tile >= 16 dividing both sides"
    if len({_format(w) for w in weights}) > 1:
        return "gate and up experts of different formats " \
            f"({', '.join(str(_format(w) or 'float') for w in weights)})"
    f = _format(weights[0])
    if f is None:
        dtype = jnp.dtype(weights[0].dtype)
        if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                         jnp.dtype(jnp.float32)):
            return f"expert weights of dtype {dtype.name}"
        return None
    kind, group, has_mins = f
    if kind == "fp8" and (group != k or has_mins):
        return "fp8 experts with group scales or mins"
    if kind != "fp8" and (not is_pow2(group) or group < (32 if kind == "int4" else 16)
                          or group > 256):
        return f"{kind} experts in groups of {group} (the kernel steps one group at a " \
            f"time: a power of two from {32 if kind == 'int4' else 16} to 256)"
    return None


def _kernel(tile_expert_ref, x_ref, *refs, num_experts: int, k: int, block_k: int,
            block_n: int, gated: bool, fmt: tuple[str, int, bool] | None) -> None:
    """Program (t, j): tile t's rows times column block j of its expert's weight (gated: of
    the gate and up weights, silu(gate) * up written in the output's dtype). `fmt`: None for
    float weights (one ref each), else every weight's (kind, group, has mins), its refs values,
    scales (and mins). fp8 slabs widen to the rows' dtype and each product is scaled per column
    after the K loop ((x @ q) * s == x @ (q * s)); integer groups step one group (block_k) at a
    time and dequantize in registers."""
    *w_refs, o_ref = refs
    per = 1 if fmt is None else 2 + (fmt[2] and fmt[0] != "fp8")
    weights = [w_refs[i:i + per] for i in range(0, len(w_refs), per)]
    t, j = pl.program_id(0), pl.program_id(1)
    e = tile_expert_ref[t]
    cols = pl.ds(j * block_n, block_n)

    def int_step(kk: jax.Array, a_lo: jax.Array, a_hi: jax.Array | None,
                 refs: tuple) -> jax.Array:
        """One group's product (kk: the group): its values dequantized by its scale row."""
        scale = refs[1][e, pl.ds(kk, 1), cols].astype(jnp.float32)  # [1, block_n]
        low = refs[2][e, pl.ds(kk, 1), cols].astype(jnp.float32) if fmt[2] else None

        def deq(v: jax.Array) -> jax.Array:
            wt = v.astype(jnp.float32) * scale
            return (wt if low is None else wt + low).astype(a_lo.dtype)

        if a_hi is None:  # int8: the group's block_k rows
            return mm(a_lo, deq(refs[0][e, pl.ds(kk * block_k, block_k), cols]))
        half = block_k // 2  # int4: packed row r holds rows r (low) and r + half (high)
        packed = refs[0][e, pl.ds(kk * half, half), cols]
        return (mm(a_lo, deq(packed & 15))
                + mm(a_hi, deq(jax.lax.shift_right_logical(packed, jnp.uint8(4)))))

    @pl.when(e < num_experts)
    def _():
        def body(kk, accs):
            if fmt is not None and fmt[0] in ("int8", "int4"):
                if fmt[0] == "int4":
                    half = block_k // 2
                    a_lo = x_ref[:, pl.ds(kk * block_k, half)]
                    a_hi = x_ref[:, pl.ds(kk * block_k + half, half)]
                else:
                    a_lo, a_hi = x_ref[:, pl.ds(kk * block_k, block_k)], None
                return tuple(acc + int_step(kk, a_lo, a_hi, w)
                             for acc, w in zip(accs, weights, strict=True))
            a = x_ref[:, pl.ds(kk * block_k, block_k)]
            return tuple(acc + mm(a, w[0][e, pl.ds(kk * block_k, block_k), cols].astype(a.dtype))
                         for acc, w in zip(accs, weights, strict=True))

        zero = jnp.zeros(o_ref.shape, jnp.float32)
        accs = jax.lax.fori_loop(0, k // block_k, body, (zero,) * len(weights))
        if fmt is not None and fmt[0] == "fp8":
            accs = tuple(acc * w[1][e, :, cols] for acc, w in zip(accs, weights, strict=True))
        out = jax.nn.silu(accs[0]) * accs[1] if gated else accs[0]
        o_ref[...] = out.astype(o_ref.dtype)

    @pl.when(e >= num_experts)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


class TileLayout(NamedTuple):
    """Sorted rows laid out so that each 16-row tile is one expert's: `tile_expert[t]` (E for
    an unused tile), `src[q]` the sorted row padded row q holds (-1: none), `dst[r]` the
    padded row of sorted row r, `live[r]` whether row r is in a group at all."""

    tile_expert: jax.Array
    src: jax.Array
    dst: jax.Array
    live: jax.Array

    def unpad(self, out: jax.Array) -> jax.Array:
        """The sorted rows' outputs from the tiled ones (zeros for rows in no group)."""
        return jnp.where(self.live[:, None], out[self.dst], 0).astype(out.dtype)

    @property
    def max_tiles(self) -> int:
        """Tiles of the layout (static): ceil(M / 16) + min(E, M)."""
        return self.tile_expert.shape[0]


def tile_layout(group_sizes: Int[Array, " E"], m: int) -> TileLayout:
    """The layout of M sorted rows in groups of `group_sizes` (sum <= M), each group from a
    tile boundary."""
    bm, e = BLOCK_M, group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    row_end = jnp.cumsum(gs)
    row_start = row_end - gs
    tiles = -(-gs // bm)  # tiles expert e's rows fill
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    max_tiles = -(-m // bm) + min(e, m)
    t = jnp.arange(max_tiles, dtype=jnp.int32)
    # (compare_all: one small fusion, where the default search is a loop of launches)
    tile_expert = jnp.searchsorted(tile_end, t, side="right",
                                   method="compare_all").astype(jnp.int32)  # E: unused
    # Padded row q of tile t holds sorted row row_start[e] + local, if local < gs[e].
    q = jnp.arange(max_tiles * bm, dtype=jnp.int32)
    qe = jnp.minimum(tile_expert[q // bm], e - 1)
    local = (q // bm - tile_start[qe]) * bm + q % bm
    valid = (tile_expert[q // bm] < e) & (local < gs[qe])
    src = jnp.where(valid, row_start[qe] + local, -1)
    # Sorted row r of expert e lies at padded row tile_start[e] * bm + (r - row_start[e]).
    r = jnp.arange(m, dtype=jnp.int32)
    re = jnp.minimum(jnp.searchsorted(row_end, r, side="right", method="compare_all"), e - 1)
    # Rows past the groups (sum(group_sizes) < M: tokens routed to no expert) are not live.
    dst = jnp.minimum(tile_start[re] * bm + r - row_start[re], max_tiles * bm - 1)
    return TileLayout(tile_expert, src, dst, r < row_end[-1])


def pad_rows(x: Float[Array, "M K"], layout: TileLayout) -> jax.Array:
    """x's rows in the tiled layout (zeros where a tile has no row): a gather."""
    return jnp.where((layout.src >= 0)[:, None], x[jnp.maximum(layout.src, 0)], 0)


def tiled_matmul(xp: jax.Array, weights: tuple[Weight, ...], layout: TileLayout, *,
                 out_dtype: Any = jnp.float32, interpret: bool = False) -> jax.Array:
    """Each tile of the padded rows `xp` times its expert's weight ([E, K, N], or a stacked
    QuantWeight); with two weights (gate, up), silu(x @ gate) * (x @ up). Rows of unused tiles
    come out zero. The weights pass `unsupported`."""
    fmt = _format(weights[0])
    arrays = [a for w in weights for a in (
        (w,) if fmt is None else (w.q, w.scales) + ((w.mins,) if fmt[0] != "fp8" and fmt[2]
                                                     else ()))]
    kp, k = xp.shape
    e, n = arrays[0].shape[0], arrays[0].shape[2]
    bm, bn = BLOCK_M, _pow2_divisor(n, BLOCK_N_MAX)
    bk = fmt[1] if fmt is not None and fmt[0] != "fp8" else _pow2_divisor(k, BLOCK_K_MAX)
    assert is_pow2(bn) and is_pow2(bk) and n % bn == 0 and k % bk == 0 and kp % bm == 0
    whole = [pl.BlockSpec(a.shape, lambda i, j: (0, 0, 0)) for a in arrays]  # read at e
    # One program per tile of xp's rows (`tile_expert` may run past them: `route_layout`'s).
    return pallas_call(
        functools.partial(_kernel, num_experts=e, k=k, block_k=bk, block_n=bn,
                          gated=len(weights) == 2, fmt=fmt),
        grid=(kp // bm, n // bn),
        in_specs=[pl.BlockSpec((layout.max_tiles,), lambda i, j: (0,)),
                  pl.BlockSpec((bm, k), lambda i, j: (i, 0)), *whole],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((kp, n), out_dtype),
        interpret=interpret, num_warps=4, num_stages=3,
        name="moe_grouped_gate_up" if len(weights) == 2 else "moe_grouped_matmul",
    )(layout.tile_expert, xp if fmt is not None else xp.astype(arrays[0].dtype), *arrays)


def grouped_matmul(x: Float[Array, "M K"], w: Weight, group_sizes: Int[Array, " E"], *,
                   interpret: bool = False) -> Float[Array, "M N"]:
    """Rows [start_e, start_e + group_sizes[e]) of x times w[e], float32 out; rows past the
    groups (sum(group_sizes) < M) zero. The shapes pass `unsupported`."""
    layout = tile_layout(group_sizes, x.shape[0])
    return layout.unpad(tiled_matmul(pad_rows(x, layout), (w,), layout, interpret=interpret))


def grouped_swiglu(x: Float[Array, "M H"], wg: Weight, wu: Weight, wd: Weight,
                   group_sizes: Int[Array, " E"], *, interpret: bool = False
                   ) -> Float[Array, "M H"]:
    """down(silu(x @ gate) * (x @ up)) of each sorted row by its own expert, float32 out: the
    rows laid out once, two launches (gate and up together with the SiLU product in the
    first's epilogue, written in the weights' dtype; then down), gathered back once."""
    layout = tile_layout(group_sizes, x.shape[0])
    h = tiled_matmul(pad_rows(x, layout), (wg, wu), layout,
                     out_dtype=x.dtype if isinstance(wg, QuantWeight) else wg.dtype,
                     interpret=interpret)
    return layout.unpad(tiled_matmul(h, (wd,), layout, interpret=interpret))


# A decode step's routing in one launch (`route_layout`): at most this many (token, expert)
# pairs, so every per-pair matrix of the program ([pairs, experts]) stays small.
ROUTE_MAX_PAIRS = 128
ROUTE_MAX_EXPERTS = 256


def routing_fits(tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether `route_layout` takes a step of `tokens` tokens over `num_experts` experts, k a
    token: powers of two (Triton's block shapes), at most ROUTE_MAX_PAIRS pairs."""
    return (is_pow2(tokens) and is_pow2(num_experts) and num_experts <= ROUTE_MAX_EXPERTS
            and tokens * _next_pow2(top_k) <= ROUTE_MAX_PAIRS)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _route_kernel(logits_ref, valid_ref, w_ref, dst_ref, te_ref, src_ref, *, top_k: int,
                  renormalize: bool, num_tiles: int) -> None:
    """One program: softmax, top-k and renormalization of every token's router logits, then
    the tile layout of its (token, expert) pairs, the pairs of each expert in token order
    (argsort's stable order: a token's k experts are distinct, so a pair's rank within its
    expert is the number of earlier tokens that chose that expert).

    Writes: w [T, KP] the weights (columns past k zero), dst [T, KP] each pair's padded row
    (-1: in no group, as the padding tokens' and the columns past k), te [num_tiles] each
    tile's expert (E: unused), src [num_tiles * 16] the token each padded row holds (-1:
    none)."""
    t, e = logits_ref.shape
    kp = w_ref.shape[1]
    bm = BLOCK_M
    lg = logits_ref[...].astype(jnp.float32)
    ex = jnp.exp(lg - jnp.max(lg, axis=1, keepdims=True))
    probs = ex / jnp.sum(ex, axis=1, keepdims=True)
    col_e = jax.lax.broadcasted_iota(jnp.int32, (t, e), 1)
    col_k = jax.lax.broadcasted_iota(jnp.int32, (t, kp), 1)
    weights = jnp.zeros((t, kp), jnp.float32)
    experts = jnp.full((t, kp), e, jnp.int32)
    for j in range(top_k):  # the largest left, ties to the lowest expert (lax.top_k's)
        best = jnp.max(probs, axis=1, keepdims=True)
        which = jnp.min(jnp.where(probs == best, col_e, e), axis=1, keepdims=True)
        weights = jnp.where(col_k == j, best, weights)
        experts = jnp.where(col_k == j, which, experts)
        probs = jnp.where(col_e == which, -1.0, probs)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=1, keepdims=True)
    experts = jnp.where(valid_ref[...][:, None] != 0, experts, e)  # padding: no expert
    w_ref[...] = weights
    # Pair p = token * KP + column: one-hot [P, E] of its expert.
    pairs = t * kp
    flat = experts.reshape(pairs)
    onehot = (flat[:, None] == jax.lax.broadcasted_iota(jnp.int32, (pairs, e), 1)
              ).astype(jnp.int32)
    sizes = jnp.sum(onehot, axis=0)  # [E]
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)  # [P]
    tiles = (sizes + (bm - 1)) // bm
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    first = jnp.sum(onehot * tile_start[None, :], axis=1)  # [P]: its expert's first tile
    dst = jnp.where(flat < e, first * bm + rank, -1)
    dst_ref[...] = dst.reshape(t, kp)
    row_t = jax.lax.broadcasted_iota(jnp.int32, (num_tiles, e), 0)
    te_ref[...] = jnp.sum((tile_end[None, :] <= row_t).astype(jnp.int32), axis=1)
    token = jax.lax.broadcasted_iota(jnp.int32, (pairs,), 0) // kp

    def fill(i, carry):  # 16 padded rows at a time: the pair whose dst is each, or none
        q = i * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, pairs), 0)
        hit = dst[None, :] == q
        src_ref[pl.ds(i * bm, bm)] = jnp.max(jnp.where(hit, token[None, :], -1), axis=1)
        return carry

    jax.lax.fori_loop(0, num_tiles, fill, 0)


def route_layout(logits: Float[Array, "T E"], valid: jax.Array | None, top_k: int,
                 renormalize: bool, *, interpret: bool = False
                 ) -> tuple[jax.Array, jax.Array, TileLayout]:
    """A decode step's routing and tile layout in one launch (`routing_fits` shapes): the
    router's softmax in float32, each token's top_k experts (renormalized when asked), and
    the layout `tiled_matmul` runs on, its padded rows taken straight from the tokens.

    Returns (weights [T, KP], dst [T, KP], layout): pair (t, j < k)'s weight and padded row
    (-1: none: a padding token's, `valid` False), and a TileLayout whose `src` names the token
    each padded row holds (so `pad_rows(x, layout)` gathers from the tokens themselves); its
    `tile_expert` is a power of two long, past the ceil(pairs / 16) + min(E, pairs) tiles
    `src` covers."""
    t, e = logits.shape
    kp = _next_pow2(top_k)
    pairs = t * top_k
    num_tiles = _next_pow2(-(-pairs // BLOCK_M) + min(e, pairs))
    valid = (jnp.ones((t,), jnp.int32) if valid is None else valid.astype(jnp.int32))
    whole = lambda *shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    w, dst, te, src = pallas_call(
        functools.partial(_route_kernel, top_k=top_k, renormalize=renormalize,
                          num_tiles=num_tiles),
        grid=(1,),
        in_specs=[whole(t, e), whole(t)],
        out_specs=[whole(t, kp), whole(t, kp), whole(num_tiles), whole(num_tiles * BLOCK_M)],
        out_shape=[jax.ShapeDtypeStruct((t, kp), jnp.float32),
                   jax.ShapeDtypeStruct((t, kp), jnp.int32),
                   jax.ShapeDtypeStruct((num_tiles,), jnp.int32),
                   jax.ShapeDtypeStruct((num_tiles * BLOCK_M,), jnp.int32)],
        # [pairs, experts] int32 matrices live in registers: a warp per 2048 of their values
        # (4 to 16), so none spills (16 tokens x 8 of 128 experts: 8 warps).
        interpret=interpret, num_warps=min(16, max(4, t * kp * e // 2048)), num_stages=1,
        name="moe_route",
    )(logits, valid)
    flat = dst.reshape(-1)
    # Tiles past the bound hold no row: xp (pad_rows, through `src`) gets only the bound's
    # rows, and `tiled_matmul` a program per tile of them (the slice fuses into the gather).
    tiles = -(-pairs // BLOCK_M) + min(e, pairs)
    return w, dst, TileLayout(te, src[:tiles * BLOCK_M], flat, flat >= 0)
