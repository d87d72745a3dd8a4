"""Compiled resources of the Pallas kernels in a GPU program: launch shape and ptxas's report.

XLA's dump of a GPU compile holds the thunk sequence: every kernel launch with its grid, threads
per block and dynamic shared memory. Registers per thread, spills, stack frame and static shared
memory come from ptxas itself, which XLA runs with `-arch=sm_90a -v`: its report is in XLA's log
when jax starts with `TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=subprocess_compilation=3` in the
environment (scripts/gpu_aot.py sets them; `capture_stderr` catches the compile's log).
Without that log, PTX files in the dump (jax 0.10 writes them; 0.11 does not) are assembled
again with the same ptxas and flags. The Pallas kernels are found by their names
(`pallas_kernels.KERNEL_PREFIXES`, the weight-streaming `decode_matmul_*` included). Each kernel's
widest global load comes from its entry in those PTX files (`ptx.max_global_load_bytes`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from jpaged.aot.ptx import load_widths
from pallas_kernels import KERNEL_PREFIXES

_THUNK = re.compile(r"kCustomKernel\s+\[[^\]]*\]\s+(\S+)\s+grid:\s*\[(\d+),\s*(\d+),\s*(\d+)\]"
                    r"\s+threads:\s*\[(\d+),\s*(\d+),\s*(\d+)\]\s+shared_memory:\s*(\d+)\s*bytes")
_ENTRY = re.compile(r"^\.visible \.entry (\S+)\(", re.M)
_PTXAS_FN = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                          r"(\d+) bytes spill loads")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
# Kernels that stream weights or K/V from HBM: each must load 16 bytes per thread per
# instruction and spill nothing (report.check_rows).
STREAMING_KERNEL_PREFIXES = ("decode_matmul", "paged_decode_", "ragged_paged_",
                             "moe_grouped_")
MIN_STREAMING_LOAD_BYTES = 16


@contextmanager
def capture_stderr() -> Iterator[list[str]]:
    """Collect what this process writes to file descriptor 2 (XLA's C++ log) meanwhile.

    The list it yields holds the text once the block has ended.
    """
    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


@dataclass
class KernelResources:
    """One Pallas kernel as compiled for the target GPU."""

    name: str
    registers: int | None  # per thread (ptxas)
    spill_bytes: int | None  # spill stores + spill loads (ptxas)
    stack_frame_bytes: int | None
    shared_memory_bytes: int  # per block: dynamic (launch) + static (ptxas)
    threads: int  # per block
    grid: tuple[int, int, int]
    launches: int  # times the program launches it (once per layer inside the scan body: 1)
    # Widest global load of its PTX entry, bytes per thread (0: none; None: no PTX found).
    max_global_load_bytes: int | None = None

    def as_dict(self) -> dict:
        """JSON-ready fields."""
        d = asdict(self)
        d["grid"] = list(self.grid)
        return d


def is_pallas_kernel(name: str) -> bool:
    """True for the launch names our Pallas kernels get (XLA may append a suffix)."""
    return name.startswith(KERNEL_PREFIXES)


@dataclass
class _Launch:
    name: str
    grid: tuple[int, int, int]
    threads: int
    dyn_smem: int


def parse_thunks(text: str) -> list[_Launch]:
    """Every kernel launch of a thunk-sequence dump."""
    out = []
    for m in _THUNK.finditer(text):
        g = tuple(int(x) for x in m.group(2, 3, 4))
        t = int(m.group(5)) * int(m.group(6)) * int(m.group(7))
        out.append(_Launch(m.group(1), g, t, int(m.group(8))))  # type: ignore[arg-type]
    return out


def find_ptxas() -> str | None:
    """The ptxas XLA would use: the pip CUDA packages' copy, else one on PATH."""
    try:
        import nvidia  # type: ignore[import-not-found]
    except ImportError:
        nvidia = None
    if nvidia is not None:
        for base in map(Path, nvidia.__path__):
            for cand in sorted(base.glob("*/bin/ptxas")):
                if cand.is_file():
                    return str(cand)
    return shutil.which("ptxas")


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """Per entry function: registers, spill, stack and static smem bytes from `ptxas -v`."""
    out: dict[str, dict[str, int]] = {}
    cur: dict[str, int] | None = None
    for line in log.splitlines():
        m = _PTXAS_FN.search(line)
        if m:
            cur = out.setdefault(m.group(1), {"smem": 0})
            continue
        if cur is None:
            continue
        if (m := _PTXAS_REGS.search(line)):
            cur["registers"] = int(m.group(1))
        if (m := _PTXAS_SPILL.search(line)):
            cur["stack"] = int(m.group(1))
            cur["spill"] = int(m.group(2)) + int(m.group(3))
        if (m := _PTXAS_SMEM.search(line)):
            cur["smem"] = int(m.group(1))
    return out


def ptxas_report(ptx_files: list[Path], wanted: set[str], ptxas: str, arch: str = "sm_90a"
                 ) -> dict[str, dict[str, int]]:
    """Assemble the PTX files that define `wanted` entries; ptxas's numbers per entry."""
    found: dict[str, dict[str, int]] = {}
    for path in ptx_files:
        text = path.read_text(errors="replace")
        if not wanted & set(_ENTRY.findall(text)):
            continue
        proc = subprocess.run([ptxas, f"-arch={arch}", "-v", "--warn-on-spills", str(path),
                               "-o", "/dev/null"], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"ptxas failed on {path.name}: {proc.stderr.strip()[-2000:]}")
        found.update({k: v for k, v in parse_ptxas(proc.stderr + proc.stdout).items()
                      if k in wanted})
    return found


def kernel_resources(dump: Path, ptxas: str | None, log: str = "") -> list[KernelResources]:
    """The Pallas kernels of the program dumped under `dump`, one entry per distinct name.

    `log`: XLA's captured log of the compile (its ptxas reports), used first.
    """
    seqs = sorted(dump.glob("*thunk_sequence.txt"))
    if not seqs:
        raise FileNotFoundError(f"XLA wrote no thunk sequence under {dump}")
    launches = [x for x in parse_thunks(seqs[0].read_text()) if is_pallas_kernel(x.name)]
    names = {x.name for x in launches}
    ptx = {k: v for k, v in parse_ptxas(log).items() if k in names}
    if ptxas and names - set(ptx):
        ptx.update(ptxas_report(sorted(dump.glob("*.ptx")), names - set(ptx), ptxas))
    widths = load_widths(sorted(dump.glob("*.ptx")), names) if names else {}
    out: dict[str, KernelResources] = {}
    for x in launches:
        if x.name in out:
            out[x.name].launches += 1
            continue
        p = ptx.get(x.name, {})
        spill = p.get("spill")
        out[x.name] = KernelResources(x.name, p.get("registers"), spill, p.get("stack"),
                                      x.dyn_smem + p.get("smem", 0), x.threads, x.grid, 1,
                                      widths.get(x.name))
    return list(out.values())
