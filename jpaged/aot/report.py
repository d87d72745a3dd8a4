"""Compile a list of cases for an abstract H200 and report each one (scripts/gpu_aot.py).

Per case: compiled or the exact error, compile seconds, XLA's memory analysis, the KV pool's
bytes and whether it is aliased in place (`buffers.pool_report`), and every Pallas kernel's
registers, spills, shared memory, threads and widest global load (`kernels.kernel_resources`),
and per step its kernel launches, per layer, outside command buffers and its wide elementwise
passes (`launches.launch_fields`). Every program compiles with `launches.COMMAND_BUFFER_OPTIONS`
under the options asked for (the target config gives CUDA 12.9, so no command type is
dropped). Before the cases of
one engine configuration, its largest bucket is compiled on a 2-block pool (what the engine's
start-up probe does) to size the pool the engine would choose on the H200 at
gpu_memory_utilization=0.9; the cases then run at that pool, so the check sees real pool sizes.
With `spec`, the verifying steps of speculative decoding too (`run_spec_config`,
`jpaged.aot.spec_verify`), under the document's "spec_verify". A configuration may keep its
decoder linears quantized (`Config.weights`: "fp8", "int4"; its rows say so under "weights"),
the decode matmul kernels then reading the quantized bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp

from jpaged.aot.buffers import (
    dump_dir,
    dump_options,
    find_dump,
    no_persistent_cache,
    pool_report,
)
from jpaged.aot.cases import (
    DECODE_FLAGS,
    TOP_FLAGS,
    VERIFY_FLAGS,
    WEIGHTS,
    StepBuilder,
    engine_config,
    model_source,
    model_spec,
)
from jpaged.aot.hbm import estimate_traffic
from jpaged.aot.kernels import (
    MIN_STREAMING_LOAD_BYTES,
    STREAMING_KERNEL_PREFIXES,
    capture_stderr,
    find_ptxas,
    kernel_resources,
)
from jpaged.aot.launches import COMMAND_BUFFER_OPTIONS, LAUNCH_KEYS, StepShape, launch_fields
from jpaged.aot.spec_verify import (
    DRAFT_CATCH_UP_TOKENS,
    DRAFT_MODELS,
    SPEC_BATCHES,
    base_shapes,
    batch_rows_of,
    cycle_rows,
    spec_engine_config,
    step_hbm,
    verify_hbm,
    verify_rows_of,
    verify_shapes,
)
from jpaged.aot.target import H200_HBM_BYTES_PER_S, TARGET_NAME, GpuTarget, h200_target
from jpaged.aot.traffic import DECODE_BATCHES, DECODE_CONTEXTS, HBM_KEYS, hbm_fields
from jpaged.core.kv_cache_groups import blocks_by_length
from jpaged.runner.batch import BucketPlan
from jpaged.runner.kv_cache import DEFAULT_UTILIZATION, plan_kv_pool
from jpaged.runner.memory_probe import PROBE_BLOCKS, largest_shape, step_activation_bytes

logger = logging.getLogger("jpaged.aot")

# The fraction of the card JAX's default allocator preallocates (its bytes_limit, which the
# engine's device_memory_bytes() reads) unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise.
DEFAULT_MEM_FRACTION = 0.75
MAX_REGISTERS = 255
SHARED_MEMORY_OPTIN = 232448


@dataclass(frozen=True)
class Config:
    """One engine configuration whose bucket shapes are compiled."""

    model: str
    kv_cache_dtype: str
    backend: str
    tensor_parallel_size: int = 1
    # Extra XLA compile options for every program of it, as (name, value) pairs.
    xla_options: tuple[tuple[str, Any], ...] = ()
    # Decoder linears kept quantized (cases.WEIGHTS), or None: the model dtype's.
    weights: str | None = None
    # LoRA adapter slots (max_loras, max_lora_rank) of an engine serving adapters, or None.
    lora: tuple[int, int] | None = None

    @property
    def key(self) -> str:
        """What --only matches: model[-weights][-loraSxR]/kv_cache_dtype/backend/tp<N>."""
        model = f"{self.model}-{self.weights}" if self.weights else self.model
        if self.lora:
            model += f"-lora{self.lora[0]}x{self.lora[1]}"
        return f"{model}/{self.kv_cache_dtype}/{self.backend}/tp{self.tensor_parallel_size}"


def compile_lowered(lower: Any, gpu: bool, ptxas: str | None, pool_shape: str,
                    target: GpuTarget | None = None,
                    analyze: Callable[[str], list[dict[str, Any]]] | None = None,
                    options: dict[str, Any] | None = None,
                    step: StepShape | None = None) -> dict[str, Any]:
    """Lower (inside the target's context) and compile one program; its report fields.

    `options`: XLA compile options added to the dump options (e.g. a forced split-K).

    `step`: for an engine step on a GPU, its shape; adds the LAUNCH_KEYS (`launches`; their
    failure under "launch_error", the case still compiled).

    `analyze`: called with the optimized HLO text; its list (one dict per context length) is
    kept under "hbm" (its failure under "hbm_error", the case still compiled).
    """
    # Every key is present whatever happens; a failed case keeps None and its `error`.
    row: dict[str, Any] = {"compiled": False, "compile_s": None, "argument_bytes": None,
                           "output_bytes": None, "temp_bytes": None, "alias_bytes": None,
                           "pool_aliased": None, "pool_copies": None, "largest_temps": None}
    if gpu:
        row["kernels"] = []
        if step is not None:
            row.update(dict.fromkeys(LAUNCH_KEYS))
    t0 = time.perf_counter()
    try:
        with dump_dir() as d, no_persistent_cache():
            ctx = target.lowering() if target is not None else contextlib.nullcontext()
            with ctx, capture_stderr() as log:
                lowered = lower()
                compiled = lowered.compile({**dump_options(d, gpu=gpu), **(options or {})})
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            row["compiled"] = True
            stats = compiled.memory_analysis()
            for key, attr in (("argument_bytes", "argument_size_in_bytes"),
                              ("output_bytes", "output_size_in_bytes"),
                              ("temp_bytes", "temp_size_in_bytes"),
                              ("alias_bytes", "alias_size_in_bytes")):
                row[key] = int(getattr(stats, attr)) if stats is not None else None
            ba = find_dump(d, "after_optimizations-buffer-assignment.txt").read_text()
            rep = pool_report(ba, compiled.as_text(), pool_shape)
            row["pool_aliased"] = rep.pool_aliased
            row["pool_copies"] = [f"{v.name}: {v.shape}" for v in rep.copies]
            row["largest_temps"] = [f"{v.name}: {v.shape} = {v.size} B"
                                    for v in rep.largest_temps]
            if gpu:
                row["kernels"] = [k.as_dict() for k in kernel_resources(d, ptxas, log[0])]
                if step is not None:
                    try:
                        row.update(launch_fields(d, compiled.as_text(), step))
                    except Exception as e:  # noqa: BLE001 - the counts fail alone
                        row["launch_error"] = f"{type(e).__name__}: {e}"[:2000]
                        logger.debug("launch counts failed:\n%s", traceback.format_exc())
            if analyze is not None:
                try:
                    row["hbm"] = analyze(compiled.as_text())
                except Exception as e:  # noqa: BLE001 - the estimate fails alone
                    row["hbm_error"] = f"{type(e).__name__}: {e}"[:2000]
                    logger.debug("hbm estimate failed:\n%s", traceback.format_exc())
    except Exception as e:  # noqa: BLE001 - each case reports its own failure
        row["compile_s"] = round(time.perf_counter() - t0, 2)
        row["error"] = f"{type(e).__name__}: {e}"[:4000]
        logger.debug("case failed:\n%s", traceback.format_exc())
    return row


def _mem_fraction() -> float:
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))


def size_pool(cfg: Config, target: GpuTarget, cpu_probe: bool = True
              ) -> tuple[int, dict[str, Any]]:
    """(num_blocks, sizing row): the pool LLM(gpu_memory_utilization=0.9) would pick on the
    target, from the compiled largest step; beside it `jpaged estimate` and the CPU probe."""
    from jpaged.estimate import estimate_capacity

    spec = model_spec(cfg.model)
    probe = StepBuilder(spec, jnp.bfloat16, cfg.kv_cache_dtype, cfg.backend, PROBE_BLOCKS,
                        target.devices, cfg.tensor_parallel_size, weights=cfg.weights,
                        lora=cfg.lora)
    t, b = largest_shape(probe.plan)
    row = compile_lowered(lambda: probe.lower_step(t, b), True, None, probe.pool_shape(),
                          target=target, options=dict(cfg.xla_options))
    act = row.get("temp_bytes")
    device_bytes = int(target.device_memory_bytes * _mem_fraction())
    config = probe.config
    s = config.scheduler
    plan = plan_kv_pool(config.cache, spec, probe.page_dtype, probe.param_bytes,
                        s.max_model_len, activation_bytes=act,
                        kv_head_shards=cfg.tensor_parallel_size, device_bytes=device_bytes,
                        platform="cuda", kv_layers=probe.kv_layout.num_slots,
                        request_blocks=blocks_by_length(
                            probe.kv_layout, config.cache.block_size, s.chunk_limit))
    est = estimate_capacity(model_source(cfg.model, cfg.weights), gpu_memory=device_bytes,
                            gpu_memory_utilization=DEFAULT_UTILIZATION, dtype="bfloat16",
                            kv_cache_dtype=cfg.kv_cache_dtype,
                            tensor_parallel_size=cfg.tensor_parallel_size,
                            quantization="fp8" if cfg.weights == "fp8" else None,
                            **({} if cfg.lora is None else {
                                "enable_lora": True, "max_loras": cfg.lora[0],
                                "max_lora_rank": cfg.lora[1]}))
    sizing = {
        "model": cfg.model, **_weights_field(cfg),
        "kv_cache_dtype": cfg.kv_cache_dtype, "backend": cfg.backend,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "device_memory_bytes": target.device_memory_bytes, "mem_fraction": _mem_fraction(),
        "device_bytes": device_bytes, "gpu_memory_utilization": DEFAULT_UTILIZATION,
        "param_bytes": probe.param_bytes, "probe_shape": [t, b],
        "activation_bytes_gpu": act, "probe_error": row.get("error"),
        "probe_largest_temps": row.get("largest_temps"),
        "margin_bytes": plan.margin_bytes, "kv_budget_bytes": plan.kv_budget_bytes,
        "bytes_per_block": plan.bytes_per_block, "num_blocks": plan.num_blocks,
        "max_concurrent_seqs": plan.max_concurrent_seqs,
        "max_model_len": plan.max_model_len,
        "estimate_activation_bytes": est.activation_bytes,
        "estimate_param_bytes": est.param_bytes_per_device,
        "estimate_num_blocks": est.num_blocks,
        "estimate_max_concurrent_seqs": est.max_concurrent_seqs,
    }
    if cpu_probe and cfg.tensor_parallel_size == 1:
        sizing["activation_bytes_cpu_probe"] = cpu_probe_bytes(cfg)
    return plan.num_blocks, sizing


def cpu_probe_bytes(cfg: Config) -> int | None:
    """What the engine's start-up probe (`step_activation_bytes`) measures on this CPU for the
    same model and KV dtype (bf16 weights, the CPU's own attention path 'xla')."""
    cpu = StepBuilder(model_spec(cfg.model), jnp.bfloat16, cfg.kv_cache_dtype, "xla",
                      PROBE_BLOCKS)
    return step_activation_bytes(cpu.abstract_model, cpu.spec, cpu.plan, cpu.block_size,
                                 cpu.page_dtype, cpu.ops)


def run_config(cfg: Config, shapes: list[tuple[int, int]], target: GpuTarget,
               ptxas: str | None, transfers: bool, cpu_probe: bool,
               sized: tuple[int, dict[str, Any]] | None = None) -> tuple[list[dict],
                                                                         dict[str, Any]]:
    """Size the pool (unless `sized` gives it: `size_pool`'s result), then compile every shape
    (and the tier transfer programs)."""
    num_blocks, sizing = sized or size_pool(cfg, target, cpu_probe=cpu_probe)
    spec = model_spec(cfg.model)
    builder = StepBuilder(spec, jnp.bfloat16, cfg.kv_cache_dtype, cfg.backend, num_blocks,
                          target.devices, cfg.tensor_parallel_size, weights=cfg.weights,
                          lora=cfg.lora)
    # Decode shapes (tokens == seqs) compile with block tables wide enough for the longest
    # context reported; that program serves every context, so it compiles once.
    decoder = StepBuilder(spec, jnp.bfloat16, cfg.kv_cache_dtype, cfg.backend, num_blocks,
                          target.devices, cfg.tensor_parallel_size,
                          engine_config(spec, max_model_len=max(DECODE_CONTEXTS)),
                          weights=cfg.weights, lora=cfg.lora)
    base = {"model": cfg.model, **_weights_field(cfg), "kv_cache_dtype": cfg.kv_cache_dtype,
            "backend": cfg.backend,
            "tensor_parallel_size": cfg.tensor_parallel_size, "num_blocks": num_blocks,
            "pool_bytes": builder.pool_bytes}
    rows = []
    for t, b in shapes:
        bld = decoder if t == b else builder
        # Mixed steps: each sequence prefills t // b tokens from position 0 (the assumption).
        contexts = DECODE_CONTEXTS if t == b else (max(1, t // b),)

        def analyze(text: str, bld=bld, t=t, b=b, contexts=contexts) -> list[dict[str, Any]]:
            return [hbm_fields(text, bld.traffic_case(t, b, c), bld.num_weights,
                               bld.pool_shape(), lookup_weights=bld.lookup_weights)
                    for c in contexts]

        row = {**base, "program": "step", "tokens": t, "seqs": b,
               "max_model_len": bld.config.scheduler.max_model_len}
        flags = DECODE_FLAGS if t == b else TOP_FLAGS  # decode rows: the default step
        row["top_logprobs"] = flags.top_logprobs
        row.update(compile_lowered(
            lambda bld=bld, t=t, b=b, flags=flags: bld.lower_step(t, b, flags), True, ptxas,
            bld.pool_shape(), target=target, analyze=analyze, options=dict(cfg.xla_options),
            step=StepShape(t, spec.hidden_size, spec.num_layers)))
        if (t, b) == tuple(sizing["probe_shape"]):
            row["temp_bytes_at_probe_pool"] = sizing["activation_bytes_gpu"]
        for r in per_context(row, contexts):
            rows.append(r)
            _log_row(r)
    if transfers and cfg.tensor_parallel_size == 1:
        for kind in ("gather", "scatter"):
            row = {**base, "program": f"kv_{kind}", "tokens": 64, "seqs": 0}
            row.update(compile_lowered(lambda kind=kind: builder.lower_transfer(kind, 64), True,
                                       ptxas, builder.pool_shape(), target=target,
                                       analyze=transfer_traffic))
            row.update(dict.fromkeys(HBM_KEYS), **(row.pop("hbm", None) or [{}])[0])
            if kind == "gather":  # not donated: only the absence of copies matters
                row["pool_aliased"] = None if not row.get("pool_copies") else False
            rows.append(row)
            _log_row(row)
    return rows, sizing


def run_spec_config(cfg: Config, target: GpuTarget, ptxas: str | None, num_blocks: int,
                    sizing: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The verifying steps of speculative decoding (`jpaged.aot.spec_verify`) at the sized
    pool: one program per verifying bucket, one row per (B, k) and decode context; the plain
    decode step of each B beside them; and the draft's proposal steps where the target has
    one (`DRAFT_MODELS`, tensor parallel 1, unquantized), its pages in the pool's blocks
    (`sizing`: the target's, whose KV budget the draft's pages share)."""
    spec = model_spec(cfg.model)
    bld = StepBuilder(spec, jnp.bfloat16, cfg.kv_cache_dtype, cfg.backend, num_blocks,
                      target.devices, cfg.tensor_parallel_size,
                      spec_engine_config(spec, max_model_len=max(DECODE_CONTEXTS)),
                      weights=cfg.weights)
    base = {"model": cfg.model, **_weights_field(cfg), "kv_cache_dtype": cfg.kv_cache_dtype,
            "backend": cfg.backend,
            "tensor_parallel_size": cfg.tensor_parallel_size, "num_blocks": num_blocks,
            "pool_bytes": bld.pool_bytes}
    out = []

    def program(b: StepBuilder, head: dict[str, Any], name: str, tokens: int, seqs: int,
                flags: Any, analyze: Callable[[str], list[dict[str, Any]]],
                num_rows: int | None = None) -> dict[str, Any]:
        row = {**head, "program": name, "tokens": tokens, "seqs": seqs,
               "max_model_len": b.config.scheduler.max_model_len,
               "top_logprobs": flags.top_logprobs}
        row.update(compile_lowered(
            lambda: b.lower_step(tokens, seqs, flags, num_rows=num_rows), True, ptxas,
            b.pool_shape(), target=target, analyze=analyze, options=dict(cfg.xla_options),
            step=StepShape(tokens, b.spec.hidden_size, b.spec.num_layers)))
        return row

    def emit(rows: list[dict[str, Any]]) -> None:
        for r in rows:
            out.append(r)
            _log_row(r)

    for (rows, seqs), pairs in verify_shapes(bld.plan).items():
        # A verifying step: T = R rows of `seqs` sequences, the tiled ragged attention.
        row = program(bld, base, "spec_verify", rows, seqs, VERIFY_FLAGS,
                      lambda text, pairs=pairs: [verify_hbm(text, bld, b, k, c)
                                                 for b, k in pairs for c in DECODE_CONTEXTS],
                      num_rows=rows)
        emit(verify_rows_of(row, pairs, rows, DECODE_CONTEXTS, HBM_KEYS, seqs))
    plain = [(bld, base, "spec_decode_base", 1)]
    draft = DRAFT_MODELS.get(cfg.model)
    if draft is not None and cfg.tensor_parallel_size == 1 and cfg.weights is None:
        dspec = model_spec(draft)
        dblocks = num_blocks
        if sizing is not None:  # the pool's blocks hold both models' pages
            probe = StepBuilder(dspec, jnp.bfloat16, cfg.kv_cache_dtype, cfg.backend, 1)
            per_block = probe.pool_bytes
            dblocks = sizing["kv_budget_bytes"] // (sizing["bytes_per_block"] + per_block)
        dbld = StepBuilder(dspec, jnp.bfloat16, cfg.kv_cache_dtype, cfg.backend, dblocks,
                           target.devices, 1,
                           spec_engine_config(dspec, max_model_len=max(DECODE_CONTEXTS)))
        dbase = {**base, "model": draft, "draft_for": cfg.model, "num_blocks": dblocks,
                 "pool_bytes": dbld.pool_bytes}
        plain += [(dbld, dbase, "draft_decode", 1),
                  (dbld, dbase, "draft_catch_up", DRAFT_CATCH_UP_TOKENS)]
    for b, head, name, per_seq in plain:
        for (t, seqs), batches in base_shapes(b.plan, SPEC_BATCHES, per_seq).items():
            flags = DECODE_FLAGS if t == seqs else VERIFY_FLAGS

            def analyze(text: str, b=b, batches=batches, per_seq=per_seq
                        ) -> list[dict[str, Any]]:
                return [step_hbm(text, b, n, per_seq, c) for n in batches
                        for c in DECODE_CONTEXTS]

            row = program(b, head, name, t, seqs, flags, analyze)
            emit(batch_rows_of(row, batches, DECODE_CONTEXTS, HBM_KEYS))
    return out


def _weights_field(cfg: Config) -> dict[str, Any]:
    """{"weights": kind} for a configuration whose linears are quantized, {"lora": [slots,
    rank]} for one serving LoRA adapters, else nothing (the rows of the model dtype's weights
    keep their fields)."""
    out: dict[str, Any] = {"weights": cfg.weights} if cfg.weights else {}
    if cfg.lora:  # (max_loras, max_lora_rank)
        out["lora"] = list(cfg.lora)
    return out


def transfer_traffic(text: str) -> list[dict[str, Any]]:
    """A tier transfer program's bytes moved (no weights, no kernels) and predicted time."""
    moved = estimate_traffic(text).hbm_bytes
    return [{"hbm_bytes": moved, "predicted_step_ms": round(moved / H200_HBM_BYTES_PER_S * 1e3,
                                                            3)}]


def per_context(row: dict[str, Any], contexts: tuple[int, ...]) -> list[dict[str, Any]]:
    """One row per context length of a compiled case (its HBM_KEYS filled); rows after the
    first are marked `reuses_compile` (same program: not counted or checked twice)."""
    found = row.pop("hbm", None) or [{"context_len": c} for c in contexts]
    out = []
    for i, h in enumerate(found):
        r = {**row, **dict.fromkeys(HBM_KEYS), **h}
        if i:
            r["reuses_compile"] = True
        out.append(r)
    return out


def _log_row(row: dict[str, Any]) -> None:
    status = "ok" if row.get("compiled") else f"FAILED {row.get('error', '')[:200]}"
    ks = ", ".join(f"{k['name']} r{k['registers']} s{k['spill_bytes']} "
                   f"smem{k['shared_memory_bytes']} ld{k.get('max_global_load_bytes')}"
                   for k in row.get("kernels", []))
    model = f"{row['model']}-{row['weights']}" if row.get("weights") else row["model"]
    print(f"  {model:13s} {row['kv_cache_dtype']:9s} {row['backend']:6s} "
          f"tp{row['tensor_parallel_size']} {row['program']:8s} T={row['tokens']:<5d} "
          f"B={row['seqs']:<4d} {row.get('compile_s', 0):6.1f}s "
          f"aliased={row.get('pool_aliased')} {status} {ks}{_launch_text(row)}"
          f"{_hbm_text(row)}", flush=True)


def _launch_text(row: dict[str, Any]) -> str:
    if row.get("kernels_per_step") is None:
        return ""
    return (f" launches={row['kernels_per_step']} per_layer={row['kernels_per_layer']} "
            f"outside_graphs={row['kernels_outside_command_buffers']}"
            f"+{row['control_flow_outside_command_buffers']}cf "
            f"wide={row['wide_elementwise_passes']}")


def _hbm_text(row: dict[str, Any]) -> str:
    if row.get("hbm_bytes") is None:
        return ""
    verify = (f" B={row['batch']} k={row['k']} verify x{row['traffic_ratio_verify']}"
              if row.get("traffic_ratio_verify") is not None else "")
    return (f" ctx={row['context_len']} hbm={row['hbm_bytes'] / 1e9:.2f}GB "
            f"x{row['traffic_ratio']} {row['predicted_step_ms']:.2f}ms{verify}")


def check_rows(rows: list[dict[str, Any]]) -> list[str]:
    """What fails the bar: not compiled, pool not aliased, a weight copied or sent through a
    collective, registers, spills, smem, a streaming kernel's loads narrower than 16 bytes."""
    bad = []
    for r in rows:
        if r.get("reuses_compile"):
            continue
        model = f"{r['model']}-{r['weights']}" if r.get("weights") else r["model"]
        tag = (f"{model}/{r['kv_cache_dtype']}/{r['backend']}/tp{r['tensor_parallel_size']}"
               f"/{r['program']} T={r['tokens']} B={r['seqs']}")
        if not r.get("compiled"):
            bad.append(f"{tag}: did not compile: {r.get('error', '')[:300]}")
            continue
        if r["program"] != "kv_gather" and r.get("pool_aliased") is not True:
            bad.append(f"{tag}: pool not aliased in place (copies: {r.get('pool_copies')})")
        if r["program"] == "kv_gather" and r.get("pool_copies"):
            bad.append(f"{tag}: pool copied: {r['pool_copies']}")
        # Every weight byte once: no temporary copies a weight, no collective carries one.
        if r.get("param_copy_bytes"):
            bad.append(f"{tag}: {r['param_copy_bytes']} bytes of weight copies")
        if r.get("param_collective_bytes"):
            bad.append(f"{tag}: collectives carry {r['param_collective_bytes']} weight bytes")
        for k in r.get("kernels", []):
            if k["registers"] is None or k["registers"] > MAX_REGISTERS:
                bad.append(f"{tag}: {k['name']} registers {k['registers']}")
            if k["spill_bytes"]:
                bad.append(f"{tag}: {k['name']} spills {k['spill_bytes']} bytes")
            if k["shared_memory_bytes"] > SHARED_MEMORY_OPTIN:
                bad.append(f"{tag}: {k['name']} shared memory {k['shared_memory_bytes']} B")
            if k["name"].startswith(STREAMING_KERNEL_PREFIXES):
                width = k.get("max_global_load_bytes")
                if width is None:
                    bad.append(f"{tag}: {k['name']} load width unknown (no PTX entry)")
                elif width < MIN_STREAMING_LOAD_BYTES:
                    bad.append(f"{tag}: {k['name']} widest global load {width} B "
                               f"(< {MIN_STREAMING_LOAD_BYTES})")
    return bad


def plan_configs(quick: bool) -> list[tuple[Config, str]]:
    """(configuration, shape set) pairs: SmolLM2 and the 8B x bf16/fp8 x pallas/xla; TP 2 on
    the 8B; Gemma 3 270M (sliding windows) on the Pallas path; the 8B's decode steps with
    fp8 and int4 weights on the Pallas path (the quantized decode matmul kernels)."""
    out = []
    for model in ("smollm2-135m", "llama3-8b"):
        for kvd in ("bfloat16", "fp8_e4m3"):
            for be in ("pallas", "xla"):
                out.append((Config(model, kvd, be), "quick" if quick else "all"))
    for be in ("pallas", "xla"):
        out.append((Config("llama3-8b", "bfloat16", be, 2), "decode" if quick else "all"))
    # Sliding windows, Gemma's blocks and head_dim 256 in the kernels.
    out.append((Config("gemma3-270m", "bfloat16", "pallas"), "decode" if quick else "all"))
    for weights in WEIGHTS:
        out.append((Config("llama3-8b", "bfloat16", "pallas", weights=weights), "decode"))
    # An engine serving LoRA adapters (4 slots of rank 16): its steps on XLA's GEMMs.
    out.append((Config("llama3-8b", "bfloat16", "pallas", lora=(4, 16)), "decode"))
    # A mixture of experts: the grouped-matmul kernel reads only the experts tokens chose.
    out.append((Config("qwen3-30b-a3b", "bfloat16", "pallas"), "decode"))
    for weights in WEIGHTS:  # (int4: a GPTQ / AWQ checkpoint's experts, or a GGUF's)
        out.append((Config("qwen3-30b-a3b", "bfloat16", "pallas", weights=weights), "decode"))
    return out


def shapes_for(builder_plan: Any, which: str) -> list[tuple[int, int]]:
    """Bucket shapes: 'all' of the plan; 'quick' = the decode shapes of DECODE_BATCHES and the
    largest mixed shape (every kernel and both attention paths); 'decode' = the decode shapes."""
    all_shapes = builder_plan.all_shapes()
    decode = [(b, b) for b in DECODE_BATCHES if (b, b) in all_shapes] or all_shapes[:1]
    if which == "all":
        return all_shapes
    if which == "decode":
        return decode
    return [*decode, max(all_shapes)]


def run(quick: bool, only: str | None = None, decode_only: bool = False,
        xla_options: dict[str, Any] | None = None, spec: bool = False) -> dict[str, Any]:
    """Every case of the plan for one abstract H200 (two for TP); the JSON document.
    `xla_options`: XLA compile options for every program, over COMMAND_BUFFER_OPTIONS (all
    recorded in the document). `spec`: the verifying steps of speculative decoding of every
    configuration (`run_spec_config`, under "spec_verify"), and the other cases only with
    `quick` or `decode_only`."""
    xla_options = {**COMMAND_BUFFER_OPTIONS, **(xla_options or {})}
    ptxas = find_ptxas()
    targets = {1: h200_target(1)}
    try:
        targets[2] = h200_target(2)
    except Exception as e:  # noqa: BLE001 - TP 2 is reported as not available
        logger.warning("no 2-device topology: %s", e)
    cases, sizing, verify = [], [], []
    steps = not spec or quick or decode_only
    for cfg, which in plan_configs(quick):
        cfg = replace(cfg, xla_options=tuple(sorted(xla_options.items())))
        if only and not any(part in cfg.key for part in only.split(",")):
            continue
        target = targets.get(cfg.tensor_parallel_size)
        if target is None:
            continue
        probe = cfg.backend == "xla" and not decode_only and steps
        sized = size_pool(cfg, target, cpu_probe=probe)
        if steps:
            plan = BucketPlan.for_config(engine_config(model_spec(cfg.model)))
            rows, _ = run_config(cfg, shapes_for(plan, "decode" if decode_only else which),
                                 target, ptxas, transfers=cfg.backend == "xla" and not decode_only,
                                 cpu_probe=probe, sized=sized)
            cases += rows
        if spec:
            verify += run_spec_config(cfg, target, ptxas, sized[0], sized[1])
        sizing.append(sized[1])
    mode = "decode" if decode_only else "quick" if quick else "full" if steps else ""
    if spec:
        mode = f"{mode}+spec" if mode else "spec"
    doc = {"jax_version": jax.__version__, "target": TARGET_NAME,
           "hbm_bytes_per_s": H200_HBM_BYTES_PER_S, "ptxas": ptxas, "mode": mode,
           "xla_options": dict(xla_options),
           "cases": cases, "sizing": sizing, "problems": check_rows(cases + verify)}
    if spec:
        doc["spec_verify"] = verify
        doc["spec_cycles"] = cycle_rows(verify)
    return doc
