"""Engine-internal benchmarks: XLA compilations over a random workload, host overhead per step.

Compilations: a cold engine runs a seeded 200-request workload whose requests arrive in random
bursts (so decode-only, mixed and prefill-only steps of many sizes occur); `compiles_lazy` is
the number of step executables it compiled on the way. Then `ModelRunner.warmup()` compiles
every bucket shape (`compiles_total`, the whole set a server ever needs) and the same workload
with new prompts runs again: `compiles_after_warmup` must be 0.

Host overhead: `batch` requests decode together; each `LLMEngine.step()` is timed whole and
split into the seconds it waited for the device (`ModelRunner.last_wait_s`: reading a step's
sampled tokens) and host time (the rest: scheduling, batch packing, dispatch, updating requests
and building outputs). `host_share` is the median over steps of host / step wall time;
`device_ms` is the median of `ModelRunner.last_device_s` (a step's dispatch until its results
are on the host; with async scheduling that spans the next step's host work).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jpaged.bench.report import median
from jpaged.bench.workloads import mixed_length_requests
from jpaged.engine import LLMEngine
from jpaged.sampling_params import RequestOutputKind, SamplingParams


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def run_bursty(engine: LLMEngine, requests: list[tuple[list[int], int]], seed: int,
               mean_burst: float = 4.0, tag: str = "burst") -> int:
    """Add requests in Poisson bursts (one burst before each step) and run them to completion.

    Returns the number of engine steps taken.
    """
    if engine.has_unfinished_requests():
        raise ValueError("the engine has unfinished requests; benchmark an idle engine")
    rng = np.random.default_rng(seed)
    pending = list(enumerate(requests))
    steps = 0
    while pending or engine.has_unfinished_requests():
        k = min(len(pending), int(rng.poisson(mean_burst)))
        if not engine.has_unfinished_requests():
            k = max(k, 1)  # never step an idle engine
        for i, (prompt, out_len) in pending[:k]:
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, _params(out_len))
        pending = pending[k:]
        engine.step()
        steps += 1
    return steps


def count_compiles(engine: LLMEngine, num_requests: int = 200, seed: int = 0,
                   prompt_range: tuple[int, int] = (16, 512),
                   output_range: tuple[int, int] = (1, 64)) -> dict[str, Any]:
    """Compilations of a cold engine over the workload, after warm-up, and the bucket count."""
    runner = engine.runner
    if runner.num_compiled != 0:
        raise ValueError("count_compiles needs a cold engine (nothing compiled yet)")
    vocab = engine.spec.vocab_size
    work = mixed_length_requests(vocab, num_requests, seed, prompt_range, output_range)
    t0 = time.perf_counter()
    steps = run_bursty(engine, work, seed, tag="cold")
    cold_s = time.perf_counter() - t0
    lazy = runner.num_compiled
    t0 = time.perf_counter()
    total = runner.warmup()
    warmup_s = time.perf_counter() - t0
    engine.reset_prefix_cache()
    work2 = mixed_length_requests(vocab, num_requests, seed + 1, prompt_range, output_range)
    steps2 = run_bursty(engine, work2, seed + 1, tag="warm")
    return {"compiles_lazy": lazy, "compiles_total": total,
            "compiles_after_warmup": runner.num_compiled - total,
            "bucket_shapes": len(runner.plan.all_shapes()), "num_requests": num_requests,
            "steps_cold": steps, "steps_warm": steps2, "cold_run_s": cold_s,
            "warmup_s": warmup_s}


def host_overhead(engine: LLMEngine, batch: int, steps: int = 8, prompt_len: int = 32,
                  seed: int = 0) -> dict[str, Any]:
    """Median host share of decode-step wall time with `batch` requests decoding together."""
    if batch > engine.config.scheduler.max_num_seqs:
        raise ValueError(f"batch={batch} exceeds max_num_seqs "
                         f"({engine.config.scheduler.max_num_seqs})")
    if engine.has_unfinished_requests():
        raise ValueError("the engine has unfinished requests; benchmark an idle engine")
    vocab = engine.spec.vocab_size
    rng = np.random.default_rng(seed)
    for i in range(batch):
        prompt = rng.integers(vocab // 2, vocab, prompt_len).tolist()
        engine.add_request(f"host-{batch}-{seed}-{i}", {"prompt_token_ids": prompt},
                           _params(steps + 4))
    # Prefill (and the first decode) untimed: every timed step is a pure decode of `batch` rows.
    sched = engine.scheduler
    while sched.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                   for r in sched.running):
        engine.step()
    shares, host, device = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        own = wall - engine.runner.last_wait_s
        host.append(own)
        device.append(engine.runner.last_device_s)
        shares.append(own / wall)
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": batch, "host_share": median(shares), "host_ms": median(host) * 1e3,
            "device_ms": median(device) * 1e3, "steps": steps}
