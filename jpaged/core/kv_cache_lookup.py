"""Prefix hits over KV cache groups: the longest hit every group's policy accepts, on the device
(``device_hit``) or continued on the host/disk tiers (``tier_hit``); vLLM's coordinator lookup.

A hit of m blocks gives each group a row of m positions: the null block before the group's
``first_held(m * block_size)`` (a window needs nothing older), then the block of each position's
hash in that group's prefix map, or, for a tier hit, a pinned host slot holding
``group_key(hash, group)``. With one full-attention group this is the classic chain: the cached
blocks from the left, continued on the host, then on disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jpaged.core.block_hash import BlockHash
from jpaged.core.block_pool import BlockPool, KVCacheBlock
from jpaged.core.kv_cache_policies import BlockPolicy, longest_common_hit
from jpaged.core.offload import KVTiers
from jpaged.kv_events import group_key, split_group_key


@dataclass
class TierHit:
    """A prefix hit continued on the host/disk tiers: for each group, each position's source
    (a cached device block, a pinned host slot to load, or the null block behind a window)."""

    num_blocks: int  # the whole hit, device blocks included
    extra_blocks: int  # blocks beyond the device hit: what the tiers added to it
    entries: list[list[KVCacheBlock | int]]  # per group, num_blocks positions


def device_hit(policies: Sequence[BlockPolicy], pool: BlockPool, hashes: Sequence[BlockHash],
               top: int) -> tuple[list[list[KVCacheBlock]], int]:
    """Per group, the blocks of the longest hit <= top blocks every group holds on the device,
    and its length in blocks."""
    maps = pool.group_maps
    n = longest_common_hit(policies, hashes, maps, top)
    null, bs = pool.null_block, policies[0].block_size
    rows: list[list[KVCacheBlock]] = []
    for p, m in zip(policies, maps, strict=True):
        first = p.first_held(n * bs)
        rows.append([null] * first + [m[h] for h in hashes[first:n]])
    return rows, n


class _OnDeviceOrTier:
    """Container of the hashes one group has on the device or on a tier (no side effect)."""

    __slots__ = ("cached", "group", "tiers")

    def __init__(self, cached: dict[BlockHash, KVCacheBlock], tiers: KVTiers,
                 group: int) -> None:
        self.cached, self.tiers, self.group = cached, tiers, group

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.cached or (isinstance(block_hash, bytes) and self.tiers.has(
            group_key(block_hash, self.group)))


def tier_hit(policies: Sequence[BlockPolicy], pool: BlockPool, tiers: KVTiers,
             hashes: Sequence[BlockHash], num_hit_blocks: int, top: int) -> TierHit | None:
    """The longest hit <= top every group accepts when a block may come from the device or a
    tier, if it is longer than the device hit of `num_hit_blocks`; None otherwise.

    Tier blocks are fetched (disk copies verified and copied to the host; host slots pinned).
    A fetch that fails (a corrupt file, no host slot) ends the hit before that position.
    """
    maps = pool.group_maps
    held = [_OnDeviceOrTier(m, tiers, g) for g, m in enumerate(maps)]
    while top > num_hit_blocks:
        m = longest_common_hit(policies, hashes, held, top)
        if m <= num_hit_blocks:
            return None
        entries = _fetch(policies, pool, tiers, hashes, m)
        if isinstance(entries, list):
            return TierHit(m, m - num_hit_blocks, entries)
        # Position `entries` failed: search again for a hit ending at or before it (a longer
        # one that a window lets skip it is not searched for).
        top = entries
    return None


def _fetch(policies: Sequence[BlockPolicy], pool: BlockPool, tiers: KVTiers,
           hashes: Sequence[BlockHash], m: int) -> list[list[KVCacheBlock | int]] | int:
    """Each group's sources of an m-block hit, the device's block where cached, else a fetched
    host slot; or the first position whose fetch failed."""
    null, bs = pool.null_block, policies[0].block_size
    entries: list[list[KVCacheBlock | int]] = []
    for g, (p, cached) in enumerate(zip(policies, pool.group_maps, strict=True)):
        first = p.first_held(m * bs)
        row: list[KVCacheBlock | int] = [null] * first
        for i in range(first, m):
            b = cached.get(hashes[i])
            if b is not None:
                row.append(b)
                continue
            slot = tiers.fetch(group_key(hashes[i], g))
            if slot is None:
                return i
            row.append(slot)
        entries.append(row)
    return entries


def load_tier_hit(tiers: KVTiers | None, hits: Sequence[Sequence[KVCacheBlock | int]],
                  fresh: Sequence[KVCacheBlock], block_size: int) -> list[list[KVCacheBlock]]:
    """A TierHit's rows with each host slot replaced by the next `fresh` block (a full block
    of group g), whose load from that slot is planned (it runs before this step's forward)."""
    assert tiers is not None, "host slots come from the tiers only"
    it = iter(fresh)
    out: list[list[KVCacheBlock]] = []
    for g, row in enumerate(hits):
        blocks: list[KVCacheBlock] = []
        for x in row:
            if isinstance(x, int):
                b = next(it)
                b.group, b.num_tokens = g, block_size
                tiers.plan_load(x, b.block_id)
                x = b
            blocks.append(x)
        out.append(blocks)
    return out


def cached_hashes(pool: BlockPool, tiers: KVTiers | None) -> dict[str, set[BlockHash]]:
    """Group 0's prefix-cache hashes each tier holds ("GPU", "CPU", "DISK")."""
    out: dict[str, set[BlockHash]] = {"GPU": set(pool.cached_blocks), "CPU": set(),
                                      "DISK": set()}
    if tiers is not None:  # group_key(hash, 0) is the hash itself
        out["CPU"] = {k for k in tiers.host.prefix_hashes() if split_group_key(k)[1] == 0}
        if tiers.disk is not None:
            out["DISK"] = {k for k in tiers.disk.hashes() if split_group_key(k)[1] == 0}
    return out
