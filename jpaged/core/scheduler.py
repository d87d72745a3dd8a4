"""Continuous batching over the paged KV cache: token budget, chunked prefill, priorities, and
preemption by recompute.

One step (``schedule``):

0. With ``token_buckets`` and chunked prefill, the token budget is first cut so the step fills
   a bucket rather than padding far up to the next one (``token_budget.py``).
1. Running requests, decodes first then in-progress prefills, each group in priority order
   (``fcfs``: arrival order). Decodes cost one token each, so a long prefill never starves them.
2. If step 1 preempted nobody, admit waiting requests in queue order
   (priority class, then preempted-first, then arrival; ``lpm``: longest cached prefix first
   within a class) until the token budget, max_num_seqs or memory runs out. A request whose next
   prefix block is being computed right now by a running request is skipped for one step, so it
   shares that block instead of computing a copy (see kv_cache_manager). While a running
   request is stalled for memory, only requests of strictly better priority are admitted
   (``fcfs``: none). Once admission stops for memory, landed remote loads behind the stop
   still start: they hold every block their first step needs (reserved with their pages).

Memory pressure — ``allocate_slots`` returns None — is handled in this order:
(1) free cached blocks are reused LRU-first: automatic, they sit in the free queue;
(2) preempt a running request still in its prompt phase (prefill or recompute in progress, not
    yet decoding), the least important first;
(3) preempt a decoding request, the least important first.
"Least important" = largest (priority, arrival_time, seq) (``fcfs``: (arrival_time, seq)). A
running request only preempts requests strictly less important than itself; it never preempts
itself: with no eligible victim it stalls this step and keeps its blocks (the most important
running request can always proceed, since add_request rejects requests the pool cannot hold).
At admission nobody is preempted (admission just stops), except under the ``priority``/``lpm``
policies, where a new request may preempt running requests of a strictly larger priority value.
Preemption = RECOMPUTE: blocks freed, num_computed_tokens = 0, outputs kept, status PREEMPTED,
requeued at the front of its priority class. With ``preemption_mode="swap"`` the victim's
computed blocks go to the host tier first (falling back to recompute, logged, when it is full)
and come back at re-admission with num_computed_tokens restored (``offload.py``).

The Scheduler is one class in four modules, by responsibility: this one (requests, the
schedule, admission, stats), ``preemption.py`` (allocation under pressure and the victim
order), ``remote_kv.py`` (the KV connector's consumer and producer state), ``step_results.py``
(applying a step: advance, append, stop, free, cache). ``request_fit.py`` has the admission
check and the decoding test as plain functions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from itertools import chain
from operator import attrgetter

from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.block_pool import KVCacheBlock
from jpaged.core.kv_cache_groups import KVCacheLayout
from jpaged.core.kv_cache_manager import KVCacheManager, TierHit
from jpaged.core.kv_connector import KVConnectorScheduler
from jpaged.core.offload import KVTiers
from jpaged.core.preemption import PreemptionMixin, ScheduleStep
from jpaged.core.pressure import PressureMonitor
from jpaged.core.remote_kv import RemoteKVMixin
from jpaged.core.request_fit import check_request_fits, is_decoding
from jpaged.core.request_queue import QueueKey, WaitingQueue
from jpaged.core.sched_output import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from jpaged.core.spec_decode_stats import SpecDecodeStats
from jpaged.core.step_results import StepResultsMixin
from jpaged.core.token_budget import fit_token_budget
from jpaged.intmath import cdiv
from jpaged.request import Request, RequestStatus

__all__ = ["Scheduler", "ScheduledRequest", "SchedulerOutput", "is_decoding"]

RUNNING = RequestStatus.RUNNING
_NUM_TOKENS = attrgetter("num_tokens")
logger = logging.getLogger("jpaged")


class Scheduler(StepResultsMixin, PreemptionMixin, RemoteKVMixin):
    """Decides, each step, which requests compute how many tokens, owning the KVCacheManager."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, tiers: KVTiers | None = None,
                 token_buckets: Sequence[int] | None = None,
                 kv_layout: KVCacheLayout | None = None,
                 connector: KVConnectorScheduler | None = None,
                 max_rows: int | None = None, max_loras: int | None = None) -> None:
        self.scheduler_config = scheduler_config
        # LoRA: the running requests use at most this many adapters at once (the device's
        # slots); None: no limit (LoRA off).
        self.max_loras = max_loras
        # Rows of a step: its requests plus their proposals (speculative decoding: each
        # proposal is scored as a row of its own); the step shapes hold at most this many.
        self.max_rows = max(max_rows or 0, scheduler_config.max_num_seqs)
        # Step token buckets (BucketPlan): with chunked prefill, each step's budget is fitted
        # to them (token_budget.py); None, or chunked prefill off, keeps the plain
        # max_num_batched_tokens budget (schedule() checks both).
        self.token_buckets = tuple(sorted(token_buckets)) if token_buckets else None
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.policy = scheduler_config.scheduling_policy
        # Request.sort_key: (priority, arrival, seq); fcfs_key: (arrival, seq). Lower first.
        self._sort_key = attrgetter("fcfs_key" if self.policy == "fcfs" else "sort_key")
        self.enable_caching = cache_config.enable_prefix_caching
        algo = cache_config.prefix_caching_hash_algo
        self.swap = cache_config.preemption_mode == "swap"
        if self.swap and tiers is None:
            raise ValueError("preemption_mode='swap' needs a host tier: set kv_offloading_size > 0")
        # KV cache groups: a request's table is per group (one full-attention group without
        # sliding layers, or None); sliding groups free the blocks behind their window.
        self.kv_cache_manager = KVCacheManager(
            self.block_size, num_blocks, self.max_model_len, self.enable_caching, algo, tiers,
            layout=kv_layout, hash_seed=cache_config.prefix_caching_hash_seed)
        self.kv_layout = self.kv_cache_manager.layout
        self._hasher = self.kv_cache_manager.block_hasher
        self.requests: dict[str, Request] = {}  # unfinished requests
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.pressure = PressureMonitor(cache_config, num_blocks)  # rate-limited warnings
        self.num_prompt_tokens = 0  # tokens computed in prompt/recompute chunks
        self.num_generation_tokens = 0  # tokens sampled
        self.num_steps = 0
        # KV connector (disaggregated prefill/decode; jpaged/core/kv_connector.py). Consumer:
        # requests whose blocks are allocated while their pages are pulled (in `requests`, not
        # in `waiting` nor `running`), and those whose pages landed (waiting, blocks held).
        # Producer: finished requests whose blocks wait for their consumer (released from
        # `requests`, blocks still held under their id).
        self.connector = connector
        self.waiting_for_kv: dict[str, Request] = {}
        self._kv_loaded: set[str] = set()
        self._held: dict[str, Request] = {}
        self.kv_failures: list[tuple[str, str]] = []  # (id, reason): failed under policy "fail"
        self.num_kv_load_failures = 0
        self.num_kv_loads = 0  # pulls that landed
        self.spec_decode = SpecDecodeStats()  # speculative decoding's verified proposals

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request; ValueError if it could never run."""
        rid = request.request_id
        if rid in self.requests or rid in self._held:
            raise ValueError(f"request id {rid!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.num_output_tokens:
            raise ValueError(f"request {rid!r} must be new (WAITING, no output)")
        check_request_fits(request, self.max_model_len, self.block_size,
                           self.kv_cache_manager.block_pool.num_blocks, self.kv_layout,
                           self.scheduler_config.max_chunk_tokens)
        if self._hasher is not None and (request.block_hasher is None or (
                request.block_hasher.block_size, request.block_hasher.algo,
                request.block_hasher.root)
                != (self._hasher.block_size, self._hasher.algo, self._hasher.root)):
            request.set_block_hasher(self._hasher)
        # Snapshot the stop ids now: the engine fills eos_token_ids before adding the request.
        request.stop_token_ids = frozenset(request.sampling_params.all_stop_token_ids)
        request.set_length_limit(self.max_model_len)
        self.requests[rid] = request
        self.waiting.push(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests (abort, or a stop string seen by the engine) and free their blocks."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"finish_requests needs a FINISHED_* status, got {status}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        done = set()
        for rid in ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if self.waiting_for_kv.pop(rid, None) is not None:
                self.connector.forget(rid)  # its pages, if they still arrive, are dropped
            elif not self.waiting.remove(rid):
                done.add(rid)
            self._kv_loaded.discard(rid)
            req.status = status
            self._release(req)
        if done:
            self.running = [r for r in self.running if r.request_id not in done]

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (FINISHED_ABORTED)."""
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def _release(self, request: Request) -> None:
        rid = request.request_id
        delay = False
        if self.connector is not None:
            delay, params = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(rid))
            request.finished_kv_transfer_params = params
        if delay:  # a producer's request: its blocks wait for the consumer's pull
            self._held[rid] = request
        else:
            self.kv_cache_manager.free(request)
        del self.requests[rid]
        self._finished_ids.append(rid)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting (for admission or remote KV) or running."""
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        """Waiting plus running requests."""
        return len(self.requests)

    @property
    def num_running(self) -> int:
        """Requests holding a place in the running batch."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission (preempted ones included)."""
        return len(self.waiting)

    # -- scheduling ------------------------------------------------------------------------------

    def _key(self, r: Request) -> tuple:
        return r.fcfs_key if self.policy == "fcfs" else r.sort_key

    def _cap_prefill(self, n: int) -> int:
        cfg = self.scheduler_config
        t = cfg.long_prefill_token_threshold
        return min(n, t) if t and cfg.enable_chunked_prefill else n

    def schedule(self) -> SchedulerOutput:
        """Plan one step: allocate blocks, preempt under memory pressure, admit new requests."""
        self.num_steps += 1
        self.kv_cache_manager.begin_step()
        budget = self.scheduler_config.max_num_batched_tokens
        self.running.sort(key=self._sort_key)
        decodes: list[Request] = []
        prompts: list[Request] = []
        for r in self.running:  # is_decoding(r), inlined: this runs per request per step
            n = len(r.all_token_ids) + r.num_output_placeholders
            (decodes if r.num_computed_tokens == n - 1 and n > r.num_prompt_tokens
             else prompts).append(r)
        if self.token_buckets is not None and self.scheduler_config.enable_chunked_prefill:
            budget = self._fitted_budget(budget, len(decodes), prompts)
        st = ScheduleStep(budget, len(self.running))
        # Proposal rows: whatever max_num_seqs requests leave of the step's rows.
        st.spare_rows = self.max_rows - self.scheduler_config.max_num_seqs
        st.victims = [prompts, decodes]
        st.tails = [len(prompts) - 1, len(decodes) - 1]

        kv = self.kv_cache_manager
        order = chain(decodes, prompts)
        for req in order:
            if st.budget <= 0:
                # The requests left out of this step verify nothing in it: their proposals
                # go (a proposal lives for the schedule it was made for).
                for r in chain((req,), order):
                    if r.spec_token_ids:
                        r.spec_token_ids = []
                break
            if req.status is not RUNNING:
                continue  # preempted earlier in this step
            n = len(req.all_token_ids) + req.num_output_placeholders
            if req.num_output_placeholders and n >= req.length_limit:
                # async: its last token (on device) ends it by length; computing more is waste
                if req.spec_token_ids:
                    req.spec_token_ids = []
                continue
            num_new = n - req.num_computed_tokens
            if num_new > 1:
                num_new = self._cap_prefill(num_new)
            if num_new > st.budget:
                num_new = st.budget
            if req.spec_token_ids:
                # Speculative decoding: a decoding request's proposals ride along, each one more
                # token of the budget and one more row of the step (rows <= max_rows), and only
                # where memory is free (nobody is preempted for a proposal). Only a decode
                # whose input token is on the host verifies (never a prompt chunk, never an
                # async decode fed on device), and at most the proposals whose verification
                # the request can still use: k + 1 tokens within its length limit
                # (max_tokens, max_model_len), so no slot lies past max_model_len.
                k = min(len(req.spec_token_ids), st.budget - num_new, st.spare_rows,
                        req.length_limit - n - 1) if (
                    num_new == 1 and not req.num_output_placeholders
                    and n > req.num_prompt_tokens) else 0
                if k > 0:
                    k = self._proposal_room(req, num_new, k, len(self.running) - len(
                        st.scheduled) - 1)
                if k > 0 and kv.allocate_slots(req, num_new + k) is not None:
                    del req.spec_token_ids[k:]
                    st.spare_rows -= k
                    self._add_scheduled(req, num_new + k, st)
                    continue
                req.spec_token_ids = []
            # First try without preempting (None changes nothing); then the preempting loop.
            if kv.allocate_slots(req, num_new) is not None or self._allocate(req, num_new, st):
                self._add_scheduled(req, num_new, st)
            elif st.stall_priority is None or req.priority < st.stall_priority:
                st.stall_priority = req.priority  # it keeps its blocks, retries next step

        if not st.preempted:
            self._admit(st)
        if st.preempted:
            self.running = [r for r in self.running if r.status is RUNNING]
            # Each push_front goes ahead of the previous one: push the least important first.
            for r in sorted(st.preempted, key=self._key, reverse=True):
                self.waiting.push_front(r)

        scheduled = list(st.scheduled.values())
        out = SchedulerOutput(scheduled, sum(map(_NUM_TOKENS, scheduled)),
                              [r.request_id for r in st.preempted], self._finished_ids,
                              self.kv_cache_manager.take_tier_transfers())
        self._finished_ids = []
        self.pressure.on_step(self.kv_cache_manager.usage, self.kv_cache_manager.num_evictions,
                              len(self.waiting))
        return out

    def _proposal_room(self, req: Request, num_new: int, k: int, others: int) -> int:
        """The most of `k` proposals whose extra blocks leave one free block (per group) for
        each of the `others` running requests still to be scheduled: proposals never take
        the block another request's next token needs."""
        kv = self.kv_cache_manager
        bs = self.block_size
        end = req.num_computed_tokens + num_new
        held = max(kv.num_positions(req.request_id), cdiv(end, bs))
        room = kv.num_free_blocks // kv.num_groups - (held - kv.num_positions(
            req.request_id)) - max(others, 0)
        while k > 0 and cdiv(end + k, bs) - held > room:
            k -= 1
        return k

    def _fitted_budget(self, budget: int, num_decodes: int, prompts: Sequence[Request]) -> int:
        """This step's budget cut so the step fills a token bucket (see token_budget.py)."""
        demand = num_decodes + sum(
            self._cap_prefill(r.num_tokens_with_placeholders - r.num_computed_tokens)
            for r in prompts)
        # Plus the waiting requests that could join, in queue order, prefix cache ignored (an
        # over-estimate only makes fitting rarer).
        room = self.scheduler_config.max_num_seqs - len(self.running)
        for req in self.waiting.first_n(max(room, 0)):
            if demand >= budget:
                break
            demand += self._cap_prefill(req.num_tokens - req.num_computed_tokens)
        return fit_token_budget(demand, budget, self.token_buckets, num_decodes)

    def _add_scheduled(self, req: Request, num_new: int, st: ScheduleStep) -> None:
        start = req.num_computed_tokens
        end = start + num_new
        known = req.all_token_ids
        n_known = len(known)
        spec = req.spec_token_ids
        if spec:  # a decode with proposals: its input token, then the proposals
            st.scheduled[req.request_id] = ScheduledRequest(
                req, start, num_new, [*known[start:], *spec],
                self.kv_cache_manager.live_block_ids(req.request_id), True, list(spec))
            st.budget -= num_new
            return
        if end <= n_known:
            ids = known[start:end]
        elif start >= n_known:  # an async decode: its input token is still on device
            ids = [PLACEHOLDER_TOKEN] * num_new
        else:  # the token still on device: the runner feeds it there
            ids = known[start:]
            ids.extend([PLACEHOLDER_TOKEN] * (end - n_known))
        st.scheduled[req.request_id] = ScheduledRequest(
            req, start, num_new, ids, self.kv_cache_manager.live_block_ids(req.request_id),
            end == n_known + req.num_output_placeholders)
        st.budget -= num_new

    def _admit(self, st: ScheduleStep) -> None:
        kv = self.kv_cache_manager
        cfg = self.scheduler_config
        lpm: list[tuple[QueueKey, Request]] | None = None
        if self.policy == "lpm":
            # Order by cached prefix length within a class. The lookups are only for ordering:
            # an earlier admission may evict blocks, so each request looks up again below.
            items = [(key, r, kv.get_computed_blocks(r)[1]) for key, r in self.waiting.drain()]
            items.sort(key=lambda it: (it[0][0], -it[2], it[0]))
            lpm = [(key, r) for key, r, _ in reversed(items)]  # pop() from the end
        skipped: list[tuple[QueueKey, Request]] = []
        # Admission stopped for memory (the queue's next request cannot get its blocks, or a
        # running request is stalled for them): from then on only landed remote loads start.
        # They hold the blocks they need (reserved with their pages), and running is how those
        # blocks come back, so none of them may wait behind a request that waits for memory.
        blocked = False
        # LoRA: the adapters of the running requests; a waiting request with another one waits
        # while they fill the device's slots (requests of the base model and of these go on).
        loras = ({r.lora_key for r in self.running if r.lora_key is not None}
                 if self.max_loras is not None else None)
        while st.budget > 0 and st.num_running < cfg.max_num_seqs:
            item = (lpm.pop() if lpm else None) if lpm is not None else self.waiting.pop()
            if item is None:
                break
            key, req = item
            if req.num_output_placeholders:
                # Preempted while its last step runs: admitted once that token is known.
                skipped.append((key, req))
                continue
            if (loras is not None and req.lora_key is not None and req.lora_key not in loras
                    and len(loras) >= self.max_loras):
                skipped.append((key, req))  # every slot holds another adapter now
                continue
            if st.stall_priority is not None and (
                    self.policy == "fcfs" or req.priority >= st.stall_priority):
                # Memory is short for a running request: only a strictly more important one
                # may be admitted (possibly preempting it).
                blocked = True
            if req.request_id in self._kv_loaded:
                # Its remote pages landed: the rest of its prompt is computed here.
                num_new = min(self._cap_prefill(req.num_tokens - req.num_computed_tokens),
                              st.budget)
                if not (kv.allocate_slots(req, num_new) is not None if blocked
                        else self._allocate(req, num_new, st, admission=True)):
                    skipped.append((key, req))
                    blocked = True
                    if not self._kv_loaded:
                        break
                    continue
                self._kv_loaded.discard(req.request_id)
                req.status = RUNNING  # first admitted when its blocks were allocated
                if loras is not None and req.lora_key is not None:
                    loras.add(req.lora_key)
                self.running.append(req)
                st.num_running += 1
                self._add_scheduled(req, num_new, st)
                continue
            if blocked:
                skipped.append((key, req))
                if not self._kv_loaded:
                    break
                continue
            if st.num_running + len(self.waiting_for_kv) + len(self._kv_loaded) \
                    >= cfg.max_num_seqs:
                # Requests whose remote pages are coming or came hold blocks and count toward
                # max_num_seqs (vLLM's rule): one more would take a slot a landed load needs
                # to run and give its blocks back (with max_num_seqs 1: a deadlock).
                skipped.append((key, req))
                if not self._kv_loaded:
                    break
                continue
            restored = kv.swapped_tokens(req.request_id)
            hit_blocks: Sequence[Sequence[KVCacheBlock]] = ()
            offloaded: TierHit | None = None
            if restored is not None:  # swapped out: its blocks come back from the host tier
                hit_tokens = restored
            else:
                # Fresh lookup: hits stay valid through _allocate (freeing never evicts).
                hit_blocks, hit_tokens = kv.get_computed_blocks(req)
                num_hit = hit_tokens // self.block_size
                offloaded = kv.get_offloaded_blocks(req, num_hit)
                if offloaded is not None:  # the tiers continue the hit
                    num_hit = offloaded.num_blocks
                    hit_tokens = num_hit * self.block_size
                if kv.is_prefix_in_flight(req, num_hit):
                    skipped.append((key, req))  # share the block next step, not a copy
                    continue
                if self.connector is not None and req.kv_transfer_params:
                    how = self._start_remote_load(req, st, hit_blocks, hit_tokens, offloaded)
                    if how == "waiting":
                        continue  # waits for its pages, taking none of this step's budget
                    if how == "no_memory":
                        skipped.append((key, req))
                        blocked = True
                        if not self._kv_loaded:
                            break
                        continue
            num_new = req.num_tokens - hit_tokens
            if not cfg.enable_chunked_prefill and num_new > st.budget:
                skipped.append((key, req))
                break
            num_new = min(self._cap_prefill(num_new), st.budget)
            if restored is not None:
                ok = self._allocate(req, num_new, st, admission=True, swapped=True)
            else:
                ok = self._allocate(req, num_new, st, hit_blocks, hit_tokens, admission=True,
                                    offloaded=offloaded)
            if not ok:
                skipped.append((key, req))
                blocked = True
                if not self._kv_loaded:
                    break
                continue
            req.status = RUNNING
            if loras is not None and req.lora_key is not None:
                loras.add(req.lora_key)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.num_computed_tokens = hit_tokens
            self.running.append(req)
            st.num_running += 1
            self._add_scheduled(req, num_new, st)
        for key, req in skipped:
            self.waiting.push(req, key)
        for key, req in lpm or ():
            self.waiting.push(req, key)

    # -- stats -----------------------------------------------------------------------------------

    def lora_names(self) -> tuple[list[str], list[str]]:
        """The LoRA adapters of the running requests and of the waiting ones, sorted names."""
        running = {r.lora_name for r in self.running if r.lora_name is not None}
        waiting = {r.lora_name for r in self.waiting if r.lora_name is not None}
        return sorted(running), sorted(waiting)

    def reset_prefix_cache(self, keep_host_tier: bool = False) -> bool:
        """Drop every cached prefix block (the host tier's too unless `keep_host_tier`); False
        while any block is in use."""
        return self.kv_cache_manager.reset_prefix_cache(keep_host_tier)

    def get_stats(self) -> dict[str, float | int]:
        """Counters and gauges for metrics (names as vLLM's where they exist)."""
        kv = self.kv_cache_manager
        ps = kv.stats
        return {
            "num_preemptions": self.num_preemptions,
            "kv_cache_usage": kv.usage,
            "num_blocks_total": kv.block_pool.num_blocks - 1,
            "num_blocks_free": kv.num_free_blocks,
            "num_requests_running": self.num_running,
            "num_requests_waiting": self.num_waiting,
            "prefix_cache_queries": ps.queries,
            "prefix_cache_hits": ps.hits,
            "prefix_cache_hit_rate": ps.hit_rate,
            "prefix_cache_hit_rate_recent": ps.recent_hit_rate,
            "cache_access_total": ps.requests,
            "num_evictions": kv.num_evictions,
            "prompt_tokens_total": self.num_prompt_tokens,
            "generation_tokens_total": self.num_generation_tokens,
            "num_steps": self.num_steps,
            # KV cache groups: 1 unless a model's sliding-window layers free blocks behind
            # their window; blocks so freed while requests ran.
            "num_kv_cache_groups": kv.num_groups,
            "num_blocks_freed_out_of_window": kv.num_freed_out_of_window,
            # KV connector (disaggregated prefill/decode)
            "kv_transfer_requests_waiting": len(self.waiting_for_kv),
            "kv_transfer_requests_held": len(self._held),
            "kv_transfer_loads_total": self.num_kv_loads,
            "kv_transfer_load_failures_policy_total": self.num_kv_load_failures,
            **kv.tier_stats(),
        }
