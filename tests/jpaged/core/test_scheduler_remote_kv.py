"""The scheduler with a KV connector's consumer side: remote loads, landings and failures.

Plain Python: the worker side is played by the test, which lands (or fails) each planned pull
when it chooses. A request sent with ``do_remote_prefill`` takes its prompt's pages (all but the
last token) from another engine while it waits in WAITING_FOR_REMOTE_KVS.
"""

from __future__ import annotations

from core_sim import fake_next, make_request
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jpaged.config import CacheConfig, KVTransferConfig, SchedulerConfig
from jpaged.core.kv_connector import KVConnectorOutput, KVConnectorScheduler
from jpaged.core.scheduler import Scheduler
from jpaged.intmath import cdiv
from jpaged.request import Request, RequestStatus


def make_consumer(num_blocks: int, *, block_size: int = 16, max_num_seqs: int = 8,
                  max_num_batched_tokens: int = 64, max_model_len: int = 128,
                  policy: str = "fcfs", caching: bool = True) -> Scheduler:
    """A consumer engine's scheduler over num_blocks blocks (block 0 is the null block)."""
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, scheduling_policy=policy)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
    conn = KVConnectorScheduler(KVTransferConfig(kv_role="kv_consumer"), block_size)
    return Scheduler(sc, cc, num_blocks, connector=conn)


def remote_request(rid: str, prompt: list[int], block_size: int = 16, max_tokens: int = 4,
                   **sp: object) -> Request:
    """A request whose prompt KV a producer holds (its blocks named 1.. on the producer)."""
    req = make_request(rid, prompt, max_tokens, **sp)
    need = cdiv(len(prompt) - 1, block_size)
    req.kv_transfer_params = {
        "do_remote_prefill": True, "remote_engine_id": "producer", "remote_host": "127.0.0.1",
        "remote_port": 1, "remote_request_id": f"p-{rid}",
        "remote_block_ids": list(range(1, need + 1))}
    return req


def land_all(sched: Scheduler) -> set[str]:
    """Land every pull the scheduler has planned so far; their request ids."""
    meta = sched.connector.build_connector_meta()
    ids = {spec.request_id for spec in meta.loads} if meta is not None else set()
    if ids:
        sched.update_from_kv_xfer(KVConnectorOutput(finished_recving=ids))
    return ids


def step(sched: Scheduler) -> int:
    """Run one synchronous step with fake_next; the tokens it scheduled."""
    out = sched.schedule()
    toks = {sr.request.request_id: fake_next(sr.request.all_token_ids)
            for sr in out.scheduled if sr.sample}
    sched.update_from_output(out, toks)
    return out.num_scheduled_tokens


def test_landed_remote_loads_cannot_wedge_the_queue() -> None:
    # Two 33-token prompts pulled from a producer into 4 usable blocks of 16: each load needs
    # 2 blocks, and the last prompt token a third. Once both land, one must run to the end.
    sched = make_consumer(5)
    for rid, seed in (("a", 1), ("b", 2)):
        sched.add_request(remote_request(rid, [seed * 100 + i for i in range(33)]))
    done: list[str] = []
    for _ in range(40):
        step(sched)
        land_all(sched)
        done += [r for r in ("a", "b") if r not in sched.requests and r not in done]
        if not sched.has_unfinished_requests():
            break
    assert done == ["a", "b"], f"finished {done}; waiting {len(sched.waiting)}, running " \
                               f"{sched.num_running}, for KV {list(sched.waiting_for_kv)}"
    assert sched.kv_cache_manager.usage == 0.0


