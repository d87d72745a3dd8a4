"""The KV pool in a compiled program: aliased in place, or copied? Read from XLA's own dumps.

A program is compiled with `xla_dump_to` (a per-compile option) and its buffer assignment is
parsed: every buffer value XLA allocates, which allocation holds it, and which allocations are
the program's parameters. The pool is updated in place when its parameter allocation is aliased
to an output (`input_output_alias` in the optimized module) and no value outside the pool's own
allocations has as many elements as the pool: a copy, a dtype conversion (XLA:CPU widening fp8
to f16) or a gather of the whole pool all need such a second buffer. Values inside the pool's
allocations (in-place scatters, Pallas kernels with aliased outputs, loop phis) are free.
"""

from __future__ import annotations

import math
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

_ALLOC = re.compile(r"^allocation (\d+): size (\d+)(.*)$")
_PARAM = re.compile(r"\bparameter (\d+), shape \|([^|]*)\|")
_VALUE = re.compile(r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)")
_ALIAS_BLOCK = re.compile(r"input_output_alias=\{(.*?)\}\s*,\s*entry_computation_layout")
_ALIAS_ENTRY = re.compile(r"\{[\d,\s]*\}:\s*\((\d+),")


@dataclass
class Value:
    """One buffer value of the assignment: its HLO name, bytes and shape text."""

    name: str
    size: int
    shape: str

    @property
    def elements(self) -> int:
        """Element count of an array shape (0 for tuples and scalars' empty dims)."""
        m = re.match(r"^[a-z0-9]+\[([\d,]*)\]", self.shape)
        if not m:
            return 0
        dims = [int(d) for d in m.group(1).split(",") if d]
        return math.prod(dims) if dims else 1


@dataclass
class Allocation:
    """One allocation: its size, the parameter it holds (if any) and its values."""

    index: int
    size: int
    parameter: int | None
    parameter_shape: str | None
    kind: str  # "parameter", "preallocated-temp", "thread-local", "constant", "temp"
    values: list[Value] = field(default_factory=list)


def parse_buffer_assignment(text: str) -> list[Allocation]:
    """The allocations of an XLA `*after_optimizations-buffer-assignment.txt` dump."""
    allocs: list[Allocation] = []
    for line in text.splitlines():
        m = _ALLOC.match(line)
        if m:
            rest = m.group(3)
            p = _PARAM.search(rest)
            kind = ("parameter" if p else "preallocated-temp" if "preallocated-temp" in rest
                    else "thread-local" if "thread-local" in rest
                    else "constant" if "constant" in rest else "temp")
            allocs.append(Allocation(int(m.group(1)), int(m.group(2)),
                                     int(p.group(1)) if p else None,
                                     p.group(2) if p else None, kind))
            continue
        v = _VALUE.match(line)
        if v and allocs:
            allocs[-1].values.append(Value(v.group(1), int(v.group(2)), v.group(3)))
    return allocs


def aliased_parameters(hlo_text: str) -> set[int]:
    """Parameter numbers that the optimized module aliases to an output."""
    header = hlo_text.split("\n", 1)[0]
    m = _ALIAS_BLOCK.search(header)
    if not m:
        return set()
    return {int(x) for x in _ALIAS_ENTRY.findall(m.group(1) + "}")}


def shape_text(shape: tuple[int, ...], dtype_name: str) -> str:
    """XLA's spelling of an array shape without layout, e.g. u8[6000,16,3,64]."""
    return f"{dtype_name}[{','.join(str(int(d)) for d in shape)}]"


@dataclass
class PoolReport:
    """What the buffer assignment says about the KV pool of one compiled program."""

    pool_params: list[int]  # parameter numbers holding the pool arrays (K and V)
    pool_aliased: bool  # every pool parameter aliased to an output, and no pool-sized copy
    copies: list[Value]  # values in temp allocations with >= the pool's elements (must be none)
    temp_bytes_in_dump: int  # bytes of the non-parameter, non-constant allocations
    largest_temps: list[Value]  # the biggest temp values, largest first (what the temps hold)


def pool_report(buffer_assignment: str, hlo_text: str, pool_shape: str) -> PoolReport:
    """Judge the pool of a program whose pool arrays have XLA shape `pool_shape` (per device).

    Raises ValueError when no parameter has that shape (the wrong shape was named).
    """
    allocs = parse_buffer_assignment(buffer_assignment)
    pool_allocs = [a for a in allocs if a.parameter_shape == pool_shape]
    if not pool_allocs:
        shapes = sorted({a.parameter_shape for a in allocs if a.parameter_shape})
        raise ValueError(f"no parameter of shape {pool_shape} in the buffer assignment; "
                         f"parameters: {shapes}")
    pool_elems = Value("pool", 0, pool_shape).elements
    # Only the pool is donated, so a copy of it can only land in a temp allocation.
    copies = [v for a in allocs if a.kind in ("preallocated-temp", "temp", "thread-local")
              for v in a.values if v.elements >= pool_elems]
    params = sorted(a.parameter for a in pool_allocs if a.parameter is not None)
    aliased = aliased_parameters(hlo_text)
    temps = [a for a in allocs if a.kind in ("preallocated-temp", "temp")]
    largest = sorted((v for a in temps for v in a.values), key=lambda v: -v.size)[:8]
    return PoolReport(params, all(p in aliased for p in params) and not copies, copies,
                      sum(a.size for a in temps), largest)


@contextmanager
def no_persistent_cache() -> Iterator[None]:
    """Compile for real: a program served from jax's persistent cache writes no XLA dump."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    cc.reset_cache()  # jax remembers whether the cache is used: ask again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        cc.reset_cache()


@contextmanager
def dump_dir() -> Iterator[Path]:
    """A fresh directory for one compile's XLA dump, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="jpaged-xla-dump-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def dump_options(path: Path, *, gpu: bool) -> dict[str, Any]:
    """Per-compile XLA options that write the optimized HLO, buffer assignment (and PTX)."""
    opts: dict[str, Any] = {"xla_dump_to": str(path), "xla_dump_hlo_as_text": True}
    if gpu:  # jax >= 0.11 writes the PTX only when asked; earlier versions accept it too
        opts["xla_gpu_dump_llvmir"] = True
    return opts


def find_dump(path: Path, suffix: str) -> Path:
    """The newest dumped file ending in `suffix` (one compile per directory)."""
    found = sorted(path.glob(f"*{suffix}"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"XLA wrote no *{suffix} under {path}")
    return found[-1]
