"""Test helpers: a deterministic fake model and a step simulator that checks every step.

The simulator keeps a fake KV pool (one token id per slot) and checks, each step, that every
scheduled request READS exactly its own token history in the slots of its block table (so a
prefix-cache hit must point at blocks written in an EARLIER step), that no cached block is ever
written, and that the scheduler's limits and the pool invariants hold.

With ``async_scheduling`` it drives the scheduler as the overlapped engine loop does: each step
is advanced right after it is "dispatched" (``update_after_schedule``), and its sampled tokens
are applied only after the NEXT step has been scheduled; a token still in flight is fed to that
step from the fake device (``device_last``), as the jitted step does from its buffer.
"""

from __future__ import annotations

import numpy as np

from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.sched_output import PLACEHOLDER_TOKEN
from jpaged.core.scheduler import Scheduler, SchedulerOutput
from jpaged.intmath import cdiv
from jpaged.request import Request, RequestStatus
from jpaged.sampling_params import SamplingParams

VOCAB = 1000
EOS = 999


def fake_next(history: list[int]) -> int:
    """Next token as a function of the token history only (never EOS unless asked)."""
    h = len(history)
    for t in history[-4:]:
        h = (h * 31 + t) % 998
    return h


def reference_output(prompt: list[int], sp: SamplingParams, max_model_len: int) -> list[int]:
    """What an unconstrained engine generates with fake_next."""
    hist, out = list(prompt), []
    stops = sp.all_stop_token_ids
    while True:
        tok = fake_next(hist)
        hist.append(tok)
        out.append(tok)
        if tok in stops and len(out) >= sp.min_tokens:
            return out
        if (sp.max_tokens is not None and len(out) >= sp.max_tokens) or len(hist) >= max_model_len:
            return out


def make_scheduler(num_blocks: int, *, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, max_model_len: int = 256,
                   caching: bool = True, policy: str = "priority", chunked: bool = True,
                   threshold: int | None = None, algo: str = "sha256") -> Scheduler:
    """A scheduler over a pool of num_blocks blocks (block 0 is the null block)."""
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, enable_chunked_prefill=chunked,
                         long_prefill_token_threshold=threshold, scheduling_policy=policy)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=caching,
                     prefix_caching_hash_algo=algo)
    return Scheduler(sc, cc, num_blocks)


def make_request(rid: str, prompt: list[int], max_tokens: int | None = 8, *, priority: int = 0,
                 arrival: float | None = None, **sp: object) -> Request:
    """A request with SamplingParams(max_tokens=..., **sp)."""
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **sp), priority=priority,
                   arrival_time=arrival)


