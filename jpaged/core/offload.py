"""KV tiers below the device pool: host RAM (this file) and disk (``disk_tier.py``), plus the
per-step transfer plan that the scheduler fills and the runner executes.

Host tier: ``capacity`` slots of a preallocated store ``[capacity, *block_shape]`` (one block
across all layers, K and V). A slot is in exactly one state: free, a prefix-cache entry (keyed
by block hash, LRU), part of a swap entry (keyed by request id: a preempted request's table,
partial last block included), or released-this-step (freed at the next ``begin_step``).

Flows:

* device eviction of a cached block -> host entry (a *gather* device->host), unless the hash is
  already on the host; the host tier's own LRU victims spill to the disk tier, if any.
* a prefix lookup that misses on the device continues the hash chain on the host, then on disk
  (disk data is read, verified by ``DiskTier.get`` and copied into a host slot); each hit gets a
  fresh device block and a *load* host->device. Host entries stay after a load (inclusive).
* swap-out: the victim's computed blocks are gathered into swap slots; swap-in loads them back.

Ordering rules (the runner executes a plan in this order, BEFORE the step's forward):

1. every gather of the step, all reading the device pool as the previous step left it;
2. every load (one scatter), so a block evicted and re-filled in the same step is read first;
3. the forward pass.

Host<->disk moves touch host memory only and are done at once, at schedule time. To keep them
and the deferred device moves consistent, every slot a step's plan touches (gather target or
load source) is *pinned* until the next ``begin_step``: a pinned slot is never evicted, spilled
or reused, and a slot released while pinned is freed only at the next ``begin_step``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from jpaged.core.block_hash import BlockHash

if TYPE_CHECKING:
    from jpaged.kv_events import KVEventCollector

logger = logging.getLogger("jpaged")


class DiskStore(Protocol):
    """What the host tier needs of the disk tier (``jpaged.core.disk_tier.DiskTier``)."""

    def __contains__(self, block_hash: object) -> bool: ...
    def __len__(self) -> int: ...
    def hashes(self) -> list[bytes]: ...
    def attach_events(self, events: KVEventCollector) -> None: ...
    def put(self, block_hash: bytes, data: np.ndarray) -> bool: ...
    def get(self, block_hash: bytes) -> np.ndarray | None: ...
    @property
    def usage(self) -> float: ...
    @property
    def stats(self) -> dict[str, int]: ...


@dataclass
class TransferPlan:
    """Device moves of one step; run all gathers, then all loads, then the forward."""

    gathers: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    load_targets: set[int] = field(default_factory=set)  # device blocks of `loads`
    num_spilled: int = 0  # host -> disk writes done at schedule time
    num_disk_loaded: int = 0  # disk -> host reads done at schedule time

    @property
    def is_empty(self) -> bool:
        """True when the runner has nothing to move."""
        return not self.gathers and not self.loads


@dataclass
class SwapEntry:
    """A preempted request's KV on the host: one slot per block, and its computed tokens."""

    slots: list[int]  # [cdiv(num_tokens, block_size)] in table order
    num_tokens: int


