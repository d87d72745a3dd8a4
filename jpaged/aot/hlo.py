"""A small reader of XLA's optimized HLO text (`compiled.as_text()`): computations, instructions,
shapes and their bytes. Enough structure for `hbm.estimate_traffic`, nothing more.

Each instruction is one line: `[ROOT] %name = <shape> <opcode>(<operands>), <attributes>`, where
the shape is an array (`bf16[32,4096]{1,0}`) or a tuple in parentheses, and operands are
`%name`s (optionally preceded by their shapes). `/*index=5*/` comments are dropped.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# Bytes per element of XLA's primitive types (sub-byte types rounded by their own arithmetic).
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25, "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)="
                    r"%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of an XLA type name (f8 variants are 1, f4 variants 0.5)."""
    if dtype in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype]
    if dtype.startswith("f8"):
        return 1
    if dtype.startswith("f4"):
        return 0.5
    raise ValueError(f"unknown XLA element type {dtype!r}")


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a shape's text, tuple elements in order."""
    return [(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
            for m in _ARRAY.finditer(_COMMENT.sub("", shape))]


def shape_bytes(shape: str) -> int:
    """Bytes of all arrays of a shape (a tuple's elements summed; layouts ignored)."""
    return int(sum(math.prod(dims) * dtype_bytes(dt) for dt, dims in arrays(shape)))


def elements(shape: str) -> int:
    """Elements of all arrays of a shape."""
    return sum(math.prod(dims) for _, dims in arrays(shape))


def same_array(a: str, b: str) -> bool:
    """True when two array shapes have the same type and dims (layouts ignored)."""
    x, y = arrays(a), arrays(b)
    return len(x) == 1 and x == y


def split_top_level(text: str, opens: str = "([{", closes: str = ")]}") -> list[str]:
    """The comma-separated parts of `text` outside any bracket of `opens`/`closes`, stripped
    (an empty last part dropped)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in opens:
            depth += 1
        elif ch in closes:
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def tuple_elements(shape: str) -> list[str]:
    """The top-level element shapes of a tuple shape's text ([shape] for an array)."""
    s = _COMMENT.sub("", shape).strip()
    if not s.startswith("("):
        return [s]
    return split_top_level(s[1:-1])


@dataclass
class Instr:
    """One HLO instruction: its name, result shape, opcode, operand names and attribute text."""

    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str
    root: bool = False
    literal: str = ""  # what `constant(...)` / `parameter(...)` hold in their parentheses

    @property
    def bytes(self) -> int:
        """Bytes of the result."""
        return shape_bytes(self.shape)

    def shape_elements(self) -> list[str]:
        """The result's top-level tuple element shapes ([shape] for an array)."""
        return tuple_elements(self.shape)

    def called(self) -> list[str]:
        """Names of the computations this instruction calls (fusion, while, call, ...)."""
        found = _CALLS.findall(self.attrs)
        m = _BRANCHES.search(self.attrs)
        if m:
            found += [x.strip().lstrip("%") for x in m.group(1).split(",") if x.strip()]
        return found


@dataclass
class Computation:
    """A computation: its instructions in text (schedule) order."""

    name: str
    instrs: list[Instr] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._by_name: dict[str, Instr] | None = None

    @property
    def by_name(self) -> dict[str, Instr]:
        """Instructions by name."""
        if self._by_name is None or len(self._by_name) != len(self.instrs):
            self._by_name = {i.name: i for i in self.instrs}
        return self._by_name

    @property
    def root(self) -> Instr:
        """The ROOT instruction (the last one if none is marked)."""
        return next((i for i in self.instrs if i.root), self.instrs[-1])

    def param(self, number: int) -> Instr | None:
        """The `parameter(number)` instruction."""
        return next((i for i in self.instrs if i.op == "parameter" and i.literal == str(number)),
                    None)

    def users(self, name: str) -> list[Instr]:
        """Instructions that take `name` as an operand."""
        return [i for i in self.instrs if name in i.operands]


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis closing the one at `start`."""
    depth = 0
    for k in range(start, len(text)):
        if text[k] == "(":
            depth += 1
        elif text[k] == ")":
            depth -= 1
            if depth == 0:
                return k + 1
    raise ValueError(f"unbalanced parentheses in HLO line: {text[:200]}")


def parse_instr(line: str) -> Instr | None:
    """One instruction line, or None for anything else."""
    m = _INSTR.match(line)
    if not m:
        return None
    pos = m.end()
    if line[pos] == "(":  # a tuple shape
        end = _balanced(line, pos)
    else:
        end = line.index(" ", pos)
    shape = _COMMENT.sub("", line[pos:end])
    o = _OPCODE.match(line, end)
    if not o:
        return None
    args_end = _balanced(line, o.end() - 1)
    args = _COMMENT.sub("", line[o.end():args_end - 1])
    op = o.group(1)
    if op in ("constant", "parameter", "iota"):
        return Instr(m.group(2), shape, op, [], line[args_end:], bool(m.group(1)), args.strip())
    if "%" in args:
        operands = re.findall(r"%([\w.\-]+)", args)
    else:  # operands printed without the % sigil: the last token of each
        operands = [a.split()[-1] for a in args.split(",") if a.strip()]
    return Instr(m.group(2), shape, op, operands, line[args_end:], bool(m.group(1)))


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
    """(computations by name, the entry computation's name) of an HLO module's text."""
    comps: dict[str, Computation] = {}
    entry, cur = "", None
    for line in text.splitlines():
        h = _HEAD.match(line)
        if h:
            cur = comps.setdefault(h.group(2), Computation(h.group(2)))
            if h.group(1):
                entry = h.group(2)
            continue
        if line.startswith("}"):
            cur = None
            continue
        if cur is not None:
            ins = parse_instr(line)
            if ins is not None:
                cur.instrs.append(ins)
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry
