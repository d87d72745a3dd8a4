"""The `jpaged` command line (typer); thin over the package."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from jpaged.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DISTRIBUTED_TIMEOUT_S,
    DEFAULT_HOST,
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PORT,
)

app = typer.Typer(help="jpaged: a JAX inference engine with a vLLM-style paged KV cache.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode=None)

Model = Annotated[str | None, typer.Option(
    "--model", "-m", help="HF directory, .gguf file or hub repo id (default: embedded SmolLM2).")]
BlockSize = Annotated[int, typer.Option("--block-size", help="Tokens per KV block (power of 2).")]
GpuMem = Annotated[float | None, typer.Option(
    "--gpu-memory-utilization", help="Fraction of device memory for weights + activations + KV "
    "pool (default 0.9; on CPU a 2 GiB KV space, capped by RAM).")]
KvBytes = Annotated[int | None, typer.Option(
    "--kv-cache-memory-bytes", help="KV pool size in bytes (overrides the fraction).")]
Prefix = Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching",
                                      help="Reuse KV blocks of shared prompt prefixes.")]
HashSeed = Annotated[str | None, typer.Option(
    "--prefix-caching-hash-seed",
    help="A deployment's secret mixed into every prefix-cache hash (default: "
    "$JPAGED_PREFIX_CACHING_HASH_SEED, else none); every replica and restart must share it.")]
KvDtype = Annotated[str, typer.Option(
    "--kv-cache-dtype",
    help="Page dtype, one of: auto, float32, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2.")]
HashAlgo = Annotated[str, typer.Option(
    "--prefix-caching-hash-algo", help="Prefix-cache block hash, one of: sha256, xxhash.")]
Swap = Annotated[float, typer.Option("--swap-space", help="Disk tier size in GiB.")]
KvDir = Annotated[str | None, typer.Option(
    "--kv-cache-dir", help="The disk tier's folder (default ~/.cache/jpaged/kv).")]
KvScales = Annotated[bool, typer.Option(
    "--calculate-kv-scales", help="fp8 KV only: per-layer scales from the first batch's K/V, "
    "then fixed (default: scale 1).")]
Offload = Annotated[float, typer.Option("--kv-offloading-size", help="Host RAM tier in GiB.")]
MaxSeqs = Annotated[int, typer.Option("--max-num-seqs", help="Max sequences per step.")]
MaxTokens = Annotated[int | None, typer.Option("--max-num-batched-tokens",
                                               help="Token budget per step.")]
MaxLen = Annotated[int | None, typer.Option("--max-model-len", help="Context length limit.")]
Dtype = Annotated[str, typer.Option(
    "--dtype", help="Weights' and activations' dtype, one of: auto, float32, bfloat16, float16.")]
Chunked = Annotated[bool, typer.Option(
    "--enable-chunked-prefill/--no-enable-chunked-prefill",
    help="Split long prompts over steps to fit the token budget (default on).")]
LongPrefill = Annotated[int | None, typer.Option(
    "--long-prefill-token-threshold", help="Most prompt tokens one request takes in a step.")]
Policy = Annotated[str, typer.Option(
    "--scheduling-policy", help="One of: priority, fcfs, lpm.")]
TP = Annotated[int, typer.Option("--tensor-parallel-size", help="Devices for tensor parallelism.")]
Preempt = Annotated[str, typer.Option("--preemption-mode", help="One of: recompute, swap.")]
Backend = Annotated[str, typer.Option("--attention-backend",
                                      help="One of: auto, pallas, reference, xla.")]
NoHybrid = Annotated[bool, typer.Option(
    "--disable-hybrid-kv-cache-manager",
    help="Keep every token's KV in every layer, sliding-window layers too (one full-attention "
    "group); by default sliding layers free the blocks behind their window.")]
Seed = Annotated[int, typer.Option("--seed", help="Engine seed.")]
Async = Annotated[bool, typer.Option(
    "--async-scheduling/--no-async-scheduling",
    help="Overlap the host with the device: dispatch the next step before reading this one's "
    "tokens (--no-async-scheduling: the synchronous reference loop).")]
CoreProc = Annotated[bool, typer.Option(
    "--engine-core-process/--no-engine-core-process",
    help="Run the scheduler and the device step in a process of their own; detokenization, "
    "stop strings and outputs stay in this one (vLLM V1's engine-core process).")]
Blocks = Annotated[int | None, typer.Option("--num-gpu-blocks-override",
                                            help="Exact KV pool size in blocks.")]
KvEvents = Annotated[str | None, typer.Option(
    "--kv-events-config",
    help="KV cache events as JSON, vLLM's: e.g. '{\"enable_kv_cache_events\": true, "
    "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}' (docs/distributed.md).")]
KvTransfer = Annotated[str | None, typer.Option(
    "--kv-transfer-config",
    help="A KV connector as JSON, vLLM's: disaggregated prefill/decode, e.g. "
    "'{\"kv_connector\": \"JaxTransferConnector\", \"kv_role\": \"kv_producer\", "
    "\"kv_port\": 14579}' (docs/distributed.md).")]
StructuredOut = Annotated[str | None, typer.Option(
    "--structured-outputs-config",
    help="Structured outputs' engine-wide defaults as JSON, vLLM's: '{\"backend\": "
    "\"guidance\"}' lets an object schema that does not say additionalProperties take other "
    "keys (default \"auto\": only the listed ones); \"disable_additional_properties\" and "
    "\"disable_any_whitespace\" go with \"guidance\" (docs/architecture.md).")]

Nnodes = Annotated[int, typer.Option(
    "--nnodes", help="Processes (hosts) one model spans; each runs this same command.")]
NodeRank = Annotated[int, typer.Option(
    "--node-rank", help="This process's rank: 0 schedules and serves, the others only run "
    "the steps process 0 sends them.")]
MasterAddr = Annotated[str, typer.Option(
    "--master-addr", help="Process 0's address (JAX coordinator on --master-port, the step "
    "channel on --master-port + 1).")]
MasterPort = Annotated[int, typer.Option("--master-port", help="Process 0's coordinator port.")]
DistTimeout = Annotated[float, typer.Option(
    "--distributed-timeout-s", help="Seconds to wait for every process to join, and to notice "
    "a dead one.")]
MaxLogprobs = Annotated[int, typer.Option(
    "--max-logprobs", help="Most logprobs / prompt_logprobs a request may ask for (-1: the "
    "whole vocabulary, which a request asks for with -1); each step with logprobs computes "
    "this many candidates.")]
LogprobsMode = Annotated[str, typer.Option(
    "--logprobs-mode", help="vLLM's: only raw_logprobs (its default) is implemented.")]


def _engine_flags(
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
    gpu_memory_utilization: GpuMem = None,
    kv_cache_memory_bytes: KvBytes = None,
    enable_prefix_caching: Prefix = True,
    prefix_caching_hash_seed: HashSeed = None,
    prefix_caching_hash_algo: HashAlgo = "sha256",
    kv_cache_dtype: KvDtype = "auto",
    calculate_kv_scales: KvScales = False,
    swap_space: Swap = 0.0,
    kv_cache_dir: KvDir = None,
    kv_offloading_size: Offload = 0.0,
    max_num_seqs: MaxSeqs = DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: MaxTokens = None,
    max_model_len: MaxLen = None,
    dtype: Dtype = "auto",
    enable_chunked_prefill: Chunked = True,
    long_prefill_token_threshold: LongPrefill = None,
    scheduling_policy: Policy = "priority",
    tensor_parallel_size: TP = 1,
    preemption_mode: Preempt = "recompute",
    disable_hybrid_kv_cache_manager: NoHybrid = False,
    attention_backend: Backend = "auto",
    seed: Seed = 0,
    num_gpu_blocks_override: Blocks = None,
    async_scheduling: Async = True,
    engine_core_process: CoreProc = False,
    kv_events_config: KvEvents = None,
    kv_transfer_config: KvTransfer = None,
    structured_outputs_config: StructuredOut = None,
    nnodes: Nnodes = 1,
    node_rank: NodeRank = 0,
    master_addr: MasterAddr = DEFAULT_MASTER_ADDR,
    master_port: MasterPort = DEFAULT_MASTER_PORT,
    distributed_timeout_s: DistTimeout = DEFAULT_DISTRIBUTED_TIMEOUT_S,
    max_logprobs: MaxLogprobs = DEFAULT_MAX_LOGPROBS,
    logprobs_mode: LogprobsMode = "raw_logprobs",
) -> None:
    """Template of the engine flags every engine command takes, spelled as vLLM's."""


