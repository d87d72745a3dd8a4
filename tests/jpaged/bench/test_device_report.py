"""The device report reads the first H200 run's log as it came back (a stage cut short by its
time limit) and sets each decode row beside the case `make gpu-aot` predicted."""

from __future__ import annotations

import json
from pathlib import Path

from jpaged.bench.device_report import collect, compare, main, markdown

ROOT = Path(__file__).resolve().parents[3]
AOT = ROOT / "docs" / "bench" / "gpu_aot_decode_jax0.10.2.json"


def test_rows_from_the_log_and_a_json_beside_their_prediction(tmp_path):
    run = tmp_path / "1"
    run.mkdir()
    (run / "device_check.log").write_text(
        (ROOT / "docs" / "bench" / "device_h200" / "run1_device_check.log").read_text())
    second = tmp_path / "2"
    second.mkdir()
    fp8 = {"kv_cache_dtype": "fp8_e4m3", "batch": 16, "context_len": 4096, "step_ms": 8.684,
           "output_tokens_per_s": 1842.5, "iters": 10}
    (second / "decode_fp8.json").write_text(json.dumps([fp8]))
    doc = collect([run, second])
    keys = [(r["kv_cache_dtype"], r["batch"], r["context_len"]) for r in doc["decode_rows"]]
    assert keys == [("bfloat16", b, c) for b in (1, 16, 64, 256) for c in (1024, 4096)] + [
        ("fp8_e4m3", 16, 4096)]
    # The prediction that run was set beside (make gpu-aot of that day): 8B bf16 batch 1, 1k.
    aot = {"hbm_bytes_per_s": 4.8e12, "cases": [
        {"model": "llama3-8b", "tensor_parallel_size": 1, "program": "step",
         "kv_cache_dtype": "bfloat16", "seqs": 1, "context_len": 1024,
         "hbm_bytes": 15371749352, "min_hbm_bytes": 16195384320, "predicted_step_ms": 3.202,
         "predicted_step_ms_at_80pct": 4.003}]}
    rows = compare(doc["decode_rows"], aot, copy_gbps=2711.0)
    b1 = rows[0]
    # 15,371,749,352 predicted bytes in 6.206 ms measured; the prediction is 3.202 ms at peak.
    assert b1["measured_over_predicted"] == round(6.206 / 3.202, 2)
    assert b1["achieved_GBps"] == round(15371749352 / 6.206e-3 / 1e9)
    assert b1["achieved_fraction_of_copy"] == round(15371749352 / 6.206e-3 / 1e9 / 2711.0, 3)
    skipped = rows[7]
    assert "step_ms" not in skipped and "65536 blocks" in skipped["skipped"]
    table = markdown(rows)
    assert "| bfloat16 | 1 | 1024 | 6.21 | 161 | 3.20 / 4.00 | 1.94x | 2.48 (52%) |" in table
    assert "not run: 256 x 4096 tokens need 65536 blocks" in table
    # A row drawn at random is set beside the step's largest branches (hbm_bytes_sampling).
    aot["cases"][0]["hbm_bytes_sampling"] = 19_200_000_000  # 4.0 ms at 4.8 TB/s
    random = {**doc["decode_rows"][0], "sampling": "random", "step_ms": 8.0}
    r = compare([random], aot, copy_gbps=None)[0]
    assert (r["hbm_bytes"], r["predicted_ms"], r["measured_over_predicted"]) == (
        19_200_000_000, 4.0, 2.0)
    assert r["predicted_ms_at_80pct"] == 5.0  # 19.2 GB at 80% of 4.8 TB/s
    assert "| bfloat16 (random) | 1 | 1024 | 8.00 |" in markdown([r])
    # With the candidates' figure (its top-k 64 lets them settle the rows) that is the
    # prediction, and the whole-row worst case rides beside it.
    aot["cases"][0]["hbm_bytes_sampling_candidates"] = 16_800_000_000  # 3.5 ms
    r = compare([random], aot, copy_gbps=None)[0]
    assert (r["hbm_bytes"], r["predicted_ms"], r["worst_hbm_bytes"], r["worst_predicted_ms"]
            ) == (16_800_000_000, 3.5, 19_200_000_000, 4.0)
    assert "| 3.50 / 4.38 (whole row: 4.00) | 2.29x |" in markdown([r])


