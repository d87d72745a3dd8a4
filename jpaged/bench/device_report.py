"""Merge what a lent GPU's device check brought back and set its decode step rows beside the
prediction of `make gpu-aot`.

    python scripts/device_report.py /work/.device/1 /work/.device/2 ... \\
        --aot docs/bench/gpu_aot_decode_jax0.10.2.json --out docs/bench/device_h200.json

Each folder may hold device_check.json / kernels.json / matmul.json / decode*.json /
engine*.json / host.json / nvidia_smi.csv and the log (device_check.log), whose "decode row
{...}" lines keep the rows of a stage that its time limit cut short. Prints the comparison as a
markdown table: measured ms per decode step, the predicted ms (hbm_bytes at 4.8 TB/s and at 80%
of it), the bandwidth the step achieved (predicted bytes / measured time), and the decode
matmuls' A/B (`ms_xla`: the step with XLA's GEMMs, `ms_kernels`: with the weight-streaming
kernels, the engine's step at up to 64 rows); then the copy ceilings (`copy_GBps_16byte`, the
best copy with 16-byte accesses, and jax's bf16 `x + 1`), the decode matmul kernels against
XLA and their ideal bytes (`matmul_markdown`), the best tile plan per kernel, the quantized
weights beside their bf16 twins (`quant_markdown`: `quant_ab`, `quant_decode`), speculative
decoding's verifying steps beside plain decode (`verify_markdown`: `verify_rows`), and each
profiled row's kernels by kind.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path
from typing import Any

from jpaged.aot.traffic import predicted_ms
from jpaged.bench.step_profile import op_kind

SPLIT_K_FLAG = "--xla_gpu_experimental_force_split_k"


def _rows_from(obj: Any) -> list[dict[str, Any]]:
    """Decode step rows in a JSON document: a list of rows, or a dict carrying `decode_rows`
    (device_check.json: its decode stages'); rows run with XLA's split-K forced off say so
    (`"xla_split_k": "off"`), so that they stand beside the default rows, not over them."""
    if isinstance(obj, list):
        return [r for r in obj if isinstance(r, dict) and "context_len" in r]
    if not isinstance(obj, dict):
        return []

    def of(stage: dict[str, Any]) -> list[dict[str, Any]]:
        off = SPLIT_K_FLAG in str(stage.get("xla_flags", ""))
        return [{**r, "xla_split_k": "off"} if off else r
                for r in stage.get("decode_rows") or []]

    rows = of(obj)
    for name in ("decode", "decode_split_k_off"):
        if isinstance(obj.get(name), dict):
            rows += of(obj[name])
    return rows


def _verify_from(obj: Any) -> list[dict[str, Any]]:
    """Verifying-step rows in a JSON document: a decode stage's `verify_rows`, or
    device_check.json's (its decode stage's, and the merged ones at the top level)."""
    if not isinstance(obj, dict):
        return []
    rows = list(obj.get("verify_rows") or [])
    if isinstance(obj.get("decode"), dict):
        rows += obj["decode"].get("verify_rows") or []
    return [r for r in rows if isinstance(r, dict) and "k" in r and "context_len" in r]


def _quant_from(obj: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
    """(kernel rows, decode rows) of the quantized weights in a JSON document: the stage's
    own (quant.json, or device_check.json's `quant`), else device_check.json's `quant_ab` and
    `quant_decode`; None when it has none."""
    if not isinstance(obj, dict):
        return None
    for stage in (obj, obj.get("quant")):
        if isinstance(stage, dict) and "quant_matmul_timings" in stage:
            return stage["quant_matmul_timings"], stage.get("quant_decode_rows") or []
    if obj.get("quant_ab") or obj.get("quant_decode"):
        return obj.get("quant_ab") or [], obj.get("quant_decode") or []
    return None


def _verify_key(row: dict[str, Any]) -> tuple[str, int, int, int]:
    return (str(row.get("kv_cache_dtype")), int(row["batch"]), int(row["k"]),
            int(row["context_len"]))


def _log_verify_rows(text: str) -> list[dict[str, Any]]:
    """The "verify row {...}" lines of a log."""
    return [ast.literal_eval(line.split("verify row ", 1)[1]) for line in text.splitlines()
            if line.strip().startswith("verify row {")]


def _log_rows(text: str) -> list[dict[str, Any]]:
    """The "decode row {...}" lines of a log (those of the split-K-off stage tagged)."""
    rows, off = [], False
    for line in text.splitlines():
        if line.startswith("== "):
            off = "split-K off" in line
        elif line.strip().startswith("decode row {"):
            row = ast.literal_eval(line.split("decode row ", 1)[1])
            rows.append({**row, "xla_split_k": "off"} if off else row)
    return rows


def collect(folders: list[Path]) -> dict[str, Any]:
    """One document from every folder's files; later folders add to earlier ones."""
    doc: dict[str, Any] = {"decode_rows": {}, "engine_runs": [], "sources": []}
    verify: dict[tuple[Any, ...], dict[str, Any]] = {}
    for folder in folders:
        # A folder's JSON rows (with their profiles) over its log's (the printed rows, kept
        # for stages their limit cut short); a later folder's over an earlier one's.
        from_log: dict[tuple[Any, ...], dict[str, Any]] = {}
        from_json: dict[tuple[Any, ...], dict[str, Any]] = {}
        v_log: dict[tuple[Any, ...], dict[str, Any]] = {}
        v_json: dict[tuple[Any, ...], dict[str, Any]] = {}
        for f in sorted(folder.iterdir()):
            doc["sources"].append(f"{folder.name}/{f.name}")
            if f.name.endswith(".log"):
                text = f.read_text()
                for row in _log_rows(text):
                    from_log[_key(row)] = row
                for row in _log_verify_rows(text):
                    v_log[_verify_key(row)] = row
                continue
            if f.name == "nvidia_smi.csv":
                doc["nvidia_smi"] = f.read_text().strip()
                continue
            if f.suffix != ".json":
                continue
            obj = json.loads(f.read_text())
            for row in _rows_from(obj):
                from_json[_key(row)] = row
            for row in _verify_from(obj):
                v_json[_verify_key(row)] = row
            quant = _quant_from(obj)
            if quant is not None:
                doc["quant_ab"], doc["quant_decode"] = quant
            if isinstance(obj, dict):
                _note_device(doc, obj)
                if f.name == "matmul.json" or "matmul_timings" in obj:
                    doc["matmuls"] = obj
                elif f.name == "kernels.json" or "checks" in obj:
                    doc["kernels"] = obj
                elif f.name == "host.json":
                    doc["host"] = obj
                elif obj.get("runs"):
                    doc["engine_runs"] += obj["runs"]
                    doc.setdefault("engine_model", obj.get("model"))
                elif "kernels" in obj:  # device_check.json: the merged stages
                    for k in ("kernels", "host", "matmuls"):
                        if obj.get(k):
                            doc[k] = obj[k]
                    if obj.get("engine") and obj["engine"].get("runs"):
                        doc["engine_runs"] += obj["engine"]["runs"]
        doc["decode_rows"].update({**from_log, **from_json})
        verify.update({**v_log, **v_json})
    doc["decode_rows"] = sorted(doc["decode_rows"].values(), key=lambda r: _key(r))
    doc["verify_rows"] = sorted(verify.values(), key=_verify_key)
    doc.setdefault("quant_ab", [])
    doc.setdefault("quant_decode", [])
    doc["ceilings"] = ceilings(doc)
    return doc


def _note_device(doc: dict[str, Any], obj: dict[str, Any]) -> None:
    """Keep the first card name (a stage's `device`) and copy rate with 16-byte accesses a
    document names (for the quant table where no kernels or matmul stage left one), and
    device_check.json's nvidia-smi text."""
    for stage in (obj, *(obj.get(k) for k in ("kernels", "matmuls", "decode", "quant",
                                              "engine"))):
        if not isinstance(stage, dict):
            continue
        if isinstance(stage.get("device"), str):
            doc.setdefault("device", stage["device"])
        if stage.get("copy_GBps_16byte"):
            doc.setdefault("copy_16byte_seen", {k: stage.get(k) for k in (
                "copy_GBps_16byte", "copy_16byte_method", "copy_GBps_jax_bf16")})
    if isinstance(obj.get("nvidia_smi"), str):
        doc.setdefault("nvidia_smi", obj["nvidia_smi"].strip())


def card(doc: dict[str, Any]) -> str:
    """The card a run measured: nvidia-smi's name, else a stage's device kind."""
    lines = (doc.get("nvidia_smi") or "").splitlines()
    if len(lines) > 1 and lines[0].startswith("name") and lines[1].strip():
        return lines[1].split(",")[0].strip()
    return doc.get("device") or "the device"


def ceilings(doc: dict[str, Any]) -> dict[str, Any]:
    """The copy rates a run measured (GB/s, read + write): `copy_GBps_16byte` (the best copy
    with 16-byte accesses a thread) and the method that reached it, `copy_GBps_jax_bf16`
    (jax's bf16 x + 1: 8-byte accesses), `copy_GBps` (the same, the attention table's
    denominator) and every method's rate; the kernels stage's, else the matmul stage's own."""
    kern = doc.get("kernels") or {}
    mm = doc.get("matmuls") or {}
    src = kern if kern.get("copy_GBps_16byte") else (mm.get("copy_source")
                                                     or doc.get("copy_16byte_seen") or {})
    out = {k: src.get(k) for k in ("copy_GBps_16byte", "copy_16byte_method",
                                   "copy_GBps_jax_bf16")}
    out["copy_GBps"] = kern.get("copy_GBps")
    out["copy_GBps_f32"] = kern.get("copy_GBps_f32")
    out["rates"] = src.get("copy_rates") or src.get("rates") or {}
    return out


def ceiling_line(c: dict[str, Any]) -> str:
    """One sentence of the copy ceilings."""
    if not c.get("copy_GBps_16byte") and not c.get("copy_GBps"):
        return ""
    rates = ", ".join(f"{k} {v:,.0f}" for k, v in sorted((c.get("rates") or {}).items(),
                                                          key=lambda kv: -kv[1]))
    return (f"Copy ceiling (read + write): {_num(c.get('copy_GBps_16byte'))} GB/s with 16-byte "
            f"accesses ({c.get('copy_16byte_method')}); jax's bf16 x + 1 "
            f"{_num(c.get('copy_GBps_jax_bf16') or c.get('copy_GBps'))} GB/s"
            + (f" (every method, GB/s: {rates})" if rates else ""))


def _num(x: float | None) -> str:
    return f"{x:,.0f}" if isinstance(x, (int, float)) else "-"


def _key(row: dict[str, Any]) -> tuple[str, int, int, str, str]:
    """A row's identity: its case, greedy or random, XLA's split-K default or off."""
    return (*_case_key(row), row.get("sampling") or "", row.get("xla_split_k") or "")


def _case_key(row: dict[str, Any]) -> tuple[str, int, int]:
    """The gpu-aot case a row is set beside: KV dtype, batch, context."""
    return (row["kv_cache_dtype"], int(row["batch"]), int(row["context_len"]))


def compare(rows: list[dict[str, Any]], aot: dict[str, Any], copy_gbps: float | None,
            copy16_gbps: float | None = None) -> list[dict[str, Any]]:
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
        c = cases.get(_case_key(r))
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
            if copy16_gbps:
                row["achieved_fraction_of_copy_16byte"] = round(gbps / copy16_gbps, 3)
        out.append(row)
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """The comparison as a markdown table."""
    lines = ["| KV | B | context | measured ms | tok/s | predicted ms (peak / 80%) | "
             "measured / predicted | achieved TB/s (% of 4.8) | ms, XLA's GEMMs | "
             "ms, matmul kernels | XLA / kernels |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kv = r["kv_cache_dtype"] + (" (random)" if r.get("sampling") == "random" else "")
        kv += " (split-K off)" if r.get("xla_split_k") == "off" else ""
        if "step_ms" not in r:
            lines.append(f"| {kv} | {r['batch']} | {r['context_len']} | "
                         f"not run: {r.get('skipped')} | | | | | | | |")
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
                     f"{ratio} | {bw} | {_ab_cells(r)} |")
    return "\n".join(lines)


def _ab_cells(r: dict[str, Any]) -> str:
    """The decode matmul A/B of a row: ms with XLA's GEMMs, with the kernels, their ratio; a
    row over the kernels' rows is one program ("same program")."""
    if "ms_kernels" in r:
        return f"{r['ms_xla']:.2f} | {r['ms_kernels']:.2f} | {r['xla_over_kernels']:.2f}x"
    if "ms_xla" in r:
        return f"{r['ms_xla']:.2f} | same program | "
    return " | | "


def matmul_markdown(mm: dict[str, Any] | None) -> str:
    """The decode matmul kernels against XLA's twins (per kernel and rows: us per call, GB/s
    of the ideal bytes and its % of the 16-byte copy, XLA / kernel, max abs error), the tile
    sweep and the best plan per kernel."""
    if not mm or not mm.get("matmul_timings"):
        return ""
    t = mm["matmul_timings"]
    lines = [f"Decode matmuls on {mm.get('device')} ({mm.get('shapes')}); % of the 16-byte "
             f"copy ({_num(mm.get('copy_GBps_16byte'))} GB/s)", "",
             "| kernel | rows | kernel us | XLA us | XLA / kernel | kernel GB/s (% copy16) | "
             "XLA GB/s (% copy16) | ideal us at copy16 | max abs err | ok |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def rate(r: dict[str, Any]) -> str:
        pct = r.get("pct_of_copy_16byte")
        return f"{r['GBps']:,.0f}" + (f" ({pct:.0f}%)" if pct is not None else "")

    for k in (r for r in t if r["impl"] == "pallas"):
        x = next((r for r in t if r["impl"] == "xla" and r["kernel"] == k["kernel"]
                  and r["rows"] == k["rows"]), None)
        lines.append(f"| {k['kernel']} | {k['rows']} | {k['us']:.1f} | "
                     f"{x['us'] if x else float('nan'):.1f} | {k['xla_over_pallas']:.2f}x | "
                     f"{rate(k)} | {rate(x) if x else ''} | "
                     f"{k.get('ideal_us_at_copy_16byte', '')} | {k['max_abs_err']:.3g} | "
                     f"{'yes' if k['ok'] else 'NO'} |")
    sweep = mm.get("matmul_sweep") or []
    if sweep:
        lines += ["", "| kernel | rows | block_n | block_k | stages | warps | us | GB/s (% copy16) "
                  "| |", "|---|---|---|---|---|---|---|---|---|"]
        for r in sweep:
            note = ("default" if r.get("default") else "") + ("" if r["ok"] else " WRONG")
            lines.append(f"| {r['kernel']} | {r['rows']} | {r['block_n']} | {r['block_k']} | "
                         f"{r['num_stages']} | {r['num_warps']} | {r['us']:.1f} | {rate(r)} | "
                         f"{note.strip()} |")
    best = mm.get("matmul_best_plans") or {}
    if best:
        lines += ["", "| kernel | best plan (rows) | us | % copy16 | default us | default / best |",
                  "|---|---|---|---|---|---|"]
        for name, b in best.items():
            p = b["plan"]
            lines.append(f"| {name} | bn {p['block_n']}, bk {p['block_k']}, "
                         f"{p['num_stages']} stages, {p['num_warps']} warps ({b['rows']}) | "
                         f"{b['us']:.1f} | {b.get('pct_of_copy_16byte', '')} | "
                         f"{b['default_us']} | {b['default_over_best']}x |")
    return "\n".join(lines)


def _cell(x: Any, fmt: str = "") -> str:
    """A table cell: the value formatted, "-" when absent."""
    if x is None:
        return "-"
    return format(x, fmt) if fmt and isinstance(x, (int, float)) else str(x)


def _times(x: Any) -> str:
    """A ratio cell: "1.62x", "-" when absent."""
    return "-" if x is None else f"{x:.2f}x"


def quant_markdown(ab: list[dict[str, Any]], decode: list[dict[str, Any]],
                   device: str | None = None, copy16_gbps: float | None = None) -> str:
    """The quantized weights beside their bf16 twins: each decode matmul kernel alone
    (`quant_ab`: us, the bf16 kernel's us, bf16 / quant, % of the 16-byte copy, correct), then
    the 8B decode step (`quant_decode`: ms, the bf16 step's, bf16 / quant, weight bytes)."""
    if not ab and not decode:
        return ""
    parts = [f"Quantized weights on {device or 'the device'}: the decode matmul kernels alone "
             f"and the decode step beside their bf16 twins (bf16 / quant > 1: the quantized "
             f"one is faster); % of the 16-byte copy ({_num(copy16_gbps)} GB/s)"]
    if ab:
        parts += ["", "| weights | kernel | rows | us | bf16 us | bf16 / quant | % of copy16 "
                  "| ok |", "|---|---|---|---|---|---|---|---|"]
        for r in ab:
            ok = {True: "yes", False: "NO"}.get(r.get("ok"), "-")
            parts.append(f"| {r.get('weights')} | {r.get('kernel')} | {r.get('rows')} | "
                         f"{_cell(r.get('us'), '.1f')} | {_cell(r.get('bf16_us'), '.1f')} | "
                         f"{_times(r.get('bf16_over_quant'))} | "
                         f"{_cell(r.get('pct_of_copy_16byte'), '.1f')} | {ok} |")
    if decode:
        parts += ["", "| weights | B | context | ms / step | bf16 ms / step | bf16 / quant | "
                  "weights GB | matmuls |", "|---|---|---|---|---|---|---|---|"]
        for r in decode:
            gb = r.get("weight_bytes")
            parts.append(f"| {r.get('weights')} | {r.get('batch')} | "
                         f"{_cell(r.get('context_len'))} | {_cell(r.get('step_ms'), '.2f')} | "
                         f"{_cell(r.get('bf16_step_ms'), '.2f')} | "
                         f"{_times(r.get('bf16_over_quant'))} | "
                         f"{_cell(gb / 1e9 if gb else None, '.2f')} | "
                         f"{_cell(r.get('decode_matmuls'))} |")
    return "\n".join(parts)


def verify_markdown(rows: list[dict[str, Any]], device: str | None = None) -> str:
    """Speculative decoding's verifying steps (`verify_rows`): B sequences with k proposals
    each as B * (k + 1) decode rows (padded to the bucket), beside the plain decode step of
    the B sequences on the same runner and pool; break-even = verify / decode, the mean
    tokens a verifying step must yield a sequence (accepted + bonus) to pay for itself."""
    if not rows:
        return ""
    lines = [f"Verifying steps on {device or 'the device'} (speculative decoding: B sequences "
             f"with k proposals each, beside the plain decode step of the B sequences; "
             f"speculation pays where the mean acceptance length exceeds the break-even)", "",
             "| KV | B | k | rows (bucket) | context | verify ms | decode ms | verify / decode "
             "| break-even tokens / step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = (f"| {r.get('kv_cache_dtype')} | {r['batch']} | {r['k']} | "
                f"{_cell(r.get('rows'))} ({_cell(r.get('bucket'))}) | {r['context_len']} |")
        if r.get("verify_ms") is None:
            lines.append(f"{head} not run: {r.get('skipped')} | | | |")
            continue
        lines.append(f"{head} {r['verify_ms']:.2f} | {_cell(r.get('decode_ms'), '.2f')} | "
                     f"{_times(r.get('ratio'))} | "
                     f"{_cell(r.get('break_even_accepted'), '.2f')} |")
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
    for r, key in ((r, key) for r in rows for key in ("profile", "profile_xla")):
        prof = r.get(key)
        if not prof:
            continue
        share = prof.get("kernel_share_of_step")
        which = ", XLA's GEMMs (decode_matmuls=False)" if key == "profile_xla" else ""
        parts.append(f"{r['kv_cache_dtype']}, B={r['batch']}, context {r['context_len']}"
                     f"{which}: "
                     f"{prof['launches_per_step']:g} kernels a step, "
                     f"{prof['kernel_ms_per_step']:.3f} ms in kernels of a "
                     f"{prof['step_ms']} ms step"
                     + (f" ({share:.0%})" if share is not None else "")
                     + f", events from the {prof['events_from']}")
        predicted = _predicted_bytes_by_kind(cases.get(_case_key(r)))
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
    doc["decode_rows"] = compare(doc["decode_rows"], aot, copy,
                                 doc["ceilings"].get("copy_GBps_16byte"))
    doc["aot_source"] = f"{args.aot.name} (jax {aot['jax_version']})"
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(markdown(doc["decode_rows"]))
    name = card(doc)
    copy16 = doc["ceilings"].get("copy_GBps_16byte")
    for part in (ceiling_line(doc["ceilings"]), matmul_markdown(doc.get("matmuls")),
                 quant_markdown(doc["quant_ab"], doc["quant_decode"], name, copy16),
                 verify_markdown(doc["verify_rows"], name)):
        if part:
            print("\n" + part)
    prof = profile_markdown(doc["decode_rows"], aot)
    if prof:
        print("\n" + prof)
    return 0


