"""N-gram (prompt lookup) proposals for speculative decoding: plain host logic, no jax.

A request whose output copies spans of its prompt or of its earlier output (code edits, quoted
documents) repeats n-grams. Given its tokens so far, the proposer finds the longest suffix of
`n` tokens (`prompt_lookup_max` >= n >= `prompt_lookup_min`) that also occurs earlier, and
proposes the up to `num_speculative_tokens` tokens that followed its most recent earlier
occurrence with that many after it (else its earliest one). The target model then verifies
them in one step, keeping its own distribution exactly (n-gram proposals are deterministic:
docs/spec_decode.md). vLLM's `ngram` method, the same field names.

Invariants: a proposal is never longer than `num_speculative_tokens`, nor than the tokens that
follow the match (the match ends before the last token, so at least one follows), nor than
`max_new` (what the request may still add); no match of at least `prompt_lookup_min` tokens
proposes nothing, and proposing nothing costs one vectorized scan per length tried.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramConfig:
    """vLLM's `ngram` speculative method's fields."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"min={self.prompt_lookup_min}, max={self.prompt_lookup_max}")


def propose_ngram(tokens: Sequence[int] | np.ndarray, config: NgramConfig,
                  max_new: int | None = None) -> list[int]:
    """The tokens that followed an earlier occurrence of the longest matching
    suffix n-gram of `tokens` (see the module doc); [] when none matches."""
    k = config.num_speculative_tokens if max_new is None else min(
        config.num_speculative_tokens, max_new)
    t = np.asarray(tokens, dtype=np.int64)
    n_tokens = t.shape[0]
    if k <= 0 or n_tokens < config.prompt_lookup_min + 1:
        return []
    for n in range(min(config.prompt_lookup_max, n_tokens - 1), config.prompt_lookup_min - 1,
                   -1):
        # Windows starting at 0 .. n_tokens - n - 1: every earlier occurrence with at least
        # one token after it (the suffix itself starts at n_tokens - n and is excluded).
        windows = sliding_window_view(t[:n_tokens - 1], n)
        hits = np.flatnonzero((windows == t[n_tokens - n:]).all(axis=1))
        if hits.size:
            # The most recent occurrence followed by k tokens; else the earliest (followed by
            # the most): in a loop the latest one overlaps the suffix and leaves one token.
            full = hits[hits + n + k <= n_tokens]
            start = int(full[-1] if full.size else hits[0]) + n
            return t[start:start + k].tolist()
    return []
