"""Per-layer paged attention on CPU: the reference vs the chunk-skipping XLA version.

    python scripts/bench_attention.py [--quick] [--out docs/bench/attention.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jpaged.bench import attention, report


def main() -> None:
    """Time both implementations on each case, write JSON + PNG, print the table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/attention.json"))
    args = ap.parse_args()
    rows = attention.run(repeats=3 if args.quick else 7)
    data = {"cases": rows, "quick": args.quick}

    def plot(ax):
        names = [r["case"] for r in rows]
        ys = range(len(rows))
        ax.barh([y + 0.2 for y in ys], [r["reference_ms"] for r in rows], 0.4,
                label="reference", color="#999999")
        ax.barh([y - 0.2 for y in ys], [r["xla_ms"] for r in rows], 0.4, label="xla",
                color="#2a7ab9")
        ax.set_yticks(list(ys), names, fontsize=7)
        ax.set_xlabel("ms per layer call")
        ax.legend(fontsize=8)

    report.write(args.out, data, plot)
    report.print_table("paged attention per layer (ms): reference | xla | speedup",
                       [(r["case"], f"{r['reference_ms']:.2f} | {r['xla_ms']:.2f} | "
                         f"{r['speedup']:.2f}x") for r in rows])


if __name__ == "__main__":
    main()
