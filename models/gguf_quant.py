"""GGUF block formats -> jpaged's quantized device form (models/quant.py), losslessly.

Each decoder reads a tensor's raw blocks ([rows, bytes]) and returns its integer values
[rows, K], with a scale (and a min) per group of consecutive values of a row, such that
value * scale + min equals llama.cpp's dequantization exactly in float32:

  Q8_0  32: d * q                   -> int8, group 32
  Q5_0  32: d * (q - 16)            -> int8, group 32
  Q5_1  32: d * q + m               -> int8 + min, group 32
  Q4_0  32: d * (q - 8)             -> int4, min -8d, group 32
  Q4_1  32: d * q + m               -> int4 + min, group 32
  Q4_K 256: d*sc_j * q - dmin*m_j   -> int4 + min, group 32 (super-block scales folded in)
  Q5_K 256: d*sc_j * q - dmin*m_j   -> int8 + min, group 32
  Q6_K 256: d*sc_j * (q - 32)       -> int8, group 16

The products d * sc are exact in float32 (an f16 times a 6- or 8-bit integer); scales stay
float16 where every one of them is (Q8_0, Q4_1, ...), else float32. Layouts follow ggml's
dequantize_row_* (ggml-quants.c).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import gguf
import numpy as np

from .quant import QuantWeight, pack_int4
from .quant_layers import QuantLayout

Q = gguf.GGMLQuantizationType


class Decoded(NamedTuple):
    """Integer values [rows, K], scales and mins (or None) [rows, K / group], and the kind."""

    kind: str
    values: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block, as float32 [rows, nblocks, 1]."""
    return blocks[..., at:at + 2].copy().view(np.float16).astype(np.float32)


