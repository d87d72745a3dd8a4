"""Preemption and KV-pressure warnings, rate-limited, with what to change.

The scheduler reports each preemption and, once per step, KV usage, the cumulative eviction
count and the waiting-queue length. Two kinds of warning reach the ``jpaged.pressure`` logger:

- ``preemption``: which request, the mode (recompute/swap), the running total, and the flags that
  would avoid it (as vLLM's "Sequence group ... is preempted by ... mode" warning);
- ``kv_pressure``: KV usage stayed >= ``usage`` for ``window_steps`` steps while requests waited,
  or the cached blocks evicted within ``window_steps`` steps reached ``turnover`` x the pool
  (a cached prefix then survives fewer than ``window_steps`` steps).

Each kind is logged at most once per ``interval`` seconds; the next logged line says how many
were suppressed meanwhile. The clock is injectable, so tests need no sleeping.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from jpaged.config import CacheConfig

logger = logging.getLogger("jpaged.pressure")

DEFAULT_WARNING_INTERVAL = 10.0  # seconds between two logged warnings of one kind

Clock = Callable[[], float]


class RateLimitedLog:
    """At most one WARNING per `interval` seconds per kind; counts the ones it swallows."""

    def __init__(self, log: logging.Logger = logger, interval: float = DEFAULT_WARNING_INTERVAL,
                 clock: Clock = time.monotonic) -> None:
        if not interval >= 0:
            raise ValueError(f"RateLimitedLog.interval must be >= 0 seconds, got {interval!r}")
        self.log = log
        self.interval = float(interval)
        self.clock = clock
        self._last: dict[str, float] = {}  # kind -> time of its last logged warning
        self.suppressed: dict[str, int] = {}  # kind -> swallowed since its last logged warning
        self.emitted: dict[str, int] = {}  # kind -> logged in total

    def warn(self, kind: str, message: str) -> bool:
        """Log `message` unless `kind` was logged less than `interval` ago; True if logged."""
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self.suppressed[kind] = self.suppressed.get(kind, 0) + 1
            return False
        n = self.suppressed.pop(kind, 0)
        if n:
            message += (f" ({n} similar warning{'s' if n > 1 else ''} suppressed in the last "
                        f"{now - last:.0f}s)")
        self._last[kind] = now
        self.emitted[kind] = self.emitted.get(kind, 0) + 1
        self.log.warning(message)
        return True


@dataclass(frozen=True)
class PressureThresholds:
    """When sustained KV pressure is worth a warning."""

    window_steps: int = 50
    usage: float = 0.95  # fraction of usable blocks held by requests
    turnover: float = 1.0  # evicted cached blocks in the window / pool blocks

    def __post_init__(self) -> None:
        if self.window_steps < 1:
            raise ValueError(f"PressureThresholds.window_steps must be >= 1, got "
                             f"{self.window_steps}")
        if not 0.0 < self.usage <= 1.0:
            raise ValueError(f"PressureThresholds.usage must be in (0, 1], got {self.usage}")
        if not self.turnover > 0:
            raise ValueError(f"PressureThresholds.turnover must be > 0, got {self.turnover}")


def advice(cache: CacheConfig) -> str:
    """The flags that give requests more KV room, phrased for the knob the user set."""
    if cache.num_gpu_blocks_override is not None:
        memory = "raise num_gpu_blocks_override"
    elif cache.kv_cache_memory_bytes is not None:
        memory = "raise kv_cache_memory_bytes"
    else:
        memory = "raise gpu_memory_utilization (on CPU: set kv_cache_memory_bytes)"
    parts = [memory, "lower max_num_seqs"]
    if cache.kv_offloading_size <= 0:
        parts.append("set kv_offloading_size > 0 with preemption_mode=swap (preempted KV waits "
                     "in host RAM instead of being recomputed)")
    elif cache.preemption_mode != "swap":
        parts.append("set preemption_mode=swap (the host tier is there)")
    if cache.kv_cache_dtype == "auto":
        parts.append("or kv_cache_dtype=fp8 (twice the blocks or more)")
    return "; ".join(parts) + ". `jpaged tune` searches these settings on your workload."


class PressureMonitor:
    """Turns scheduler events into rate-limited preemption and KV-pressure warnings."""

    def __init__(self, cache: CacheConfig, num_blocks: int, *,
                 interval: float = DEFAULT_WARNING_INTERVAL, clock: Clock = time.monotonic,
                 thresholds: PressureThresholds | None = None,
                 log: logging.Logger = logger) -> None:
        self.cache = cache
        self.num_usable = max(num_blocks - 1, 1)  # block 0 is the null block
        self.thresholds = thresholds or PressureThresholds()
        self.limiter = RateLimitedLog(log, interval, clock)
        self.advice = advice(cache)
        # Invariant: _high_steps counts consecutive steps with usage >= thresholds.usage and a
        # non-empty waiting queue; _evicted holds the evictions of the last <= window steps.
        self._high_steps = 0
        self._evicted: deque[int] = deque(maxlen=self.thresholds.window_steps)
        self._last_evictions: int | None = None

    def on_preemption(self, request_id: str, mode: str, total: int) -> None:
        """One request was preempted by `mode` ("recompute" | "swap"); `total` counts all."""
        self.limiter.warn("preemption", (
            f"Request {request_id!r} was preempted by {mode.upper()} mode because the KV cache "
            f"ran out of blocks; total_num_cumulative_preemption={total}. Frequent preemption "
            f"slows every request: {self.advice}"))

    def on_step(self, kv_usage: float, num_evictions: int, num_waiting: int) -> None:
        """One scheduled step: current usage, cumulative evictions, waiting requests."""
        th = self.thresholds
        if kv_usage >= th.usage and num_waiting > 0:
            self._high_steps += 1
            if self._high_steps >= th.window_steps:
                self._high_steps = 0  # a new window starts after each (possibly muted) warning
                self.limiter.warn("kv_pressure", (
                    f"KV cache pressure: usage has stayed >= {th.usage:.0%} for "
                    f"{th.window_steps} steps with {num_waiting} request(s) waiting; the pool "
                    f"({self.num_usable} blocks) limits concurrency: {self.advice}"))
        else:
            self._high_steps = 0
        prev = self._last_evictions
        self._last_evictions = num_evictions
        self._evicted.append(0 if prev is None else max(num_evictions - prev, 0))
        evicted = sum(self._evicted)
        if evicted >= th.turnover * self.num_usable:
            steps = len(self._evicted)
            self._evicted.clear()
            self.limiter.warn("kv_pressure", (
                f"KV cache pressure: {evicted} cached blocks evicted in the last "
                f"{steps} steps ({evicted / self.num_usable:.1f}x the pool of "
                f"{self.num_usable} blocks): cached prefixes are dropped before they are reused "
                f"and the prefix hit rate falls: {self.advice}"))
