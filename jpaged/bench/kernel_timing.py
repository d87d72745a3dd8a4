"""Device time of one jitted program, dispatched back to back: the device check's kernel timer.

`jax.block_until_ready` after every call would add the host's dispatch and wake-up latency
(tens of microseconds) to kernels that run for ten; `pipelined` instead queues `batch` calls
of the compiled program and waits once, so the device runs them back to back and the host's
latency is paid once per batch (METHOD.md: warm up, then the median of repeats). A program
that holds U calls of a kernel (`unrolled`) amortises the dispatch of the program itself
over U launches. Wall-clock seconds, because XLA's own timers are not reachable from jax; on
a GPU the first call compiles and is never timed.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax


@dataclass(frozen=True)
class Timing:
    """Seconds per unit of work (a call of the program / `per_call` of them): median, spread."""

    median_s: float
    min_s: float
    max_s: float
    calls: int  # programs timed per repeat

    def as_dict(self) -> dict[str, float]:
        return {"us": round(self.median_s * 1e6, 3), "us_min": round(self.min_s * 1e6, 3),
                "us_max": round(self.max_s * 1e6, 3)}


def pipelined(fn: Callable[..., Any], args: Sequence[Any], *, per_call: int = 1,
              repeats: int = 5, target_s: float = 0.02, max_calls: int = 200) -> Timing:
    """Seconds per unit of `fn(*args)`, a jitted program doing `per_call` units of work.

    One call compiles and warms up; a second, waited for alone, sizes the batch to about
    `target_s`; then `repeats` batches of that many calls, each queued back to back and
    waited for once. Outputs of a call are dropped as the next is queued (jax frees them
    when the device is done)."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t0
    calls = max(1, min(max_calls, math.ceil(target_s / max(one, 1e-7))))
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        per.append((time.perf_counter() - t0) / (calls * per_call))
    return Timing(statistics.median(per), min(per), max(per), calls)


def unrolled(fn: Callable[..., Any], n_args: int) -> Callable[..., list[Any]]:
    """One jitted program calling `fn` on each of several argument tuples in turn.

    `program(*flat)` takes the tuples flattened (`n_args` arrays each) and returns every
    call's output, so none is dead code, and each call has its own input arrays, so none is
    a common subexpression of another. `fn` is jitted on its own first: jax lowers it once and
    the program calls that one function (a Pallas kernel is compiled once, not per call)."""
    inner = jax.jit(fn)

    @jax.jit
    def program(*flat: Any) -> list[Any]:
        return [inner(*flat[i:i + n_args]) for i in range(0, len(flat), n_args)]

    return program
