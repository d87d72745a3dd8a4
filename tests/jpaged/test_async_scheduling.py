"""Async scheduling (the overlapped loop) against the synchronous reference loop, on a tiny random
Llama: the same tokens and text in every mode the engine has, and nothing shown past a stop."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_llm, tiny

from jpaged import SamplingParams
from jpaged.sampling_params import RequestOutputKind

BASE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=8)


def _engines(**kw):
    args = {**BASE, "num_gpu_blocks_override": 128, **kw}
    return {mode: make_llm(tiny(), async_scheduling=mode == "async", **args).llm_engine
            for mode in ("sync", "async")}


@pytest.fixture(scope="module")
def engines():
    return _engines()


def _prompts(seed: int, n: int, lo: int = 3, hi: int = 90) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _run(engine, work, abort_at=None):
    """Feed (prompt, params) pairs, two new ones per step; collect final outputs and deltas.

    abort_at: {request_id: step} aborts that request at that step (counted from 0).
    """
    pending = [(f"r{i}", {"prompt_token_ids": p}, sp) for i, (p, sp) in enumerate(work)]
    final, deltas, steps = {}, {}, 0
    while pending or engine.has_unfinished_requests():
        for rid, prompt, sp in pending[:2]:
            engine.add_request(rid, prompt, sp)
        pending = pending[2:]
        for rid, at in (abort_at or {}).items():
            if at == steps:
                engine.abort_request(rid)
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out)
            if out.finished:
                final[out.request_id] = out
        steps += 1
    engine.step()  # drain a step still in flight (async): its tokens belong to nobody now
    return final, deltas


def _tokens(final):
    return {rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for rid, o in sorted(final.items())}


def _assert_idle(engine):
    m = engine.get_metrics()
    assert m["num_blocks_free"] == m["num_blocks_total"] and not engine.has_unfinished_requests()


COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries",
            "prefix_cache_hits", "num_requests_finished")


def _both(engines, work, **kw):
    for e in engines.values():  # the same (empty) prefix cache for both
        assert e.reset_prefix_cache()
    before = {m: {k: e.get_metrics()[k] for k in COUNTERS} for m, e in engines.items()}
    res = {mode: _run(e, work, **kw) for mode, e in engines.items()}
    for e in engines.values():
        _assert_idle(e)
    # The counters move alike (a dropped token is not generated; a fed decode is no prompt).
    delta = {m: {k: e.get_metrics()[k] - before[m][k] for k in COUNTERS}
             for m, e in engines.items()}
    if kw.get("abort_at"):  # an abort at the same call finds one token fewer applied (async)
        for d in delta.values():
            d.pop("generation_tokens_total")
    if not any(e.get_metrics()["num_preemptions"] for e in engines.values()):
        assert delta["sync"] == delta["async"]
    return res["sync"], res["async"]


def test_greedy_identical_with_chunked_prefill(engines):
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    work = [(p, sp) for p in _prompts(0, 10)]
    (a, _), (b, _) = _both(engines, work)
    assert len(a) == 10 and _tokens(a) == _tokens(b)


def test_seeded_penalties_logprobs_and_n_identical(engines):
    sps = [SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=3, n=3, max_tokens=16,
                          ignore_eos=True, logprobs=3),
           SamplingParams(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5,
                          frequency_penalty=0.4, seed=11, max_tokens=24, ignore_eos=True),
           SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=24, ignore_eos=True,
                          logprobs=2),
           SamplingParams(temperature=1.2, min_p=0.05, max_tokens=12, ignore_eos=True)]
    work = [(p, sps[i % len(sps)]) for i, p in enumerate(_prompts(1, 8))]
    (a, _), (b, _) = _both(engines, work)
    assert _tokens(a) == _tokens(b)
    for rid in a:
        for ca, cb in zip(a[rid].outputs, b[rid].outputs, strict=True):
            assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-4)
            if ca.logprobs is not None:
                assert len(cb.logprobs) == len(cb.token_ids) == len(ca.logprobs)
                assert [sorted(x) for x in ca.logprobs] == [sorted(x) for x in cb.logprobs]


def test_stop_strings_ending_mid_step_show_nothing_past_the_stop(engines):
    # Stop strings and stop tokens cut from the reference output, at several places.
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = _prompts(2, 6, 5, 40)
    ref, _ = _run(engines["sync"], [(p, greedy) for p in prompts])
    work = []
    for i, p in enumerate(prompts):
        c = ref[f"r{i}"].outputs[0]
        if i % 2 == 0 and len(c.text) > 12:
            stop = c.text[5 + i:8 + i]
            work.append((p, greedy.clone(stop=[stop], output_kind=RequestOutputKind.DELTA,
                                         include_stop_str_in_output=i % 4 == 0)))
        else:
            work.append((p, greedy.clone(stop_token_ids=[c.token_ids[6 + i]],
                                         output_kind=RequestOutputKind.DELTA)))
    (a, da), (b, db) = _both(engines, work)
    for rid in a:
        # DELTA outputs: the streamed pieces of both loops add up to the same text and tokens.
        for deltas in (da[rid], db[rid]):
            text = "".join(o.outputs[0].text for o in deltas)
            ids = [t for o in deltas for t in o.outputs[0].token_ids]
            assert (text, ids) == ("".join(o.outputs[0].text for o in da[rid]),
                                   [t for o in da[rid] for t in o.outputs[0].token_ids])
            assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "stop"
            assert all(not o.finished for o in deltas[:-1])
        sp = work[int(rid[1:])][1]
        if sp.stop_token_ids:
            assert ids[-1] == sp.stop_token_ids[0] and sp.stop_token_ids[0] not in ids[:-1]
        else:
            s = sp.stop[0]
            assert text.endswith(s) if sp.include_stop_str_in_output else s not in text
        assert [o.outputs[0].stop_reason for o in da[rid]] == [
            o.outputs[0].stop_reason for o in db[rid]]


def test_aborts_mid_stream(engines):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)
    work = [(p, sp) for p in _prompts(3, 6, 5, 30)]
    abort_at = {"r1": 4, "r4": 7}
    (a, da), (b, db) = _both(engines, work, abort_at=abort_at)
    assert set(a) == set(b) == {"r0", "r2", "r3", "r5"}
    assert _tokens(a) == _tokens(b)
    for deltas in (da, db):
        for rid in abort_at:  # what was shown before the abort is a prefix of the full output
            shown = [t for o in deltas.get(rid, []) for t in o.outputs[0].token_ids]
            assert len(shown) < 40


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_identical_under_memory_pressure(mode):
    extra = {"kv_offloading_size": 0.01} if mode == "swap" else {}
    pair = _engines(num_gpu_blocks_override=24, preemption_mode=mode, **extra)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True)
    work = [(p, sp if i % 2 else seeded) for i, p in enumerate(_prompts(4, 8, 10, 40))]
    (a, _), (b, _) = _both(pair, work)
    assert len(a) == 8 and _tokens(a) == _tokens(b)
    for e in pair.values():
        assert e.get_metrics()["num_preemptions"] > 0


def test_prefix_cache_hits_counted_alike(engines):
    shared = list(range(40, 80))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    work = [(shared + p, sp) for p in _prompts(5, 6, 2, 12)]
    for e in engines.values():
        e.reset_prefix_cache()
    before = {m: e.get_metrics()["prefix_cache_hits"] for m, e in engines.items()}
    (a, _), (b, _) = _both(engines, work)
    assert _tokens(a) == _tokens(b)
    hits = {m: e.get_metrics()["prefix_cache_hits"] - before[m] for m, e in engines.items()}
    assert hits["sync"] == hits["async"] > 0


def test_no_token_computed_past_max_tokens(engines):
    # A request whose token still on device reaches max_tokens is not scheduled again: every
    # sampling row dispatched yields a token somebody sees.
    e = engines["async"]
    rows = []
    real = e.runner.dispatch

    def counting(scheduled):
        rows.append(sum(s.sample for s in scheduled))
        return real(scheduled)

    e.runner.dispatch = counting
    try:
        sp = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
        final, _ = _run(e, [(p, sp) for p in _prompts(6, 4)])
    finally:
        del e.runner.dispatch
    assert all(len(o.outputs[0].token_ids) == 7 for o in final.values())
    assert sum(rows) == 28


def test_warmup_while_a_step_is_in_flight(engines):
    # warmup() compiles with a scratch token buffer: the step in flight keeps its tokens.
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = _prompts(7, 3)
    ref, _ = _run(engines["sync"], [(p, sp) for p in prompts])
    e = engines["async"]
    for i, p in enumerate(prompts):
        e.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    final = {}
    for k in range(200):
        if k == 4:
            assert e.core.step_in_flight
            e.runner.warmup([(1, 1), (4, 4)])
        for out in e.step():
            if out.finished:
                final[out.request_id] = out
        if not e.has_unfinished_requests():
            break
    e.step()
    assert _tokens(final) == _tokens(ref)
    _assert_idle(e)


def test_one_engine_switches_loops_when_idle(engines):
    # The A/B the host benchmark and the device check run: both loops on one engine, outputs
    # identical, no recompilation, and the switch refused while a request is unfinished.
    # (The module's async engine: the test leaves it idle and overlapped again.)
    e = engines["async"]
    _assert_idle(e)
    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    prompts = _prompts(8, 4)
    a, _ = _run(e, [(p, sp) for p in prompts])
    # Abort mid-stream so that a step is still in flight when the switch comes.
    e.add_request("x", {"prompt_token_ids": prompts[0]}, sp)
    while e.scheduler.num_waiting or not e.scheduler.running[0].num_output_tokens:
        e.step()
    with pytest.raises(ValueError, match="unfinished requests"):
        e.set_async_scheduling(False)
    e.abort_request("x")
    assert e.core.step_in_flight
    compiled = e.runner.num_compiled
    e.set_async_scheduling(False)
    assert not e.core.step_in_flight and not e.async_scheduling
    assert e.config.scheduler.async_scheduling is False
    b, _ = _run(e, [(p, sp) for p in prompts])
    assert _tokens(a) == _tokens(b)
    assert e.runner.num_compiled == compiled
    _assert_idle(e)
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        e.set_async_scheduling("yes")
    assert e.async_scheduling is False
    e.set_async_scheduling(True)
    c, _ = _run(e, [(p, sp) for p in prompts])
    assert _tokens(c) == _tokens(a)
    _assert_idle(e)
