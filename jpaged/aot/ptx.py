"""How wide a kernel's global loads are, read from its PTX (the entry's body in XLA's dump).

A weight-streaming or attention kernel reaches HBM's bandwidth only when every thread loads 16
bytes per instruction (`ld.global.v4.b32`, `ld.global.v2.b64`, `ld.global.b128`, a 16-byte
`cp.async` or a TMA copy); one that loads 4 or 8 bytes at a time issues 2-4x the load
instructions for the same bytes. `max_global_load_bytes` is the widest such load in an entry's
body (0: it loads nothing from global memory):

* `ld.global[.nc][.<cache hints>][.vN].<type>` and `ldu.global`: N x the type's bytes
  (`.v4.b32` 16, `.v2.b32` / `.v4.b16` 8, `.b32` 4, `.b128` 16; packed `.f16x2` 4);
* `cp.async.ca|cg.shared.global [dst], [src], <size>`: its size operand (4, 8 or 16, decimal
  or hex as Triton writes it: `0x10`);
* `cp.async.bulk[.tensor]...shared::<x>.global ...` (TMA, into shared memory): 16, the width
  the bulk copy engine moves; stores the other way and prefetches are no loads.

Generic `ld` (no state space) is not counted: Triton and XLA's emitters name `.global`.
"""

from __future__ import annotations

import re
from pathlib import Path

from jpaged.aot.hlo import split_top_level

_ENTRY = re.compile(r"^[ \t]*(?:\.visible[ \t]+|\.weak[ \t]+)?\.entry[ \t]+([\w$.]+)[ \t]*\(", re.M)
_FUNC = re.compile(r"^[ \t]*(?:\.visible[ \t]+|\.weak[ \t]+|\.extern[ \t]+)?(?:\.entry|\.func)\b",
                   re.M)
_PRED = re.compile(r"^@!?%?\w+\s+")
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_LABEL = re.compile(r"^[$\w]+:\s*")
_VEC = re.compile(r"^v(\d+)$")
_TYPE_BYTES = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
               "b32": 4, "u32": 4, "s32": 4, "f32": 4, "f16x2": 4, "bf16x2": 4, "tf32": 4,
               "b64": 8, "u64": 8, "s64": 8, "f64": 8, "b128": 16}
# A bulk (TMA) copy into shared memory: the width the brief counts it as.
BULK_COPY_BYTES = 16


def entry_bodies(ptx: str) -> dict[str, str]:
    """Each `.entry` of a PTX module: its text up to the next entry or function."""
    starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(ptx)]
    bounds = sorted(m.start() for m in _FUNC.finditer(ptx))
    out = {}
    for pos, name in starts:
        end = next((b for b in bounds if b > pos), len(ptx))
        out[name] = ptx[pos:end]
    return out


def _statements(body: str) -> list[str]:
    """The instructions of a body: split at line ends and `;` (an instruction on one line, as
    Triton and LLVM write them), braces, labels and predicates removed."""
    out = []
    for raw in re.split(r"[;\n]", _COMMENT.sub("", body)):
        s = raw.strip()
        while s and s[0] in "{}":
            s = s[1:].strip()
        s = _LABEL.sub("", s) if not s.startswith(".") else s
        s = _PRED.sub("", s)
        if s:
            out.append(s)
    return out


def _operands(stmt: str) -> list[str]:
    """Top-level comma-separated operands of a statement (after its opcode)."""
    parts = stmt.split(None, 1)
    # Address brackets and vector braces group the operands of a load.
    return split_top_level(parts[1], "[{", "]}") if len(parts) == 2 else []


def load_bytes(stmt: str) -> int | None:
    """Bytes one global load instruction moves per thread, or None for anything else."""
    opcode = stmt.split(None, 1)[0]
    parts = opcode.split(".")
    if parts[0] in ("ld", "ldu"):
        if "global" not in parts[1:]:
            return None
        vec = next((int(m.group(1)) for p in parts if (m := _VEC.match(p))), 1)
        width = next((_TYPE_BYTES[p] for p in reversed(parts) if p in _TYPE_BYTES), None)
        return None if width is None else vec * width
    if parts[:2] != ["cp", "async"] or "prefetch" in parts:
        return None
    spaces = [p for p in parts if p.startswith(("shared", "global"))]
    if "bulk" in parts:  # destination first: shared <- global is a load
        return BULK_COPY_BYTES if len(spaces) >= 2 and spaces[0].startswith("shared") \
            and spaces[1] == "global" else None
    if "global" in spaces and spaces[0].startswith("shared"):
        ops = _operands(stmt)
        if len(ops) >= 3:
            try:
                return int(ops[2], 0)
            except ValueError:
                return None
    return None


def max_global_load_bytes(body: str) -> int:
    """The widest global load (bytes per thread per instruction) in a PTX body; 0 if none."""
    return max((b for s in _statements(body) if (b := load_bytes(s)) is not None), default=0)


def load_widths(ptx_files: list[Path], names: set[str]) -> dict[str, int]:
    """`max_global_load_bytes` of each named entry found in the PTX files."""
    found: dict[str, int] = {}
    for path in ptx_files:
        text = path.read_text(errors="replace")
        if not any(f".entry {n}(" in text for n in names - set(found)):
            continue
        for name, body in entry_bodies(text).items():
            if name in names:
                found[name] = max_global_load_bytes(body)
    return found
