"""Quantized weights kept quantized on the device: the formats, their host conversions and the
jnp math every path shares.

One device form covers every supported source (docs/kernels.md, "Quantized weights"):

  int4  q uint8, two 4-bit values a byte; w = q * scale + min      (scale, min per group)
  int8  q int8;                           w = q * scale (+ min)    (scale, min per group)
  fp8   q float8_e4m3fn;                  w = q * scale            (scale per output channel)

A linear's weight is laid out as the model's nnx kernel, [K, N] (input features first), with its
groups of `group_size` consecutive input rows: `scales` (and `mins`) are [K / group_size, N].
An embedding table keeps the vocabulary first, [V, K], its groups along K (the contraction of
the tied output head), `scales` [V, K / group_size]. int4 pairs the two halves of a group in one
byte: in the packed group, byte r holds element r in its low nibble and element r + group/2 in
its high nibble (GGUF's Q4_0/Q4_1 block order), so a group unpacks on its own. Invariants:
group_size divides K and is even; int4 always carries `mins` (symmetric sources fold their
offset into it: Q4_0's -8 * d, GPTQ's -zero * scale); int4 values are 0..15, int8 -128..127.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

KINDS = ("int4", "int8", "fp8")
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
# Elements of one dequantized slab on XLA:CPU: the matmul walks the weight in slabs this size
# (a few MiB of float32) so no temporary is the size of the weight.
CPU_SLAB_ELEMENTS = 1 << 20


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "scales", "mins"],
                   meta_fields=["kind", "k_axis"])
@dataclass(frozen=True)
class QuantWeight:
    """A quantized matrix as host (numpy) or device arrays; `k_axis`: 0 for a linear's [K, N]
    kernel, 1 for an embedding's [V, K] table or a layer's stacked experts [E, K, N]
    (scales and mins [E, K / group_size, N])."""

    kind: str
    q: np.ndarray | jax.Array
    scales: np.ndarray | jax.Array
    mins: np.ndarray | jax.Array | None
    k_axis: int = 0

    @property
    def k(self) -> int:
        """Input features (the contracted axis), unpacked."""
        n = self.q.shape[self.k_axis]
        return 2 * n if self.kind == "int4" else n

    @property
    def group_size(self) -> int:
        """Consecutive input rows sharing one scale (K for a per-channel scale)."""
        return self.k // self.scales.shape[self.k_axis]

    @property
    def nbytes(self) -> int:
        """Bytes of every array."""
        arrays = [self.q, self.scales] + ([] if self.mins is None else [self.mins])
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in arrays)

    def check(self, name: str) -> None:
        """Raise ValueError naming `name` when the arrays do not form a valid weight."""
        if self.kind not in KINDS:
            raise ValueError(f"{name}: unknown quantized kind {self.kind!r}; known: {KINDS}")
        want = {"int4": np.uint8, "int8": np.int8, "fp8": ml_dtypes.float8_e4m3fn}[self.kind]
        if np.dtype(self.q.dtype) != np.dtype(want):
            raise ValueError(f"{name}: {self.kind} values must be {np.dtype(want)}, "
                             f"got {np.dtype(self.q.dtype)}")
        stacked = self.q.ndim == 3 and self.k_axis == 1  # [E, K, N] experts
        if not stacked and (self.q.ndim != 2 or self.scales.ndim != 2):
            raise ValueError(f"{name}: values and scales must be 2-D, got {self.q.shape} and "
                             f"{self.scales.shape}")
        if stacked and self.scales.ndim != 3:
            raise ValueError(f"{name}: stacked experts' scales must be [experts, groups, "
                             f"out], got {tuple(self.scales.shape)}")
        others = (0, 2) if stacked else (1 - self.k_axis,)
        groups = self.scales.shape[self.k_axis]
        if any(self.scales.shape[o] != self.q.shape[o] for o in others) or groups < 1 \
                or self.k % groups:
            raise ValueError(f"{name}: scales of shape {tuple(self.scales.shape)} do not fit "
                             f"values of shape {tuple(self.q.shape)} ({self.k} input features)")
        if self.kind == "int4" and (self.group_size % 2 or self.mins is None):
            raise ValueError(f"{name}: int4 needs an even group size and mins")
        if self.mins is not None and tuple(self.mins.shape) != tuple(self.scales.shape):
            raise ValueError(f"{name}: mins of shape {tuple(self.mins.shape)} != scales "
                             f"{tuple(self.scales.shape)}")


# ---------------------------------------------------------------------------------------------
# Host side: packing, quantizing, dequantizing (numpy)


def pack_int4(values: np.ndarray, group_size: int, k_axis: int = 0) -> np.ndarray:
    """uint8 values 0..15 along `k_axis` -> bytes, two a byte (low: r, high: r + group/2)."""
    v = np.moveaxis(np.asarray(values, np.uint8), k_axis, -1)
    g = v.reshape(*v.shape[:-1], v.shape[-1] // group_size, 2, group_size // 2)
    packed = (g[..., 0, :] | (g[..., 1, :] << 4)).reshape(*v.shape[:-1], v.shape[-1] // 2)
    return np.ascontiguousarray(np.moveaxis(packed, -1, k_axis))


def unpack_int4_np(packed: np.ndarray, group_size: int, k_axis: int = 0) -> np.ndarray:
    """Inverse of `pack_int4`."""
    p = np.moveaxis(np.asarray(packed, np.uint8), k_axis, -1)
    g = p.reshape(*p.shape[:-1], -1, group_size // 2)
    v = np.stack([g & 15, g >> 4], axis=-2).reshape(*p.shape[:-1], 2 * p.shape[-1])
    return np.moveaxis(v, -1, k_axis)


def _expand(a: np.ndarray, group_size: int, k_axis: int) -> np.ndarray:
    return np.repeat(a.astype(np.float32), group_size, axis=k_axis)


def dequantize_np(w: QuantWeight) -> np.ndarray:
    """The float32 matrix a host QuantWeight stands for."""
    q = unpack_int4_np(w.q, w.group_size, w.k_axis) if w.kind == "int4" else w.q
    out = q.astype(np.float32) * _expand(np.asarray(w.scales), w.group_size, w.k_axis)
    if w.mins is not None:
        out += _expand(np.asarray(w.mins), w.group_size, w.k_axis)
    return out


def narrow_scales(a: np.ndarray) -> np.ndarray:
    """float16 when every value survives the cast exactly, else float32 (lossless either way)."""
    a = np.asarray(a, np.float32)
    half = a.astype(np.float16)
    return half if np.array_equal(half.astype(np.float32), a) else a


# The fp8 scale of a channel is searched, without data: candidates absmax / 448 * 2^(i / n),
# i = 0 .. n - 1, span one octave, which holds every alignment of e4m3's grid to the channel's
# values (doubling a scale moves every value one binade: the same relative grid); the candidate
# with the least squared error over the channel wins, ties to the smaller. i = 0 is plain absmax
# scaling, so no channel's error is larger than absmax's. A channel's error is dominated by its
# few largest weights, and where they land between two e4m3 values depends on the scale.
FP8_SCALE_CANDIDATES = 16
# Elements of one [K, columns] block searched at a time (a few MiB of float32 on the device).
FP8_SEARCH_ELEMENTS = 1 << 22


@functools.partial(jax.jit, static_argnums=1)
def _fp8_search(w: jax.Array, candidates: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """w [K, C] float32 -> (q [K, C] e4m3, scales [1, C], finite [C]: the column holds no NaN
    or inf), each column's scale searched."""
    amax = jnp.max(jnp.abs(w), axis=0, keepdims=True)
    base = jnp.where(amax > 0, amax / FP8_MAX, 1.0)

    def values(s: jax.Array) -> jax.Array:
        # (clipped: a division that rounds up past 448 must not become e4m3fn's NaN)
        return jnp.clip(w / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)

    def body(i: jax.Array, best: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        err, scale = best
        s = base * jnp.exp2(i.astype(jnp.float32) / candidates)
        e = jnp.sum(jnp.square(values(s).astype(jnp.float32) * s - w), axis=0, keepdims=True)
        return jnp.where(e < err, e, err), jnp.where(e < err, s, scale)

    _, scales = jax.lax.fori_loop(0, candidates, body, (jnp.full_like(base, jnp.inf), base))
    return values(scales), scales, jnp.all(jnp.isfinite(w), axis=0)


def quantize_fp8(w: np.ndarray, k_axis: int = 0, candidates: int = FP8_SCALE_CANDIDATES
                 ) -> QuantWeight:
    """Per-output-channel fp8_e4m3 of a float matrix, each channel's scale the one of
    `candidates` in [absmax / 448, 2 * absmax / 448) with the least squared error (1: absmax).
    Runs on the default device, a block of whole channels at a time."""
    if candidates < 1:
        raise ValueError(f"fp8 scale candidates must be >= 1, got {candidates}")
    w = np.moveaxis(np.asarray(w, np.float32), k_axis, 0)  # [K, N]: channels are columns
    k, n = w.shape
    width = max(1, min(n, FP8_SEARCH_ELEMENTS // max(k, 1)))
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    scales = np.empty((1, n), np.float32)
    finite = np.empty(n, bool)
    for c0 in range(0, n, width):
        block = w[:, c0:c0 + width]
        cols = block.shape[1]
        if cols < width:  # one program for every block: pad with zero channels (scale 1)
            block = np.pad(block, ((0, 0), (0, width - cols)))
        bq, bs, ok = _fp8_search(jnp.asarray(block), candidates)
        q[:, c0:c0 + cols] = np.asarray(bq)[:, :cols]
        scales[:, c0:c0 + cols] = np.asarray(bs)[:, :cols]
        finite[c0:c0 + cols] = np.asarray(ok)[:cols]
    bad = ~finite
    if bad.any():
        raise ValueError(f"weight holds NaN or inf values in {int(bad.sum())} of its {n} output "
                         f"channels (first: channel {int(np.argmax(bad))}); fp8 cannot scale "
                         f"them")
    return QuantWeight("fp8", np.moveaxis(q, 0, k_axis), np.moveaxis(scales, 0, k_axis),
                       None, k_axis)


# ---------------------------------------------------------------------------------------------
# Device side (jnp): every model path and the kernels' references


def unpack_int4(packed: jax.Array, group_size: int, k_axis: int = 0) -> jax.Array:
    """jnp twin of `unpack_int4_np` (uint8 values 0..15)."""
    p = jnp.moveaxis(packed, k_axis, -1)
    g = p.reshape(*p.shape[:-1], -1, group_size // 2)
    v = jnp.stack([g & 15, g >> 4], axis=-2).reshape(*p.shape[:-1], 2 * p.shape[-1])
    return jnp.moveaxis(v, -1, k_axis)


def dequantize(q: jax.Array, scales: jax.Array, mins: jax.Array | None, kind: str,
               dtype: jnp.dtype, k_axis: int = 0) -> jax.Array:
    """The matrix in `dtype` (computed in float32, then cast once)."""
    groups = scales.shape[k_axis]
    k = q.shape[k_axis] * (2 if kind == "int4" else 1)
    gs = k // groups
    vals = unpack_int4(q, gs, k_axis) if kind == "int4" else q
    vals = vals.astype(jnp.float32)
    shape = list(vals.shape)
    grouped = shape[:k_axis] + [groups, gs] + shape[k_axis + 1:]
    g_axis = k_axis + 1  # the within-group axis of `grouped`
    out = vals.reshape(grouped) * jnp.expand_dims(scales.astype(jnp.float32), g_axis)
    if mins is not None:
        out = out + jnp.expand_dims(mins.astype(jnp.float32), g_axis)
    return out.reshape(shape).astype(dtype)


def _slabs(groups: int, elements: int) -> int:
    """How many equal slabs of whole groups keep each under CPU_SLAB_ELEMENTS (a divisor of
    `groups`; 1 when the matrix is small)."""
    if elements <= CPU_SLAB_ELEMENTS:
        return 1
    want = -(-elements // CPU_SLAB_ELEMENTS)
    for n in range(want, groups + 1):
        if groups % n == 0:
            return n
    return groups


def _e4m3_over_256(b: jax.Array) -> jax.Array:
    """float8_e4m3fn bytes -> float16 values 2^-8 times theirs, exactly, by moving bits: e4m3's
    sign, 4 exponent and 3 mantissa bits land in float16's sign, the low 4 of its 5 exponent
    bits and its top 3 mantissa bits; the biases (7 and 15) differ by 8, subnormals included
    (finite values only: e4m3fn's NaN reads as 480). On XLA:CPU a projection's matmul runs
    10-25% faster through float16 than through the fp8 conversion."""
    h = b.astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(((h & 0x80) << 8) | ((h & 0x7F) << 7), jnp.float16)


def _chunked_matmul(x: jax.Array, q: jax.Array, scales: jax.Array, mins: jax.Array | None,
                    kind: str, dtype: jnp.dtype, precision: jax.lax.Precision | None
                    ) -> jax.Array:
    """x @ W for a [K, N] weight, dequantizing it a slab of K rows at a time (accumulated in
    float32): the temporaries stay a slab, whatever the weight's size. Integer slabs hold whole
    groups; fp8's one scale row multiplies the sum."""
    fp8, fp8_dtype = kind == "fp8", q.dtype
    e4m3 = fp8 and fp8_dtype == jnp.float8_e4m3fn  # read through float16, 2^-8 times its values
    rows, n = q.shape
    k = rows * (2 if kind == "int4" else 1)
    # Slab boundaries: any K row for fp8 (its scale is per column), else whole groups.
    units = k if fp8 else scales.shape[0]
    slabs = _slabs(units, k * n)

    def part(xi: jax.Array, qi: jax.Array, si: jax.Array, mi: jax.Array | None) -> jax.Array:
        if e4m3:
            w = _e4m3_over_256(qi).astype(dtype)
        elif fp8:
            w = jax.lax.bitcast_convert_type(qi, fp8_dtype).astype(dtype)
        else:
            w = dequantize(qi, si, mi, kind, dtype)
        return jnp.dot(xi, w, precision=precision, preferred_element_type=jnp.float32)

    x = x.astype(dtype)
    if fp8:
        # Sliced as bytes: XLA:CPU widens a whole fp8 array to float16 before slicing it. It
        # still copies the bytes once for the loop (the fp8 weight's own size, a quarter of the
        # float32 copy that converting it whole would make).
        q = jax.lax.bitcast_convert_type(q, jnp.uint8)
    if slabs == 1:
        acc = part(x, q, scales, mins)
    else:
        xs = x.reshape(x.shape[0], slabs, -1).swapaxes(0, 1)
        qs = q.reshape(slabs, -1, n)
        ss = None if fp8 else scales.reshape(slabs, -1, n)
        ms = None if mins is None else mins.reshape(slabs, -1, n)

        def body(acc: jax.Array, p: tuple) -> tuple[jax.Array, None]:
            return acc + part(*p), None

        acc, _ = jax.lax.scan(body, jnp.zeros((x.shape[0], n), jnp.float32), (xs, qs, ss, ms))
    if not fp8:
        return acc
    return acc * (scales.astype(jnp.float32)[0] * (256.0 if e4m3 else 1.0))


def quant_matmul(x: jax.Array, q: jax.Array, scales: jax.Array, mins: jax.Array | None,
                 kind: str, dtype: jnp.dtype, precision: jax.lax.Precision | None = None
                 ) -> jax.Array:
    """x [T, K] @ W [K, N] of a quantized weight, float32 out.

    On XLA:CPU every kind is dequantized a slab at a time (`_chunked_matmul`). Elsewhere fp8's
    per-channel scale multiplies the product (x @ q, then * scale: the GEMM reads the fp8
    bytes, and XLA:GPU fuses the convert into it), and integer groups dequantize whole for XLA
    to fuse into its GEMM (the decode kernels read the packed bytes themselves:
    pallas_kernels/decode_matmul.py).
    """
    def plain(x: jax.Array) -> jax.Array:
        if kind == "fp8":
            y = jnp.dot(x.astype(dtype), q.astype(dtype), precision=precision,
                        preferred_element_type=jnp.float32)
            return y * scales.astype(jnp.float32)[0]
        w = dequantize(q, scales, mins, kind, dtype)
        return jnp.dot(x.astype(dtype), w, precision=precision,
                       preferred_element_type=jnp.float32)

    return jax.lax.platform_dependent(
        x, cpu=lambda x: _chunked_matmul(x, q, scales, mins, kind, dtype, precision),
        default=plain)


def quant_rows(q: jax.Array, scales: jax.Array, mins: jax.Array | None, kind: str,
               ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows `ids` of a [V, K] quantized table, dequantized (only the rows gathered)."""
    return dequantize(q[ids], scales[ids], None if mins is None else mins[ids], kind, dtype,
                      k_axis=1)


def quant_logits(h: jax.Array, q: jax.Array, scales: jax.Array, mins: jax.Array | None,
                 kind: str, dtype: jnp.dtype, precision: jax.lax.Precision | None = None
                 ) -> jax.Array:
    """h [T, K] against every row of a [V, K] quantized table: [T, V] float32 (the tied
    output head), a slab of rows at a time so no temporary is the table's size."""
    v, groups = scales.shape
    k = q.shape[1] * (2 if kind == "int4" else 1)
    slabs = _slabs(v, v * k)

    def part(qi: jax.Array, si: jax.Array, mi: jax.Array | None) -> jax.Array:
        w = dequantize(qi, si, mi, kind, dtype, k_axis=1)
        return jnp.einsum("tk,vk->tv", h.astype(dtype), w, precision=precision,
                          preferred_element_type=jnp.float32)

    if slabs == 1:
        return part(q, scales, mins)
    qs, ss = q.reshape(slabs, -1, q.shape[1]), scales.reshape(slabs, -1, groups)
    ms = None if mins is None else mins.reshape(slabs, -1, groups)
    out = jax.lax.map(lambda a: part(*a), (qs, ss, ms))  # [slabs, T, V / slabs]
    return out.swapaxes(0, 1).reshape(h.shape[0], v)
