"""Following the replicas' KV cache events into the router's prefix index (one thread): a ZMQ
SUB socket per replica, and any gap in a replica's sequence replayed from its replay socket."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from jpaged.dp.router import Router
from jpaged.kv_events import END_OF_REPLAY, decode_batch

logger = logging.getLogger("jpaged.dp")

REPLAY_TIMEOUT_MS = 5000


class KVEventReader:
    """Reads every followed replica's KV events into the router's index (one thread)."""

    def __init__(self, router: Router, router_lock: threading.Lock) -> None:
        import zmq

        self.router, self.router_lock = router, router_lock  # the lock guards the router
        self.ctx = zmq.Context()
        self._lock = threading.Lock()
        self._subs: dict[int, Any] = {}  # replica -> SUB socket
        self._replay: dict[int, str] = {}
        self._next: dict[int, int] = {}  # replica -> next expected sequence number
        # (replica, "drop" or None, events endpoint, replay endpoint): changes for the thread
        self._pending: list[tuple[int, str | None, str, str]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="jpaged-dp-events",
                                        daemon=True)
        self._thread.start()

    def follow(self, replica: int, info: Mapping[str, Any]) -> None:
        """Start reading a replica's events from their beginning."""
        if info.get("events_endpoint") is None:
            return
        with self._lock:
            self._pending.append((replica, None, info["events_endpoint"],
                                  info["replay_endpoint"]))

    def unfollow(self, replica: int) -> None:
        """Stop reading a replica (it is down); its index entries are dropped by the caller."""
        with self._lock:
            self._pending.append((replica, "drop", "", ""))

    def close(self) -> None:
        """Stop the thread and close the sockets."""
        self._closed = True
        self._thread.join(5.0)
        for s in self._subs.values():
            s.close(0)
        self.ctx.term()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        while not self._closed:
            with self._lock:
                pending, self._pending = self._pending, []
            for r, what, endpoint, replay in pending:
                old = self._subs.pop(r, None)
                if old is not None:
                    poller.unregister(old)
                    old.close(0)
                self._next.pop(r, None)
                if what == "drop":
                    continue
                sub = self.ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(endpoint)
                self._subs[r], self._replay[r] = sub, replay
                poller.register(sub, zmq.POLLIN)
                self._catch_up(r, 0)
            try:
                ready = dict(poller.poll(50))
            except zmq.ZMQError:
                continue
            for r, sub in list(self._subs.items()):
                if sub not in ready:
                    continue
                while True:
                    try:
                        _, seq_b, payload = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    seq = int.from_bytes(seq_b, "big")
                    expected = self._next.get(r, 0)
                    if seq < expected:
                        continue  # already applied (from a replay)
                    if seq > expected:  # a gap: fetch what was missed first
                        self._catch_up(r, expected)
                        if seq < self._next.get(r, 0):
                            continue
                    self._apply(r, seq, payload)

    def _apply(self, replica: int, seq: int, payload: bytes) -> None:
        batch = decode_batch(payload)
        with self.router_lock:
            for e in batch.events:
                self.router.index.apply(replica, e)
        self._next[replica] = seq + 1

    def _catch_up(self, replica: int, start: int) -> None:
        """Replay a replica's batches from `start` (its replay socket) and apply them."""
        import zmq

        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, REPLAY_TIMEOUT_MS)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self._replay[replica])
            dealer.send(start.to_bytes(8, "big"))
            self._next.setdefault(replica, start)
            while True:
                _, seq_b, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == END_OF_REPLAY:
                    break
                if seq > self._next[replica]:  # older than the replay buffer keeps
                    logger.warning("replica %d: KV events %d..%d are gone; its index entries "
                                   "may be incomplete", replica, self._next[replica], seq - 1)
                if seq >= self._next[replica]:
                    self._apply(replica, seq, payload)
        except zmq.Again:
            logger.warning("replica %d: no answer from its KV event replay socket", replica)
        finally:
            dealer.close(0)
