"""KV cache events: what one engine's prefix cache holds, as a stream a router can index.

Schema and wire format follow vLLM's (`--kv-events-config`):

* `BlockStored`: full blocks that became cached in one tier, as a chain: their hashes in order,
  the hash of the block before the first (None: the first block of a sequence), the token ids
  of all of them (flat, `block_size` per block), the block size, the LoRA id (always None
  here) and the medium.
* `BlockRemoved`: cached blocks evicted or dropped from one tier.
* `AllBlocksCleared`: every tier's blocks are gone (`reset_prefix_cache`); blocks that survive
  a reset (disk files, host entries pinned by the running step) are stated again right after,
  as `BlockStored`, so a subscriber that clears everything on it stays exact.

Media: "GPU" is the device pool (vLLM's name for it, whatever the device), "CPU" the host-RAM
tier, "DISK" the disk tier. A block moving between tiers is stored in one and removed from the
other. Disk blocks found on disk at start-up (an earlier run's, or another replica's) are
stated with their hash only: their tokens are not in the files (token_ids empty, parent None).

A step's events form one `KVEventBatch` (timestamp, events, data-parallel rank). In-process,
`LLMEngine.subscribe_kv_events(fn)` calls `fn(batch)` in order at the end of every step that
produced events. Over ZMQ (publisher "zmq"), each batch is one multipart message
[topic, sequence number (8 bytes, big-endian), msgpack payload] on a PUB socket; sequence
numbers count from 0 without gaps, so a subscriber that misses one sees the gap and can ask the
replay socket (ROUTER, `replay_endpoint`) for every batch from a sequence number on: it sends
that number (8 bytes) and gets [b"", seq, payload] per buffered batch, then [b"", -1, b""].

Payload encoding (msgpack, vLLM's tagged arrays): a batch is [ts, [event, ...], dp_rank]; an
event is ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium],
["BlockRemoved", hashes, medium] or ["AllBlocksCleared"]. Hashes are bytes.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

logger = logging.getLogger("jpaged")

MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK = "GPU", "CPU", "DISK"
MEDIA = (MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK)
PUBLISHERS = ("null", "zmq")
END_OF_REPLAY = -1  # the replay's last message carries this sequence number


@dataclass(slots=True)
class BlockStored:
    """A chain of full blocks became cached in one tier."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]  # block_size per block, in order (empty where unknown: disk scan)
    block_size: int
    lora_id: int | None = None
    medium: str = MEDIUM_DEVICE
    # The KV cache group whose layers hold the blocks (0 unless the model is hybrid: its
    # full-attention layers are group 0, each sliding-window group has its own index).
    group: int = 0


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks left one tier (evicted, dropped, or their file went away)."""

    block_hashes: list[bytes]
    medium: str = MEDIUM_DEVICE
    group: int = 0


@dataclass(slots=True)
class AllBlocksCleared:
    """Every tier's cached blocks are gone (survivors are stated again right after)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """The events of one engine step, in order."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# A cached block is keyed by (hash, KV cache group). Group 0 (a model's full-attention layers,
# or every layer) keeps the bare hash; the host and disk tiers store another group's block under
# the hash plus GROUP_MARK and the group as 2 bytes: a length no hash algorithm here produces
# (sha256: 32 bytes, xxh3_128: 16), so a key tells its group unambiguously.
GROUP_MARK = b"#"
_HASH_LENGTHS = (16, 32)


def group_key(block_hash: bytes, group: int) -> bytes:
    """The tier key of `group`'s block with this hash (the hash itself for group 0)."""
    return block_hash if group == 0 else block_hash + GROUP_MARK + group.to_bytes(2, "big")


def split_group_key(key: bytes) -> tuple[bytes, int]:
    """(hash, group) of a tier key made by `group_key`."""
    if len(key) - 3 in _HASH_LENGTHS and key[-3:-2] == GROUP_MARK:
        return key[:-3], int.from_bytes(key[-2:], "big")
    return key, 0


# ------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config`: whether and where the engine publishes KV cache events."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "null": in-process subscribers only; "zmq": also a PUB socket
    endpoint: str = "tcp://*:5557"  # the PUB socket binds here
    replay_endpoint: str | None = None  # a ROUTER socket for replays binds here (None: none)
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ send high-water mark (messages)
    max_queue_size: int = 100_000  # batches waiting for the sender thread; more are dropped
    topic: str = ""

    def __post_init__(self) -> None:
        c = "kv_events_config"  # the flag's name: errors name the field as kv_events_config.x
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"{c}.enable_kv_cache_events must be true or false, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"{c}.publisher must be one of {PUBLISHERS}, got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{c}.{name} must be a string, got {getattr(self, name)!r}")
        if self.publisher == "zmq" and "://" not in self.endpoint:
            raise ValueError(f"{c}.endpoint must be a ZMQ address such as tcp://*:5557, "
                             f"got {self.endpoint!r}")
        if self.replay_endpoint is not None and (not isinstance(self.replay_endpoint, str)
                                                 or "://" not in self.replay_endpoint):
            raise ValueError(f"{c}.replay_endpoint must be a ZMQ address or null, "
                             f"got {self.replay_endpoint!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{c}.{name} must be an integer >= 1, got {v!r}")

    @classmethod
    def parse(cls, value: KVEventsConfig | Mapping[str, Any] | str | None
              ) -> KVEventsConfig | None:
        """From a KVEventsConfig, a dict, or its JSON text (the CLI flag); None stays None."""
        return parse_json_config(cls, value, "kv_events_config")


