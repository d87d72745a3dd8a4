"""scripts/device_check.sh end to end in its CPU smoke mode: the same steps as on a lent GPU
(kernel checks and timings with the 16-byte copy ceiling, the decode matmul kernels against
XLA with their tile sweep, the decode rows' matmul A/B, speculative decoding's verifying step
beside plain decode, decode rows with XLA's split-K forced off, the quantized weights (fp8,
int4) beside their bf16 twins, the MoE grouped matmul, the engine on random weights with both
loops compared, the host work per request-step, one merged JSON), tiny shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "device_check.sh"


def test_device_check_cpu_smoke(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu-smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "device_check.json").read_text())
    assert (doc["kernels_rc"], doc["matmuls_rc"], doc["decode_rc"], doc["engine_rc"],
            doc["host_rc"], doc["decode_split_k_off_rc"], doc["quant_rc"],
            doc["moe_rc"]) == (0,) * 8
    assert doc["stages"] == ["kernels", "matmuls", "decode", "split_k", "quant", "moe",
                             "engine", "host"]
    log = (tmp_path / "device_check.log").read_text()
    assert "== decode step rows" in log and log.count("== stage took") == 8
    # The MoE grouped matmul kernel (interpreted) on routed rows, checked.
    assert [r["tokens"] for r in doc["moe_ab"]] == [1, 5] and all(r["ok"] for r in doc["moe_ab"])
    assert [r["tokens"] for r in doc["moe_block"]] == [1, 4]
    assert all(r["ok"] for r in doc["moe_block"])
    # The split-K-off rows right after the decode rows they are compared with.
    assert log.index("split-K off (limit") < log.index("== engine check")
    kernels, engine, host = doc["kernels"], doc["engine"], doc["host"]
    assert kernels["mode"] == "cpu-smoke" and kernels["failures"] == []
    assert kernels["copy_GBps"] > 0 and kernels["copy_GBps_f32"] > 0  # bf16 and f32 copies
    # The honest ceiling: the best 16-byte copy (a Pallas kernel or jax's float32 x + 1),
    # beside jax's bf16 x + 1; at the merged document's top level too.
    assert set(kernels["copy_rates"]) == {
        "jax_bf16", "jax_f32", "pallas_f32_b4096_w4", "pallas_f32_b16384_w8",
        "pallas_bf16_b8192_w4", "pallas_u32_copy_b4096_w4"}
    assert kernels["copy_GBps_16byte"] == kernels["copy_rates"][kernels["copy_16byte_method"]]
    assert kernels["copy_16byte_method"] != "jax_bf16"
    assert (doc["copy_GBps_16byte"], doc["copy_16byte_method"], doc["copy_GBps_jax_bf16"]) == (
        kernels["copy_GBps_16byte"], kernels["copy_16byte_method"],
        kernels["copy_GBps_jax_bf16"])
    assert all("frac_copy_16byte" in t for t in kernels["timings"])
    # The decode matmul kernels against XLA's twins, correct, with their tile sweep.
    mm = doc["matmuls"]
    assert mm["failures"] == [] and mm["copy_GBps_16byte"] == kernels["copy_GBps_16byte"]
    main = ("qkv", "gate_up", "o", "down")
    # The engine's layout at rows 1 and 4 (the [N, K] layout is left to the GPU run and
    # tests/jpaged/bench/test_matmul_check.py).
    assert [(c["kernel"], c["rows"]) for c in mm["matmul_checks"]] == [
        (k, r) for r in (1, 4) for k in main]
    assert all(c["ok"] for c in mm["matmul_checks"])
    assert len(mm["matmul_timings"]) == 16 and len(mm["matmul_sweep"]) == 8
    assert set(doc["matmul_best_plans"]) == {"qkv", "gate_up", "o", "down"}
    assert len(kernels["checks"]) >= 8 and all(c["ok"] for c in kernels["checks"])
    assert {t["impl"] for t in kernels["timings"]} >= {"pallas-decode", "pallas-ragged",
                                                       "pallas-kv_write"}
    assert engine["mode"] == "cpu-smoke"
    assert [r["kv_cache_dtype"] for r in engine["runs"]] == ["bfloat16", "fp8_e4m3"]
    for run in engine["runs"]:
        assert run["greedy_equal"], run
        assert all(len(t) == 4 for t in run["tokens_pallas"])  # ignore_eos: every new token
        assert [t["batch"] for t in run["throughput"]] == [1, 4]
        assert all(t["output_tokens_per_s"] > 0 for t in run["throughput"])
        # fp8 pages are half as big: the same 16 MiB buys twice the blocks.
        assert run["pallas_pool"] == run["xla_pool"]
    assert engine["runs"][1]["pallas_pool"]["num_blocks"] > engine["runs"][0]["pallas_pool"][
        "num_blocks"]
    # The synchronous and the overlapped loop, once (first KV dtype), on the largest batch.
    overlap = engine["runs"][0]["overlap"]
    assert overlap["batch"] == 4 and overlap["outputs_identical"] is True
    assert len(overlap["async_ratio_per_round"]) == 3 and overlap["async_ratio"] > 0
    assert "overlap" not in engine["runs"][1]
    # The decode step rows gpu-aot predicts, measured: each KV dtype, batch and context.
    assert engine["decode_rows"] == []  # measured in their own stage, before the engine check
    rows = doc["decode"]["decode_rows"]
    # The first KV dtype's batch 4 twice: greedy, then drawing at random through every filter.
    assert [(r["kv_cache_dtype"], r["batch"], r["context_len"], r.get("sampling"))
            for r in rows] == [("bfloat16", 1, 40, None), ("bfloat16", 4, 40, None),
                               ("bfloat16", 4, 40, "random"), ("fp8_e4m3", 1, 40, None),
                               ("fp8_e4m3", 4, 40, None)]
    assert all(r["step_ms"] > 0 and r["output_tokens_per_s"] > 0 for r in rows), rows
    # The decode matmul A/B (the Pallas backend runs the kernels at these batches): the
    # engine's step and its twin with XLA's GEMMs, on one pool; the random row is the
    # engine's step alone.
    ab = [r for r in rows if r.get("sampling") is None]
    assert all(r["ms_kernels"] == r["step_ms"] and r["ms_xla"] > 0 for r in ab), rows
    assert rows[2]["decode_matmuls"] == "kernels" and "ms_xla" not in rows[2]
    assert [(r["kv_cache_dtype"], r["batch"]) for r in doc["decode_ab"]] == [
        (r["kv_cache_dtype"], r["batch"]) for r in ab]
    # The profiled row (the first KV dtype's greedy batch 4): its kernels by kind.
    assert [r["batch"] for r in rows if "profile" in r] == [4], rows
    prof = rows[1]["profile"]
    assert prof["step_ms"] == rows[1]["step_ms"] and prof["launches_per_step"] > 0
    assert prof["kinds"] and "decode profile B=4 ctx=40" in log
    # ... and the twin's step (XLA's GEMMs) beside it.
    assert rows[1]["profile_xla"]["step_ms"] == rows[1]["ms_xla"]
    assert "decode profile (XLA's GEMMs) B=4 ctx=40" in log
    # Speculative decoding's verifying step (B=1, k=3: one sequence of 4 tokens and rows, a
    # verifying program of its own) beside the plain decode step of its batch, same pool.
    verify = doc["decode"]["verify_rows"]
    assert [(r["kv_cache_dtype"], r["batch"], r["k"], r["rows"], r["bucket"], r["context_len"])
            for r in verify] == [("bfloat16", 1, 3, 4, 4, 40)], verify
    v = verify[0]
    assert v["verify_ms"] > 0 and v["decode_ms"] > 0 and v["new_programs"] == 1
    assert v["break_even_accepted"] == v["ratio"] == round(v["verify_ms"] / v["decode_ms"], 3)
    assert doc["verify_rows"] == [{k: v[k] for k in (
        "kv_cache_dtype", "batch", "k", "rows", "bucket", "context_len", "verify_ms",
        "decode_ms", "ratio", "break_even_accepted")}]
    assert "verify row {" in log and "break-even tokens/step" in log
    assert "verify bfloat16 B=1 k=3 (4 rows, bucket 4) ctx=40" in log
    # The bf16 rows again with XLA's split-K heuristic forced off (the flag reaches XLA).
    off = doc["decode_split_k_off"]
    assert "--xla_gpu_experimental_force_split_k=1" in off["xla_flags"]
    assert "--xla_gpu_experimental_force_split_k" not in doc["decode"]["xla_flags"]
    assert [(r["kv_cache_dtype"], r["batch"]) for r in off["decode_rows"]] == [("bfloat16", 4)]
    assert all(r["step_ms"] > 0 for r in off["decode_rows"]), off
    # The quantized weights: every kernel alone with fp8 and int4 weights, correct, beside the
    # matmul stage's bf16 time; the decode step with each beside the decode stage's bf16 step.
    quant = doc["quant"]
    assert quant["failures"] == [] and log.index("== quantized weights") < log.index(
        "== engine check")
    assert sorted((r["kernel"], r["weights"]) for r in doc["quant_ab"]) == sorted(
        (k, w) for k in main for w in ("fp8", "int4"))
    assert all(r["ok"] and r["bf16_us"] and r["bf16_over_quant"] > 0 for r in doc["quant_ab"])
    assert [(r["weights"], r["batch"], r["decode_matmuls"]) for r in doc["quant_decode"]] == [
        ("fp8", 1, "kernels"), ("int4", 1, "kernels")]
    bf16_b1 = next(r["step_ms"] for r in rows if r["batch"] == 1
                   and r["kv_cache_dtype"] == "bfloat16")
    assert all(r["bf16_step_ms"] == bf16_b1 and r["step_ms"] > 0 for r in doc["quant_decode"])
    # fp8's load-time quantization of the widest projection: the scale search beside absmax.
    fq = quant["fp8_quantize"]
    assert fq["shape"] == [64, 128] and fq["candidates"] == 16, fq
    assert fq["search_s"] > 0 and fq["absmax_s"] > 0 and "fp8 at load [64, 128]" in log
    # Host work per request-step of both loops (the tiny model; no embedded model there).
    assert [(r["mode"], r["batch"]) for r in host["rows"]] == [("sync", 4), ("async", 4)]
    assert all(r["host_us_per_request_step"] > 0 for r in host["rows"])
    assert host["embedded"] is None and host["core_process_rows"] == []
    assert list(host["timelines"]) == ["tiny model, 4 requests"]
    assert not list(tmp_path.glob("*.png"))  # --no-plot: the GPU image has no matplotlib
