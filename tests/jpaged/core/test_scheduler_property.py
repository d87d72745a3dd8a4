"""Random workloads: every step checked by Sim; outputs equal an unconstrained run; no leaks."""

from __future__ import annotations

from core_sim import Sim, make_request, make_scheduler, reference_output
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jpaged.intmath import cdiv

MAX_LEN = 48

BASES = [[(b * 37 + i * 5) % 900 for i in range(30)] for b in range(3)]

request_st = st.tuples(
    st.integers(0, 2),  # base prompt
    st.integers(0, 30),  # shared prefix length
    st.lists(st.integers(0, 899), min_size=0, max_size=8),  # own suffix
    st.integers(1, 12),  # max_tokens
    st.integers(0, 2),  # priority
    st.integers(0, 6),  # step at which it arrives
    st.one_of(st.none(), st.integers(1, 30)),  # step at which it is aborted
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request_st, min_size=1, max_size=8),
    block_size=st.sampled_from([1, 2, 4, 8]),
    extra_blocks=st.integers(0, 40),
    budget=st.integers(1, 40),
    chunked=st.booleans(),
    caching=st.booleans(),
    policy=st.sampled_from(["priority", "fcfs", "lpm"]),
    threshold=st.one_of(st.none(), st.integers(1, 8)),
    max_num_seqs=st.integers(1, 6),
    async_scheduling=st.booleans(),
)
def test_random_workloads(reqs, block_size, extra_blocks, budget, chunked, caching, policy,
                          threshold, max_num_seqs, async_scheduling):
    specs = []
    for i, (base, share, suffix, max_tokens, prio, arrive, abort) in enumerate(reqs):
        p = (BASES[base][:share] + suffix)[:MAX_LEN] or [7]
        specs.append((f"r{i}", p, max_tokens, prio, arrive, abort))
    need = max(cdiv(min(MAX_LEN, len(p) + mt) - 1, block_size) for _, p, mt, *_ in specs)
    s = make_scheduler(1 + need + extra_blocks, block_size=block_size,
                       max_num_batched_tokens=budget if chunked else max(budget, MAX_LEN),
                       max_model_len=MAX_LEN, caching=caching, policy=policy, chunked=chunked,
                       threshold=threshold, max_num_seqs=max_num_seqs)
    sim = Sim(s, async_scheduling)
    pending = sorted(specs, key=lambda x: x[4])
    aborted = set()
    step = 0
    objs = {}
    while pending or s.has_unfinished_requests():
        while pending and pending[0][4] <= step:
            rid, p, mt, prio, _, abort = pending.pop(0)
            objs[rid] = make_request(rid, p, mt, priority=prio, arrival=float(step))
            s.add_request(objs[rid])
        for rid, _, _, _, arrive, abort in specs:
            if abort is not None and arrive + abort == step and rid in s.requests:
                s.abort_requests(rid)
                aborted.add(rid)
        if s.has_unfinished_requests():
            sim.step()
        step += 1
        assert step < 5000, "no progress"
    sim.assert_drained()
    for rid, r in objs.items():
        if rid in aborted:
            assert r.finish_reason == "abort"
            continue
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling_params,
                                                      MAX_LEN), rid
