"""Weight-streaming matmuls for decode: a few rows against a large weight, one pass over it.

At decode a projection multiplies a handful of rows (the batch) by a weight of tens of MB, so
its cost is reading the weight once. One Pallas (Triton) kernel, `_stream_kernel`, does every
projection of a decoder layer, each in one launch:

* `projections` — q, k and v (or any list of weights sharing an input): one launch over the
  column blocks of all of them, each program streaming one [K, block_n] slab of one weight
  (`pl.when` picks which), optionally with the layer's RMSNorm in the prologue, biases (Qwen2)
  and RoPE of q and k in the epilogue, and k and v also stored into the KV pages at their
  slots (`KVWritePlan`: what `kv_write` would store, in the same launch);
* `gated_up` — gate and up as one launch: each program streams the same column slab of both
  weights and writes act(gate) * up (SiLU or tanh-GELU), with the RMSNorm prologue;
* `projection_residual` — o or down: the residual add in the epilogue;
* `logits` — the output head: float32 logits of lm_head's [K, V] kernel or a tied [V, K]
  embedding table, any vocabulary size (the last column block masked).

Layout and invariants:

* Weights are the models' own `[K, N]` kernels (nnx.Linear's layout), as the loaders place
  them; nothing is concatenated or copied. A program reads its slab `block_k` rows at a time
  (each row `block_n` contiguous elements, 64+ bytes), so every weight byte is read exactly
  once per row block, and the K reduction finishes inside the program (no split-K partials).
* Rows are padded in registers only: a program's `block_m` (a power of two >= 16, the smallest
  M of a tensor-core product) covers rows `[i * block_m, (i + 1) * block_m)`, loads past the
  batch are masked to zero and stores past it are masked off. Row blocks are grid axis 0 (the
  fastest), so the programs that share a weight slab run side by side and the slab comes from
  HBM once.
* The RMSNorm prologue is exact to the models' order: a first loop sums x^2 over all of K in
  float32; the main loop normalises each x tile, rounds it to the model dtype and multiplies by
  the norm weight (Llama: `w * round(x * r)`; Gemma: `round(x * r * (1 + w))`) before the product.
  x is [rows, K] (kilobytes): it is read twice from L2, never written back normalised.
* Accumulation is float32; bf16 operands use the tensor cores, float32 operands use IEEE
  float32 products (`Precision.HIGHEST`), as the models' own float32 matmuls do.
* `transposed=True` takes [N, K] weights instead (K contiguous): a tied output head's
  embedding table (float, or int4 / int8 quantized along K); the device check times both
  layouts for the projections.

Quantized weights (weight-only: activations stay in the model's dtype; docs/kernels.md,
"Quantized weights"). Any weight may be a `models.quant.QuantWeight` (int4, int8, fp8; the
layout of models/quant.py) instead of a float array. A program then streams the weight's values
(`q`, a [K or K / 2, block_n] slab: block_n bytes a row, 16-byte loads) and the scales and mins
of its columns: each K step loads one tile of values and its groups' scales and mins, expands
those to the rows in registers and dequantizes as `models.quant.dequantize` does (`q * scale +
min` in float32, rounded to the model dtype) before the product; fp8 (a scale per output
channel) multiplies the float32 sum instead, as `quant_matmul` does. A K tile holds whole
groups or lies within one. An int4 tile of block_k rows is block_k / 2 packed rows: their low
nibbles are each group's first half, their high nibbles its second half (the group-local
pairing), two products with the matching x columns. A quantized output is the float32 sum, the
bias added in float32, rounded once: QuantLinear's order. `plan_stream` picks the K tile for
quantized weights (`_quant_block_k`); `unsupported` names the formats it cannot take
(`quant_unsupported`), and a launch given one raises ValueError.

`unsupported` says why a shape cannot take these kernels (the caller falls back to XLA's GEMMs
and logs it once); `pallas_kernels/reference.py` has the jnp twins the kernels are tested
against.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float

from jpaged.intmath import cdiv
from models.quant import QuantWeight
from pallas_kernels._compat import next_pow2, pallas_call
from pallas_kernels.kv_write import quantize
from pallas_kernels.reference import from_bits, is_fp8, to_bits

# An H200 has 132 SMs: below this many programs a launch leaves SMs idle.
_MIN_PROGRAMS = 264
# Bytes of one weight tile ([block_k, block_n]) a pipeline stage holds in shared memory.
_TILE_BYTES = 16 * 1024
_MAX_BLOCK_M = 64
ACTIVATIONS = ("silu", "gelu_tanh")
# Quantized weights: bytes of values one K step of a program loads (all its weights), which
# bounds the float32 tiles the dequantization holds in registers (4 KiB: a 32-column slab of
# int4 takes 256 rows, of int8 / fp8 128; a 16-column RoPE half-slab then loads 2 KiB, 16
# bytes for each of a program's 128 threads); elements of twice the x tile (block_m x block_k)
# at most; pipeline stages (the tiles are smaller than a float weight's).
_QUANT_TILE_BYTES = 4096
_QUANT_X_ELEMENTS = 8192
# ... and a program's float32 accumulators (block_m x block_n a weight) at most this many
# elements (64 registers a thread): gate/up at 64-row blocks takes 64 columns, not 128.
_QUANT_ACC_ELEMENTS = 8192
_QUANT_STAGES = 4
QUANT_KINDS = ("int4", "int8", "fp8")

# A weight operand: the model's float [K, N] kernel, or a quantized one laid out like it.
Weight = jax.Array | QuantWeight


@dataclass(frozen=True)
class StreamPlan:
    """Tile sizes of one launch (all powers of two; block_n divides every weight's N)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class KVWritePlan:
    """Which outputs of a `projections` launch also go into the KV pages, and how (static).

    `segments`: the output indices of K and V (their pages, in that order); `page_dtype`: the
    pages' dtype (fp8 quantized with the scales, stored as bits like kv_write).
    """

    segments: tuple[int, int]
    head_dim: int
    page_dtype: jnp.dtype

    @property
    def fp8(self) -> bool:
        """Whether the pages are fp8 (the launch takes the K and V scales)."""
        return is_fp8(self.page_dtype)


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


@dataclass(frozen=True)
class QuantFormat:
    """What the kernels need to know of a quantized weight (static): its kind, its group size
    (consecutive input rows sharing a scale; K for a scale per output channel) and whether it
    carries mins."""

    kind: str
    group_size: int
    has_mins: bool

    @classmethod
    def of(cls, w: QuantWeight) -> QuantFormat:
        """The format of a [K, N] (or, k_axis 1, [N, K]) QuantWeight."""
        return cls(w.kind, w.group_size, w.mins is not None)


def weight_format(w: Weight) -> QuantFormat | None:
    """A weight's QuantFormat, or None for a float array."""
    return QuantFormat.of(w) if isinstance(w, QuantWeight) else None


def weight_shape(w: Weight) -> tuple[int, int]:
    """The [K, N] a weight stands for (a quantized one unpacked, in either layout); a float
    array as it lies ([N, K] for `transposed` launches)."""
    if isinstance(w, QuantWeight):
        return w.k, int(w.q.shape[1 - w.k_axis])
    return tuple(w.shape)  # type: ignore[return-value]


def _fits(f: QuantFormat | None, bk: int) -> bool:
    """Whether a K tile of `bk` rows (a power of two) can stream this weight: it holds whole
    groups or lies within one, and each product has >= 16 rows (int4: its two halves)."""
    if f is None or f.kind == "fp8":
        return bk >= 16
    gs = f.group_size
    if bk % gs and gs % bk:
        return False
    return bk >= (32 if f.kind == "int4" else 16)


def quant_unsupported(f: QuantFormat, k: int) -> str | None:
    """Why the kernels cannot stream a quantized weight of this format with `k` input rows,
    or None if they can."""
    gs = f.group_size
    if f.kind not in QUANT_KINDS:
        return f"quantized kind {f.kind!r} (the kernels read {', '.join(QUANT_KINDS)})"
    if gs < 1 or k % gs:
        return f"{f.kind} group size {gs} does not divide the input size {k}"
    if f.kind == "fp8" and (gs != k or f.has_mins):
        return "fp8 weights with group scales or mins (the kernels take one scale per output " \
               "channel)"
    if f.kind == "int4" and (gs % 2 or not f.has_mins):
        return f"int4 group size {gs} is odd or the weight has no mins"
    if not any(_fits(f, bk) for bk in _pow2_divisors(k)):
        need = 32 if f.kind == "int4" else 16
        return (f"{f.kind} group size {gs}: no power-of-two K tile >= {need} dividing {k} "
                "holds whole groups or lies within one")
    return None


def _pow2_divisors(k: int, cap: int = 256) -> list[int]:
    """Powers of two in [16, cap] dividing k, largest first."""
    out, d = [], _pow2_divisor(k, cap)
    while d >= 16:
        out.append(d)
        d //= 2
    return out


def unsupported(rows: int, k: int, ns: Sequence[int], dtype: jnp.dtype,
                formats: Sequence[QuantFormat | None] = ()) -> str | None:
    """Why these shapes cannot take the streaming kernels, or None if they can.

    `dtype`: the weights' dtype, or with quantized weights the activations' (the model's);
    `formats`: one per weight of the launch (None: a float weight), when any is quantized.
    """
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                jnp.dtype(jnp.float32)):
        what = "activation" if any(f is not None for f in formats) else "weight"
        return f"{what} dtype {jnp.dtype(dtype).name} (bf16, f16 or f32 only)"
    if _pow2_divisor(k, 256) < 16:
        return f"input size {k} has no power-of-two tile >= 16 dividing it"
    for n in ns:
        if _pow2_divisor(n, 128) < 16:
            return f"output size {n} has no power-of-two tile >= 16 dividing it"
    if rows < 1:
        return "no rows"
    for f in formats:
        why = None if f is None else quant_unsupported(f, k)
        if why is not None:
            return why
    if any(f is not None for f in formats) and not any(
            all(_fits(f, bk) for f in formats) for bk in _pow2_divisors(k)):
        kinds = ", ".join(sorted({f"{f.kind}/{f.group_size}" for f in formats if f}))
        return f"no K tile dividing {k} suits every weight of the launch together ({kinds})"
    return None


