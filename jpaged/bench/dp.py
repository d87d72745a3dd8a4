"""Data-parallel routing benchmark logic (scripts/bench_dp.py): the same multi-tenant workload
through a real server over N replicas (Ray actors) under each routing policy, and through one
engine alone.

Workload: `tenants` long system prompts (random token ids, `system_len` tokens), `questions`
short questions each (`question_len` tokens), arriving interleaved (tenant after tenant, in a
shuffled order per round) and sent with at most `concurrency` in flight, streaming, greedy,
`max_tokens` each. Measured per run (fresh replicas, so fresh caches): prefix hit rate (cached /
looked-up prompt tokens over all replicas), prompt tokens actually computed, TTFT (first
streamed chunk) p50/p99, output tokens/s over the run's wall time, and each replica's share of
the requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jpaged.config import EngineArgs

COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_total",
            "generation_tokens_total")


def tenant_workload(tenants: int, questions: int, system_len: int, question_len: int,
                    vocab: tuple[int, int] = (1000, 20000), seed: int = 0
                    ) -> list[tuple[int, list[int]]]:
    """(tenant, prompt token ids) in arrival order: every tenant's q-th question before any
    tenant's (q+1)-th, tenants shuffled within each round."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(*vocab, system_len).tolist() for _ in range(tenants)]
    out = []
    for _ in range(questions):
        for t in rng.permutation(tenants).tolist():
            out.append((t, systems[t] + rng.integers(*vocab, question_len).tolist()))
    return out


def _percentile(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if xs else float("nan")


async def _drive(url: str, model: str, prompts: Sequence[list[int]], max_tokens: int,
                 concurrency: int) -> tuple[list[float], int, float]:
    """Stream every prompt (at most `concurrency` at once); (TTFTs, output tokens, wall s)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                timeout=600)
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def one(ids: list[int]) -> None:
        nonlocal tokens
        async with sem:
            t0 = time.perf_counter()
            stream = await client.completions.create(
                model=model, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            first = True
            async for chunk in stream:
                if first and chunk.choices:
                    ttfts.append(time.perf_counter() - t0)
                    first = False
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()
    return ttfts, tokens, time.perf_counter() - t0


def run_policy(args: EngineArgs, replicas: int, policy: str,
               workload: Sequence[tuple[int, list[int]]], warmup: Sequence[list[int]],
               max_tokens: int, concurrency: int, replica_cpus: float = 1.0
               ) -> dict[str, Any]:
    """One fresh set of `replicas` behind a real server, the workload under `policy`."""
    from jpaged.dp.client import DPEngineClient
    from jpaged.server import BackgroundServer, build_app

    client = DPEngineClient(args, replicas, policy, replica_cpus=replica_cpus)
    server = BackgroundServer(build_app(client, "bench", owned=True))
    try:
        # Compile the step shapes first (unrelated prompts: no prefix is shared with the run).
        asyncio.run(_drive(server.url, "bench", warmup, max_tokens, concurrency))
        _wait_idle(client)
        # The counters summed over the replicas (DPEngineClient.get_metrics).
        before, routed0 = client.get_metrics(), list(client.router.routed)
        ttfts, tokens, wall = asyncio.run(_drive(server.url, "bench",
                                                 [p for _, p in workload], max_tokens,
                                                 concurrency))
        _wait_idle(client)
        after = client.get_metrics()
        routed = [b - a for a, b in zip(routed0, client.router.routed, strict=True)]
    finally:
        server.stop()
    d = {k: float(after.get(k, 0) - before.get(k, 0)) for k in COUNTERS}
    n = sum(routed)
    return {"policy": policy, "replicas": replicas, "requests": n,
            "hit_rate": round(d["prefix_cache_hits"] / max(1.0, d["prefix_cache_queries"]), 4),
            "prefill_tokens": int(d["prompt_tokens_total"]),
            "prompt_tokens": int(d["prefix_cache_queries"]),
            "ttft_p50_s": round(_percentile(ttfts, 50), 4),
            "ttft_p99_s": round(_percentile(ttfts, 99), 4),
            "tokens_per_s": round(tokens / wall, 2), "wall_s": round(wall, 2),
            "replica_share": [round(r / max(1, n), 3) for r in routed]}


def _wait_idle(client: Any, timeout: float = 300.0) -> None:
    """Until no request is in flight and every replica's metrics say it is idle."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        per = client.replica_metrics()
        if (client.get_metrics().get("num_unfinished_requests") == 0 and per
                and all(m.get("num_unfinished_requests") == 0 for m in per)):
            time.sleep(1.0)  # one more health poll, so the counters are the final ones
            return
        time.sleep(0.2)
    raise TimeoutError("the replicas did not go idle")
