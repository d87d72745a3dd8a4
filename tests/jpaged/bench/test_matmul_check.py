"""The device check's decode matmul stage and copy ceiling (jpaged/bench/matmul_check.py,
copy_ceiling.py, kernel_timing.py) here, in the Pallas interpreter on tiny shapes: what a lent
GPU runs, so that a typo cannot waste its time; and what only lowering shows (one Triton
kernel per timed program, the copy kernel's launch)."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from helpers import lower_for_cuda

from jpaged.bench import matmul_check as mc
from jpaged.bench.copy_ceiling import copy_rates, pallas_copy
from jpaged.bench.kernel_timing import pipelined, unrolled
from pallas_kernels import decode_matmul as dm


def test_ideal_bytes_and_plans_of_the_8b_shapes():
    ks = mc.kernels_of(mc.gpu_config())
    # q/k/v: 4096 x (4096 + 2 x 1024) bf16 weights, the norm weight, x and the outputs.
    assert ks["qkv"].ideal_bytes(1, 2) == 2 * (4096 * 6144 + 4096 + 4096 + 6144)
    # gate and up: two 4096 x 14336 weights, one output of 14336 a row.
    assert ks["gate_up"].ideal_bytes(16, 2) == 2 * (2 * 4096 * 14336 + 4096 + 16 * 4096
                                                   + 16 * 14336)
    # down: 14336 x 4096 weight, x, and the residual read and the output written.
    assert ks["down"].ideal_bytes(64, 2) == 2 * (14336 * 4096 + 64 * 14336 + 2 * 64 * 4096)
    cfg = mc.gpu_config()
    for k in ks.values():
        plans = mc.sweep_plans(k, cfg)
        assert plans[0] == mc.default_plan(k, 1, 2) and len(plans) == len(set(plans)) <= 10
        for p in plans:  # every plan divides the shapes and its tiles fit shared memory
            assert k.k % p.block_k == 0 and all(n % p.block_n == 0 for n in k.ns)
            smem = p.num_stages * p.block_k * (p.block_n * k.weights_per_program + p.block_m)
            assert smem * 2 <= 160 * 1024


def test_unrolled_program_lowers_one_triton_kernel_for_all_its_calls():
    """U calls of a Pallas kernel in one timed program: jax lowers the jitted call once, so
    the GPU compiles the kernel once (the GPU's jax 0.11 compiles Triton while lowering)."""
    k = mc.kernels_of(mc.gpu_config())["o"]
    pallas, _ = mc.call_fns(k, interpret=False)
    s = jax.ShapeDtypeStruct
    args = [s((1, 4096), jnp.bfloat16), s((4096, 4096), jnp.bfloat16),
            s((1, 4096), jnp.bfloat16)]
    text = lower_for_cuda(unrolled(pallas, 3), *(args * 4))
    assert text.count("xla.gpu.triton") + text.count("triton_kernel_call") == 1
    assert "decode_matmul_residual" in text
    copy = lower_for_cuda(functools.partial(pallas_copy, block=4096, num_warps=4),
                          s((2**20,), jnp.float32))
    assert "copy16_float32_b4096_w4" in copy


def test_copy_kernel_and_rates_in_the_interpreter():
    x = jax.random.normal(jax.random.key(0), (3 * 256,), jnp.float32)
    np.testing.assert_array_equal(pallas_copy(x, block=256, num_warps=4, interpret=True),
                                  np.asarray(x) + 1)
    u = jnp.arange(512, dtype=jnp.uint32)
    np.testing.assert_array_equal(pallas_copy(u, block=128, num_warps=4, add=False,
                                              interpret=True), np.asarray(u))
    r = copy_rates(2**17, interpret=True, repeats=1, target_s=1e-4)
    assert r["errors"] == {} and set(r["rates"]) >= {"jax_bf16", "jax_f32"}
    assert len(r["rates"]) == 6
    # The best of the 16-byte methods: never the bf16 one (8-byte accesses).
    assert r["copy_16byte_method"] != "jax_bf16"
    assert r["copy_GBps_16byte"] == max(v for k, v in r["rates"].items() if k != "jax_bf16")
    assert r["copy_GBps_jax_bf16"] == r["rates"]["jax_bf16"]


def test_pipelined_timer_counts_per_unit():
    f = jax.jit(lambda x: x * 2)
    t = pipelined(f, (jnp.ones(16),), per_call=4, repeats=3, target_s=1e-3)
    assert 0 < t.min_s <= t.median_s <= t.max_s and t.calls >= 1
    assert set(t.as_dict()) == {"us", "us_min", "us_max"}


def test_matmul_stage_runs_every_job_and_finds_a_wrong_kernel(tmp_path, monkeypatch):
    # (A swept plan for q/k/v keeps RoPE's half-slabs >= 16 columns: block_n 32 at head_dim 32.)
    cfg = dataclasses.replace(mc.smoke_config(), rows=(3,), priority_rows=(3,), sweep_rows=3,
                              sweep=((32, 32, 2, 4),), sweep_plans=2, layouts=True)
    doc = mc.MatmulCheck(cfg, copy_gbps=10.0, budget_s=1e9).run()
    assert doc["failures"] == []
    assert [(c["kernel"], c["rows"], c["ok"]) for c in doc["matmul_checks"]] == [
        (k, 3, True) for k in mc.KERNELS]
    assert {(t["kernel"], t["impl"]) for t in doc["matmul_timings"]} == {
        (k, i) for k in mc.KERNELS for i in ("pallas", "xla")}
    for t in doc["matmul_timings"]:
        assert t["us"] > 0 and t["GBps"] >= 0 and t["calls_per_program"] == 2
        gbps = t["ideal_bytes"] / (t["us"] * 1e-6) / 1e9
        assert t["pct_of_copy_16byte"] == round(100 * gbps / 10.0, 1)
    # Per kernel of the engine's layout: the default plan (its time the A/B row's) and the one
    # swept plan; the [N, K] layout is timed at its default plan only.
    assert [(s["kernel"], s["default"]) for s in doc["matmul_sweep"]] == [
        (k, d) for k in mc.MAIN_KERNELS for d in (True, False)]
    assert set(doc["matmul_best_plans"]) == set(mc.MAIN_KERNELS)
    best = doc["matmul_best_plans"]["qkv"]
    assert best["plans_tried"] == 2 and best["us"] <= best["default_us"]
    assert "best plan qkv" in mc.summary(doc)
    # A kernel that computes something else is caught by the comparison with its twin.
    real = dm.projection_residual
    monkeypatch.setattr(dm, "projection_residual",
                        lambda x, w, r, b=None, **kw: real(x, w, r, b, **kw) + 1)
    doc = mc.MatmulCheck(dataclasses.replace(cfg, sweep=()), None, 1e9).run()
    assert [c["ok"] for c in doc["matmul_checks"]] == [True, True, False, False] * 2
    assert "pct_of_copy_16byte" not in doc["matmul_timings"][0]  # no ceiling given
    # Over budget: every job is named as skipped.
    doc = mc.MatmulCheck(cfg, None, budget_s=-1).run()
    assert doc["matmul_timings"] == [] and all(
        f["error"] == "skipped: time budget" for f in doc["failures"])
    # The CLI takes the ceiling from the kernels stage's JSON.
    kern = tmp_path / "kernels.json"
    kern.write_text(json.dumps({"copy_GBps_16byte": 123.0, "copy_16byte_method": "jax_f32",
                                "copy_GBps_jax_bf16": 100.0}))
    assert mc._ceiling(kern) == (123.0, {"copy_GBps_16byte": 123.0,
                                         "copy_16byte_method": "jax_f32",
                                         "copy_GBps_jax_bf16": 100.0})
    assert mc._ceiling(tmp_path / "missing.json") == (None, None)