ENGINE_FLAGS = inspect.signature(_engine_flags, eval_str=True).parameters


def engine_command(*, exclude: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Any]:
    """Register a command whose options are its own plus the engine flags (minus `exclude`).

    The command function takes `engine_flags: dict[str, Any]` instead of one parameter per flag;
    typer sees the merged signature, so `--help` lists every flag.
    """
    def register(fn: Callable[..., Any]) -> Any:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values()
               if p.name != "engine_flags"]
        extra = [p for name, p in ENGINE_FLAGS.items() if name not in exclude]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            flags = {p.name: kwargs.pop(p.name) for p in extra}
            return fn(engine_flags=flags, **kwargs)

        del command.__wrapped__  # typer must read the merged signature below
        command.__signature__ = inspect.Signature(own + extra)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in own + extra}
        return app.command()(command)

    return register


@app.callback()
def _root() -> None:
    """jpaged: a JAX inference engine with a vLLM-style paged KV cache."""


# "SamplingParams.top_p must ..." names the field; engine and sampling flags are spelled as
# their fields (--top-p), so the message can name the flag too.
_FIELD_RE = re.compile(r"\b(?:SamplingParams|CacheConfig|SchedulerConfig|ModelConfig|"
                       r"ParallelConfig|EngineArgs)\.(\w+)\b"
                       r"|\b(kv_events_config|kv_transfer_config|structured_outputs_config)\b")


