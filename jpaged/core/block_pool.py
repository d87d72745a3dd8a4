"""Physical KV blocks, the LRU free queue, reference counts and the prefix-hash → block map.

Invariants (checked by ``BlockPool.check_invariants``):

* block 0 is the null block: never allocated, never freed, never in the free queue, never cached;
  padding in block tables points at it.
* for every other block: ``ref_count == 0`` ⇔ the block is in the free queue.
* ``b.block_hash == h and b.group == g`` ⇔ ``cached[g][h] is b`` (b is the hash's primary
  copy) or ``b`` is one of ``dups[g][h]`` (another block computed with the same content); a
  cached block may be in use (ref_count > 0) or free (reusable until it is evicted). There is
  one map per KV cache group (kv_cache_groups.py): the groups share the blocks and the free
  queue, and a block belongs to at most one group's table at a time.
* a hash has duplicates only while it has a primary: evicting the primary promotes a duplicate.
* the free queue is in eviction order: front = evicted first.

Duplicate content (vLLM keeps every computed block of a hash findable): a block computed again
with a cached block's content is cached as a duplicate, so the content stays findable until
its last copy is evicted. Lookups return the primary. KV events and the lower tiers see the
hash, not the copies: BlockStored when its first copy is cached, BlockRemoved (and the offload
of its content) only when its last copy is evicted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from jpaged.core.block_hash import BlockHash
from jpaged.kv_events import group_key

if TYPE_CHECKING:
    from jpaged.kv_events import KVEventCollector


class KVCacheBlock:
    """One physical block: id, ref count, prefix hash if cached, valid tokens, LRU."""

    __slots__ = ("block_id", "ref_count", "block_hash", "num_tokens", "last_accessed",
                 "prev_free", "next_free", "is_null", "group")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0  # number of block tables holding this block
        self.block_hash: BlockHash | None = None  # set only while in the hash map
        self.num_tokens = 0  # slots of this block assigned to tokens
        self.last_accessed = 0  # pool clock at the last allocate / touch / free
        # Links of the free queue; both None ⇔ not in the queue (sentinels excepted).
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False
        self.group = 0  # the KV cache group whose hash map holds it (meaningful while cached)

    def __repr__(self) -> str:
        return (f"KVCacheBlock({self.block_id}, ref={self.ref_count}, "
                f"cached={self.block_hash is not None}, tokens={self.num_tokens})")


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction (LRU) order, with O(1) edits in the middle."""

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)  # sentinel: head.next_free is the front
        self._tail = KVCacheBlock(-2)  # sentinel: tail.prev_free is the back
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block (the next to evict)."""
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the n front blocks, front first."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def _link(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        """Add a block at the back (evicted last)."""
        self._link(block, self._tail.prev_free, self._tail)  # type: ignore[arg-type]

    def appendleft(self, block: KVCacheBlock) -> None:
        """Add a block at the front (evicted first)."""
        self._link(block, self._head, self._head.next_free)  # type: ignore[arg-type]

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append blocks at the back in the given order."""
        for b in blocks:
            self.append(b)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks front to back (O(n); tests and debugging)."""
        out, b = [], self._head.next_free
        while b is not self._tail:
            out.append(b)
            b = b.next_free  # type: ignore[assignment]
        return out

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """All blocks of the KV pool: allocation, ref-counted freeing, LRU reuse and the hash map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, num_groups: int = 1) -> None:
        if num_blocks < 2:
            raise ValueError(f"BlockPool.num_blocks must be >= 2 (block 0 is the null block), "
                             f"got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # One prefix map per KV cache group (a hash names the same tokens in every group, but
        # each group's layers keep their own KV for them); group 0's is `cached_blocks`.
        self.group_maps: list[dict[BlockHash, KVCacheBlock]] = [{} for _ in range(num_groups)]
        self.cached_blocks = self.group_maps[0]
        # Further copies of a cached hash, per group: hash -> {block id: block}.
        self.dups: list[dict[BlockHash, dict[int, KVCacheBlock]]] = [
            {} for _ in range(num_groups)]
        self.num_evictions = 0
        self._clock = 0
        # Called as on_evict(block_id, hash) when a cached block is reused (the offload tier).
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        # Where BlockStored / BlockRemoved of this pool go (medium "GPU"); None: no events.
        self.events: KVEventCollector | None = None

    # -- allocation ------------------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop n blocks LRU-first with ref_count 1, evicting their cached hashes."""
        if n > self.free_block_queue.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only "
                             f"{self.free_block_queue.num_free_blocks} are free")
        self._clock += 1
        out = self.free_block_queue.popleft_n(n)
        for b in out:
            if b.block_hash is not None:
                self._evict(b)
            b.ref_count = 1
            b.num_tokens = 0
            b.last_accessed = self._clock
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        h, g = block.block_hash, block.group
        copies = self.dups[g].get(h)  # type: ignore[arg-type]
        if copies:  # another block still holds this content: only this copy goes
            if copies.pop(block.block_id, None) is None:  # the primary: a duplicate takes over
                _, heir = copies.popitem()
                self.group_maps[g][h] = heir  # type: ignore[index]
            if not copies:
                del self.dups[g][h]  # type: ignore[arg-type]
            block.block_hash = None
            self.num_evictions += 1
            return
        if self.on_evict is not None:  # the lower tiers key another group's block apart
            self.on_evict(block.block_id,  # type: ignore[arg-type]
                          group_key(block.block_hash, block.group))  # type: ignore[arg-type]
        del self.group_maps[block.group][block.block_hash]  # type: ignore[arg-type]
        if self.events is not None:  # after on_evict: a lower tier has taken it first
            self.events.removed([block.block_hash], "GPU",  # type: ignore[list-item]
                                group=block.group)
        block.block_hash = None
        self.num_evictions += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on (cached) blocks, pulling free ones out of the free queue."""
        self._clock += 1
        for b in blocks:
            if b.is_null:
                continue
            if b.ref_count == 0:
                self.free_block_queue.remove(b)
            b.ref_count += 1
            b.last_accessed = self._clock

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 join the free queue.

        Pass a request's blocks TAIL FIRST: cached blocks are appended in that order, so a
        chain's tail is evicted before its head. Uncached blocks hold nothing reusable and go
        to the front (they are reused before any cached block is evicted).
        """
        self._clock += 1
        q = self.free_block_queue
        for b in blocks_in_eviction_order:
            if b.is_null:
                continue
            if b.ref_count <= 0:
                raise ValueError(f"double free of block {b.block_id}")
            b.ref_count -= 1
            if b.ref_count == 0:
                b.last_accessed = self._clock
                if b.block_hash is None:
                    b.num_tokens = 0
                    q.appendleft(b)
                else:
                    q.append(b)

    # -- prefix cache ----------------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        """The block holding this prefix hash in `group`, if cached (in use or free)."""
        return self.group_maps[group].get(block_hash)

    def cache_full_blocks(self, block_hashes: Sequence[BlockHash], blocks: Sequence[KVCacheBlock],
                          num_cached_blocks: int, num_full_blocks: int,
                          token_ids: Sequence[int] | None = None, group: int = 0,
                          lora_id: int | None = None) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under block_hashes[i] in `group`.

        A hash already mapped keeps its primary; the new block joins its duplicates. Null
        blocks (a sliding group's freed positions) are skipped. `token_ids` (the sequence's
        tokens) and `lora_id` (its LoRA adapter's id) are only read for KV events.
        """
        if not self.enable_caching:
            return
        cached = self.group_maps[group]
        run: list[int] = []  # newly mapped block indices, for the events
        for i in range(num_cached_blocks, num_full_blocks):
            b = blocks[i]
            if b.block_hash is not None or b.is_null:
                continue  # already cached (a prefix hit)
            h = block_hashes[i]
            b.block_hash = h
            b.group = group
            if h in cached:  # duplicate content: findable too, the first stays the primary
                self.dups[group].setdefault(h, {})[b.block_id] = b
                continue
            cached[h] = b
            run.append(i)
        if self.events is not None and run:
            self._stored_events(block_hashes, run, token_ids or (), group, lora_id)

    def _stored_events(self, hashes: Sequence[BlockHash], run: list[int],
                       token_ids: Sequence[int], group: int, lora_id: int | None) -> None:
        # One BlockStored per stretch of consecutive block indices (its own chain).
        bs = self.events.block_size  # type: ignore[union-attr]
        start = prev = run[0]
        for i in [*run[1:], None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            self.events.stored_chain(  # type: ignore[union-attr]
                hashes[start:prev + 1], hashes[start - 1] if start else None,
                token_ids[start * bs:(prev + 1) * bs], "GPU", group=group, lora_id=lora_id)
            if i is not None:
                start = prev = i

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for m in self.group_maps:
            for b in m.values():
                b.block_hash = None
            m.clear()
        for d in self.dups:
            for copies in d.values():
                for b in copies.values():
                    b.block_hash = None
            d.clear()
        return True

    # -- accounting ------------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (cached free blocks included: they are reusable)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (null block excluded) held by requests."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    def check_invariants(self) -> None:
        """Raise AssertionError if any invariant in the module docstring is broken (O(n))."""
        free = self.free_block_queue.get_all_free_blocks()
        free_ids = {b.block_id for b in free}
        _require(len(free_ids) == len(free) == self.free_block_queue.num_free_blocks,
                 "free queue has duplicates or a wrong count")
        n = self.null_block
        _require(n.block_id == 0 and n.is_null and n.block_hash is None
                 and n.prev_free is None and n.next_free is None, "null block misused")
        for b in self.blocks[1:]:
            _require(b.ref_count >= 0, f"negative ref count on {b}")
            _require((b.ref_count == 0) == (b.block_id in free_ids),
                     f"ref_count == 0 must hold exactly for free blocks: {b}")
            if b.block_hash is not None:
                _require(self.group_maps[b.group].get(b.block_hash) is b
                         or self.dups[b.group].get(b.block_hash, {}).get(b.block_id) is b,
                         f"hash of {b} not mapped in group {b.group}")
        for g, m in enumerate(self.group_maps):
            for h, b in m.items():
                _require(b.block_hash == h and b.group == g, f"map entry disagrees with {b}")
            _require(self.enable_caching or not m, "cached blocks without caching")
            for h, copies in self.dups[g].items():
                _require(bool(copies) and h in m, f"duplicates of {h.hex()[:8]} without a primary")
                for i, b in copies.items():
                    _require(b.block_id == i and b.block_hash == h and b.group == g
                             and m[h] is not b, f"duplicate entry disagrees with {b}")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)
