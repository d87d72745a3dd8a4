"""Per-request block tables over the KV cache groups, on one BlockPool: prefix lookup,
allocation, caching, freeing, swap. One manager for every model: a request's table is per group
(``kv_cache_groups.py``; one full-attention group for a model without sliding layers), and each
group's policy (``kv_cache_policies.py``) says which positions it needs, which hits it accepts
and which blocks it frees while the request runs; ``kv_cache_lookup.py`` finds the hits.

When a block becomes shareable: a full block is registered in its group's hash map by
``commit`` — after the step that computed it, when its KV has been WRITTEN — never at
allocation. Between ``allocate_slots`` and ``commit`` its hash is *in flight*;
``is_prefix_in_flight`` lets the scheduler hold back a request whose next prefix block some
running request is computing right now, so it hits the block one step later instead of
computing a private copy (this is what bounds the n > 1 fan-out to
prompt_blocks + n × (generated blocks + 1)).

Prefix-cache metrics (``prefix_cache_stats.py``) count TOKENS once per admission.

With KV tiers (``offload.KVTiers``): evicting a cached block offloads it to the host tier (a
group's block under ``group_key(hash, group)``); a lookup continues on the host/disk tiers
(``get_offloaded_blocks``), and those hits get fresh blocks, registered in the maps at once
(their load runs before this step's forward) and counted as prefix hits; ``swap_out`` /
``swap_in`` move a preempted request's needed blocks (a window's only, for a sliding group).

Invariants (``check_invariants``), for every request holding blocks:

* every group's table has the same length, cdiv(tokens scheduled so far, block_size); every
  real block but the last is full, so internal waste is < 1 block per request and group;
* positions [0, freed[g]) of group g hold the null block, the others real blocks; freed[g] <=
  first_held(computed tokens), so a position a query reads is never null, and a windowed
  group holds at most its policy's max_blocks (these two against the requests' tokens:
  tests/jpaged/core/test_kv_cache_groups_state_machine.py);
* a block sits in one group's tables only (shared between requests only through the prefix
  cache, whose maps are per group) and its ref count is the number of tables holding it;
* blocks [0, num_cached) of every table were offered to their group's map (a duplicate of a
  cached hash included); the null block is never written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jpaged.core.block_hash import BlockHash, BlockHasher
from jpaged.core.block_pool import BlockPool, KVCacheBlock
from jpaged.core.kv_block_tables import RequestTables
from jpaged.core.kv_cache_groups import KVCacheLayout, kv_cache_layout
from jpaged.core.kv_cache_lookup import (
    TierHit,
    cached_hashes,
    device_hit,
    load_tier_hit,
    tier_hit,
)
from jpaged.core.offload import KVTiers, TransferPlan, empty_tier_stats
from jpaged.core.prefix_cache_stats import RECENT_WINDOW, PrefixCacheStats
from jpaged.intmath import cdiv
from jpaged.request import Request

if TYPE_CHECKING:
    from jpaged.kv_events import KVEventCollector

__all__ = ["RECENT_WINDOW", "KVCacheManager", "PrefixCacheStats", "TierHit"]


class KVCacheManager:
    """Block tables of running requests, one per KV cache group; allocation is all-or-nothing.

    `layout` (None: one full-attention group) gives the groups and their policies.
    """

    def __init__(self, block_size: int, num_blocks: int, max_model_len: int,
                 enable_caching: bool = True, hash_algo: str = "sha256",
                 tiers: KVTiers | None = None, layout: KVCacheLayout | None = None,
                 hash_seed: str | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"KVCacheManager.block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        # Requests must carry block_hashes made by an equivalent hasher (Scheduler sets it).
        self.block_hasher = (BlockHasher(block_size, hash_algo, hash_seed) if enable_caching
                             else None)
        self.layout = layout if layout is not None else kv_cache_layout([None])
        self.policies = self.layout.policies(block_size)
        self.num_groups = len(self.policies)
        self.block_pool = BlockPool(num_blocks, enable_caching, self.num_groups)
        self.stats = PrefixCacheStats()
        self.num_freed_out_of_window = 0  # blocks windowed groups returned while running
        self._windowed_groups = [g for g, p in enumerate(self.policies) if p.frees_behind]
        # The fast path's shortcut: one group that frees nothing (a model without windows).
        self._one_full_group = self.num_groups == 1 and not self._windowed_groups
        self._req_tables: dict[str, RequestTables] = {}
        # Hashes of full blocks being computed in the current step, per request and overall.
        self._in_flight_marks: dict[str, list[BlockHash]] = {}
        self._in_flight_count: dict[BlockHash, int] = {}
        self.tiers = tiers
        if tiers is not None and enable_caching:
            self.block_pool.on_evict = tiers.on_device_evict

    # -- lookup ----------------------------------------------------------------------------------

    def max_cache_hit_blocks(self, request: Request) -> int:
        """Most blocks a lookup may return: the last token is always recomputed."""
        return min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """Per group, the blocks of the longest prefix hit every group accepts on the device,
        and its length in tokens (a window's group has the null block before its window).

        Pure lookup (no reference taken, nothing counted); pass the result to allocate_slots.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [[] for _ in self.policies], 0
        rows, n = device_hit(self.policies, self.block_pool, request.block_hashes,
                             self.max_cache_hit_blocks(request))
        return rows, n * self.block_size

    def get_offloaded_blocks(self, request: Request, num_hit_blocks: int) -> TierHit | None:
        """The hit continued on the host/disk tiers past a `num_hit_blocks` device hit (its host
        slots pinned, disk hits verified and copied to the host), or None when they add
        nothing. Pass it to allocate_slots as `offloaded`."""
        if self.tiers is None or not self.enable_caching or request.skip_reading_prefix_cache:
            return None
        return tier_hit(self.policies, self.block_pool, self.tiers, request.block_hashes,
                        num_hit_blocks, self.max_cache_hit_blocks(request))

    def is_prefix_in_flight(self, request: Request, num_hit_blocks: int) -> bool:
        """True if the block after a `num_hit_blocks` hit is being computed by a running request.

        Never for a request that takes no hit (``skip_reading_prefix_cache``): it has nothing
        to wait for.
        """
        if not self._in_flight_count or request.skip_reading_prefix_cache \
                or num_hit_blocks >= self.max_cache_hit_blocks(request):
            return False
        return request.block_hashes[num_hit_blocks] in self._in_flight_count

    # -- allocation ------------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[Sequence[KVCacheBlock]] = (),
                       num_new_computed_tokens: int = 0, offloaded: TierHit | None = None,
                       delay_cache_blocks: bool = False) -> list[KVCacheBlock] | None:
        """Grow every group's table to cover num_computed + num_new_computed + num_new_tokens.

        Returns the blocks taken from the free queue ([] if none were needed), or None when the
        queue cannot supply them; then nothing changed but that windowed groups released the
        blocks their window has left (never to be read again). `new_computed_blocks` (a device
        hit per group from get_computed_blocks, only on admission) are referenced; cached free
        ones count against the free queue. `offloaded` (a TierHit from get_offloaded_blocks)
        replaces them: its host slots are loaded into fresh blocks before this step's forward.
        `delay_cache_blocks`: no step computes the new blocks now (another engine's pages land
        in them later), so they are not in flight: nobody waits for them.
        """
        req = self._req_tables.get(request.request_id)
        if req is not None and offloaded is None and not num_new_computed_tokens \
                and not new_computed_blocks:
            # Fast path (decodes, most chunks): the new tokens fit in the last position, which
            # every group holds (the last position is never behind a window).
            bs = self.block_size
            computed = request.num_computed_tokens
            total = computed + num_new_tokens
            tables = req.blocks
            first_table = tables[0]
            last = len(first_table) - 1
            if last >= 0 and last * bs < total <= (last + 1) * bs \
                    and total <= request.num_tokens_with_spec \
                    and total <= self.max_model_len:
                if self._one_full_group:  # a plain model's table: nothing to free, one block
                    first_table[last].num_tokens = total - last * bs
                else:
                    if computed >= req.release_at:
                        self.num_freed_out_of_window += req.release_behind(
                            self.policies, self._windowed_groups, computed, self.block_pool)
                    n = total - last * bs
                    for table in tables:
                        table[last].num_tokens = n
                if self.enable_caching and total // bs > req.num_cached:
                    self._mark_in_flight(request, req, total)
                return []
            return self._grow(request, req, num_new_tokens, delay_cache_blocks)
        return self._admit(request, req,
                           new_computed_blocks if offloaded is None else offloaded.entries,
                           num_new_computed_tokens, num_new_tokens, delay_cache_blocks)

    def _grow(self, request: Request, req: RequestTables, num_new_tokens: int,
              delay_cache_blocks: bool) -> list[KVCacheBlock] | None:
        """allocate_slots for a request holding tables, past the fast path: new positions."""
        bs, G = self.block_size, self.num_groups
        computed = request.num_computed_tokens
        total = computed + num_new_tokens
        if total > self.max_model_len or total > request.num_tokens_with_spec:
            raise ValueError(f"request {request.request_id!r}: {total} tokens exceed "
                             f"max_model_len ({self.max_model_len}) or the known tokens "
                             f"({request.num_tokens})")
        pool = self.block_pool
        if computed >= req.release_at:
            self.num_freed_out_of_window += req.release_behind(
                self.policies, self._windowed_groups, computed, pool)
        num_new = max(0, cdiv(total, bs) - req.num_positions)
        if G * num_new > pool.get_num_free_blocks():
            return None
        fresh = pool.get_new_blocks(G * num_new) if num_new else []
        req.extend(fresh, num_new, computed // bs, total, bs)
        if self.enable_caching and not delay_cache_blocks:
            self._mark_in_flight(request, req, total)
        return fresh

    def _admit(self, request: Request, req: RequestTables | None,
               hits: Sequence[Sequence[KVCacheBlock | int]], num_new_computed_tokens: int,
               num_new_tokens: int, delay_cache_blocks: bool) -> list[KVCacheBlock] | None:
        """allocate_slots with a prefix hit (`hits`: per group, at each hit position a device
        block, the null block behind a window, or a host slot to load) or a first table."""
        rid = request.request_id
        bs, G = self.block_size, self.num_groups
        if hits and len(hits) != G:
            raise ValueError(f"prefix hit blocks must come per group ({G}), got {len(hits)} "
                             "lists")
        num_hit = len(hits[0]) if hits else 0
        if any(len(h) != num_hit for h in hits):
            raise ValueError("every group's prefix hit must cover the same blocks")
        if num_new_computed_tokens != num_hit * bs:
            raise ValueError("num_new_computed_tokens must equal the hit blocks * block_size, "
                             f"got {num_new_computed_tokens}")
        if req is not None:  # hits only on admission
            if num_hit:
                raise ValueError(f"prefix hit blocks given for request {rid!r} that already "
                                 "has blocks")
            return self._grow(request, req, num_new_tokens, delay_cache_blocks)
        computed = request.num_computed_tokens + num_new_computed_tokens
        total = computed + num_new_tokens
        if total > self.max_model_len or total > request.num_tokens_with_spec:
            raise ValueError(f"request {rid!r}: {total} tokens exceed max_model_len "
                             f"({self.max_model_len}) or the known tokens ({request.num_tokens})")
        num_new = max(0, cdiv(total, bs) - num_hit)
        num_loads = reused = 0
        for row in hits:
            for b in row:
                if isinstance(b, int):
                    num_loads += 1
                elif b.ref_count == 0 and not b.is_null:
                    reused += 1  # a free cached hit block leaves the free queue
        pool = self.block_pool
        if G * num_new + num_loads + reused > pool.get_num_free_blocks():
            return None
        if hits:  # referenced BEFORE popping new ones, so popping cannot evict them
            pool.touch([b for row in hits for b in row if not isinstance(b, int)])
        fresh = pool.get_new_blocks(num_loads + G * num_new) if num_loads or num_new else []
        rows = load_tier_hit(self.tiers, hits, fresh[:num_loads], bs) if num_loads else [
            [b for b in row if not isinstance(b, int)] for row in hits]
        # A hit row holds the null block before its group's first_held(hit tokens).
        req = self._req_tables[rid] = RequestTables(
            rows if rows else [[] for _ in range(G)], num_hit,
            [p.first_held(num_hit * bs) for p in self.policies], self.policies)
        self._record_admission(request, num_new_computed_tokens)
        req.extend(fresh[num_loads:], num_new, computed // bs, total, bs)
        if num_loads:  # the loads run before the forward, so the blocks are shareable at once
            assert self.tiers is not None  # host slots come from the tiers only
            for g, table in enumerate(req.blocks):
                pool.cache_full_blocks(request.block_hashes, table, 0, num_hit,
                                       request.all_token_ids, group=g,
                                       lora_id=_lora_id(request))
            # Tokens once per position, however many groups loaded a block for it.
            loaded = sum(1 for col in zip(*hits, strict=True)
                         if any(isinstance(b, int) for b in col))
            self.tiers.record_hits(num_loads, loaded * bs)
        if self.enable_caching and not delay_cache_blocks:
            self._mark_in_flight(request, req, total)
        return fresh

    def _record_admission(self, request: Request, hit_tokens: int) -> None:
        """Count a request's first lookup (prefix-cache metrics; re-admissions apart). A
        request that skips the lookup (prompt_logprobs) is no query, as vLLM counts."""
        if self.enable_caching:
            if not request.skip_reading_prefix_cache:
                self.stats.record(request.num_tokens, hit_tokens,
                                  preempted=request.num_preemptions > 0)
            if request.num_preemptions == 0:
                request.num_cached_tokens = hit_tokens

    def _mark_in_flight(self, request: Request, req: RequestTables, total: int) -> None:
        rid = request.request_id
        self._clear_in_flight(rid)
        start = req.num_cached
        end = min(total // self.block_size, len(request.block_hashes))
        if end <= start:
            return
        marked = request.block_hashes[start:end]
        self._in_flight_marks[rid] = marked
        counts = self._in_flight_count
        for h in marked:
            counts[h] = counts.get(h, 0) + 1

    def _clear_in_flight(self, rid: str) -> None:
        marked = self._in_flight_marks.pop(rid, None)
        if not marked:
            return
        counts = self._in_flight_count
        for h in marked:
            c = counts[h] - 1
            if c:
                counts[h] = c
            else:
                del counts[h]

    def blocks_to_admit(self, request: Request, num_new_tokens: int,
                        hits: Sequence[Sequence[KVCacheBlock | int]] = (),
                        num_hit_tokens: int = 0, swapped: bool = False) -> int:
        """Free blocks `allocate_slots` (or, `swapped`, `swap_in`) would take to admit
        `request` now: new positions of every group, host slots to load, and the free cached
        hit blocks it takes out of the free queue (not windowed groups' releases)."""
        bs, G = self.block_size, self.num_groups
        if swapped:
            restored = self.swapped_tokens(request.request_id) or 0
            n_tab = cdiv(restored + num_new_tokens, bs)
            return sum(n_tab - p.first_held(restored) for p in self.policies)
        req = self._req_tables.get(request.request_id)
        total = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        if req is not None:
            return G * max(0, cdiv(total, bs) - req.num_positions)
        num_hit = len(hits[0]) if hits else 0
        taken = sum(1 for row in hits for b in row
                    if isinstance(b, int) or (b.ref_count == 0 and not b.is_null))
        return G * max(0, cdiv(total, bs) - num_hit) + taken

    def blocks_freed_by(self, requests: Sequence[Request],
                        keep: Sequence[Sequence[KVCacheBlock | int]] = ()) -> int:
        """Blocks that freeing every one of `requests` would return to the free queue: those
        no other request holds, `keep` (a hit about to be taken) excepted."""
        kept = {b.block_id for row in keep for b in row if not isinstance(b, int)}
        held: dict[int, int] = {}
        refs: dict[int, int] = {}
        for r in requests:
            tables = self._req_tables.get(r.request_id)
            for table in tables.blocks if tables is not None else ():
                for b in table:
                    if not b.is_null and b.block_id not in kept:
                        held[b.block_id] = held.get(b.block_id, 0) + 1
                        refs[b.block_id] = b.ref_count
        return sum(1 for bid, n in held.items() if refs[bid] == n)

    def commit(self, request: Request) -> None:
        """After a step: cache every group's blocks made full by the computed tokens."""
        rid = request.request_id
        if rid in self._in_flight_marks:
            self._clear_in_flight(rid)
        req = self._req_tables.get(rid)
        if req is None or not self.enable_caching:
            return
        start = req.num_cached
        end = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        if end <= start:  # most calls (decodes inside a block) end here
            return
        tables = req.blocks
        end = min(end, len(tables[0]))
        if end > start:
            for g, table in enumerate(tables):
                self.block_pool.cache_full_blocks(request.block_hashes, table, start, end,
                                                  request.all_token_ids, group=g,
                                                  lora_id=_lora_id(request))
            req.num_cached = end

    def trim(self, request: Request) -> int:
        """Speculative decoding, after verification: give back every block past the ones that
        hold the request's computed tokens (blocks that held only rejected proposals), and
        set the last kept block's fill. They were never hashed nor cached (commit caches only
        blocks of known tokens). Returns how many blocks (over all groups) went back."""
        req = self._req_tables.get(request.request_id)
        if req is None:
            return 0
        bs = self.block_size
        computed = request.num_computed_tokens
        keep = cdiv(computed, bs)
        if req.num_positions <= keep:
            return 0
        if keep < req.num_cached or any(f > keep for f in req.freed):
            raise ValueError(f"request {request.request_id!r}: cannot trim to {computed} "
                             "tokens below its cached or window-freed blocks")
        self._clear_in_flight(request.request_id)
        n = 0
        for table, ids in zip(req.blocks, req.ids, strict=True):
            gone = table[keep:]
            del table[keep:], ids[keep:]
            self.block_pool.free_blocks(reversed(gone))
            n += len(gone)
            if keep:
                table[keep - 1].num_tokens = computed - (keep - 1) * bs
        return n

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (a chain's tail is evicted before its head).

        Also forgets its swap entry, if it was swapped out.
        """
        rid = request.request_id
        if self.tiers is not None:
            self.tiers.drop_swap(rid)
        self._free_tables(rid)

    def _free_tables(self, rid: str) -> None:
        self._clear_in_flight(rid)
        req = self._req_tables.pop(rid, None)
        if req is not None:
            for table in req.blocks:
                self.block_pool.free_blocks(reversed(table))

    # -- swap and transfers ----------------------------------------------------------------------

    def swap_out(self, request: Request) -> bool:
        """Move a running request's computed blocks that its groups still need (every block of
        a full group, the window's of a sliding one) to the host tier and free its tables.

        False — changing nothing — without a host tier or when it cannot take them.
        """
        rid = request.request_id
        req = self._req_tables.get(rid)
        computed = request.num_computed_tokens
        n = cdiv(computed, self.block_size)
        if self.tiers is None or req is None or n == 0:
            return False
        ids = req.needed_ids(self.policies, computed, self.block_size)
        if not self.tiers.swap_out(rid, ids, computed):
            return False
        self._free_tables(rid)
        return True

    def swapped_tokens(self, request_id: str) -> int | None:
        """Computed tokens a swapped-out request will get back (None: not swapped out)."""
        return self.tiers.swapped_tokens(request_id) if self.tiers is not None else None

    def swap_in(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Give a swapped-out request its tables back (the needed positions of each group) for
        its swapped tokens + num_new_tokens and plan the loads; sets num_computed_tokens.
        None — changing nothing — without enough blocks."""
        rid = request.request_id
        restored = self.swapped_tokens(rid)
        if restored is None or rid in self._req_tables:
            raise ValueError(f"request {rid!r} is not swapped out")
        total = restored + num_new_tokens
        if total > min(self.max_model_len, request.num_tokens):
            raise ValueError(f"request {rid!r}: {total} tokens exceed max_model_len or the "
                             "known tokens")
        bs = self.block_size
        n_tab, n_loaded = cdiv(total, bs), cdiv(restored, bs)
        firsts = [p.first_held(restored) for p in self.policies]
        need = sum(n_tab - f for f in firsts)
        if need > self.block_pool.get_num_free_blocks():
            return None
        assert self.tiers is not None
        blocks = self.block_pool.get_new_blocks(need)
        req = self._req_tables[rid] = RequestTables.from_blocks(
            blocks, firsts, total, bs, self.block_pool.null_block, self.policies)
        # Positions [firsts[g], n_loaded) of each group get the swapped blocks back, in the
        # order swap_out gathered them (needed_ids).
        self.tiers.swap_in(rid, [i for f, ids in zip(firsts, req.ids, strict=True)
                                 for i in ids[f:n_loaded]])
        request.num_computed_tokens = restored
        if self.enable_caching:
            self._mark_in_flight(request, req, total)
        return blocks

    def begin_step(self) -> None:
        """A new schedule() starts: the previous step's transfers have run."""
        if self.tiers is not None:
            self.tiers.begin_step()

    def take_tier_transfers(self) -> TransferPlan | None:
        """The device transfers this schedule() planned (None without tiers)."""
        return self.tiers.take_plan() if self.tiers is not None else None

    def tier_stats(self) -> dict[str, float | int]:
        """Offload/swap/disk metrics (all zero without tiers)."""
        return self.tiers.get_stats() if self.tiers is not None else empty_tier_stats()

    # -- queries ---------------------------------------------------------------------------------

    def request_ids(self) -> list[str]:
        """Ids of the requests holding tables, in the order they got them."""
        return list(self._req_tables)

    def get_blocks(self, request_id: str) -> list[list[KVCacheBlock]]:
        """Per group, the request's block table (copies; empty if it holds none)."""
        req = self._req_tables.get(request_id)
        return [list(t) for t in req.blocks] if req is not None else [[] for _ in self.policies]

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """Per group, the request's block ids (copies; 0 where a window freed one)."""
        req = self._req_tables.get(request_id)
        return [list(t) for t in req.ids] if req is not None else [[] for _ in self.policies]

    def live_block_ids(self, request_id: str) -> list[list[int]]:
        """Per group, the request's block ids as kept here, not copied: a copy per request per
        step would cost the table's length. Do not mutate.

        Each list grows in place at its end as the table grows and is dropped (not cleared)
        when the request's blocks are freed; a windowed group also writes 0 over positions it
        frees: a runner copying only new positions keeps the stale ids there, which is safe
        because no step reads or writes positions outside the window.
        """
        req = self._req_tables.get(request_id)
        return req.ids if req is not None else [[] for _ in self.policies]

    def num_positions(self, request_id: str) -> int:
        """Length of the request's block tables (0 without any)."""
        req = self._req_tables.get(request_id)
        return 0 if req is None else req.num_positions

    def num_blocks_held(self, request_id: str) -> int:
        """Real blocks the request holds across all groups."""
        req = self._req_tables.get(request_id)
        return req.num_held() if req is not None else 0

    def num_cached_blocks(self, request_id: str) -> int:
        """Positions of the request's tables already offered to the prefix cache (0: none)."""
        req = self._req_tables.get(request_id)
        return req.num_cached if req is not None else 0

    def in_flight_hashes(self) -> dict[BlockHash, int]:
        """Hashes of the full blocks being computed this step, with how many requests compute
        each (a copy)."""
        return dict(self._in_flight_count)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, cached free blocks included."""
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self.block_pool.get_usage()

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted to make room."""
        return self.block_pool.num_evictions

    def reset_prefix_cache(self, keep_host_tier: bool = False) -> bool:
        """Drop all cached hashes (host-tier entries too, unless `keep_host_tier`: sleep mode
        loses the device pages only); False while any block is in use."""
        ok = self.block_pool.reset_prefix_cache()
        if ok:  # the recent hit rate starts over (vLLM's reset); the totals keep counting
            self.stats.reset_recent()
        if ok and self.tiers is not None and not keep_host_tier:
            self.tiers.host.clear_prefix_entries()
        events = self.block_pool.events
        if ok and events is not None:
            survivors: dict[str, list[BlockHash]] = {}
            if self.tiers is not None:  # pinned host entries and the disk tier stay
                survivors["CPU"] = self.tiers.host.prefix_hashes()
                if self.tiers.disk is not None:
                    survivors["DISK"] = self.tiers.disk.hashes()
            events.cleared(survivors)
        return ok

    def cached_hashes(self) -> dict[str, set[BlockHash]]:
        """Group 0's prefix-cache hashes each tier holds ("GPU", "CPU", "DISK")."""
        return cached_hashes(self.block_pool, self.tiers)

    def set_events(self, events: KVEventCollector) -> None:
        """Report every cached-block change of the pool and the tiers to `events` from now on.

        Blocks the tiers already hold are stated at once.
        """
        self.block_pool.events = events
        if self.tiers is not None:
            self.tiers.set_events(events)

    def check_invariants(self) -> None:
        """Pool invariants plus the module docstring's: table lengths and id mirrors, null
        positions, one group per block, ref counts = tables holding a block, tiers."""
        self.block_pool.check_invariants()
        refs: dict[int, int] = {}
        group_of: dict[int, int] = {}
        for rid, req in self._req_tables.items():
            req.check(rid, self.policies, refs, group_of)
        for b in self.block_pool.blocks[1:]:
            if b.ref_count != refs.get(b.block_id, 0):
                raise AssertionError(f"{b}: ref_count != tables holding it "
                                     f"({refs.get(b.block_id, 0)})")
        if self.tiers is not None:
            self.tiers.check_invariants()
            for rid in self._req_tables:
                if self.tiers.swapped_tokens(rid) is not None:
                    raise AssertionError(f"{rid!r} holds device blocks and a swap entry")


def _lora_id(request: Request) -> int | None:
    """The lora_int_id of a request's LoRA adapter (KV events state it), or None."""
    lora = getattr(request, "lora_request", None)  # (duck-typed requests have none)
    return None if lora is None else lora.lora_int_id
