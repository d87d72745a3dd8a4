"""Memory pressure in one schedule() call: allocation that preempts, and the victim order.

When ``allocate_slots`` returns None the scheduler (1) reuses free cached blocks LRU-first
(automatic: they sit in the free queue), then preempts (2) a running request still in its
prompt phase, then (3) a decoding one, the least important first ("least important" = largest
(priority, arrival_time, seq); ``fcfs``: (arrival_time, seq)); under a priority policy the
lowest priority class goes first, stages 2 then 3 within it (a more important prompt-phase
request is never preempted while a less important one decodes). A running request only preempts
requests strictly less important than itself; at admission only the ``priority``/``lpm``
policies preempt, only requests of a strictly larger priority value, and only when preempting
all of those would make room (else nobody: the arrival waits, as vLLM's would).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from jpaged.core.block_pool import KVCacheBlock
from jpaged.core.kv_cache_manager import KVCacheManager, TierHit
from jpaged.core.pressure import PressureMonitor
from jpaged.core.sched_output import ScheduledRequest
from jpaged.request import Request, RequestStatus

__all__ = ["PreemptionMixin", "ScheduleStep"]

RUNNING = RequestStatus.RUNNING
logger = logging.getLogger("jpaged")


class ScheduleStep:
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
        self.spare_rows = 0  # rows left for proposals (speculative decoding)


class PreemptionMixin:
    """The Scheduler's allocation under pressure (its attributes are the Scheduler's)."""

    kv_cache_manager: KVCacheManager
    policy: str
    swap: bool
    num_preemptions: int
    pressure: PressureMonitor
    _key: Callable[[Request], Any]

    def _allocate(self, req: Request, num_new: int, st: ScheduleStep,
                  hit_blocks: Sequence[Sequence[KVCacheBlock]] = (), hit_tokens: int = 0,
                  admission: bool = False, offloaded: TierHit | None = None,
                  swapped: bool = False, delay_cache_blocks: bool = False) -> bool:
        """allocate_slots (or swap_in), preempting eligible victims (stage 2, then 3) until it
        succeeds. At admission nobody is preempted unless preempting every eligible victim
        would make room (a request that cannot get in must not cost others their progress)."""
        kv = self.kv_cache_manager
        checked = not admission
        while (kv.swap_in(req, num_new) if swapped else
               kv.allocate_slots(req, num_new, hit_blocks, hit_tokens, offloaded,
                                 delay_cache_blocks)) is None:
            if not checked:
                checked = True
                hits = offloaded.entries if offloaded is not None else hit_blocks
                need = kv.blocks_to_admit(req, num_new, hits, hit_tokens, swapped)
                room = kv.num_free_blocks + kv.blocks_freed_by(
                    self._eligible_victims(req, st), keep=hits)
                if need > room:
                    return False
            victim = self._pick_victim(req, st, admission)
            if victim is None:
                return False
            self._preempt(victim, st)
        return True

    def _eligible_victims(self, req: Request, st: ScheduleStep) -> list[Request]:
        """The running requests an admission of `req` may preempt (`_pick_victim`'s rule)."""
        if self.policy == "fcfs":
            return []
        return [c for stage, lst in enumerate(st.victims) for c in lst[:st.tails[stage] + 1]
                if c.status is RUNNING and c.priority > req.priority]

    def _pick_victim(self, req: Request, st: ScheduleStep, admission: bool) -> Request | None:
        """The next request to preempt for `req`: of the eligible ones, a prompt-phase request
        before a decoding one (seed stages 2, 3), but under a priority policy never a more
        important one before a less important one (the lowest priority class goes first)."""
        if admission and self.policy == "fcfs":
            return None
        found: list[Request] = []
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
                found.append(cand)
        if len(found) == 2 and self.policy != "fcfs" and found[1].priority > found[0].priority:
            return found[1]  # the decoding one is of a lower priority class
        return found[0] if found else None

    def _preempt(self, victim: Request, st: ScheduleStep) -> None:
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
        victim.spec_token_ids = []  # proposals follow tokens it will compute again
        sr = st.scheduled.pop(victim.request_id, None)
        if sr is not None:  # already scheduled this step: give its tokens back (and rows)
            st.budget += sr.num_tokens
            st.spare_rows += len(sr.spec_token_ids)
        st.preempted.append(victim)
