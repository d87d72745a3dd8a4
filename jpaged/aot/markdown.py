"""Markdown tables of a gpu_aot JSON (for docs/kernels.md): kernels, programs, launches per step,
pool sizing, HBM traffic."""

from __future__ import annotations

from typing import Any


def _gib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f} GiB"


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:.0f} MiB"


def _model(c: dict[str, Any]) -> str:
    """A case's model, with its quantized weights' kind when it has them (llama3-8b-int4)."""
    return f"{c['model']}-{c['weights']}" if c.get("weights") else c["model"]


def programs(doc: dict[str, Any]) -> int:
    """Programs compiled (a case's extra context rows share their program), the verifying
    steps' (`spec_verify`) included."""
    return sum(not c.get("reuses_compile") for c in doc["cases"] + doc.get("spec_verify", []))


def _gb(x: int | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def hbm_table(doc: dict[str, Any]) -> str:
    """Per decode case (tokens == seqs) and context: bytes moved, least bytes, their ratio,
    weight copies and collectives, temp bytes and the predicted step time on the H200."""
    bw = doc.get("hbm_bytes_per_s")
    head = ("| model | KV | path | tp | B | context | HBM GB | min GB | ratio | param copy GB | "
            "param collective GB | temp | ms @ peak | ms @ 80% |")
    lines = [f"HBM traffic per decode step (peak {bw / 1e12:.1f} TB/s)" if bw else
             "HBM traffic per decode step", "", head, "|---" * 14 + "|"]
    for c in doc["cases"]:
        if c["program"] != "step" or c["tokens"] != c["seqs"] or c.get("hbm_bytes") is None:
            continue
        lines.append(
            f"| {_model(c)} | {c['kv_cache_dtype']} | {c['backend']} | "
            f"{c['tensor_parallel_size']} | {c['seqs']} | {c['context_len']} | "
            f"{_gb(c['hbm_bytes'])} | {_gb(c['min_hbm_bytes'])} | {c['traffic_ratio']:.2f}"
            f"{'*' if _loop_once(c) else ''} | "
            f"{_gb(c['param_copy_bytes'])} | {_gb(c['param_collective_bytes'])} | "
            f"{_mib(c.get('temp_bytes'))} | {c['predicted_step_ms']:.2f} | "
            f"{c['predicted_step_ms_at_80pct']:.2f} |")
    if any(_loop_once(c) for c in doc["cases"] if c.get("hbm_bytes") is not None):
        lines += ["", "\\* a loop of unknown trip count is counted once: a lower bound."]
    return "\n".join(lines)


# vLLM's published operating point on an H200 for an 8B model at batch 1: ~77% of the HBM
# bandwidth, i.e. ~4.3 ms per output token.
VLLM_BATCH1_MS_8B = 4.3
VLLM_BATCH1_FRACTION = 0.77


def prediction_table(doc: dict[str, Any], model: str = "llama3-8b",
                     backend: str = "pallas") -> str:
    """Predicted decode ms per step and output tokens/s per (KV dtype, tp, batch, context),
    beside the bandwidth-bound ideal (min_hbm_bytes at peak) and vLLM's batch-1 point."""
    bw = doc.get("hbm_bytes_per_s") or 4.8e12
    head = ("| KV | tp | B | context | predicted ms (peak / 80%) | predicted tok/s (80%) | "
            "ideal ms | ideal tok/s | vLLM point |")
    lines = [head, "|---" * 9 + "|"]
    for c in doc["cases"]:
        if (c["program"] != "step" or c["tokens"] != c["seqs"] or _model(c) != model
                or c["backend"] != backend or c.get("hbm_bytes") is None):
            continue
        b, slow = c["seqs"], c["predicted_step_ms_at_80pct"]
        ideal = c["min_hbm_bytes"] / bw * 1e3
        vllm = (f"~{VLLM_BATCH1_MS_8B} ms ({VLLM_BATCH1_FRACTION:.0%} of peak)"
                if b == 1 and c["tensor_parallel_size"] == 1 else "")
        fits = " (pool too small)" if c.get("context_fits_pool") is False else ""
        lines.append(f"| {c['kv_cache_dtype']} | {c['tensor_parallel_size']} | {b} | "
                     f"{c['context_len']}{fits} | {c['predicted_step_ms']:.2f} / {slow:.2f} | "
                     f"{b / slow * 1e3:,.0f} | {ideal:.2f} | {b / ideal * 1e3:,.0f} | {vllm} |")
    return "\n".join(lines)


def spec_table(doc: dict[str, Any]) -> str:
    """Per verifying step of speculative decoding (`spec_verify`: B sequences of k + 1 new
    tokens, `rows` sampled rows, its sequences padded to `seqs_bucket`) and context: launches,
    bytes moved, the least it could move and their ratio, the least the same step would move
    as single-token rows (each its own context read) against what it moves, predicted time."""
    bw = doc.get("hbm_bytes_per_s")
    lines = [f"HBM traffic per verifying step (peak {bw / 1e12:.1f} TB/s)" if bw else
             "HBM traffic per verifying step", "",
             "| model | KV | path | tp | B | k | B(k+1) | rows | seqs | context | launches | "
             "graphs | HBM GB | min GB | ratio | min GB as rows | as rows / HBM | ms @ peak |",
             "|---" * 18 + "|"]
    for c in doc.get("spec_verify", []):
        if c.get("hbm_bytes") is None or c.get("program", "spec_verify") != "spec_verify":
            continue
        lines.append(
            f"| {_model(c)} | {c['kv_cache_dtype']} | {c['backend']} | "
            f"{c['tensor_parallel_size']} | {c['batch']} | {c['k']} | "
            f"{c['tokens_per_step_max']} | {c['rows']} | {_dash(c.get('seqs_bucket'))} | "
            f"{c['context_len']} | "
            f"{_dash(c.get('kernels_per_step'))} | {_dash(c.get('command_buffers'))} | "
            f"{_gb(c['hbm_bytes'])} | {_gb(c['min_hbm_bytes'])} | {c['traffic_ratio']:.2f} | "
            f"{_gb(c['min_hbm_bytes_rows'])} | {c['rows_ratio']:.2f} | "
            f"{c['predicted_step_ms']:.2f} |")
    return "\n".join(lines)


def cycle_table(doc: dict[str, Any]) -> str:
    """Per speculation cycle (`spec_cycles`: B sequences, k proposals, a context): the plain
    decode step's bytes, the verifying step's, and the tokens a cycle must yield a sequence to
    move no more than the decode steps it replaces, without a draft and with the draft's
    catch-up and k - 1 single-token steps."""
    lines = ["Bytes of a speculation cycle against plain decode", "",
             "| model | KV | tp | B | k | context | decode GB | verify GB | break-even tokens | "
             "draft | draft cycle GB | break-even tokens (draft) |",
             "|---" * 12 + "|"]
    for c in doc.get("spec_cycles", []):
        draft = c.get("draft_cycle_hbm_bytes")
        lines.append(
            f"| {_model(c)} | {c['kv_cache_dtype']} | {c['tensor_parallel_size']} | "
            f"{c['batch']} | {c['k']} | {c['context_len']} | {_gb(c['decode_hbm_bytes'])} | "
            f"{_gb(c['verify_hbm_bytes'])} | {c['break_even_tokens']:.2f} | "
            f"{c.get('draft_model') or '-'} | {'-' if draft is None else _gb(draft)} | "
            f"{_dash(c.get('break_even_tokens_draft'))} |")
    return "\n".join(lines)


def _loop_once(case: dict[str, Any]) -> bool:
    return any("unknown trip count" in n for n in case.get("hbm_notes") or [])


def kernel_table(doc: dict[str, Any]) -> str:
    """One row per distinct (configuration, kernel name): its compiled resources."""
    seen: dict[tuple, dict[str, Any]] = {}
    for c in doc["cases"]:
        if c.get("reuses_compile"):
            continue
        for k in c.get("kernels", []):
            key = (_model(c), c["kv_cache_dtype"], c["tensor_parallel_size"], k["name"])
            if key not in seen:
                seen[key] = {**k, "shapes": []}
            seen[key]["shapes"].append(f"{c['tokens']}x{c['seqs']}")
    lines = ["| model | KV | tp | kernel | registers | spill B | shared mem B | threads | "
             "seen in T x B | widest load B |", "|---" * 10 + "|"]
    for (model, kvd, tp, name), k in seen.items():
        shapes = k["shapes"]
        where = ", ".join(shapes) if len(shapes) <= 3 else f"{len(shapes)} shapes"
        lines.append(f"| {model} | {kvd} | {tp} | `{name}` | {k['registers']} | "
                     f"{k['spill_bytes']} | {k['shared_memory_bytes']} | {k['threads']} | "
                     f"{where} | {_dash(k.get('max_global_load_bytes'))} |")
    return "\n".join(lines)


def _dash(x: Any) -> str:
    return "-" if x is None else str(x)


def launch_table(doc: dict[str, Any]) -> str:
    """One row per compiled step: kernel launches (per layer, outside the layers), copies, CUDA
    graphs and what runs outside them, wide elementwise passes."""
    lines = ["| model | KV | path | tp | T | B | launches | per layer | outside layers | copies | "
             "graphs | outside graphs: launches + control flow | wide elementwise passes |",
             "|---" * 13 + "|"]
    for c in doc["cases"]:
        if c["program"] != "step" or c.get("reuses_compile") or c.get("kernels_per_step") is None:
            continue
        lines.append(
            f"| {_model(c)} | {c['kv_cache_dtype']} | {c['backend']} | "
            f"{c['tensor_parallel_size']} | {c['tokens']} | {c['seqs']} | "
            f"{c['kernels_per_step']} | {_dash(c['kernels_per_layer'])} | "
            f"{_dash(c['kernels_outside_layers'])} | {c['copies_per_step']} | "
            f"{c['command_buffers']} | {c['kernels_outside_command_buffers']} + "
            f"{c['control_flow_outside_command_buffers']} | {c['wide_elementwise_passes']} |")
    return "\n".join(lines)


def program_table(doc: dict[str, Any]) -> str:
    """One row per configuration: programs compiled, in place, compile seconds, temp range."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for c in doc["cases"]:
        key = (_model(c), c["kv_cache_dtype"], c["backend"], c["tensor_parallel_size"])
        if not c.get("reuses_compile"):
            groups.setdefault(key, []).append(c)
    lines = ["| model | KV | path | tp | programs | compiled | pool in place | pool per device | "
             "compile s (max) | temp bytes (min..max) |", "|---" * 10 + "|"]
    for (model, kvd, be, tp), rows in groups.items():
        ok = sum(bool(r.get("compiled")) for r in rows)
        steps = [r for r in rows if r["program"] != "kv_gather"]
        inplace = sum(r.get("pool_aliased") is True for r in steps)
        temps = [r["temp_bytes"] for r in rows if r.get("temp_bytes") is not None]
        secs = [r.get("compile_s", 0) for r in rows]
        lines.append(f"| {model} | {kvd} | {be} | {tp} | {len(rows)} | {ok}/{len(rows)} | "
                     f"{inplace}/{len(steps)} | {_gib(rows[0]['pool_bytes'])} | "
                     f"{max(secs):.1f} | {_mib(min(temps)) if temps else '-'}.."
                     f"{_mib(max(temps)) if temps else '-'} |")
    return "\n".join(lines)


def sizing_table(doc: dict[str, Any]) -> str:
    """What LLM(gpu_memory_utilization=0.9) picks on the H200, beside jpaged estimate."""
    lines = ["| model | KV | path | tp | params / device | activations: GPU step / CPU probe / "
             "estimate | KV budget | blocks (estimate) | seqs of max_model_len |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in doc["sizing"]:
        lines.append(
            f"| {_model(s)} | {s['kv_cache_dtype']} | {s['backend']} | "
            f"{s['tensor_parallel_size']} | {_gib(s['param_bytes'])} | "
            f"{_mib(s['activation_bytes_gpu'])} / {_mib(s.get('activation_bytes_cpu_probe'))} / "
            f"{_mib(s['estimate_activation_bytes'])} | {_gib(s['kv_budget_bytes'])} | "
            f"{s['num_blocks']:,} ({s['estimate_num_blocks']:,}) | "
            f"{s['max_concurrent_seqs']:,} @ {s['max_model_len']} |")
    return "\n".join(lines)


def render(doc: dict[str, Any]) -> str:
    """All three tables with a heading line naming the run."""
    head = (f"jax {doc['jax_version']}, {doc['target']}, mode {doc['mode']}, "
            f"{programs(doc)} programs, {len(doc['problems'])} problems, "
            f"{doc.get('wall_s', '?')} s")
    tables = [head, program_table(doc), kernel_table(doc), launch_table(doc),
              sizing_table(doc), hbm_table(doc), prediction_table(doc)]
    if doc.get("spec_verify"):
        tables.append(spec_table(doc))
    if doc.get("spec_cycles"):
        tables.append(cycle_table(doc))
    return "\n\n".join(tables)
