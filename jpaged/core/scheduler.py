"""Continuous batching over the paged KV cache (seed 3.2): token budget, chunked prefill,
priorities, and preemption by recompute.

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

Memory pressure — ``allocate_slots`` returns None — is handled in the seed's order:
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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from operator import attrgetter

from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.block_pool import KVCacheBlock
from jpaged.core.kv_cache_groups import KVCacheLayout, blocks_needed
from jpaged.core.kv_cache_manager import KVCacheManager, TierHit
from jpaged.core.kv_connector import KVConnectorOutput, KVConnectorScheduler
from jpaged.core.offload import KVTiers
from jpaged.core.pressure import PressureMonitor
from jpaged.core.request_queue import QueueKey, WaitingQueue
from jpaged.core.sched_output import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from jpaged.core.token_budget import fit_token_budget
from jpaged.intmath import cdiv
from jpaged.request import Request, RequestStatus

__all__ = ["Scheduler", "ScheduledRequest", "SchedulerOutput", "is_decoding"]

RUNNING = RequestStatus.RUNNING
_NUM_TOKENS = attrgetter("num_tokens")
logger = logging.getLogger("jpaged")


class _Step:
    """Mutable state of one schedule() call."""

    def __init__(self, budget: int, num_running: int) -> None:
        self.budget = budget
        self.num_running = num_running
        self.scheduled: dict[str, ScheduledRequest] = {}
        self.preempted: list[Request] = []
        # Victim candidates: [prompt-phase, decoding], each sorted most important first; the
        # preempted ones always form a suffix (we only take tails), so tails[i] only moves down.
        self.victims: list[list[Request]] = [[], []]
        self.tails = [-1, -1]
        # Best priority among running requests that could not get memory (None: no stall).
        self.stall_priority: int | None = None


def is_decoding(request: Request) -> bool:
    """True if the request has output and only its last sampled token lacks KV."""
    # num_tokens_with_placeholders - 1 == computed, and some output (known or on device).
    # Scheduler.schedule's partition has this test written out (per request per step): keep
    # the two the same.
    n = request.num_tokens_with_placeholders
    return request.num_computed_tokens == n - 1 and n > request.num_prompt_tokens


def check_request_fits(request: Request, max_model_len: int, block_size: int,
                       num_blocks: int, layout: KVCacheLayout | None = None,
                       chunk: int = 0) -> None:
    """ValueError if `request` could never run: its prompt, or its longest length in blocks
    (with KV cache groups: the blocks of every group, sliding ones bounded by their window
    plus a `chunk` of new tokens)."""
    rid = request.request_id
    n = request.num_prompt_tokens
    if n > max_model_len:
        raise ValueError(f"request {rid!r}: prompt of {n} tokens exceeds max_model_len "
                         f"({max_model_len})")
    # Longest length it can reach; the last sampled token is never computed.
    longest = max(max_model_len, n + 1)
    if request.max_tokens is not None:
        longest = min(longest, n + request.max_tokens)
    blocks = cdiv(longest - 1, block_size)
    if layout is not None:
        blocks = blocks_needed(longest - 1, layout, block_size, chunk)
    usable = num_blocks - 1  # block 0 is the null block
    if blocks > usable:
        raise ValueError(f"request {rid!r} may need {blocks} KV blocks but the pool has only "
                         f"{usable}; lower max_tokens/max_model_len or enlarge the pool")


class Scheduler:
    """Decides, each step, which requests compute how many tokens, owning the KVCacheManager."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, tiers: KVTiers | None = None,
                 token_buckets: Sequence[int] | None = None,
                 kv_layout: KVCacheLayout | None = None,
                 connector: KVConnectorScheduler | None = None) -> None:
        self.scheduler_config = scheduler_config
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

    @property
    def held_requests(self) -> Mapping[str, Request]:
        """A producer's finished requests whose blocks wait for their consumers, by id."""
        return self._held

    def has_held_blocks(self) -> bool:
        """True while a producer holds finished requests' blocks for their consumers."""
        return bool(self._held)

    def update_from_kv_xfer(self, output: KVConnectorOutput) -> None:
        """Apply what the connector's worker side finished: free the blocks a consumer has
        pulled (or that timed out); make landed pages computed, cached blocks and queue their
        requests; a failed pull recomputes locally or fails its request (the policy)."""
        kv = self.kv_cache_manager
        for rid in output.finished_sending:
            req = self._held.pop(rid, None)
            if req is not None:
                kv.free(req)
        for rid in output.finished_recving:
            req = self.waiting_for_kv.pop(rid, None)
            if req is None:
                continue  # aborted meanwhile; its blocks were freed then
            req.num_computed_tokens = self.connector.loaded_tokens(rid)
            kv.commit(req)  # hashed and shareable, as blocks computed here
            req.status = RequestStatus.WAITING
            self._kv_loaded.add(rid)
            self.num_kv_loads += 1
            self.waiting.push(req)
        for rid, reason in output.failed_recving.items():
            req = self.waiting_for_kv.pop(rid, None)
            if req is None:
                continue
            self.connector.forget(rid)
            self.num_kv_load_failures += 1
            if self.connector.config.kv_load_failure_policy == "fail":
                logger.error("request %r: KV load failed, request failed: %s", rid, reason)
                req.status = RequestStatus.FINISHED_ABORTED
                req.stop_reason = f"KV load failed: {reason}"
                self._release(req)
                self.kv_failures.append((rid, reason))
                continue
            logger.warning("request %r: KV load failed, recomputing its prompt: %s", rid, reason)
            kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self.waiting.push(req)

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
        st = _Step(budget, len(self.running))
        st.victims = [prompts, decodes]
        st.tails = [len(prompts) - 1, len(decodes) - 1]

        kv = self.kv_cache_manager
        max_len = self.max_model_len
        for req in chain(decodes, prompts):
            if st.budget <= 0:
                break
            if req.status is not RUNNING:
                continue  # preempted earlier in this step
            n = len(req.all_token_ids) + req.num_output_placeholders
            if req.num_output_placeholders and (n >= max_len or (
                    (mt := req.sampling_params.max_tokens) is not None
                    and n - req.num_prompt_tokens >= mt)):
                # async: its last token (on device) ends it by max_tokens / max_model_len;
                # computing more is waste
                continue
            num_new = n - req.num_computed_tokens
            if num_new > 1:
                num_new = self._cap_prefill(num_new)
            if num_new > st.budget:
                num_new = st.budget
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

    def _allocate(self, req: Request, num_new: int, st: _Step,
                  hit_blocks: Sequence[Sequence[KVCacheBlock]] = (), hit_tokens: int = 0,
                  admission: bool = False, offloaded: TierHit | None = None,
                  swapped: bool = False, delay_cache_blocks: bool = False) -> bool:
        """allocate_slots (or swap_in), preempting eligible victims (stage 2, then 3) until it
        succeeds."""
        kv = self.kv_cache_manager
        while (kv.swap_in(req, num_new) if swapped else
               kv.allocate_slots(req, num_new, hit_blocks, hit_tokens, offloaded,
                                 delay_cache_blocks)) is None:
            victim = self._pick_victim(req, st, admission)
            if victim is None:
                return False
            self._preempt(victim, st)
        return True

    def _pick_victim(self, req: Request, st: _Step, admission: bool) -> Request | None:
        if admission and self.policy == "fcfs":
            return None
        for stage in (0, 1):  # 0: prompt phase (seed stage 2), 1: decoding (seed stage 3)
            lst, i = st.victims[stage], st.tails[stage]
            while i >= 0 and lst[i].status is not RUNNING:
                i -= 1
            st.tails[stage] = i
            if i < 0:
                continue
            cand = lst[i]  # the least important of its stage still running
            if admission:
                ok = cand.priority > req.priority
            else:
                ok = self._key(cand) > self._key(req)
            if ok:
                return cand
        return None

    def _preempt(self, victim: Request, st: _Step) -> None:
        kv = self.kv_cache_manager
        computed = victim.num_computed_tokens > 0
        swapped = self.swap and computed and kv.swap_out(victim)
        if not swapped:
            if self.swap and computed:
                logger.info("swap preemption of %r fell back to recompute (host tier full)",
                            victim.request_id)
            kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.pressure.on_preemption(victim.request_id, "swap" if swapped else "recompute",
                                    self.num_preemptions)
        st.num_running -= 1
        sr = st.scheduled.pop(victim.request_id, None)
        if sr is not None:  # already scheduled this step: give its tokens back
            st.budget += sr.num_tokens
        st.preempted.append(victim)

    def _add_scheduled(self, req: Request, num_new: int, st: _Step) -> None:
        start = req.num_computed_tokens
        end = start + num_new
        known = req.all_token_ids
        n_known = len(known)
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

    def _admit(self, st: _Step) -> None:
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
        while st.budget > 0 and st.num_running < cfg.max_num_seqs:
            item = (lpm.pop() if lpm else None) if lpm is not None else self.waiting.pop()
            if item is None:
                break
            key, req = item
            if req.num_output_placeholders:
                # Preempted while its last step runs: admitted once that token is known.
                skipped.append((key, req))
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
                self.running.append(req)
                st.num_running += 1
                self._add_scheduled(req, num_new, st)
                continue
            if blocked:
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

    def _start_remote_load(self, req: Request, st: _Step,
                           hit_blocks: Sequence[Sequence[KVCacheBlock]], hit_tokens: int,
                           offloaded: TierHit | None) -> str:
        """Allocate the blocks a remote engine's KV fills and plan their pull.

        Returns "waiting" (it now waits for its pages), "no_memory" (nothing changed; queue it
        again) or "local" (nothing to pull: admit it as usual).
        """
        conn = self.connector
        assert conn is not None
        problem = conn.check_remote_blocks(req)
        if problem is not None:  # the params cannot cover the prompt: as a failed pull
            req.kv_transfer_params["do_remote_prefill"] = False
            self.waiting_for_kv[req.request_id] = req
            self.update_from_kv_xfer(KVConnectorOutput(failed_recving={req.request_id: problem}))
            return "waiting"  # failed (policy "fail") or queued again to recompute
        ext, _ = conn.get_num_new_matched_tokens(req, hit_tokens)
        if ext <= 0:
            return "local"
        # Blocks for the pages and for the first chunk computed here once they land (the last
        # prompt token at least): a landed request always runs on the blocks it holds, so
        # loads that fill the pool cannot each wait for a block another one holds.
        rest = req.num_tokens - hit_tokens - ext
        local = min(self._cap_prefill(rest), self.scheduler_config.max_num_batched_tokens)
        if not self._allocate(req, ext + local, st, hit_blocks, hit_tokens, admission=True,
                              offloaded=offloaded, delay_cache_blocks=True):
            return "no_memory"
        req.num_computed_tokens = hit_tokens
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        conn.update_state_after_alloc(req, self.kv_cache_manager.get_block_ids(req.request_id),
                                      ext)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_kv[req.request_id] = req
        return "waiting"

    # -- results ---------------------------------------------------------------------------------

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
                           finished_at: list[int] | None = None) -> list[Request]:
        """Commit a computed step: advance, append sampled tokens, stop, cache, free.

        `sampled_token_ids`: request id -> token, or the step's tokens by row as Python ints
        (row i is `output.scheduled[i]`; `tolist()` of the sampled array). After
        `update_after_schedule` (async) only the tokens are applied: a request finished or
        aborted meanwhile drops its token; one preempted meanwhile keeps it (its KV was
        computed before the preemption, as the synchronous loop would have it). Returns the
        requests that got a new token (finished ones included); `rows`, when given, gets the
        row of each of them; `finished_at` the position in the returned list of each one that
        finished.
        """
        kv = self.kv_cache_manager
        changed: list[Request] = []
        finished = False
        advanced = output.advanced
        by_id = isinstance(sampled_token_ids, Mapping)
        if not by_id and len(sampled_token_ids) < len(output.scheduled):
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for a step of "
                             f"{len(output.scheduled)} rows")
        requests, bs = self.requests, self.block_size
        max_len = self.max_model_len
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
                self._advance(sr)
                if not sr.sample:
                    continue
            if not by_id:
                tok = sampled_token_ids[i]  # a list from tolist(): Python ints already
            elif rid in sampled_token_ids:
                tok = int(sampled_token_ids[rid])
            else:
                raise KeyError(f"no sampled token for scheduled request {rid!r}")
            req.append_output_token(tok)
            changed.append(req)
            if rows is not None:
                rows.append(i)
            running = req.status is RUNNING
            n = len(req.all_token_ids)
            if advanced and running and n % bs == 0:
                kv.commit(req)  # the token completed a block: it is shareable now
            # A cheap superset of _check_stop's conditions first (this runs per request per
            # step): a stop token, max_model_len, or max_tokens (outputs = n - prompt).
            if (tok in req.stop_token_ids or n >= max_len
                    or ((mt := req.sampling_params.max_tokens) is not None
                        and n - req.num_prompt_tokens >= mt)) and self._check_stop(req):
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

    def _check_stop(self, req: Request) -> bool:
        # update_from_output tests a cheap superset of these conditions before calling this:
        # a new condition here goes there too.
        out = req.output_token_ids
        tok = out[-1]
        sp = req.sampling_params
        if tok in req.stop_token_ids and len(out) >= sp.min_tokens:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = tok if tok in (sp.stop_token_ids or ()) else None
            return True
        if (sp.max_tokens is not None and len(out) >= sp.max_tokens) or \
                req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    # -- stats -----------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block; False while any block is in use."""
        return self.kv_cache_manager.reset_prefix_cache()

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