def _run_worker_if_not_rank0(model: str | None, flags: dict[str, Any]) -> bool:
    """Processes 1..nnodes-1 of a multi-process run: run the steps process 0 sends until it
    says stop (True), or exit with the error; process 0 and single-process runs: False."""
    if flags.get("nnodes", 1) <= 1 or flags.get("node_rank", 0) == 0:
        return False
    from jpaged.multiprocess_worker import run_worker
    from jpaged.runner.multiprocess import ProcessGroupError, exit_now

    try:
        run_worker(_engine_args({**flags, "model": model}))
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    except ProcessGroupError as e:
        exit_now(e)
    return True


def _fail(msg: str) -> None:
    m = _FIELD_RE.search(msg)
    if m is not None:
        msg = f"--{(m.group(1) or m.group(2)).replace('_', '-')}: {msg}"
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


def _read_prompts(path: Path) -> list[str]:
    """The prompts of a --input JSONL file: one {"prompt": "..."} object a line (blank lines
    skipped); anything else stops the command with the file and line named."""
    if not path.is_file():
        _fail(f"--input file not found: {path}" if not path.exists()
              else f"--input is not a file: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        _fail(f"--input {path} is not UTF-8 text ({e.reason} at byte {e.start})")
    except OSError as e:
        _fail(f"--input: cannot read {path}: {e.strerror or e}")
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            _fail(f"{where}: not JSON ({e})")
        if not isinstance(obj, dict) or "prompt" not in obj:
            _fail(f"{where}: expected a JSON object with 'prompt', got {line.strip()[:60]}")
        if not isinstance(obj["prompt"], str):
            _fail(f"{where}: 'prompt' must be a string")
        if extra := sorted(set(obj) - {"prompt"}):
            _fail(f"{where}: unknown key(s) {', '.join(map(repr, extra))}: a line holds only "
                  "'prompt'; the command's flags set max tokens and sampling")
        out.append(obj["prompt"])
    return out


@engine_command()
def generate(
    prompts: Annotated[list[str] | None, typer.Argument(help="Prompts to complete.")] = None,
    model: Model = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k")] = -1,
    min_p: Annotated[float, typer.Option("--min-p")] = 0.0,
    n: Annotated[int, typer.Option("--n", help="Completions per prompt.")] = 1,
    raw: Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per prompt.")] = False,
    input_file: Annotated[Path | None, typer.Option("--input",
                                                    help="JSONL file of {'prompt': ...}.")] = None,
    output_file: Annotated[Path | None, typer.Option("--output",
                                                     help="Write JSONL results here.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log to stderr.")] = False,
    engine_flags: dict[str, Any] | None = None,
) -> None:
    """Complete prompts with the paged engine (chat template applied unless --raw)."""
    _setup_logging(verbose)
    if _run_worker_if_not_rank0(model, engine_flags or {}):
        return
    texts = list(prompts or [])
    if input_file is not None:
        texts.extend(_read_prompts(input_file))
    if output_file is not None:  # checked before the model loads, not after the batch ran
        if output_file.is_dir():
            _fail(f"--output is a directory: {output_file}")
        if not output_file.parent.is_dir():
            _fail(f"--output: no such directory: {output_file.parent}")
    if not texts:
        _fail("give at least one PROMPT or --input FILE")
    for i, t in enumerate(texts, 1):  # checked before the model loads
        if not t:
            _fail(f"prompt {i} is empty")
    from jpaged.llm import LLM
    from jpaged.runner.multiprocess import ProcessGroupError, exit_now
    from jpaged.sampling_params import SamplingParams

    try:
        flags = engine_flags or {}
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, max_tokens=max_tokens, seed=flags.get("seed", 0))
        llm = LLM(model, **flags)
        tok = llm.get_tokenizer()
        inputs: list[Any] = []
        for t in texts:
            if raw or not tok.has_chat_template:
                inputs.append(t)
            else:
                templ = tok.apply_chat_template([{"role": "user", "content": t}])
                inputs.append({"prompt": t,
                               "prompt_token_ids": tok.encode(templ, add_special_tokens=False)})
        # A batch written to a file always reports progress on stderr (one final line when
        # stderr is not a terminal); several prompts to a terminal only when it is one.
        show = output_file is not None or (len(inputs) > 1 and sys.stderr.isatty())
        outs = llm.generate(inputs, params, use_tqdm=show)
        llm.llm_engine.shutdown()  # a multi-process run: the other processes stop too
    except ProcessGroupError as e:
        exit_now(e)
        return
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
        return
    try:
        sink = output_file.open("w") if output_file is not None else None
    except OSError as e:
        _fail(f"--output: cannot write {output_file}: {e.strerror or e}")
        return
    try:
        for out in outs:
            for c in out.outputs:
                rec = {"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids,
                       "finish_reason": c.finish_reason}
                if sink is not None:
                    sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
                elif as_json:
                    typer.echo(json.dumps(rec, ensure_ascii=False))
                else:
                    typer.echo(c.text)
    finally:
        if sink is not None:
            sink.close()


