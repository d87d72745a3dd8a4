"""The engine end to end on random weights: Pallas vs XLA greedy tokens, tokens/s, pool chosen.

    python scripts/gpu_engine_check.py --out engine.json     # GPU: Llama-3-8B shape, bf16 + fp8
    python scripts/gpu_engine_check.py --cpu-smoke           # a tiny shape, Pallas interpreter

Logic: jpaged/bench/gpu_engine.py. Part of scripts/device_check.sh.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jpaged.bench.gpu_engine import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
