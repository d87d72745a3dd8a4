"""Suite-wide settings: a persistent XLA compilation cache shared by every engine in the run,
XLA:CPU's -O0 for most compiles, and the fixture that lets a module compile at XLA's level."""

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest

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
# of their time (a compile-heavy file's compiles a third shorter; what they compute agrees to
# float rounding). jax_disable_most_optimizations sets exactly those two options
# (xla_backend_optimization_level=0, xla_llvm_disable_expensive_passes) on each compile, so a
# module whose time is the embedded model's steps *running* (about three times as long at -O0)
# can compile at XLA's own level instead: the `optimized_compiles` fixture below. Processes the
# tests start inherit the setting through JAX_DISABLE_MOST_OPTIMIZATIONS, read when their jax
# starts. JPAGED_TEST_XLA_FLAGS, when set, replaces it: those XLA_FLAGS (empty: XLA's
# defaults) for every compile. helpers.xla_flags adds a child's own flags to XLA_FLAGS.
TEST_XLA_FLAGS = os.environ.get("JPAGED_TEST_XLA_FLAGS")
if TEST_XLA_FLAGS is None:
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    jax.config.update("jax_disable_most_optimizations", True)
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS or ''}".strip()

# Shared helpers (tests/helpers.py) are importable from every test package.
import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "models"))  # tiny_models


@contextlib.contextmanager
def _compiles_at_xla_level() -> Iterator[None]:
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="module")
def optimized_compiles():
    """This module's compiles at XLA's own optimization level (the -O0 above left off): for
    modules whose time is the embedded model's steps running, not compiling. A program's values
    agree with -O0's to float rounding; a module compares programs compiled at its one level.
    A module opts in with `pytestmark = pytest.mark.usefixtures("optimized_compiles")`."""
    with _compiles_at_xla_level():
        yield


@pytest.fixture
def optimized_compiles_in_test():
    """`optimized_compiles` for one test of a module whose other tests compile more than they
    run (`@pytest.mark.usefixtures("optimized_compiles_in_test")`)."""
    with _compiles_at_xla_level():
        yield
