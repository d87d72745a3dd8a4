"""The persistent batch packs exactly what pack_step builds from scratch, step after step, over
random scheduler workloads: chunked prefill, preemption, aborts, prefix hits, penalties, seeds,
and the async loop's placeholders."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "core"))
from core_sim import Sim, make_request, make_scheduler  # noqa: E402

from jpaged.runner.batch import (  # noqa: E402
    BucketPlan,
    flatten_step,
    pack_step,
    unflatten_step,
)
from jpaged.runner.input_batch import InputBatch  # noqa: E402

VOCAB = 1000


def _assert_same_batch(got, want) -> None:
    """Every field of the two packed steps equal in dtype, shape and value, and what the
    jitted step receives (two buffers) gives the same fields back."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got.batch),
                            jax.tree_util.tree_leaves(want.batch), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    back = unflatten_step(flatten_step(got.batch))
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(got.batch),
                    strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), b)


class PackingSim(Sim):
    """Sim that packs every scheduled step both ways and compares the arrays."""

    def __init__(self, sched, async_scheduling: bool) -> None:
        super().__init__(sched, async_scheduling)
        cfg = sched.scheduler_config
        self.plan = BucketPlan(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len,
                               sched.block_size)
        self.batch = InputBatch(self.plan, sched.block_size, VOCAB, default_seed=5)
        self.prev_rows: dict[str, int] = {}
        self.packed = 0
        self.flags_seen: set = set()
        self.bans = 0  # steps that banned some row's stop tokens (min_tokens)

    def on_schedule(self, out) -> None:
        """Pack the step both ways and compare."""
        self.batch.remove(out.finished_request_ids)
        self.batch.remove(out.preempted)
        if not out.scheduled:
            return
        got = self.batch.pack(out.scheduled, self.prev_rows)
        want = pack_step(out.scheduled, self.plan, self.sched.block_size, VOCAB, 5,
                         self.prev_rows)
        assert (got.num_seqs, got.num_tokens, got.flags) == (want.num_seqs, want.num_tokens,
                                                             want.flags)
        self.flags_seen.add(got.flags)
        vals = got.batch.sampling.bias_vals
        self.bans += vals is not None and bool(np.isneginf(vals).any())
        # A pure decode step (one token per sequence) and only it says so.
        assert got.flags.decode_only == (got.num_tokens == got.num_seqs > 0)
        _assert_same_batch(got, want)
        assert self.batch.num_rows <= len(self.sched.requests)
        self.prev_rows = {s.request.request_id: i for i, s in enumerate(out.scheduled)
                          if s.sample}
        self.packed += 1


@pytest.mark.parametrize("seed", range(6))
def test_persistent_batch_packs_like_pack_step(seed):
    rng = random.Random(seed)
    async_scheduling = seed % 2 == 1
    s = make_scheduler([18, 18, 24, 24, 60, 60][seed], block_size=4, max_num_seqs=6,
                       max_num_batched_tokens=rng.choice([8, 24, 64]), max_model_len=64)
    sim = PackingSim(s, async_scheduling)
    pending = []
    for i in range(14):
        prompt = [rng.randrange(900) for _ in range(rng.randint(1, 30))]
        if i % 3 == 0:
            prompt = list(range(20)) + prompt  # a shared prefix: cache hits
        sp = {}
        if i % 4 == 1:
            # A seed past 2**31: its uint32 bits travel in the int32 buffer.
            sp = dict(temperature=0.7, seed=2**32 - 1 - i, repetition_penalty=1.2,
                      frequency_penalty=0.1)
        elif i % 4 == 2:
            sp = dict(temperature=1.0, top_k=5, top_p=0.8, min_p=0.1)
        elif i % 4 == 3:  # top candidates wanted: the step's top_logprobs flag (0: not)
            sp = dict(logprobs=2 if i % 8 == 3 else 0)
        if i % 5 == 4:  # token constraints: their rows' entries, a [B, K] class per step
            sp.update(logit_bias={3: 2.0, 7: -1.5},
                      allowed_token_ids=[1, 3, 7, 9] if i % 10 == 9 else None)
        max_tokens = rng.randint(1, 12)
        if i % 3 == 1:  # min_tokens: EOS and stop_token_ids banned until it is reached
            sp.update(min_tokens=rng.randint(1, max_tokens), stop_token_ids=[11, 13])
        pending.append((rng.randint(0, 10), make_request(f"q{i}", prompt, max_tokens,
                                                         priority=rng.randint(0, 1), **sp)))
    step = 0
    while pending or s.has_unfinished_requests():
        for _, req in [p for p in pending if p[0] <= step]:
            s.add_request(req)
        pending = [p for p in pending if p[0] > step]
        if step == 6:
            s.abort_requests([r for r in list(s.requests)[:1]])
        if s.has_unfinished_requests():
            sim.step()
        step += 1
        assert step < 1000
    sim.assert_drained()
    assert sim.packed > 5 and sim.bans > 0
    assert {f.top_logprobs for f in sim.flags_seen} == {False, True}, sim.flags_seen
    assert {f.decode_only for f in sim.flags_seen} == {False, True}, sim.flags_seen
    if seed < 2:  # the smallest pool: requests are preempted and come back with new tables
        assert sim.events
    sim.batch.remove(list(sim.batch.row_of))  # what the next schedule would report
    assert sim.batch.num_rows == 0


