"""A fast GGUF header reader: metadata and tensor locations, without touching tensor data.

`gguf.GGUFReader` builds numpy views for every part of every field (262,144 tokenizer strings
for Gemma 3 take it over 10 s); loading needs the values once, the capacity planner a dozen
integers. This reader walks the header of a memory-mapped file once with `struct`: strings are
sliced and decoded, numeric arrays read with one `np.frombuffer`. With ``full=False`` long
arrays are kept by length only (as ``range(count)``, which has the right ``len()``), so
`spec_from_gguf` can use the result without the vocabulary being decoded.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np

from jpaged.intmath import cdiv

_MAGIC = b"GGUF"
# GGUF value type -> struct format of one element (STRING=8 and ARRAY=9 are variable-length).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
LONG_ARRAY = 64  # with full=False, arrays longer than this are kept as range(count)
DEFAULT_ALIGNMENT = 32  # GGUF's tensor data alignment when general.alignment is absent


class TensorInfo(NamedTuple):
    """Where one tensor's bytes are in a GGUF file and how they are stored."""

    name: str
    dims: tuple[int, ...]  # GGUF order: fastest-varying first
    ggml_type: int
    offset: int  # absolute byte offset in the file

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy (C-order) shape: the reverse of the GGUF dims, HF's [out, in] for matrices."""
        return tuple(reversed(self.dims))

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in the file (KeyError for a ggml type gguf does not know)."""
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.ggml_type)]
        return math.prod(self.dims) // block * size


class _Cursor:
    """Reads little-endian GGUF values from a buffer, advancing a position."""

    def __init__(self, buf: Any):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError("unexpected end of file")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("unexpected end of file in a string")
        text = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, vtype: int, full: bool) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            keep = full or count <= LONG_ARRAY
            if etype in _NUMPY:
                width = np.dtype(_NUMPY[etype]).itemsize
                if self.pos + count * width > len(self.buf):
                    raise ValueError("unexpected end of file in an array")
                start, self.pos = self.pos, self.pos + count * width
                if not keep:
                    return range(count)
                return np.frombuffer(self.buf, _NUMPY[etype], count, start).tolist()
            items = [self.value(etype, full) for _ in range(count)]
            return items if keep else range(count)
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        value = self.scalar(_SCALARS[vtype])
        if vtype == _FLOAT32:
            value = float(str(np.float32(value)))  # 1e-05, not 9.999999747378752e-06
        return value


def read_gguf(path: str | Path, full: bool = True
              ) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """(metadata, tensors by name) of a GGUF file; ValueError naming the file if it is corrupt.

    full: every array is read (the tokenizer needs them) and each tensor is checked to lie
    within the file; else long arrays are ``range(count)`` and tensor bounds are not checked.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 4:
                raise ValueError("not a GGUF file (too short)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                meta, tensors = _parse(memoryview(mm), size, full)
    except (ValueError, struct.error, OverflowError) as e:
        raise ValueError(f"corrupt or truncated GGUF file {path}: {e}") from e
    return meta, tensors


def _parse(buf: memoryview, size: int, full: bool
           ) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    cur = _Cursor(buf)
    try:
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.scalar("<I"), full)
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
            raw.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align < 1:
            raise ValueError(f"invalid general.alignment {align!r}")
        data_start = cdiv(cur.pos, align) * align
    finally:
        del cur  # drop the cursor's view so the mmap can close
        buf.release()
    tensors = {name: TensorInfo(name, dims, ggml_type, data_start + offset)
               for name, dims, ggml_type, offset in raw}
    if full:
        for t in tensors.values():
            try:
                end = t.offset + t.nbytes
            except (KeyError, ValueError):
                raise ValueError(f"tensor {t.name!r} has unknown ggml type {t.ggml_type}") from None
            if end > size:
                raise ValueError(f"tensor {t.name!r} ends at byte {end}, past the end of the "
                                 f"file ({size} bytes)")
    return meta, tensors


def read_gguf_header(path: str | Path) -> tuple[dict[str, Any], set[str]]:
    """(metadata, tensor names) of a GGUF file, long arrays as ``range(count)``; ValueError
    naming the file if it is not one."""
    meta, tensors = read_gguf(path, full=False)
    return meta, set(tensors)
