"""Merge what a lent GPU's device check brought back and set its decode step rows beside the
prediction of `make gpu-aot`.

    python scripts/device_report.py /work/.device/1 /work/.device/2 ... \\
        --aot docs/bench/gpu_aot_decode_jax0.10.2.json --out docs/bench/device_h200.json

Each folder may hold device_check.json / kernels.json / decode*.json / engine*.json /
host.json / nvidia_smi.csv and the log (device_check.log), whose "decode row {...}" lines keep
the rows of a stage that its time limit cut short. Prints the comparison as a markdown table:
measured ms per decode step, the predicted ms (hbm_bytes at 4.8 TB/s and at 80% of it), and the
bandwidth the step achieved (predicted bytes / measured time).
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path
from typing import Any

from jpaged.aot.traffic import predicted_ms
from jpaged.bench.step_profile import op_kind


def _rows_from(obj: Any) -> list[dict[str, Any]]:
    """Decode step rows in a JSON document: a list of rows, or a dict carrying `decode_rows`."""
    if isinstance(obj, list):
        return [r for r in obj if isinstance(r, dict) and "context_len" in r]
    if isinstance(obj, dict):
        rows = list(obj.get("decode_rows") or [])
        if isinstance(obj.get("decode"), dict):
            rows += obj["decode"].get("decode_rows") or []
        return rows
    return []


def collect(folders: list[Path]) -> dict[str, Any]:
    """One document from every folder's files; later folders add to earlier ones."""
    doc: dict[str, Any] = {"decode_rows": {}, "engine_runs": [], "sources": []}
    for folder in folders:
        for f in sorted(folder.iterdir()):
            doc["sources"].append(f"{folder.name}/{f.name}")
            if f.name.endswith(".log"):
                for line in f.read_text().splitlines():
                    if line.strip().startswith("decode row {"):
                        row = ast.literal_eval(line.split("decode row ", 1)[1])
                        doc["decode_rows"][_key(row)] = row
                continue
            if f.name == "nvidia_smi.csv":
                doc["nvidia_smi"] = f.read_text().strip()
                continue
            if f.suffix != ".json":
                continue
            obj = json.loads(f.read_text())
            for row in _rows_from(obj):
                doc["decode_rows"][_key(row)] = row
            if isinstance(obj, dict):
                if f.name == "kernels.json" or "checks" in obj:
                    doc["kernels"] = obj
                elif f.name == "host.json":
                    doc["host"] = obj
                elif obj.get("runs"):
                    doc["engine_runs"] += obj["runs"]
                    doc.setdefault("engine_model", obj.get("model"))
                elif "kernels" in obj:  # device_check.json: the merged stages
                    for k in ("kernels", "host"):
                        if obj.get(k):
                            doc[k] = obj[k]
                    if obj.get("engine") and obj["engine"].get("runs"):
                        doc["engine_runs"] += obj["engine"]["runs"]
    doc["decode_rows"] = sorted(doc["decode_rows"].values(), key=lambda r: _key(r))
    return doc


def _key(row: dict[str, Any]) -> tuple[str, int, int]:
    return (row["kv_cache_dtype"], int(row["batch"]), int(row["context_len"]))


