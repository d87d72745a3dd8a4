"""The scheduler's side of moving KV between engines (a KV connector, vLLM V1's split).

Consumer: a request sent with ``do_remote_prefill`` is admitted with blocks for the pulled
tokens and for its first local chunk, and waits in ``waiting_for_kv`` (no budget) until its
pages land (then committed like blocks computed here, and queued: it starts on the blocks it
holds) or fail (recompute or fail, by policy). Producer: a finished remote-decode request's
blocks are held under its id until its consumer has them (``held_requests``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jpaged.core.block_pool import KVCacheBlock
from jpaged.core.kv_cache_manager import KVCacheManager, TierHit
from jpaged.core.kv_connector import KVConnectorOutput, KVConnectorScheduler
from jpaged.core.preemption import ScheduleStep
from jpaged.core.request_queue import WaitingQueue
from jpaged.request import Request, RequestStatus

__all__ = ["RemoteKVMixin"]

logger = logging.getLogger("jpaged")


class RemoteKVMixin:
    """The Scheduler's KV-connector state and steps (its attributes are the Scheduler's)."""

    kv_cache_manager: KVCacheManager
    connector: KVConnectorScheduler | None
    waiting: WaitingQueue
    waiting_for_kv: dict[str, Request]
    _kv_loaded: set[str]
    _held: dict[str, Request]
    kv_failures: list[tuple[str, str]]
    num_kv_load_failures: int
    num_kv_loads: int
    scheduler_config: Any
    _cap_prefill: Callable[[int], int]
    _release: Callable[[Request], None]
    _allocate: Callable[..., bool]

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

    def _start_remote_load(self, req: Request, st: ScheduleStep,
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
