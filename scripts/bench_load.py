"""Load time of the embedded model from each format: GGUF, HF safetensors, jpaged orbax.

    python scripts/bench_load.py [--quick] [--out docs/bench/load.json]

Writes `rows` (format, dtype loaded in, median/min/all seconds, MiB on disk, speedup over the
GGUF) and prints them as a table. --quick: 3 rounds, float32 formats only; otherwise 5 rounds
plus a bfloat16 orbax checkpoint.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from jpaged.bench import report
from jpaged.bench.load import measure


def main() -> None:
    """Parse flags, write the formats to a temp dir, time their loads, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="3 rounds, float32 formats only")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/load.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="jpaged-bench-load-") as tmp:
        data = measure(Path(tmp), repeats=3 if args.quick else 5, with_bf16=not args.quick)
    data["quick"] = args.quick
    report.write(args.out, data)
    report.print_table(f"load_model, {data['model']}, median of {data['repeats']}",
                       [(f"{r['format']} ({r['dtype']}, {r['disk_mib']} MiB)",
                         f"{r['median_s']:.2f} s  x{r['speedup_vs_gguf']}")
                        for r in data["rows"]])


if __name__ == "__main__":
    main()