class Sim:
    """Drives a Scheduler with fake_next, checking every step."""

    def __init__(self, sched: Scheduler, async_scheduling: bool = False) -> None:
        self.sched = sched
        self.async_scheduling = async_scheduling
        self.device_last: dict[str, int] = {}  # token each request sampled in the last step
        self.in_flight: tuple[SchedulerOutput, dict[str, int]] | None = None
        bs = sched.block_size
        self.kv = np.full((sched.kv_cache_manager.block_pool.num_blocks, bs), -1, np.int64)
        self.outputs: list[SchedulerOutput] = []
        self.finished: dict[str, Request] = {}
        self.max_used_blocks = 0
        self.events: list[tuple[int, str]] = []  # (step, preempted id)

    def step(self) -> SchedulerOutput:
        """schedule → check → fake forward → update → check."""
        s = self.sched
        cfg = s.scheduler_config
        bs = s.block_size
        kvm = s.kv_cache_manager
        out = s.schedule()
        self.on_schedule(out)
        step = len(self.outputs)
        self.outputs.append(out)
        self.events += [(step, rid) for rid in out.preempted]
        assert out.num_scheduled_tokens == sum(x.num_tokens for x in out.scheduled)
        assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs and s.num_running <= cfg.max_num_seqs
        ids = [x.request.request_id for x in out.scheduled]
        assert len(set(ids)) == len(ids)
        for rid in out.preempted:
            assert rid not in ids and kvm.num_blocks_held(rid) == 0
        # Reads: all scheduled requests see only what earlier steps wrote.
        for x in out.scheduled:
            r = x.request
            assert r.status is RequestStatus.RUNNING
            assert x.start_pos == r.num_computed_tokens and x.num_tokens > 0
            end = x.start_pos + x.num_tokens
            assert x.token_ids == r.all_token_ids[x.start_pos:end] + [PLACEHOLDER_TOKEN] * max(
                0, end - r.num_tokens)
            assert end <= r.num_tokens_with_placeholders
            assert x.block_ids == kvm.get_block_ids(r.request_id)
            assert len(x.block_ids) == 1, "one KV cache group (no sliding layers)"
            ids = x.block_ids[0]
            assert len(ids) == cdiv(end, bs), "table must be exactly cdiv(tokens, bs)"
            assert 0 not in ids
            assert x.sample == (end == r.num_tokens_with_placeholders)
            pos = np.arange(x.start_pos)
            got = self.kv[np.asarray(ids)[pos // bs], pos % bs]
            assert got.tolist() == r.all_token_ids[:x.start_pos], f"{r.request_id} reads bad KV"
        # Writes: never into a cached (shared, immutable) block, never twice per step.
        written: set[tuple[int, int]] = set()
        pool = kvm.block_pool
        for x in out.scheduled:
            for p in range(x.start_pos, x.start_pos + x.num_tokens):
                b, o = x.block_ids[0][p // bs], p % bs
                assert pool.blocks[b].block_hash is None, f"write into cached block {b}"
                assert pool.blocks[b].ref_count == 1, f"write into shared block {b}"
                assert (b, o) not in written
                written.add((b, o))
                r = x.request
                self.kv[b, o] = (r.all_token_ids[p] if p < r.num_tokens
                                 else self.device_last[r.request_id])
        self.max_used_blocks = max(self.max_used_blocks, pool.num_blocks - 1 - kvm.num_free_blocks)
        sampled = {}
        for x in out.scheduled:
            if x.sample:
                r = x.request
                hist = r.all_token_ids + ([self.device_last[r.request_id]]
                                          if x.token_ids[-1] == PLACEHOLDER_TOKEN else [])
                sampled[r.request_id] = fake_next(hist)
        if self.async_scheduling:
            s.update_after_schedule(out)
            self.device_last.update(sampled)
            prev, self.in_flight = self.in_flight, (out, sampled) if out.scheduled else None
            if prev is not None:
                self._apply(*prev)
            elif not out.scheduled:
                self._apply(out, sampled)
        else:
            self._apply(out, sampled)
        return out

    def on_schedule(self, out: SchedulerOutput) -> None:
        """Called with each step's plan before anything is checked or run (subclasses' hook)."""

    def _apply(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        for r in self.sched.update_from_output(out, sampled):
            if r.is_finished():
                self.finished[r.request_id] = r
        self.sched.kv_cache_manager.check_invariants()
        self._check_running()

    def flush(self) -> None:
        """Apply the tokens of a step still in flight (async scheduling)."""
        prev, self.in_flight = self.in_flight, None
        if prev is not None:
            self._apply(*prev)

    def _check_running(self) -> None:
        s = self.sched
        kvm = s.kv_cache_manager
        for r in s.running:
            assert r.status is RequestStatus.RUNNING
            # At most one partly filled block: the table covers exactly the computed tokens.
            assert kvm.num_blocks_held(r.request_id) == cdiv(r.num_computed_tokens, s.block_size)
        for r in s.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert kvm.num_blocks_held(r.request_id) == 0 and r.num_computed_tokens == 0
        assert s.num_running + s.num_waiting == s.get_num_unfinished_requests()
        if self.in_flight is None:
            assert all(not r.num_output_placeholders for r in s.requests.values())

    def run(self, max_steps: int = 10_000) -> dict[str, Request]:
        """Step until nothing is left; then every block must be free."""
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        else:
            raise AssertionError("workload did not finish")
        self.assert_drained()
        return self.finished

    def assert_drained(self) -> None:
        """No leaks: every block back in the free queue, invariants hold."""
        self.flush()
        kvm = self.sched.kv_cache_manager
        assert kvm.usage == 0.0
        assert kvm.num_free_blocks == kvm.block_pool.num_blocks - 1
        assert not kvm.in_flight_hashes()
        kvm.check_invariants()