def test_loads_count_toward_max_num_seqs_so_one_slot_cannot_deadlock() -> None:
    """vLLM's test_async_loads_count_toward_active_request_limit and the max_num_seqs=1
    deadlock test: with one slot, two loads started at once landed, one ran, and the other
    held the blocks the runner needed while it could not get the slot: no progress, ever.
    Loads in flight or landed now count toward max_num_seqs."""
    for extra in ([], [make_request("r", [300 + i for i in range(16)], 40)]):
        sched = make_consumer(9, max_num_seqs=1, max_model_len=1024)  # 8 usable blocks
        reqs = [remote_request("l1", [100 + i for i in range(40)], max_tokens=60),
                remote_request("l2", [200 + i for i in range(40)], max_tokens=60), *extra]
        for r in reqs:
            sched.add_request(r)
        for _ in range(400):
            step(sched)
            land_all(sched)
            assert sched.num_running + len(sched.waiting_for_kv) <= 1
            if not sched.has_unfinished_requests():
                break
        assert not sched.has_unfinished_requests(), {
            r.request_id: (r.status.name, r.num_computed_tokens) for r in reqs}
        assert sched.kv_cache_manager.usage == 0.0


def test_a_local_request_does_not_wait_for_a_remote_load_sharing_its_prefix() -> None:
    # The remote load's pages are not computed by this engine in any step: a local request
    # with the same prefix computes it now rather than waiting until (or if) they land.
    sched = make_consumer(20)
    prompt = list(range(40))
    sched.add_request(remote_request("remote", prompt))
    step(sched)
    assert sched.waiting_for_kv.keys() == {"remote"}
    sched.add_request(make_request("local", prompt + [7, 8]))
    out = sched.schedule()
    assert [sr.request.request_id for sr in out.scheduled] == ["local"]
    assert out.scheduled[0].num_tokens == len(prompt) + 2


def test_a_landed_load_is_admitted_while_a_running_request_is_stalled() -> None:
    # A local request runs out of blocks while a remote load holds the rest of the pool. The
    # load lands: it runs on the blocks it holds (the running one being more important then
    # takes them by preemption), rather than both waiting for each other.
    sched = make_consumer(6, max_model_len=80)  # 5 usable blocks
    sched.add_request(make_request("local", list(range(500, 531)), max_tokens=40))
    step(sched)  # local: 31 prompt tokens in 2 blocks
    sched.add_request(remote_request("remote", list(range(33)), max_tokens=2))
    for _ in range(60):
        step(sched)
        land_all(sched)
        if not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests(), (
        {r: (q.status, q.num_computed_tokens) for r, q in sched.requests.items()})
    assert sched.kv_cache_manager.usage == 0.0


def test_prompt_logprobs_take_no_hit_from_the_remote_side_nor_wait_for_it() -> None:
    sched = make_consumer(20)
    req = remote_request("r", list(range(40)), prompt_logprobs=1)
    sched.add_request(req)
    out = sched.schedule()
    # Its prompt logprobs need every position computed here: nothing is pulled.
    assert not sched.waiting_for_kv
    assert [sr.num_tokens for sr in out.scheduled] == [40]
    assert req.status is RequestStatus.RUNNING


