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
* `projection_residual` — o or down: the residual add in the epilogue.

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
* `transposed=True` takes [N, K] weights instead (K contiguous); the models do not use it, the
  device check times both layouts.

`unsupported` says why a shape cannot take these kernels (the caller falls back to XLA's GEMMs
and logs it once); `pallas_kernels/reference.py` has the jnp twins the kernels are tested
against.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float

from jpaged.intmath import cdiv
from pallas_kernels._compat import next_pow2, pallas_call
from pallas_kernels.kv_write import quantize
from pallas_kernels.reference import from_bits, is_fp8, to_bits

# An H200 has 132 SMs: below this many programs a launch leaves SMs idle.
_MIN_PROGRAMS = 264
# Bytes of one weight tile ([block_k, block_n]) a pipeline stage holds in shared memory.
_TILE_BYTES = 16 * 1024
_MAX_BLOCK_M = 64
ACTIVATIONS = ("silu", "gelu_tanh")


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


def unsupported(rows: int, k: int, ns: Sequence[int], dtype: jnp.dtype) -> str | None:
    """Why these shapes cannot take the streaming kernels, or None if they can."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                jnp.dtype(jnp.float32)):
        return f"weight dtype {jnp.dtype(dtype).name} (bf16, f16 or f32 only)"
    if _pow2_divisor(k, 256) < 16:
        return f"input size {k} has no power-of-two tile >= 16 dividing it"
    for n in ns:
        if _pow2_divisor(n, 128) < 16:
            return f"output size {n} has no power-of-two tile >= 16 dividing it"
    if rows < 1:
        return "no rows"
    return None


def rope_fits(head_dim: int, ns: Sequence[int]) -> bool:
    """Whether q/k of this head size (outputs of sizes `ns`) can take RoPE in the epilogue:
    each column block must split into two half-slabs of >= 16 columns within a half head."""
    half_slab = min(_pow2_divisor(head_dim // 2, 64), *(_pow2_divisor(n, 128) // 2 for n in ns))
    return head_dim % 2 == 0 and half_slab >= 16


def plan_stream(rows: int, k: int, ns: Sequence[int], itemsize: int,
                block_n: int | None = None, block_k: int | None = None,
                weights_per_program: int = 1, head_dim: int | None = None) -> StreamPlan:
    """Tiles for `rows` rows against weights [k, n] for n in `ns` (see `unsupported` first).

    block_n: the widest power of two <= 128 dividing every n, halved (down to 32) while the
    launch would have fewer than `_MIN_PROGRAMS` programs; block_k: as many rows as keep the
    weight tiles of one pipeline stage (`weights_per_program` of them: 2 for gate and up)
    within `_TILE_BYTES`, dividing k. `head_dim` (RoPE in the epilogue): block_n at most
    twice the widest power of two dividing head_dim / 2, so a block's two half-slabs pair up.
    """
    bm = max(16, min(_MAX_BLOCK_M, next_pow2(rows)))
    row_blocks = cdiv(rows, bm)
    if block_n is None:
        block_n = min(_pow2_divisor(n, 128) for n in ns)
        if head_dim is not None:
            block_n = min(block_n, 2 * _pow2_divisor(head_dim // 2, 64))
        while block_n > 32 and row_blocks * sum(n // block_n for n in ns) < _MIN_PROGRAMS:
            block_n //= 2
    if block_k is None:
        block_k = _pow2_divisor(
            k, max(16, _TILE_BYTES // (block_n * itemsize * weights_per_program)))
    if any(n % block_n for n in ns) or k % block_k:
        raise ValueError(f"tiles ({block_k}, {block_n}) do not divide k={k}, n={list(ns)}")
    return StreamPlan(bm, block_n, block_k)


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
                   has_rope: bool, transposed: bool, kv: KVWritePlan | None) -> None:
    """One (row block, column block): stream the slab(s) of the segment the column block falls
    in (`kinds`) and write its [block_m, block_n] output tile (and, for the K and V segments
    of `kv`, the same values into the pages at the rows' slots).

    refs: x, [norm weight], [residual], [cos, sin], [slots, [fp8 scales]], per segment its
    slabs then [their biases], [K and V pages in]; then one output per segment, [K and V pages
    out (aliases of the pages in)]."""
    bm, bn, bk = plan.block_m, plan.block_n, plan.block_k
    it = iter(refs)
    x_ref = next(it)
    g_ref = next(it) if has_norm else None
    res_ref = next(it) if has_residual else None
    cos_ref, sin_ref = (next(it), next(it)) if has_rope else (None, None)
    slot_ref = next(it) if kv is not None else None
    kvs_ref = next(it) if kv is not None and kv.fp8 else None
    segs = []
    for kind in kinds:
        ws = [next(it) for _ in range(SLABS[kind])]
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

    def store(out_ref, col0: jax.Array, width: int, y: jax.Array, page: int | None) -> None:
        plt.store(out_ref.at[rows_at, pl.ds(col0, width)], y.astype(out_ref.dtype),
                  mask=live[:, None])
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
        def _segment(ws=ws, bs=bs, kind=kind, out_ref=out_ref, lo=lo, page=page) -> None:
            jj = j - lo  # the column block within the segment; weights come as its slabs
            width = bn // len(ws) if kind == "rope" else bn

            def body(kk, accs):
                xt = operand(kk)
                ks = pl.ds(kk * bk, bk)
                return tuple(a + (_dot(xt, w[:, ks], trans_b=True) if transposed
                                  else _dot(xt, w[ks, :]))
                             for a, w in zip(accs, ws, strict=True))

            zero = jnp.zeros((bm, width), jnp.float32)
            accs = lax.fori_loop(0, steps, body, (zero,) * len(ws))
            # Rounded to the model dtype, then the bias added in it: the XLA path's order.
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
            store(out_ref, jj * bn, bn, y.astype(dtype), page)


def _rope_columns(jj: jax.Array, pairs: int, width: int) -> tuple[jax.Array, jax.Array]:
    """For column block `jj` of a RoPE segment (each head: `pairs` blocks of `width` pairs):
    its first column within the half head (the angle tables' column) and the output column of
    its first half; the second half lies `pairs * width` further on."""
    head, c = jj // pairs, jj % pairs
    return c * width, head * (2 * pairs * width) + c * width


Segment = tuple[str, Sequence[jax.Array], Sequence[jax.Array | None]]  # kind, weights, biases


def _launch(x: jax.Array, segments: Sequence[Segment], *, name: str,
            norm_weight: jax.Array | None = None, norm_eps: float = 1e-6,
            norm_offset: float = 0.0, act: str | None = None,
            residual: jax.Array | None = None, rope: tuple[jax.Array, jax.Array] | None = None,
            head_dim: int | None = None, transposed: bool = False, interpret: bool = False,
            plan: StreamPlan | None = None, kv: KVWritePlan | None = None,
            kv_pages: tuple[jax.Array, jax.Array] | None = None,
            kv_slots: jax.Array | None = None,
            kv_scales: tuple[jax.Array | float, jax.Array | float] = (1.0, 1.0)
            ) -> list[jax.Array]:
    """One streaming launch over `segments`; one [M, N] output per segment (see `SLABS`),
    then, with `kv`, the K and V pages with those outputs written at `kv_slots` (in place).
    `transposed`: every weight is [N, K] (K contiguous) instead of [K, N]."""
    rows, k = x.shape
    kdim = 1 if transposed else 0
    ns = [ws[0].shape[1 - kdim] for _, ws, _ in segments]
    for _, ws, _ in segments:
        for w in ws:
            if w.ndim != 2 or w.shape[kdim] != k:
                raise ValueError(f"weight {w.shape} does not take inputs of size {k}")
    kinds = tuple(kind for kind, _, _ in segments)
    plan = plan or plan_stream(rows, k, ns, x.dtype.itemsize,
                               weights_per_program=2 if "gated" in kinds else 1,
                               head_dim=head_dim if "rope" in kinds or kv else None)
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
    seg_blocks = tuple(n // bn for n in ns)
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
            args.append(w)
            if transposed:
                specs.append(pl.BlockSpec((width, k), lambda i, j, col=col: (col(j), 0)))
            else:
                specs.append(pl.BlockSpec((k, width), lambda i, j, col=col: (0, col(j))))
        if has_bias:
            for w, b, col in zip(ws, bs, slab_cols, strict=True):
                args.append(jnp.zeros((w.shape[1 - kdim],), x.dtype) if b is None else b)
                specs.append(pl.BlockSpec((width,), lambda i, j, col=col: (col(j),)))
        lo += nblk
    kernel = functools.partial(
        _stream_kernel, plan=plan, rows=rows, k=k, seg_blocks=seg_blocks, kinds=kinds,
        rope_pairs=rope_pairs, has_bias=has_bias, has_norm=norm_weight is not None,
        norm_offset=norm_offset, eps=norm_eps, act=act, has_residual=residual is not None,
        has_rope="rope" in kinds, transposed=transposed, kv=kv)
    out_specs = [pl.BlockSpec((rows, n), functools.partial(_origin, 2)) for n in ns]
    out_shape = [jax.ShapeDtypeStruct((rows, n), x.dtype) for n in ns]
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


def projections(x: Float[Array, "M K"], weights: Sequence[Float[Array, "K N"]],
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
    weights are [N, K].
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


def gated_up(x: Float[Array, "M K"], w_gate: Float[Array, "K N"], w_up: Float[Array, "K N"],
             b_gate: jax.Array | None = None, b_up: jax.Array | None = None, *,
             act: str = "silu", norm_weight: jax.Array | None = None, norm_eps: float = 1e-6,
             norm_offset: float = 0.0, transposed: bool = False, interpret: bool = False,
             plan: StreamPlan | None = None) -> Float[Array, "M N"]:
    """act(norm(x) @ w_gate (+ b)) * (norm(x) @ w_up (+ b)) in one launch."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not one of {ACTIVATIONS}")
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gate {w_gate.shape} and up {w_up.shape} weights differ in shape")
    (out,) = _launch(x, [("gated", [w_gate, w_up], [b_gate, b_up])], name="decode_matmul_gate_up",
                     norm_weight=norm_weight, norm_eps=norm_eps, norm_offset=norm_offset,
                     act=act, transposed=transposed, interpret=interpret, plan=plan)
    return out


def projection_residual(x: Float[Array, "M K"], w: Float[Array, "K N"],
                        residual: Float[Array, "M N"], b: jax.Array | None = None, *,
                        transposed: bool = False, interpret: bool = False,
                        plan: StreamPlan | None = None) -> Float[Array, "M N"]:
    """residual + (x @ w (+ b)) in one launch (o and down projections)."""
    n = w.shape[0 if transposed else 1]
    if residual.shape != (x.shape[0], n):
        raise ValueError(f"residual {residual.shape} is not [{x.shape[0]}, {n}]")
    (out,) = _launch(x, [("plain", [w], [b])], name="decode_matmul_residual",
                     residual=residual.astype(x.dtype), transposed=transposed,
                     interpret=interpret, plan=plan)
    return out
