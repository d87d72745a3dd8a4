"""Compile every engine step for an H200 on this machine (no GPU): resources, pool aliasing.

    JAX_PLATFORMS=cpu .venv-gpu/bin/python scripts/gpu_aot.py --quick --out gpu_aot.json
    JAX_PLATFORMS=cpu .venv-gpu/bin/python scripts/gpu_aot.py --spec --only 8b/bfloat16/pallas

(--spec: the verifying steps of speculative decoding, jpaged/aot/spec_verify.py.)

Needs a jax with a CUDA plugin (`make gpu-aot` makes one). Logic: jpaged/aot/report.py.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin registers; no GPU is needed
# XLA logs every ptxas run with its -v report (registers, spills): read before jax loads.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
os.environ.setdefault("TF_CPP_VMODULE", "subprocess_compilation=3")

from jpaged.aot.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
