"""The waiting queue: requests ordered by policy, preempted ones at the front of their class."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from jpaged.request import Request

# (class, tier, t, seq): class = priority ("fcfs": 0); tier 0 = preempted (t = -k for the k-th
# preemption pushed, so the most recently requeued is first), tier 1 = new (t = arrival_time).
QueueKey = tuple[int, int, float, int]


class WaitingQueue:
    """Min-heap of waiting requests with lazy deletion; O(log n) push/pop, O(1) remove."""

    def __init__(self, policy: str = "priority") -> None:
        self.policy = policy
        self._heap: list[tuple[QueueKey, int, Request]] = []
        self._live: dict[str, int] = {}  # request_id -> token of its live heap entry
        self._tokens = itertools.count()
        self._front = itertools.count(1)

    def _class(self, request: Request) -> int:
        return 0 if self.policy == "fcfs" else request.priority

    def key_new(self, request: Request) -> QueueKey:
        """Key of a newly arrived request: by class, then arrival."""
        return (self._class(request), 1, request.arrival_time, request.seq)

    def key_front(self, request: Request) -> QueueKey:
        """Key placing a preempted request at the front of its class."""
        return (self._class(request), 0, float(-next(self._front)), request.seq)

    def push(self, request: Request, key: QueueKey | None = None) -> None:
        """Add a request (default key: a new arrival); replaces any entry it already has."""
        token = next(self._tokens)
        self._live[request.request_id] = token
        heapq.heappush(self._heap, (key or self.key_new(request), token, request))

    def push_front(self, request: Request) -> None:
        """Add a preempted request ahead of every other request of its class."""
        self.push(request, self.key_front(request))

    def _is_live(self, entry: tuple[QueueKey, int, Request]) -> bool:
        """Whether a heap entry is its request's current one (not removed, not re-pushed)."""
        return self._live.get(entry[2].request_id) == entry[1]

    def _prune(self) -> None:
        heap = self._heap
        while heap and not self._is_live(heap[0]):
            heapq.heappop(heap)

    def pop(self) -> tuple[QueueKey, Request] | None:
        """Remove the first request; returns (its key, it) so it can be pushed back unchanged."""
        self._prune()
        if not self._heap:
            return None
        key, _, request = heapq.heappop(self._heap)
        del self._live[request.request_id]
        return key, request

    def peek(self) -> Request | None:
        """The first request, left in place."""
        self._prune()
        return self._heap[0][2] if self._heap else None

    def first_n(self, k: int) -> list[Request]:
        """The first k requests in order, left in place (O(k log k) plus stale entries met)."""
        heap, out = self._heap, []
        # Best-first walk of the heap tree: a node is only reached after its parent, and every
        # entry is <= its children, so entries leave the frontier in sorted order.
        frontier = [(heap[0], 0)] if heap else []
        while frontier and len(out) < k:
            entry, i = heapq.heappop(frontier)
            if self._is_live(entry):
                out.append(entry[2])
            for c in (2 * i + 1, 2 * i + 2):
                if c < len(heap):
                    heapq.heappush(frontier, (heap[c], c))
        return out

    def remove(self, request_id: str) -> bool:
        """Drop a request (lazily, amortised O(1)); False if it was not waiting."""
        if self._live.pop(request_id, None) is None:
            return False
        if len(self._heap) > 2 * len(self._live) + 64:  # bound the stale entries
            self._heap = [e for e in self._heap if self._is_live(e)]
            heapq.heapify(self._heap)
        return True

    def drain(self) -> list[tuple[QueueKey, Request]]:
        """Remove and return every request in order."""
        out = []
        while (item := self.pop()) is not None:
            out.append(item)
        return out

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def __iter__(self) -> Iterator[Request]:
        """Requests in order (O(n log n); for inspection)."""
        return iter(self.first_n(len(self)))
