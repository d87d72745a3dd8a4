"""Suite-wide settings: a persistent XLA compilation cache shared by every engine in the run."""

import os
from pathlib import Path

import jax

_CACHE = Path(os.environ.get("JPAGED_TEST_JAX_CACHE", Path(__file__).parent.parent / ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
# Processes the tests start (CLI runs, workers) compile into the same cache, not the user's.
os.environ.setdefault("JPAGED_COMPILE_CACHE_DIR", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
# PyTorch (the HF references) in one thread: `make test` runs two workers on two cores, and
# torch's OpenMP threads spin-wait when they share a core with XLA's, which made an HF
# generate up to ten times slower than on one thread. Read when torch is first imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Shared helpers (tests/helpers.py) are importable from every test package.
import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "models"))  # tiny_models
