"""Where a compiled step's time goes, kernel by kernel: a jax.profiler trace, summed by kind.

On a GPU the trace holds one event per kernel the device ran, on the device's stream lines;
its `hlo_op` argument, where present, names the HLO instruction the kernel came from (a
fusion, a Pallas custom call, a cuBLAS call), else the kernel's own name stands in. Summed
per kind of op (the instruction's name less its numeric suffix, as
`jpaged.aot.hbm.Traffic.by_op` names kinds), the time says which kinds fall short of their
bytes, and the share of the step's wall time the device spent in kernels says how much went
to launch gaps instead. On XLA:CPU the events are the runtime's thunks on the host's threads
(a while loop's thunk encloses its body's, so there the kinds overlap).

XLA:GPU turns its command buffers (CUDA graphs) off while the profiler runs, so a traced step
launches every kernel on its own: its kernel times say where the work goes, but its wall
time is not the step's. The un-profiled time (`decode_rows.time_decode`) is the one that counts.
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
# Lines the trace viewer derives on a device from its kernels (one event per op, module or
# step, spanning kernels that are also on the stream lines): counted, they would count twice.
_DERIVED = ("XLA Modules", "XLA Ops", "Steps", "Framework", "Source", "TensorFlow")


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
    """The complete events of the kernels the device ran (its stream threads; the derived
    per-op and per-module lines of a device, which span those kernels again, left out), of
    `module` where an event names its module (substring of `hlo_module`; None: any); with no
    device process, the host's op events (`hlo_op`) instead. Returns them and which it was."""
    meta = [e for e in doc.get("traceEvents", []) if e.get("ph") == "M"]
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in meta
             if e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in meta
               if e.get("name") == "thread_name"}
    devices = {pid for pid, n in procs.items() if n.startswith("/device:")}

    def of_module(e: dict[str, Any], default: bool) -> bool:
        named = e.get("args", {}).get("hlo_module")
        return module is None or (module in str(named) if named is not None else default)

    spans = [e for e in doc.get("traceEvents", []) if e.get("ph") == "X"]
    on_device = [e for e in spans if e["pid"] in devices and of_module(e, True)]
    streams = {k for k, n in threads.items() if k[0] in devices and n.startswith("Stream")}
    if streams:
        on_device = [e for e in on_device if (e["pid"], e.get("tid")) in streams]
    else:
        on_device = [e for e in on_device
                     if not threads.get((e["pid"], e.get("tid")), "").startswith(_DERIVED)]
    if on_device:
        return on_device, "device"
    return [e for e in spans if "hlo_op" in e.get("args", {}) and of_module(e, False)], "host"


def summarize(trace: Path, calls: int, step_ms: float | None = None,
              module: str | None = None, top: int = 25) -> dict[str, Any]:
    """Per-step kernel counts and times of a trace of `calls` identical steps, by kind of op,
    largest first (`top` kinds); with the step's wall time, the share spent in kernels."""
    doc = json.loads(gzip.decompress(trace.read_bytes()))
    events, where = _events(doc, module)
    kinds: dict[str, list[float]] = {}
    for e in events:
        op = e.get("args", {}).get("hlo_op")
        kind = op_kind(str(op if op is not None else e.get("name", "?")))
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
