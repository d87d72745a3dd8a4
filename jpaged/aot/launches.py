"""Kernel launches of a compiled GPU step, read from XLA's dumps: how many, how many per decoder
layer, which run outside command buffers (CUDA graphs), and the wide elementwise passes.

XLA's dump of a GPU compile holds the thunk sequence after its thunk passes
(`*thunk_sequence_after_thunk_passes.txt`): one line per thunk, `NNN: kKind [deps] label`,
nested thunks indented under the thunk that holds them (a kCommandBuffer's commands, a
kConditional's branches, a kWhile's condition and body, a kDynamicSliceFusion's copy).
`*thunk_metadata.txt` names each thunk id's HLO instruction (its profile annotation). What is
counted, statically (every thunk of the sequence once: both branches of a conditional, a loop
body once):

* a kernel launch: a kernel thunk (kKernel, kCustomKernel: XLA's fusions, Triton GEMMs, the
  Pallas kernels) or a library call (kGemm, kCublasLtMatmul, kCuDnn, kCustomCall,
  collectives, ...); copies and memsets (kCopy, kMemset32BitValue, kMemzero, ...) are counted
  apart (`copies_per_step`);
* outside command buffers: launches and copies with no kCommandBuffer above them, and control
  flow (kConditional, kWhile) outside one: its predicate goes back to the host each step;
* per layer: each launch is given the decoder layer whose weights its HLO instruction reads
  (entry parameters named `...layers_<i>_...`, through bitcasts); layer i starts at the first
  launch of layer i's weights, and `kernels_per_layer` is the median distance (in launches,
  nested ones included) between consecutive layer starts. Everything else is
  `kernels_outside_layers` (embedding, rope tables, final norm, logits, sampling).

`wide_elementwise_passes` reads the optimized HLO: loop fusions (XLA's elementwise kernels,
kind=kLoop) in the entry and the computations its control flow runs whose largest result array
holds at least tokens x hidden elements, in-place updates (a dynamic-update-slice or scatter
root) excepted. Each is one more pass over an activation a GEMM epilogue or a norm could have
fused.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jpaged.aot.hlo import Computation, arrays, parse_module
from jpaged.runner.model_runner import (  # noqa: F401 - re-exported for the report
    COMMAND_BUFFER_OPTIONS,
    COMMAND_BUFFER_TYPES,
)

# The options that put every thunk of a step into command buffers (CUDA graphs): the engine's
# own (jpaged/runner/model_runner.py), which its GPU step programs compile with. The target
# config says CUDA 12.9 (jpaged/aot/h200.txtpb): a deviceless compile without it would drop the
# command types that need 12.3.
# Every key a step row gets from `launch_fields` (None where it could not be read).
LAUNCH_KEYS = ("kernels_per_step", "copies_per_step", "kernels_in_control_flow",
               "kernels_per_layer", "kernels_outside_layers", "command_buffers",
               "kernels_outside_command_buffers", "control_flow_outside_command_buffers",
               "outside_command_buffers", "all_in_command_buffers", "wide_elementwise_passes",
               "wide_elementwise_fusions")
MAX_LISTED = 20

_LINE = re.compile(r"^([ \t]*)(\d+):\s+(k\w+)\s*\[[^\]]*\]\s*(.*?)\s*$")
_META_ID = re.compile(r"\bthunk_id:\s*(\d+)")
_META_NAME = re.compile(r'\bprofile_annotation:\s*"([^"]*)"')
_LAYER = re.compile(r"layers_+(\d+)_")
_KERNEL_KINDS = {"kKernel", "kCustomKernel"}
_CONTROL_KINDS = {"kConditional", "kWhile"}
# Thunks that only hold others or order them: no launch of their own.
_NO_WORK = {"kCommandBuffer", "kConditional", "kWhile", "kSequential", "kDynamicSliceFusion",
            "kAsyncStart", "kAsyncDone", "kWaitForStreams", "kGroup"}
_VIEWS = {"bitcast", "get-tuple-element", "reshape"}
_RUNS = {"while", "conditional", "call", "async-start"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}


def is_copy_kind(kind: str) -> bool:
    """True for thunks that copy or fill memory (kCopy, kMemset32BitValue, kMemzero, ...)."""
    return "Copy" in kind or "Mem" in kind


@dataclass
class Thunk:
    """One thunk of a dumped sequence, with what holds it."""

    id: int
    kind: str
    label: str  # the text after its dependencies (a kernel's name and launch shape)
    depth: int  # indentation
    in_command_buffer: bool = False
    in_control_flow: bool = False
    name: str = ""  # its HLO instruction (thunk metadata), else the label's first word

    @property
    def is_work(self) -> bool:
        """True when the thunk launches something itself (kernel, library call, copy)."""
        return self.kind not in _NO_WORK

    @property
    def is_kernel(self) -> bool:
        """A launch that is no copy: a kernel or a library call."""
        return self.is_work and not is_copy_kind(self.kind)


def parse_thunk_tree(text: str) -> list[Thunk]:
    """The thunks of a `*thunk_sequence*.txt` dump in order, each marked by its ancestors."""
    out: list[Thunk] = []
    stack: list[Thunk] = []
    for line in text.splitlines():
        m = _LINE.match(line.expandtabs(4))
        if not m:
            continue
        depth = len(m.group(1))
        while stack and stack[-1].depth >= depth:
            stack.pop()
        label = m.group(4)
        t = Thunk(int(m.group(2)), m.group(3), label, depth,
                  any(s.kind == "kCommandBuffer" for s in stack),
                  any(s.kind in _CONTROL_KINDS for s in stack),
                  label.split()[0] if label else m.group(3))
        out.append(t)
        stack.append(t)
    return out


def parse_thunk_metadata(text: str) -> dict[int, str]:
    """HLO instruction name (profile annotation) by thunk id, from `*thunk_metadata.txt`."""
    out = {}
    for block in text.split("thunk_metadata {")[1:]:
        i, n = _META_ID.search(block), _META_NAME.search(block)
        if i and n:
            out[int(i.group(1))] = n.group(1)
    return out


def instruction_layers(hlo_text: str) -> dict[str, int]:
    """Decoder layer of each entry instruction that reads one layer's weights (directly or
    through bitcasts): entry parameters whose names hold `layers_<i>_`."""
    comps, entry = parse_module(hlo_text)
    layer: dict[str, int] = {}
    out: dict[str, int] = {}
    for ins in comps[entry].instrs:
        if ins.op == "parameter":
            m = _LAYER.search(ins.name)
            if m:
                layer[ins.name] = int(m.group(1))
            continue
        found = {layer[o] for o in ins.operands if o in layer}
        if not found:
            continue
        if ins.op in _VIEWS:
            if len(found) == 1:
                layer[ins.name] = found.pop()
        else:
            out[ins.name] = min(found)
    return out


def kernels_per_layer(thunks: list[Thunk], layers: dict[str, int], num_layers: int
                      ) -> float | int | None:
    """Median launches between consecutive layer starts (None: the layers were not all seen,
    or out of order)."""
    launches = [t for t in thunks if t.is_kernel]
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for pos, t in enumerate(launches):
        k = layers.get(t.name)
        if k is not None:
            first.setdefault(k, pos)
            last[k] = pos
    if sorted(first) != list(range(num_layers)):
        return None
    if num_layers == 1:
        return last[0] - first[0] + 1
    starts = [first[k] for k in range(num_layers)]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    if min(gaps) <= 0:
        return None
    med = statistics.median(gaps)
    return int(med) if med == int(med) else med


@dataclass
class LaunchStats:
    """Launch counts of one compiled step (see the module doc for what each counts)."""

    kernels_per_step: int
    copies_per_step: int
    kernels_in_control_flow: int
    kernels_per_layer: float | int | None
    kernels_outside_layers: float | int | None
    command_buffers: int
    kernels_outside_command_buffers: int
    control_flow_outside_command_buffers: int
    outside_command_buffers: list[str] = field(default_factory=list)  # "kind name", capped
    all_in_command_buffers: bool = False


def launch_stats(thunks: list[Thunk], layers: dict[str, int] | None = None,
                 num_layers: int | None = None) -> LaunchStats:
    """Count the launches of a parsed thunk sequence (names already resolved)."""
    kernels = [t for t in thunks if t.is_kernel]
    copies = [t for t in thunks if t.is_work and not t.is_kernel]
    outside = [t for t in thunks if not t.in_command_buffer and t.kind != "kCommandBuffer"
               and (t.is_work or t.kind in _CONTROL_KINDS)]
    per_layer = (kernels_per_layer(thunks, layers, num_layers)
                 if layers is not None and num_layers else None)
    outside_layers = (len(kernels) - per_layer * num_layers
                      if per_layer is not None and num_layers else None)
    n_control = sum(t.kind in _CONTROL_KINDS for t in outside)
    return LaunchStats(
        kernels_per_step=len(kernels), copies_per_step=len(copies),
        kernels_in_control_flow=sum(t.in_control_flow for t in kernels),
        kernels_per_layer=per_layer, kernels_outside_layers=outside_layers,
        command_buffers=sum(t.kind == "kCommandBuffer" for t in thunks),
        kernels_outside_command_buffers=len(outside) - n_control,
        control_flow_outside_command_buffers=n_control,
        outside_command_buffers=[f"{t.kind} {t.name}" for t in outside[:MAX_LISTED]],
        all_in_command_buffers=not outside)


def _run_computations(comps: dict[str, Computation], entry: str) -> list[Computation]:
    """The entry and every computation its control flow runs (not fusion bodies)."""
    seen, order, todo = set(), [], [entry]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        order.append(comps[name])
        for ins in comps[name].instrs:
            if ins.op in _RUNS:
                todo.extend(ins.called())
    return order


def _largest_array(shape: str) -> tuple[int, str]:
    """(elements, "dtype[dims]") of the largest array of a shape (a tuple's elements too)."""
    best = (0, "")
    for dtype, dims in arrays(shape):
        n = math.prod(dims)
        if n > best[0]:
            best = (n, f"{dtype}[{','.join(map(str, dims))}]")
    return best


def wide_elementwise_passes(hlo_text: str, tokens: int, hidden: int) -> list[str]:
    """Loop fusions whose largest result holds >= tokens x hidden elements, as "name shape"
    (in-place dynamic-update-slice / scatter roots excepted)."""
    comps, entry = parse_module(hlo_text)
    want = tokens * hidden
    out = []
    for comp in _run_computations(comps, entry):
        for ins in comp.instrs:
            if ins.op != "fusion" or "kind=kLoop" not in ins.attrs:
                continue
            elements, text = _largest_array(ins.shape)
            if elements < want:
                continue
            body = [comps[c] for c in ins.called() if c in comps]
            if body and _in_place(body[0]):
                continue
            out.append(f"{ins.name} {text}")
    return out


def _in_place(body: Computation) -> bool:
    root = body.root
    if root.op in _IN_PLACE:
        return True
    if root.op == "tuple":
        return any(body.by_name[o].op in _IN_PLACE for o in root.operands if o in body.by_name)
    return False


@dataclass(frozen=True)
class StepShape:
    """What the per-step launch fields need of the step: its tokens, hidden size, layers."""

    tokens: int
    hidden_size: int
    num_layers: int


def _dump_file(dump: Path, *suffixes: str) -> Path | None:
    for suffix in suffixes:
        found = sorted(dump.glob(f"*{suffix}"))
        if found:
            return found[0]
    return None


def launch_fields(dump: Path, hlo_text: str, shape: StepShape) -> dict[str, Any]:
    """The LAUNCH_KEYS of one compiled step from its XLA dump and optimized HLO."""
    seq = _dump_file(dump, "thunk_sequence_after_thunk_passes.txt", "thunk_sequence.txt")
    if seq is None:
        raise FileNotFoundError(f"XLA wrote no thunk sequence under {dump}")
    thunks = parse_thunk_tree(seq.read_text())
    meta = _dump_file(dump, "thunk_metadata.txt")
    names = parse_thunk_metadata(meta.read_text()) if meta is not None else {}
    for t in thunks:
        t.name = names.get(t.id, t.name)
    layers = instruction_layers(hlo_text) if names else None
    stats = launch_stats(thunks, layers, shape.num_layers)
    wide = wide_elementwise_passes(hlo_text, shape.tokens, shape.hidden_size)
    return {**asdict(stats), "wide_elementwise_passes": len(wide),
            "wide_elementwise_fusions": wide[:MAX_LISTED]}
