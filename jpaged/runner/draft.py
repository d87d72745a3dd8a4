"""A draft model's proposals for speculative decoding (vLLM's `draft_model` method).

The draft is a smaller model that shares the target's tokenizer. Its KV lives in pages of its
own shape indexed by the target's block ids: a block of the pool holds both models' KV for
its tokens (the pool planner counts both), so the draft needs no table, allocation or cache
of its own. Each engine step, after the schedule gave a decoding request k proposal slots
(positions n .. n + k - 1 past its n known tokens), `propose` runs the draft greedily: one
step over the tokens its pages lack (the whole prefix the first time, then what the target
accepted since), which yields the first proposal, then k - 1 single-token steps. Greedy
proposals are deterministic, so the target's verification keeps its own distribution
(docs/spec_decode.md).

Invariants: `computed[r]` draft positions of request r hold the draft's KV for r's verified
tokens; the draft writes only positions < n + k - 1, inside the slots the step holds; after
verification `computed[r]` drops to what the target kept (rejected positions are rewritten
next time). A request seen for the first time starts at 0: a prefix-cache hit has the target's
KV but maybe not the draft's, so the draft recomputes it (the same values).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jpaged.runner.model_runner import ModelRunner
from jpaged.sampling_params import SamplingParams

__all__ = ["DraftRunner"]

_GREEDY = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class _DraftRequest:
    """What the draft's step batch reads of a request: its id and greedy sampling."""

    request_id: str
    sampling_params: SamplingParams = field(default_factory=lambda: _GREEDY)
    output_token_ids: list[int] = field(default_factory=list)
    num_output_placeholders: int = 0
    stop_token_ids: frozenset[int] = frozenset()


@dataclass(slots=True)
class _Row:
    """A draft step's share of one request (a ScheduledRequest's duck type)."""

    request: _DraftRequest
    start_pos: int
    num_tokens: int
    token_ids: list[int]
    block_ids: list[list[int]]
    sample: bool = True
    spec_token_ids: list[int] = field(default_factory=list)


class DraftRunner:
    """The draft model's runner and how far each request's draft KV is computed."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.computed: dict[str, int] = {}
        self._written: dict[str, int] = {}
        self._shims: dict[str, _DraftRequest] = {}
        self.num_steps = 0  # draft steps run (catch-up and single-token)

    def propose(self, scheduled: Sequence[Any]) -> None:
        """Fill every scheduled row's reserved proposal slots (`spec_token_ids`, the tail of
        `token_ids`) with the draft's greedy tokens, in place, on request and row alike."""
        rows = [s for s in scheduled if s.spec_token_ids]
        if not rows:
            return
        drafts: list[list[int]] = [[] for _ in rows]
        batch = []
        for s in rows:
            req = s.request
            rid = req.request_id
            n = req.num_tokens  # the last known token is the step's input at n - 1
            start = min(self.computed.get(rid, 0), n - 1)
            shim = self._shims.get(rid)
            if shim is None:
                shim = self._shims[rid] = _DraftRequest(rid)
            batch.append(_Row(shim, start, n - start, req.all_token_ids[start:n], s.block_ids))
        active = list(range(len(rows)))  # rows still proposing, aligned with `batch`
        first = True
        while batch:
            toks = self._catch_up(batch) if first else self._run(batch)
            first = False
            nxt_active, nxt_batch = [], []
            for i, row, tok in zip(active, batch, toks, strict=True):
                drafts[i].append(tok)
                if len(drafts[i]) < len(rows[i].spec_token_ids):  # feed it back
                    nxt_active.append(i)
                    nxt_batch.append(_Row(row.request, row.start_pos + row.num_tokens, 1,
                                          [tok], rows[i].block_ids))
            active, batch = nxt_active, nxt_batch
        self._fill(scheduled, drafts)

    def _fill(self, scheduled: Sequence[Any], drafts: list[list[int]]) -> None:
        i = 0
        for s in scheduled:
            if not s.spec_token_ids:
                continue
            d = drafts[i]
            i += 1
            req = s.request
            n = req.num_tokens
            s.spec_token_ids[:] = d
            req.spec_token_ids = list(d)
            s.token_ids[len(s.token_ids) - len(d):] = d
            # Draft KV written for positions < n + k - 1 (its last proposal was not fed back).
            self._written[req.request_id] = n + len(d) - 1

    def _catch_up(self, batch: list[_Row]) -> list[int]:
        """The first draft step: each row's missing tokens, in steps of at most the plan's
        largest token bucket (a long prefix takes several); each row's token after its last."""
        cap = self.runner.plan.token_buckets[-1]
        out = [0] * len(batch)
        todo = [(i, r.start_pos, r.start_pos + r.num_tokens) for i, r in enumerate(batch)]
        while todo:
            step, idx, left, rest = [], [], cap, []
            for i, start, end in todo:
                take = min(end - start, left)
                if take <= 0:
                    rest.append((i, start, end))
                    continue
                r = batch[i]
                off = start - r.start_pos
                step.append(_Row(r.request, start, take, r.token_ids[off:off + take],
                                 r.block_ids))
                idx.append((i, start + take == end))
                left -= take
                if start + take < end:
                    rest.append((i, start + take, end))
            for (i, done), tok in zip(idx, self._run(step), strict=True):
                if done:
                    out[i] = tok
            todo = rest
        return out

    def _run(self, batch: list[_Row]) -> list[int]:
        """One greedy draft step over `batch`; each row's sampled token."""
        self.num_steps += 1
        result = self.runner.dispatch(batch).result()
        return np.asarray(result.token_ids[:len(batch)]).tolist()

    def after_verify(self, scheduled: Sequence[Any]) -> None:
        """The target kept what it kept: each verified request's draft KV is valid up to the
        fewer of the positions the draft wrote and those the target computed."""
        for s in scheduled:
            rid = s.request.request_id
            written = self._written.pop(rid, None)
            if written is not None:
                self.computed[rid] = min(written, s.request.num_computed_tokens)

    def truncate(self, request_id: str, num_blocks: int) -> None:
        """The request's tables lost their rejected tail (see InputBatch.truncate)."""
        self.runner.input_batch.truncate(request_id, num_blocks)

    def remove(self, request_ids: Iterable[str]) -> None:
        """Forget requests finished, aborted or preempted (their blocks are gone)."""
        ids = list(request_ids)
        self.runner.remove_requests(ids)
        for rid in ids:
            self.computed.pop(rid, None)
            self._written.pop(rid, None)
            self._shims.pop(rid, None)
