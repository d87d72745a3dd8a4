"""jpaged/bench/step_profile.py: kernel time by kind from a real profiler trace (XLA:CPU here)
and from a GPU-shaped trace written by hand; the device report's table of it."""

from __future__ import annotations

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from jpaged.bench.device_report import profile_markdown
from jpaged.bench.step_profile import op_kind, summarize, trace_calls


def test_op_kind_strips_numeric_suffixes_and_dots():
    assert op_kind("loop_add_fusion.3") == "loop_add_fusion"
    assert op_kind("loop_add_fusion_3") == "loop_add_fusion"  # a GPU kernel's name
    assert op_kind("gemm_fusion_dot.12.0") == "gemm_fusion_dot"
    assert op_kind("paged_decode_ppb8_ppp64") == "paged_decode_ppb8_ppp64"
    assert op_kind("while") == "while"


def test_a_real_trace_counts_each_call_of_the_named_module_once(tmp_path):
    def stepfn(x):
        return jnp.tanh(x @ x) + 1.0

    def other(x):
        return jnp.exp(x) * 2.0

    f, g = jax.jit(stepfn), jax.jit(other)
    x = jnp.ones((128, 128), jnp.float32)
    f(x).block_until_ready(), g(x).block_until_ready()

    def both():
        f(x).block_until_ready()
        g(x).block_until_ready()

    summaries = []
    for calls in (2, 4):
        trace = trace_calls(both, calls, tmp_path / f"t{calls}.trace.json.gz")
        assert trace.exists()
        summaries.append(summarize(trace, calls, step_ms=10.0, module="stepfn"))
        everything = summarize(trace, calls)  # both programs
        assert everything["launches_per_step"] > summaries[-1]["launches_per_step"]
    two, four = summaries
    assert two["events_from"] == "host"  # XLA:CPU: the runtime's thunks
    # Per step, whatever the number of calls traced: the same kernels of `stepfn` alone.
    assert two["launches_per_step"] == four["launches_per_step"] >= 1
    times = [k["ms_per_step"] for k in four["kinds"]]
    assert times == sorted(times, reverse=True)  # largest first
    assert {k["kind"] for k in two["kinds"]} == {k["kind"] for k in four["kinds"]}
    assert sum(k["launches_per_step"] for k in four["kinds"]) == four["launches_per_step"]
    assert sum(k["share_of_kernel_time"] for k in four["kinds"]) == pytest.approx(1, abs=1e-3)
    assert four["kernel_share_of_step"] == pytest.approx(four["kernel_ms_per_step"] / 10.0,
                                                         abs=1e-4)


