"""Speculative decoding in the scheduler, against the fake model: proposals get slots, the
verified tokens are kept, rejected positions roll back (computed length, blocks), and nothing
unverified is ever cached; outputs equal the reference through preemption and prefix hits."""

from __future__ import annotations

import numpy as np
import pytest
from core_sim import fake_next, make_request, make_scheduler, reference_output

from jpaged.intmath import cdiv
from jpaged.request import RequestStatus


class SpecDriver:
    """Drives a Scheduler as the engine does with a proposer: proposals before each schedule
    (right ones, then maybe a wrong one), a fake forward that samples every verified position
    with fake_next, and update_from_output by row with first_rows."""

    def __init__(self, sched, seed: int = 0, max_k: int = 4) -> None:
        self.sched = sched
        self.rng = np.random.default_rng(seed)
        self.max_k = max_k
        bs = sched.block_size
        self.kv = np.full((sched.kv_cache_manager.block_pool.num_blocks, bs), -1, np.int64)
        self.finished = {}
        self.proposed = self.accepted = 0

    def _propose(self) -> None:
        for r in self.sched.running:
            n = r.num_tokens
            if r.num_computed_tokens != n - 1 or n <= r.num_prompt_tokens:
                r.spec_token_ids = []
                continue
            k = int(self.rng.integers(0, self.max_k + 1))
            k = max(0, min(k, r.length_limit - n - 1))
            hist, spec = list(r.all_token_ids), []
            for _ in range(k):
                tok = fake_next(hist)
                if self.rng.random() < 0.2:
                    tok = (tok + 1) % 998  # a wrong proposal
                spec.append(tok)
                hist.append(tok)
            r.spec_token_ids = spec

    def step(self):
        s = self.sched
        kvm = s.kv_cache_manager
        bs = s.block_size
        self._propose()
        out = s.schedule()
        assert out.num_scheduled_tokens <= s.scheduler_config.max_num_batched_tokens
        rows = sum(1 + len(x.spec_token_ids) for x in out.scheduled)
        assert rows <= s.max_rows  # every position is a row of the step
        sampled, first = [], []
        pool = kvm.block_pool
        for x in out.scheduled:
            r = x.request
            spec = x.spec_token_ids
            assert x.token_ids[len(x.token_ids) - len(spec):] == spec
            end = x.start_pos + x.num_tokens
            ids = x.block_ids[0]
            assert len(ids) == cdiv(end, bs)
            pos = np.arange(x.start_pos)
            assert self.kv[np.asarray(ids)[pos // bs], pos % bs].tolist() == \
                r.all_token_ids[:x.start_pos], f"{r.request_id} reads bad KV"
            for j, p in enumerate(range(x.start_pos, end)):
                b, o = ids[p // bs], p % bs
                assert pool.blocks[b].block_hash is None, f"write into cached block {b}"
                self.kv[b, o] = x.token_ids[j]
            first.append(len(sampled))
            if spec:
                hist = list(r.all_token_ids)
                for j in range(len(spec) + 1):
                    sampled.append(fake_next(hist + spec[:j]))
            else:
                sampled.append(fake_next(r.all_token_ids) if x.sample else -1)
        for r in s.update_from_output(out, sampled, first_rows=first):
            if r.is_finished():
                self.finished[r.request_id] = r
        kvm.check_invariants()
        for r in s.running:  # the tables cover exactly the verified, computed tokens
            assert r.spec_token_ids == []
            assert kvm.num_blocks_held(r.request_id) == cdiv(r.num_computed_tokens, bs)
            # Every cached block of a running request holds verified tokens only.
            for i, b in enumerate(kvm.get_blocks(r.request_id)[0]):
                if b.block_hash is not None:
                    assert self.kv[b.block_id].tolist() == r.all_token_ids[i * bs:(i + 1) * bs]
        return out

    def run(self, max_steps: int = 5000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        else:
            raise AssertionError("workload did not finish")
        kvm = self.sched.kv_cache_manager
        assert kvm.num_free_blocks == kvm.block_pool.num_blocks - 1
        stats = self.sched.spec_decode
        assert stats.num_accepted_tokens == sum(stats.accepted_per_pos)
        assert stats.num_accepted_tokens <= stats.num_draft_tokens
        return self.finished


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outputs_equal_reference_through_preemption_and_prefix_hits(seed):
    rng = np.random.default_rng(seed)
    # A small pool: requests preempt each other; shared prefixes hit the cache.
    sched = make_scheduler(24, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                           max_model_len=128)
    sched.max_rows = 32  # BucketPlan's rows with proposals: room for 3 a request
    shared = rng.integers(0, 998, size=12).tolist()
    reqs = []
    for i in range(10):
        tail = rng.integers(0, 998, size=int(rng.integers(1, 20))).tolist()
        prompt = (shared + tail) if i % 2 else tail
        req = make_request(f"r{i}", prompt, max_tokens=int(rng.integers(5, 40)))
        reqs.append((req, prompt))
        sched.add_request(req)
    drv = SpecDriver(sched, seed)
    done = drv.run()
    assert len(done) == len(reqs)
    for req, prompt in reqs:
        assert req.output_token_ids == reference_output(prompt, req.sampling_params, 128)
    stats = sched.spec_decode
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sched.num_preemptions > 0 and sched.get_stats()["prefix_cache_hits"] > 0


def test_rejected_blocks_are_freed_and_never_cached():
    sched = make_scheduler(64, block_size=4, max_model_len=128)
    sched.max_rows = 64
    req = make_request("a", list(range(1, 8)), max_tokens=30)  # 7 prompt tokens
    sched.add_request(req)
    kvm = sched.kv_cache_manager
    out = sched.schedule()
    sched.update_from_output(out, [fake_next(req.all_token_ids)], first_rows=[0])
    assert req.num_tokens == 8 and req.num_computed_tokens == 7
    # Propose 6 tokens, only the first right: positions 7..13 get slots (4 blocks).
    good = fake_next(req.all_token_ids)
    req.spec_token_ids = [good] + [997] * 5
    out = sched.schedule()
    (x,) = out.scheduled
    assert x.num_tokens == 7 and x.spec_token_ids == [good] + [997] * 5
    assert kvm.num_blocks_held("a") == cdiv(14, 4)
    free_before = kvm.num_free_blocks
    hist = list(req.all_token_ids)
    sampled = [fake_next(hist + x.spec_token_ids[:j]) for j in range(7)]
    changed = sched.update_from_output(out, sampled, first_rows=[0])
    assert changed == [req, req]  # the accepted proposal, then the target's own token
    assert req.output_token_ids[-2:] == sampled[:2]
    assert req.num_computed_tokens == 9  # 8 known before + the accepted proposal
    assert kvm.num_blocks_held("a") == cdiv(9, 4) == 3
    assert kvm.num_free_blocks == free_before + 1  # the block of rejected tokens only
    # Only blocks full of verified tokens are cached: 9 computed -> 2 full blocks.
    hashed = [b for b in kvm.get_blocks("a")[0] if b.block_hash is not None]
    assert len(hashed) == 2 and len(req.block_hashes) == 2
    assert sched.spec_decode.num_draft_tokens == 6 and sched.spec_decode.num_accepted_tokens == 1
    assert sched.spec_decode.accepted_per_pos[:2] == [1, 0]


def test_proposals_stop_at_eos_and_max_tokens():
    sched = make_scheduler(64, block_size=4, max_model_len=128)
    sched.max_rows = 64
    req = make_request("a", [5, 6, 7], max_tokens=4, stop_token_ids=[])
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, [fake_next(req.all_token_ids)], first_rows=[0])
    hist = list(req.all_token_ids)
    spec = []
    for _ in range(2):
        spec.append(fake_next(hist + spec))
    req.spec_token_ids = spec
    out = sched.schedule()
    sampled = [fake_next(hist + spec[:j]) for j in range(3)]
    changed = sched.update_from_output(out, sampled, first_rows=[0])
    assert len(changed) == 3 and req.status is RequestStatus.FINISHED_LENGTH
    assert req.num_output_tokens == 4
    kvm = sched.kv_cache_manager
    assert kvm.num_free_blocks == kvm.block_pool.num_blocks - 1


def test_proposal_rows_are_capped_and_leave_admission_alone():
    # max_num_seqs 3 and 4 rows a step: one proposal row beside the requests' own.
    sched = make_scheduler(64, block_size=4, max_num_seqs=3, max_model_len=128)
    sched.max_rows = 4
    a, b = make_request("a", [1, 2, 3], max_tokens=20), make_request("b", [4, 5, 6], 20)
    for r in (a, b):
        sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, [fake_next(r.all_token_ids) for r in (a, b)],
                             first_rows=[0, 1])
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3], [4, 5]
    c = make_request("c", [7, 8, 9], 20)
    sched.add_request(c)
    out = sched.schedule()
    assert sum(len(x.spec_token_ids) for x in out.scheduled) == 1
    assert sum(1 + len(x.spec_token_ids) for x in out.scheduled) == 4
    assert c in [x.request for x in out.scheduled]  # proposals never keep a request out


def test_a_proposal_never_preempts():
    # A pool with room for the input tokens but not for proposals' blocks.
    sched = make_scheduler(5, block_size=4, max_num_seqs=2, max_model_len=12)
    sched.max_rows = 16
    a = make_request("a", [1, 2, 3, 4], max_tokens=6)
    b = make_request("b", [5, 6, 7, 8], max_tokens=6)
    for r in (a, b):
        sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, [fake_next(r.all_token_ids) for r in (a, b)],
                             first_rows=[0, 1])
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]
    # 2 free blocks: each request's next token needs one; its proposals may fill the rest of
    # that block (3 positions) but take no block the other request needs.
    out = sched.schedule()
    assert sched.num_preemptions == 0 and len(out.scheduled) == 2
    assert [len(x.spec_token_ids) for x in out.scheduled] == [3, 3]
