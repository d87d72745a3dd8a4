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
# XLA:CPU builds the suite's ~1,500 step programs at LLVM -O0 without its expensive passes:
# they are programs of tiny models, compiled once and run for a few steps, so compiling is most
# of their time (a compile-heavy file's compiles a third shorter; what they compute is the
# same). The embedded model's steps run about twice as long at -O0, so tests keep its long
# generations few. Set before jax starts its backend; processes the tests start inherit it
# (helpers.xla_flags adds their own flags to it).
TEST_XLA_FLAGS = os.environ.get(
    "JPAGED_TEST_XLA_FLAGS",
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

# Shared helpers (tests/helpers.py) are importable from every test package.
import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "models"))  # tiny_models