def test_main_writes_the_merged_document(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "nvidia_smi.csv").write_text("name\nNVIDIA H200\n")
    (run / "engine_bf16.json").write_text(json.dumps(
        {"model": "random llama", "runs": [{"kv_cache_dtype": "bfloat16", "greedy_equal": True}],
         "decode_rows": []}))
    out = tmp_path / "merged.json"
    assert main([str(run), "--aot", str(AOT), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["engine_runs"] == [{"kv_cache_dtype": "bfloat16", "greedy_equal": True}]
    assert doc["nvidia_smi"].endswith("NVIDIA H200")
    assert doc["aot_source"] == "gpu_aot_decode_jax0.10.2.json (jax 0.10.2)"
    assert "| KV | B | context |" in capsys.readouterr().out


def test_new_keys_of_a_run_the_matmul_ab_and_the_copy_ceilings(tmp_path, capsys):
    """A run with the decode matmul stage: the A/B columns of the decode rows (a JSON row over
    its log line; split-K-off rows beside, not over, the default ones), the copy ceilings,
    the matmul table, the sweep and the best plans."""
    from jpaged.bench.device_report import ceiling_line, matmul_markdown, profile_markdown

    run = tmp_path / "run"
    run.mkdir()
    ab = {"kv_cache_dtype": "bfloat16", "batch": 1, "context_len": 1024, "step_ms": 5.0,
          "output_tokens_per_s": 200.0, "iters": 10, "ms_kernels": 5.0, "ms_xla": 6.2,
          "xla_over_kernels": 1.24, "decode_matmuls": "kernels"}
    big = {"kv_cache_dtype": "bfloat16", "batch": 256, "context_len": 1024, "step_ms": 36.0,
           "output_tokens_per_s": 7111.1, "iters": 10, "ms_xla": 36.0,
           "decode_matmuls": "one program: over 64 rows both paths run XLA's GEMMs"}
    off = {**big, "step_ms": 30.0, "ms_xla": 30.0}
    prof = {"events_from": "device", "calls": 3, "launches_per_step": 600,
            "kernel_ms_per_step": 4.0, "step_ms": 5.0, "kernel_share_of_step": 0.8,
            "kinds": [{"kind": "decode_matmul_gate_up", "launches_per_step": 32,
                       "ms_per_step": 1.9, "share_of_kernel_time": 0.5}]}
    (run / "device_check.log").write_text(
        "== decode step rows (limit 170 s)\n"
        f"  decode row {ab}\n  decode row {big}\n"
        "== decode step rows, bf16 KV, XLA split-K off (limit 90 s)\n"
        f"  decode row {off}\n== engine check (limit 190 s)\n")
    (run / "decode.json").write_text(json.dumps(
        {"xla_flags": "", "decode_rows": [{**ab, "profile": prof,
                                           "profile_xla": {**prof, "step_ms": 6.2}}, big]}))
    (run / "kernels.json").write_text(json.dumps(
        {"checks": [], "copy_GBps": 2711.0, "copy_GBps_f32": 4000.0,
         "copy_GBps_16byte": 4300.0, "copy_16byte_method": "pallas_f32_b16384_w8",
         "copy_GBps_jax_bf16": 2700.0,
         "copy_rates": {"jax_bf16": 2700.0, "pallas_f32_b16384_w8": 4300.0}}))
    timing = {"kernel": "qkv", "rows": 1, "us": 13.0, "GBps": 3900.0,
              "pct_of_copy_16byte": 90.7, "ideal_us_at_copy_16byte": 11.8,
              "xla_over_pallas": 1.5, "max_abs_err": 0.0078, "ok": True}
    (run / "matmul.json").write_text(json.dumps({
        "device": "NVIDIA H200", "shapes": {"hidden": 4096}, "copy_GBps_16byte": 4300.0,
        "matmul_timings": [{**timing, "impl": "pallas"},
                           {**timing, "impl": "xla", "us": 19.5, "GBps": 2600.0,
                            "pct_of_copy_16byte": 60.5}],
        "matmul_sweep": [{"kernel": "qkv", "rows": 1, "block_n": 32, "block_k": 256,
                          "num_stages": 3, "num_warps": 4, "default": True, "us": 13.0,
                          "GBps": 3900.0, "pct_of_copy_16byte": 90.7, "ok": True}],
        "matmul_best_plans": {"qkv": {"rows": 1, "plan": {
            "block_m": 16, "block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 3},
            "us": 13.0, "GBps": 3900.0, "pct_of_copy_16byte": 90.7, "default_us": 13.0,
            "default_over_best": 1.0}}}))
    doc = collect([run])
    rows = doc["decode_rows"]
    assert [(r["batch"], r.get("xla_split_k")) for r in rows] == [(1, None), (256, None),
                                                                    (256, "off")]
    assert "profile_xla" in rows[0]  # the JSON's row (with its profiles), not the log's
    assert doc["ceilings"]["copy_GBps_16byte"] == 4300.0
    assert doc["ceilings"]["copy_16byte_method"] == "pallas_f32_b16384_w8"
    line = ceiling_line(doc["ceilings"])
    assert "4,300 GB/s with 16-byte accesses (pallas_f32_b16384_w8)" in line
    assert "jax's bf16 x + 1 2,700 GB/s" in line
    table = markdown(compare(rows, {"hbm_bytes_per_s": 4.8e12, "cases": []}, 2711.0))
    assert "| 6.20 | 5.00 | 1.24x |" in table  # ms with XLA's GEMMs, with the kernels
    assert "| 36.00 | same program |  |" in table
    assert "| bfloat16 (split-K off) | 256 | 1024 | 30.00 |" in table
    mm = matmul_markdown(doc["matmuls"])
    assert "| qkv | 1 | 13.0 | 19.5 | 1.50x | 3,900 (91%) | 2,600 (60%) | 11.8 | 0.0078 | yes |" \
        in mm
    assert "| qkv | 1 | 32 | 256 | 3 | 4 | 13.0 | 3,900 (91%) | default |" in mm
    assert "| qkv | bn 32, bk 256, 3 stages, 4 warps (1) | 13.0 | 90.7 | 13.0 | 1.0x |" in mm
    prof_md = profile_markdown(rows)
    assert "bfloat16, B=1, context 1024, XLA's GEMMs (decode_matmuls=False)" in prof_md
    assert prof_md.count("| decode_matmul_gate_up | 32 |") == 2
    # The 16-byte fraction rides beside the old one where a prediction exists.
    aot = {"hbm_bytes_per_s": 4.8e12, "cases": [
        {"model": "llama3-8b", "tensor_parallel_size": 1, "kv_cache_dtype": "bfloat16",
         "seqs": 1, "context_len": 1024, "hbm_bytes": 15e9, "min_hbm_bytes": 16e9}]}
    r = compare(rows[:1], aot, 2711.0, 4300.0)[0]
    assert r["achieved_fraction_of_copy_16byte"] == round(15e9 / 5e-3 / 1e9 / 4300.0, 3)
    assert main([str(run), "--aot", str(AOT)]) == 0
    out = capsys.readouterr().out
    assert "Copy ceiling" in out and "Decode matmuls on NVIDIA H200" in out


def test_quant_and_verify_tables_from_a_device_check_json(tmp_path, capsys):
    """device_check.json's quantized-weights rows (`quant_ab`, `quant_decode`) and verifying
    steps (`verify_rows`, the decode stage's over the merged ones; a log's line where no JSON
    has the row), with the card's name and the 16-byte copy rate."""
    from jpaged.bench.device_report import card, quant_markdown, verify_markdown

    run = tmp_path / "run"
    run.mkdir()
    verify = {"kv_cache_dtype": "bfloat16", "batch": 1, "k": 7, "rows": 8, "bucket": 16,
              "context_len": 1024, "verify_ms": 9.3, "decode_ms": 6.2, "ratio": 1.5,
              "break_even_accepted": 1.5}
    skipped = {"kv_cache_dtype": "bfloat16", "batch": 16, "k": 3, "context_len": 1024,
               "skipped": "time budget"}
    (run / "device_check.json").write_text(json.dumps({
        "stages": ["decode", "quant"], "decode_rc": 0, "quant_rc": 0,
        "copy_GBps_16byte": 4300.0, "copy_16byte_method": "jax_f32",
        "nvidia_smi": "name, memory.total [MiB]\nNVIDIA H200, 143771 MiB\n",
        "decode": {"device": "NVIDIA H200", "decode_rows": [],
                   "verify_rows": [{**verify, "iters": 10, "new_programs": 0}, skipped]},
        "verify_rows": [{**verify, "verify_ms": 1.0}],  # the stage's own row wins
        "quant_ab": [{"weights": "fp8", "kernel": "qkv", "rows": 1, "us": 8.0,
                      "bf16_us": 13.0, "bf16_over_quant": 1.625, "pct_of_copy_16byte": 71.4,
                      "ok": True},
                     {"weights": "int4", "kernel": "down", "rows": 64, "us": 30.0,
                      "bf16_us": None, "bf16_over_quant": None, "pct_of_copy_16byte": None,
                      "ok": False}],
        "quant_decode": [{"weights": "int4", "batch": 1, "context_len": 1024, "step_ms": 3.1,
                          "bf16_step_ms": 6.2, "bf16_over_quant": 2.0,
                          "decode_matmuls": "kernels", "weight_bytes": 4_900_000_000}]}))
    (run / "device_check.log").write_text(
        "== decode step rows (limit 130 s)\n  verify row " + repr(
            {**verify, "batch": 16, "k": 1, "rows": 32, "bucket": 64}) + "\n")
    doc = collect([run])
    assert card(doc) == "NVIDIA H200" and doc["ceilings"]["copy_GBps_16byte"] == 4300.0
    assert [(r["batch"], r["k"]) for r in doc["verify_rows"]] == [(1, 7), (16, 1), (16, 3)]
    assert doc["verify_rows"][0]["verify_ms"] == 9.3
    md = verify_markdown(doc["verify_rows"], card(doc))
    assert md.startswith("Verifying steps on NVIDIA H200")
    assert "| bfloat16 | 1 | 7 | 8 (16) | 1024 | 9.30 | 6.20 | 1.50x | 1.50 |" in md
    assert "| bfloat16 | 16 | 1 | 32 (64) | 1024 |" in md  # from the log
    assert "| bfloat16 | 16 | 3 | - (-) | 1024 | not run: time budget | | | |" in md
    q = quant_markdown(doc["quant_ab"], doc["quant_decode"], card(doc), 4300.0)
    assert q.startswith("Quantized weights on NVIDIA H200") and "(4,300 GB/s)" in q
    assert "| fp8 | qkv | 1 | 8.0 | 13.0 | 1.62x | 71.4 | yes |" in q
    assert "| int4 | down | 64 | 30.0 | - | - | - | NO |" in q
    assert "| int4 | 1 | 1024 | 3.10 | 6.20 | 2.00x | 4.90 | kernels |" in q
    assert quant_markdown([], []) == "" and verify_markdown([]) == ""
    out = tmp_path / "merged.json"
    assert main([str(run), "--aot", str(AOT), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Quantized weights on NVIDIA H200" in printed and "Verifying steps on" in printed
    merged = json.loads(out.read_text())
    assert len(merged["quant_ab"]) == 2 and len(merged["verify_rows"]) == 3
