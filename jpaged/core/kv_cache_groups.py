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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jpaged.core.block_hash import BlockHash
from jpaged.core.block_pool import BlockPool, KVCacheBlock
from jpaged.core.kv_cache_manager import KVCacheManager
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


class HybridKVCacheManager(KVCacheManager):
    """KVCacheManager whose requests hold one block table per KV cache group.

    Full-attention groups behave as the plain manager; sliding groups free the blocks behind
    their window (before each allocation, from the request's computed tokens) and take prefix
    hits that need only the window's blocks. Host/disk tiers and swap are not supported here.
    """

    def __init__(self, layout: KVCacheLayout, block_size: int, num_blocks: int,
                 max_model_len: int, enable_caching: bool = True,
                 hash_algo: str = "sha256") -> None:
        super().__init__(block_size, num_blocks, max_model_len, enable_caching, hash_algo, None)
        self.layout = layout
        self.windows = [g.sliding_window for g in layout.groups]
        self._sliding = [g for g, w in enumerate(self.windows) if w is not None]
        self._full = [g for g, w in enumerate(self.windows) if w is None]
        self.block_pool = BlockPool(num_blocks, enable_caching, layout.num_groups)
        # rid -> per group: table, ids mirror (0 where freed); positions freed per group.
        self._gtables: dict[str, list[list[KVCacheBlock]]] = {}
        self._gids: dict[str, list[list[int]]] = {}
        self._freed_upto: dict[str, list[int]] = {}
        self.num_freed_out_of_window = 0  # blocks returned by sliding groups while running

    # -- lookup ----------------------------------------------------------------------------------

    def _sliding_hit(self, group: int, hashes: Sequence[BlockHash], n: int) -> int:
        """Longest hit m <= n for which `group` holds the blocks its window needs (from right)."""
        cached = self.block_pool.group_maps[group]
        w, bs = self.windows[group], self.block_size
        m = n
        while m > 0:
            first = first_needed_block(m * bs, w, bs)  # type: ignore[arg-type]
            j = m - 1
            while j >= first and hashes[j] in cached:
                j -= 1
            if j < first:
                return m
            # Block j is missing and every hit of length in (j, m] needs it (first_needed is
            # monotone): the next candidate ends just before it.
            m = j
        return 0

    def get_computed_blocks(self, request: Request
                            ) -> tuple[list[list[KVCacheBlock]], int]:  # type: ignore[override]
        """Per group, the blocks of the longest prefix hit every group accepts, and its tokens.

        Full groups need every block of the prefix; sliding groups only the blocks covering the
        last W tokens before the hit point (their earlier positions hold the null block).
        """
        G = self.layout.num_groups
        if not self.enable_caching:
            return [[] for _ in range(G)], 0
        hashes = request.block_hashes
        maps = self.block_pool.group_maps
        n = self.max_cache_hit_blocks(request)
        for g in self._full:
            m = maps[g]
            i = 0
            while i < n and hashes[i] in m:
                i += 1
            n = i
        changed = True
        while changed and n > 0:  # every sliding group must accept the same length
            changed = False
            for g in self._sliding:
                m = self._sliding_hit(g, hashes, n)
                if m < n:
                    n, changed = m, True
        null = self.block_pool.null_block
        out: list[list[KVCacheBlock]] = []
        for g, w in enumerate(self.windows):
            first = 0 if w is None else first_needed_block(n * self.block_size, w,
                                                           self.block_size)
            m = maps[g]
            out.append([null] * first + [m[h] for h in hashes[first:n]])
        return out, n * self.block_size

    def get_offloaded_blocks(self, request: Request, num_hit_blocks: int) -> list[int]:
        """No host/disk tiers with groups: always empty."""
        return []

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
                       offloaded: Sequence[int] = ()) -> list[KVCacheBlock] | None:
        """Grow every group's table to cover the request's tokens so far + num_new_tokens.

        Sliding groups first return the blocks their window has left behind. Returns the new
        blocks (all groups), or None when the pool cannot supply them: then nothing else
        changed but that freeing (the freed blocks were never to be read again).
        """
        if offloaded:
            raise ValueError("the hybrid KV cache manager has no host/disk tiers")
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
        if hits:
            reused = sum(1 for h in hits for b in h if b.ref_count == 0 and not b.is_null)
        if G * num_new_blocks + reused > pool.get_num_free_blocks():
            return None
        if hits:
            for h in hits:  # referenced before popping new ones, so popping cannot evict them
                pool.touch(h)
        new_blocks = pool.get_new_blocks(G * num_new_blocks) if num_new_blocks else []
        if admitting:
            tables = self._gtables[rid] = [list(h) for h in hits] if hits else [
                [] for _ in range(G)]
            self._gids[rid] = [[b.block_id for b in t] for t in tables]
            self._freed_upto[rid] = [
                0 if w is None else first_needed_block(computed, w, bs) for w in self.windows]
            self._num_cached[rid] = num_hit
            self._tables[rid] = tables[0]  # group 0's table, for the base class's queries
            self._block_ids[rid] = self._gids[rid][0]
            if self.enable_caching:
                self.stats.record(request.num_tokens, num_new_computed_tokens,
                                  preempted=request.num_preemptions > 0)
                if request.num_preemptions == 0:
                    request.num_cached_tokens = num_new_computed_tokens
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
        if self.enable_caching:
            self._mark_in_flight(request, total)
        return new_blocks

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
        """No host tier with groups: preemption recomputes."""
        return False

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
        for b in self.block_pool.blocks[1:]:
            if b.ref_count != refs.get(b.block_id, 0):
                raise AssertionError(f"{b}: ref_count != tables holding it "
                                     f"({refs.get(b.block_id, 0)})")
