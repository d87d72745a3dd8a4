"""Automatic prefix caching through the scheduler: exact hit counts, n > 1 sharing bound,
blocks shared only once written, LPM order, salts, eviction, multi-turn reuse."""

from __future__ import annotations

import pytest
from core_sim import Sim, make_request, make_scheduler, reference_output

from jpaged.intmath import cdiv
from jpaged.request import Request
from jpaged.sampling_params import SamplingParams


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 53 + i * 11) % 900 for i in range(n)]


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_hits_equal_theory_when_submitted_together(algo):
    bs = 16
    s = make_scheduler(128, block_size=bs, max_num_batched_tokens=512, algo=algo)
    shared = prompt(1, 3 * bs)
    reqs = [make_request(f"r{i}", shared + [800 + i] * (3 + i), 4) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    sim = Sim(s)
    first = sim.step()
    # Only r0 computes the shared blocks; the others wait one step and then hit all three.
    assert [x.request.request_id for x in first.scheduled] == ["r0"]
    second = sim.step()
    assert {x.request.request_id: x.start_pos for x in second.scheduled if
            x.request.request_id != "r0"} == {"r1": 48, "r2": 48, "r3": 48}
    sim.run()
    st = s.get_stats()
    assert st["prefix_cache_hits"] == 3 * bs * 3
    assert st["prefix_cache_queries"] == sum(r.num_prompt_tokens for r in reqs)
    assert st["cache_access_total"] == 4


@pytest.mark.parametrize("prompt_len", [100, 96])
def test_n8_fanout_shares_prompt_blocks(prompt_len):
    bs, n, gen = 16, 8, 20
    parent = prompt(7, prompt_len)
    used = {}
    for caching in (True, False):
        s = make_scheduler(256, block_size=bs, max_num_seqs=16, max_num_batched_tokens=64,
                           caching=caching)
        sp = SamplingParams(n=n, max_tokens=gen)
        kids = [Request(f"{i}_p", parent, sp) for i in range(n)]
        for k in kids:
            s.add_request(k)
        sim = Sim(s)
        fin = sim.run()
        ref = reference_output(parent, sp, 256)
        assert all(fin[k.request_id].output_token_ids == ref for k in kids)
        used[caching] = sim.max_used_blocks
    full_prompt_blocks = prompt_len // bs
    gen_blocks = cdiv(gen, bs)
    assert used[True] <= full_prompt_blocks + n * (gen_blocks + 1)
    assert used[False] >= n * full_prompt_blocks  # without sharing each child has a copy


def test_chunked_prefill_children_follow_the_first_one():
    s = make_scheduler(256, block_size=4, max_num_batched_tokens=16)
    p = prompt(3, 50)
    a, b = make_request("a", p, 3), make_request("b", p, 3)
    s.add_request(a)
    s.add_request(b)
    sim = Sim(s)
    starts = []
    while b.num_output_tokens == 0:
        out = sim.step()
        starts.append({x.request.request_id: (x.start_pos, x.num_tokens) for x in out.scheduled})
    # b is held back while a computes the prefix, then hits every full block but the last token's.
    assert [st["a"] for st in starts[:4]] == [(0, 16), (16, 16), (32, 16), (48, 2)]
    assert all("b" not in st for st in starts[:3])
    assert starts[3]["b"] == (48, 2)
    sim.run()
    assert s.get_stats()["prefix_cache_hits"] == 48


def test_lpm_prefers_longest_cached_prefix():
    s = make_scheduler(256, max_num_seqs=1, policy="lpm")
    base = prompt(2, 40)
    s.add_request(make_request("warm", base, 1, arrival=0.0))
    sim = Sim(s)
    sim.run()
    s.add_request(make_request("cold", prompt(5, 40), 1, arrival=1.0))
    s.add_request(make_request("short", base[:12] + [1] * 28, 1, arrival=2.0))
    s.add_request(make_request("long", base[:36] + [1] * 4, 1, arrival=3.0))
    s.add_request(make_request("vip", prompt(6, 40), 1, priority=-1, arrival=4.0))
    order = [sim.step().scheduled[0].request.request_id for _ in range(4)]
    assert order == ["vip", "long", "short", "cold"]
    sim.assert_drained()


def test_salt_isolates_tenants():
    s = make_scheduler(128)
    p = prompt(4, 30)
    sim = Sim(s)
    s.add_request(Request("a", p, SamplingParams(max_tokens=2), cache_salt="t1"))
    sim.run()
    s.add_request(Request("b", p, SamplingParams(max_tokens=2), cache_salt="t2"))
    s.add_request(Request("c", p, SamplingParams(max_tokens=2), cache_salt="t1",
                          arrival_time=1e18))
    sim.run()
    assert s.get_stats()["prefix_cache_hits"] == 28  # only c, from a


def test_multi_turn_reuses_generated_blocks():
    s = make_scheduler(128)
    p = prompt(8, 10)
    a = make_request("turn1", p, 14)
    s.add_request(a)
    sim = Sim(s)
    sim.run()
    follow = a.all_token_ids + [5, 6, 7]  # 27 tokens: 6 full blocks computed by turn 1
    s.add_request(make_request("turn2", follow, 2))
    sim.run()
    # turn1 computed tokens [0, 23): blocks 0..4 are full and cached.
    assert s.kv_cache_manager.stats.hits == 20


def test_lru_eviction_and_reset():
    s = make_scheduler(9, max_num_seqs=1)  # 8 usable blocks
    sim = Sim(s)
    s.add_request(make_request("x", prompt(1, 16), 1))
    sim.run()
    s.add_request(make_request("y", prompt(2, 24), 1))  # needs 6 blocks: evicts 2 of x's 4
    sim.run()
    assert s.get_stats()["num_evictions"] == 2
    s.add_request(make_request("x2", prompt(1, 16) + [1], 1))
    sim.run()
    # x's tail blocks were evicted first (tail-first free): its first two blocks survive.
    assert s.kv_cache_manager.stats.hits == 8
    assert s.reset_prefix_cache() is True
    s.add_request(make_request("x3", prompt(1, 16) + [1], 1))
    sim.run()
    assert s.kv_cache_manager.stats.hits == 8
