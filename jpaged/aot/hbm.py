"""Bytes a compiled program moves through device memory, read from its optimized HLO text.

Model (a lower bound on what a GPU runs, no cache reuse between kernels): every top-level op of
a computation that runs as a kernel (fusion, custom-call, copy, collective, ...) reads its
operands and writes its result once; bitcast, get-tuple-element, tuple, parameter and constant
move nothing. Refinements:

* a fusion operand counts the elements the fusion's results depend on (`footprint`): a slice
  of it, the rows a gather or dynamic-slice picks (the KV pool and stacked weights are passed
  whole, read in part), the k columns of split-K partials that one consumer reduces;
* an in-place dynamic-update-slice or scatter (top level, or a fusion's root updating one of
  its parameters) writes only the update and does not read its target;
* while bodies count `known_trip_count` times (XLA's backend_config), else what the model's
  `loop_trips` says for the loop's op_name (a loop whose count is data, such as the XLA
  attention's chunk loop), else the condition's constant, else once (noted); a conditional
  counts its largest branch (noted); call and async wrappers recurse;
* a Pallas kernel (custom-call named by `KernelRule`s) reads/writes the pool operands it is
  passed by the rule's figures, not their whole size; its other operands and results count whole.

Besides the total it sums `param_copy_bytes` (temporaries that are copies or slices of weights:
ops whose only non-index input is a weight) and `param_collective_bytes` (collectives of
weights). Weights are entry parameters 0..num_weights-1, followed through bitcast,
get-tuple-element and loop-invariant while / call operands.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from jpaged.aot.footprint import param_read_elements
from jpaged.aot.hlo import (
    Computation,
    Instr,
    arrays,
    dtype_bytes,
    elements,
    parse_module,
    same_array,
    shape_bytes,
)

_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "add-dependency", "partition-id", "replica-id", "opt-barrier", "domain",
         "async-update", "async-done", "copy-done", "send-done", "recv-done"}
_COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all",
                "reduce-scatter", "ragged-all-to-all", "collective-broadcast")
_SLICING = {"dynamic-slice", "slice", "gather"}
_VIEW = {"bitcast", "reshape"}  # inside a fusion: indexing only
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_NAME = re.compile(r'\bname\s*=\s*"([^"]+)"|"name":"([^"]+)"')
_OP_NAME = re.compile(r'op_name="[^"]*?/([\w.\-]+)/pallas_call"')
_OP_NAME_ANY = re.compile(r'op_name="([^"]*)"')
_INT_CONST = re.compile(r"^-?\d+$")
_SUFFIX = re.compile(r"(\.\d+)+(\.clone)?$")

W, C = "w", "c"  # value tags: a weight; a copy / slice / collective result of a weight
L = "l"  # a lookup table (the embedding): rows read by index from it are activations
_WEIGHTY = (W, C, L)


@dataclass(frozen=True)
class KernelRule:
    """What one launch of a Pallas kernel moves for each operand / result of the pool's shape."""

    pool_read: int  # bytes read per pool operand (e.g. the K pages a decode kernel touches)
    pool_write: int  # bytes written per pool-shaped result (e.g. the new tokens' K rows)
    # The launch loads and stores nothing at all (every program of it skips its work).
    idle: bool = False
    # Bytes it stores into its other results (None: each whole), e.g. the split-K partials of
    # the partitions that hold keys, in the real query rows only.
    write: int | None = None
    # Bytes it loads from its other operands (None: each whole), e.g. a merge that reads only
    # those partials.
    read: int | None = None


@dataclass(frozen=True)
class HbmModel:
    """What the HLO text does not say: which entry parameters are weights, the kernels' rules."""

    num_weights: int = 0
    pool_shape: str | None = None  # e.g. "u16[131072,16,8,128]": operands the rules replace
    kernel_rule: Callable[[str], KernelRule | None] | None = None
    # Entry parameters that are lookup tables (the token embedding): row reads are no copies.
    lookup_weights: tuple[int, ...] = ()
    # Which branch of a conditional counts: "largest" (a bound for any predicate) or
    # "smallest" (the step's lax.conds skip random draws and filtering for a greedy batch).
    branch: str = "largest"
    # Name scopes (in a conditional's op_name) whose conditionals count their smallest branch
    # whatever `branch` says: work a batch of the case skips (the sampler's whole-row draw).
    skip_scopes: tuple[str, ...] = ()
    # Trip count of a while loop whose count is data, from its op_name (None: not known).
    loop_trips: Callable[[str], int | None] | None = None


