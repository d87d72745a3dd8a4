"""Where a compiled step's time goes, kernel by kernel: a jax.profiler trace, summed by kind.

On a GPU the trace holds one event per kernel the device ran, on the device's own timeline;
its `hlo_op` argument names the HLO instruction the kernel came from (a fusion, a Pallas
custom call, a cuBLAS call). Summed per kind of op (the instruction's name less its numeric
suffix, as `jpaged.aot.hbm.Traffic.by_op` names kinds), the time says which kinds fall short
of their bytes, and the share of the step's wall time the device spent in kernels says how
much went to launch gaps instead. On XLA:CPU the events are the runtime's thunks on the host's
threads (a while loop's thunk encloses its body's, so there the kinds overlap).
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

_SUFFIX = re.compile(r"([._]\d+)+$")
# Instructions named for what launches them, not what runs: a device event of one is named by
# its kernel (a Pallas kernel's `name`, as the HBM estimate names it).
_BY_KERNEL_NAME = ("pallas_call", "custom-call", "custom_call")


def op_kind(name: str) -> str:
    """An instruction's or kernel's kind: the name less its numeric suffixes, '_' for '.'
    ("loop_add_fusion.3" and the kernel "loop_add_fusion_3" -> "loop_add_fusion")."""
    return _SUFFIX.sub("", name).replace(".", "_")


def trace_calls(fn: Callable[[], Any], calls: int, out: Path) -> Path:
    """Run `fn` (which blocks until its work is done) `calls` times under the profiler and
    copy the trace (Chrome trace JSON, gzipped) to `out`; returns `out`."""
    with tempfile.TemporaryDirectory(prefix="jpaged-trace-") as tmp:
        jax.profiler.start_trace(tmp)
        try:
            for _ in range(calls):
                fn()
        finally:
            jax.profiler.stop_trace()
        found = sorted(p for p in Path(tmp).rglob("*.trace.json.gz"))
        if not found:
            raise FileNotFoundError(f"the profiler wrote no *.trace.json.gz under {tmp}")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(found[-1], out)
    return out


def _events(doc: dict[str, Any], module: str | None) -> tuple[list[dict[str, Any]], str]:
    """The complete events of ops of `module` (substring of `hlo_module`; None: any), from
    the device processes when the trace has any, else from the host's; and which it was."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in doc.get("traceEvents", [])
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, n in names.items() if n.startswith("/device:")}
    ops = [e for e in doc.get("traceEvents", [])
           if e.get("ph") == "X" and "hlo_op" in e.get("args", {})
           and (module is None or module in str(e["args"].get("hlo_module", "")))]
    on_device = [e for e in ops if e["pid"] in devices]
    return (on_device, "device") if on_device else (ops, "host")


def summarize(trace: Path, calls: int, step_ms: float | None = None,
              module: str | None = None, top: int = 25) -> dict[str, Any]:
    """Per-step kernel counts and times of a trace of `calls` identical steps, by kind of op,
    largest first (`top` kinds); with the step's wall time, the share spent in kernels."""
    doc = json.loads(gzip.decompress(trace.read_bytes()))
    events, where = _events(doc, module)
    kinds: dict[str, list[float]] = {}
    for e in events:
        kind = op_kind(str(e["args"]["hlo_op"]))
        if where == "device" and kind in _BY_KERNEL_NAME:  # a Pallas kernel: its own name
            kind = op_kind(str(e.get("name", kind)))
        k = kinds.setdefault(kind, [0, 0.0])
        k[0] += 1
        k[1] += float(e.get("dur", 0.0))  # microseconds
    total_us = sum(v[1] for v in kinds.values())
    rows = [{"kind": k, "launches_per_step": round(n / calls, 2),
             "ms_per_step": round(us / calls / 1e3, 4),
             "share_of_kernel_time": round(us / total_us, 4) if total_us else 0.0}
            for k, (n, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1])]
    kernel_ms = total_us / calls / 1e3
    return {"events_from": where, "calls": calls,
            "launches_per_step": round(len(events) / calls, 2),
            "kernel_ms_per_step": round(kernel_ms, 4),
            "step_ms": step_ms,
            "kernel_share_of_step": (round(kernel_ms / step_ms, 4) if step_ms else None),
            "kinds": rows[:top], "kinds_left_out": max(0, len(rows) - top)}
