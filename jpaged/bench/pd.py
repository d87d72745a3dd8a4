"""Disaggregated prefill/decode benchmark logic (scripts/bench_pd.py): the same workload through
two co-located replicas and through one prefill plus one decode replica, each replica pinned to
its own core, behind a real OpenAI server.

Workload: `streams` steady streams (short prompts, `decode_len` tokens each) decode while
`long_prompts` long prompts (`long_len` tokens: a shared system prompt of half that, then a
unique part; `long_max_tokens` each) arrive every `gap_s`. Co-located, a long prompt's prefill
shares steps with the streams on its replica and stretches their inter-token latency;
disaggregated, it runs on the prefill replica and only its pages reach the decode replica.

Measured per run: inter-token latency (ITL: gaps between a steady stream's chunks after its
first) p50/p99, TTFT of the long prompts p50, every greedy text, the blocks the decode replica
pulled and the seconds its pulls took, the KV usage of every replica once idle. Plus, on the
idle replicas before the workload, one long prompt alone (max_tokens 1): the seconds per block
of computing it (co-located) and of pulling it (disaggregated: the decode replica's pull from
its ask to the pages on its device).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jpaged.bench.dp import _percentile, _wait_idle
from jpaged.config import EngineArgs
from jpaged.intmath import cdiv


@dataclass
class PDWorkload:
    """Prompts and timings of one run (token ids; the same for both configurations)."""

    streams: list[list[int]]
    longs: list[list[int]]
    decode_len: int
    long_max_tokens: int
    gap_s: float


def pd_workload(streams: int, long_prompts: int, long_len: int, stream_len: int = 32,
                decode_len: int = 64, long_max_tokens: int = 4, gap_s: float = 1.0,
                vocab: tuple[int, int] = (1000, 20000), seed: int = 0) -> PDWorkload:
    """Random-token prompts: the long ones share their first half (a system prompt)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(*vocab, long_len // 2).tolist()
    return PDWorkload(
        [rng.integers(*vocab, stream_len).tolist() for _ in range(streams)],
        [system + rng.integers(*vocab, long_len - len(system)).tolist()
         for _ in range(long_prompts)],
        decode_len, long_max_tokens, gap_s)


async def _drive(url: str, work: PDWorkload) -> dict[str, Any]:
    """Run the workload; ITLs of the streams, TTFTs of the long prompts, every text."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                timeout=900)
    itls: list[float] = []
    ttfts: list[float] = []
    texts: dict[str, str] = {}

    async def one(key: str, ids: list[int], max_tokens: int, delay: float) -> None:
        await asyncio.sleep(delay)
        t0 = time.perf_counter()
        stream = await client.completions.create(
            model="bench", prompt=ids, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        last = None
        text = ""
        async for chunk in stream:
            if not chunk.choices:
                continue
            now = time.perf_counter()
            if last is None:
                if key.startswith("long"):
                    ttfts.append(now - t0)
            elif key.startswith("stream"):
                itls.append(now - last)
            last = now
            text += chunk.choices[0].text
        texts[key] = text

    t0 = time.perf_counter()
    try:
        jobs = [one(f"stream{i}", p, work.decode_len, 0.0) for i, p in enumerate(work.streams)]
        jobs += [one(f"long{i}", p, work.long_max_tokens, 0.5 + i * work.gap_s)
                 for i, p in enumerate(work.longs)]
        await asyncio.gather(*jobs)
    finally:
        await client.close()
    return {"itls": itls, "ttfts": ttfts, "texts": texts, "wall_s": time.perf_counter() - t0}


async def _one_prefill(url: str, ids: list[int]) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                timeout=900)
    try:
        t0 = time.perf_counter()
        await client.completions.create(model="bench", prompt=ids, max_tokens=1,
                                        temperature=0)
        return time.perf_counter() - t0
    finally:
        await client.close()


def run_pd(args: EngineArgs, disagg: bool, work: PDWorkload, warmup: PDWorkload,
           cores: Sequence[int], replica_cpus: float = 1.0,
           probe: list[int] | None = None) -> dict[str, Any]:
    """One fresh pair of replicas (co-located, or 1 prefill + 1 decode), pinned to `cores`."""
    from jpaged.dp.client import DPEngineClient
    from jpaged.server import BackgroundServer, build_app

    pins = [[cores[r % len(cores)]] for r in range(2)]
    kw: dict[str, Any] = dict(prefill_replicas=1, decode_replicas=1) if disagg else {}
    client = DPEngineClient(args, 1 if disagg else 2, "kv_aware", replica_cpus=replica_cpus,
                            cpu_affinity=pins, **kw)
    server = BackgroundServer(build_app(client, "bench", owned=True))
    try:
        asyncio.run(_drive(server.url, warmup))  # compiles every step shape of the run
        _wait_idle(client)
        # One prompt alone on the idle pair: what computing its blocks costs (co-located), or
        # moving them (disaggregated: the decode replica's pull, from its ask to the pages on
        # its device).
        probe_s = None
        if probe is not None:
            m0 = client.replica_metrics()
            secs = asyncio.run(_one_prefill(server.url, probe))
            _wait_idle(client)
            m1 = client.replica_metrics()
            if disagg:
                got_blocks = (m1[1]["kv_transfer_blocks_received_total"]
                              - m0[1]["kv_transfer_blocks_received_total"])
                probe_s = ((m1[1]["kv_transfer_receive_seconds_total"]
                            - m0[1]["kv_transfer_receive_seconds_total"]) / max(1, got_blocks))
            else:
                probe_s = secs / cdiv(len(probe), args.block_size)
        before = client.replica_metrics()
        got = asyncio.run(_drive(server.url, work))
        _wait_idle(client)
        deadline = time.monotonic() + 120  # a producer frees its blocks once they are pulled
        while time.monotonic() < deadline and any(
                m.get("kv_cache_usage", 1.0) > 0 for m in client.replica_metrics()):
            time.sleep(0.2)
        after = client.replica_metrics()
    finally:
        server.stop()

    def delta(r: int, key: str) -> float:
        return float(after[r].get(key, 0) - before[r].get(key, 0))

    row = {"disagg": disagg, "requests": len(work.streams) + len(work.longs),
           "itl_p50_s": round(_percentile(got["itls"], 50), 4),
           "itl_p99_s": round(_percentile(got["itls"], 99), 4),
           "ttft_p50_s": round(_percentile(got["ttfts"], 50), 4),
           "wall_s": round(got["wall_s"], 2), "texts": got["texts"],
           "kv_usage_after": [m.get("kv_cache_usage") for m in after]}
    if probe_s is not None:
        row["transfer_s_per_block" if disagg else "recompute_s_per_block"] = round(probe_s, 6)
    if disagg:
        received = delta(1, "kv_transfer_blocks_received_total")
        row.update(blocks_transferred=int(received),
                   blocks_sent=int(delta(0, "kv_transfer_blocks_sent_total")),
                   transfer_s=round(delta(1, "kv_transfer_receive_seconds_total"), 4),
                   # Under load a pull also waits for the producer's running step (its gather
                   # queues behind it on the device).
                   transfer_s_per_block_loaded=round(
                       delta(1, "kv_transfer_receive_seconds_total") / max(1.0, received), 6))
    return row
