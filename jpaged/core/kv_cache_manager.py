"""Per-request block tables on top of the BlockPool: prefix lookup, allocation, caching, freeing.

When a block becomes shareable: a full block is registered in the hash map by ``commit`` — after
the step that computed it, when its KV has been WRITTEN — never at allocation. Between
``allocate_slots`` and ``commit`` its hash is *in flight*; ``is_prefix_in_flight`` lets the
scheduler hold back a request whose next prefix block some running request is computing right now,
so it hits the block one step later instead of computing a private copy (this is what bounds the
n > 1 fan-out to prompt_blocks + n × (generated blocks + 1)).

Prefix-cache metrics count TOKENS once per admission (the first ``allocate_slots`` of a request
with no blocks), not per ``get_computed_blocks`` call, so a request that has to wait is not
counted twice. Re-admissions after preemption are counted apart (``preempted_*``) so that the
hit rate reflects sharing between requests, not a request finding its own freed blocks.

With KV tiers (``offload.KVTiers``): evicting a cached block offloads it to the host tier; a
lookup continues on the host/disk tiers (``get_offloaded_blocks``), and those hits get fresh
blocks, registered in the hash map at once (their load runs before this step's forward) and
counted as prefix hits; ``swap_out``/``swap_in`` move a preempted request's table.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jpaged.core.block_hash import BlockHash, BlockHasher
from jpaged.core.block_pool import BlockPool, KVCacheBlock
from jpaged.core.offload import KVTiers, TransferPlan, empty_tier_stats
from jpaged.request import Request

if TYPE_CHECKING:
    from jpaged.kv_events import KVEventCollector

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

    @property
    def hit_rate(self) -> float:
        """hits / queries over all first admissions (0 when none)."""
        return self.hits / self.queries if self.queries else 0.0

    @property
    def recent_hit_rate(self) -> float:
        """hits / queries over the last RECENT_WINDOW first admissions."""
        return self._recent_h / self._recent_q if self._recent_q else 0.0


class KVCacheManager:
    """Block tables of running requests; allocation is all-or-nothing.

    Invariants: a request's table covers cdiv(tokens scheduled so far, block_size) blocks; every
    block but the last is full, so internal waste is < 1 block per request; blocks
    [0, num_cached[r]) of a table are cached (a duplicate of a cached hash included).
    """

    def __init__(self, block_size: int, num_blocks: int, max_model_len: int,
                 enable_caching: bool = True, hash_algo: str = "sha256",
                 tiers: KVTiers | None = None, num_groups: int = 1,
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
        self.block_pool = BlockPool(num_blocks, enable_caching, num_groups)
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[KVCacheBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}  # mirrors _tables, kept incrementally
        self._num_cached: dict[str, int] = {}  # blocks of the table already offered to the map
        # Hashes of full blocks being computed in the current step, per request and overall.
        self._in_flight: dict[str, list[BlockHash]] = {}
        self._in_flight_count: dict[BlockHash, int] = {}
        self.tiers = tiers
        if tiers is not None and enable_caching:
            self.block_pool.on_evict = tiers.on_device_evict

    # -- lookup ----------------------------------------------------------------------------------

    def max_cache_hit_blocks(self, request: Request) -> int:
        """Most blocks a lookup may return: the last token is always recomputed."""
        return min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest chain of cached full blocks prefixing the request, and its length in tokens.

        Pure lookup (no reference taken, nothing counted); pass the result to allocate_slots.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        get = self.block_pool.cached_blocks.get
        hashes = request.block_hashes
        out: list[KVCacheBlock] = []
        for i in range(self.max_cache_hit_blocks(request)):
            b = get(hashes[i])
            if b is None:
                break
            out.append(b)
        return out, len(out) * self.block_size

    def get_offloaded_blocks(self, request: Request, num_hit_blocks: int) -> list[int]:
        """Host slots continuing a `num_hit_blocks` device hit on the host/disk tiers (pinned).

        Pass them to allocate_slots as `offloaded`; disk hits are verified and copied to the host.
        """
        if self.tiers is None or not self.enable_caching or request.skip_reading_prefix_cache:
            return []
        end = self.max_cache_hit_blocks(request)
        return self.tiers.fetch_prefix(request.block_hashes[num_hit_blocks:end])

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
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       num_new_computed_tokens: int = 0,
                       offloaded: Sequence[int] = (),
                       delay_cache_blocks: bool = False) -> list[KVCacheBlock] | None:
        """Grow the table to cover num_computed + num_new_computed + num_new_tokens tokens.

        Returns the newly allocated blocks ([] if none were needed), or None — changing
        nothing — when the free queue cannot supply them. `new_computed_blocks` (a prefix hit,
        only on admission) are referenced; cached free ones count against the free queue.
        `offloaded` (host slots from get_offloaded_blocks) continue the hit: the first
        len(offloaded) new blocks are loaded from them and count as computed.
        `delay_cache_blocks`: no step computes the new blocks now (another engine's pages land
        in them later), so they are not in flight: nobody waits for them.
        """
        rid = request.request_id
        bs = self.block_size
        table = self._tables.get(rid)
        if table and not new_computed_blocks and num_new_computed_tokens == 0 and not offloaded:
            # Fast path (decodes, most chunks): the new tokens fit in the last block.
            total = request.num_computed_tokens + num_new_tokens
            last = len(table) - 1
            if last * bs < total <= (last + 1) * bs \
                    and total <= len(request.all_token_ids) + request.num_output_placeholders \
                    and total <= self.max_model_len:
                table[last].num_tokens = total - last * bs
                if self.enable_caching and total // bs > self._num_cached[rid]:
                    self._mark_in_flight(request, total)
                return []
        admitting = table is None
        num_hit = len(new_computed_blocks) + len(offloaded)
        if num_hit and not admitting:
            raise ValueError(f"prefix hit blocks given for request {rid!r} that already has blocks")
        if num_new_computed_tokens != num_hit * bs:
            raise ValueError("num_new_computed_tokens must equal (len(new_computed_blocks) + "
                             f"len(offloaded)) * block_size, got {num_new_computed_tokens}")
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if total > self.max_model_len or total > request.num_tokens_with_placeholders:
            raise ValueError(f"request {rid!r}: {total} tokens exceed max_model_len "
                             f"({self.max_model_len}) or the known tokens ({request.num_tokens})")
        have = 0 if admitting else len(table)  # type: ignore[arg-type]
        num_new_blocks = max(0, -(-total // bs) - have - len(new_computed_blocks))
        # Free cached hit blocks leave the free queue when referenced.
        num_reused_free = sum(1 for b in new_computed_blocks if b.ref_count == 0)
        pool = self.block_pool
        if num_new_blocks + num_reused_free > pool.get_num_free_blocks():
            return None

        # Reference hit blocks BEFORE popping new ones, so popping cannot evict them.
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        if admitting:
            table = self._tables[rid] = []
            self._block_ids[rid] = []
            self._num_cached[rid] = num_hit
            self._record_admission(request, num_new_computed_tokens)
        assert table is not None
        ids = self._block_ids[rid]
        for b in (*new_computed_blocks, *new_blocks):
            table.append(b)
            ids.append(b.block_id)
        # Slots assigned: blocks before the last are full, the last holds the remainder.
        first = max(0, (request.num_computed_tokens + num_new_computed_tokens) // bs)
        for i in range(first, len(table)):
            table[i].num_tokens = min(bs, total - i * bs)
        if offloaded:
            self._load_offloaded(request, new_blocks, offloaded, len(new_computed_blocks))

        if self.enable_caching and not delay_cache_blocks:
            self._mark_in_flight(request, total)
        return new_blocks

    def _record_admission(self, request: Request, hit_tokens: int) -> None:
        """Count a request's first lookup (prefix-cache metrics; re-admissions apart)."""
        if self.enable_caching:
            self.stats.record(request.num_tokens, hit_tokens,
                              preempted=request.num_preemptions > 0)
            if request.num_preemptions == 0:
                request.num_cached_tokens = hit_tokens

    def _load_offloaded(self, request: Request, new_blocks: Sequence[KVCacheBlock],
                        slots: Sequence[int], first: int) -> None:
        # The loads run before this step's forward, so the blocks are shareable at once.
        tiers = self.tiers
        assert tiers is not None
        for slot, b in zip(slots, new_blocks, strict=False):
            b.num_tokens = self.block_size
            tiers.plan_load(slot, b.block_id)
        # Table positions first.. hold them (after the device hit blocks).
        self.block_pool.cache_full_blocks(request.block_hashes, self._tables[request.request_id],
                                          first, first + len(slots), request.all_token_ids)
        tiers.record_hits(len(slots), self.block_size)

    def _mark_in_flight(self, request: Request, total: int) -> None:
        rid = request.request_id
        self._clear_in_flight(rid)
        start = self._num_cached[rid]
        end = min(total // self.block_size, len(request.block_hashes))
        if end <= start:
            return
        marked = request.block_hashes[start:end]
        self._in_flight[rid] = marked
        counts = self._in_flight_count
        for h in marked:
            counts[h] = counts.get(h, 0) + 1

    def _clear_in_flight(self, rid: str) -> None:
        marked = self._in_flight.pop(rid, None)
        if not marked:
            return
        counts = self._in_flight_count
        for h in marked:
            c = counts[h] - 1
            if c:
                counts[h] = c
            else:
                del counts[h]

    def commit(self, request: Request) -> None:
        """After a step: cache the request's blocks made full by its computed tokens."""
        rid = request.request_id
        if rid in self._in_flight:
            self._clear_in_flight(rid)
        start = self._num_cached.get(rid)  # None: no table (caching off keeps it at 0)
        if start is None or not self.enable_caching:
            return
        end = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        if end <= start:  # most calls (decodes inside a block) end here
            return
        table = self._tables[rid]
        end = min(end, len(table))
        if end > start:
            self.block_pool.cache_full_blocks(request.block_hashes, table, start, end,
                                              request.all_token_ids)
            self._num_cached[rid] = end

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (a chain's tail is evicted before its head).

        Also forgets its swap entry, if it was swapped out.
        """
        rid = request.request_id
        if self.tiers is not None:
            self.tiers.drop_swap(rid)
        self._free_table(rid)

    def _free_table(self, rid: str) -> None:
        self._clear_in_flight(rid)
        table = self._tables.pop(rid, None)
        self._block_ids.pop(rid, None)
        self._num_cached.pop(rid, None)
        if table:
            self.block_pool.free_blocks(reversed(table))

    # -- swap and transfers ----------------------------------------------------------------------

    def swap_out(self, request: Request) -> bool:
        """Move a running request's computed blocks to the host tier and free its table.

        False — changing nothing — without a host tier or when it cannot take them.
        """
        if self.tiers is None:
            return False
        rid = request.request_id
        n = -(-request.num_computed_tokens // self.block_size)
        ids = self._block_ids.get(rid, [])[:n]
        if n == 0 or not self.tiers.swap_out(rid, ids, request.num_computed_tokens):
            return False
        self._free_table(rid)
        return True

    def swapped_tokens(self, request_id: str) -> int | None:
        """Computed tokens a swapped-out request will get back (None: not swapped out)."""
        return self.tiers.swapped_tokens(request_id) if self.tiers is not None else None

    def _swap_in_tokens(self, request: Request, num_new_tokens: int) -> tuple[int, int]:
        """(swapped tokens, tokens after this step) of a request to swap in; ValueError if it
        is not swapped out or would exceed its limits."""
        rid = request.request_id
        restored = self.swapped_tokens(rid)
        if restored is None or rid in self._tables:
            raise ValueError(f"request {rid!r} is not swapped out")
        total = restored + num_new_tokens
        if total > min(self.max_model_len, request.num_tokens):
            raise ValueError(f"request {rid!r}: {total} tokens exceed max_model_len or the "
                             "known tokens")
        return restored, total

    def swap_in(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Give a swapped-out request a table for its swapped tokens + num_new_tokens and plan
        the loads; sets num_computed_tokens. None — changing nothing — without enough blocks."""
        rid = request.request_id
        restored, total = self._swap_in_tokens(request, num_new_tokens)
        need = -(-total // self.block_size)
        if need > self.block_pool.get_num_free_blocks():
            return None
        assert self.tiers is not None
        blocks = self.block_pool.get_new_blocks(need)
        n_loaded = -(-restored // self.block_size)
        self.tiers.swap_in(rid, [b.block_id for b in blocks[:n_loaded]])
        self._tables[rid] = list(blocks)
        self._block_ids[rid] = [b.block_id for b in blocks]
        self._num_cached[rid] = 0  # commit re-offers the full blocks to the hash map
        for i, b in enumerate(blocks):
            b.num_tokens = min(self.block_size, total - i * self.block_size)
        request.num_computed_tokens = restored
        if self.enable_caching:
            self._mark_in_flight(request, total)
        return blocks

    def begin_step(self) -> None:
        """A new schedule() starts: the previous step's transfers have run."""
        if self.tiers is not None:
            self.tiers.begin_step()

    def take_transfers(self) -> TransferPlan | None:
        """The device transfers this schedule() planned (None without tiers)."""
        return self.tiers.take_plan() if self.tiers is not None else None

    def tier_stats(self) -> dict[str, float | int]:
        """Offload/swap/disk metrics (all zero without tiers)."""
        return self.tiers.get_stats() if self.tiers is not None else empty_tier_stats()

    # -- queries ---------------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block table (a copy; empty if it holds none)."""
        return list(self._tables.get(request_id, ()))

    def get_block_ids(self, request_id: str) -> list[int]:
        """Physical block ids of the request's table (a copy; empty if it holds none)."""
        return list(self._block_ids.get(request_id, ()))

    def live_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids as kept here, not copied: a copy per request per step would
        cost the table's length. Do not mutate; it grows in place as the table grows and is
        dropped (not cleared) when the request's blocks are freed."""
        ids = self._block_ids.get(request_id)
        return [] if ids is None else ids

    def num_blocks_held(self, request_id: str) -> int:
        """Length of the request's block table."""
        return len(self._tables.get(request_id, ()))

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

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes (host-tier entries too); False while any block is in use."""
        ok = self.block_pool.reset_prefix_cache()
        if ok and self.tiers is not None:
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
        """The prefix-cache hashes each tier holds ("GPU", "CPU", "DISK")."""
        out = {"GPU": set(self.block_pool.cached_blocks), "CPU": set(), "DISK": set()}
        if self.tiers is not None:
            out["CPU"] = set(self.tiers.host.prefix_hashes())
            if self.tiers.disk is not None:
                out["DISK"] = set(self.tiers.disk.hashes())
        return out

    def set_events(self, events: KVEventCollector) -> None:
        """Report every cached-block change of the pool and the tiers to `events` from now on.

        Blocks the tiers already hold are stated at once.
        """
        self.block_pool.events = events
        if self.tiers is not None:
            self.tiers.set_events(events)

    def check_invariants(self) -> None:
        """Pool invariants plus: ref counts equal the number of tables holding each block."""
        self.block_pool.check_invariants()
        refs: dict[int, int] = {}
        for rid, table in self._tables.items():
            if [b.block_id for b in table] != self._block_ids[rid]:
                raise AssertionError(f"block id mirror of {rid!r} is stale")
            for b in table:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        self._check_holders(refs)

    def _check_holders(self, refs: dict[int, int]) -> None:
        """Every block's ref count equals `refs[id]` (the tables holding it); the tiers'
        invariants hold and no swapped-out request holds device blocks."""
        for b in self.block_pool.blocks[1:]:
            if b.ref_count != refs.get(b.block_id, 0):
                raise AssertionError(f"{b}: ref_count != tables holding it "
                                     f"({refs.get(b.block_id, 0)})")
        if self.tiers is not None:
            self.tiers.check_invariants()
            for rid in self.tiers.host._swap:
                if rid in self._tables:
                    raise AssertionError(f"{rid!r} holds device blocks and a swap entry")
