"""The engine core in its own process (CoreProcessEngine): the same outputs as the in-process
engine, aborts and stop strings reach the core, bad input is refused in the front end, a dead
core is named, and a real server streams from it. The core loads `host_model` (a tiny random
Llama with a word tokenizer) itself: a made-up model travels as a picklable loader."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import numpy as np
import openai
import pytest

from jpaged.async_engine import AsyncLLMEngine
from jpaged.bench.host import host_model
from jpaged.config import EngineArgs
from jpaged.core_client import MAX_AHEAD, CoreProcessEngine, CoreProcessError, create_engine
from jpaged.engine import LLMEngine
from jpaged.llm import LLM
from jpaged.sampling_params import RequestOutputKind, SamplingParams
from jpaged.server import BackgroundServer, build_app

ARGS = dict(max_num_seqs=8, max_model_len=128, num_gpu_blocks_override=64, block_size=16,
            disable_log_stats=True)


def _prompts(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, 256, int(k)).tolist()}
            for k in rng.integers(4, 30, n)]


# Greedy, seeded sampling with a stop string, n = 2 with logprobs: the three kinds of work the
# front end does on the core's tokens.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12),
          SamplingParams(temperature=0.9, seed=3, max_tokens=16, stop=[" w7", " w100"]),
          SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, logprobs=2)]


@pytest.fixture(scope="module")
def core() -> CoreProcessEngine:
    engine = CoreProcessEngine(EngineArgs(**ARGS), loader=host_model)
    yield engine
    engine.shutdown()
    assert not engine.proc.is_alive()


def _drain(engine: CoreProcessEngine) -> dict:
    """The core's metrics once it holds no block (its last aborts applied)."""
    m = engine.get_metrics()  # a call is answered after every message sent before it
    assert m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
    return m


def test_outputs_equal_the_in_process_engine(core):
    prompts = _prompts(9)
    params = [PARAMS[i % 3] for i in range(len(prompts))]
    ref = LLM.from_engine(LLMEngine(EngineArgs(**ARGS), loaded=host_model())).generate(
        prompts, params)
    got = LLM.from_engine(core).generate(prompts, params)
    stopped = 0
    for a, b in zip(ref, got, strict=True):
        assert b.num_cached_tokens == a.num_cached_tokens
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert (cb.token_ids, cb.text, cb.finish_reason, cb.stop_reason) == (
                ca.token_ids, ca.text, ca.finish_reason, ca.stop_reason)
            # A stop string ends a sequence in the core a step or more later than in-process:
            # the batches differ meanwhile, and so may a float's last bits (not a token).
            assert (ca.logprobs is None) == (cb.logprobs is None)
            for la, lb in zip(ca.logprobs or [], cb.logprobs or [], strict=True):
                assert {t: (v.rank, v.decoded_token) for t, v in lb.items()} == {
                    t: (v.rank, v.decoded_token) for t, v in la.items()}
                assert [v.logprob for v in lb.values()] == pytest.approx(
                    [v.logprob for v in la.values()], abs=1e-5)
            assert cb.cumulative_logprob == pytest.approx(ca.cumulative_logprob, abs=1e-4)
            stopped += isinstance(ca.stop_reason, str)
    assert stopped >= 1  # a stop string ended a sequence (the core learned it by an abort)
    m = _drain(core)
    assert m["num_blocks_free"] == m["num_blocks_total"]
    assert m["num_requests_finished"] >= len(prompts)


def test_grammars_bad_words_and_prompt_logprobs_run_in_the_core():
    """The core makes the grammar matchers and bad words of what its front end sends, and sends
    prompt logprobs back: the same outputs as in-process (the tiny byte-level model, whose
    tokens a grammar can read)."""
    from helpers import tiny

    from jpaged.sampling_params import StructuredOutputsParams

    prompts = [{"prompt_token_ids": [5, 17, 99, 42]}] * 3
    params = [SamplingParams(temperature=1.0, seed=2, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(regex="[0-9]{3}x")),
              SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                             allowed_token_ids=[ord("a"), ord("b")], bad_words=["a"]),
              SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)]
    ref = LLM.from_engine(LLMEngine(EngineArgs(**ARGS), loaded=tiny())).generate(
        prompts, params)
    core = CoreProcessEngine(EngineArgs(**ARGS), loader=tiny)
    try:
        got = LLM.from_engine(core).generate(prompts, params)
    finally:
        core.shutdown()
    assert re.fullmatch("[0-9]{3}x", got[0].outputs[0].text), got[0].outputs[0].text
    assert got[1].outputs[0].text == "bbbbbb"
    for a, b in zip(ref, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    plp = got[2].prompt_logprobs
    assert plp[0] is None and len(plp) == 4
    assert [{t: round(v.logprob, 4) for t, v in e.items()} for e in plp[1:]] == [
        {t: round(v.logprob, 4) for t, v in e.items()} for e in ref[2].prompt_logprobs[1:]]


def test_streaming_abort_and_core_queries(core):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    for i, p in enumerate(_prompts(3, seed=1)):
        core.add_request(f"s{i}", p, params)
    got = {f"s{i}": [] for i in range(3)}
    while len(got["s0"]) < 5:
        for o in core.step():
            got[o.request_id] += o.outputs[0].token_ids
    state = core.cache_state()
    assert {e["user_request_id"] for e in state["requests"].values()} == {"s0", "s1", "s2"}
    core.abort_request("s1")
    aborted_at = len(got["s1"])
    while core.has_unfinished_requests():
        for o in core.step():
            got[o.request_id] += o.outputs[0].token_ids
    assert len(got["s1"]) == aborted_at  # nothing shown after the abort
    assert len(got["s0"]) == len(got["s2"]) == 40
    m = _drain(core)
    assert m["num_requests_aborted"] >= 1 and m["kv_cache_usage"] == 0.0
    assert core.cache_state()["requests"] == {}
    assert core.metrics_history.snapshot()  # the core's per-step history, asked for
    assert core.reset_prefix_cache() is True
    assert set(core.cached_block_hashes()) >= {"GPU"}


def test_the_core_runs_at_most_max_ahead_steps_past_the_front_end(core):
    before = core.get_metrics()["num_steps"]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i, p in enumerate(_prompts(2, seed=2)):
        core.add_request(f"ahead{i}", p, params)
    core.step()  # takes (and acknowledges) the first step
    deadline = time.monotonic() + 60  # (a first step of new shapes compiles first)
    while core.get_metrics()["num_steps"] - before < MAX_AHEAD + 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)  # unbounded, the tiny model would finish all 60 tokens meanwhile
    # It waits, still answering calls: the first step and MAX_AHEAD unacknowledged ones.
    assert core.get_metrics()["num_steps"] - before == MAX_AHEAD + 1
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    assert sorted(len(o.outputs[0].token_ids) for o in outs if o.finished) == [60, 60]


