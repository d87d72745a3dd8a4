"""A bounded per-step history of scheduler gauges and counters, for plots over time."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from jpaged.core.scheduler import Scheduler

DEFAULT_MAXLEN = 2048  # steps kept; older points are dropped first

# Field order of one stored point (tuples keep the per-step cost to one small allocation).
FIELDS = ("step", "time", "kv_cache_usage", "num_requests_running", "num_requests_waiting",
          "num_preemptions", "prefix_cache_hit_rate", "num_scheduled_tokens",
          "prompt_tokens_total", "generation_tokens_total")


class MetricsHistory:
    """The last `maxlen` engine steps: time, KV usage, queue sizes, preemptions, hit rate, tokens.

    `time` is seconds since the history was created (time.monotonic clock); counters
    (num_preemptions, *_tokens_total) are cumulative, num_scheduled_tokens is per step.
    """

    def __init__(self, maxlen: int = DEFAULT_MAXLEN) -> None:
        if maxlen < 1:
            raise ValueError(f"MetricsHistory.maxlen must be >= 1, got {maxlen}")
        self.t0 = time.monotonic()
        self._points: deque[tuple] = deque(maxlen=maxlen)

    def record(self, scheduler: Scheduler, num_scheduled_tokens: int) -> None:
        """Append one point read from the scheduler after its step (O(1), read-only)."""
        kv = scheduler.kv_cache_manager
        self._points.append((
            scheduler.num_steps, time.monotonic() - self.t0, kv.usage, scheduler.num_running,
            scheduler.num_waiting, scheduler.num_preemptions, kv.stats.hit_rate,
            num_scheduled_tokens, scheduler.num_prompt_tokens, scheduler.num_generation_tokens))

    def snapshot(self) -> list[dict[str, Any]]:
        """The kept points, oldest first, as dicts keyed by FIELDS."""
        return [dict(zip(FIELDS, p, strict=True)) for p in self._points]

    def clear(self) -> None:
        """Forget every point (the clock keeps running)."""
        self._points.clear()

    def __len__(self) -> int:
        return len(self._points)
