"""Disaggregated prefill/decode vs two co-located replicas, on the embedded model.

Two replicas (Ray actors on this machine, each pinned to its own core) behind a real OpenAI
server, twice on the same workload: co-located (both prefill and decode, KV-aware routing),
then one prefill replica and one decode replica (the prompt's KV pulled over
jax.experimental.transfer on 127.0.0.1). Steady streams decode while long prompts keep
arriving. Writes `itl_p50_colocated_s`, `itl_p99_colocated_s`, `itl_p50_disagg_s`,
`itl_p99_disagg_s`, `ttft_p50_colocated_s`, `ttft_p50_disagg_s`, `blocks_transferred`,
`blocks_skipped_cached`, `transfer_s_per_block` (and `_loaded`: under the workload, waits
behind the producer's steps included), `recompute_s_per_block`, `outputs_identical`,
`kv_usage_after` and both runs' rows. Logic in jpaged/bench/pd.py.

    .venv/bin/python scripts/bench_pd.py --quick --out /tmp/pd.json   # ~4 min
    .venv/bin/python scripts/bench_pd.py --out docs/bench/pd.json     # ~8 min
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from jpaged.bench import report
from jpaged.bench.pd import pd_workload, run_pd
from jpaged.config import EngineArgs
from jpaged.intmath import cdiv


def main() -> None:
    """Parse flags, run both configurations, write JSON + PNG, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer and shorter requests")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/pd.json"))
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    args = ap.parse_args()
    import ray

    cores = sorted(os.sched_getaffinity(0))[:2]
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR",
                           str(Path("~/.cache/jpaged/xla-bench-pd").expanduser()))
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"JAX_COMPILATION_CACHE_DIR": cache,
                                       "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}})
    shape = (dict(streams=3, long_prompts=4, long_len=384, decode_len=48, gap_s=1.5)
             if args.quick else
             dict(streams=4, long_prompts=8, long_len=768, decode_len=96, gap_s=2.0))
    work = pd_workload(**shape, seed=0)
    warm = pd_workload(**shape, seed=1)  # the same shapes: every step shape compiles here
    probe = pd_workload(**{**shape, "long_prompts": 1}, seed=2).longs[0]
    engine = EngineArgs(model=args.model, max_model_len=2048, max_num_seqs=8,
                        kv_cache_memory_bytes=256 * 2**20, disable_log_stats=True,
                        kv_transfer_config={"kv_connector_extra_config": {
                            "abort_timeout_s": 60}})
    plain = EngineArgs(**{**vars(engine), "kv_transfer_config": None})
    try:
        colo = run_pd(plain, False, work, warm, cores, probe=probe)
        print({k: v for k, v in colo.items() if k != "texts"}, flush=True)
        dis = run_pd(engine, True, work, warm, cores, probe=probe)
        print({k: v for k, v in dis.items() if k != "texts"}, flush=True)
    finally:
        ray.shutdown()
    bs = engine.block_size
    prompts = work.streams + work.longs
    needed = sum(cdiv(len(p) - 1, bs) for p in prompts)  # what a decode engine reads
    data: dict = {
        "quick": args.quick, "cores": cores,
        "workload": {**shape, "stream_len": len(work.streams[0]), "requests": len(prompts)},
        "itl_p50_colocated_s": colo["itl_p50_s"], "itl_p99_colocated_s": colo["itl_p99_s"],
        "itl_p50_disagg_s": dis["itl_p50_s"], "itl_p99_disagg_s": dis["itl_p99_s"],
        "ttft_p50_colocated_s": colo["ttft_p50_s"], "ttft_p50_disagg_s": dis["ttft_p50_s"],
        "blocks_transferred": dis["blocks_transferred"],
        "blocks_skipped_cached": needed - dis["blocks_transferred"],
        "transfer_s_per_block": dis["transfer_s_per_block"],
        "transfer_s_per_block_loaded": dis["transfer_s_per_block_loaded"],
        "recompute_s_per_block": colo["recompute_s_per_block"],
        "outputs_identical": colo["texts"] == dis["texts"],
        "kv_usage_after": {"colocated": colo["kv_usage_after"],
                           "disagg": dis["kv_usage_after"]},
        "rows": [{k: v for k, v in r.items() if k != "texts"} for r in (colo, dis)],
    }
    data["itl_p99_ratio"] = round(dis["itl_p99_s"] / colo["itl_p99_s"], 3)

    def plot(ax):
        names = ["ITL p50", "ITL p99", "TTFT p50 (long)"]
        keys = [("itl_p50_colocated_s", "itl_p50_disagg_s"),
                ("itl_p99_colocated_s", "itl_p99_disagg_s"),
                ("ttft_p50_colocated_s", "ttft_p50_disagg_s")]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [data[a] for a, _ in keys], 0.4, label="co-located x2",
               color="#e08a2c")
        ax.bar([x + 0.2 for x in xs], [data[b] for _, b in keys], 0.4,
               label="1 prefill + 1 decode", color="#2a7ab9")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("seconds")
        ax.legend(fontsize=8)
        ax.set_title(f"{shape['streams']} streams decoding while {shape['long_prompts']} "
                     f"prompts of {shape['long_len']} tokens arrive", fontsize=9)

    report.write(args.out, data, plot)
    report.print_table("disaggregated prefill/decode", [
        (k, data[k]) for k in ("itl_p50_colocated_s", "itl_p99_colocated_s", "itl_p50_disagg_s",
                               "itl_p99_disagg_s", "itl_p99_ratio", "ttft_p50_colocated_s",
                               "ttft_p50_disagg_s", "blocks_transferred",
                               "blocks_skipped_cached", "transfer_s_per_block",
                               "transfer_s_per_block_loaded", "recompute_s_per_block",
                               "outputs_identical")])


if __name__ == "__main__":
    main()
