"""The verifying step of speculative decoding beside plain decode, timed on the device.

A step verifying B sequences' k proposals each is a ragged step of B sequences of k + 1 new
tokens (`runner/batch.py`, `step_rows`): sequence i's tokens at positions context_len - 1 ..
context_len - 1 + k (its input token, then its proposals), all on its block table, a KV slot
for every token, and a sampled row at each token (B * (k + 1) rows). Its shape is the plan's
verifying bucket (T = R = the decode bucket of its rows, B sequences in powers of 4): the
attention reads each context once per query tile, where B * (k + 1) decode rows would read it
k + 1 times. It is a program of its own (`new_programs` in the row says whether one was
compiled for it).

The step is built as the engine builds it: requests as they stand after their prefill and first
token, scheduled as `Scheduler._add_scheduled` schedules a decode with proposals, packed by
`pack_step` (the runner's persistent `InputBatch` packs the same arrays,
tests/jpaged/runner/test_input_batch.py; it is not used here because it holds the rows of the
engine's live requests). The plain decode step it is set beside is the same requests without
proposals, through the same code: the same blocks, contexts and sampling (greedy).

`break_even_accepted` = verify_ms / decode_ms: a verifying step that yields L tokens a sequence
on average (the accepted proposals plus the bonus token, i.e. the bench's mean acceptance
length) replaces L plain decode steps, so it pays for itself when L > break_even_accepted (the
proposer's own time and the overlapped loop a proposing step gives up not counted).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jpaged.core.sched_output import ScheduledRequest
from jpaged.intmath import cdiv
from jpaged.request import Request
from jpaged.runner.batch import (
    BucketPlan,
    PackedStep,
    flatten_step,
    pack_step,
)
from jpaged.runner.model_runner import ModelRunner
from jpaged.sampling_params import SamplingParams


def parse_cases(text: str) -> tuple[tuple[int, int], ...]:
    """"1x3,16x3" -> ((1, 3), (16, 3)): (sequences, proposals each) of each verifying row."""
    cases = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        b, sep, k = part.partition("x")
        if not sep or not b.isdigit() or not k.isdigit() or int(b) < 1 or int(k) < 1:
            raise ValueError(f"verify case {part!r}: want BxK with B, K >= 1 (e.g. 1x3)")
        cases.append((int(b), int(k)))
    return tuple(cases)


def verify_requests(batch: int, k: int, context_len: int, vocab_size: int, seed: int = 0
                    ) -> list[Request]:
    """`batch` greedy requests as the engine holds them when they verify: context_len - 1
    prompt tokens computed, one output token (the step's input), k proposals."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(batch):
        req = Request(f"verify-{i}", rng.integers(0, vocab_size, context_len - 1).tolist(),
                      SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
        req.append_output_token(int(rng.integers(0, vocab_size)))
        req.num_computed_tokens = context_len - 1
        req.spec_token_ids = rng.integers(0, vocab_size, k).tolist()
        reqs.append(req)
    return reqs


def verify_scheduled(requests: list[Request], block_ids: np.ndarray) -> list[ScheduledRequest]:
    """Each request's share of the step as the scheduler gives a decode with proposals: its
    input token and proposals from its computed length on, sequence i on the blocks of row i
    of `block_ids` (one KV cache group)."""
    out = []
    for req, ids in zip(requests, block_ids, strict=True):
        start, spec = req.num_computed_tokens, list(req.spec_token_ids)
        out.append(ScheduledRequest(req, start, len(req.all_token_ids) - start + len(spec),
                                    [*req.all_token_ids[start:], *spec],
                                    [[int(x) for x in ids]], True, spec))
    return out


def pack_verify(scheduled: list[ScheduledRequest], plan: BucketPlan, block_size: int,
                vocab_size: int, default_seed: int) -> PackedStep:
    """The step batch of scheduled requests as the runner's dispatch packs them (a request
    with proposals: one sequence sampled at each of its new tokens)."""
    return pack_step(scheduled, plan, block_size, vocab_size, default_seed)


def verify_pair(runner: ModelRunner, batch: int, k: int, context_len: int, seed: int = 0
                ) -> tuple[PackedStep, PackedStep]:
    """(the step verifying `batch` sequences at `context_len` tokens with k proposals each,
    the plain decode step of the same sequences): the same requests on the same distinct pool
    blocks (the decode step's tables without the blocks only the proposals' slots need).

    Raises ValueError when the rows, the pool or the block tables cannot hold it.
    """
    plan, bs = runner.plan, runner.block_size
    rows = batch * (k + 1)
    if rows > plan.seq_buckets[-1]:
        raise ValueError(f"{batch} x (k + 1 = {k + 1}) = {rows} rows; the largest decode "
                         f"bucket is {plan.seq_buckets[-1]} (raise max_num_seqs)")
    if batch > plan.verify_seq_buckets[-1]:
        raise ValueError(f"{batch} sequences; the runner's steps hold "
                         f"{plan.verify_seq_buckets[-1]} (raise max_num_seqs)")
    if plan.num_groups != 1:
        raise ValueError(f"{plan.num_groups} KV cache groups: the verify rows use one")
    per_seq = cdiv(context_len + k, bs)  # the proposals' slots too
    if per_seq > plan.max_blocks:
        raise ValueError(f"context_len={context_len} + k={k} needs {per_seq} blocks per "
                         f"sequence; the block tables hold {plan.max_blocks}")
    num_blocks = runner.kv.num_blocks
    if batch * per_seq > num_blocks - 1:  # block 0 is the null block
        raise ValueError(f"{batch} x {context_len + k} tokens need {batch * per_seq} blocks; "
                         f"the pool has {num_blocks - 1}")
    rng = np.random.default_rng(seed)
    ids = rng.permutation(np.arange(1, num_blocks, dtype=np.int32))[:batch * per_seq]
    ids = ids.reshape(batch, per_seq)
    reqs = verify_requests(batch, k, context_len, runner.vocab_size, seed)
    verify = pack_verify(verify_scheduled(reqs, ids), plan, bs, runner.vocab_size, runner.seed)
    for r in reqs:
        r.spec_token_ids = []
    return verify, pack_verify(verify_scheduled(reqs, ids[:, :cdiv(context_len, bs)]), plan, bs,
                               runner.vocab_size, runner.seed)


def _warm(runner: ModelRunner, packed: PackedStep) -> Callable[[], None]:
    """One call of the packed step, waiting for its result; called once here (compiled or
    loaded, warm)."""
    flat = flatten_step(packed.batch)

    def call() -> None:
        runner.launch(flat, packed.flags, False)[0].block_until_ready()

    call()
    return call


def time_verify(runner: ModelRunner, batch: int, k: int, context_len: int, iters: int = 10
                ) -> dict[str, Any]:
    """Median ms of the verifying step (`verify_ms`) and of the plain decode step of the same
    sequences (`decode_ms`), called in turn on the runner's pool (both warmed first, not
    timed); `break_even_accepted` (= `ratio`) is the mean tokens a verifying step must yield
    a sequence, bonus token included, to pay for itself."""
    before = runner.num_compiled
    verify, decode = verify_pair(runner, batch, k, context_len)
    v_call, d_call = _warm(runner, verify), _warm(runner, decode)
    v_times, d_times = [], []
    for _ in range(iters):
        for call, times in ((v_call, v_times), (d_call, d_times)):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    # The ratio is of the times as reported (rounded), so the row's figures agree.
    v_ms = round(statistics.median(v_times) * 1e3, 3)
    d_ms = round(statistics.median(d_times) * 1e3, 3)
    ratio = round(v_ms / d_ms, 3)
    return {"batch": batch, "k": k, "rows": verify.num_rows,
            "bucket": int(verify.batch.input_ids.shape[0]), "context_len": context_len,
            "verify_ms": v_ms, "decode_ms": d_ms, "ratio": ratio,
            "break_even_accepted": ratio, "iters": iters,
            "new_programs": runner.num_compiled - before}


def verify_rows(runner: ModelRunner, cases: tuple[tuple[int, int], ...], context_len: int,
                kv_cache_dtype: str, deadline: float = float("inf"), iters: int = 10
                ) -> list[dict[str, Any]]:
    """One row per (batch, k) case at `context_len` (`time_verify`), each printed as it lands;
    a case that does not fit, or comes after `deadline` (time.perf_counter()), says so."""
    rows = []
    for b, k in cases:
        row: dict[str, Any] = {"kv_cache_dtype": kv_cache_dtype, "batch": b, "k": k,
                               "context_len": context_len}
        if time.perf_counter() > deadline:
            row["skipped"] = "time budget"
        else:
            try:
                row.update(time_verify(runner, b, k, context_len, iters))
            except ValueError as e:  # does not fit this runner: named, not timed
                row["skipped"] = str(e)
        rows.append(row)
        print(f"  verify row {row}", flush=True)  # a cut-short run keeps them in the log
    return rows


def verify_table(rows: list[dict[str, Any]]) -> list[str]:
    """The rows as the log's table: one line each."""
    lines = ["  verify KV        B    k   rows bucket ctx    verify ms  decode ms  "
             "verify/decode  break-even tokens/step"]
    for r in rows:
        head = (f"  verify {r['kv_cache_dtype']:9s} {r['batch']:<4} {r['k']:<3} "
                f"{r.get('rows', '-')!s:<4} {r.get('bucket', '-')!s:<6} {r['context_len']:<6}")
        if "verify_ms" not in r:
            lines.append(f"{head} skipped: {r['skipped']}")
            continue
        lines.append(f"{head} {r['verify_ms']:<10} {r['decode_ms']:<10} "
                     f"{r['ratio']:<14} {r['break_even_accepted']}")
    return lines
