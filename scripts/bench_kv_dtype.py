"""Decode step time per KV dtype (float32, bf16, fp8) at the default pool, as ratios.

    python scripts/bench_kv_dtype.py [--quick] [--out docs/bench/kv_dtype.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jpaged.bench import report
from jpaged.bench.kv_dtype import decode_step_times
from models.loader import load_model


def main() -> None:
    """Parse flags, measure, write JSON + PNG, print the table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="batch 1 and 16, 4 timed steps")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/kv_dtype.json"))
    ap.add_argument("--model", default=None, help="model path (default: the embedded model)")
    args = ap.parse_args()
    loaded = load_model(args.model, dtype="float32")
    batches, steps = ((1, 16), 4) if args.quick else ((1, 16, 64), 8)
    data = decode_step_times(loaded, batches, steps)
    data["quick"] = args.quick
    rows = data["rows"]

    def plot(ax):
        width = 0.8 / len(rows)
        for i, r in enumerate(rows):
            xs = [j + i * width for j in range(len(batches))]
            ax.bar(xs, [r[f"decode_ms_b{b}"] for b in batches], width,
                   label=f"{r['kv_cache_dtype']} ({r['num_blocks']} blocks)")
        ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(batches))],
                      [str(b) for b in batches])
        ax.set_xlabel("decode batch")
        ax.set_ylabel("ms per decode step (device)")
        ax.set_title("KV dtype at the default 2 GiB pool (embedded model, CPU)", fontsize=9)
        ax.legend(fontsize=8)

    report.write(args.out, data, plot)
    report.print_table("decode step per KV dtype, default pool",
                       [(f"{r['kv_cache_dtype']} {k}", v) for r in rows for k, v in r.items()
                        if k != "kv_cache_dtype"])


if __name__ == "__main__":
    main()
