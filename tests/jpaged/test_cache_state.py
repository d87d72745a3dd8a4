"""LLM.cache_state() and LLM.metrics_history() against the engine's own host state, step by step."""

from __future__ import annotations

import json

import pytest
from helpers import make_llm, tiny

from jpaged import LLM, SamplingParams
from jpaged.core.cache_state import CACHED_FREE, FREE, IN_USE, NULL
from jpaged.core.metrics_history import FIELDS, MetricsHistory
from jpaged.intmath import cdiv

# The engine shape of tests/jpaged/test_engine.py, so the compiled steps are shared.
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              num_gpu_blocks_override=128, block_size=8)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm(tiny(), **ENGINE)


def _assert_matches_truth(llm: LLM, state: dict) -> None:
    """Every field of the snapshot agrees with the scheduler, the manager and the pool."""
    sched = llm.llm_engine.scheduler
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    kv.check_invariants()
    assert state["num_blocks"] == pool.num_blocks == len(state["status"])
    assert state["block_size"] == kv.block_size
    tables = {r.request_id: kv.get_block_ids(r.request_id) for r in sched.running}
    assert {rid: e["block_tables"] for rid, e in state["requests"].items()} == tables
    assert all(e["block_table"] == e["block_tables"][0] for e in state["requests"].values())
    holders: dict[int, list[str]] = {}
    for rid, per_group in tables.items():
        for b in (b for ids in per_group for b in ids if b):
            holders.setdefault(b, []).append(rid)
    for b in pool.blocks:
        i = b.block_id
        assert state["ref_counts"][i] == b.ref_count == len(holders.get(i, []))
        assert sorted(state["owners"][i]) == sorted(holders.get(i, []))
        assert state["cached"][i] == (b.block_hash is not None)
        assert state["num_tokens"][i] == b.num_tokens
        want = NULL if i == 0 else IN_USE if b.ref_count else (
            CACHED_FREE if b.block_hash is not None else FREE)
        assert state["status"][i] == want
    assert state["free_queue"] == [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert state["num_free_blocks"] == kv.num_free_blocks == len(state["free_queue"])
    assert sorted(state["cached_blocks"].values()) == sorted(
        b.block_id for b in pool.cached_blocks.values())
    assert all(len(h) == 16 for h in state["cached_blocks"])
    for rid, e in state["requests"].items():
        req = sched.requests[rid]
        assert (e["num_tokens"], e["num_computed_tokens"]) == (req.num_tokens,
                                                               req.num_computed_tokens)
        assert cdiv(e["num_computed_tokens"], kv.block_size) <= len(e["block_table"])
    assert set(state["waiting"]) == set(sched.requests) - set(tables)
    m = llm.get_metrics()
    assert state["usage"] == m["kv_cache_usage"]
    assert state["prefix_cache_hit_rate"] == m["prefix_cache_hit_rate"]
    assert set(state["tiers"]) <= set(m)
    assert json.loads(json.dumps(state)) == state


def test_snapshot_tracks_a_shared_prefix_run_with_preemption(llm):
    eng = llm.llm_engine
    llm.reset_prefix_cache()
    start = len(eng.metrics_history)
    prefix = list(range(20, 60))  # 5 full blocks shared by every request
    # 6 x (160 prompt + 60 output) tokens need ~140 blocks of the 127: someone is preempted.
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(6):
        own = [(i * 37 + j) % 250 for j in range(120)]
        eng.add_request(f"cs-{i}", {"prompt_token_ids": prefix + own}, params)
    eng.add_request("cs-n", {"prompt_token_ids": prefix + [200]},
                    SamplingParams(temperature=1.0, max_tokens=20, n=2, seed=1))
    max_shared = 0
    saw_child = saw_waiting = False
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        state = llm.cache_state()
        _assert_matches_truth(llm, state)
        max_shared = max(max_shared, max(len(o) for o in state["owners"]))
        saw_waiting |= bool(state["waiting"])
        for rid, e in state["requests"].items():
            if rid != e["user_request_id"]:
                assert e["user_request_id"] == "cs-n" and rid in ("0_cs-n", "1_cs-n")
                saw_child = True
    assert max_shared >= 6 and saw_child and saw_waiting
    assert llm.get_metrics()["num_preemptions"] > 0
    end = llm.cache_state()
    _assert_matches_truth(llm, end)
    assert end["requests"] == {} and end["num_in_use_blocks"] == 0 and end["usage"] == 0.0
    assert end["num_cached_free_blocks"] == len(end["cached_blocks"]) > 0
    # The 5 prefix blocks are computed once and hit by the 6 other sequences.
    assert end["status"][0] == NULL and end["prefix_cache_hits"] >= 6 * 40

    hist = llm.metrics_history()[start:]
    assert len(hist) == steps and all(set(p) == set(FIELDS) for p in hist)
    assert [p["step"] for p in hist] == list(range(hist[0]["step"], hist[0]["step"] + steps))
    assert all(a["time"] <= b["time"] for a, b in zip(hist, hist[1:], strict=False))
    assert max(p["kv_cache_usage"] for p in hist) > 0.9 and hist[-1]["kv_cache_usage"] == 0.0
    assert hist[-1]["num_preemptions"] == llm.get_metrics()["num_preemptions"]
    assert max(p["num_requests_waiting"] for p in hist) > 0


def test_swapped_requests_and_tier_metrics_show():
    llm = make_llm(tiny(), **ENGINE, preemption_mode="swap", kv_offloading_size=0.01)
    eng = llm.llm_engine
    for i in range(6):
        eng.add_request(f"sw-{i}", {"prompt_token_ids": [(i * 37 + j) % 250 for j in range(160)]},
                        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    swapped: dict[str, int] = {}
    while eng.has_unfinished_requests():
        eng.step()
        state = llm.cache_state()
        _assert_matches_truth(llm, state)
        assert set(state["swapped"]) <= set(state["waiting"])
        swapped.update(state["swapped"])
    assert swapped and all(n > 0 for n in swapped.values())
    assert {"host_tier_usage", "num_swapped_out"} <= set(state["tiers"])
    assert state["tiers"]["num_swapped_out"] >= len(swapped)


def test_snapshot_is_read_only(llm):
    eng = llm.llm_engine
    eng.add_request("ro", {"prompt_token_ids": list(range(30))},
                    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()
    pool = eng.scheduler.kv_cache_manager.block_pool
    before = (pool._clock, pool.num_evictions, [b.block_id for b in
                                                 pool.free_block_queue.get_all_free_blocks()])
    a, b = llm.cache_state(), llm.cache_state()
    assert a == b
    assert before == (pool._clock, pool.num_evictions, [b.block_id for b in
                                                         pool.free_block_queue.get_all_free_blocks()])
    while eng.has_unfinished_requests():
        eng.step()
    _assert_matches_truth(llm, llm.cache_state())


def test_history_is_bounded(llm):
    h = MetricsHistory(maxlen=3)
    for n in range(5):
        h.record(llm.llm_engine.scheduler, n)
    pts = h.snapshot()
    assert len(h) == 3 and [p["num_scheduled_tokens"] for p in pts] == [2, 3, 4]
    h.clear()
    assert h.snapshot() == []
    with pytest.raises(ValueError, match="maxlen"):
        MetricsHistory(maxlen=0)