@app.command()
def estimate(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="HF directory, config.json, .gguf or hub repo id (config only; "
        "default: embedded SmolLM2).")] = None,
    gpu_memory: Annotated[str, typer.Option(
        "--gpu-memory", help="Memory of one device: 80GiB, 80GB (1e9), 512MiB or bytes.")
    ] = "80GiB",
    gpu_memory_utilization: Annotated[float, typer.Option(
        "--gpu-memory-utilization", help="Fraction of device memory jpaged may use.")] = 0.9,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
    kv_cache_dtype: KvDtype = "auto",
    max_model_len: MaxLen = None,
    avg_len: Annotated[int | None, typer.Option(
        "--avg-len", help="Average sequence length for a second concurrency figure.")] = None,
    tensor_parallel_size: TP = 1,
    dtype: Annotated[str, typer.Option(
        "--dtype", help="Weights dtype, one of: auto (the config's torch_dtype), float32, "
        "bfloat16, float16.")
    ] = "auto",
    max_num_batched_tokens: Annotated[int, typer.Option(
        "--max-num-batched-tokens", help="Token budget per step (sizes the activations).")
    ] = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: MaxSeqs = DEFAULT_MAX_NUM_SEQS,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Plan KV capacity: bytes per token/block, blocks that fit, max concurrent sequences."""
    from jpaged.estimate import EstimateError, estimate_capacity, rows

    try:
        est = estimate_capacity(
            model, gpu_memory=gpu_memory, gpu_memory_utilization=gpu_memory_utilization,
            block_size=block_size, kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
            avg_len=avg_len, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    except EstimateError as e:
        _fail(str(e))
        return
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


@app.command()
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
) -> None:
    """Write SRC as an orbax checkpoint that --model OUT loads faster (docs/distributed.md)."""
    import time

    from models.build import DTYPES
    from models.checkpoint import MARKER, PARAMS_DIR, save_checkpoint
    from models.loader import DEFAULT_MODEL, load_model

    if dtype not in DTYPES:
        _fail(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if out.exists() and not out.is_dir():
        _fail(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        _fail(f"output directory {out} exists and is not empty; pass --overwrite to replace "
              "a checkpoint there, or choose another directory")
    model = None if src in ("embedded", DEFAULT_MODEL) else src
    try:
        t0 = time.perf_counter()
        loaded = load_model(model, dtype)
        t1 = time.perf_counter()
        path = save_checkpoint(loaded, out, overwrite=overwrite)
        t2 = time.perf_counter()
    except (ValueError, FileNotFoundError, FileExistsError, OSError) as e:
        _fail(str(e))
        return
    params = json.loads((path / MARKER).read_text())["params"]
    on_disk = sum(f.stat().st_size for f in (path / PARAMS_DIR).rglob("*") if f.is_file())
    typer.echo(str(path))
    typer.echo(f"source {loaded.source}: {loaded.spec.architecture}, "
               f"{params['num_params'] / 1e6:.1f}M params in {params['num_tensors']} tensors, "
               f"{dtype}; {params['bytes'] / 2**20:.1f} MiB in memory, "
               f"{on_disk / 2**20:.1f} MiB on disk")
    typer.echo(f"loaded in {t1 - t0:.2f} s, written in {t2 - t1:.2f} s; "
               f"use it with --model {path}")


def _engine_args(flags: dict[str, Any]) -> Any:
    """EngineArgs from a command's engine flags (None keeps the EngineArgs default)."""
    import dataclasses

    from jpaged.config import EngineArgs

    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    kw = {k: v for k, v in flags.items()
          if k in EngineArgs.field_names() and not (v is None and defaults.get(k) is not None)}
    return EngineArgs(**kw)


