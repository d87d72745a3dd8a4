"""The measuring and planning commands: `jpaged bench`, `tune`, `estimate` and `convert`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from jpaged.cli_common import create_engine, fail, run_worker_if_not_rank0, setup_logging
from jpaged.cli_engine_flags import engine_args, with_engine_flags
from jpaged.config import DEFAULT_MAX_NUM_BATCHED_TOKENS


@with_engine_flags(exclude=("disable_log_stats",))
def bench(
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="Requests in the batch.")] = 64,
    input_len: Annotated[int, typer.Option("--input-len", help="Prompt tokens each.")] = 128,
    output_len: Annotated[int, typer.Option("--output-len", help="Generated tokens each.")] = 64,
    warmup: Annotated[bool, typer.Option(
        "--warmup/--no-warmup", help="Run an untimed batch of the same shape first.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    out: Annotated[Path | None, typer.Option("--out", help="Also write the JSON here.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log to stderr.")] = False,
    engine_flags: dict[str, Any] | None = None,
) -> None:
    """Offline throughput on random prompts, as `vllm bench throughput` (--seed seeds both)."""
    flags = engine_flags or {}
    setup_logging(verbose)
    for flag, value in (("--num-prompts", num_prompts), ("--input-len", input_len),
                        ("--output-len", output_len)):
        if value < 1:  # before the model loads
            fail(f"{flag} must be >= 1, got {value}")
    if run_worker_if_not_rank0(flags):
        return
    from jpaged.bench import report
    from jpaged.bench.throughput import run_throughput, summary_line

    try:
        engine = create_engine(engine_args(flags, disable_log_stats=True))
        result = run_throughput(engine, num_prompts, input_len, output_len, flags["seed"],
                                warmup)
        engine.shutdown()  # a multi-process run: the other processes stop too
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    if out is not None:
        report.write(out, result)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    typer.echo(summary_line(result))
    report.print_table(f"jpaged bench: {num_prompts} x ({input_len} in, {output_len} out)",
                       [(k, v) for k, v in result.items()])


# tune builds engine after engine in one process: never over several processes, and it logs
# its own progress instead of stats lines.
@with_engine_flags(exclude=("swap_space", "nnodes", "node_rank", "master_addr", "master_port",
                            "distributed_timeout_s", "engine_core_process",
                            "disable_log_stats"))
def tune(
    workload: Annotated[Path | None, typer.Option(
        "--workload", help="JSONL of requests: prompt | prompt_token_ids | messages, "
        "max_tokens.")] = None,
    synthetic: Annotated[str | None, typer.Option(
        "--synthetic", help="Random requests: n=64,in=256,out=64,prefix=0,seed=0.")] = None,
    num_requests: Annotated[int | None, typer.Option(
        "--num-requests", help="Requests sampled from the workload (default 64; quick 16).")
    ] = None,
    max_minutes: Annotated[float, typer.Option(
        "--max-minutes", help="Stop after this long with the best so far.")] = 10.0,
    quick: Annotated[bool, typer.Option("--quick", help="Smaller sample, coarser steps.")
                     ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print {steps, recommended} as JSON.")
                       ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log to stderr.")] = False,
    engine_flags: dict[str, Any] | None = None,
) -> None:
    """Find engine flags for a workload: memory, then max_num_seqs, then features."""
    setup_logging(verbose)
    from jpaged.tune.command import print_report
    from jpaged.tune.command import tune as run_tune

    try:
        report, rows, command = run_tune(
            engine_args(engine_flags or {}), workload=workload, synthetic_spec=synthetic,
            num_requests=num_requests, max_minutes=max_minutes, quick=quick,
            progress=sys.stderr.isatty() or not as_json)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps({**report.to_json(), "command": command}, indent=2))
        return
    print_report(report, rows, command)


# estimate reads the model's config only, and plans for a device it may not run on: its own
# --model, --dtype and memory options; the pool's shape flags are the engine's.
@with_engine_flags(only=("block_size", "kv_cache_dtype", "max_model_len", "tensor_parallel_size",
                         "max_num_seqs", "quantization", "enable_lora", "max_loras",
                         "max_lora_rank", "hf_overrides"))
def estimate(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="HF directory, config.json, .gguf or hub repo id (config only; "
        "default: embedded SmolLM2).")] = None,
    gpu_memory: Annotated[str, typer.Option(
        "--gpu-memory", help="Memory of one device: 80GiB, 80GB (1e9), 512MiB or bytes.")
    ] = "80GiB",
    gpu_memory_utilization: Annotated[float, typer.Option(
        "--gpu-memory-utilization", help="Fraction of device memory jpaged may use.")] = 0.9,
    avg_len: Annotated[int | None, typer.Option(
        "--avg-len", help="Average sequence length for a second concurrency figure.")] = None,
    dtype: Annotated[str, typer.Option(
        "--dtype", help="Weights dtype, one of: auto (the config's torch_dtype), float32, "
        "bfloat16, float16.")
    ] = "auto",
    max_num_batched_tokens: Annotated[int, typer.Option(
        "--max-num-batched-tokens", help="Token budget per step (sizes the activations).")
    ] = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    draft_model: Annotated[str | None, typer.Option(
        "--draft-model", help="A speculative draft model (as --model): its weights and its "
        "KV per block count too (speculative_config's model).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    engine_flags: dict[str, Any] | None = None,
) -> None:
    """Plan KV capacity: bytes per token/block, blocks that fit, max concurrent sequences."""
    from jpaged.estimate import EstimateError, estimate_capacity, rows

    try:
        est = estimate_capacity(
            model, gpu_memory=gpu_memory, gpu_memory_utilization=gpu_memory_utilization,
            avg_len=avg_len, dtype=dtype, max_num_batched_tokens=max_num_batched_tokens,
            draft_model=draft_model, **(engine_flags or {}))
    except EstimateError as e:
        fail(str(e))
    if as_json:
        typer.echo(est.to_json())
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="jpaged estimate: KV cache capacity")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for name, value in rows(est):
        table.add_row(name, value)
    Console().print(table)


def convert(
    src: Annotated[str, typer.Argument(
        help="Model to convert: 'embedded' (the default SmolLM2), a .gguf file, an HF "
        "directory or hub repo id.")],
    out: Annotated[Path, typer.Argument(help="Directory to write the jpaged checkpoint to.")],
    dtype: Annotated[str, typer.Option(
        "--dtype", help="Dtype the parameters are stored in, one of: float32, bfloat16, "
        "float16.")
    ] = "float32",
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace the checkpoint files of an existing, non-empty OUT.")
    ] = False,
    quantization: Annotated[str | None, typer.Option(
        "--quantization", help="Store the weights quantized: gguf (a GGUF at its own "
        "quantization) or fp8 (decoder linears per channel); OUT loads back quantized.")
    ] = None,
) -> None:
    """Write SRC as an orbax checkpoint that --model OUT loads faster (docs/distributed.md)."""
    import time

    from jpaged.config import canonical_dtype
    from models.build import DTYPES
    from models.checkpoint import MARKER, PARAMS_DIR, save_checkpoint
    from models.loader import DEFAULT_MODEL, load_model

    dtype = canonical_dtype(dtype)
    if dtype not in DTYPES:
        fail(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if out.exists() and not out.is_dir():
        fail(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        fail(f"output directory {out} exists and is not empty; pass --overwrite to replace "
             "a checkpoint there, or choose another directory")
    model = None if src in ("embedded", DEFAULT_MODEL) else src
    try:
        t0 = time.perf_counter()
        loaded = load_model(model, dtype, quantization=quantization)
        t1 = time.perf_counter()
        path = save_checkpoint(loaded, out, overwrite=overwrite)
        t2 = time.perf_counter()
    except (ValueError, FileNotFoundError, FileExistsError, OSError) as e:
        fail(str(e))
    params = json.loads((path / MARKER).read_text())["params"]
    on_disk = sum(f.stat().st_size for f in (path / PARAMS_DIR).rglob("*") if f.is_file())
    typer.echo(str(path))
    typer.echo(f"source {loaded.source}: {loaded.spec.architecture}, "
               f"{params['num_params'] / 1e6:.1f}M params in {params['num_tensors']} tensors, "
               f"{dtype}{'' if quantization is None else ', ' + quantization}; "
               f"{params['bytes'] / 2**20:.1f} MiB in memory, "
               f"{on_disk / 2**20:.1f} MiB on disk")
    typer.echo(f"loaded in {t1 - t0:.2f} s, written in {t2 - t1:.2f} s; "
               f"use it with --model {path}")
