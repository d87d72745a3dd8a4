"""Scheduler: continuous batching, token budget, chunked prefill, ordering, stops, abort, stats."""

from __future__ import annotations

import random

import pytest
from core_sim import EOS, Sim, make_request, make_scheduler, reference_output

from jpaged.core.request_queue import WaitingQueue
from jpaged.request import RequestStatus


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 7) % 900 for i in range(n)]


def check_outputs(finished, reqs, max_model_len=256):
    for r in reqs:
        assert finished[r.request_id].output_token_ids == reference_output(
            r.prompt_token_ids, r.sampling_params, max_model_len), r.request_id


def test_continuous_batching_joins_and_leaves():
    s = make_scheduler(64, max_num_seqs=2)
    reqs = [make_request(f"r{i}", prompt(i, 5 + i), max_tokens=2 + 2 * i) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    sim = Sim(s)
    running_sets = []
    while s.has_unfinished_requests():
        out = sim.step()
        running_sets.append(sorted(x.request.request_id for x in out.scheduled))
    assert running_sets[0] == ["r0", "r1"]
    # r0 (2 tokens) leaves after step 1; r2 joins in the very next step while r1 keeps going.
    assert running_sets[2] == ["r1", "r2"]
    assert all(len(x) <= 2 for x in running_sets)
    assert max(len(x) for x in running_sets) == 2
    check_outputs(sim.finished, reqs)
    sim.assert_drained()


def test_token_budget_and_chunked_prefill_keep_decodes_running():
    s = make_scheduler(128, max_num_batched_tokens=16, max_num_seqs=4)
    d1 = make_request("d1", prompt(1, 3), max_tokens=30)
    d2 = make_request("d2", prompt(2, 5), max_tokens=30)
    s.add_request(d1)
    s.add_request(d2)
    sim = Sim(s)
    sim.step()  # both prefill in one step (8 tokens)
    long = make_request("long", prompt(3, 100), max_tokens=3)
    s.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = sim.step()
        by_id = {x.request.request_id: x for x in out.scheduled}
        assert by_id["d1"].num_tokens == by_id["d2"].num_tokens == 1  # decodes every step
        assert out.num_scheduled_tokens <= 16
        chunks.append(by_id["long"].num_tokens)
    assert chunks == [14] * 7 + [2]  # 100 = 7 * 14 + 2
    sim.run()
    check_outputs(sim.finished, [d1, d2, long])


def test_long_prefill_threshold_caps_chunks():
    s = make_scheduler(128, max_num_batched_tokens=64, threshold=10)
    r = make_request("r", prompt(4, 35), max_tokens=2)
    s.add_request(r)
    sim = Sim(s)
    sizes = [sim.step().scheduled[0].num_tokens for _ in range(4)]
    assert sizes == [10, 10, 10, 5]
    sim.run()


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = make_scheduler(128, max_num_batched_tokens=64, max_model_len=64, chunked=False)
    a = make_request("a", prompt(1, 40), max_tokens=4)
    b = make_request("b", prompt(2, 40), max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    sim = Sim(s)
    out = sim.step()
    assert [x.request.request_id for x in out.scheduled] == ["a"]  # b does not fit in 24
    out = sim.step()
    assert {x.request.request_id: x.num_tokens for x in out.scheduled} == {"a": 1, "b": 40}
    sim.run()
    check_outputs(sim.finished, [a, b], 64)


def test_priority_and_fcfs_admission_order():
    for policy, expect in [("priority", ["hi", "mid", "lo"]), ("fcfs", ["lo", "mid", "hi"])]:
        s = make_scheduler(64, max_num_seqs=1, policy=policy)
        for rid, prio, t in [("lo", 5, 0.0), ("mid", 1, 1.0), ("hi", 0, 2.0)]:
            s.add_request(make_request(rid, prompt(prio, 4), max_tokens=1, priority=prio,
                                       arrival=t))
        sim = Sim(s)
        order = [sim.step().scheduled[0].request.request_id for _ in range(3)]
        assert order == expect, policy
        sim.assert_drained()


def test_waiting_queue_front_of_class():
    q = WaitingQueue("priority")
    mk = lambda rid, p, t: make_request(rid, [1], priority=p, arrival=t)  # noqa: E731
    a, b, c, d = mk("a", 0, 0.0), mk("b", 1, 1.0), mk("c", 1, 2.0), mk("d", 1, 9.0)
    for r in (a, b, c):
        q.push(r)
    q.push_front(d)  # preempted: ahead of b and c, behind the better class
    assert [r.request_id for r in q] == ["a", "d", "b", "c"]
    assert q.remove("b") and not q.remove("b") and "b" not in q and len(q) == 3
    assert [q.pop()[1].request_id for _ in range(3)] == ["a", "d", "c"] and q.pop() is None


def test_waiting_queue_first_n_matches_pop_order_and_leaves_the_queue():
    rng = random.Random(0)
    q = WaitingQueue("priority")
    reqs = [make_request(f"r{i}", [1], priority=rng.randrange(3), arrival=rng.random())
            for i in range(40)]
    for r in reqs:
        q.push(r)
    for r in reqs[::3]:
        q.push_front(r)  # re-pushed: its old heap entry goes stale
    for r in reqs[1::5]:
        q.remove(r.request_id)
    expect = [r.request_id for r in q]
    for k in (0, 1, 7, len(q), len(q) + 5):
        assert [r.request_id for r in q.first_n(k)] == expect[:k]
    assert [q.pop()[1].request_id for _ in range(len(expect))] == expect and q.pop() is None
    assert q.first_n(3) == []


def test_stop_tokens_min_tokens_and_lengths():
    base = prompt(9, 6)
    ref = reference_output(base, make_request("x", base, max_tokens=10).sampling_params, 256)
    s = make_scheduler(128)
    stop = make_request("stop", base, max_tokens=10, stop_token_ids=[ref[2]])
    eos = make_request("eos", base, max_tokens=10, eos_token_ids=(ref[1],), min_tokens=3)
    ign = make_request("ign", base, max_tokens=10, eos_token_ids=(ref[1],), ignore_eos=True)
    ln = make_request("len", base, max_tokens=None)
    for r in (stop, eos, ign, ln):
        s.add_request(r)
    fin = Sim(s).run()
    assert fin["stop"].output_token_ids == ref[:3] and fin["stop"].stop_reason == ref[2]
    assert fin["stop"].finish_reason == "stop"
    # EOS ignored before min_tokens; here it never reappears, so max_tokens ends it.
    assert fin["eos"].output_token_ids[:3] == ref[:3]
    assert fin["ign"].output_token_ids == ref and fin["ign"].finish_reason == "length"
    assert fin["len"].num_tokens == 256 and fin["len"].finish_reason == "length"


def test_eos_stops_with_no_stop_reason():
    base = prompt(11, 6)
    ref = reference_output(base, make_request("x", base, max_tokens=10).sampling_params, 256)
    s = make_scheduler(64)
    s.add_request(make_request("e", base, max_tokens=10, eos_token_ids=(ref[4], EOS)))
    fin = Sim(s).run()
    assert fin["e"].output_token_ids == ref[:5] and fin["e"].stop_reason is None
    assert fin["e"].status is RequestStatus.FINISHED_STOPPED


def test_prompt_at_max_model_len_yields_one_token():
    s = make_scheduler(64, max_model_len=32)
    s.add_request(make_request("r", prompt(1, 32), max_tokens=10))
    fin = Sim(s).run()
    assert fin["r"].num_output_tokens == 1 and fin["r"].finish_reason == "length"


def test_abort_frees_blocks_and_is_reported():
    s = make_scheduler(64, max_num_seqs=2)
    a, b, c = (make_request(x, prompt(i, 9), max_tokens=50) for i, x in enumerate("abc"))
    for r in (a, b, c):
        s.add_request(r)
    sim = Sim(s)
    sim.step()
    sim.step()
    out = s.schedule()  # a step in flight when the aborts arrive
    s.abort_requests(["a", "c", "nope"])  # running and waiting
    assert a.status is RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert s.kv_cache_manager.num_blocks_held("a") == 0 and "c" not in s.waiting
    changed = s.update_from_output(out, {x.request.request_id: 1 for x in out.scheduled})
    assert [r.request_id for r in changed] == ["b"]
    s.kv_cache_manager.check_invariants()
    assert sorted(s.schedule().finished_request_ids) == ["a", "c"]
    s.finish_requests("b", RequestStatus.FINISHED_STOPPED)  # e.g. a stop string
    assert not s.has_unfinished_requests() and s.kv_cache_manager.usage == 0.0
    with pytest.raises(ValueError):
        s.finish_requests("b", RequestStatus.RUNNING)


def test_add_request_guards():
    s = make_scheduler(9, max_model_len=64)  # 8 usable blocks of 4 tokens
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request("big", prompt(1, 65)))
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(make_request("huge", prompt(1, 30), max_tokens=10))
    s.add_request(make_request("ok", prompt(1, 30), max_tokens=3))  # 32 slots = 8 blocks
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("ok", prompt(2, 3)))
    Sim(s).run()