@dataclass
class Traffic:
    """The estimate: total bytes, its weight-copy and weight-collective parts, notes."""

    hbm_bytes: int = 0
    param_copy_bytes: int = 0
    param_collective_bytes: int = 0
    kernel_bytes: dict[str, int] = field(default_factory=dict)  # per Pallas kernel, all launches
    notes: list[str] = field(default_factory=list)
    # Bytes per kind of op: its name less the numeric suffix, with its result shape.
    by_op: dict[str, int] = field(default_factory=dict)

    def add(self, other: Traffic) -> None:
        """Accumulate another estimate into this one."""
        self.hbm_bytes += other.hbm_bytes
        self.param_copy_bytes += other.param_copy_bytes
        self.param_collective_bytes += other.param_collective_bytes
        for k, v in other.kernel_bytes.items():
            self.kernel_bytes[k] = self.kernel_bytes.get(k, 0) + v
        for k, v in other.by_op.items():
            self.by_op[k] = self.by_op.get(k, 0) + v
        self.notes += [n for n in other.notes if n not in self.notes]

    def count(self, ins: Instr, moved: int) -> None:
        """Add `moved` bytes of one op (all its executions) to the total and to its kind."""
        self.hbm_bytes += moved
        if moved:
            kernel = kernel_name(ins) if ins.op == "custom-call" else None
            key = f"{kernel or _SUFFIX.sub('', ins.name)}: {ins.shape}"
            self.by_op[key] = self.by_op.get(key, 0) + moved

    def largest(self, n: int = 8) -> list[str]:
        """The `n` kinds of op that move the most bytes, largest first."""
        top = sorted(self.by_op.items(), key=lambda kv: -kv[1])[:n]
        return [f"{k} = {v} B" for k, v in top]


def kernel_name(ins: Instr) -> str | None:
    """The Pallas kernel's name of a custom-call (its `name` attribute or op_name path)."""
    m = _NAME.search(ins.attrs)
    if m:
        return m.group(1) or m.group(2)
    m = _OP_NAME.search(ins.attrs)
    return m.group(1) if m else None


def _is_index(shape: str) -> bool:
    """Small integer operands (indices, slot maps): not data for the weight-copy test."""
    return shape.split("[")[0] in ("s32", "u32", "s64", "u64", "s8", "u8", "pred") and \
        elements(shape) <= 4096


