"""A fast GGUF header reader: metadata scalars and tensor names, without touching tensor data.

`gguf.GGUFReader` parses every field (49,152 tokenizer strings and 48,900 merges for SmolLM2)
into numpy views, which takes seconds; the capacity planner needs a dozen integers. This reader
walks the header once, keeps scalars, strings and short arrays, and records long arrays by
length only (as ``range(count)``, which has the right ``len()``), so `spec_from_gguf` can use it.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

_MAGIC = b"GGUF"
# GGUF value type -> struct format of one element (STRING=8 and ARRAY=9 are variable-length).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
LONG_ARRAY = 64  # arrays longer than this are kept as range(count)


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    raw = f.read(size)
    if len(raw) != size:
        raise ValueError("unexpected end of file")
    return struct.unpack(fmt, raw)[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    raw = f.read(n)
    if len(raw) != n:
        raise ValueError("unexpected end of file in a string")
    return raw.decode("utf-8", errors="replace")


def _value(f: BinaryIO, vtype: int) -> Any:
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        etype, count = _read(f, "<I"), _read(f, "<Q")
        if count > LONG_ARRAY:
            if etype in _SCALARS:
                f.seek(count * struct.calcsize(_SCALARS[etype]), 1)
            else:
                for _ in range(count):
                    _value(f, etype)
            return range(count)
        return [_value(f, etype) for _ in range(count)]
    if vtype not in _SCALARS:
        raise ValueError(f"unknown GGUF value type {vtype}")
    value = _read(f, _SCALARS[vtype])
    if vtype == _FLOAT32:
        value = float(str(np.float32(value)))  # 1e-05, not 9.999999747378752e-06
    return value


def read_gguf_header(path: str | Path) -> tuple[dict[str, Any], set[str]]:
    """(metadata, tensor names) of a GGUF file; ValueError naming the file if it is not one."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if f.read(4) != _MAGIC:
                raise ValueError("not a GGUF file (bad magic)")
            version = _read(f, "<I")
            if version not in (2, 3):
                raise ValueError(f"unsupported GGUF version {version}")
            n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
            meta: dict[str, Any] = {}
            for _ in range(n_kv):
                key = _string(f)
                meta[key] = _value(f, _read(f, "<I"))
            names = set()
            for _ in range(n_tensors):
                names.add(_string(f))
                n_dims = _read(f, "<I")
                f.seek(8 * n_dims + 4 + 8, 1)  # dims (u64 each), ggml type (u32), offset (u64)
    except (ValueError, struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt or truncated GGUF file {path}: {e}") from e
    return meta, names