def rope_fits(head_dim: int, ns: Sequence[int]) -> bool:
    """Whether q/k of this head size (outputs of sizes `ns`) can take RoPE in the epilogue:
    each column block must split into two half-slabs of >= 16 columns within a half head."""
    half_slab = min(_pow2_divisor(head_dim // 2, 64), *(_pow2_divisor(n, 128) // 2 for n in ns))
    return head_dim % 2 == 0 and half_slab >= 16


def plan_stream(rows: int, k: int, ns: Sequence[int], itemsize: int,
                block_n: int | None = None, block_k: int | None = None,
                weights_per_program: int = 1, head_dim: int | None = None,
                formats: Sequence[QuantFormat | None] = (), ragged: bool = False
                ) -> StreamPlan:
    """Tiles for `rows` rows against weights [k, n] for n in `ns` (see `unsupported` first).

    block_n: the widest power of two <= 128 dividing every n, halved (down to 32) while the
    launch would have fewer than `_MIN_PROGRAMS` programs; block_k: as many rows as keep the
    weight tiles of one pipeline stage (`weights_per_program` of them: 2 for gate and up)
    within `_TILE_BYTES`, dividing k. `head_dim` (RoPE in the epilogue): block_n at most
    twice the widest power of two dividing head_dim / 2, so a block's two half-slabs pair up.
    `formats` (one per weight, None for a float one): with any quantized weight block_n is
    also halved (down to 32) while the accumulators exceed `_QUANT_ACC_ELEMENTS`, block_k
    comes from `_quant_block_k` and the plan pipelines `_QUANT_STAGES` stages.
    `ragged` (the output head's one weight, `logits`): block_n need not divide n; it starts at
    128 where no power of two >= 32 divides n, and the last column block is masked.
    """
    bm = max(16, min(_MAX_BLOCK_M, next_pow2(rows)))
    row_blocks = cdiv(rows, bm)
    block_n_given = block_n
    if block_n is None:
        block_n = min(_pow2_divisor(n, 128) for n in ns)
        if ragged and block_n < 32:
            block_n = 128
        if head_dim is not None:
            block_n = min(block_n, 2 * _pow2_divisor(head_dim // 2, 64))
        while block_n > 32 and row_blocks * sum(cdiv(n, block_n) for n in ns) < _MIN_PROGRAMS:
            block_n //= 2
    quant = any(f is not None for f in formats)
    if quant and block_n_given is None:  # float32 accumulators: block_m x block_n per weight
        while block_n > 32 and bm * block_n * weights_per_program > _QUANT_ACC_ELEMENTS:
            block_n //= 2
    if block_k is None:
        if quant:
            block_k = _quant_block_k(k, block_n, weights_per_program, formats, itemsize, bm)
            # An int4 tile inside one group reads its two half-runs of packed rows 8 bytes a
            # thread at most (PTX of the 8B's int4 head, groups of 128, 64-row tiles): narrower
            # columns buy a tile of whole groups, read 16 bytes a thread.
            while (block_k is not None and block_n > 32 and block_n_given is None
                   and any(f is not None and f.kind == "int4" and f.group_size > block_k
                           and k % f.group_size == 0 for f in formats)):
                block_n //= 2
                block_k = _quant_block_k(k, block_n, weights_per_program, formats, itemsize,
                                         bm)
            if block_k is None:
                raise ValueError(f"no K tile dividing k={k} suits these quantized weights "
                                 f"({unsupported(rows, k, ns, jnp.float32, formats)})")
        else:
            block_k = _pow2_divisor(
                k, max(16, _TILE_BYTES // (block_n * itemsize * weights_per_program)))
    if (not ragged and any(n % block_n for n in ns)) or k % block_k:
        raise ValueError(f"tiles ({block_k}, {block_n}) do not divide k={k}, n={list(ns)}")
    if quant:
        return StreamPlan(bm, block_n, block_k, num_stages=_QUANT_STAGES)
    return StreamPlan(bm, block_n, block_k)


def _quant_block_k(k: int, block_n: int, weights_per_program: int,
                   formats: Sequence[QuantFormat | None], itemsize: int, block_m: int = 16
                   ) -> int | None:
    """The K tile of a launch with quantized weights: the largest power of two dividing k that
    every weight fits (`_fits`) and that keeps a step's bytes of values (block_k x block_n x
    weights a program, half a byte an int4 element) within _QUANT_TILE_BYTES and twice its x
    tile (block_m x block_k: an int4 step holds both halves beside their dequantized tiles)
    within _QUANT_X_ELEMENTS, or block_k at most 128 / weights a program (a float weight of
    the launch: its bytes within _TILE_BYTES too); None when none fits. (The caps keep every
    launch of the 8B within the registers, without spills, in a deviceless H200 compile.)"""
    per_element = 0.5 if all(f is not None and f.kind == "int4" for f in formats) else 1.0
    cap = max(16, min(int(_QUANT_TILE_BYTES / (block_n * weights_per_program * per_element)),
                      max(128 // weights_per_program, _QUANT_X_ELEMENTS // (2 * block_m))))
    if any(f is None for f in formats):
        cap = min(cap, max(16, _TILE_BYTES // (block_n * itemsize * weights_per_program)))
    for bk in _pow2_divisors(k, cap):
        if all(_fits(f, bk) for f in formats):
            return bk
    # Nothing at or under the cap: the smallest tile above it that fits (int4 needs 32 rows).
    for bk in reversed(_pow2_divisors(k)):
        if bk > cap and all(_fits(f, bk) for f in formats):
            return bk
    return None


def _dot(a: jax.Array, b: jax.Array, trans_b: bool = False) -> jax.Array:
    """a @ b (or a @ b.T) with float32 accumulation; IEEE float32 products for float32."""
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (1 if trans_b else 0,)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def _act(name: str, x: jax.Array) -> jax.Array:
    """The gate activation on float32 values."""
    if name == "silu":
        return x * jax.nn.sigmoid(x)
    # tanh-approximated gelu (Gemma), written out: the Triton lowering has tanh.
    c = 0.7978845608028654  # sqrt(2 / pi)
    return 0.5 * x * (1.0 + jnp.tanh(c * (x + 0.044715 * x * x * x)))


# What a segment's program does with its slabs (static, per segment):
#   "plain": one [K, block_n] slab -> its output columns;
#   "gated": the same columns of two weights (gate, up) -> act(gate) * up;
#   "rope":  two [K, block_n / 2] slabs of one weight, the halves (d, d + head_dim / 2) of the
#            same head dims -> rotated by the rows' position angle (RoPE, rotate-half layout).
SLABS = {"plain": 1, "gated": 2, "rope": 2}


def _stream_kernel(*refs, plan: StreamPlan, rows: int, k: int, seg_blocks: tuple[int, ...],
                   kinds: tuple[str, ...], rope_pairs: int, has_bias: bool, has_norm: bool,
                   norm_offset: float, eps: float, act: str | None, has_residual: bool,
                   has_rope: bool, transposed: bool, kv: KVWritePlan | None,
                   formats: tuple[tuple[QuantFormat | None, ...], ...] = (),
                   n_valid: tuple[int | None, ...] = (), f32_out: bool = False) -> None:
    """One (row block, column block): stream the slab(s) of the segment the column block falls
    in (`kinds`) and write its [block_m, block_n] output tile (and, for the K and V segments
    of `kv`, the same values into the pages at the rows' slots).

    refs: x, [norm weight], [residual], [cos, sin], [slots, [fp8 scales]], per segment its
    slabs (a float slab: one ref; a quantized one, `formats`: values, scales, [mins]) then
    [their biases], [K and V pages in]; then one output per segment, [K and V pages out
    (aliases of the pages in)]. With `transposed` every slab is [block_n, K] (a quantized one:
    values [block_n, K or K / 2], scales and mins [block_n, groups]).

    `n_valid` (per segment, a ragged one's N, else None): that segment's last column block
    overhangs its weight; its loads of weight columns >= N are masked off (never read) and so
    are its stores. `f32_out`: the float32 sums are stored as they are (the output head's
    logits), not rounded to the model dtype."""
    bm, bn, bk = plan.block_m, plan.block_n, plan.block_k
    it = iter(refs)
    x_ref = next(it)
    g_ref = next(it) if has_norm else None
    res_ref = next(it) if has_residual else None
    cos_ref, sin_ref = (next(it), next(it)) if has_rope else (None, None)
    slot_ref = next(it) if kv is not None else None
    kvs_ref = next(it) if kv is not None and kv.fp8 else None
    formats = formats or tuple((None,) * SLABS[kind] for kind in kinds)
    segs = []
    for fmts in formats:
        ws = [next(it) if f is None else tuple(next(it) for _ in range(2 + f.has_mins))
              for f in fmts]
        bs = [next(it) for _ in ws] if has_bias else [None] * len(ws)
        segs.append((ws, bs))
    outs = list(it)
    pages_out: list = []
    if kv is not None:  # the pages in (read through their aliased outputs), the pages out
        outs, pages_out = outs[2:-2], outs[-2:]
    dtype = x_ref.dtype
    i, j = pl.program_id(0), pl.program_id(1)
    r = i * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0)
    live = r < rows  # rows past the batch: loaded as 0, never stored
    rows_at = pl.ds(i * bm, bm)
    steps = k // bk

    def tile(ref: Any, at: Any, ok: jax.Array | None) -> jax.Array:
        """A slab's rows `at` along K (values, or scales / mins along their groups): ref[at, :],
        or ref[:, at] for a transposed slab; with `ok` (a ragged block's live columns) the
        columns past N are masked off, not read. A masked lane holds anything: it feeds only
        its own output column, which is never stored."""
        idx = (slice(None), at) if transposed else (at, slice(None))
        if ok is None:
            return ref[idx]
        return plt.load(ref.at[idx], mask=ok[:, None] if transposed else ok[None, :])

    def x_tile(kk: jax.Array) -> jax.Array:
        return plt.load(x_ref.at[rows_at, pl.ds(kk * bk, bk)], mask=live[:, None], other=0)

    inv = None
    if has_norm:
        def sq(kk, acc):
            xt = x_tile(kk).astype(jnp.float32)
            return acc + jnp.sum(xt * xt, axis=1)

        ssq = lax.fori_loop(0, steps, sq, jnp.zeros((bm,), jnp.float32))
        inv = lax.rsqrt(ssq / k + eps)

    def operand(kk: jax.Array) -> jax.Array:
        xt = x_tile(kk)
        if not has_norm:
            return xt
        gt = g_ref[pl.ds(kk * bk, bk)]
        normed = xt.astype(jnp.float32) * inv[:, None]
        if norm_offset:  # Gemma: round(x * r * (1 + w))
            return (normed * (norm_offset + gt.astype(jnp.float32))[None, :]).astype(dtype)
        return normed.astype(dtype) * gt[None, :].astype(dtype)  # Llama: w * round(x * r)

    def operand_at(start: jax.Array, size: int) -> jax.Array:
        """`operand` of input columns [start, start + size) (a quantized weight's unit)."""
        xt = plt.load(x_ref.at[rows_at, pl.ds(start, size)], mask=live[:, None], other=0)
        if not has_norm:
            return xt
        gt = g_ref[pl.ds(start, size)]
        normed = xt.astype(jnp.float32) * inv[:, None]
        if norm_offset:
            return (normed * (norm_offset + gt.astype(jnp.float32))[None, :]).astype(dtype)
        return normed.astype(dtype) * gt[None, :].astype(dtype)

    def x_gather(cols: jax.Array) -> jax.Array:
        """`operand` of the input columns `cols` [n] (any order: an int4 tile's halves)."""
        n = cols.shape[0]
        r = jnp.minimum(i * bm + lax.broadcasted_iota(jnp.int32, (bm, n), 0), rows - 1)
        c = jnp.broadcast_to(cols[None, :], (bm, n))
        xt = plt.load(x_ref.at[r, c], mask=jnp.broadcast_to(live[:, None], (bm, n)), other=0)
        if not has_norm:
            return xt
        gt = g_ref[cols]
        normed = xt.astype(jnp.float32) * inv[:, None]
        if norm_offset:
            return (normed * (norm_offset + gt.astype(jnp.float32))[None, :]).astype(dtype)
        return normed.astype(dtype) * gt[None, :].astype(dtype)

    def groups_of(f: QuantFormat) -> int:
        """Groups an integer slab's K step spans: bk / gs whole ones, or 1 (gs >= bk)."""
        return bk // f.group_size if bk % f.group_size == 0 else 1

    def first_group(kk: jax.Array, f: QuantFormat) -> tuple[int, jax.Array]:
        """(groups, first group) of the integer slab rows step `kk` reads."""
        gs = f.group_size
        if bk % gs == 0:  # whole groups, consecutive
            return bk // gs, kk * (bk // gs)
        return 1, lax.div(kk, gs // bk)  # the tile lies in one group (gs a multiple of bk)

    def ahead(w: Any, f: QuantFormat | None) -> bool:
        """Whether an integer slab's scales and mins are loaded a step early: a tile of them
        under 4 bytes a thread cannot join the pipeline's copies (Triton then loads it where
        it is used, stalling the step), so the step before issues it into registers. (Only
        one step: carrying loads further makes Triton's pipeliner give up on the loop.)"""
        if f is None or f.kind == "fp8":
            return False
        width = w[1].shape[0 if transposed else 1]
        return groups_of(f) * width * w[1].dtype.itemsize < 4 * 32 * plan.num_warps

    def group_params(kk: jax.Array, w: tuple, f: QuantFormat | None,
                     ok: jax.Array | None = None) -> tuple:
        """The scales (and mins) [groups, width] ([width, groups] transposed) of step `kk`'s
        rows of an integer slab, as stored; () for a float or fp8 slab."""
        if f is None or f.kind == "fp8":
            return ()
        groups, g0 = first_group(kk, f)
        return tuple(tile(ref, pl.ds(g0, groups), ok) for ref in w[1:])

    def quant_step(kk: jax.Array, w: tuple, f: QuantFormat, x_at, params: tuple,  # noqa: ANN001
                   ok: jax.Array | None = None) -> jax.Array:
        """x tile(s) @ the dequantized [block_k, width] tile of a quantized slab, float32: one
        load of its values (block_k rows, int4 block_k / 2), its groups' scales and mins
        (`params`) expanded to the rows in registers. A transposed slab's tile is [width,
        block_k], dequantized alike and multiplied as its transpose."""
        q_ref = w[0]
        if f.kind == "fp8":  # the per-channel scale multiplies the sum (the epilogue)
            xt = x_at(("x",), kk * bk, bk)
            return _dot(xt, tile(q_ref, pl.ds(kk * bk, bk), ok).astype(dtype),
                        trans_b=transposed)
        gs = f.group_size
        nq = bk // 2 if f.kind == "int4" else bk  # rows of values a step loads
        groups, g0 = first_group(kk, f)
        width = q_ref.shape[0 if transposed else 1]

        def rows_of(v: jax.Array) -> jax.Array:  # [groups, width] -> [nq or 1, width]
            v = v.astype(jnp.float32)
            if groups == 1:
                return v
            per = nq // groups
            if transposed:  # [width, groups] -> [width, nq]
                return jnp.broadcast_to(v[:, :, None], (width, groups, per)).reshape(width, nq)
            return jnp.broadcast_to(v[:, None, :], (groups, per, width)).reshape(nq, width)

        scale = rows_of(params[0])
        low = rows_of(params[1]) if f.has_mins else None

        def deq(v: jax.Array) -> jax.Array:
            wt = v.astype(jnp.float32) * scale
            return (wt if low is None else wt + low).astype(dtype)

        if f.kind == "int8":
            xt = x_at(("x",), kk * bk, bk)
            return _dot(xt, deq(tile(q_ref, pl.ds(kk * bk, bk), ok)), trans_b=transposed)
        # int4: packed row r of a group holds its elements r (low nibble) and r + gs / 2.
        packed = tile(q_ref, pl.ds(kk * nq, nq), ok)
        half = gs // 2
        if groups > 1 or gs == bk:  # whole groups: each half-group's columns, gathered
            r = lax.broadcasted_iota(jnp.int32, (nq,), 0)
            cols = kk * bk + lax.div(r, half) * gs + lax.rem(r, half)
            x_lo = x_at(("lo", gs), cols, None)
            x_hi = x_at(("hi", gs), cols + half, None)
        else:  # a run of nq packed rows within one group: two contiguous column runs
            lo = g0 * gs + lax.rem(kk, gs // bk) * nq
            x_lo = x_at(("lo", gs), lo, nq)
            x_hi = x_at(("hi", gs), lo + half, nq)
        return (_dot(x_lo, deq(packed & 15), trans_b=transposed)
                + _dot(x_hi, deq(lax.shift_right_logical(packed, jnp.uint8(4))),
                       trans_b=transposed))

    def store(out_ref, col0: jax.Array, width: int, y: jax.Array, page: int | None,  # noqa: ANN001
              ok: jax.Array | None = None) -> None:
        plt.store(out_ref.at[rows_at, pl.ds(col0, width)], y.astype(out_ref.dtype),
                  mask=live[:, None] if ok is None else live[:, None] & ok[None, :])
        if page is None:
            return
        # Rows with a slot also go to the pages: block slot // block_size, offset slot %
        # block_size, the head and dims of these columns, quantized as kv_write does; slot < 0
        # (padding) writes nothing.
        slot = plt.load(slot_ref.at[rows_at], mask=live, other=-1)
        ok = live & (slot >= 0)
        at = jnp.where(ok, slot, 0)
        page_rows = pages_out[page].shape[1]
        dst = pages_out[page]
        scale = kvs_ref[page] if kvs_ref is not None else 1.0
        val = quantize(y, kv.page_dtype, scale)
        if dst.dtype != kv.page_dtype:
            val = lax.bitcast_convert_type(val, dst.dtype)
        # Every index an array ([rows, width] pointers): the form both Triton and the
        # interpreter take for a scatter. Masked lanes point at slot 0 (the null block).
        dims = col0 % kv.head_dim + lax.broadcasted_iota(jnp.int32, (bm, width), 1)
        heads = jnp.full((bm, width), col0 // kv.head_dim, jnp.int32)
        blk, off = (jnp.broadcast_to(a[:, None], (bm, width))
                    for a in (at // page_rows, at % page_rows))
        plt.store(dst.at[blk, off, heads, dims], val,
                  mask=jnp.broadcast_to(ok[:, None], (bm, width)))

    start = 0
    for n, ((ws, bs), kind, out_ref, nblk) in enumerate(
            zip(segs, kinds, outs, seg_blocks, strict=True)):
        lo = start
        start += nblk
        page = None if kv is None or n not in kv.segments else kv.segments.index(n)

        @pl.when((j >= lo) & (j < start))
        def _segment(ws=ws, bs=bs, kind=kind, out_ref=out_ref, lo=lo, page=page,
                     fmts=formats[n], nv=n_valid[n] if n_valid else None) -> None:
            jj = j - lo  # the column block within the segment; weights come as its slabs
            width = bn // len(ws) if kind == "rope" else bn
            # A ragged segment's columns below its N (all but the last block's tail: a plain
            # segment, whose block is `bn` columns); None: every column is live.
            ok = None if nv is None else (
                jj * bn + lax.broadcasted_iota(jnp.int32, (bn,), 0) < nv)

            def body(kk, accs):
                xt = operand(kk)
                ks = pl.ds(kk * bk, bk)
                return tuple(a + _dot(xt, tile(w, ks, ok), trans_b=transposed)
                             for a, w in zip(accs, ws, strict=True))

            early = [ahead(w, f) for w, f in zip(ws, fmts, strict=True)]

            def params_at(kk):  # the early slabs' scales and mins of step kk (clamped)
                kk = jnp.minimum(kk, steps - 1)
                return tuple(group_params(kk, w, f, ok) if e else ()
                             for w, f, e in zip(ws, fmts, early, strict=True))

            def quant_body(kk, carry):
                accs, params = carry  # params: the early slabs' scales of step kk
                nxt = params_at(kk + 1)
                params = tuple(p if e else group_params(kk, w, f, ok)
                               for p, w, f, e in zip(params, ws, fmts, early, strict=True))
                tiles: dict[tuple, jax.Array] = {}  # x tiles of this step, by the columns

                def x_at(key: tuple, at: jax.Array, size: int | None) -> jax.Array:
                    if key not in tiles:  # size None: `at` holds the columns
                        tiles[key] = x_gather(at) if size is None else operand_at(at, size)
                    return tiles[key]

                accs = tuple(
                    a + (_dot(x_at(("x",), kk * bk, bk), tile(w, pl.ds(kk * bk, bk), ok),
                              trans_b=transposed)
                         if f is None else quant_step(kk, w, f, x_at, p, ok))
                    for a, w, f, p in zip(accs, ws, fmts, params, strict=True))
                return accs, nxt

            zero = jnp.zeros((bm, width), jnp.float32)
            quantized = any(f is not None for f in fmts)
            if quantized:
                accs, _ = lax.fori_loop(0, steps, quant_body,
                                        ((zero,) * len(ws), params_at(jnp.int32(0))))
            else:
                accs = lax.fori_loop(0, steps, body, (zero,) * len(ws))
            if quantized:  # float32 sum (x fp8's channel scale) + bias, rounded once
                vals = [_finish_quant(a, w, b, f, jnp.float32 if f32_out else dtype, ok)
                        for a, w, b, f in zip(accs, ws, bs, fmts, strict=True)]
            elif f32_out:  # the head's logits: the float32 sums themselves (no bias)
                vals = list(accs)
            else:  # Rounded to the model dtype, then the bias added in it: the XLA path's order.
                vals = [a.astype(dtype) if b is None else a.astype(dtype) + b[...][None, :]
                        for a, b in zip(accs, bs, strict=True)]
            if kind == "rope":  # XLA's apply_rope: float32 rotation of the rounded halves
                half_col, lo_col = _rope_columns(jj, rope_pairs, width)
                ang = (rows_at, pl.ds(half_col, width))
                c = plt.load(cos_ref.at[ang], mask=live[:, None], other=0)
                sn = plt.load(sin_ref.at[ang], mask=live[:, None], other=0)
                x1, x2 = (v.astype(jnp.float32) for v in vals)
                store(out_ref, lo_col, width, (x1 * c - x2 * sn).astype(dtype), page)
                store(out_ref, lo_col + rope_pairs * width, width,
                      (x2 * c + x1 * sn).astype(dtype), page)
                return
            if kind == "gated":  # act(gate) * up
                y = _act(act, vals[0].astype(jnp.float32)).astype(dtype) * vals[1]
            else:
                y = vals[0]
            if has_residual:
                res = plt.load(res_ref.at[rows_at, pl.ds(jj * bn, bn)], mask=live[:, None],
                               other=0)
                y = y + res
            store(out_ref, jj * bn, bn, y if f32_out else y.astype(dtype), page, ok)


def _finish_quant(acc: jax.Array, w: Any, b: Any, f: QuantFormat | None,
                  dtype: jnp.dtype, ok: jax.Array | None = None) -> jax.Array:
    """A quantized segment's output tile from its float32 sum, in QuantLinear's order: fp8's
    channel scale, the bias in float32, one rounding (a float slab of the segment: as `body`'s
    epilogue rounds it). `ok`: a ragged block's live columns (the scales past N not read)."""
    if f is None:
        return acc.astype(dtype) if b is None else acc.astype(dtype) + b[...][None, :]
    if f.kind == "fp8":  # scales [1, width] (fp8 takes no transposed slab)
        scale = w[1][...] if ok is None else plt.load(w[1].at[pl.ds(0, 1), :],
                                                     mask=ok[None, :])
        acc = acc * scale.astype(jnp.float32)
    if b is not None:
        acc = acc + b[...][None, :].astype(jnp.float32)
    return acc.astype(dtype)


def _rope_columns(jj: jax.Array, pairs: int, width: int) -> tuple[jax.Array, jax.Array]:
    """For column block `jj` of a RoPE segment (each head: `pairs` blocks of `width` pairs):
    its first column within the half head (the angle tables' column) and the output column of
    its first half; the second half lies `pairs * width` further on."""
    head, c = jj // pairs, jj % pairs
    return c * width, head * (2 * pairs * width) + c * width


Segment = tuple[str, Sequence[Weight], Sequence[jax.Array | None]]  # kind, weights, biases


def _launch(x: jax.Array, segments: Sequence[Segment], *, name: str,
            norm_weight: jax.Array | None = None, norm_eps: float = 1e-6,
            norm_offset: float = 0.0, act: str | None = None,
            residual: jax.Array | None = None, rope: tuple[jax.Array, jax.Array] | None = None,
            head_dim: int | None = None, transposed: bool = False, interpret: bool = False,
            plan: StreamPlan | None = None, kv: KVWritePlan | None = None,
            kv_pages: tuple[jax.Array, jax.Array] | None = None,
            kv_slots: jax.Array | None = None,
            kv_scales: tuple[jax.Array | float, jax.Array | float] = (1.0, 1.0),
            out_dtype: jnp.dtype | None = None, ragged: bool = False
            ) -> list[jax.Array]:
    """One streaming launch over `segments`; one [M, N] output per segment (see `SLABS`),
    then, with `kv`, the K and V pages with those outputs written at `kv_slots` (in place).
    `transposed`: every weight is [N, K] (K contiguous) instead of [K, N]; a quantized one is
    then a table quantized along K (k_axis 1: int4 or int8). A weight may be a QuantWeight:
    ValueError when its format cannot be streamed (`unsupported`), never a wrong answer.
    `out_dtype` float32: the sums unrounded (no bias). `ragged`: one plain segment whose N
    need not be a multiple of block_n (its last column block masked)."""
    rows, k = x.shape
    kdim = 1 if transposed else 0
    k_axis = 1 if transposed else 0
    ns = [weight_shape(ws[0])[1] if isinstance(ws[0], QuantWeight) or not transposed
          else ws[0].shape[0] for _, ws, _ in segments]
    for _, ws, _ in segments:
        for w in ws:
            if isinstance(w, QuantWeight):
                if w.k_axis != k_axis or w.k != k or (transposed and w.kind == "fp8"):
                    raise ValueError(
                        f"quantized weight of {w.k} inputs (k_axis {w.k_axis}) does not take "
                        f"inputs of size {k} as "
                        + ("[N, K] (transposed=True takes float weights only, or int4 / int8 "
                           "tables quantized along K: k_axis 1)" if transposed else "[K, N]"))
            elif w.ndim != 2 or w.shape[kdim] != k:
                raise ValueError(f"weight {w.shape} does not take inputs of size {k}")
    f32_out = out_dtype is not None and jnp.dtype(out_dtype) == jnp.float32
    if out_dtype is not None and jnp.dtype(out_dtype) not in (jnp.dtype(x.dtype),
                                                              jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype {jnp.dtype(out_dtype)}: {x.dtype} or float32 only")
    if (ragged or f32_out) and (len(segments) != 1 or segments[0][0] != "plain" or kv
                                or residual is not None or segments[0][2][0] is not None):
        raise ValueError("float32 or ragged outputs take one plain segment without a bias, "
                         "residual or KV write (the output head)")
    kinds = tuple(kind for kind, _, _ in segments)
    # One format per slab the kernel streams (a RoPE segment's weight twice: its two halves).
    formats = tuple(tuple(weight_format(w) for w in (ws * 2 if kind == "rope" else ws))
                    for kind, ws, _ in segments)
    flat = [f for fs in formats for f in fs]
    quantized = any(f is not None for f in flat)
    if quantized:
        why = unsupported(rows, k, () if ragged else ns, x.dtype, flat)
        if why is not None:
            raise ValueError(f"these quantized weights cannot take the streaming kernels: {why}")
    plan = plan or plan_stream(rows, k, ns, x.dtype.itemsize,
                               weights_per_program=2 if "gated" in kinds else 1,
                               head_dim=head_dim if "rope" in kinds or kv else None,
                               formats=flat, ragged=ragged)
    if not ragged and any(n % plan.block_n for n in ns):
        raise ValueError(f"block_n {plan.block_n} does not divide the outputs {ns}")
    if quantized and not all(_fits(f, plan.block_k) for f in flat):
        raise ValueError(f"block_k {plan.block_k} does not suit these quantized weights "
                         f"({', '.join(sorted({f'{f.kind}/{f.group_size}' for f in flat if f}))})")
    bn = plan.block_n
    rope_pairs = 0
    if "rope" in kinds:
        half = head_dim // 2
        if rope is None or bn // 2 < 16 or half % (bn // 2):
            raise ValueError(f"RoPE in the epilogue needs the angle tables and half-slabs of "
                             f">= 16 columns dividing head_dim/2 = {half} (block_n {bn})")
        rope_pairs = half // (bn // 2)
    has_bias = any(b is not None for _, _, bs in segments for b in bs)
    front: list[jax.Array] = [x]
    if norm_weight is not None:
        front.append(norm_weight)
    if residual is not None:
        front.append(residual)
    if "rope" in kinds:
        front.extend(t.astype(jnp.float32) for t in rope)
    if kv is not None:
        if head_dim % bn and "rope" not in kinds:
            raise ValueError(f"a KV write needs column blocks within a head ({bn} vs {head_dim})")
        front.append(kv_slots.astype(jnp.int32))
        if kv.fp8:
            front.append(jnp.stack([jnp.asarray(kv_scales[0], jnp.float32),
                                    jnp.asarray(kv_scales[1], jnp.float32)]))
    # x, the norm weight, the residual and the angle tables whole (the kernel indexes their
    # rows); each weight and bias as the slab of the program's column block (clamped into its
    # segment: a program of another segment never reads it).
    specs = [pl.BlockSpec(a.shape, functools.partial(_origin, a.ndim)) for a in front]
    args = list(front)
    seg_blocks = tuple(cdiv(n, bn) for n in ns)  # (a ragged segment: its last block partial)
    lo = 0
    for nblk, (kind, ws, bs) in zip(seg_blocks, segments, strict=True):
        if kind == "rope":  # the weight twice: its first-half and second-half slabs
            w, b = ws[0], bs[0]
            width = bn // 2
            slab_cols = [functools.partial(_rope_slab, lo, nblk, rope_pairs, half)
                         for half in (0, 1)]
            ws, bs = [w, w], [b, b]
        else:
            width = bn
            slab_cols = [functools.partial(_slab_column, lo, nblk)] * len(ws)
        for w, col in zip(ws, slab_cols, strict=True):
            if isinstance(w, QuantWeight):  # its values, scales and mins: the same columns
                for a in (w.q, w.scales) + (() if w.mins is None else (w.mins,)):
                    args.append(a)
                    if transposed:  # [N, K along its packed values or its groups]
                        specs.append(pl.BlockSpec((width, a.shape[1]),
                                                  lambda i, j, col=col: (col(j), 0)))
                    else:
                        specs.append(pl.BlockSpec((a.shape[0], width),
                                                  lambda i, j, col=col: (0, col(j))))
                continue
            args.append(w)
            if transposed:
                specs.append(pl.BlockSpec((width, k), lambda i, j, col=col: (col(j), 0)))
            else:
                specs.append(pl.BlockSpec((k, width), lambda i, j, col=col: (0, col(j))))
        if has_bias:
            for w, b, col in zip(ws, bs, slab_cols, strict=True):
                n_out = weight_shape(w)[1] if isinstance(w, QuantWeight) else w.shape[1 - kdim]
                args.append(jnp.zeros((n_out,), x.dtype) if b is None else b)
                specs.append(pl.BlockSpec((width,), lambda i, j, col=col: (col(j),)))
        lo += nblk
    kernel = functools.partial(
        _stream_kernel, plan=plan, rows=rows, k=k, seg_blocks=seg_blocks, kinds=kinds,
        rope_pairs=rope_pairs, has_bias=has_bias, has_norm=norm_weight is not None,
        norm_offset=norm_offset, eps=norm_eps, act=act, has_residual=residual is not None,
        has_rope="rope" in kinds, transposed=transposed, kv=kv,
        formats=formats if quantized else (),
        n_valid=tuple(n if n % bn else None for n in ns) if ragged else (), f32_out=f32_out)
    out_specs = [pl.BlockSpec((rows, n), functools.partial(_origin, 2)) for n in ns]
    out_shape = [jax.ShapeDtypeStruct((rows, n), jnp.float32 if f32_out else x.dtype)
                 for n in ns]
    aliases = {}
    if kv is not None:
        # The pages as bits for bf16 / fp8 (as kv_write), whole, aliased in -> out: the launch
        # writes only the rows' slots.
        for pages in kv_pages:
            bits = to_bits(pages)
            aliases[len(args)] = len(out_shape)
            args.append(bits)
            specs.append(pl.BlockSpec(bits.shape, functools.partial(_origin, 4)))
            out_specs.append(pl.BlockSpec(bits.shape, functools.partial(_origin, 4)))
            out_shape.append(jax.ShapeDtypeStruct(bits.shape, bits.dtype))
    outs = pallas_call(
        kernel,
        grid=(cdiv(rows, plan.block_m), sum(seg_blocks)),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret, num_warps=plan.num_warps, num_stages=plan.num_stages,
        name=name,
    )(*args)
    outs = list(outs)
    if kv is not None:
        outs[-2:] = [from_bits(o, kv.page_dtype) for o in outs[-2:]]
    return outs


def _rope_slab(lo: int, nblk: int, pairs: int, half: int, j: jax.Array) -> jax.Array:
    """The half-width slab (in units of block_n / 2) that program column `j` of a RoPE segment
    reads: its first-half columns (`half` 0) or its second-half ones (1)."""
    jj = jnp.clip(j - lo, 0, nblk - 1)
    return (jj // pairs) * (2 * pairs) + jj % pairs + half * pairs


def _origin(ndim: int, *_: jax.Array) -> tuple[int, ...]:
    """The block index of a whole-array BlockSpec."""
    return (0,) * ndim


def _slab_column(lo: int, nblk: int, j: jax.Array) -> jax.Array:
    """The column block of a segment's weight that program column `j` reads (clamped)."""
    return jnp.clip(j - lo, 0, nblk - 1)


def projections(x: Float[Array, "M K"], weights: Sequence[Weight],
                biases: Sequence[jax.Array | None] | None = None, *,
                norm_weight: jax.Array | None = None, norm_eps: float = 1e-6,
                norm_offset: float = 0.0, rope: tuple[jax.Array, jax.Array] | None = None,
                rope_outputs: int = 0, head_dim: int | None = None, transposed: bool = False,
                kv_pages: tuple[jax.Array, jax.Array] | None = None,
                kv_slots: jax.Array | None = None,
                kv_scales: tuple[jax.Array | float, jax.Array | float] = (1.0, 1.0),
                interpret: bool = False,
                plan: StreamPlan | None = None) -> list[jax.Array]:
    """[norm(x) @ w (+ b) for w in weights], one launch (q/k/v): [M, N_w] each, x's dtype.

    `rope` (cos, sin), each [M, head_dim / 2]: the first `rope_outputs` outputs (q and k) are
    rotated by RoPE (rotate-half pairs within each head of `head_dim`) in the epilogue.
    `kv_pages` (K and V pages, [blocks, block_size, kv_heads, head_dim]): outputs 1 and 2 (k
    and v, after RoPE) are also written at `kv_slots` [M] (< 0 writes nothing; a layer's
    region of a shared pool is in the slots) as `kv_write` writes them (fp8 pages quantized
    by `kv_scales`), in place; the updated pages follow the outputs. `transposed`: the
    weights are [N, K]. A weight may be a QuantWeight ([K, N], models/quant.py).
    """
    biases = list(biases) if biases is not None else [None] * len(weights)
    segs = [("rope" if n < rope_outputs else "plain", [w], [b])
            for n, (w, b) in enumerate(zip(weights, biases, strict=True))]
    kv = None
    if kv_pages is not None:
        if len(weights) < 3 or head_dim is None or kv_slots is None:
            raise ValueError("a KV write takes q, k, v weights, head_dim and the slots")
        kv = KVWritePlan((1, 2), head_dim, jnp.dtype(kv_pages[0].dtype))
    return _launch(x, segs, name="decode_matmul_proj", norm_weight=norm_weight,
                   norm_eps=norm_eps, norm_offset=norm_offset, rope=rope, head_dim=head_dim,
                   transposed=transposed, interpret=interpret, plan=plan, kv=kv,
                   kv_pages=kv_pages, kv_slots=kv_slots, kv_scales=kv_scales)


def gated_up(x: Float[Array, "M K"], w_gate: Weight, w_up: Weight,
             b_gate: jax.Array | None = None, b_up: jax.Array | None = None, *,
             act: str = "silu", norm_weight: jax.Array | None = None, norm_eps: float = 1e-6,
             norm_offset: float = 0.0, transposed: bool = False, interpret: bool = False,
             plan: StreamPlan | None = None) -> Float[Array, "M N"]:
    """act(norm(x) @ w_gate (+ b)) * (norm(x) @ w_up (+ b)) in one launch."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not one of {ACTIVATIONS}")
    if weight_shape(w_gate) != weight_shape(w_up):
        raise ValueError(f"gate {weight_shape(w_gate)} and up {weight_shape(w_up)} weights "
                         "differ in shape")
    (out,) = _launch(x, [("gated", [w_gate, w_up], [b_gate, b_up])], name="decode_matmul_gate_up",
                     norm_weight=norm_weight, norm_eps=norm_eps, norm_offset=norm_offset,
                     act=act, transposed=transposed, interpret=interpret, plan=plan)
    return out


def projection_residual(x: Float[Array, "M K"], w: Weight,
                        residual: Float[Array, "M N"], b: jax.Array | None = None, *,
                        transposed: bool = False, interpret: bool = False,
                        plan: StreamPlan | None = None) -> Float[Array, "M N"]:
    """residual + (x @ w (+ b)) in one launch (o and down projections)."""
    n = weight_shape(w)[1] if isinstance(w, QuantWeight) or not transposed else w.shape[0]
    if residual.shape != (x.shape[0], n):
        raise ValueError(f"residual {residual.shape} is not [{x.shape[0]}, {n}]")
    (out,) = _launch(x, [("plain", [w], [b])], name="decode_matmul_residual",
                     residual=residual.astype(x.dtype), transposed=transposed,
                     interpret=interpret, plan=plan)
    return out


def logits_unsupported(k: int, n: int, dtype: jnp.dtype, fmt: QuantFormat | None = None,
                       transposed: bool = False) -> str | None:
    """Why an output head of `k` inputs and `n` outputs (any n: a ragged last block is masked)
    cannot take `logits`, or None if it can. `dtype`: the head's (float) or, quantized
    (`fmt`), the model's; `transposed`: a tied [n, k] table (quantized: int4 or int8)."""
    if n < 1:
        return "no outputs"
    if fmt is not None and transposed and fmt.kind not in ("int4", "int8"):
        return f"a {fmt.kind} embedding table (the kernels read int4 or int8 tables)"
    return unsupported(1, k, (), dtype, () if fmt is None else (fmt,))


def logits(x: Float[Array, "M K"], w: Weight, *, transposed: bool = False,
           interpret: bool = False, plan: StreamPlan | None = None) -> Float[Array, "M N"]:
    """x @ w as float32 logits [M, N] in one launch (the output head), unrounded.

    `w`: lm_head's [K, N] kernel (float or a [K, N] QuantWeight), or with `transposed` a tied
    embedding table [N, K] (float, or a QuantEmbed's int4 / int8 [N, K] QuantWeight). N may be
    any size: the plan's block_n need not divide it, and the last column block's loads and
    stores past N are masked (the weight is neither padded nor copied). A float weight's
    product takes x in the weight's dtype, as the XLA head does; a quantized one's x in the
    model's dtype (the dtype it dequantizes to)."""
    if not isinstance(w, QuantWeight):
        x = x.astype(w.dtype)
    (out,) = _launch(x, [("plain", [w], [None])], name="decode_matmul_logits",
                     transposed=transposed, interpret=interpret, plan=plan,
                     out_dtype=jnp.float32, ragged=True)
    return out
