"""Speculative decoding's proposer: the scheduler's collaborator that proposes tokens for the
decoding requests before each schedule (vLLM's `ngram` and `suffix` methods; for
`draft_model` it reserves the slots, which the draft model fills after the schedule). Plain
host logic, no jax.

The engine core calls `propose(running)` before every schedule; each decoding request gets
`spec_token_ids` (possibly none), the scheduler gives them slots, the runner scores them in the
step and `step_results.py` keeps the accepted ones. Invariants: only a request decoding with
its last token on the host proposes; a proposal never lets a verifying step yield more tokens
than the request may still add (max_tokens, max_model_len); every other running request's
`spec_token_ids` is []. A proposer error is the request's alone (`failures`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jpaged.config import SpeculativeConfig
from jpaged.core.ngram_proposer import NgramConfig, propose_ngram
from jpaged.core.suffix_proposer import SuffixConfig, SuffixProposer
from jpaged.request import Request, RequestStatus

__all__ = ["DRAFT_PLACEHOLDER", "Proposer"]

# A proposal slot a draft model fills after the schedule (never a token the target sees).
DRAFT_PLACEHOLDER = 0

logger = logging.getLogger("jpaged")


class Proposer:
    """Proposals for the running requests, by the configured method."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.method = config.method
        self.num_speculative_tokens = int(config.num_speculative_tokens or 0)
        # vLLM's speculative max_model_len: no proposal takes a request past it.
        self.max_len = config.max_model_len
        self._ngram = NgramConfig(self.num_speculative_tokens, int(config.prompt_lookup_max),
                                  int(config.prompt_lookup_min))
        self._suffix = SuffixProposer(SuffixConfig(
            self.num_speculative_tokens, config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests, config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob)) if self.method == "suffix" else None
        # suffix: the requests whose tokens the trees hold, and how many of them.
        self._tracked: dict[str, tuple[Request, int]] = {}

    def propose(self, running: Sequence[Request]) -> list[tuple[str, str]]:
        """Set `spec_token_ids` of every running request; (id, reason) of those whose
        proposer failed (they propose nothing; the caller ends them)."""
        failures: list[tuple[str, str]] = []
        if self._suffix is not None:
            self._sync_suffix(running)
        for req in running:
            n = len(req.all_token_ids)
            # Decoding with its last token on the host (the tokens it proposes after).
            if (req.num_output_placeholders or req.num_computed_tokens != n - 1
                    or n <= req.num_prompt_tokens or req.is_finished()):
                req.spec_token_ids = []
                continue
            limit = req.length_limit if self.max_len is None else min(req.length_limit,
                                                                     self.max_len)
            room = limit - n - 1  # a verifying step adds up to k + 1 tokens
            if room <= 0:
                req.spec_token_ids = []
                continue
            if self.method == "draft_model":
                # Slots only: the draft model writes the tokens once the step is scheduled
                # (the runner's DraftRunner), into the positions these reserve.
                req.spec_token_ids = [DRAFT_PLACEHOLDER] * min(self.num_speculative_tokens, room)
                continue
            try:
                if self._suffix is not None:
                    spec = self._suffix.propose(req.request_id, room)
                else:
                    spec = propose_ngram(req.all_token_ids, self._ngram, room)
            except Exception as e:  # one request's proposer broke: end it, not the engine
                logger.exception("proposer failed for request %s", req.request_id)
                failures.append((req.request_id, f"speculative proposer failed: {e}"))
                spec = []
            req.spec_token_ids = list(spec)
        return failures

    def _sync_suffix(self, running: Sequence[Request]) -> None:
        """Bring the suffix trees up to date: new requests start, running ones gain the tokens
        added since, and those gone stop (a finished response joins the global tree)."""
        suffix = self._suffix
        assert suffix is not None
        live = {r.request_id for r in running}
        for rid in [r for r in self._tracked if r not in live]:
            req, _ = self._tracked[rid]
            if req.is_finished() or req.status is not RequestStatus.PREEMPTED:
                done = req.status in (RequestStatus.FINISHED_STOPPED,
                                      RequestStatus.FINISHED_LENGTH)
                suffix.stop_request(rid, cache_response=done)
                del self._tracked[rid]
        for req in running:
            rid = req.request_id
            entry = self._tracked.get(rid)
            n = len(req.all_token_ids)
            if entry is None or entry[0] is not req:
                if entry is not None:  # the id was reused by a new request
                    suffix.stop_request(rid, cache_response=False)
                suffix.start_request(rid, req.prompt_token_ids)
                seen = req.num_prompt_tokens
            else:
                seen = entry[1]
            if n > seen:
                suffix.extend(rid, req.all_token_ids[seen:n])
            self._tracked[rid] = (req, n)

    def reset_cache(self) -> None:
        """Drop the suffix method's tree of earlier responses (the running requests' own
        trees stay); nothing for the other methods."""
        if self._suffix is not None:
            self._suffix.clear_cache()

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop the state of requests that ended (aborted or failed) without a response."""
        if self._suffix is None:
            return
        for rid in request_ids:
            if self._tracked.pop(rid, None) is not None:
                self._suffix.stop_request(rid, cache_response=False)
