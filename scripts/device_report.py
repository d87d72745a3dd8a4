"""Merge a lent GPU's device-check files and compare its decode step rows with `make gpu-aot`'s
prediction (jpaged/bench/device_report.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jpaged.bench.device_report import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