def _blocks(raw: np.ndarray, qtype: Q) -> np.ndarray:
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    return raw.reshape(raw.shape[0], -1, size)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: low nibbles first, then high (Q4_0/Q4_1/Q5_x order)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _fifth_bits(b: np.ndarray, at: int) -> np.ndarray:
    """Q5_0/Q5_1's 32 high bits (a uint32 at `at`) as 0/16 per value."""
    qh = b[..., at:at + 4].copy().view("<u4")  # [rows, nb, 1]
    return (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _rows(x: np.ndarray) -> np.ndarray:
    """[rows, nblocks, per block] -> [rows, nblocks * per block]."""
    return x.reshape(x.shape[0], -1)


def _q8_0(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, Q.Q8_0)
    return Decoded("int8", _rows(b[..., 2:].view(np.int8)), _rows(_f16(b, 0)), None)


def _q4_0(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, Q.Q4_0)
    d = _f16(b, 0)
    return Decoded("int4", _rows(_nibbles(b[..., 2:])), _rows(d), _rows(-8.0 * d))


def _q4_1(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, Q.Q4_1)
    return Decoded("int4", _rows(_nibbles(b[..., 4:])), _rows(_f16(b, 0)), _rows(_f16(b, 2)))


def _q5_0(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, Q.Q5_0)
    q = (_nibbles(b[..., 6:]) | _fifth_bits(b, 2)).astype(np.int16) - 16
    return Decoded("int8", _rows(q.astype(np.int8)), _rows(_f16(b, 0)), None)


def _q5_1(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, Q.Q5_1)
    q = _nibbles(b[..., 8:]) | _fifth_bits(b, 4)
    return Decoded("int8", _rows(q.astype(np.int8)), _rows(_f16(b, 0)), _rows(_f16(b, 2)))


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and mins (get_scale_min_k4)."""
    s = s.astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc.astype(np.float32), m.astype(np.float32)


def _q4_k(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, Q.Q4_K)
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k_scales(b[..., 4:16])
    qs = b[..., 16:144].reshape(*b.shape[:2], 4, 32)  # four chunks of 64 values
    q = np.stack([qs & 15, qs >> 4], axis=-2)  # [rows, nb, 4, 2, 32]: sub-block 2c, 2c + 1
    return Decoded("int4", _rows(q), _rows(d * sc), _rows(-(dmin * m)))


def _q5_k(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, Q.Q5_K)
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k_scales(b[..., 4:16])
    qh = b[..., 16:48][..., None, :]  # [rows, nb, 1, 32]
    qs = b[..., 48:176].reshape(*b.shape[:2], 4, 32)
    shift = 2 * np.arange(4, dtype=np.uint8)[:, None]  # chunk c uses bits 2c and 2c + 1
    lo = (qs & 15) | (((qh >> shift) & 1) << 4)
    hi = (qs >> 4) | (((qh >> (shift + 1)) & 1) << 4)
    q = np.stack([lo, hi], axis=-2)
    return Decoded("int8", _rows(q.astype(np.int8)), _rows(d * sc), _rows(-(dmin * m)))


def _q6_k(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, Q.Q6_K)
    ql = b[..., 0:128].reshape(*b.shape[:2], 2, 64)  # two halves of 128 values
    qh = b[..., 128:192].reshape(*b.shape[:2], 2, 32)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)  # 16 sub-blocks of 16
    d = _f16(b, 208)
    parts = [ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4]
    q = np.stack([(p | (((qh >> (2 * i)) & 3) << 4)) for i, p in enumerate(parts)], axis=-2)
    q = (q.astype(np.int16) - 32).astype(np.int8)  # [rows, nb, 2, 4, 32]: 128n + 32i + l
    return Decoded("int8", _rows(q), _rows(d * sc), None)


DECODERS: dict[Q, Callable[[np.ndarray], Decoded]] = {
    Q.Q8_0: _q8_0, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1,
    Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
}
# The device layout of each type: the 32-value blocks' scales are float16 as stored (Q4_0's
# min -8d too), the K-quants' folded d * sc need float32.
LAYOUTS: dict[Q, QuantLayout] = {
    Q.Q8_0: QuantLayout("int8", 32, False, "float16"),
    Q.Q5_0: QuantLayout("int8", 32, False, "float16"),
    Q.Q5_1: QuantLayout("int8", 32, True, "float16"),
    Q.Q4_0: QuantLayout("int4", 32, True, "float16"),
    Q.Q4_1: QuantLayout("int4", 32, True, "float16"),
    Q.Q4_K: QuantLayout("int4", 32, True, "float32"),
    Q.Q5_K: QuantLayout("int8", 32, True, "float32"),
    Q.Q6_K: QuantLayout("int8", 16, False, "float32"),
}
# Types kept as they are (float) under quantization="gguf".
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


def supported_types() -> list[str]:
    """Names of the GGUF types that run quantized."""
    return [t.name for t in DECODERS]


def decode(raw: np.ndarray, qtype: Q) -> Decoded:
    """Values, scales and mins of raw blocks [rows, bytes] of a quantized type."""
    if qtype not in DECODERS:
        raise ValueError(f"GGUF type {qtype.name} cannot run quantized (supported: "
                         f"{', '.join(supported_types())}, and F32/F16/BF16 as floats)")
    return DECODERS[qtype](np.ascontiguousarray(raw, np.uint8))


def _cast_exact(a: np.ndarray, dtype: str, what: str) -> np.ndarray:
    """`a` in `dtype`, or ValueError when a value would change."""
    out = a.astype(dtype)
    if not np.array_equal(out.astype(np.float32), a):
        raise ValueError(f"{what} do not fit {dtype} exactly")
    return out


def to_weight(dec: Decoded, layout: QuantLayout, k_axis: int) -> QuantWeight:
    """A decoded [rows = N or V, K] tensor in the device form: a linear's kernel [K, N]
    (k_axis 0, transposed) or an embedding table [V, K] (k_axis 1)."""
    values = dec.values
    scales = _cast_exact(dec.scales, layout.scale_dtype, "scales")
    mins = None if dec.mins is None else _cast_exact(dec.mins, layout.scale_dtype, "mins")
    if k_axis == 0:
        values, scales = values.T, scales.T
        mins = None if mins is None else mins.T
    if dec.kind == "int4":
        q = pack_int4(values, layout.group_size, k_axis)
    else:
        q = np.ascontiguousarray(values)
    return QuantWeight(dec.kind, q, np.ascontiguousarray(scales),
                       None if mins is None else np.ascontiguousarray(mins), k_axis)


def device_bytes(qtype: Q, shape: tuple[int, ...], float_bytes: int) -> int:
    """Bytes one GGUF tensor takes on the device under quantization="gguf" (a float type at
    the model's dtype, `float_bytes` an element)."""
    n = int(np.prod(shape))
    if qtype not in LAYOUTS:
        return n * float_bytes
    layout = LAYOUTS[qtype]
    groups = n // layout.group_size
    value = n // 2 if layout.kind == "int4" else n
    return value + groups * np.dtype(layout.scale_dtype).itemsize * (2 if layout.has_min else 1)
