"""Suite-wide settings: a persistent XLA compilation cache shared by every engine in the run,
XLA:CPU's -O0 for most compiles, and the fixture that lets a module compile at XLA's level."""

import contextlib
import os
import subprocess
import sys
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
# starts. Every compile also uses XLA:CPU's older loop emitters instead of its MLIR fusion
# emitters (--xla_cpu_use_fusion_emitters=false): a tiny engine's step compiles in ~0.6 s
# instead of ~1.1 s (the spec-decode file 140 -> 93 s alone; the suite 1093 -> 783 s), while
# the embedded model's optimized steps run ~7% slower. JPAGED_TEST_XLA_FLAGS, when set,
# replaces both: those XLA_FLAGS (empty: XLA's defaults) for every compile.
# helpers.xla_flags adds a child's own flags to XLA_FLAGS.
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _legacy_emitters() -> str:
    """LEGACY_EMITTERS if this jaxlib's XLA knows the flag, else "" (an unknown flag in
    XLA_FLAGS aborts the process; jaxlib 0.10 has the old emitters, 0.11 no longer does).
    Asked once a run: the answer reaches the test processes (xdist workers) in the environment."""
    key = "JPAGED_TEST_LEGACY_EMITTERS"
    if key not in os.environ:
        probe = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices('cpu')"],
            env={**os.environ, "XLA_FLAGS": LEGACY_EMITTERS, "JAX_PLATFORMS": "cpu"},
            capture_output=True, timeout=300)
        os.environ[key] = LEGACY_EMITTERS if probe.returncode == 0 else ""
    return os.environ[key]


TEST_XLA_FLAGS = os.environ.get("JPAGED_TEST_XLA_FLAGS")
if TEST_XLA_FLAGS is None:
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    jax.config.update("jax_disable_most_optimizations", True)
    TEST_XLA_FLAGS = _legacy_emitters()
_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in TEST_XLA_FLAGS.split() if f not in _flags])

# Shared helpers (tests/helpers.py) are importable from every test package.
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


# The slowest test files, slowest first (their tests' seconds in a full run on a 2-core
# machine, 2026-12-07: 349 s for the first down to 84 s for the last). With `--dist loadfile`
# each of the two workers takes one file at a time from a queue; pytest-xdist orders that queue
# by test count, which puts these few-test, minutes-long files last, where one of them can
# keep a worker busy while the other has nothing left. Started first instead (longest first),
# they leave the many short files to even out the two workers' ends. Replayed on two full
# runs' file times, the ends of xdist's order were 44 and 67 s apart, these 31 and 26 s (a
# run's wall time is the later end).
SLOW_FILES = (
    "tests/jpaged/dp/test_dp_server.py",
    "tests/jpaged/test_spec_decode.py",
    "tests/jpaged/test_structured_outputs.py",
    "tests/jpaged/bench/test_device_check.py",
    "tests/models/test_moe.py",
    "tests/jpaged/runner/test_multiprocess.py",
    "tests/jpaged/runner/test_tensor_parallel_kernels.py",
    "tests/models/test_convert.py",
    "tests/jpaged/runner/test_tensor_parallel.py",
    "tests/jpaged/test_moe_engine.py",
    "tests/jpaged/test_sliding_window.py",
    "tests/pallas_kernels/test_decode_matmul_quant.py",
    "tests/jpaged/test_engine_embedded.py",
    "tests/jpaged/test_lora.py",
    "tests/jpaged/test_cli.py",
    "tests/jpaged/runner/test_sampler.py",
    "tests/jpaged/aot/test_pool_in_place.py",
    "tests/jpaged/test_engine_pallas.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """Keep the collection's file order in xdist's queue (see SLOW_FILES)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """SLOW_FILES first, in their order; every other file after them, as collected (a stable
    sort: the tests of a file keep their order)."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
