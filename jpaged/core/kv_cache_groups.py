"""KV cache groups: a hybrid model's layers grouped by attention type over one block pool.

A sliding-window layer with window W only ever reads the last W positions, so the blocks behind
them can go back to the pool while the request still runs (vLLM V1's hybrid KV cache manager).

Layout (``kv_cache_layout``): layers are grouped by their window (None = full attention). With
one kind of layer there is one group. With several, every group gets the same number of layers,
``group_size = gcd(layer counts per kind)`` (Gemma 3's 5 sliding : 1 full gives 1 full and 5
sliding groups of L/6 layers each). The device pool has ``group_size`` slots (instead of one per
layer): slot j of block b holds the KV of the j-th layer of whichever group owns b. So one block
id costs ``group_size`` layers' worth of KV, and the groups draw their blocks from one pool.

Invariants of the manager (``HybridKVCacheManager.check_invariants``):

* every group's table of a request has the same length, cdiv(tokens scheduled, block_size);
* a block sits in the tables of one group only (shared between requests only through the prefix
  cache, whose maps are per group: a cached block is keyed by (hash, group));
* a sliding group's positions whose tokens all lie more than W - 1 behind the request's computed
  tokens hold the null block; the others hold real blocks, so a request never holds more than
  ``cdiv(W - 1 + chunk, block_size) + 1`` blocks of a sliding group;
* the null block is never written (its positions are never in a step's slot mapping).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jpaged.core.block_hash import BlockHash
from jpaged.core.block_pool import KVCacheBlock
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.offload import KVTiers
from jpaged.kv_events import group_key, split_group_key
from jpaged.request import Request


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group: its layers and their window (None: full attention)."""

    layers: tuple[int, ...]
    sliding_window: int | None

    @property
    def kind(self) -> str:
        """"full" or "sliding"."""
        return "full" if self.sliding_window is None else "sliding"


@dataclass(frozen=True)
class KVCacheLayout:
    """The groups, and where each layer's KV lives: (group, slot) per layer."""

    groups: tuple[KVCacheGroupSpec, ...]
    group_of: tuple[int, ...]  # per layer
    slot_of: tuple[int, ...]  # per layer: its row block of the device pool

    @property
    def num_groups(self) -> int:
        """Groups (each has its own block table per request)."""
        return len(self.groups)

    @property
    def num_slots(self) -> int:
        """Layers' worth of KV one block id holds (the pool's leading axis is this x blocks)."""
        return len(self.groups[0].layers)

    @property
    def num_layers(self) -> int:
        """Decoder layers the layout covers."""
        return len(self.group_of)

    @property
    def is_hybrid(self) -> bool:
        """True when some group slides (its blocks are freed behind the window)."""
        return any(g.sliding_window is not None for g in self.groups)

    def describe(self) -> list[dict[str, object]]:
        """The groups as plain dicts (cache_state, logs)."""
        return [{"kind": g.kind, "sliding_window": g.sliding_window, "layers": list(g.layers)}
                for g in self.groups]


def kv_cache_layout(layer_windows: Sequence[int | None], hybrid: bool = True) -> KVCacheLayout:
    """The groups of a model whose layer i has window `layer_windows[i]` (None: full).

    `hybrid=False` (vLLM's --disable-hybrid-kv-cache-manager) keeps one full-attention group
    over all layers: every layer keeps every token's KV (the sliding layers still attend only
    to their window). A model without sliding layers gets that layout either way.
    """
    n = len(layer_windows)
    if n < 1:
        raise ValueError("kv_cache_layout needs at least one layer")
    for i, w in enumerate(layer_windows):
        if w is not None and (not isinstance(w, int) or w < 1):
            raise ValueError(f"layer {i}: sliding window must be an integer >= 1, got {w!r}")
    kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))  # full first
    if not hybrid or kinds == [None]:
        return KVCacheLayout((KVCacheGroupSpec(tuple(range(n)), None),), (0,) * n,
                             tuple(range(n)))
    by_kind = {w: [i for i, x in enumerate(layer_windows) if x == w] for w in kinds}
    size = math.gcd(*(len(v) for v in by_kind.values()))
    groups: list[KVCacheGroupSpec] = []
    group_of, slot_of = [0] * n, [0] * n
    for w in kinds:
        layers = by_kind[w]
        for start in range(0, len(layers), size):
            chunk = tuple(layers[start:start + size])
            for j, layer in enumerate(chunk):
                group_of[layer], slot_of[layer] = len(groups), j
            groups.append(KVCacheGroupSpec(chunk, w))
    return KVCacheLayout(tuple(groups), tuple(group_of), tuple(slot_of))


