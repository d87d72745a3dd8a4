"""Paged KV cache vs the naive contiguous cache at equal KV memory, side by side.

    python scripts/bench_vs_naive.py [--quick] [--out docs/bench/vs_naive.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jpaged.bench import report
from jpaged.bench.vs_naive import (
    kv_budget_bytes,
    paged_engine,
    parallel_sampling_blocks,
    run_naive,
    run_paged,
)
from jpaged.bench.workloads import mixed_length_requests
from jpaged.naive import NaiveEngine
from models.loader import load_model


def main() -> None:
    """Parse flags, run both caches on the same workload, write JSON + PNG, print the table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller workload (< 3 min on 2 cores)")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/vs_naive.json"))
    ap.add_argument("--model", default=None, help="model path (default: the embedded model)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    max_len = 2048
    if args.quick:
        n, rows, prompt_range, output_range, repeats = 10, 2, (32, 512), (32, 64), 1
    else:
        n, rows, prompt_range, output_range, repeats = 48, 4, (32, 512), (32, 512), 1
    repeats = args.repeats or repeats
    loaded = load_model(args.model, dtype="float32")
    budget = kv_budget_bytes(loaded, rows, max_len)
    paged = paged_engine(loaded, budget, max_len)
    naive = NaiveEngine(loaded, max_len, budget)
    vocab = loaded.spec.vocab_size
    runs_p, runs_n = [], []
    for r in range(repeats):
        work = mixed_length_requests(vocab, n, args.seed + r, prompt_range, output_range)
        runs_p.append(run_paged(paged, work, f"p{r}"))
        runs_n.append(run_naive(naive, work, f"n{r}"))
    med = report.median
    p_tps = med([x["tokens_per_s"] for x in runs_p])
    n_tps = med([x["tokens_per_s"] for x in runs_n])
    ps_prompts = [p for p, _ in mixed_length_requests(vocab, 4, args.seed, (256, 256), (1, 1))]
    ps = parallel_sampling_blocks(loaded, ps_prompts, 16 if args.quick else 64, max_len)
    data = {
        "paged_max_concurrency": max(x["max_concurrency"] for x in runs_p),
        "naive_max_concurrency": max(x["max_concurrency"] for x in runs_n),
        "paged_waste": med([x["waste"] for x in runs_p]),
        "naive_waste": med([x["waste"] for x in runs_n]),
        "paged_tokens_per_s": p_tps, "naive_tokens_per_s": n_tps,
        "throughput_ratio": p_tps / n_tps,
        "parallel_sampling_blocks_shared": ps["shared"],
        "parallel_sampling_blocks_unshared": ps["unshared"],
        "parallel_sampling_memory_ratio": ps["unshared"] / ps["shared"],
        "kv_budget_bytes": budget, "naive_rows": naive.rows,
        "paged_blocks": paged.config.cache.num_gpu_blocks, "max_model_len": max_len,
        "num_requests": n, "prompt_range": prompt_range, "output_range": output_range,
        "repeats": repeats, "quick": args.quick, "paged_runs": runs_p, "naive_runs": runs_n,
    }
    data["concurrency_ratio"] = data["paged_max_concurrency"] / data["naive_max_concurrency"]

    def plot(ax):
        names = ["max concurrency", "KV waste x10", "tokens/s"]
        pv = [data["paged_max_concurrency"], 10 * data["paged_waste"], p_tps]
        nv = [data["naive_max_concurrency"], 10 * data["naive_waste"], n_tps]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], nv, 0.4, label="naive (contiguous)", color="#999999")
        ax.bar([x + 0.2 for x in xs], pv, 0.4, label="paged", color="#2a7ab9")
        ax.set_xticks(list(xs), names)
        ax.legend(fontsize=8)
        ax.set_title(f"equal KV memory ({naive.rows} rows of {max_len}): "
                     f"{data['concurrency_ratio']:.1f}x concurrency, "
                     f"{data['throughput_ratio']:.2f}x throughput", fontsize=9)

    report.write(args.out, data, plot)
    report.print_table("paged vs naive KV cache",
                       [(k, v) for k, v in data.items() if not k.endswith("_runs")])


if __name__ == "__main__":
    main()
