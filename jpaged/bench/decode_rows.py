"""Decode step time at a set context length: the rows `make gpu-aot` predicts, measured.

A synthetic pure-decode step (every sequence at `context_len` tokens, its block table naming
distinct pool blocks in a random order) runs through the engine's own jitted step
(`ModelRunner.launch`), so the attention kernels read exactly the pages a real decode at that
context reads. The KV content is whatever the pool holds: the time does not depend on it.
No prefill is run, so a 256 x 4096-token row costs a few steps, not a million-token prefill.
Rows may also be profiled (jpaged/bench/step_profile.py): the same step traced, its kernels'
time summed by kind of op. A row is greedy (what `hbm_bytes` predicts) unless it says
`"sampling": "random"`: every sequence then draws with every filter (RANDOM_SAMPLING), which
`hbm_bytes_sampling_candidates` predicts where the draw's candidates settle its rows (its
top-k of 64 does, unless the logits are flat) and `hbm_bytes_sampling` where the whole row
must.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from jpaged.bench.step_profile import summarize, trace_calls
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.intmath import cdiv
from jpaged.runner.batch import PackedStep, empty_step, flatten_step
from jpaged.runner.model_runner import ModelRunner
from models.loader import LoadedModel

# A random draw through every filter (Gemma 3's generation defaults, and a min-p): every
# conditional of the sampler takes its largest branch.
RANDOM_SAMPLING = {"temperature": 1.0, "top_k": 64, "top_p": 0.95, "min_p": 0.05}


def decode_step(runner: ModelRunner, batch: int, context_len: int, seed: int = 0,
                sampled: bool = False) -> PackedStep:
    """A decode step of `batch` sequences, each at `context_len` tokens after it: greedy, or
    with `sampled` every row drawn at random through RANDOM_SAMPLING's filters.

    Raises ValueError when the pool or the block tables cannot hold them.
    """
    if batch not in runner.plan.seq_buckets:
        raise ValueError(f"batch={batch} is not a decode bucket {runner.plan.seq_buckets}")
    bs, num_blocks = runner.block_size, runner.kv.num_blocks
    per_seq = cdiv(context_len, bs)
    if per_seq > runner.plan.max_blocks:
        raise ValueError(f"context_len={context_len} needs {per_seq} blocks per sequence; the "
                         f"block tables hold {runner.plan.max_blocks} (raise max_model_len)")
    if batch * per_seq > num_blocks - 1:  # block 0 is the null block
        raise ValueError(f"{batch} x {context_len} tokens need {batch * per_seq} blocks; the "
                         f"pool has {num_blocks - 1}")
    rng = np.random.default_rng(seed)
    ids = rng.permutation(np.arange(1, num_blocks, dtype=np.int32))[:batch * per_seq]
    tables = np.zeros((batch, runner.plan.max_blocks), np.int32)
    tables[:, :per_seq] = ids.reshape(batch, per_seq)
    packed = empty_step(runner.plan, batch, batch, runner.vocab_size, decode_only=True)
    b, last = packed.batch, context_len - 1
    b.input_ids[:] = rng.integers(0, runner.vocab_size, batch)
    b.positions[:] = last
    b.slot_mapping[:] = tables[:, last // bs] * bs + last % bs
    b.query_start_loc[:] = np.arange(batch + 1)
    b.seq_lens[:] = context_len
    b.block_tables[:] = tables
    b.logits_indices[:] = np.arange(batch)
    if not sampled:
        return packed
    # New arrays, not writes into the greedy ones: the empty step shares one zeros array
    # between several fields.
    def full(name: str) -> np.ndarray:
        return np.full(batch, RANDOM_SAMPLING[name], np.float32)

    sampling = replace(b.sampling, temperature=full("temperature"), top_p=full("top_p"),
                       min_p=full("min_p"), top_k=np.full(
                           batch, min(RANDOM_SAMPLING["top_k"], runner.vocab_size - 1),
                           np.int32))
    return replace(packed, batch=replace(b, sampling=sampling))


def _warm_step(runner: ModelRunner, batch: int, context_len: int, sampled: bool = False
               ) -> Callable[[], None]:
    """One call of the compiled decode step at (batch, context_len), waiting for its result;
    called once here, so the step is compiled (or loaded) and warm."""
    packed = decode_step(runner, batch, context_len, sampled=sampled)
    flat = flatten_step(packed.batch)

    def call() -> None:
        runner.launch(flat, packed.flags, False)[0].block_until_ready()

    call()
    return call


def time_decode(runner: ModelRunner, batch: int, context_len: int, iters: int = 10,
                sampled: bool = False) -> dict[str, Any]:
    """Median ms of the compiled decode step at (batch, context_len), greedy or (`sampled`)
    random; the first call compiles (or loads) it and is not timed."""
    call = _warm_step(runner, batch, context_len, sampled)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    row = {"batch": batch, "context_len": context_len, "step_ms": round(ms, 3),
           "output_tokens_per_s": round(batch / ms * 1e3, 1), "iters": iters}
    return {**row, "sampling": "random"} if sampled else row


def profile_decode(runner: ModelRunner, batch: int, context_len: int, trace: Path,
                   step_ms: float | None = None, calls: int = 3) -> dict[str, Any]:
    """`calls` runs of the decode step at (batch, context_len) under the profiler: the trace
    kept at `trace`, its kernels summed by kind (`step_profile.summarize`)."""
    trace_calls(_warm_step(runner, batch, context_len), calls, trace)
    return {"trace": trace.name, **summarize(trace, calls, step_ms, module="_step")}


def _print_profile(row: dict[str, Any]) -> None:
    prof = row["profile"]
    top = ", ".join(f"{k['kind']} {k['ms_per_step']} ms x{k['launches_per_step']}"
                    for k in prof["kinds"][:8])
    print(f"  decode profile B={row['batch']} ctx={row['context_len']}: "
          f"{prof['launches_per_step']} kernels, {prof['kernel_ms_per_step']} ms of a "
          f"{prof['step_ms']} ms step ({prof['events_from']}); {top}", flush=True)


def _profile_row(runner: ModelRunner, row: dict[str, Any], profile_dir: Path) -> None:
    """Profile a timed row's step into `row["profile"]` (or name the failure in
    `row["profile_error"]`: the row's time stands without it)."""
    b, ctx = row["batch"], row["context_len"]
    trace = profile_dir / f"decode_{row['kv_cache_dtype']}_b{b}_c{ctx}.trace.json.gz"
    try:
        row["profile"] = profile_decode(runner, b, ctx, trace, row["step_ms"])
        _print_profile(row)
    except Exception as e:  # noqa: BLE001 - the row's time stands without it
        row["profile_error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"  decode profile B={b}: {row['profile_error']}", flush=True)


def decode_rows(loaded: LoadedModel, kv_dtypes: tuple[str, ...], batches: tuple[int, ...],
                contexts: tuple[int, ...], engine_args: dict[str, Any],
                budget_s: float = 1e9, profile_batches: tuple[int, ...] = (),
                profile_dir: Path | None = None,
                sampled_batches: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """Per KV dtype, an engine at the default pool and one row per (batch, context); a row
    that does not fit the pool, or comes after the budget, says so instead of a time.

    The rows of the first KV dtype and first context whose batch is in `profile_batches` are
    also profiled, each trace written under `profile_dir` (a failed profile is named in
    the row's `profile_error`; its time stays); those whose batch is in `sampled_batches` are
    timed again drawing at random (the same compiled step)."""
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for kvd in kv_dtypes:
        engine = LLMEngine(EngineArgs(kv_cache_dtype=kvd, disable_log_stats=True,
                                      max_model_len=max(contexts) + 16,
                                      max_num_seqs=max(batches), **engine_args), loaded=loaded)
        for b in batches:
            for ctx in contexts:
                first = kvd == kv_dtypes[0] and ctx == contexts[0]
                for sampled in (False, True) if first and b in sampled_batches else (False,):
                    row: dict[str, Any] = {"kv_cache_dtype": kvd, "batch": b,
                                           "context_len": ctx,
                                           **({"sampling": "random"} if sampled else {})}
                    if time.perf_counter() - t_start > budget_s:
                        rows.append({**row, "skipped": "time budget"})
                        continue
                    try:
                        rows.append({**row, **time_decode(engine.runner, b, ctx,
                                                          sampled=sampled)})
                    except ValueError as e:  # does not fit this pool: named, not timed
                        rows.append({**row, "skipped": str(e)})
                    print(f"  decode row {rows[-1]}", flush=True)  # a cut-short run keeps them
                    if ("step_ms" in rows[-1] and profile_dir is not None and not sampled
                            and b in profile_batches and first):
                        _profile_row(engine.runner, rows[-1], profile_dir)
        engine.runner.kv = None  # free this pool before the next engine allocates its own
        del engine
        gc.collect()
    return rows