def sliding_blocks_bound(window: int, chunk: int, block_size: int) -> int:
    """Most blocks a request holds in a sliding group: cdiv(W - 1 + chunk, bs) + 1."""
    return -(-(window - 1 + chunk) // block_size) + 1


def first_needed_block(num_computed_tokens: int, window: int, block_size: int) -> int:
    """First block a sliding layer still reads once `num_computed_tokens` are computed: the
    next query (at that position) sees keys from num_computed - W + 1 on."""
    return max(0, num_computed_tokens - window + 1) // block_size


def blocks_needed(longest: int, layout: KVCacheLayout, block_size: int, chunk: int) -> int:
    """Most blocks one request of `longest` scheduled tokens holds across all groups."""
    full = -(-longest // block_size)
    total = 0
    for g in layout.groups:
        w = g.sliding_window
        total += full if w is None else min(full, sliding_blocks_bound(w, chunk, block_size))
    return total


@dataclass
class HybridHit:
    """A prefix hit continued on the host/disk tiers: for each group, each position's source
    (a cached device block, a pinned host slot, or the null block behind a window)."""

    num_blocks: int  # the whole hit, device blocks included
    extra: int  # blocks beyond the device hit: what the scheduler counts as offloaded
    entries: list[list[KVCacheBlock | int]]

    def __len__(self) -> int:
        return self.extra


class HybridKVCacheManager(KVCacheManager):
    """KVCacheManager whose requests hold one block table per KV cache group.

    Full-attention groups behave as the plain manager; sliding groups free the blocks behind
    their window (before each allocation, from the request's computed tokens) and take prefix
    hits that need only the window's blocks. With host/disk tiers a group's block is kept
    there under group_key(hash, group); swap moves only the window's blocks of sliding groups.
    """

    def __init__(self, layout: KVCacheLayout, block_size: int, num_blocks: int,
                 max_model_len: int, enable_caching: bool = True,
                 hash_algo: str = "sha256", tiers: KVTiers | None = None,
                 hash_seed: str | None = None) -> None:
        # Host/disk tiers: a group's block is stored under group_key(hash, group) (the pool's
        # eviction hook passes that key); a host slot holds num_slots layers, as a block does.
        super().__init__(block_size, num_blocks, max_model_len, enable_caching, hash_algo, tiers,
                         layout.num_groups, hash_seed)
        self.layout = layout
        self.windows = [g.sliding_window for g in layout.groups]
        self._sliding = [g for g, w in enumerate(self.windows) if w is not None]
        self._full = [g for g, w in enumerate(self.windows) if w is None]
        # rid -> per group: table, ids mirror (0 where freed); positions freed per group.
        self._gtables: dict[str, list[list[KVCacheBlock]]] = {}
        self._gids: dict[str, list[list[int]]] = {}
        self._freed_upto: dict[str, list[int]] = {}
        self.num_freed_out_of_window = 0  # blocks returned by sliding groups while running

    # -- lookup ----------------------------------------------------------------------------------

    def _sliding_hit(self, group: int, has: Callable[[int], bool], n: int) -> int:
        """Longest hit m <= n for which `group` has (`has(i)`) the blocks its window needs,
        found from the right."""
        w, bs = self.windows[group], self.block_size
        m = n
        while m > 0:
            first = first_needed_block(m * bs, w, bs)  # type: ignore[arg-type]
            j = m - 1
            while j >= first and has(j):
                j -= 1
            if j < first:
                return m
            # Block j is missing and every hit of length in (j, m] needs it (first_needed is
            # monotone): the next candidate ends just before it.
            m = j
        return 0

    def _longest_hit(self, n: int, has: Callable[[int, int], bool]) -> int:
        """The longest hit <= n that every group accepts, `has(g, i)` saying whether group g
        can have block i (full groups: every block before the hit; sliding: the window's)."""
        for g in self._full:
            i = 0
            while i < n and has(g, i):
                i += 1
            n = i
        changed = True
        while changed and n > 0:  # every sliding group must accept the same length
            changed = False
            for g in self._sliding:
                m = self._sliding_hit(g, lambda i, g=g: has(g, i), n)
                if m < n:
                    n, changed = m, True
        return n

    def _first_held(self, g: int, num_tokens: int) -> int:
        """First position group g holds once `num_tokens` are computed (0 for a full group)."""
        w = self.windows[g]
        return 0 if w is None else first_needed_block(num_tokens, w, self.block_size)

    def get_computed_blocks(self, request: Request
                            ) -> tuple[list[list[KVCacheBlock]], int]:  # type: ignore[override]
        """Per group, the blocks of the longest prefix hit every group accepts, and its tokens.

        Full groups need every block of the prefix; sliding groups only the blocks covering the
        last W tokens before the hit point (their earlier positions hold the null block).
        """
        G = self.layout.num_groups
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [[] for _ in range(G)], 0
        hashes = request.block_hashes
        maps = self.block_pool.group_maps
        n = self._longest_hit(self.max_cache_hit_blocks(request),
                              lambda g, i: hashes[i] in maps[g])
        null = self.block_pool.null_block
        out: list[list[KVCacheBlock]] = []
        for g in range(G):
            first = self._first_held(g, n * self.block_size)
            m = maps[g]
            out.append([null] * first + [m[h] for h in hashes[first:n]])
        return out, n * self.block_size

    def get_offloaded_blocks(self, request: Request,  # type: ignore[override]
                             num_hit_blocks: int) -> HybridHit | list[int]:
        """The hit continued on the host/disk tiers, as a HybridHit whose len() is the blocks
        beyond the device hit (its host slots are pinned); [] when the tiers add nothing.

        A group's block at a position may come from the device (cached) or from a tier (under
        group_key(hash, group)); the hit is again the longest every group accepts.
        """
        tiers = self.tiers
        if tiers is None or not self.enable_caching or request.skip_reading_prefix_cache:
            return []
        hashes = request.block_hashes
        maps = self.block_pool.group_maps
        top = self.max_cache_hit_blocks(request)
        if num_hit_blocks >= top:
            return []
        m = self._longest_hit(top, lambda g, i: hashes[i] in maps[g]
                              or tiers.has(group_key(hashes[i], g)))
        if m <= num_hit_blocks:
            return []
        null = self.block_pool.null_block
        entries: list[list[KVCacheBlock | int]] = []
        for g in range(self.layout.num_groups):
            first = self._first_held(g, m * self.block_size)
            row: list[KVCacheBlock | int] = [null] * first
            for i in range(first, m):
                b = maps[g].get(hashes[i])
                slot = None if b is not None else tiers.fetch(group_key(hashes[i], g))
                if b is None and slot is None:
                    return []  # a disk copy failed its check: the device hit alone
                row.append(b if b is not None else slot)  # type: ignore[arg-type]
            entries.append(row)
        return HybridHit(m, m - num_hit_blocks, entries)

    # -- allocation ------------------------------------------------------------------------------

    def _remove_skipped(self, rid: str, num_computed: int) -> None:
        """Free each sliding group's blocks whose tokens are all out of the window."""
        upto = self._freed_upto[rid]
        tables, ids = self._gtables[rid], self._gids[rid]
        null, bs = self.block_pool.null_block, self.block_size
        for g in self._sliding:
            first = min(first_needed_block(num_computed, self.windows[g], bs),  # type: ignore
                        len(tables[g]))
            start = upto[g]
            if first <= start:
                continue
            table, gids = tables[g], ids[g]
            gone = [b for b in table[start:first] if not b.is_null]
            for i in range(start, first):
                table[i] = null
                gids[i] = 0
            upto[g] = first
            if gone:
                # Oldest first in the chain, so free tail first: the chain's head stays longest.
                self.block_pool.free_blocks(reversed(gone))
                self.num_freed_out_of_window += len(gone)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[Sequence[KVCacheBlock]] = (),  # type: ignore
                       num_new_computed_tokens: int = 0,
                       offloaded: HybridHit | Sequence[int] = (),
                       delay_cache_blocks: bool = False) -> list[KVCacheBlock] | None:
        """Grow every group's table to cover the request's tokens so far + num_new_tokens.

        Sliding groups first return the blocks their window has left behind. A HybridHit from
        get_offloaded_blocks (on admission) replaces `new_computed_blocks`: its host slots are
        loaded into fresh blocks before this step's forward. Returns the new blocks (all
        groups), or None when the pool cannot supply them: then nothing else changed but that
        freeing (the freed blocks were never to be read again). `delay_cache_blocks`: as the
        plain manager's (nothing is in flight).
        """
        loads: HybridHit | None = None
        if offloaded:
            if not isinstance(offloaded, HybridHit):
                raise ValueError("offloaded blocks must come as the HybridHit of "
                                 "get_offloaded_blocks")
            loads = offloaded
            new_computed_blocks = offloaded.entries  # type: ignore[assignment]
        rid = request.request_id
        bs = self.block_size
        tables = self._gtables.get(rid)
        if tables and not new_computed_blocks and num_new_computed_tokens == 0:
            # Fast path (decodes, most chunks): the new tokens fit in the last blocks, which
            # every group holds (the last position is never behind a window).
            total = request.num_computed_tokens + num_new_tokens
            last = len(tables[0]) - 1
            if last * bs < total <= (last + 1) * bs \
                    and total <= len(request.all_token_ids) + request.num_output_placeholders \
                    and total <= self.max_model_len:
                self._remove_skipped(rid, request.num_computed_tokens)
                for table in tables:
                    table[last].num_tokens = total - last * bs
                if self.enable_caching and total // bs > self._num_cached[rid]:
                    self._mark_in_flight(request, total)
                return []
        admitting = tables is None
        hits = list(new_computed_blocks) if new_computed_blocks else None
        if hits is not None and len(hits) != self.layout.num_groups:
            raise ValueError(f"prefix hit blocks must come per group ({self.layout.num_groups}), "
                             f"got {len(hits)} lists")
        num_hit = len(hits[0]) if hits else 0
        if num_hit and not admitting:
            raise ValueError(f"prefix hit blocks given for request {rid!r} that already has blocks")
        if hits is not None and any(len(h) != num_hit for h in hits):
            raise ValueError("every group's prefix hit must cover the same blocks")
        if num_new_computed_tokens != num_hit * bs:
            raise ValueError("num_new_computed_tokens must equal the hit blocks * block_size, "
                             f"got {num_new_computed_tokens}")
        computed = request.num_computed_tokens + num_new_computed_tokens
        total = computed + num_new_tokens
        if total > self.max_model_len or total > request.num_tokens_with_placeholders:
            raise ValueError(f"request {rid!r}: {total} tokens exceed max_model_len "
                             f"({self.max_model_len}) or the known tokens ({request.num_tokens})")
        if not admitting:
            self._remove_skipped(rid, request.num_computed_tokens)
            have = len(tables[0])  # type: ignore[index]
        else:
            have = num_hit
        num_new_blocks = max(0, -(-total // bs) - have)
        G = self.layout.num_groups
        pool = self.block_pool
        reused = 0
        num_loads = 0
        if hits:
            for h in hits:
                for b in h:
                    if isinstance(b, int):
                        num_loads += 1
                    elif b.ref_count == 0 and not b.is_null:
                        reused += 1
        if G * num_new_blocks + num_loads + reused > pool.get_num_free_blocks():
            return None
        if hits:
            for h in hits:  # referenced before popping new ones, so popping cannot evict them
                pool.touch([b for b in h if not isinstance(b, int)])
        if num_loads:
            hits = self._load_hit(request, hits, pool.get_new_blocks(num_loads))  # type: ignore
        new_blocks = pool.get_new_blocks(G * num_new_blocks) if num_new_blocks else []
        if admitting:
            tables = self._gtables[rid] = [list(h) for h in hits] if hits else [
                [] for _ in range(G)]
            self._gids[rid] = [[b.block_id for b in t] for t in tables]
            self._freed_upto[rid] = [self._first_held(g, computed) for g in range(G)]
            self._num_cached[rid] = num_hit
            self._tables[rid] = tables[0]  # group 0's table, for the base class's queries
            self._block_ids[rid] = self._gids[rid][0]
            self._record_admission(request, num_new_computed_tokens)
        assert tables is not None
        ids = self._gids[rid]
        for g in range(G):
            part = new_blocks[g * num_new_blocks:(g + 1) * num_new_blocks]
            for b in part:
                b.group = g  # the owner, for cache_state (cache_full_blocks sets it too)
            tables[g].extend(part)
            ids[g].extend(b.block_id for b in part)
            first = computed // bs
            for i in range(first, len(tables[g])):
                b = tables[g][i]
                if not b.is_null:
                    b.num_tokens = min(bs, total - i * bs)
        if loads is not None:  # loaded blocks are shareable at once (the loads run first)
            for g, table in enumerate(tables):
                self.block_pool.cache_full_blocks(request.block_hashes, table, 0, num_hit,
                                                  request.all_token_ids, group=g)
            self.tiers.record_hits(num_loads, bs)  # type: ignore[union-attr]
        if self.enable_caching and not delay_cache_blocks:
            self._mark_in_flight(request, total)
        return new_blocks

    def _load_hit(self, request: Request, hits: list[list[KVCacheBlock | int]],
                  fresh: list[KVCacheBlock]) -> list[list[KVCacheBlock]]:
        """The hit with each host slot replaced by a fresh block its content is loaded into."""
        tiers = self.tiers
        assert tiers is not None
        it = iter(fresh)
        out: list[list[KVCacheBlock]] = []
        for g, row in enumerate(hits):
            blocks: list[KVCacheBlock] = []
            for x in row:
                if isinstance(x, int):
                    b = next(it)
                    b.group, b.num_tokens = g, self.block_size
                    tiers.plan_load(x, b.block_id)
                    blocks.append(b)
                else:
                    blocks.append(x)
            out.append(blocks)
        return out

    def commit(self, request: Request) -> None:
        """After a step: cache every group's blocks made full by the computed tokens."""
        rid = request.request_id
        if rid in self._in_flight:
            self._clear_in_flight(rid)
        start = self._num_cached.get(rid)
        if start is None or not self.enable_caching:
            return
        end = min(request.num_computed_tokens // self.block_size, len(request.block_hashes),
                  len(self._gtables[rid][0]))
        if end <= start:
            return
        for g, table in enumerate(self._gtables[rid]):
            self.block_pool.cache_full_blocks(request.block_hashes, table, start, end,
                                              request.all_token_ids, group=g)
        self._num_cached[rid] = end

    def _free_table(self, rid: str) -> None:
        self._clear_in_flight(rid)
        tables = self._gtables.pop(rid, None)
        self._gids.pop(rid, None)
        self._freed_upto.pop(rid, None)
        self._tables.pop(rid, None)
        self._block_ids.pop(rid, None)
        self._num_cached.pop(rid, None)
        for table in tables or ():
            self.block_pool.free_blocks(reversed(table))

    def swap_out(self, request: Request) -> bool:
        """Move a running request's in-window computed blocks (every block of a full group,
        the window's of a sliding one) to the host tier and free its tables.

        False, changing nothing, without a host tier or when it cannot take them.
        """
        if self.tiers is None:
            return False
        rid = request.request_id
        computed = request.num_computed_tokens
        n = -(-computed // self.block_size)
        ids = self._gids.get(rid)
        if n == 0 or ids is None:
            return False
        flat = [b for g in range(self.layout.num_groups)
                for b in ids[g][self._first_held(g, computed):n]]
        if not self.tiers.swap_out(rid, flat, computed):
            return False
        self._free_table(rid)
        return True

    def swap_in(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Give a swapped-out request its tables back (the window's blocks of sliding groups)
        for its swapped tokens + num_new_tokens and plan the loads; sets num_computed_tokens.
        None, changing nothing, without enough blocks."""
        rid = request.request_id
        restored, total = self._swap_in_tokens(request, num_new_tokens)
        bs, G = self.block_size, self.layout.num_groups
        n_tab, n_loaded = -(-total // bs), -(-restored // bs)
        firsts = [self._first_held(g, restored) for g in range(G)]
        need = sum(n_tab - f for f in firsts)
        if need > self.block_pool.get_num_free_blocks():
            return None
        assert self.tiers is not None
        fresh = iter(self.block_pool.get_new_blocks(need))
        null = self.block_pool.null_block
        tables: list[list[KVCacheBlock]] = []
        loaded: list[int] = []
        for g, f in enumerate(firsts):
            table = [null] * f
            for i in range(f, n_tab):
                b = next(fresh)
                b.group, b.num_tokens = g, min(bs, total - i * bs)
                table.append(b)
                if i < n_loaded:
                    loaded.append(b.block_id)
            tables.append(table)
        self.tiers.swap_in(rid, loaded)  # the same order swap_out gathered them in
        self._gtables[rid] = tables
        self._gids[rid] = [[b.block_id for b in t] for t in tables]
        self._freed_upto[rid] = firsts
        self._tables[rid] = tables[0]
        self._block_ids[rid] = self._gids[rid][0]
        self._num_cached[rid] = 0  # commit re-offers the full blocks to the maps
        request.num_computed_tokens = restored
        if self.enable_caching:
            self._mark_in_flight(request, total)
        return [b for t in tables for b in t if not b.is_null]

    def cached_hashes(self) -> dict[str, set[BlockHash]]:
        """Group 0's prefix-cache hashes each tier holds ("GPU", "CPU", "DISK")."""
        out = super().cached_hashes()
        for medium in ("CPU", "DISK"):
            out[medium] = {h for h in out[medium] if split_group_key(h)[1] == 0}
        return out

    # -- queries ---------------------------------------------------------------------------------

    def live_block_ids(self, request_id: str) -> Any:
        """Per group, the request's block ids as kept here (0 where a sliding group freed one);
        with one group, that group's list alone (as the plain manager's).

        Not copied; do not mutate. Positions only grow at the end, except that a sliding group
        writes 0 over positions it frees: a runner copying only new positions keeps the stale
        ids there, which is safe because no step reads or writes positions outside the window.
        """
        ids = self._gids.get(request_id)
        if ids is None:
            ids = [[] for _ in self.windows]
        return ids[0] if len(ids) == 1 else ids

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """Per group, a copy of the request's block ids (0: freed or not needed)."""
        return [list(x) for x in self._gids.get(request_id, ())]

    def num_blocks_held(self, request_id: str) -> int:
        """Real blocks the request holds across all groups."""
        return sum(1 for t in self._gtables.get(request_id, ()) for b in t if not b.is_null)

    def check_invariants(self) -> None:
        """Pool invariants; ref counts = tables holding a block; one group per block; windows."""
        self.block_pool.check_invariants()
        refs: dict[int, int] = {}
        group_of: dict[int, int] = {}
        for rid, tables in self._gtables.items():
            if len({len(t) for t in tables}) != 1:
                raise AssertionError(f"{rid!r}: group tables of different lengths")
            for g, table in enumerate(tables):
                if [b.block_id for b in table] != self._gids[rid][g]:
                    raise AssertionError(f"block id mirror of {rid!r} group {g} is stale")
                for i, b in enumerate(table):
                    if b.is_null:
                        if i >= self._freed_upto[rid][g]:
                            raise AssertionError(f"{rid!r} group {g}: null block at {i}, "
                                                 "inside the window")
                        continue
                    if group_of.setdefault(b.block_id, g) != g:
                        raise AssertionError(f"block {b.block_id} is in two groups' tables")
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
                if self.windows[g] is not None and any(
                        not b.is_null for b in table[:self._freed_upto[rid][g]]):
                    raise AssertionError(f"{rid!r} group {g}: a block behind the window")
        self._check_holders(refs)  # _tables mirrors group 0 of _gtables
