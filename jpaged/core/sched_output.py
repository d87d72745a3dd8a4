"""What the scheduler hands the runner each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from jpaged.core.offload import TransferPlan
from jpaged.request import Request

# Stands in ScheduledRequest.token_ids for a token sampled by the step still in flight (async
# scheduling); the jitted step reads it from its device-side buffer of last sampled tokens.
PLACEHOLDER_TOKEN = -1


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens [start_pos, start_pos + num_tokens)."""

    request: Request
    start_pos: int  # == num_computed_tokens at schedule time (prefix-cache hits included)
    num_tokens: int
    # [num_tokens] == request.all_token_ids[start_pos:start_pos+num_tokens], then
    # PLACEHOLDER_TOKEN for a last token still on device
    token_ids: list[int]
    # Per KV cache group (one for a model without sliding layers), the whole block table of
    # cdiv(start_pos + num_tokens, block_size) ids: the manager's own lists, not copies
    # (KVCacheManager.live_block_ids), exact until the next schedule(), which may append to
    # them. Read them (the runner packs them) before then; never mutate them.
    block_ids: list[list[int]]
    sample: bool  # start_pos + num_tokens == request.num_tokens: this step yields a token
    # Speculative decoding: the proposed tokens this step verifies, the last len() of
    # token_ids (the request's spec_token_ids as scheduled; [] for any other row). A row
    # with k of them yields 1 to k + 1 tokens.
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What one step computes, plus bookkeeping for the runner."""

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted: list[str]  # ids preempted (recompute) during this schedule()
    finished_request_ids: list[str] = field(default_factory=list)  # since the last schedule()
    # Device<->host block moves to run before this step's forward (None without KV tiers).
    tier_transfers: TransferPlan | None = None
    # True once Scheduler.update_after_schedule advanced its requests (async scheduling).
    advanced: bool = False

    @property
    def is_empty(self) -> bool:
        """True when nothing is computed this step."""
        return not self.scheduled
