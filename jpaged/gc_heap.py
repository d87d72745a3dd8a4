"""Keep the cyclic GC's full collections off the engine loop (vLLM freezes its heap likewise).

Python's full (generation 2) collection walks every object the GC tracks. In a process that has
loaded a model and compiled its steps that is ~185–217k objects (modules, the model, JAX's
caches): one full collection took 115–167 ms on this project's CPU, a stall of the engine loop,
and so of the device, that recurs as requests come and go. Those start-up objects live as long
as the process; moved into the GC's permanent generation (`gc.freeze`), they are never walked
again.
"""

from __future__ import annotations

import gc
import logging
import os

logger = logging.getLogger("jpaged")

ENV_DISABLE = "JPAGED_GC_FREEZE"  # "0": leave the GC heap as it is


def freeze_gc_heap() -> int:
    """Collect once, then freeze every object alive now; returns how many are frozen.

    Call it in a process the engine owns (the server, a replica), once the engine is built and
    warmed up: cyclic garbage among frozen objects is never collected, so a notebook should not.
    `JPAGED_GC_FREEZE=0` in the environment skips it (returns 0).
    """
    if os.environ.get(ENV_DISABLE, "1") == "0":
        return 0
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    logger.info("froze the GC heap after start-up: %d objects (full collections now walk only "
                "later ones; %s=0 skips this)", n, ENV_DISABLE)
    return n
