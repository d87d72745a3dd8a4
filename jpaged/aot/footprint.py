"""Which elements of its parameters a fused computation reads (`hbm` counts those bytes).

A GPU loop or input fusion computes each output element from the operand elements it depends
on; an operand element nothing depends on is never loaded. So a split-K GEMM's f32 partials
`[s, M, N]`, reduced and then sliced to the k columns by one consumer fusion, are read there only
in those columns. `param_read_elements` walks a fused computation from its root to its
parameters and keeps, for every value, the box (one [lo, hi) range per dimension) of elements
that are demanded, and apart from it the boxes whose places data decides: a dynamic-slice or
gather reads its extent wherever its indices point; such a box is kept as if its picks sat
first, and a pad or concatenation keeps its extent rather than its offsets.

It over-approximates: several demands on one value merge into their bounding box (those
picked by different indices add up); an op the walk does not know demands every element of
each operand; a reshape or bitcast that does not map a box cleanly demands its whole group of
dimensions; a bitcast between layouts other than the default row-major one demands all. The
one assumption: picks of one gather that reach a value by two paths land on the same
dimension there (true of the row gathers in a step: they pick tokens).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from jpaged.aot.hlo import Computation, Instr, arrays
from jpaged.intmath import cdiv

Box = tuple[tuple[int, int], ...]

# Ops whose result element i depends on element i of each (same-shaped) operand only.
_ELEMENTWISE = {
    "abs", "add", "and", "atan2", "cbrt", "ceil", "clamp", "compare", "complex", "convert",
    "copy", "cosine", "divide", "erf", "exponential", "exponential-minus-one", "floor", "imag",
    "is-finite", "log", "log-plus-one", "logistic", "maximum", "minimum", "multiply", "negate",
    "not", "or", "popcnt", "power", "real", "reduce-precision", "remainder", "round-nearest-afz",
    "round-nearest-even", "rsqrt", "select", "shift-left", "shift-right-arithmetic",
    "shift-right-logical", "sign", "sine", "sqrt", "subtract", "tan", "tanh", "xor",
}
_DIMS = re.compile(r"\bdimensions=\{([\d,\s]*)\}")
_SLICE = re.compile(r"\bslice=\{([^}]*)\}")
_PADDING = re.compile(r"\bpadding=([\d_x\-]+)")
_LAYOUT = re.compile(r"\]\{([\d,]*)")


@dataclass
class Demand:
    """Elements of one value that are read: a box at known places (None: none), boxes of known
    extent at unknown places (what data indices pick), or (`whole`) all of them."""

    box: Box | None = None
    # By the gather / dynamic-slice whose indices place them: boxes as if its picks sat first.
    free: dict[str, Box] = field(default_factory=dict)
    whole: bool = False

    def add(self, box: Box | None, origin: str | None = None) -> None:
        """Merge another demand in: the bounding box of the placed ones, and of the unplaced
        ones of one origin (the same picks); unplaced ones of different origins add up."""
        if box is None or any(lo >= hi for lo, hi in box):
            return
        old = self.box if origin is None else self.free.get(origin)
        new = box if old is None else tuple((min(a, c), max(b, d)) for (a, b), (c, d) in zip(
            old, box, strict=True))
        if origin is None:
            self.box = new
        else:
            self.free[origin] = new

    def elements(self, dims: tuple[int, ...]) -> int:
        """Elements demanded, at most the value's own."""
        if self.whole:
            return math.prod(dims)
        boxes = ([self.box] if self.box is not None else []) + list(self.free.values())
        return min(math.prod(dims), sum(math.prod(hi - lo for lo, hi in b) for b in boxes))


def _dims(ins: Instr) -> tuple[int, ...] | None:
    """The dims of an array-shaped instruction (None for a tuple)."""
    found = arrays(ins.shape)
    return found[0][1] if len(found) == 1 and not ins.shape.lstrip().startswith("(") else None


def _full(dims: tuple[int, ...]) -> Box:
    return tuple((0, d) for d in dims)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _default_layout(shape: str, rank: int) -> bool:
    m = _LAYOUT.search(shape)
    return m is None or _ints(m.group(1)) == list(range(rank - 1, -1, -1))


