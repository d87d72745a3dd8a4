"""The token constraints of the requests a scheduler holds: structured outputs' grammars and
bad_words, beside the scheduler (vLLM's StructuredOutputManager).

The engine core asks it, each step: whether the step's sampling must wait for the previous
step's tokens (`needs_deferral`, `needs_sync`), the scheduled rows' packed token masks
(`token_masks`), and, once the tokens are known, to advance each grammar past its request's
token (`accept_tokens`). Plain Python and numpy: the grammars are llguidance matchers made by a
`GrammarCompiler`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jpaged.core.sched_output import ScheduledRequest
from jpaged.core.structured_output import GrammarCompiler, consume, forbid, mask_words
from jpaged.request import Request

__all__ = ["StructuredOutputManager"]

logger = logging.getLogger("jpaged")


class StructuredOutputManager:
    """Grammar matchers and bad words by request id, and each step's masks from them.

    Invariant: every id in `matchers` or `bad_words` is a request the scheduler held when it
    was added; `prune` drops those it no longer holds (finished or aborted).
    """

    def __init__(self, compiler: Callable[[], GrammarCompiler], vocab_size: int) -> None:
        self._compiler = compiler  # made on first use: most engines never see a grammar
        self.vocab_size = vocab_size
        self.mask_words = mask_words(vocab_size)  # [W]: int32 words of a packed row mask
        # Each constrained request's grammar matcher (set when queued).
        self.matchers: dict[str, Any] = {}
        # bad_words: each such request's words as token sequences.
        self.bad_words: dict[str, tuple[tuple[int, ...], ...]] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler of this model's tokenizer."""
        return self._compiler()

    def add_requests(self, requests: Sequence[Request]) -> dict[str, Any]:
        """The matchers of `requests` that have a structured output, made before any of them
        is queued (a grammar that does not compile raises here, changing nothing)."""
        return {r.request_id: self.compiler.matcher(so) for r in requests
                if (so := r.sampling_params.structured_outputs) is not None}

    def track(self, requests: Sequence[Request], matchers: Mapping[str, Any]) -> None:
        """Hold `matchers` (from add_requests) and the bad words of `requests`, now queued."""
        self.matchers.update(matchers)
        for req in requests:
            words = req.sampling_params.bad_words_token_ids
            if words:
                self.bad_words[req.request_id] = words

    @property
    def active(self) -> bool:
        """True while some request has a grammar or bad words."""
        return bool(self.matchers or self.bad_words)

    def prune(self, held: Mapping[str, Request]) -> None:
        """Forget the requests the scheduler no longer holds (finished or aborted)."""
        for rid in [r for r in self.matchers if r not in held]:
            del self.matchers[rid]
        for rid in [r for r in self.bad_words if r not in held]:
            del self.bad_words[rid]

    def needs_sync(self, held: Mapping[str, Request], whole_steps: bool) -> bool:
        """True while a request whose next mask needs its previous token on the host (a
        grammar, a bad word of several tokens) is held, and the step cannot be split into
        forward and sampling (`whole_steps`: a multi-process mesh runs whole steps)."""
        if not self.active:
            return False
        self.prune(held)
        if not whole_steps:
            return False
        return bool(self.matchers) or any(len(w) > 1 for ws in self.bad_words.values()
                                          for w in ws)

    def needs_deferral(self, scheduled: Sequence[ScheduledRequest]) -> bool:
        """Whether a sampling row's mask depends on its previous token: a grammar, or a bad
        word of several tokens (one-token words give the same mask every step)."""
        if not self.active:
            return False
        for s in scheduled:
            if s.sample:
                rid = s.request.request_id
                if rid in self.matchers or any(len(w) > 1 for w in self.bad_words.get(rid, ())):
                    return True
        return False

    def token_masks(self, scheduled: Sequence[ScheduledRequest]) -> np.ndarray | None:
        """[rows, W] packed masks when a scheduled sampling row is constrained: one row per
        scheduled row, and k + 1 for one verifying k proposals (position j's mask follows the
        first j proposals: its grammar advanced past them, its bad words after them)."""
        if not self.active:
            return None
        rows: list[tuple[Any, int]] = []
        banned: list[tuple[int, list[int]]] = []
        i = 0
        for s in scheduled:
            spec = s.spec_token_ids
            if s.sample:
                rid = s.request.request_id
                m = self.matchers.get(rid)
                for j in range(len(spec) + 1):
                    if m is not None:
                        if j:  # a copy past the first j proposals (check_proposals: allowed)
                            m = self.matchers[rid].deep_copy()
                            m.consume_tokens(spec[:j])
                        rows.append((m, i + j))
                    ban = self.banned(s.request, spec[:j])
                    if ban:
                        banned.append((i + j, ban))
            i += 1 + len(spec)
        if not rows and not banned:
            return None
        masks = np.full((i, self.mask_words), -1, np.int32)
        if rows:
            self.compiler.fill_masks(rows, masks)
        for r, ban in banned:
            forbid(masks[r], ban)
        return masks

    def check_proposals(self, running: Sequence[Request]) -> None:
        """Cut each constrained request's proposals before the first token its grammar
        refuses (speculative decoding): the positions after it could not be masked, and the
        verification rejects a refused proposal anyway (its row's mask forbids it)."""
        if not self.matchers:
            return
        for req in running:
            spec = req.spec_token_ids
            if spec and (m := self.matchers.get(req.request_id)) is not None:
                n = 0 if m.is_stopped() else m.validate_tokens(spec)
                if n < len(spec):
                    del spec[n:]

    def banned(self, req: Request, after: Sequence[int] = ()) -> list[int]:
        """Tokens a request's bad_words forbid next (vLLM's rule: a word's last token, where
        the output ends with the word's other tokens; a one-token word always); `after`:
        proposals that follow its output (speculative decoding)."""
        words = self.bad_words.get(req.request_id) if self.bad_words else None
        if not words:
            return []
        out = req.output_token_ids if not after else [*req.output_token_ids, *after]
        ban = []
        for w in words:
            k = len(w) - 1
            if k == 0 or (len(out) >= k and tuple(out[len(out) - k:]) == w[:k]):
                ban.append(w[-1])
        return ban

    def accept_tokens(self, updated: Sequence[Request], rows: Sequence[int],
                      ids: Sequence[int]) -> list[int]:
        """Advance each constrained request's matcher past the token it just sampled
        (`ids[rows[i]]` for `updated[i]`); the positions in `updated` of the requests whose
        token the grammar refuses, each given the reason as its stop_reason (for the caller
        to abort them)."""
        refused: list[int] = []
        if not self.matchers or not ids:
            return refused
        for i, (req, row) in enumerate(zip(updated, rows, strict=True)):
            m = self.matchers.get(req.request_id)
            if m is None or not req.output_token_ids:
                continue
            err = consume(m, ids[row])
            if err is None:
                continue
            # Only if another constraint overrode the grammar's mask (allowed_token_ids or
            # logit_bias leaving no token the grammar allows): the request ends here, aborted
            # with the reason, rather than going on unconstrained as if it had succeeded.
            why = (err.strip().splitlines() or [""])[0][:200]
            req.stop_reason = (f"sampled token {ids[row]} is outside the request's structured "
                               f"output (another constraint, such as allowed_token_ids, left "
                               f"no token it allows): {why}")
            logger.warning("request %s aborted: %s", req.request_id, req.stop_reason)
            del self.matchers[req.request_id]
            refused.append(i)
        return refused