class _Estimator:
    def __init__(self, text: str, model: HbmModel) -> None:
        self.comps, self.entry = parse_module(text)
        self.model = model
        self._footprints: dict[str, dict[int, int]] = {}

    # ---- fusion internals -------------------------------------------------------------------
    def _terminal_users(self, comp: Computation, name: str) -> list[tuple[Instr, str]]:
        """Users of `name` through views, each with the operand name it uses."""
        out = []
        for u in comp.users(name):
            if u.op in _VIEW:
                out += self._terminal_users(comp, u.name)
            else:
                out.append((u, name))
        return out

    def _source_param(self, comp: Computation, name: str) -> Instr | None:
        """The fusion parameter a view chain starts from."""
        ins = comp.by_name.get(name)
        while ins is not None and ins.op in _VIEW:
            ins = comp.by_name.get(ins.operands[0])
        return ins if ins is not None and ins.op == "parameter" else None

    def _in_place(self, comp: Computation) -> dict[int, int]:
        """{root tuple index: parameter number} of roots updating a parameter in place."""
        root = comp.root
        elems = [comp.by_name[o] for o in root.operands] if root.op == "tuple" else [root]
        out = {}
        for k, e in enumerate(elems):
            while e.op in _VIEW:
                e = comp.by_name[e.operands[0]]
            if e.op in ("dynamic-update-slice", "scatter"):
                p = self._source_param(comp, e.operands[0])
                if p is not None:
                    out[k] = int(p.literal)
        return out

    def _update_bytes(self, comp: Computation, index: int) -> int:
        root = comp.root
        e = comp.by_name[root.operands[index]] if root.op == "tuple" else root
        while e.op in _VIEW:
            e = comp.by_name[e.operands[0]]
        upd = e.operands[1] if e.op == "dynamic-update-slice" else e.operands[-1]
        return comp.by_name[upd].bytes

    def _footprint(self, fused: Computation) -> dict[int, int]:
        """Elements of each parameter the fusion reads (per fused computation, computed once)."""
        if fused.name not in self._footprints:
            self._footprints[fused.name] = param_read_elements(fused)
        return self._footprints[fused.name]

    def _fusion_io(self, ins: Instr, comp: Computation, fused: Computation
                   ) -> tuple[list[int], int]:
        inplace = self._in_place(fused)
        footprint = self._footprint(fused)
        reads = []
        for i, opnd in enumerate(ins.operands):
            full = comp.by_name[opnd].bytes
            p = fused.param(i)
            users = self._terminal_users(fused, p.name) if p is not None else []
            if i in inplace.values() and all(u.op in ("dynamic-update-slice", "scatter")
                                             and u.operands[0] == via for u, via in users):
                reads.append(0)  # the in-place target: only the update is written (below)
            elif p is not None and i in footprint:
                reads.append(min(full, int(footprint[i] * dtype_bytes(arrays(p.shape)[0][0]))))
            else:
                reads.append(full)
        write = sum(self._update_bytes(fused, k) if k in inplace else shape_bytes(s)
                    for k, s in enumerate(ins.shape_elements()))
        return reads, write

    # ---- tags (weights and their copies) ----------------------------------------------------
    def _lookup(self, ins: Instr, index: int, table: bool) -> bool:
        """Whether operand `index` is read only by picking rows: through gathers (an embedding
        lookup), or for a lookup table (`table`) any slicing (one row is a dynamic-slice). The
        rows are the activation itself, not a copy of the weight."""
        ways = _SLICING if table else {"gather"}
        if ins.op in ways:
            return index == 0
        if ins.op != "fusion":
            return False
        fused = self.comps[ins.called()[0]]
        p = fused.param(index)
        users = self._terminal_users(fused, p.name) if p is not None else []
        return bool(users) and all(u.op in ways and u.operands[0] == via for u, via in users)

    def _weight_copy(self, ins: Instr, comp: Computation, tags: dict[str, object],
                     reads: list[int], write: int) -> bool:
        """A temp that is a weight's copy, slice, or product with a much smaller input: it reads
        a weight (or such a temp), writes at least the weight bytes it read, and its other data
        inputs (not indices) are smaller than that. A lookup of rows by index is none of these,
        nor is a contraction: a GEMM's output is a product however large (split-K partials)."""
        if ins.op in ("dot", "convolution") or ins.op == "fusion" and any(
                i.op in ("dot", "convolution") for i in self.comps[ins.called()[0]].instrs):
            return False  # a contraction (a GEMM, split-K partials included) is a product
        weight = other = 0
        for k, (o, r) in enumerate(zip(ins.operands, reads, strict=True)):
            tag = tags.get(o)
            if tag in _WEIGHTY and self._lookup(ins, k, tag == L):
                return False
            if tag in _WEIGHTY:
                weight += r
            elif not _is_index(comp.by_name[o].shape):
                other += r
        return weight > 0 and write >= weight > other

    # ---- walking ----------------------------------------------------------------------------
    def trip_count(self, ins: Instr) -> tuple[int, str | None]:
        """(trip count, note) of a while op."""
        m = _TRIP.search(ins.attrs)
        if m:
            return int(m.group(1)), None
        op_name = _OP_NAME_ANY.search(ins.attrs)
        if self.model.loop_trips is not None and op_name:
            n = self.model.loop_trips(op_name.group(1))
            if n is not None:
                return n, None
        c = re.search(r"\bcondition=%?([\w.\-]+)", ins.attrs)
        cond = self.comps.get(c.group(1)) if c else None
        consts: set[int] = set()
        todo = [cond] if cond else []
        while todo:
            c = todo.pop()
            for i in c.instrs:
                if i.op == "constant" and _INT_CONST.match(i.literal) and i.shape.startswith(
                        ("s32[]", "s64[]", "u32[]")):
                    consts.add(int(i.literal))
                todo += [self.comps[n] for n in i.called() if n in self.comps]
        consts.discard(0)
        if len(consts) == 1:
            n = consts.pop()
            return n, f"{ins.name}: trip count {n} from its condition's constant"
        return 1, f"{ins.name}: unknown trip count, body counted once"

    def run(self, comp: Computation, param_tags: list[object], mult: int) -> tuple[Traffic,
                                                                                   object]:
        """Traffic of one execution of `comp` times `mult`; the tag of its root."""
        t = Traffic()
        tags: dict[str, object] = {}
        for ins in comp.instrs:
            tags[ins.name] = self._visit(ins, comp, tags, param_tags, mult, t)
        return t, tags.get(comp.root.name)

    def _visit(self, ins: Instr, comp: Computation, tags: dict[str, object],
               param_tags: list[object], mult: int, t: Traffic) -> object:
        op, ops = ins.op, ins.operands
        if op == "parameter":
            k = int(ins.literal)
            return param_tags[k] if k < len(param_tags) else None
        if op == "get-tuple-element":
            src = tags.get(ops[0])
            k = int(re.search(r"index=(\d+)", ins.attrs).group(1))
            return src[k] if isinstance(src, tuple) and k < len(src) else None
        if op == "tuple":
            return tuple(tags.get(o) for o in ops)
        if op in ("bitcast", "copy-done") or op.endswith("-done"):
            return tags.get(ops[0]) if ops and tags.get(ops[0]) in _WEIGHTY else None
        if op in _FREE:
            return None
        if op == "while":
            return self._while(ins, tags, mult, t)
        if op == "conditional":
            return self._conditional(ins, tags, mult, t)
        if op in ("call", "async-start"):
            callee = self.comps[ins.called()[0]]
            sub, root_tag = self.run(callee, [tags.get(o) for o in ops], mult)
            t.add(sub)
            return root_tag if op == "call" else None
        base = op[:-6] if op.endswith("-start") else op
        if base in _COLLECTIVES:
            out = ins.shape_elements()[-1] if op.endswith("-start") else ins.shape
            moved = sum(comp.by_name[o].bytes for o in ops) + shape_bytes(out)
            t.count(ins, moved * mult)
            if any(tags.get(o) in _WEIGHTY for o in ops):
                t.param_collective_bytes += shape_bytes(out) * mult
                # A gathered lookup table is still one: rows read from it are activations.
                return L if any(tags.get(o) == L for o in ops) else C
            return None
        reads, write = self._io(ins, comp, t, mult)
        t.count(ins, (sum(reads) + write) * mult)
        if op != "custom-call" and self._weight_copy(ins, comp, tags, reads, write):
            t.param_copy_bytes += write * mult
            return C
        return None

    def _io(self, ins: Instr, comp: Computation, t: Traffic, mult: int
            ) -> tuple[list[int], int]:
        """(bytes read per operand, bytes written) of one kernel-like op."""
        op = ins.op
        size = [comp.by_name[o].bytes for o in ins.operands]
        if op == "fusion":
            return self._fusion_io(ins, comp, self.comps[ins.called()[0]])
        if op == "dynamic-update-slice":  # in place: the target is not read
            return [0, *size[1:]], size[1]
        if op in ("dynamic-slice", "slice", "gather"):
            return [ins.bytes, *size[1:]], ins.bytes
        if op == "scatter":  # in place: reads indices and updates, writes the updated rows
            return [0, *size[1:]], size[-1]
        if op == "copy-start":
            return size, size[0]
        if op == "custom-call":
            return self._custom_call_io(ins, size, comp, t, mult)
        return size, ins.bytes

    def _custom_call_io(self, ins: Instr, size: list[int], comp: Computation, t: Traffic,
                        mult: int) -> tuple[list[int], int]:
        outs = ins.shape_elements()
        target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
        target_name = target.group(1) if target else ""
        if len(outs) > 1 and any(x in target_name for x in ("gemm", "cublas", "cudnn")) and \
                outs[-1].startswith(("s8[", "u8[")):
            outs = outs[:-1]  # the library's scratch workspace
        name = kernel_name(ins)
        m = self.model
        rule = m.kernel_rule(name) if (m.kernel_rule and name) else None
        if rule is None or m.pool_shape is None:
            if name and m.kernel_rule and "triton" in target_name:
                note = f"kernel {name}: no read rule, operands counted whole"
                if note not in t.notes:
                    t.notes.append(note)
            return size, sum(shape_bytes(s) for s in outs)
        pool = m.pool_shape
        if rule.idle:
            t.kernel_bytes.setdefault(name, 0)
            return [0] * len(size), 0
        in_pool = [same_array(comp.by_name[o].shape, pool) for o in ins.operands]
        reads = [rule.pool_read if p else b for p, b in zip(in_pool, size, strict=True)]
        if rule.read is not None:  # the other operands' loads, in operand order, capped
            left = rule.read
            for k, p in enumerate(in_pool):
                if not p:
                    reads[k] = min(left, size[k])
                    left -= reads[k]
        pool_outs = [s for s in outs if same_array(s, pool)]
        others = sum(shape_bytes(s) for s in outs if not same_array(s, pool))
        write = rule.pool_write * len(pool_outs) + (others if rule.write is None else
                                                    min(rule.write, others))
        t.kernel_bytes[name] = t.kernel_bytes.get(name, 0) + (sum(reads) + write) * mult
        return reads, write

    def _while(self, ins: Instr, tags: dict[str, object], mult: int, t: Traffic) -> object:
        cond_name, body_name = (re.search(rf"\b{k}=%?([\w.\-]+)", ins.attrs).group(1)
                                for k in ("condition", "body"))
        body, cond = self.comps[body_name], self.comps[cond_name]
        init = tags.get(ins.operands[0])
        init = init if isinstance(init, tuple) else ()
        # Only loop-invariant elements keep their tag: the body returns get-tuple-element k.
        root, arg = body.root, body.param(0)
        inv = []
        for k, tag in enumerate(init):
            src = body.by_name.get(root.operands[k]) if root.op == "tuple" and \
                k < len(root.operands) else None
            ok = src is not None and src.op == "get-tuple-element" and \
                src.operands[0] == getattr(arg, "name", None) and f"index={k}" in src.attrs
            inv.append(tag if ok else None)
        n, note = self.trip_count(ins)
        if note:
            t.notes.append(note)
        for c in (body, cond):
            sub, _ = self.run(c, [tuple(inv)], mult * n)
            t.add(sub)
        return tuple(inv)

    def _conditional(self, ins: Instr, tags: dict[str, object], mult: int, t: Traffic) -> None:
        best: Traffic | None = None
        branches = ins.called()
        op_name = _OP_NAME_ANY.search(ins.attrs)
        skipped = op_name is not None and any(f"{scope}/cond" in op_name.group(1)
                                              for scope in self.model.skip_scopes)
        branch = "smallest" if skipped else self.model.branch
        for k, name in enumerate(branches):
            arg = tags.get(ins.operands[k + 1]) if k + 1 < len(ins.operands) else None
            sub, _ = self.run(self.comps[name], [arg], mult)
            smaller = best is not None and sub.hbm_bytes < best.hbm_bytes
            if best is None or (smaller if branch == "smallest" else
                                sub.hbm_bytes > best.hbm_bytes):
                best = sub
        if best is not None:
            t.add(best)
        t.notes.append(f"{ins.name}: {branch} of {len(branches)} branches counted")
        return None


def estimate_traffic(hlo_text: str, model: HbmModel | None = None) -> Traffic:
    """Bytes moved by one run of the program whose optimized HLO text is given."""
    model = model or HbmModel()
    est = _Estimator(hlo_text, model)
    entry = est.comps[est.entry]
    n = sum(1 for i in entry.instrs if i.op == "parameter")
    tags: list[object] = [L if k in model.lookup_weights else W if k < model.num_weights
                          else None for k in range(n)]
    traffic, _ = est.run(entry, tags, 1)
    return traffic
