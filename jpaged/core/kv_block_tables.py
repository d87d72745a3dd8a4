"""One request's block tables, one per KV cache group, as the KV cache manager keeps them.

The manager (``kv_cache_manager.py``) decides what a request gets from the pool; a
``RequestTables`` holds it: per group the blocks and their id mirror (what the runner packs),
how far the tables are offered to the prefix cache, and how far each group has put the null block
behind its window. Its policies (``kv_cache_policies.py``) say which positions a group needs.

Invariants (``check``): every group's table has the same length; ``ids[g][i]`` is
``blocks[g][i].block_id`` (0 for the null block); positions [0, freed[g]) hold the null block
and the others real blocks; ``release_at`` is the fewest computed tokens at which some group
frees its next position.
"""

from __future__ import annotations

from collections.abc import Sequence

from jpaged.core.block_pool import BlockPool, KVCacheBlock
from jpaged.core.kv_cache_policies import NEVER, BlockPolicy
from jpaged.intmath import cdiv


class RequestTables:
    """A request's block table per group, its id mirrors, and how far each is cached/freed."""

    __slots__ = ("blocks", "freed", "ids", "num_cached", "release_at")

    def __init__(self, blocks: list[list[KVCacheBlock]], num_cached: int, freed: list[int],
                 policies: Sequence[BlockPolicy]) -> None:
        self.blocks = blocks
        self.ids = [[b.block_id for b in t] for t in blocks]  # 0 at the null block
        self.num_cached = num_cached  # positions offered to the maps (the same in every group)
        self.freed = freed  # per group: positions [0, freed[g]) hold the null block
        # Fewest computed tokens at which some group frees a position (NEVER: none frees).
        self.release_at = release_point(policies, freed)

    @classmethod
    def from_blocks(cls, blocks: Sequence[KVCacheBlock], firsts: Sequence[int], total: int,
                    block_size: int, null: KVCacheBlock,
                    policies: Sequence[BlockPolicy]) -> RequestTables:
        """Tables of cdiv(total, block_size) positions whose group g holds the null block
        before firsts[g] and the next of `blocks` (in order) after; none offered to the prefix
        cache yet (commit offers the full ones)."""
        n = cdiv(total, block_size)
        it = iter(blocks)
        tables: list[list[KVCacheBlock]] = []
        for g, f in enumerate(firsts):
            table = [null] * f
            for i in range(f, n):
                b = next(it)
                b.group, b.num_tokens = g, min(block_size, total - i * block_size)
                table.append(b)
            tables.append(table)
        return cls(tables, 0, list(firsts), policies)

    @property
    def num_positions(self) -> int:
        """Length of every group's table (cdiv(tokens scheduled, block_size))."""
        return len(self.blocks[0])

    def num_held(self) -> int:
        """Real blocks across all groups."""
        return sum(len(t) - f for t, f in zip(self.blocks, self.freed, strict=True))

    def release_behind(self, policies: Sequence[BlockPolicy], windowed: Sequence[int],
                       num_computed: int, pool: BlockPool) -> int:
        """Each windowed group returns to `pool` the blocks its window has left once
        `num_computed` tokens are computed (its policy says which); returns how many."""
        null, n = pool.null_block, 0
        for g in windowed:
            self.freed[g], gone = policies[g].release_behind(
                self.blocks[g], self.ids[g], self.freed[g], num_computed, null)
            if gone:
                # Oldest first in the chain, so free tail first: the chain's head stays longest.
                pool.free_blocks(reversed(gone))
                n += len(gone)
        self.release_at = release_point(policies, self.freed)
        return n

    def extend(self, fresh: Sequence[KVCacheBlock], num_new: int, first: int, total: int,
               block_size: int) -> None:
        """Append num_new blocks of `fresh` to each group (group g takes the g-th run), then
        assign slots from position `first` on: full blocks, the last holding the rest of
        `total` tokens."""
        bs = block_size
        g = 0
        for table, ids in zip(self.blocks, self.ids, strict=True):
            if num_new:
                part = fresh[g * num_new:(g + 1) * num_new]
                for b in part:
                    b.group = g  # the owner, for cache_state (cache_full_blocks sets it too)
                    ids.append(b.block_id)
                table += part
            g += 1
            for i in range(first, len(table)):
                b = table[i]
                if not b.is_null:
                    b.num_tokens = min(bs, total - i * bs)

    def needed_ids(self, policies: Sequence[BlockPolicy], num_computed: int,
                   block_size: int) -> list[int]:
        """The real block ids holding the computed tokens that each group still needs, group
        after group (what swap-out gathers)."""
        n = cdiv(num_computed, block_size)
        return [b for p, ids in zip(policies, self.ids, strict=True)
                for b in ids[p.first_held(num_computed):n]]

    def check(self, rid: str, policies: Sequence[BlockPolicy], refs: dict[int, int],
              group_of: dict[int, int]) -> None:
        """Raise AssertionError if an invariant of the module docstring is broken; count each
        real block's holders into `refs` and its group into `group_of`."""
        if len({len(t) for t in self.blocks}) != 1 or len(self.blocks) != len(policies):
            raise AssertionError(f"{rid!r}: group tables of different lengths")
        for g, table in enumerate(self.blocks):
            if [b.block_id for b in table] != self.ids[g]:
                raise AssertionError(f"block id mirror of {rid!r} group {g} is stale")
            for i, b in enumerate(table):
                if (i < self.freed[g]) != b.is_null:
                    raise AssertionError(f"{rid!r} group {g}: position {i} is "
                                         f"{'null' if b.is_null else 'real'}, freed up to "
                                         f"{self.freed[g]}")
                if b.is_null:
                    continue
                if group_of.setdefault(b.block_id, g) != g:
                    raise AssertionError(f"block {b.block_id} is in two groups' tables")
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        if self.release_at != release_point(policies, self.freed):
            raise AssertionError(f"{rid!r}: stale release point {self.release_at}")


def release_point(policies: Sequence[BlockPolicy], freed: Sequence[int]) -> int:
    """Fewest computed tokens at which some group frees position freed[g] (NEVER: none)."""
    at = NEVER
    for p, f in zip(policies, freed, strict=True):
        if p.frees_behind:
            at = min(at, p.release_point(f))
    return at