def test_a_fed_token_without_a_previous_row_is_refused():
    """A sequence whose input token is on device must name a row of the previous step; a
    missing one is refused, naming the request (with no rows at all, or without its own)."""
    from jpaged.core.sched_output import PLACEHOLDER_TOKEN

    class Checking(PackingSim):
        checked = 0

        def on_schedule(self, out) -> None:
            fed = [s for s in out.scheduled if s.token_ids[-1] == PLACEHOLDER_TOKEN]
            if fed:
                rid = fed[0].request.request_id
                for prev in (None, {k: v for k, v in self.prev_rows.items() if k != rid}):
                    fresh = InputBatch(self.plan, self.sched.block_size, VOCAB, default_seed=5)
                    with pytest.raises(ValueError, match=f"request '{rid}': a token on device"):
                        fresh.pack(out.scheduled, prev)
                self.checked += 1
            super().on_schedule(out)

    s = make_scheduler(40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                       max_model_len=64)
    sim = Checking(s, async_scheduling=True)
    for i in range(3):
        s.add_request(make_request(f"r{i}", list(range(5 + i)), 6))
    while s.has_unfinished_requests():
        sim.step()
    assert sim.checked > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_verifying_steps_pack_like_pack_step(seed):
    """Steps that verify proposals (beside prompt chunks and plain decodes, with penalties,
    seeds, min_tokens and logit_bias) pack the same both ways: one sequence of k + 1 tokens a
    verifying request, a sampled row at each token, its rows' counters and penalty history
    counting the proposals before them; the step's shape is the plan's."""
    from test_scheduler_spec import SpecDriver

    rng = np.random.default_rng(seed)
    sched = make_scheduler(40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                           max_model_len=96)
    sched.max_rows = 16
    plan = BucketPlan(4, 32, 96, 4, num_speculative_tokens=3)
    assert plan.max_rows == 16
    batch = InputBatch(plan, 4, VOCAB, default_seed=5)
    seen = {"verify": 0, "verify_mixed": 0}
    schedule = sched.schedule

    def packing_schedule():
        out = schedule()
        batch.remove(out.finished_request_ids)
        batch.remove(out.preempted)
        if not out.scheduled:
            return out
        got = batch.pack(out.scheduled)
        want = pack_step(out.scheduled, plan, 4, VOCAB, 5)
        assert (got.num_seqs, got.num_tokens, got.num_rows, got.flags, got.first_rows) == (
            want.num_seqs, want.num_tokens, want.num_rows, want.flags, want.first_rows)
        _assert_same_batch(got, want)
        spec = [len(s.spec_token_ids) for s in out.scheduled]
        if not any(spec):
            assert got.first_rows is None and got.num_rows == got.num_seqs
            return out
        b = got.batch
        t, bb, r = (b.input_ids.shape[0], b.seq_lens.shape[0], b.logits_indices.shape[0])
        assert (t, bb, r) == plan.pick_step(got.num_tokens, got.num_seqs, got.num_rows)
        assert not got.flags.decode_only
        mixed = got.num_tokens != got.num_rows
        seen["verify_mixed" if mixed else "verify"] += 1
        if not mixed:
            assert (t, bb, r) in plan.verify_shapes()
        assert got.num_rows == sum(k + 1 if k else 1 for k in spec)
        qsl = b.query_start_loc
        for i, (s, k) in enumerate(zip(out.scheduled, spec, strict=True)):
            first = got.first_rows[i]
            assert qsl[i + 1] - qsl[i] == s.num_tokens
            rows = range(first, first + (k + 1 if k else 1))
            want_idx = (range(qsl[i], qsl[i + 1]) if k else [qsl[i + 1] - 1])
            assert b.logits_indices[list(rows)].tolist() == list(want_idx)
            base = s.request.num_output_tokens + s.request.num_output_placeholders
            assert b.sampling.counters[list(rows)].tolist() == [base + j for j in
                                                               range(len(rows))]
        return out

    sched.schedule = packing_schedule
    update = sched.update_from_output

    def truncating_update(out, *args, **kw):  # as the engine: tables lose rejected blocks
        res = update(out, *args, **kw)
        for s in out.scheduled:
            if s.spec_token_ids:
                rid = s.request.request_id
                batch.truncate(rid, sched.kv_cache_manager.num_positions(rid))
        return res

    sched.update_from_output = truncating_update
    for i in range(8):
        prompt = rng.integers(0, 900, size=int(rng.integers(3, 40))).tolist()
        sp = {}
        if i % 3 == 1:
            sp = dict(temperature=0.7, seed=i, repetition_penalty=1.2, min_tokens=3,
                      stop_token_ids=[11])
        elif i % 3 == 2:
            sp = dict(logit_bias={3: 2.0}, logprobs=1)
        sched.add_request(make_request(f"v{i}", prompt, int(rng.integers(6, 30)), **sp))
    SpecDriver(sched, seed, max_k=3).run()
    assert seen["verify"] > 0 and seen["verify_mixed"] > 0, seen
