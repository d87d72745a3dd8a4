"""Applying a step to the scheduler's requests: advance at dispatch (async scheduling), then
append the sampled tokens, stop, free finished requests and cache newly full blocks.

The stop rule is written once: a stop token once ``min_tokens`` are out, else the request's
``length_limit`` (Request.set_length_limit: max_model_len, or its prompt plus max_tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.request_queue import WaitingQueue
from jpaged.core.sched_output import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from jpaged.core.spec_decode_stats import SpecDecodeStats
from jpaged.request import Request, RequestStatus

__all__ = ["StepResultsMixin"]

RUNNING = RequestStatus.RUNNING


class StepResultsMixin:
    """The Scheduler's step application (its attributes are the Scheduler's)."""

    kv_cache_manager: KVCacheManager
    requests: dict[str, Request]
    running: list[Request]
    waiting: WaitingQueue
    block_size: int
    num_prompt_tokens: int
    num_generation_tokens: int
    _release: Callable[[Request], None]
    spec_decode: SpecDecodeStats

    def update_after_schedule(self, output: SchedulerOutput) -> None:
        """Async scheduling: advance the scheduled requests as if the step had run.

        Called once its step is dispatched, before its sampled tokens are on the host: each
        request's computed count moves past the step, a sampling request gets a placeholder for
        its token (fed to the next step on device), and full blocks of known tokens are cached
        (device steps run in dispatch order, so any later step reads them written).
        """
        if output.advanced:
            raise ValueError("update_after_schedule called twice for one step")
        output.advanced = True
        advance = self._advance
        for sr in output.scheduled:
            if sr.spec_token_ids:  # the engine runs speculative steps synchronously
                raise ValueError(f"request {sr.request.request_id!r}: a step verifying "
                                 "proposals cannot be advanced before its tokens are known")
            advance(sr)
            if sr.sample:
                sr.request.num_output_placeholders += 1

    def _advance(self, sr: ScheduledRequest) -> None:
        req = sr.request
        if req.num_computed_tokens != sr.start_pos:
            raise ValueError(f"request {req.request_id!r}: output applied twice or out of order")
        if sr.num_tokens == 1 and sr.token_ids[0] == PLACEHOLDER_TOKEN:
            # A decode fed on device (async): no prompt tokens, and no block of known tokens
            # completed (its input token is not on the host yet), so nothing to commit.
            req.num_computed_tokens += 1
            return
        if not (sr.sample and sr.num_tokens == 1
                and req.num_output_tokens + req.num_output_placeholders):
            self.num_prompt_tokens += sr.num_tokens  # a prompt or recompute chunk
        req.num_computed_tokens += sr.num_tokens
        self.kv_cache_manager.commit(req)  # its KV is written (or will be, in order)

    def update_from_output(self, output: SchedulerOutput,
                           sampled_token_ids: Mapping[str, int] | Sequence[int],
                           rows: list[int] | None = None,
                           finished_at: list[int] | None = None,
                           first_rows: Sequence[int] | None = None) -> list[Request]:
        """Commit a computed step: advance, append sampled tokens, stop, cache, free.

        `sampled_token_ids`: request id -> token, or the step's tokens by row as Python ints
        (row i is `output.scheduled[i]`; `tolist()` of the sampled array; fewer than the
        step's rows is refused, ValueError, before any request changes). After
        `update_after_schedule` (async) only the tokens are applied: a request finished or
        aborted meanwhile drops its token; one preempted meanwhile keeps it (its KV was
        computed before the preemption, as the synchronous loop would have it). Returns the
        requests that got a new token (finished ones included); `rows`, when given, gets the
        row of each of them; `finished_at` the position in the returned list of each one that
        finished.

        Speculative decoding: a row with k proposals (`sr.spec_token_ids`) was sampled at
        k + 1 rows, from `first_rows[i]` on (None: row i is i, no proposals in the step). Its
        proposals are accepted while each equals the token sampled before it; the request
        gains those and the token sampled after the last accepted one (1 .. k + 1 tokens, each
        listed in the returned list with its row, in order, up to a stop). Its computed count
        rolls back to the verified tokens and the blocks that held only rejected proposals
        are freed before anything is cached (KVCacheManager.trim, then commit).
        """
        kv = self.kv_cache_manager
        changed: list[Request] = []
        finished = False
        advanced = output.advanced
        by_id = isinstance(sampled_token_ids, Mapping)
        if not by_id:
            # Every row the step sampled, before any request changes: the last scheduled
            # request's rows end the step (first_rows ascend, as step_rows makes them).
            num_rows = len(output.scheduled)
            if first_rows is not None and num_rows:
                num_rows = first_rows[-1] + 1 + len(output.scheduled[-1].spec_token_ids)
            if len(sampled_token_ids) < num_rows:
                raise ValueError(f"{len(sampled_token_ids)} sampled tokens for a step of "
                                 f"{num_rows} rows")
        requests, bs = self.requests, self.block_size
        for i, sr in enumerate(output.scheduled):
            req = sr.request
            rid = req.request_id
            # Live: still this scheduler's request, so not finished (every finish releases
            # it from `requests`) nor aborted and replaced by another of the same id.
            live = requests.get(rid) is req
            if advanced:
                if sr.sample:
                    req.num_output_placeholders -= 1
                if not live or not sr.sample:
                    continue
            else:
                if req.status is not RUNNING or not live:
                    continue  # finished or aborted since schedule()
                if sr.spec_token_ids:
                    if by_id or first_rows is None:
                        raise ValueError(f"request {rid!r} verified proposals: its tokens come "
                                         "by row, with first_rows")
                    if self._apply_verified(sr, sampled_token_ids, first_rows[i], changed, rows,
                                            finished_at):
                        finished = True
                    continue
                self._advance(sr)
                if not sr.sample:
                    continue
            row = i if first_rows is None else first_rows[i]  # the row sampled for it
            if not by_id:
                tok = sampled_token_ids[row]  # a list from tolist(): Python ints already
            elif rid in sampled_token_ids:
                tok = int(sampled_token_ids[rid])
            else:
                raise KeyError(f"no sampled token for scheduled request {rid!r}")
            req.append_output_token(tok)
            changed.append(req)
            if rows is not None:
                rows.append(row)
            running = req.status is RUNNING
            n = len(req.all_token_ids)
            if advanced and running and n % bs == 0:
                kv.commit(req)  # the token completed a block: it is shareable now
            # A cheap superset of _check_stop's conditions first (this runs per request per
            # step): a stop token, or the length limit.
            if (tok in req.stop_token_ids or n >= req.length_limit) and self._check_stop(req):
                if finished_at is not None:
                    finished_at.append(len(changed) - 1)
                if running:
                    finished = True
                else:  # preempted: it waits in the queue
                    self.waiting.remove(rid)
                self._release(req)
        self.num_generation_tokens += len(changed)
        if finished:
            self.running = [r for r in self.running if r.status is RUNNING]
        return changed

    def _apply_verified(self, sr: ScheduledRequest, sampled: Sequence[int], first: int,
                        changed: list[Request], rows: list[int] | None,
                        finished_at: list[int] | None) -> bool:
        """A verified row (see update_from_output): accept, append, roll back, cache. True if
        the request finished."""
        req = sr.request
        if req.num_computed_tokens != sr.start_pos:
            raise ValueError(f"request {req.request_id!r}: output applied twice or out of order")
        drafts = sr.spec_token_ids
        k = len(drafts)
        got = sampled[first:first + k + 1]
        m = 0
        while m < k and got[m] == drafts[m]:
            m += 1
        self.spec_decode.record(k, m)
        req.spec_token_ids = []
        # The KV of the input token and the m accepted proposals is what the step computed
        # right; the positions after them are rejected and computed again later.
        req.num_computed_tokens = sr.start_pos + 1 + m
        kv = self.kv_cache_manager
        kv.trim(req)
        for j in range(m + 1):
            tok = got[j]
            req.append_output_token(tok)
            changed.append(req)
            if rows is not None:
                rows.append(first + j)
            if (tok in req.stop_token_ids or req.num_tokens >= req.length_limit) \
                    and self._check_stop(req):
                if finished_at is not None:
                    finished_at.append(len(changed) - 1)
                self._release(req)
                return True
        kv.commit(req)  # blocks now full of verified tokens are shareable
        return False

    def _check_stop(self, req: Request) -> bool:
        # The stop rule (a stop token once min_tokens are out, else the length limit of
        # Request.set_length_limit). update_from_output tests a cheap superset of it before
        # calling this: a new condition here goes there too.
        out = req.output_token_ids
        tok = out[-1]
        sp = req.sampling_params
        if tok in req.stop_token_ids and len(out) >= sp.min_tokens:
            req.status = RequestStatus.FINISHED_STOPPED
            # As vLLM: the primary EOS (the tokenizer's) stops with no stop_reason; any other
            # stop token, a generation_config EOS included, is the reason.
            eos = sp.eos_token_ids
            req.stop_reason = None if eos and tok == eos[0] and not sp.ignore_eos else tok
            return True
        if req.num_tokens >= req.length_limit:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
