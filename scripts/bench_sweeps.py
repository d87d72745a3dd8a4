"""Trade-off sweeps on the embedded model: block size (8..128) and KV pool depth.

    python scripts/bench_sweeps.py [--quick] [--out docs/bench/sweeps.json]

Writes the JSON, `<out stem>_block_size.png` and `<out stem>_pool_depth.png` beside it, and
prints both tables. See jpaged/bench/sweeps.py for what is measured.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from jpaged.bench import report
from jpaged.bench.sweeps import PRESETS, plot_block_size, plot_pool_depth, run_sweeps
from models.loader import load_model


def main() -> None:
    """Parse flags, run both sweeps, write JSON + two PNGs, print the tables."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller grid (< 3 min on 2 cores)")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/sweeps.json"))
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    args = ap.parse_args()
    mode = "quick" if args.quick else "full"
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype="float32")
    data = run_sweeps(loaded, **PRESETS[mode])
    data.update(mode=mode, model=loaded.source, wall_time_s=time.perf_counter() - t0)
    report.write(args.out, data)
    w = data["workload"]
    stem = args.out.with_suffix("")
    plot_block_size(data["block_size"], f"{stem}_block_size.png",
                    f"Block size: {w['block_size_requests']} questions sharing a "
                    f"{w['block_size_common_prefix_tokens']}-token prefix, "
                    f"{w['block_size_max_tokens']} tokens out ({mode}; tokens/s on a shared CPU, "
                    "indicative)")
    plot_pool_depth(data["pool_depth"], f"{stem}_pool_depth.png",
                    f"Pool depth: {w['pool_requests']} requests, {w['pool_groups']} system "
                    f"prompts interleaved, {w['max_tokens']} tokens out, block 16, max_num_seqs "
                    f"{w['max_num_seqs']} ({w['pool_blocks_all_at_once']} blocks hold all at "
                    f"once; {mode})")
    keys = ("prefix_cache_hit_rate", "kv_waste", "num_preemptions", "num_evictions",
            "tokens_per_second")
    for name, x in (("block_size", "block_size"), ("pool_depth", "num_gpu_blocks")):
        rows = [(f"{x}={p[x]}", "  ".join(f"{k}={p[k]:.3g}" if isinstance(p[k], float)
                                          else f"{k}={p[k]}" for k in keys))
                for p in data[name]]
        report.print_table(f"sweep: {name}", rows)


if __name__ == "__main__":
    main()