@engine_command()
def serve(
    model: Model = None,
    host: Annotated[str, typer.Option("--host", help="Interface to bind.")] = DEFAULT_HOST,
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = DEFAULT_PORT,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="JPAGED_API_KEY",
        help="Require 'Authorization: Bearer KEY' on /v1/* routes.")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="Model name clients use (default: --model as given).")
    ] = None,
    disable_log_stats: Annotated[bool, typer.Option(
        "--disable-log-stats", help="No periodic stats line in the log.")] = False,
    data_parallel_size: Annotated[int, typer.Option(
        "--data-parallel-size", "-dp",
        help="Engine replicas behind one router (each its own process, devices and cache).")
    ] = 1,
    data_parallel_backend: Annotated[str, typer.Option(
        "--data-parallel-backend", help="How replicas run: ray (the only backend).")] = "ray",
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", help="Join this Ray cluster (default: start a local one).")] = None,
    routing_policy: Annotated[str, typer.Option(
        "--routing-policy", help="Data parallel, one of: kv_aware, round_robin, least_load.")
    ] = "kv_aware",
    prefill_replicas: Annotated[int, typer.Option(
        "--prefill-replicas",
        help="Disaggregated serving on Ray: replicas that only prefill (with "
        "--decode-replicas; the KV moves to a decode replica).")] = 0,
    decode_replicas: Annotated[int, typer.Option(
        "--decode-replicas",
        help="Disaggregated serving on Ray: replicas that pull a prompt's KV and decode.")] = 0,
    replica_dead_timeout_s: Annotated[float, typer.Option(
        "--replica-dead-timeout-s",
        help="Data parallel: exit non-zero once no replica has been healthy this long (Ray "
        "lost their node), so a supervisor restarts the server.")] = 60.0,
    engine_flags: dict[str, Any] | None = None,
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /metrics)."""
    flags = {**locals(), **(engine_flags or {})}  # own options + the engine flags
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if _run_worker_if_not_rank0(model, engine_flags or {}):
        return
    from jpaged.core_client import create_engine
    from jpaged.runner.multiprocess import ProcessGroupError, exit_now
    from jpaged.server import run_server

    try:
        if data_parallel_backend != "ray":
            raise ValueError(f"--data-parallel-backend must be ray, got {data_parallel_backend!r}")
        if data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {data_parallel_size}")
        if (data_parallel_size > 1 or ray_address is not None or prefill_replicas
                or decode_replicas):
            from jpaged.dp.client import DPEngineClient
            from jpaged.dp.router import ROUTING_POLICIES

            if routing_policy not in ROUTING_POLICIES:
                raise ValueError(f"--routing-policy must be one of {ROUTING_POLICIES}, "
                                 f"got {routing_policy!r}")
            engine = DPEngineClient(_engine_args(flags), data_parallel_size, routing_policy,
                                    ray_address=ray_address, prefill_replicas=prefill_replicas,
                                    decode_replicas=decode_replicas,
                                    dead_timeout_s=replica_dead_timeout_s)
            engine.on_dead = _exit_cluster_lost
        else:
            engine = create_engine(_engine_args(flags))
    except ProcessGroupError as e:
        exit_now(e)
        return
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
        return
    try:
        run_server(engine, host=host, port=port, api_key=api_key,
                   served_model_name=served_model_name or model)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        pass


def _exit_cluster_lost(cause: BaseException) -> None:
    """No replica can come back: stop Ray if this server started it (bounded), then exit 1."""
    import threading

    from jpaged.runner.multiprocess import exit_now

    threading.Timer(15.0, exit_now, (cause,)).start()  # a stuck Ray cannot keep us up
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    finally:
        exit_now(cause)


@engine_command()
def chat(
    model: Model = None,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", help="Longest reply in tokens (default: up to --max-model-len).")
    ] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    system: Annotated[str | None, typer.Option("--system", help="System message.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log to stderr.")] = False,
    engine_flags: dict[str, Any] | None = None,
) -> None:
    """Chat interactively: replies stream as they are made; /reset, /exit."""
    flags = {**locals(), **(engine_flags or {})}  # own options + the engine flags
    _setup_logging(verbose)
    if _run_worker_if_not_rank0(model, engine_flags or {}):
        return
    from jpaged.chat_cli import ChatSession, run_chat
    from jpaged.core_client import create_engine
    from jpaged.sampling_params import SamplingParams

    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                seed=flags["seed"])
        engine = create_engine(_engine_args({**flags, "disable_log_stats": True}))
        session = ChatSession(engine, params, system=system)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
        return
    run_chat(session)
    engine.shutdown()  # a multi-process run: the other processes stop too


@engine_command()
def bench(
    model: Model = None,
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
    flags = {**locals(), **(engine_flags or {})}  # own options + the engine flags
    _setup_logging(verbose)
    for flag, value in (("--num-prompts", num_prompts), ("--input-len", input_len),
                        ("--output-len", output_len)):
        if value < 1:  # before the model loads
            _fail(f"{flag} must be >= 1, got {value}")
    if _run_worker_if_not_rank0(model, engine_flags or {}):
        return
    from jpaged.bench import report
    from jpaged.bench.throughput import run_throughput, summary_line
    from jpaged.core_client import create_engine

    try:
        engine = create_engine(_engine_args({**flags, "disable_log_stats": True}))
        result = run_throughput(engine, num_prompts, input_len, output_len, flags["seed"],
                                warmup)
        engine.shutdown()  # a multi-process run: the other processes stop too
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
        return
    if out is not None:
        report.write(out, result)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    typer.echo(summary_line(result))
    report.print_table(f"jpaged bench: {num_prompts} x ({input_len} in, {output_len} out)",
                       [(k, v) for k, v in result.items()])


# tune builds engine after engine in one process: never over several processes.
@engine_command(exclude=("swap_space", "nnodes", "node_rank", "master_addr", "master_port",
                         "distributed_timeout_s", "engine_core_process"))
def tune(
    model: Model = None,
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
    """Find engine flags for a workload (seed 4.3): memory, then max_num_seqs, then features."""
    flags = {**locals(), **(engine_flags or {})}  # own options + the engine flags
    _setup_logging(verbose)
    from jpaged.tune.command import print_report
    from jpaged.tune.command import tune as run_tune

    try:
        report, rows, command = run_tune(
            _engine_args(flags), workload=workload, synthetic_spec=synthetic,
            num_requests=num_requests, max_minutes=max_minutes, quick=quick,
            progress=sys.stderr.isatty() or not as_json)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
        return
    if as_json:
        typer.echo(json.dumps({**report.to_json(), "command": command}, indent=2))
        return
    print_report(report, rows, command)


def main() -> None:
    """Entry point for `python -m jpaged.cli`."""
    app()


if __name__ == "__main__":
    main()
