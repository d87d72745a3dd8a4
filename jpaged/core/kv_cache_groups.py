"""KV cache groups: a hybrid model's layers grouped by attention type over one block pool.

A sliding-window layer with window W only ever reads the last W positions, so the blocks behind
them can go back to the pool while the request still runs (vLLM V1's hybrid KV cache).

Layout (``kv_cache_layout``): layers are grouped by their window (None = full attention). With
one kind of layer there is one group. With several, every group gets the same number of layers,
``group_size = gcd(layer counts per kind)`` (Gemma 3's 5 sliding : 1 full gives 1 full and 5
sliding groups of L/6 layers each). The device pool has ``group_size`` slots (instead of one per
layer): slot j of block b holds the KV of the j-th layer of whichever group owns b. So one block
id costs ``group_size`` layers' worth of KV, and the groups draw their blocks from one pool.

This module is the layout only: each group's block policy is in ``kv_cache_policies.py``
(``KVCacheLayout.policies``), and the one manager of every group's tables, whatever the layout,
is ``kv_cache_manager.KVCacheManager``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jpaged.core.kv_cache_policies import (
    BlockPolicy,
    first_needed_block,
    make_policy,
    sliding_blocks_bound,
)

__all__ = ["KVCacheGroupSpec", "KVCacheLayout", "blocks_needed", "first_needed_block",
           "kv_cache_layout", "sliding_blocks_bound"]


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

    def policies(self, block_size: int) -> list[BlockPolicy]:
        """Each group's block policy (kv_cache_policies.py), in group order."""
        return [make_policy(g.sliding_window, block_size) for g in self.groups]

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


def blocks_needed(longest: int, layout: KVCacheLayout, block_size: int, chunk: int) -> int:
    """Most blocks one request of `longest` scheduled tokens holds across all groups (each
    group's policy bounds its own: max_blocks)."""
    return sum(p.max_blocks(longest, chunk) for p in layout.policies(block_size))


def blocks_by_length(layout: KVCacheLayout, block_size: int, chunk: int | None
                     ) -> Callable[[int], int]:
    """`blocks_needed` as a function of the request's length; `chunk` None: no chunked
    prefill, so a request's one chunk is its whole length."""
    return lambda n: blocks_needed(n, layout, block_size, n if chunk is None else chunk)


def largest_fitting(blocks: Callable[[int], int], usable: int, longest: int) -> int:
    """The largest length <= longest whose request takes at most `usable` blocks (0: none;
    `blocks`, e.g. `blocks_by_length`, never decreases with the length): bisection."""
    lo, hi = 0, longest
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks(mid) <= usable:
            lo = mid
        else:
            hi = mid - 1
    return lo
