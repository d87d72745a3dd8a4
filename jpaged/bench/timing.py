"""Wall time net of XLA compilation, so lazily compiling engines can be timed side by side."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# jax's own duration events for one compilation: trace, lowering, XLA backend compile.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


@dataclass
class Stopwatch:
    """Wall seconds of a block, and the seconds jax spent compiling inside it."""

    wall_s: float = 0.0
    compile_s: float = 0.0

    @property
    def net_s(self) -> float:
        """Wall time minus compilation: what the block costs once every shape is compiled."""
        return max(self.wall_s - self.compile_s, 1e-9)


@contextmanager
def stopwatch() -> Iterator[Stopwatch]:
    """Time a block; compilation seconds come from jax.monitoring's duration events."""
    import jax.monitoring

    sw = Stopwatch()

    def listener(event: str, duration: float, **_: object) -> None:
        if event in COMPILE_EVENTS:
            sw.compile_s += duration

    jax.monitoring.register_event_duration_secs_listener(listener)
    t0 = time.perf_counter()
    try:
        yield sw
    finally:
        sw.wall_s = time.perf_counter() - t0
        jax.monitoring.unregister_event_duration_listener(listener)


def median_call_s(f: Callable[..., Any], *args: Any, repeats: int = 5) -> float:
    """Median seconds of `repeats` calls of jitted `f(*args)` after one warm-up (compile) call."""
    import jax

    from jpaged.bench.report import median

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return median(times)
