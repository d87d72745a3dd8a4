"""Offline throughput benchmark, as `vllm bench throughput` on its random dataset.

Every request arrives at t0 with `input_len` random prompt tokens and generates exactly
`output_len` tokens (ignore_eos). Reported: requests/s, total and output tokens/s over the
wall time of the batch, TTFT (first token − arrival) and TPOT ((finish − first token) /
(output tokens − 1)) per request, and the engine's preemptions, prefix-cache hit rate and peak
KV usage during the run. A warm-up batch of the same shape (other prompts) runs first by default,
so compilation is not timed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jpaged.engine import LLMEngine
from jpaged.sampling_params import RequestOutputKind, SamplingParams


def random_prompts(vocab_size: int, num_prompts: int, input_len: int, seed: int
                   ) -> list[list[int]]:
    """`num_prompts` prompts of `input_len` token ids drawn uniformly from the vocabulary."""
    for name, v in (("num_prompts", num_prompts), ("input_len", input_len),
                    ("vocab_size", vocab_size)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(num_prompts, input_len)).tolist()


def _check(engine: LLMEngine, input_len: int, output_len: int) -> None:
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    max_len = engine.config.scheduler.max_model_len
    if input_len + output_len > max_len:
        raise ValueError(f"input_len + output_len = {input_len + output_len} exceeds "
                         f"max_model_len ({max_len}); lower them or raise --max-model-len")


def _percentiles(xs: list[float], name: str) -> dict[str, float]:
    a = np.asarray(xs, dtype=np.float64) * 1e3 if xs else np.zeros(1)
    return {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
            f"p99_{name}_ms": float(np.percentile(a, 99))}


def run_batch(engine: LLMEngine, prompts: Sequence[Sequence[int]],
              params: SamplingParams | Sequence[SamplingParams], tag: str) -> dict[str, Any]:
    """Add every prompt at one instant (one params, or one per prompt), step to completion;
    timings from the outputs, engine counters as deltas over the batch."""
    if not isinstance(params, SamplingParams) and len(params) != len(prompts):
        raise ValueError(f"params: expected one SamplingParams or {len(prompts)}, got "
                         f"{len(params)}")
    before = engine.get_metrics()
    t0 = time.monotonic()
    for i, p in enumerate(prompts):
        sp = params if isinstance(params, SamplingParams) else params[i]
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": list(p)}, sp, arrival_time=t0)
    peak = engine.kv_cache_usage
    ttft: list[float] = []
    tpot: list[float] = []
    out_tokens = 0
    done = 0
    while done < len(prompts):
        outs = engine.step()
        now = time.monotonic()
        peak = max(peak, engine.kv_cache_usage)
        for o in outs:
            if not o.finished:
                continue
            done += 1
            n = len(o.outputs[0].token_ids)
            out_tokens += n
            first = o.metrics.get("first_token_time", now)
            ttft.append(first - o.metrics["arrival_time"])
            if n > 1:
                tpot.append((now - first) / (n - 1))
    elapsed = time.monotonic() - t0
    after = engine.get_metrics()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "elapsed_time": elapsed,
        "num_requests": len(prompts),
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": out_tokens,
        "total_num_tokens": prompt_tokens + out_tokens,
        "requests_per_second": len(prompts) / elapsed,
        "tokens_per_second": (prompt_tokens + out_tokens) / elapsed,
        "output_tokens_per_second": out_tokens / elapsed,
        **_percentiles(ttft, "ttft"),
        **_percentiles(tpot, "tpot"),
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "kv_cache_usage_peak": peak,
        "num_steps": after["num_steps"] - before["num_steps"],
    }


def run_throughput(engine: LLMEngine, num_prompts: int, input_len: int, output_len: int,
                   seed: int = 0, warmup: bool = True) -> dict[str, Any]:
    """Run the benchmark on an engine (no requests in flight); returns vLLM-named results."""
    engine = getattr(engine, "llm_engine", engine)  # an LLM works too
    if engine.has_unfinished_requests():
        raise ValueError("the engine has unfinished requests; benchmark an idle engine")
    _check(engine, input_len, output_len)
    vocab = engine.spec.vocab_size
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    if warmup:
        run_batch(engine, random_prompts(vocab, num_prompts, input_len, seed + 1), params,
                   f"bench-warmup-{seed}")
        engine.reset_prefix_cache()  # the timed batch starts from a cold prefix cache
    before = engine.get_metrics()
    result = run_batch(engine, random_prompts(vocab, num_prompts, input_len, seed), params,
                        f"bench-{seed}")
    if engine.config.speculative is not None:  # this batch's verified proposals
        result.update(spec_decode_summary(before, engine.get_metrics()))
    cache = engine.config.cache
    sched = engine.config.scheduler
    result.update(input_len=input_len, output_len=output_len, seed=seed, warmup=warmup,
                  block_size=cache.block_size, num_gpu_blocks=cache.num_gpu_blocks,
                  enable_prefix_caching=cache.enable_prefix_caching,
                  kv_cache_dtype=cache.kv_cache_dtype, max_num_seqs=sched.max_num_seqs,
                  max_num_batched_tokens=sched.max_num_batched_tokens,
                  max_model_len=sched.max_model_len)
    return result


def spec_decode_summary(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Speculative decoding between two get_metrics() snapshots: drafts, proposed and accepted
    tokens, the acceptance rate and the mean acceptance length (tokens a verifying step
    yields per request: accepted proposals plus the target's own)."""
    d = {k: after[k] - before.get(k, 0) for k in (
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens")}
    drafts, proposed, accepted = d.values()
    d["spec_decode_acceptance_rate"] = accepted / proposed if proposed else 0.0
    d["spec_decode_mean_acceptance_length"] = 1 + accepted / drafts if drafts else 0.0
    return d


def summary_line(result: dict[str, Any]) -> str:
    """vLLM's one-line throughput summary (and the mean acceptance length, as vLLM's spec
    decode stats line, when proposals were verified)."""
    line = (f"Throughput: {result['requests_per_second']:.2f} requests/s, "
            f"{result['tokens_per_second']:.2f} total tokens/s, "
            f"{result['output_tokens_per_second']:.2f} output tokens/s")
    if "spec_decode_mean_acceptance_length" in result:
        line += (f"; mean acceptance length {result['spec_decode_mean_acceptance_length']:.2f}"
                 f", acceptance rate {result['spec_decode_acceptance_rate']:.1%}")
    return line