def test_an_id_added_again_gets_none_of_the_old_requests_steps(core):
    """vLLM's test_engine_core re-adds an id once its request ended. Here the core runs
    steps ahead, so steps of the old request were still on the way: aborted (or ended by a
    stop string, or already finished in the core) and added again at once, the new request
    got the old one's tokens and finish (found by porting vLLM's engine-core tests)."""
    ref_engine = LLM.from_engine(LLMEngine(EngineArgs(**ARGS), loaded=host_model()))
    old, new = _prompts(2, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = ref_engine.generate(new, params, use_tqdm=False)[0].outputs[0].token_ids
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for rid, first in (("again", long), ("short", params.clone(max_tokens=3))):
        core.add_request(rid, old, first)
        core.step()
        deadline = time.monotonic() + 60
        while core.get_metrics()["num_steps"] < MAX_AHEAD and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the core has its steps ahead queued
        core.abort_request(rid)
        core.add_request(rid, new, params)
        outs = []
        while core.has_unfinished_requests():
            outs += core.step()
        (done,) = [o for o in outs if o.finished]
        assert done.outputs[0].token_ids == want and done.outputs[0].finish_reason == "length"
    _drain(core)


def test_bad_input_is_refused_in_the_front_end(core):
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request("long", {"prompt_token_ids": [1] * 200})
    with pytest.raises(ValueError, match="unknown engine-core call"):
        core._call("shutdown")
    with pytest.raises(ValueError, match="ZMQ publisher"):
        core.subscribe_kv_events(print)
    assert core.step() == []  # idle: returns at once
    core.add_request("ok", {"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request("ok", {"prompt_token_ids": [3, 4, 5]})
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="not an already loaded model"):
        create_engine(EngineArgs(engine_core_process=True), loaded=host_model())
    with pytest.raises(ValueError, match="engine_core_process must be True or False"):
        create_engine(EngineArgs(engine_core_process="yes"))
    from jpaged.dp.client import DPEngineClient

    with pytest.raises(ValueError, match="engine_core_process is not supported with data"):
        DPEngineClient(EngineArgs(engine_core_process=True), 2)  # refused before Ray starts


def test_a_request_the_pool_cannot_hold_is_refused_before_the_core():
    engine = CoreProcessEngine(EngineArgs(**{**ARGS, "num_gpu_blocks_override": 4}),
                               loader=host_model)
    try:
        with pytest.raises(ValueError, match="KV blocks"):
            engine.add_request("big", {"prompt_token_ids": [1] * 60},
                               SamplingParams(max_tokens=20))
        assert engine.get_num_unfinished_requests() == 0
        # The core was never sent it and goes on serving.
        out = LLM.from_engine(engine).generate([{"prompt_token_ids": [1, 2]}],
                                               SamplingParams(max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
        # A dead core is named, and the engine says so from then on.
        engine.add_request("x", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=40))
        os.kill(engine.proc.pid, signal.SIGKILL)
        with pytest.raises(CoreProcessError, match="exit code -9"):
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.shutdown()
        engine.shutdown()  # idempotent
    assert not engine.proc.is_alive()


def test_a_model_the_core_cannot_load_is_named(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        create_engine(EngineArgs(model=str(missing), engine_core_process=True))


def test_a_real_server_streams_from_the_core_process():
    engine = AsyncLLMEngine(CoreProcessEngine(EngineArgs(**ARGS), loader=host_model))
    server = BackgroundServer(build_app(engine, "tiny"))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                               timeout=120)
        full = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=12,
                                         temperature=0.0)
        text = full.choices[0].text
        chunks = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=12,
                                           temperature=0.0, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == text
        stop = text.split()[3]  # a word the greedy output reaches: it ends the text there
        cut = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=12,
                                        temperature=0.0, stop=[" " + stop])
        assert cut.choices[0].finish_reason == "stop"
        assert text.startswith(cut.choices[0].text) and len(cut.choices[0].text) < len(text)
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        assert "jpaged:num_requests_running" in metrics
    finally:
        server.stop()
        engine.shutdown()
