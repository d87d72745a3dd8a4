"""`jpaged tune`: load the model and workload, run the flow with a progress bar, print the table
and the recommended `jpaged serve` command line."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jpaged.config import DEFAULT_BLOCK_SIZE, EngineArgs
from jpaged.tune.driver import TuneReport, run_tune, serve_command
from jpaged.tune.policy import (
    GPU_START_UTILIZATION,
    SEQS_START,
    TrialConfig,
    TunePolicy,
    memory_ladder,
)
from jpaged.tune.workload import (
    SYNTHETIC_DEFAULT,
    SYNTHETIC_QUICK,
    WorkloadRequest,
    blocks_needed,
    fit,
    load_jsonl,
    parse_synthetic,
    sample,
    synthetic,
)

DEFAULT_NUM_REQUESTS = 64
QUICK_NUM_REQUESTS = 16


logger = logging.getLogger("jpaged.tune")


def _gib(x: float) -> str:
    return f"{x / 2**30:.3g} GiB" if x >= 2**30 else f"{x / 2**20:.3g} MiB"


def memory_label(flag: str, value: float) -> str:
    """A memory setting as the table shows it."""
    if flag == "gpu_memory_utilization":
        return f"util {value:.2f}"
    if flag == "kv_cache_memory_bytes":
        return _gib(value)
    return f"{int(value)} blocks"


def load_workload(tokenizer: Any, vocab_size: int, workload: Path | None, spec: str | None,
                  num_requests: int | None, quick: bool, max_model_len: int
                  ) -> list[WorkloadRequest]:
    """The requests to replay: a sample of the file, or the synthetic spec."""
    if workload is not None and spec is not None:
        raise ValueError("give --workload or --synthetic, not both")
    if workload is not None:
        n = num_requests or (QUICK_NUM_REQUESTS if quick else DEFAULT_NUM_REQUESTS)
        reqs = sample(load_jsonl(workload, tokenizer), n)
    else:
        syn = parse_synthetic(spec or (SYNTHETIC_QUICK if quick else SYNTHETIC_DEFAULT))
        if num_requests is not None:
            syn = dataclasses.replace(syn, n=num_requests)
        reqs = synthetic(syn, vocab_size)
    return fit(reqs, max_model_len)


def start_memory(base: EngineArgs, backend: str, per_block: int, need_blocks: int
                 ) -> tuple[str, float, float | None]:
    """(flag, starting value, top) of the memory ladder for these starting flags.

    The knob the user set is the one tuned; with none, GPU starts at utilization 0.70 (the
    ladder's start) and CPU at 0.70 of its default KV space. Byte and block ladders end at the first
    setting that holds the whole sample at once (no preemption is possible beyond it).
    """
    from jpaged.runner.kv_cache import CPU_DEFAULT_KV_BYTES

    if base.num_gpu_blocks_override is not None:
        return "num_gpu_blocks_override", base.num_gpu_blocks_override, need_blocks
    if base.kv_cache_memory_bytes is not None:
        return "kv_cache_memory_bytes", base.kv_cache_memory_bytes, need_blocks * per_block
    if base.gpu_memory_utilization is not None:
        return "gpu_memory_utilization", base.gpu_memory_utilization, None
    if backend == "cpu":
        return ("kv_cache_memory_bytes", int(GPU_START_UTILIZATION * CPU_DEFAULT_KV_BYTES),
                need_blocks * per_block)
    return "gpu_memory_utilization", GPU_START_UTILIZATION, None


@contextlib.contextmanager
def _quiet_engine_logs() -> Iterator[None]:
    """Trials preempt on purpose: keep their warnings and start-up lines out of the output."""
    names = ("jpaged", "jpaged.pressure")
    old = [logging.getLogger(n).level for n in names]
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, lvl in zip(names, old, strict=True):
            logging.getLogger(n).setLevel(lvl)


def _row(i: int, phase: str, r: Any, note: str) -> list[str]:
    c = r.config
    if not r.ok:
        metrics = ["-"] * 7
    else:
        metrics = [f"{r.preemption_rate:.2f}", f"{r.prefix_cache_hit_rate:.2f}",
                   f"{r.tokens_per_second:.0f}", f"{r.ttft_p50_ms:.0f}/{r.ttft_p99_ms:.0f}",
                   f"{r.tpot_p50_ms:.0f}/{r.tpot_p99_ms:.0f}", str(r.num_gpu_blocks),
                   f"{r.kv_cache_usage_peak:.2f}"]
    extras = [x for x in (c.kv_cache_dtype if c.kv_cache_dtype != "auto" else "",
                          f"offload {c.kv_offloading_size:g}G/{c.preemption_mode}"
                          if c.kv_offloading_size else "") if x]
    return [str(i), phase, memory_label(c.memory_flag, c.memory), str(c.max_num_seqs),
            "on" if c.enable_prefix_caching else "off", " ".join(extras) or "-", *metrics, note]


COLUMNS = ("#", "phase", "memory", "max seqs", "prefix", "dtype/offload", "preempt/req",
           "hit rate", "tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "blocks", "peak KV",
           "verdict")


def print_report(report: TuneReport, rows: list[list[str]], command: str) -> None:
    """The per-step table and the recommended command line, on stdout."""
    import sys

    from rich.console import Console
    from rich.table import Table

    # Not a terminal (a pipe, a log file): do not squeeze the table into 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    table = Table(title="jpaged tune: one row per trial")
    for name in COLUMNS:
        table.add_column(name, justify="right" if name not in ("phase", "verdict") else "left")
    for i, row in enumerate(rows):
        style = "bold green" if i == report.recommended_step else None
        table.add_row(*row, style=style)
    console.print(table)
    if report.stopped_early:
        console.print("[yellow]time limit reached: the recommendation is the best so far[/]")
    console.print("Recommended flags: " + json.dumps(report.recommended))
    console.print(command, soft_wrap=True, highlight=False)


def tune(base: EngineArgs, *, workload: Path | None = None, synthetic_spec: str | None = None,
         num_requests: int | None = None, max_minutes: float = 10.0, quick: bool = False,
         progress: bool = True, loaded: Any = None) -> tuple[TuneReport, list[list[str]], str]:
    """Run the flow; returns the report, the table rows and the `jpaged serve` line."""
    import jax

    from jpaged.core.kv_cache_groups import blocks_needed as seq_blocks
    from jpaged.core.kv_cache_groups import kv_cache_layout
    from jpaged.runner.kv_cache import bytes_per_block, kv_dtype
    from jpaged.tune.replay import EngineReplayer
    from models.loader import load_model

    if not max_minutes > 0:
        raise ValueError(f"--max-minutes must be > 0, got {max_minutes}")
    loaded = loaded or load_model(base.model, base.dtype, quantization=base.quantization)
    spec = loaded.spec
    sched = base.create_engine_config(spec.max_position_embeddings).scheduler
    max_len = sched.max_model_len
    requests = load_workload(loaded.tokenizer, spec.vocab_size, workload, synthetic_spec,
                             num_requests, quick, max_len)
    layout = kv_cache_layout(spec.layer_windows,
                             hybrid=not base.disable_hybrid_kv_cache_manager)
    per_block = bytes_per_block(spec, base.block_size, kv_dtype(base.kv_cache_dtype,
                                                                loaded.model.dtype),
                                base.tensor_parallel_size, layout.num_slots)
    # The engine refuses a pool that cannot hold one max_model_len request (null block
    # included; the engine's own count, sliding-window groups too): no rung of the ladder may
    # be below it, however small the sample.
    floor_blocks = 1 + seq_blocks(max_len, layout, base.block_size, sched.max_chunk_tokens)
    need = max(blocks_needed(requests, base.block_size), floor_blocks)
    flag, start, top = start_memory(base, jax.default_backend(), per_block, need)
    floor = {"num_gpu_blocks_override": floor_blocks,
             "kv_cache_memory_bytes": floor_blocks * per_block}.get(flag)
    if floor is not None and start < floor:
        logger.warning("%s=%s cannot hold one request of max_model_len=%d: the tuner starts at "
                       "%s", flag, start, max_len, floor)
        start = floor
    ladder = memory_ladder(flag, start, quick=quick, top=top)
    if len(requests) < SEQS_START:
        logger.warning("the workload has %d requests: max_num_seqs is tried only up to that; "
                       "give a sample as large as the concurrency you expect to size it",
                       len(requests))
    start_cfg = TrialConfig(flag, ladder[0], base.max_num_seqs, base.enable_prefix_caching,
                            base.kv_cache_dtype, base.kv_offloading_size, base.preemption_mode)
    policy = TunePolicy(start_cfg, ladder, seqs_cap=len(requests), quick=quick)
    replayer = EngineReplayer(loaded, base, requests, memory_top=max(ladder),
                              max_num_seqs_top=max(base.max_num_seqs, len(requests)))
    rows: list[list[str]] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_quiet_engine_logs())
        bar = task = None
        if progress:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            bar = stack.enter_context(Progress(
                TextColumn("[progress.description]{task.description}"), BarColumn(),
                TextColumn("trial {task.completed:.0f}"), TimeElapsedColumn(),
                console=Console(stderr=True), transient=True))
            task = bar.add_task("jpaged tune: memory", total=policy.max_trials())

        def on_trial(i: int, phase: str, r: Any, note: str) -> None:
            rows.append(_row(i, phase, r, note))
            if bar is not None:
                bar.update(task, advance=1, description=f"jpaged tune: {policy.phase}")
                bar.console.print(f"trial {i} [{phase}] {rows[-1][2]}, max_num_seqs "
                                  f"{rows[-1][3]}: {note}", highlight=False)

        report = run_tune(policy, replayer, max_seconds=max_minutes * 60, on_trial=on_trial)
        replayer.close()
    base_flags = {"model": base.model,
                  "block_size": base.block_size if base.block_size != DEFAULT_BLOCK_SIZE else None,
                  "max_model_len": base.max_model_len,
                  "max_num_batched_tokens": base.max_num_batched_tokens,
                  "tensor_parallel_size": base.tensor_parallel_size
                  if base.tensor_parallel_size != 1 else None,
                  "attention_backend": base.attention_backend
                  if base.attention_backend != "auto" else None}
    return report, rows, serve_command(report.recommended, base_flags)
