"""Routing between data-parallel replicas: kv_aware vs round_robin vs least_load, and one engine.

Two replicas of the embedded model (Ray actors on this machine) behind a real OpenAI server; the
same multi-tenant workload (several long system prompts, many questions each, interleaved) per
routing policy, each on fresh replicas; then the workload through one engine alone. Writes
`hit_rate_<policy>`, `prefill_tokens_<policy>`, `ttft_p50_<policy>_s`, `ttft_p99_<policy>_s`,
`tokens_per_s_<policy>`, `replica_share_<policy>`, the same for `single`, and every run's row.
Logic in jpaged/bench/dp.py.

    .venv/bin/python scripts/bench_dp.py --quick --out /tmp/dp.json   # ~4 min
    .venv/bin/python scripts/bench_dp.py --out docs/bench/dp.json     # ~8 min
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from jpaged.bench import report
from jpaged.bench.dp import run_policy, tenant_workload
from jpaged.config import EngineArgs

POLICIES = ("kv_aware", "round_robin", "least_load")


def main() -> None:
    """Parse flags, run every policy and one engine, write JSON + PNG, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tenants and questions")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/dp.json"))
    ap.add_argument("--replicas", type=int, default=2)
    args = ap.parse_args()
    import ray

    # One local cluster for every run; the replicas share a persistent XLA cache, so only the
    # first run compiles.
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR",
                           str(Path("~/.cache/jpaged/xla-bench-dp").expanduser()))
    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"JAX_COMPILATION_CACHE_DIR": cache,
                                       "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}})
    tenants, questions = (4, 6) if args.quick else (6, 12)
    shape = dict(tenants=tenants, questions=questions, system_len=384, question_len=24)
    workload = tenant_workload(**shape, seed=0)
    warmup = [p for _, p in tenant_workload(tenants=8, questions=1, system_len=384,
                                            question_len=24, seed=99)]
    run = dict(max_tokens=8, concurrency=8)
    engine = EngineArgs(max_model_len=1024, max_num_seqs=8, kv_cache_memory_bytes=256 * 2**20,
                        disable_log_stats=True)
    rows = []
    try:
        for policy in POLICIES:
            rows.append(run_policy(engine, args.replicas, policy, workload, warmup,
                                   replica_cpus=0.5, **run))
            print(rows[-1], flush=True)
        single = run_policy(engine, 1, "round_robin", workload, warmup, replica_cpus=0.5, **run)
        single["policy"] = "single"
        rows.append(single)
        print(single, flush=True)
    finally:
        ray.shutdown()
    data: dict = {"quick": args.quick, "workload": {**shape, **run, "requests": len(workload)},
                  "replicas": args.replicas, "rows": rows}
    for r in rows:
        p = r["policy"]
        data[f"hit_rate_{p}"] = r["hit_rate"]
        data[f"prefill_tokens_{p}"] = r["prefill_tokens"]
        data[f"ttft_p50_{p}_s"] = r["ttft_p50_s"]
        data[f"ttft_p99_{p}_s"] = r["ttft_p99_s"]
        data[f"tokens_per_s_{p}"] = r["tokens_per_s"]
        data[f"replica_share_{p}"] = r["replica_share"]

    def plot(ax):
        names = [r["policy"] for r in rows]
        ax.bar(names, [r["hit_rate"] for r in rows], color=["#2a7ab9", "#e08a2c", "#8e44ad",
                                                            "#7f8c8d"][:len(rows)])
        for i, r in enumerate(rows):
            ax.text(i, r["hit_rate"] + 0.01, f"{r['hit_rate']:.2f}\n{r['prefill_tokens']} tok",
                    ha="center", fontsize=8)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("prefix cache hit rate")
        ax.set_title(f"{args.replicas} replicas, {tenants} tenants x {questions} questions "
                     "(same requests)", fontsize=9)

    report.write(args.out, data, plot)
    report.print_table("routing", [
        (r["policy"], f"hit {r['hit_rate']:.3f}, prefill {r['prefill_tokens']} tok, TTFT p50 "
                      f"{r['ttft_p50_s']:.3f}s p99 {r['ttft_p99_s']:.3f}s, "
                      f"{r['tokens_per_s']} tok/s, shares {r['replica_share']}")
        for r in rows])


if __name__ == "__main__":
    main()