class HostTier:
    """The host-RAM store: LRU prefix entries by block hash, swap entries by request id, pins."""

    def __init__(self, capacity: int, block_shape: tuple[int, ...], dtype: np.dtype,
                 disk: DiskStore | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"HostTier.capacity must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self.block_shape = tuple(block_shape)
        self.dtype = np.dtype(dtype)
        # The slot store is numpy (random access by slot); transfers to and from the device are
        # staged through jax's pinned_host memory where the device has it (runner/tier_transfer).
        self.store = np.empty((capacity, *self.block_shape), self.dtype)
        self.disk = disk
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # pop() gives slot 0 first
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()  # first = least recently used
        self._swap: dict[str, SwapEntry] = {}
        self._pinned: set[int] = set()
        self._released: list[int] = []  # freed while pinned: free at the next begin_step
        self.num_spilled = 0
        self.events: KVEventCollector | None = None  # prefix entries in and out ("CPU")

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one slot."""
        return int(np.prod(self.block_shape)) * self.dtype.itemsize

    # -- step boundaries -------------------------------------------------------------------------

    def begin_step(self) -> None:
        """The previous plan has run: unpin every slot and free the released ones."""
        self._pinned.clear()
        self._free.extend(self._released)
        self._released.clear()

    def pin(self, slot: int) -> None:
        """Protect a slot the current plan touches until the next begin_step."""
        self._pinned.add(slot)

    # -- slots -----------------------------------------------------------------------------------

    def num_available(self) -> int:
        """Slots alloc_slot could hand out now (free + unpinned prefix entries)."""
        pinned = self._pinned
        return len(self._free) + sum(1 for s in self._lru.values() if s not in pinned)

    def alloc_slot(self) -> int | None:
        """A free slot, evicting (and spilling) the LRU unpinned prefix entry if needed."""
        if self._free:
            return self._free.pop()
        for h, slot in self._lru.items():
            if slot not in self._pinned:
                del self._lru[h]
                self._spill(h, slot)
                if self.events is not None:  # after the spill: the disk has stated it first
                    self.events.removed([h], "CPU")
                return slot
        return None

    def _spill(self, block_hash: BlockHash, slot: int) -> None:
        # The slot is unpinned, so its content is final (no gather of this step targets it).
        if self.disk is not None and block_hash not in self.disk:
            if self.disk.put(block_hash, self.store[slot]):
                self.num_spilled += 1

    def release(self, slot: int) -> None:
        """Return a slot no entry owns any more (deferred while pinned)."""
        (self._released if slot in self._pinned else self._free).append(slot)

    # -- prefix entries --------------------------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding this hash (refreshing its LRU position), or None."""
        slot = self._lru.get(block_hash)
        if slot is not None:
            self._lru.move_to_end(block_hash)
        return slot

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._lru

    def insert(self, block_hash: BlockHash, slot: int) -> None:
        """Register a slot (most recently used) as holding this hash."""
        if block_hash in self._lru:
            raise ValueError("HostTier.insert: hash already present")
        self._lru[block_hash] = slot
        if self.events is not None:
            self.events.stored([block_hash], "CPU")

    def prefix_hashes(self) -> list[BlockHash]:
        """The hashes of the prefix entries, least recently used first."""
        return list(self._lru)

    def clear_prefix_entries(self) -> None:
        """Drop every unpinned prefix entry (no spill)."""
        dropped = []
        for h, slot in list(self._lru.items()):
            if slot not in self._pinned:
                del self._lru[h]
                self._free.append(slot)
                dropped.append(h)
        if self.events is not None:
            self.events.removed(dropped, "CPU")

    # -- swap entries ----------------------------------------------------------------------------

    def put_swap(self, request_id: str, entry: SwapEntry) -> None:
        """Record a swapped-out request."""
        if request_id in self._swap:
            raise ValueError(f"request {request_id!r} is already swapped out")
        self._swap[request_id] = entry

    def get_swap(self, request_id: str) -> SwapEntry | None:
        """The swap entry of a request, if any."""
        return self._swap.get(request_id)

    def pop_swap(self, request_id: str) -> SwapEntry | None:
        """Remove and return a request's swap entry (its slots stay owned by the caller)."""
        return self._swap.pop(request_id, None)

    # -- accounting ------------------------------------------------------------------------------

    @property
    def num_used(self) -> int:
        """Slots not free (entries plus slots released this step)."""
        return self.capacity - len(self._free)

    @property
    def num_prefix_entries(self) -> int:
        """Prefix-cache blocks on the host."""
        return len(self._lru)

    @property
    def num_swapped_requests(self) -> int:
        """Requests with a swap entry."""
        return len(self._swap)

    def check_invariants(self) -> None:
        """Every slot is in exactly one state; pins only on owned or released slots."""
        owners: list[int] = list(self._free) + list(self._released) + list(self._lru.values())
        for e in self._swap.values():
            owners.extend(e.slots)
        if sorted(owners) != list(range(self.capacity)):
            raise AssertionError("host tier slots are lost or owned twice")
        if set(self._free) & self._pinned:
            raise AssertionError("a free host slot is pinned")


class KVTiers:
    """The host tier (+ optional disk) and the current step's TransferPlan, with metrics."""

    def __init__(self, host: HostTier) -> None:
        self.host = host
        self.plan = TransferPlan()
        self.stats = dict.fromkeys(
            ("offload_hits_blocks", "offload_hits_tokens", "offload_bytes_to_host",
             "offload_bytes_to_device", "num_swapped_out", "num_swapped_in",
             "num_swap_fallbacks", "offload_dropped", "disk_hits_blocks"), 0)

    @property
    def disk(self) -> DiskStore | None:
        """The disk tier behind the host tier, if any."""
        return self.host.disk

    def attach_disk(self, disk: DiskStore) -> None:
        """Add the disk tier (lazily, e.g. once fp8 scales are known)."""
        self.host.disk = disk
        if self.host.events is not None:
            disk.attach_events(self.host.events)

    def set_events(self, events: KVEventCollector) -> None:
        """Report the host and disk tiers' prefix entries to `events`; state the current ones."""
        self.host.events = events
        events.stored(self.host.prefix_hashes(), "CPU")
        if self.host.disk is not None:
            self.host.disk.attach_events(events)

    def begin_step(self) -> None:
        """Start a new plan; the previous one has been executed."""
        self.host.begin_step()
        self.plan = TransferPlan()

    def take_plan(self) -> TransferPlan:
        """The plan filled since begin_step (the runner executes it before the forward)."""
        plan = self.plan
        plan.num_spilled, self.host.num_spilled = self.host.num_spilled, 0
        return plan

    # -- moves -----------------------------------------------------------------------------------

    def _gather(self, block_id: int, slot: int) -> None:
        self.host.pin(slot)
        self.plan.gathers.append((block_id, slot))
        self.stats["offload_bytes_to_host"] += self.host.bytes_per_block

    def plan_load(self, slot: int, block_id: int) -> None:
        """Copy a (pinned) host slot into a device block before this step's forward."""
        self.host.pin(slot)
        self.plan.loads.append((slot, block_id))
        self.plan.load_targets.add(block_id)
        self.stats["offload_bytes_to_device"] += self.host.bytes_per_block

    def on_device_evict(self, block_id: int, block_hash: BlockHash) -> None:
        """A cached device block is being reused: keep its content on the host tier."""
        host = self.host
        if host.lookup(block_hash) is not None:
            # Already there (this covers a block loaded this step: its source entry is pinned).
            return
        if block_id in self.plan.load_targets:
            return  # its content arrives later in this step; nothing valid to gather yet
        slot = host.alloc_slot()
        if slot is None:
            self.stats["offload_dropped"] += 1  # every slot pinned or swapped: lose it
            return
        host.insert(block_hash, slot)
        self._gather(block_id, slot)

    def fetch_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Host slots holding the longest prefix of `hashes` (host, then verified disk); pinned.

        Disk hits are copied into host slots at once. Slots are pinned for this step, so the
        loads planned from them read what they hold now.
        """
        out: list[int] = []
        for h in hashes:
            slot = self.fetch(h)
            if slot is None:
                break
            out.append(slot)
        return out

    def has(self, key: BlockHash) -> bool:
        """True if the host or the disk tier holds this key (no side effect)."""
        disk = self.host.disk
        return key in self.host or (disk is not None and key in disk)

    def fetch(self, key: BlockHash) -> int | None:
        """The host slot holding `key` (from the host, else a verified disk copy); pinned."""
        host, disk = self.host, self.host.disk
        slot = host.lookup(key)
        if slot is None and disk is not None and key in disk:
            data = disk.get(key)  # verified; None for a corrupt/foreign file (a miss)
            if data is None:
                return None
            slot = host.alloc_slot()
            if slot is None:
                return None
            host.store[slot] = data
            host.insert(key, slot)
            self.stats["disk_hits_blocks"] += 1
            self.plan.num_disk_loaded += 1
        if slot is not None:
            host.pin(slot)
        return slot

    def record_hits(self, num_blocks: int, num_tokens: int) -> None:
        """Count a prefix hit the host/disk tiers served: `num_blocks` block copies loaded
        (every group's), covering `num_tokens` prompt tokens."""
        self.stats["offload_hits_blocks"] += num_blocks
        self.stats["offload_hits_tokens"] += num_tokens

    def swap_out(self, request_id: str, block_ids: Sequence[int], num_tokens: int) -> bool:
        """Gather a victim's computed blocks into swap slots; False (nothing done) if full."""
        host = self.host
        # Blocks loaded this step hold nothing valid until the step's loads run.
        if any(b in self.plan.load_targets for b in block_ids) or \
                host.num_available() < len(block_ids):
            self.stats["num_swap_fallbacks"] += 1
            return False
        slots = []
        for b in block_ids:
            slot = host.alloc_slot()
            assert slot is not None  # num_available counted it
            slots.append(slot)
            self._gather(b, slot)
        host.put_swap(request_id, SwapEntry(slots, num_tokens))
        self.stats["num_swapped_out"] += 1
        return True

    def swapped_tokens(self, request_id: str) -> int | None:
        """Computed tokens held by a request's swap entry (None: not swapped out)."""
        e = self.host.get_swap(request_id)
        return e.num_tokens if e is not None else None

    def swap_in(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Load a swap entry into the given device blocks (table order) and drop the entry."""
        e = self.host.pop_swap(request_id)
        if e is None or len(e.slots) != len(block_ids):
            raise ValueError(f"request {request_id!r}: no swap entry of {len(block_ids)} blocks")
        for slot, b in zip(e.slots, block_ids, strict=True):
            self.plan_load(slot, b)
            self.host.release(slot)  # pinned now: freed after this step's loads
        self.stats["num_swapped_in"] += 1

    def drop_swap(self, request_id: str) -> None:
        """Forget a request's swap entry (finished or aborted while swapped out)."""
        e = self.host.pop_swap(request_id)
        if e is not None:
            for slot in e.slots:
                self.host.release(slot)

    # -- metrics ---------------------------------------------------------------------------------

    def get_stats(self) -> dict[str, float | int]:
        """Tier counters and gauges (names of issue 6)."""
        host, disk = self.host, self.host.disk
        d = disk.stats if disk is not None else {}
        return {
            **self.stats,
            "host_tier_blocks": host.num_prefix_entries + sum(
                len(e.slots) for e in host._swap.values()),
            "host_tier_usage": host.num_used / host.capacity,
            "num_swapped_requests": host.num_swapped_requests,
            "disk_tier_blocks": len(disk) if disk is not None else 0,
            "disk_tier_usage": disk.usage if disk is not None else 0.0,
            "disk_bytes_written": d.get("bytes_written", 0),
            "disk_bytes_read": d.get("bytes_read", 0),
            "disk_corrupt_skipped": d.get("corrupt_skipped", 0),
        }

    def check_invariants(self) -> None:
        """Host invariants plus: every slot the plan touches is pinned."""
        self.host.check_invariants()
        touched = {s for _, s in self.plan.gathers} | {s for s, _ in self.plan.loads}
        if not touched <= self.host._pinned:
            raise AssertionError("a host slot used by this step's plan is not pinned")


# Zeros for every tier metric, so get_stats has the same keys with the tiers off.
TIER_STAT_KEYS = (
    "offload_hits_blocks", "offload_hits_tokens", "offload_bytes_to_host",
    "offload_bytes_to_device", "num_swapped_out", "num_swapped_in", "num_swap_fallbacks",
    "offload_dropped", "disk_hits_blocks", "host_tier_blocks", "host_tier_usage",
    "num_swapped_requests", "disk_tier_blocks", "disk_tier_usage", "disk_bytes_written",
    "disk_bytes_read", "disk_corrupt_skipped")


def empty_tier_stats() -> dict[str, float | int]:
    """The tier metrics of an engine without tiers (all zero)."""
    return dict.fromkeys(TIER_STAT_KEYS, 0)
