"""JAX's persistent compilation cache for the engine's step programs.

Each decoder layer is its own code in the step program (models/llama.py loops over layers at
trace time), so a cold compile of a many-layer model costs several seconds per bucket shape on
XLA:CPU. The executables are kept on disk, keyed by JAX on the program and the backend, so a
later process with the same model and shapes loads them instead of compiling.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from jpaged.config import COMPILE_CACHE_ENV, DEFAULT_COMPILE_CACHE_DIR

logger = logging.getLogger("jpaged")

OFF = ("", "0", "off", "none")


def enable_compilation_cache() -> str | None:
    """Turn JAX's persistent compilation cache on at jpaged's directory; returns the directory
    in use (None when disabled).

    A directory the process configured itself (jax_compilation_cache_dir) is kept as it is.
    Otherwise $JPAGED_COMPILE_CACHE_DIR, or ~/.cache/jpaged/xla; "off" disables it. The
    cache is trusted code: the directory is made readable by its owner only.
    """
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    wanted = os.environ.get(COMPILE_CACHE_ENV, DEFAULT_COMPILE_CACHE_DIR)
    if wanted.strip().lower() in OFF:
        return None
    path = Path(wanted).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:  # a read-only home: compile every time, as without a cache
        logger.warning("compilation cache %s unusable (%s); compiling without one", path, e)
        return None
    compilation_cache.set_cache_dir(str(path))
    # JAX decides once per process whether a cache is in use; an earlier compile (before the
    # directory was set) would have decided "no".
    compilation_cache.reset_cache()
    logger.info("compilation cache: %s", path)
    return str(path)