def _reshape_box(box: Box, out: tuple[int, ...], src: tuple[int, ...]) -> Box:
    """The box of `src` elements that a box over the same elements viewed as `out` covers
    (row-major): dims are matched in groups of equal products; within a group a box that is
    whole in all but its major dimension maps to a range of the group's major source dim (whole
    minor source dims); any other group demands its source dims whole."""
    result: list[tuple[int, int]] = []
    i = j = 0
    while i < len(out) or j < len(src):
        gi, gj = [i], [j]
        po = out[i] if i < len(out) else 1
        ps = src[j] if j < len(src) else 1
        i, j = i + 1, j + 1
        while po != ps:
            if po < ps and i < len(out):
                gi.append(i)
                po *= out[i]
                i += 1
            elif j < len(src):
                gj.append(j)
                ps *= src[j]
                j += 1
            else:
                return _full(src)  # shapes that do not factor together
        gi = [k for k in gi if k < len(out)]
        gj = [k for k in gj if k < len(src)]
        while len(gi) > 1 and out[gi[0]] == 1:  # size-1 dims lead nothing
            gi.pop(0)
        while len(gj) > 1 and src[gj[0]] == 1:
            result.append((0, 1))
            gj.pop(0)
        if not gj:
            continue
        if gi and all(box[k] == (0, out[k]) for k in gi[1:]):
            inner_out = math.prod(out[k] for k in gi[1:])
            lo, hi = box[gi[0]][0] * inner_out, box[gi[0]][1] * inner_out
            inner_src = math.prod(src[k] for k in gj[1:])
            result.append((lo // inner_src, cdiv(hi, inner_src)))
            result += [(0, src[k]) for k in gj[1:]]
        else:
            result += [(0, src[k]) for k in gj]
    return tuple(result)


Ask = tuple[Box | None, str | None]  # (box of an operand, the origin of an unplaced one)


def _gather_box(ins: Instr, box: Box, operand: tuple[int, ...]) -> Box | None:
    """The extent a gather reads of its operand for `box` of its result (places unknown): one
    slice per batch element, the batch counted along the first indexed dimension."""
    offset = re.search(r"\boffset_dims=\{([\d,]*)\}", ins.attrs)
    collapsed = re.search(r"\bcollapsed_slice_dims=\{([\d,]*)\}", ins.attrs)
    index_map = re.search(r"\bstart_index_map=\{([\d,]*)\}", ins.attrs)
    if offset is None or index_map is None or "operand_batching_dims" in ins.attrs:
        return None
    offs, gone = _ints(offset.group(1)), set(_ints(collapsed.group(1)) if collapsed else [])
    kept = [d for d in range(len(operand)) if d not in gone]
    if len(kept) != len(offs) or not _ints(index_map.group(1)):
        return None
    ext = [1] * len(operand)
    for d, o in zip(kept, offs, strict=True):
        ext[d] = box[o][1] - box[o][0]
    batch = math.prod(hi - lo for k, (lo, hi) in enumerate(box) if k not in offs)
    first = _ints(index_map.group(1))[0]
    ext[first] = min(operand[first], ext[first] * batch)
    return tuple((0, e) for e in ext)


def _operand_demands(ins: Instr, box: Box, comp: Computation, origin: str | None
                     ) -> list[Ask]:
    """What each operand must supply when `box` of `ins` is demanded: placed (`origin` None), or
    picked by the gather / dynamic-slice `origin` (then a pad or concatenation keeps extents,
    not offsets)."""
    ops = [comp.by_name.get(o) for o in ins.operands]
    dims = [_dims(o) if o is not None else None for o in ops]
    out = _dims(ins)
    whole: list[Ask] = [(_full(d) if d is not None else None, None) for d in dims]
    if out is None or any(d is None for d in dims):
        return whole
    op = ins.op
    if op in _ELEMENTWISE:
        return [(box, origin) if d == out else (_full(d), None) for d in dims]
    if op == "broadcast":
        m = _DIMS.search(ins.attrs)
        if m is None:
            return whole
        return [(tuple(box[k] for k in _ints(m.group(1))), origin)]
    if op == "transpose":
        m = _DIMS.search(ins.attrs)
        perm = _ints(m.group(1)) if m else []
        if sorted(perm) != list(range(len(out))):
            return whole
        src: list[tuple[int, int]] = [(0, 0)] * len(out)
        for k, p in enumerate(perm):
            src[p] = box[k]
        return [(tuple(src), origin)]
    if op == "slice":
        m = _SLICE.search(ins.attrs)
        parts = re.findall(r"\[(-?\d+):(-?\d+)(?::(\d+))?\]", m.group(1)) if m else []
        if len(parts) != len(out):
            return whole
        src = []
        for (lo, hi), (start, _, stride) in zip(box, parts, strict=True):
            s = int(stride or 1)
            src.append((int(start) + lo * s, int(start) + (hi - 1) * s + 1))
        return [(tuple(src), origin)]
    if op == "pad":
        m = _PADDING.search(ins.attrs)
        specs = [[int(v) for v in spec.split("_")] for spec in m.group(1).split("x")] if m \
            else []
        if len(specs) != len(out) or any(len(sp) > 2 and sp[2] for sp in specs):
            return whole  # interior padding
        if origin is not None:  # the picks may sit anywhere in the source
            return [(tuple((0, min(d, hi - lo)) for (lo, hi), d in zip(box, dims[0],
                                                                       strict=True)), origin),
                    (_full(dims[1]), None)]
        src = [(max(0, lo - sp[0]), min(d, hi - sp[0]))
               for (lo, hi), sp, d in zip(box, specs, dims[0], strict=True)]
        return [(tuple(src), None), (_full(dims[1]), None)]
    if op == "concatenate":
        m = _DIMS.search(ins.attrs)
        if m is None:
            return whole
        axis, off, res = _ints(m.group(1))[0], 0, []
        for d in dims:
            lo, hi = box[axis]
            part = list(box)
            part[axis] = (max(0, lo - off), min(d[axis], hi - off)) if origin is None \
                else \
                (0, min(d[axis], hi - lo))
            res.append((tuple(part), origin))
            off += d[axis]
        return res
    if op == "reduce":
        m = _DIMS.search(ins.attrs)
        if m is None:
            return whole
        reduced, half = set(_ints(m.group(1))), len(dims) // 2
        res = []
        for k, d in enumerate(dims):
            if k >= half:
                res.append((_full(d), None))  # the init values
                continue
            kept = iter(box)
            res.append((tuple((0, n) if a in reduced else next(kept) for a, n in enumerate(d)),
                        origin))
        return res
    if op in ("bitcast", "reshape"):
        if op == "bitcast" and not (_default_layout(ins.shape, len(out))
                                    and _default_layout(ops[0].shape, len(dims[0]))):
            return whole
        if math.prod(out) != math.prod(dims[0]):
            return whole
        return [(_reshape_box(box, out, dims[0]), origin)]
    if op == "dynamic-slice":  # the slice's extent, wherever the offsets put it
        return [(box, origin or ins.name)] + [(_full(d), None) for d in dims[1:]]
    if op == "gather":
        got = _gather_box(ins, box, dims[0])
        return [(got, origin or ins.name) if got is not None else whole[0], *whole[1:]]
    return whole


def param_read_elements(fused: Computation) -> dict[int, int]:
    """{parameter number: elements of it that the fusion's results depend on}."""
    demand: dict[str, Demand] = {}
    root = fused.root
    for name in (root.operands if root.op == "tuple" else [root.name]):
        d = _dims(fused.by_name[name]) if name in fused.by_name else None
        demand[name] = Demand(_full(d)) if d is not None else Demand(whole=True)
    out: dict[int, int] = {}
    for ins in reversed(fused.instrs):
        want = demand.get(ins.name)
        if want is None:
            continue
        dims = _dims(ins)
        if ins.op == "parameter":
            if dims is not None:  # a tuple parameter is left out: counted whole by the caller
                out[int(ins.literal)] = want.elements(dims)
            continue
        if want.whole or dims is None:  # all of it: every operand whole
            for o in ins.operands:
                if o in fused.by_name:
                    demand.setdefault(o, Demand()).whole = True
            continue
        for origin, box in ([(None, want.box)] if want.box is not None else []) + \
                list(want.free.items()):
            asks = _operand_demands(ins, box, fused, origin)
            for o, (part, part_origin) in zip(ins.operands, asks, strict=True):
                if o not in fused.by_name:
                    continue
                dm = demand.setdefault(o, Demand())
                dm.whole = dm.whole or _dims(fused.by_name[o]) is None
                dm.add(part, part_origin)
    return out