def parse_json_config(cls: Any, value: Any, flag: str) -> Any:
    """A config dataclass `cls` from an instance, a dict or its JSON text (a CLI flag's value),
    unknown fields refused by name (`flag` names them in errors); None stays None."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON ({e}): {value!r}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{flag} must be a JSON object (or dict), got {type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{flag} has unknown field(s) {unknown}; known: {sorted(known)}")
    return cls(**value)


# ------------------------------------------------------------------------------- encoding
def _encode_event(e: KVEvent) -> list[Any]:
    if isinstance(e, BlockStored):
        return ["BlockStored", e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size,
                e.lora_id, e.medium, e.group]
    if isinstance(e, BlockRemoved):
        return ["BlockRemoved", e.block_hashes, e.medium, e.group]
    return ["AllBlocksCleared"]


def _decode_event(a: Sequence[Any]) -> KVEvent:
    tag = a[0]
    if tag == "BlockStored":
        return BlockStored(list(a[1]), a[2], list(a[3]), a[4], a[5], a[6],
                           a[7] if len(a) > 7 else 0)
    if tag == "BlockRemoved":
        return BlockRemoved(list(a[1]), a[2], a[3] if len(a) > 3 else 0)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event tag {tag!r}")


def encode_batch(batch: KVEventBatch) -> bytes:
    """msgpack bytes of a batch (vLLM's tagged-array layout)."""
    import msgpack

    return msgpack.packb([batch.ts, [_encode_event(e) for e in batch.events],
                          batch.data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> KVEventBatch:
    """The batch `encode_batch` made."""
    import msgpack

    ts, events, rank = msgpack.unpackb(payload, raw=False)
    return KVEventBatch(ts, [_decode_event(e) for e in events], rank)


# ------------------------------------------------------------------------------- state
@dataclass
class CacheIndex:
    """Which block hashes each tier holds, rebuilt from events alone (what a router keeps).

    Only group 0 is indexed: a hybrid model's prefix hit needs its full-attention group's
    blocks (group 0) to reach a length, so those bound what a replica can serve.
    """

    blocks: dict[str, set[bytes]] = field(default_factory=lambda: {m: set() for m in MEDIA})

    def apply(self, event: KVEvent) -> None:
        """Apply one event."""
        if not isinstance(event, AllBlocksCleared) and event.group != 0:
            return
        if isinstance(event, BlockStored):
            self.blocks.setdefault(event.medium, set()).update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self.blocks.setdefault(event.medium, set()).difference_update(event.block_hashes)
        else:
            for s in self.blocks.values():
                s.clear()

    def apply_batch(self, batch: KVEventBatch) -> None:
        """Apply a batch's events in order."""
        for e in batch.events:
            self.apply(e)


class KVEventCollector:
    """Where the pool and the tiers report changes; the engine takes a batch per step.

    It also remembers each cached hash's parent and tokens while some tier holds it, so a block
    moving to the host or disk tier is stated with them too. Thread-safe (the disk tier may be
    used from another thread).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] = []
        self._lock = threading.Lock()
        # hash -> (parent, tokens of its block) while any tier holds it; tiers per hash. Only
        # group 0's blocks move to lower tiers, so other groups' are not remembered.
        self._meta: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}
        self._where: dict[bytes, set[str]] = {}

    def stored_chain(self, hashes: Sequence[bytes], parent: bytes | None,
                     token_ids: Sequence[int], medium: str = MEDIUM_DEVICE,
                     group: int = 0, lora_id: int | None = None) -> None:
        """Consecutive blocks of one sequence became cached (tokens: all of them, flat;
        `lora_id`: its LoRA adapter's lora_int_id, None for the base model)."""
        if not hashes:
            return
        bs = self.block_size
        with self._lock:
            prev = parent
            for i, h in enumerate(hashes):
                if group == 0:
                    self._meta[h] = (prev, tuple(token_ids[i * bs:(i + 1) * bs]))
                    self._where.setdefault(h, set()).add(medium)
                prev = h
            self._events.append(BlockStored(list(hashes), parent, list(token_ids), bs,
                                            lora_id, medium, group))

    def stored(self, hashes: Iterable[bytes], medium: str) -> None:
        """Blocks became cached in a lower tier: each stated with what is known of it (tier
        keys of groups other than 0 are stated as their hash and group)."""
        bs = self.block_size
        with self._lock:
            for h in hashes:
                base, group = split_group_key(h)
                if group:
                    self._events.append(BlockStored([base], None, [], bs, None, medium, group))
                    continue
                parent, tokens = self._meta.get(h, (None, ()))
                self._where.setdefault(h, set()).add(medium)
                self._events.append(BlockStored([h], parent, list(tokens), bs, None, medium))

    def removed(self, hashes: Iterable[bytes], medium: str, group: int = 0) -> None:
        """Blocks left one tier (of `group`'s layers)."""
        hashes = list(hashes)
        if not hashes:
            return
        with self._lock:
            if group:
                self._events.append(BlockRemoved(hashes, medium, group))
                return
            keyed = [split_group_key(h) for h in hashes]
            if any(g for _, g in keyed):  # tier keys of other groups: one event per group
                for g in sorted({g for _, g in keyed} - {0}):
                    self._events.append(BlockRemoved([b for b, x in keyed if x == g], medium, g))
                hashes = [b for b, x in keyed if x == 0]
                if not hashes:
                    return
            for h in hashes:
                where = self._where.get(h)
                if where is not None:
                    where.discard(medium)
                    if not where:
                        del self._where[h]
                        self._meta.pop(h, None)
            self._events.append(BlockRemoved(hashes, medium))

    def cleared(self, survivors: Mapping[str, Iterable[bytes]]) -> None:
        """Every tier was cleared except `survivors` (medium -> hashes), stated again."""
        survivors = {m: list(hs) for m, hs in survivors.items()}
        with self._lock:
            keep = {h for hs in survivors.values() for h in hs}
            self._meta = {h: m for h, m in self._meta.items() if h in keep}
            self._where = {}
            self._events.append(AllBlocksCleared())
        for medium, hashes in survivors.items():
            self.stored(hashes, medium)

    def take(self) -> list[KVEvent]:
        """The events since the previous take, in order."""
        with self._lock:
            events, self._events = self._events, []
        return events


# ------------------------------------------------------------------------------- publishers
class ZmqEventPublisher:
    """Sends batches on a ZMQ PUB socket from a thread of its own, keeping some for replay."""

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        self.config = config
        self._topic = config.topic.encode()
        # (seq, batch); None stops the thread. A batch's seq is taken when it is published, so
        # one dropped from a full queue leaves a gap subscribers see.
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(
            config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self.num_dropped = 0  # batches dropped because the queue was full
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router = None
        try:
            self._pub.bind(config.endpoint)
            if config.replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot bind {config.endpoint!r} / "
                             f"{config.replay_endpoint!r}: {e}") from None
        # The endpoints as bound (a port of 0 or * becomes the real one).
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (self._router.getsockopt_string(zmq.LAST_ENDPOINT)
                                if self._router is not None else None)
        self._thread = threading.Thread(target=self._run, name="jpaged-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Queue a batch for sending (never blocks the engine; a full queue drops it)."""
        seq = self._seq
        self._seq += 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped += 1
            logger.warning("kv events: send queue full, batch dropped (subscribers see a gap)")

    def _run(self) -> None:
        import zmq

        while True:
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                item = ...
            if item is None:
                return
            if item is not ...:
                seq, batch = item
                payload = encode_batch(batch)
                self._buffer.append((seq, payload))
                try:
                    self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload],
                                             flags=zmq.NOBLOCK)
                except zmq.Again:  # past the high-water mark: subscribers see the gap
                    pass
            if self._router is not None:
                self._serve_replays(zmq)

    def _serve_replays(self, zmq: Any) -> None:
        while self._router.poll(0):
            frames = self._router.recv_multipart()
            ident, start = frames[0], int.from_bytes(frames[-1][:8], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            self._router.send_multipart(
                [ident, b"", END_OF_REPLAY.to_bytes(8, "big", signed=True), b""])

    def _close_sockets(self) -> None:
        for s in (self._pub, self._router):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        self._close_sockets()


class KVEventHub:
    """One engine's event stream: the collector, in-process subscribers, and a publisher."""

    def __init__(self, config: KVEventsConfig, block_size: int,
                 data_parallel_rank: int | None = None) -> None:
        self.config = config
        self.collector = KVEventCollector(block_size)
        self.data_parallel_rank = data_parallel_rank
        self._subscribers: list[Callable[[KVEventBatch], None]] = []
        self.publisher = ZmqEventPublisher(config) if config.publisher == "zmq" else None

    def subscribe(self, fn: Callable[[KVEventBatch], None]) -> Callable[[], None]:
        """Call fn(batch) for every batch from now on; returns the unsubscribe function."""
        self._subscribers.append(fn)

        def unsubscribe() -> None:
            if fn in self._subscribers:
                self._subscribers.remove(fn)

        return unsubscribe

    def flush(self) -> KVEventBatch | None:
        """Hand the events gathered since the last flush to every subscriber, as one batch."""
        events = self.collector.take()
        if not events:
            return None
        batch = KVEventBatch(time.time(), events, self.data_parallel_rank)
        for fn in list(self._subscribers):
            try:
                fn(batch)
            except Exception:  # a subscriber's bug must not stop the engine or the others
                logger.exception("kv events: subscriber %r failed; it stays subscribed", fn)
        if self.publisher is not None:
            self.publisher.publish(batch)
        return batch

    def close(self) -> None:
        """Flush and stop the publisher."""
        self.flush()
        if self.publisher is not None:
            self.publisher.close()
