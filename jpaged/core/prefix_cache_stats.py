"""Prefix-cache counters of the KV cache manager, in tokens.

Counted once per admission (the first ``allocate_slots`` of a request with no blocks), not per
``get_computed_blocks`` call, so a request that has to wait is not counted twice. Re-admissions
after preemption are counted apart (``preempted_*``) so that the hit rate reflects sharing
between requests, not a request finding its own freed blocks.
"""

from __future__ import annotations

from collections import deque

RECENT_WINDOW = 1000  # requests in the "recent" hit rate


class PrefixCacheStats:
    """Prefix-cache counters in tokens; `recent` covers the last RECENT_WINDOW admissions."""

    def __init__(self) -> None:
        self.queries = 0  # prompt tokens of first admissions
        self.hits = 0  # of which found in the cache
        self.requests = 0  # first admissions looked up (cache_access_total)
        self.preempted_queries = 0  # tokens looked up again after a preemption
        self.preempted_hits = 0
        self._recent: deque[tuple[int, int]] = deque()
        self._recent_q = 0
        self._recent_h = 0

    def record(self, queries: int, hits: int, preempted: bool) -> None:
        """Count one lookup of `queries` tokens of which `hits` were cached."""
        if preempted:
            self.preempted_queries += queries
            self.preempted_hits += hits
            return
        self.queries += queries
        self.hits += hits
        self.requests += 1
        self._recent.append((queries, hits))
        self._recent_q += queries
        self._recent_h += hits
        if len(self._recent) > RECENT_WINDOW:
            q, h = self._recent.popleft()
            self._recent_q -= q
            self._recent_h -= h

    def reset_recent(self) -> None:
        """Forget the recent window (the prefix cache was reset); the totals stay."""
        self._recent.clear()
        self._recent_q = self._recent_h = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries over all first admissions (0 when none)."""
        return self.hits / self.queries if self.queries else 0.0

    @property
    def recent_hit_rate(self) -> float:
        """hits / queries over the last RECENT_WINDOW first admissions."""
        return self._recent_h / self._recent_q if self._recent_q else 0.0