def _gpu_trace(path):
    """Two steps on a GPU, as the profiler lays them out: host events (the launches, with the
    same hlo_op) and device events (the kernels), 'M' events naming the processes."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 7, "tid": 1, "name": "thread_name",
             "args": {"name": "Stream #13(Compute)"}},
            {"ph": "M", "pid": 7, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    events = []
    for step in range(2):
        t = step * 1000.0
        for name, op, dur in (("gemm_fusion_dot_3", "gemm_fusion_dot.3", 300.0),
                              ("gemm_fusion_dot_4", "gemm_fusion_dot.4", 100.0),
                              ("paged_decode_ppb8_ppp64", "pallas_call.12", 150.0),
                              ("loop_add_fusion", "loop_add_fusion", 50.0)):
            args = {"hlo_op": op, "hlo_module": "jit__step"}
            events.append({"ph": "X", "pid": 7, "tid": 1, "ts": t, "dur": dur, "name": name,
                           "args": args})
            events.append({"ph": "X", "pid": 1, "tid": 2, "ts": t, "dur": 5.0, "name": op,
                           "args": args})  # the host's launch: not a kernel
            events.append({"ph": "X", "pid": 7, "tid": 9, "ts": t, "dur": dur, "name": op,
                           "args": args})  # the derived per-op line: the same kernel again
            t += dur
        events.append({"ph": "X", "pid": 7, "tid": 1, "ts": t, "dur": 999.0, "name": "other",
                       "args": {"hlo_op": "fusion", "hlo_module": "jit_other"}})
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": meta + events}).encode()))
    return path


def test_a_gpu_trace_sums_device_kernels_by_kind(tmp_path):
    prof = summarize(_gpu_trace(tmp_path / "gpu.trace.json.gz"), 2, step_ms=1.2,
                     module="_step")
    assert prof["events_from"] == "device"
    assert prof["launches_per_step"] == 4
    assert prof["kernel_ms_per_step"] == pytest.approx(0.6)  # 300 + 100 + 150 + 50 us
    assert prof["kernel_share_of_step"] == pytest.approx(0.5)
    assert [(k["kind"], k["launches_per_step"], k["ms_per_step"]) for k in prof["kinds"]] == [
        ("gemm_fusion_dot", 2, 0.4), ("paged_decode_ppb8_ppp64", 1, 0.15),
        ("loop_add_fusion", 1, 0.05)]
    assert prof["kinds"][0]["share_of_kernel_time"] == pytest.approx(0.4 / 0.6, abs=1e-4)


def test_the_report_sets_predicted_bytes_beside_the_kernels(tmp_path):
    prof = summarize(_gpu_trace(tmp_path / "gpu.trace.json.gz"), 2, step_ms=1.2,
                     module="_step")
    row = {"kv_cache_dtype": "bfloat16", "batch": 1, "context_len": 1024, "step_ms": 1.2,
           "profile": prof}
    aot = {"cases": [{"model": "llama3-8b", "tensor_parallel_size": 1, "seqs": 1,
                      "kv_cache_dtype": "bfloat16", "context_len": 1024,
                      "largest_traffic": ["gemm_fusion_dot: bf16[2,4096] = 600000000 B",
                                          "gemm_fusion_dot: f32[4,2,6144] = 200000000 B",
                                          "paged_decode_ppb8_ppp64: (f32[1]) = 30000000 B"]}]}
    table = profile_markdown([row, {**row, "batch": 16, "profile": None}], aot)
    assert "B=1, context 1024: 4 kernels a step, 0.600 ms in kernels of a 1.2 ms step (50%)" \
        in table
    assert "B=16" not in table  # no profile, no table
    # 0.8 GB in 0.4 ms: 2,000 GB/s; 0.03 GB in 0.15 ms: 200 GB/s; no bytes for the add.
    assert "| gemm_fusion_dot | 2 | 0.400 | 66.7% | 0.80 | 2,000 |" in table
    assert "| paged_decode_ppb8_ppp64 | 1 | 0.150 | 25.0% | 0.03 | 200 |" in table
    assert "| loop_add_fusion | 1 | 0.050 | 8.3% |  |  |" in table


def test_device_kernels_without_op_names_are_named_by_their_kernel(tmp_path):
    """A device whose lines are not named Stream..., and kernels that carry no `hlo_op`: the
    kernel's name is the kind, and a derived 'XLA Modules' line is still left out."""
    meta = [{"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 3, "tid": 5, "name": "thread_name",
             "args": {"name": "XLA Modules"}}]
    events = [{"ph": "X", "pid": 3, "tid": 1, "ts": 0.0, "dur": 40.0,
               "name": "loop_add_fusion_12", "args": {}},
              {"ph": "X", "pid": 3, "tid": 1, "ts": 40.0, "dur": 60.0,
               "name": "gemm_fusion_dot_7", "args": {}},
              {"ph": "X", "pid": 3, "tid": 5, "ts": 0.0, "dur": 100.0, "name": "jit__step",
               "args": {"hlo_module": "jit__step"}}]
    path = tmp_path / "bare.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": meta + events}).encode()))
    prof = summarize(path, 1, module="_step")
    assert prof["events_from"] == "device" and prof["kernel_ms_per_step"] == pytest.approx(0.1)
    assert [k["kind"] for k in prof["kinds"]] == ["gemm_fusion_dot", "loop_add_fusion"]