def compare(rows: list[dict[str, Any]], aot: dict[str, Any], copy_gbps: float | None
            ) -> list[dict[str, Any]]:
    """Each measured row beside its predicted case (Llama-3-8B, tp=1, same KV dtype, batch and
    context): a greedy row beside `hbm_bytes`, a random one (`"sampling": "random"`) beside
    `hbm_bytes_sampling_candidates` (RANDOM_SAMPLING's top-k 64 lets the draw's candidates
    settle its rows unless the logits are flat), with `hbm_bytes_sampling`, the whole-row
    worst case, beside it as `worst_hbm_bytes` (an older JSON without the first: the worst
    case alone)."""
    cases = {(c["kv_cache_dtype"], c["seqs"], c["context_len"]): c for c in aot["cases"]
             if c["model"] == "llama3-8b" and c["tensor_parallel_size"] == 1
             and c.get("program", "step") == "step"}
    out = []
    for r in rows:
        c = cases.get(_key(r))
        row = {**r}
        if c is not None and "step_ms" in r:
            moved = c["hbm_bytes"]
            if r.get("sampling") == "random":
                worst = c["hbm_bytes_sampling"]
                moved = c.get("hbm_bytes_sampling_candidates") or worst
                row.update(worst_hbm_bytes=worst,
                           worst_predicted_ms=predicted_ms(worst, aot["hbm_bytes_per_s"])[0])
            pred, pred80 = predicted_ms(moved, aot["hbm_bytes_per_s"])
            gbps = moved / (r["step_ms"] * 1e-3) / 1e9
            row.update(predicted_ms=pred, predicted_ms_at_80pct=pred80,
                       hbm_bytes=moved, min_hbm_bytes=c["min_hbm_bytes"],
                       measured_over_predicted=round(r["step_ms"] / pred, 2),
                       achieved_GBps=round(gbps),
                       achieved_fraction_of_peak=round(gbps / (aot["hbm_bytes_per_s"] / 1e9), 3))
            if copy_gbps:
                row["achieved_fraction_of_copy"] = round(gbps / copy_gbps, 3)
        out.append(row)
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """The comparison as a markdown table."""
    lines = ["| KV | B | context | measured ms | tok/s | predicted ms (peak / 80%) | "
             "measured / predicted | achieved TB/s (% of 4.8) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kv = r["kv_cache_dtype"] + (" (random)" if r.get("sampling") == "random" else "")
        if "step_ms" not in r:
            lines.append(f"| {kv} | {r['batch']} | {r['context_len']} | "
                         f"not run: {r.get('skipped')} | | | | |")
            continue
        pred = (f"{r['predicted_ms']:.2f} / {r['predicted_ms_at_80pct']:.2f}"
                if "predicted_ms" in r else "")
        if "worst_predicted_ms" in r and r["worst_hbm_bytes"] != r["hbm_bytes"]:
            pred += f" (whole row: {r['worst_predicted_ms']:.2f})"
        ratio = f"{r['measured_over_predicted']:.2f}x" if "predicted_ms" in r else ""
        bw = (f"{r['achieved_GBps'] / 1000:.2f} ({r['achieved_fraction_of_peak']:.0%})"
              if "achieved_GBps" in r else "")
        lines.append(f"| {kv} | {r['batch']} | {r['context_len']} | "
                     f"{r['step_ms']:.2f} | {r['output_tokens_per_s']:,.0f} | {pred} | "
                     f"{ratio} | {bw} |")
    return "\n".join(lines)


def _predicted_bytes_by_kind(case: dict[str, Any] | None) -> dict[str, int]:
    """The case's largest kinds of op by predicted bytes ("kind: shape = N B" entries)."""
    out: dict[str, int] = {}
    for entry in (case or {}).get("largest_traffic") or []:
        key, _, nbytes = entry.rpartition(" = ")
        kind = op_kind(key.split(":")[0])
        out[kind] = out.get(kind, 0) + int(nbytes.split()[0])
    return out


def profile_markdown(rows: list[dict[str, Any]], aot: dict[str, Any] | None = None) -> str:
    """Each profiled row's kernels by kind: launches and ms per step, and where the gpu-aot
    JSON names the kind among the case's largest, its predicted bytes and achieved GB/s."""
    cases = {(c["kv_cache_dtype"], c["seqs"], c["context_len"]): c
             for c in (aot or {}).get("cases", [])
             if c["model"] == "llama3-8b" and c["tensor_parallel_size"] == 1}
    parts = []
    for r in rows:
        prof = r.get("profile")
        if not prof:
            continue
        share = prof.get("kernel_share_of_step")
        parts.append(f"{r['kv_cache_dtype']}, B={r['batch']}, context {r['context_len']}: "
                     f"{prof['launches_per_step']:g} kernels a step, "
                     f"{prof['kernel_ms_per_step']:.3f} ms in kernels of a "
                     f"{prof['step_ms']} ms step"
                     + (f" ({share:.0%})" if share is not None else "")
                     + f", events from the {prof['events_from']}")
        predicted = _predicted_bytes_by_kind(cases.get(_key(r)))
        parts += ["", "| kind | launches / step | ms / step | share | predicted GB | GB/s |",
                  "|---|---|---|---|---|---|"]
        for k in prof["kinds"]:
            nbytes = predicted.get(k["kind"])
            pred = f"{nbytes / 1e9:.2f}" if nbytes else ""
            gbps = (f"{nbytes / (k['ms_per_step'] * 1e-3) / 1e9:,.0f}"
                    if nbytes and k["ms_per_step"] else "")
            parts.append(f"| {k['kind']} | {k['launches_per_step']:g} | "
                         f"{k['ms_per_step']:.3f} | {k['share_of_kernel_time']:.1%} | "
                         f"{pred} | {gbps} |")
        parts.append("")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Merge the folders, compare the decode rows, write JSON and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", type=Path, nargs="+", help="folders a device run brought back")
    p.add_argument("--aot", type=Path, required=True, help="a `make gpu-aot --decode` JSON")
    p.add_argument("--out", type=Path, help="write the merged document here")
    args = p.parse_args(argv)
    doc = collect(args.folders)
    aot = json.loads(args.aot.read_text())
    copy = (doc.get("kernels") or {}).get("copy_GBps")
    doc["decode_rows"] = compare(doc["decode_rows"], aot, copy)
    doc["aot_source"] = f"{args.aot.name} (jax {aot['jax_version']})"
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(markdown(doc["decode_rows"]))
    prof = profile_markdown(doc["decode_rows"], aot)
    if prof:
        print("\n" + prof)
    return 0


