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

The decode matmuls' A/B: with the Pallas backend a step of at most `linears.max_rows` (64)
tokens runs its projections on the weight-streaming kernels (pallas_kernels/decode_matmul.py).
Beside the engine's runner a twin (`xla_twin`: the same parameters, buckets and pool, built
with `decode_matmuls=False`, so XLA's GEMMs) compiles the same step, and the two are timed
call for call in turn on the one pool: `ms_kernels` (the engine's step, also `step_ms`) and
`ms_xla`. Above 64 rows both runners compile the same program, so such a row is timed once and
says so (`decode_matmuls`); its `ms_xla` is its `step_ms`. Only the un-profiled times count:
XLA turns command buffers (CUDA graphs) off while the profiler runs, so a profiled step
launches every kernel on its own and runs slower than the timed one.
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
from flax import nnx

from jpaged.bench.step_profile import summarize, trace_calls
from jpaged.bench.verify_rows import verify_rows
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


def xla_twin(runner: ModelRunner) -> ModelRunner | None:
    """The runner's step with XLA's GEMMs for every projection (`decode_matmuls=False`): the
    same parameter arrays, buckets and (lent per call, see `on_pool`) pool. None when the
    runner runs no kernels (another backend, shapes the kernels refuse) or is tensor
    parallel (the decode rows run on one device)."""
    if runner.linears is None or runner.parallel is not None:
        return None
    model = nnx.merge(runner.graphdef, runner.params)  # the same arrays, not a copy
    twin = ModelRunner(model, runner.kv, runner.plan, runner.block_size, runner.vocab_size,
                       runner.ops, runner.seed, kv_layout=runner.kv_layout,
                       num_top_logprobs=runner.num_top_logprobs, decode_matmuls=False)
    twin.kv = None  # the pool stays the engine runner's; on_pool lends it for each call
    return twin


def on_pool(owner: ModelRunner, borrower: ModelRunner, fn: Callable[[], None]) -> None:
    """Run `fn` (a call of `borrower`'s step) on `owner`'s pool, then hand the pool back: the
    step donates the pool and returns it, so exactly one runner holds it at a time."""
    borrower.kv, owner.kv = owner.kv, None
    try:
        fn()
    finally:
        owner.kv, borrower.kv = borrower.kv, None


def time_decode_ab(runner: ModelRunner, twin: ModelRunner, batch: int, context_len: int,
                   iters: int = 10) -> dict[str, Any]:
    """Median ms of the engine's decode step (`ms_kernels`, also `step_ms`) and of its twin's
    with XLA's GEMMs (`ms_xla`) at (batch, context_len), the two called in turn on the same
    pool and step, so drift of the clocks falls on both alike; both compiled and warmed
    first (not timed)."""
    k_call = _warm_step(runner, batch, context_len)
    x_step = _warm_step_on(runner, twin, batch, context_len)
    k_times, x_times = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        k_call()
        k_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        on_pool(runner, twin, x_step)
        x_times.append(time.perf_counter() - t0)
    # The row's figures agree with each other: the ratio is of the times as reported.
    ms_k = round(statistics.median(k_times) * 1e3, 3)
    ms_x = round(statistics.median(x_times) * 1e3, 3)
    return {"batch": batch, "context_len": context_len, "step_ms": ms_k,
            "output_tokens_per_s": round(batch / ms_k * 1e3, 1), "iters": iters,
            "ms_kernels": ms_k, "ms_xla": ms_x,
            "xla_over_kernels": round(ms_x / ms_k, 3), "decode_matmuls": "kernels"}


def _warm_step_on(runner: ModelRunner, twin: ModelRunner, batch: int, context_len: int
                  ) -> Callable[[], None]:
    """`_warm_step` of the twin, on the runner's pool (compiled and warm on return)."""
    packed = decode_step(runner, batch, context_len)
    flat = flatten_step(packed.batch)

    def call() -> None:
        twin.launch(flat, packed.flags, False)[0].block_until_ready()

    on_pool(runner, twin, call)
    return call


def profile_decode(runner: ModelRunner, batch: int, context_len: int, trace: Path,
                   step_ms: float | None = None, calls: int = 3,
                   twin: ModelRunner | None = None) -> dict[str, Any]:
    """`calls` runs of the decode step at (batch, context_len) under the profiler (the twin's
    on the runner's pool, with `twin`): the trace kept at `trace`, its kernels summed by kind
    (`step_profile.summarize`). XLA runs without command buffers under the profiler, so the
    kernels' times are the step's work, not its un-profiled wall time (`step_ms` is that)."""
    if twin is None:
        fn = _warm_step(runner, batch, context_len)
    else:
        step = _warm_step_on(runner, twin, batch, context_len)

        def fn() -> None:
            on_pool(runner, twin, step)
    trace_calls(fn, calls, trace)
    return {"trace": trace.name, **summarize(trace, calls, step_ms, module="_step")}


def _print_profile(row: dict[str, Any], key: str = "profile") -> None:
    prof = row[key]
    top = ", ".join(f"{k['kind']} {k['ms_per_step']} ms x{k['launches_per_step']}"
                    for k in prof["kinds"][:8])
    which = " (XLA's GEMMs)" if key == "profile_xla" else ""
    print(f"  decode profile{which} B={row['batch']} ctx={row['context_len']}: "
          f"{prof['launches_per_step']} kernels, {prof['kernel_ms_per_step']} ms of a "
          f"{prof['step_ms']} ms step ({prof['events_from']}); {top}", flush=True)


def _profile_row(runner: ModelRunner, row: dict[str, Any], profile_dir: Path,
                 twin: ModelRunner | None = None) -> None:
    """Profile a timed row's step into `row["profile"]` (with `twin`, its step too, into
    `row["profile_xla"]`), or name the failure in `row["profile_error"]`: the row's time
    stands without it. The un-profiled time is the one that counts (command buffers are off
    under the profiler)."""
    b, ctx = row["batch"], row["context_len"]
    stem = f"decode_{row['kv_cache_dtype']}_b{b}_c{ctx}"
    jobs = [("profile", None, row["step_ms"])]
    if twin is not None and "ms_xla" in row:
        jobs.append(("profile_xla", twin, row["ms_xla"]))
    for key, tw, ms in jobs:
        trace = profile_dir / f"{stem}{'_xla' if tw is not None else ''}.trace.json.gz"
        try:
            row[key] = profile_decode(runner, b, ctx, trace, ms, twin=tw)
            _print_profile(row, key)
        except Exception as e:  # noqa: BLE001 - the row's time stands without it
            row[f"{key}_error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"  decode {key} B={b}: {row[f'{key}_error']}", flush=True)


def row_order(batches: tuple[int, ...], contexts: tuple[int, ...], ab_max: int
              ) -> list[tuple[int, int]]:
    """(batch, context) in the order the rows run: first the batches an A/B compares
    (at most `ab_max` rows), every context, context by context, then the larger batches.
    The contexts of one batch share its compiled steps, so after the first context the
    others cost only their timing."""
    small = [b for b in batches if b <= ab_max]
    large = [b for b in batches if b > ab_max]
    return ([(b, c) for c in contexts for b in small]
            + [(b, c) for c in contexts for b in large])


def decode_rows(loaded: LoadedModel, kv_dtypes: tuple[str, ...], batches: tuple[int, ...],
                contexts: tuple[int, ...], engine_args: dict[str, Any],
                budget_s: float = 1e9, profile_batches: tuple[int, ...] = (),
                profile_dir: Path | None = None,
                sampled_batches: tuple[int, ...] = (), ab: bool = True,
                verify: tuple[tuple[int, int], ...] = (),
                verify_out: list[dict[str, Any]] | None = None
                ) -> list[dict[str, Any]]:
    """Per KV dtype, an engine at the default pool and one row per (batch, context); a row
    that does not fit the pool, or comes after the budget, says so instead of a time.

    With `ab` (and an engine that runs the decode matmul kernels) a row of at most
    `linears.max_rows` sequences times the engine's step and its XLA twin's in turn
    (`time_decode_ab`: `ms_kernels`, `ms_xla`); larger rows are one program either way.
    Rows run in `row_order`. The rows of the first KV dtype and first context whose batch is
    in `profile_batches` are also profiled (an A/B row: both steps), each trace written under
    `profile_dir` (a failed profile is named in the row's `profile_error`; its time stays);
    those whose batch is in `sampled_batches` are timed again drawing at random (the engine's
    step, the same compiled program).

    `verify`: (batch, k) cases of speculative decoding's verifying step
    (jpaged/bench/verify_rows.py), timed beside the plain decode step of their batch on the
    first KV dtype's engine at the first context, right after that context's rows (whose
    buckets they reuse); their rows go to `verify_out`, under the same budget."""
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for kvd in kv_dtypes:
        engine = LLMEngine(EngineArgs(kv_cache_dtype=kvd, disable_log_stats=True,
                                      max_model_len=max(contexts) + 16,
                                      max_num_seqs=max(batches), **engine_args), loaded=loaded)
        runner = engine.runner
        twin = xla_twin(runner) if ab else None
        lin = runner.linears
        ab_max = lin.max_rows if lin is not None else 0
        if lin is None:
            why = f"off ({runner.ops.name} backend or shapes the kernels refuse): XLA's GEMMs"
        order: list[tuple[int, int] | None] = list(row_order(batches, contexts, ab_max))
        if verify and kvd == kv_dtypes[0]:  # None: the verifying steps' turn
            at = next((i for i, (_, c) in enumerate(order) if c != contexts[0]), len(order))
            order.insert(at, None)
        for job in order:
            if job is None:
                got = verify_rows(runner, verify, contexts[0], kvd, t_start + budget_s)
                if verify_out is not None:
                    verify_out.extend(got)
                continue
            b, ctx = job
            first = kvd == kv_dtypes[0] and ctx == contexts[0]
            for sampled in (False, True) if first and b in sampled_batches else (False,):
                row: dict[str, Any] = {"kv_cache_dtype": kvd, "batch": b, "context_len": ctx,
                                       **({"sampling": "random"} if sampled else {})}
                if time.perf_counter() - t_start > budget_s:
                    rows.append({**row, "skipped": "time budget"})
                    print(f"  decode row {rows[-1]}", flush=True)
                    continue
                try:
                    if twin is not None and b <= ab_max and not sampled:
                        rows.append({**row, **time_decode_ab(runner, twin, b, ctx)})
                    else:
                        timed = {**row, **time_decode(runner, b, ctx, sampled=sampled)}
                        if lin is None:
                            timed["decode_matmuls"] = why
                        elif b > ab_max:
                            timed.update(ms_xla=timed["step_ms"], decode_matmuls=(
                                f"one program: over {ab_max} rows both paths run XLA's GEMMs"))
                        else:  # a sampled row, or the A/B turned off: the engine's step
                            timed["decode_matmuls"] = "kernels"
                        rows.append(timed)
                except ValueError as e:  # does not fit this pool: named, not timed
                    rows.append({**row, "skipped": str(e)})
                print(f"  decode row {rows[-1]}", flush=True)  # a cut-short run keeps them
                if ("step_ms" in rows[-1] and profile_dir is not None and not sampled
                        and b in profile_batches and first):
                    _profile_row(runner, rows[-1], profile_dir,
                                 twin if b <= ab_max else None)
        runner.kv = None  # free this pool before the next engine allocates its own
        del engine, runner, twin
        gc.collect()
    return rows
