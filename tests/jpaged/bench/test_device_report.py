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
