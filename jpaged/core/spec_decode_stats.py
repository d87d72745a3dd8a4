"""Speculative decoding's counters (vLLM's `spec_decode_*` metrics): plain host logic."""

from __future__ import annotations

from jpaged.config import MAX_SPECULATIVE_TOKENS

__all__ = ["SpecDecodeStats"]


class SpecDecodeStats:
    """Proposals verified so far: drafts (requests with proposals, per step), proposed and
    accepted tokens, and accepted tokens by position (position j counts the drafts whose
    first j + 1 proposals were all accepted).

    Invariant: num_accepted_tokens == sum(accepted_per_pos) <= num_draft_tokens.
    """

    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * MAX_SPECULATIVE_TOKENS

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """One request's verified proposals: `num_accepted` of `num_proposed` (a prefix)."""
        if not 0 <= num_accepted <= num_proposed <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"accepted {num_accepted} of {num_proposed} proposals")
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens (0 before any proposal)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step yields per request on average: accepted proposals plus the
        one the target samples (vLLM's mean acceptance length; 0 before any proposal)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_metrics(self, num_positions: int) -> dict[str, float | int | list[int]]:
        """vLLM's names; per position for the first `num_positions` positions."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": self.accepted_per_pos[:num_positions],
            "spec_decode_acceptance_rate": self.acceptance_rate,
            "spec_decode_mean_acceptance_length": self.mean_acceptance_length,
        }