def test_stats():
    s = make_scheduler(33, max_num_seqs=3)
    for i in range(5):
        s.add_request(make_request(f"r{i}", prompt(0, 8) + [i], max_tokens=3))
    Sim(s).run()
    st = s.get_stats()
    for k in ("num_preemptions", "kv_cache_usage", "num_blocks_total", "num_blocks_free",
              "num_requests_running", "num_requests_waiting", "prefix_cache_queries",
              "prefix_cache_hits", "prefix_cache_hit_rate", "prefix_cache_hit_rate_recent",
              "cache_access_total", "num_evictions"):
        assert k in st
    assert st["num_blocks_total"] == 32 == st["num_blocks_free"]
    assert st["prefix_cache_queries"] == 45 and st["prefix_cache_hits"] == 4 * 8
    assert st["cache_access_total"] == 5 and st["generation_tokens_total"] == 15
    assert st["prefix_cache_hit_rate"] == pytest.approx(32 / 45)
    assert st["prompt_tokens_total"] == 45 - 32


def test_tokens_by_row_are_applied_like_tokens_by_id():
    """update_from_output takes the step's tokens by row too (what the engine reads off the
    device) and reports each updated request's row; a short token list is refused."""
    runs = {}
    for by_row in (False, True):
        s = make_scheduler(64, max_num_seqs=4, block_size=4)
        for i in range(3):
            s.add_request(make_request(f"r{i}", prompt(i, 5 + 3 * i), max_tokens=6))
        log = []
        while s.has_unfinished_requests():
            out = s.schedule()
            toks = [(7 * j + len(log)) % 50 + 1 for j in range(len(out.scheduled))]
            rows: list[int] = []
            if by_row:
                changed = s.update_from_output(out, toks, rows)
            else:
                changed = s.update_from_output(out, {x.request.request_id: t for x, t in
                                                     zip(out.scheduled, toks, strict=True)})
                rows = [i for i, x in enumerate(out.scheduled) if x.request in changed]
            assert [out.scheduled[i].request for i in rows] == changed
            log.append([(r.request_id, r.output_token_ids[-1]) for r in changed])
        runs[by_row] = log
    assert runs[True] == runs[False] and any(runs[True])
    s = make_scheduler(64)
    s.add_request(make_request("a", prompt(1, 5)))
    out = s.schedule()
    with pytest.raises(ValueError, match="0 sampled tokens for a step of 1 rows"):
        s.update_from_output(out, [])


def test_scheduled_block_ids_are_the_managers_list_not_a_copy():
    """A step's block_ids are the manager's own lists, one per KV cache group (a copy per
    request per step would cost the table's length): exact when scheduled, grown in place
    later, left alone once freed."""
    s = make_scheduler(64, max_num_seqs=2, block_size=4)
    s.add_request(make_request("a", prompt(1, 6), max_tokens=8))
    sim = Sim(s)
    out = sim.step()
    per_group = out.scheduled[0].block_ids
    assert per_group is s.kv_cache_manager.live_block_ids("a") and len(per_group) == 1
    ids = per_group[0]
    assert len(ids) == 2
    before = list(ids)
    while len(ids) == 2:
        sim.step()
    assert ids[:2] == before and len(ids) == 3  # grew in place
    sim.run()
    assert ids[:2] == before  # freed: dropped by the manager, not cleared
    assert s.kv_cache_manager.live_block_ids("a") == [[]]