class RemoteLoadMachine(RuleBasedStateMachine):
    """Remote loads, local requests (some sharing a remote prompt's prefix), landings, failed
    pulls and aborts over a pool of a few blocks.

    Progress: while no pull is outstanding, every request holds its blocks as a running or
    landed request, so some request must be scheduled within a few steps (a running request
    stalled for memory may wait one step for a victim's preemption). While pulls are
    outstanding their blocks are out of reach, and waiting for them is memory pressure, not a
    wedge. At teardown every pull lands or fails, every request runs out, and no block leaks.
    """

    @initialize(num_blocks=st.integers(4, 14), block_size=st.sampled_from([2, 4]),
                policy=st.sampled_from(["fcfs", "priority"]),
                fail_policy=st.sampled_from(["recompute", "fail"]),
                budget=st.sampled_from([8, 64]), caching=st.booleans() | st.just(True))
    def setup(self, num_blocks, block_size, policy, fail_policy, budget, caching) -> None:
        self.bs = block_size
        sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=24,
                             scheduling_policy=policy)
        cc = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
        conn = KVConnectorScheduler(
            KVTransferConfig(kv_role="kv_consumer", kv_load_failure_policy=fail_policy),
            block_size)
        self.sched = Scheduler(sc, cc, num_blocks, connector=conn)
        self.pulls: list[str] = []  # planned and not yet landed or failed, in plan order
        self.prompts: list[list[int]] = []
        self.n = 0
        self.idle = 0  # consecutive steps that scheduled nothing though requests could run

    def _add(self, req: Request) -> None:
        try:
            self.sched.add_request(req)
        except ValueError:
            return  # cannot fit this pool at all: refused, as the engine does
        self.prompts.append(req.prompt_token_ids)

    def _prompt(self, data, length: int) -> list[int]:
        if self.prompts and data.draw(st.booleans()):  # share a prefix with an earlier one
            base = data.draw(st.sampled_from(self.prompts))
            keep = data.draw(st.integers(1, len(base)))
            return (base[:keep] + [900 + self.n + i for i in range(length)])[:20]
        return [self.n * 50 + i for i in range(length)]

    @rule(data=st.data(), length=st.integers(2, 14), max_tokens=st.integers(1, 6),
          priority=st.integers(0, 2))
    def add_remote(self, data, length, max_tokens, priority) -> None:
        self.n += 1
        req = remote_request(f"r{self.n}", self._prompt(data, length), self.bs, max_tokens)
        req.priority = priority
        req.sort_key = (priority, req.arrival_time, req.seq)
        self._add(req)

    @rule(data=st.data(), length=st.integers(1, 14), max_tokens=st.integers(1, 6),
          priority=st.integers(0, 2), logprobs=st.booleans())
    def add_local(self, data, length, max_tokens, priority, logprobs) -> None:
        self.n += 1
        req = make_request(f"l{self.n}", self._prompt(data, length), max_tokens,
                           priority=priority, prompt_logprobs=0 if logprobs else None)
        self._add(req)

    @rule()
    def step(self) -> None:
        sched = self.sched
        runnable = bool(sched.waiting) or bool(sched.running)
        scheduled = step(sched)
        meta = sched.connector.build_connector_meta()
        if meta is not None:
            self.pulls += [s.request_id for s in meta.loads]
        self.pulls = [r for r in self.pulls if r in sched.waiting_for_kv]
        self.idle = self.idle + 1 if runnable and not scheduled else 0
        if not sched.waiting_for_kv:
            assert self.idle <= 2, (
                f"no request scheduled for {self.idle} steps with no pull outstanding: "
                f"{sorted(sched.requests.values(), key=lambda r: r.seq)}, "
                f"{sched.kv_cache_manager.num_free_blocks} blocks free")

    @precondition(lambda self: self.pulls)
    @rule(data=st.data(), ok=st.booleans())
    def finish_pull(self, data, ok) -> None:
        rid = data.draw(st.sampled_from(self.pulls))
        self.pulls.remove(rid)
        out = (KVConnectorOutput(finished_recving={rid}) if ok
               else KVConnectorOutput(failed_recving={rid: "producer lost"}))
        self.sched.update_from_kv_xfer(out)

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.abort_requests(rid)

    @invariant()
    def pool_is_consistent(self) -> None:
        if hasattr(self, "sched"):
            self.sched.kv_cache_manager.check_invariants()

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        for _ in range(300):
            meta = sched.connector.build_connector_meta()
            if meta is not None:
                self.pulls += [s.request_id for s in meta.loads]
            if sched.waiting_for_kv:
                sched.update_from_kv_xfer(KVConnectorOutput(
                    finished_recving=set(sched.waiting_for_kv)))
            if not sched.has_unfinished_requests():
                break
            step(sched)
        assert not sched.has_unfinished_requests(), sorted(sched.requests)
        assert sched.kv_cache_manager.usage == 0.0


TestRemoteLoadMachine = RemoteLoadMachine.TestCase
TestRemoteLoadMachine.settings = settings(max_examples=150, stateful_step_count=40,
                                          deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
