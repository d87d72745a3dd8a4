"""Per-kind block policies of the KV cache groups: what one kind of attention layer needs of a
request's block table (vLLM's single-type managers, as stateless policy objects).

A policy answers, from token counts and hashes alone (the manager keeps the tables):

* ``first_held(num_tokens)``: the first table position its group still reads once `num_tokens`
  tokens are computed; positions before it hold the null block (their blocks went back to the
  pool, ``release_behind``), and ``release_point`` says when the next one may go;
* ``longest_hit(hashes, held, n)``: the longest prefix hit m <= n for which the group has every
  block it needs (``held`` answers whether a block's content is available);
* ``max_blocks(num_tokens, chunk)``: the most real blocks one request holds in the group.

Full attention needs every block: it frees nothing and scans hits from the left. A sliding
window W needs the blocks covering the last W - 1 tokens before the next query, so its hits are
searched from the right. Chunked local attention (a query at p reads keys from p - p % C) fits
the same seam: a SlidingWindow whose first_held is (num_tokens - num_tokens % C) // block_size
and whose bound is cdiv(C - 1 + chunk, block_size) + 1.
"""

from __future__ import annotations

import sys
from collections.abc import Container, Sequence

from jpaged.core.block_hash import BlockHash
from jpaged.core.block_pool import KVCacheBlock
from jpaged.intmath import cdiv

NEVER = sys.maxsize  # release_point of a group that frees nothing


def sliding_blocks_bound(window: int, chunk: int, block_size: int) -> int:
    """Most blocks a request holds in a sliding group: cdiv(W - 1 + chunk, bs) + 1."""
    return cdiv(window - 1 + chunk, block_size) + 1


def first_needed_block(num_computed_tokens: int, window: int, block_size: int) -> int:
    """First block a sliding layer still reads once `num_computed_tokens` are computed: the
    next query (at that position) sees keys from num_computed - W + 1 on."""
    return max(0, num_computed_tokens - window + 1) // block_size


class BlockPolicy:
    """What one group's attention kind needs of a table (see the module docstring); the
    defaults are full attention's: every position held, hits from the left, nothing freed."""

    kind = ""
    # False when positions behind the request's tokens are never freed (first_held is 0).
    frees_behind = False
    # True when every hit shorter than an accepted one is accepted too (a prefix-closed kind:
    # the cross-group search need not ask it again after another group shortened the hit).
    prefix_closed = True

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def first_held(self, num_tokens: int) -> int:
        """First table position the group needs once `num_tokens` tokens are computed."""
        return 0

    def release_point(self, start: int) -> int:
        """Fewest computed tokens at which position `start` may be released (NEVER: never)."""
        return NEVER

    def longest_hit(self, hashes: Sequence[BlockHash], held: Container[BlockHash],
                    n: int) -> int:
        """Longest hit m <= n whose needed blocks `held` has: every block from the left."""
        i = 0
        while i < n and hashes[i] in held:
            i += 1
        return i

    def max_blocks(self, num_tokens: int, chunk: int) -> int:
        """Most real blocks a request of `num_tokens` tokens (chunks <= `chunk`) holds."""
        return cdiv(num_tokens, self.block_size)

    def release_behind(self, table: list[KVCacheBlock], ids: list[int], start: int,
                       num_tokens: int, null: KVCacheBlock) -> tuple[int, list[KVCacheBlock]]:
        """Put the null block at positions [start, first_held(num_tokens)) of a request's
        table (and 0 in its id mirror); returns the new start and the real blocks taken out,
        oldest first (the caller frees them)."""
        first = min(self.first_held(num_tokens), len(table))
        if first <= start:
            return start, []
        gone = [b for b in table[start:first] if not b.is_null]
        for i in range(start, first):
            table[i] = null
            ids[i] = 0
        return first, gone


class FullAttention(BlockPolicy):
    """Every layer reads every earlier token: every block is kept, hits scan from the left."""

    kind = "full"


class SlidingWindow(BlockPolicy):
    """A window of W tokens: blocks all of whose tokens are W - 1 or more behind the computed
    tokens are freed; a hit needs only the window's blocks before its end, found from the
    right."""

    kind = "sliding"
    frees_behind = True
    prefix_closed = False

    def __init__(self, window: int, block_size: int) -> None:
        super().__init__(block_size)
        self.window = window

    def first_held(self, num_tokens: int) -> int:
        """First block the next query (at position num_tokens) reads: from num_tokens - W + 1."""
        return max(0, num_tokens - self.window + 1) // self.block_size

    def release_point(self, start: int) -> int:
        """Fewest computed tokens t with first_held(t) > start: (start + 1) * bs + W - 1."""
        return (start + 1) * self.block_size + self.window - 1

    def longest_hit(self, hashes: Sequence[BlockHash], held: Container[BlockHash],
                    n: int) -> int:
        """Longest hit m <= n for which `held` has blocks first_held(m * bs) .. m - 1."""
        bs = self.block_size
        m = n
        while m > 0:
            first = self.first_held(m * bs)
            j = m - 1
            while j >= first and hashes[j] in held:
                j -= 1
            if j < first:
                return m
            # Block j is missing and every hit of length in (j, m] needs it (first_held is
            # monotone): the next candidate ends just before it.
            m = j
        return 0

    def max_blocks(self, num_tokens: int, chunk: int) -> int:
        """min(the blocks of all its tokens, cdiv(W - 1 + chunk, bs) + 1)."""
        return min(cdiv(num_tokens, self.block_size),
                   sliding_blocks_bound(self.window, chunk, self.block_size))


def make_policy(sliding_window: int | None, block_size: int) -> BlockPolicy:
    """The policy of a group whose layers have this window (None: full attention)."""
    if sliding_window is None:
        return FullAttention(block_size)
    return SlidingWindow(sliding_window, block_size)


def longest_common_hit(policies: Sequence[BlockPolicy], hashes: Sequence[BlockHash],
                       held: Sequence[Container[BlockHash]], n: int) -> int:
    """The longest hit <= n that every group accepts, group g having the blocks in held[g].

    The prefix-closed groups once (each accepts every hit shorter than its own), then the
    others in turn until none shortens the hit.
    """
    for p, h in zip(policies, held, strict=True):
        if p.prefix_closed and n > 0:
            n = p.longest_hit(hashes, h, n)
    again = [(p, h) for p, h in zip(policies, held, strict=True) if not p.prefix_closed]
    changed = True
    while changed and n > 0:
        changed = False
        for p, h in again:
            m = p.longest_hit(hashes, h, n)
            if m < n:
                n, changed = m, True
    return n
