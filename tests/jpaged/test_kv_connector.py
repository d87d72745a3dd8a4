"""KV connectors between two engines on the tiny model (127.0.0.1): a producer prefills, a
consumer pulls exactly the pages its prefix cache lacks and decodes the same greedy tokens as
one engine; holds time out, bad pulls and mismatched engines are refused, a lost producer is
recomputed (or fails only its request), and every block is free afterwards."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from helpers import free_port, tiny

from jpaged import SamplingParams
from jpaged.async_engine import AsyncLLMEngine
from jpaged.config import EngineArgs, KVTransferConfig
from jpaged.engine import LLMEngine
from jpaged.intmath import cdiv

BS = 8
GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)


def _args(xfer=None, **kw):
    a = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, block_size=BS,
             num_gpu_blocks_override=64, kv_transfer_config=xfer)
    a.update(kw)
    return EngineArgs(**a)


def _prompt(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def _run(engine, rid, prompt, params):
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    final = None
    deadline = time.monotonic() + 120
    while final is None and time.monotonic() < deadline:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None, f"{rid} did not finish"
    return final


async def _agen(engine, prompt, params):
    final = None
    async for out in engine.generate({"prompt_token_ids": prompt}, params):
        final = out
    return final


def _prefill(producer, prompt):
    """The producer's half: one token, and the params a consumer needs."""
    sp = SamplingParams(**{**GREEDY, "max_tokens": 1},
                        extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    return asyncio.run(asyncio.wait_for(_agen(producer, prompt, sp), 60))


def _decode_params(kvp):
    return SamplingParams(**GREEDY, extra_args={"kv_transfer_params": dict(kvp)})


def _wait(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def reference():
    engine = LLMEngine(_args(), loaded=tiny())
    cache = {}

    def tokens(prompt):
        key = tuple(prompt)
        if key not in cache:
            cache[key] = _run(engine, f"ref{len(cache)}", prompt,
                              SamplingParams(**GREEDY)).outputs[0].token_ids
        return cache[key]
    yield tokens
    engine.shutdown()


@pytest.fixture
def producer():
    xfer = {"kv_role": "kv_producer", "kv_port": free_port(),
            "kv_connector_extra_config": {"abort_timeout_s": 30}}
    engine = AsyncLLMEngine(LLMEngine(_args(xfer), loaded=tiny()))
    yield engine
    engine.shutdown()
    engine.engine.shutdown()


def _consumer(**xfer):
    cfg = {"kv_role": "kv_consumer", "kv_port": 0, **xfer}
    cfg.setdefault("kv_connector_extra_config", {"transfer_timeout_s": 5})
    return LLMEngine(_args(cfg), loaded=tiny())


def test_config_refuses_unknown_and_bad_fields():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['kv_buffer_size'\]"):
        KVTransferConfig.parse({"kv_role": "kv_both", "kv_buffer_size": 1})
    with pytest.raises(ValueError, match="kv_role must be one of"):
        KVTransferConfig.parse('{"kv_role": "producer"}')
    with pytest.raises(ValueError, match="kv_connector must be one of"):
        KVTransferConfig.parse({"kv_connector": "NixlConnector"})
    with pytest.raises(ValueError, match=r"kv_connector_extra_config has unknown field\(s\) "
                                         r"\['timeout'\]"):
        KVTransferConfig.parse({"kv_connector_extra_config": {"timeout": 3}})
    with pytest.raises(ValueError, match="shared_storage_path"):
        KVTransferConfig.parse({"kv_connector": "SharedStorageConnector"})
    with pytest.raises(ValueError, match="not valid JSON"):
        KVTransferConfig.parse("{kv_role: 1")
    cfg = KVTransferConfig.parse('{"kv_role": "kv_consumer", "kv_port": 0, '
                                 '"kv_load_failure_policy": "fail"}')
    assert cfg.is_consumer and not cfg.is_producer and cfg.kv_port == 0


def test_request_params_are_checked(producer):
    plain = LLMEngine(_args(), loaded=tiny())
    decode = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params":
                                                      {"do_remote_decode": True}})
    with pytest.raises(ValueError, match="no KV connector"):
        plain.add_request("a", {"prompt_token_ids": [1, 2, 3]}, decode)
    plain.shutdown()
    with pytest.raises(ValueError, match="needs a consumer engine"):
        producer.engine.add_request("b", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(
            extra_args={"kv_transfer_params": {"do_remote_prefill": True}}))
    with pytest.raises(ValueError, match="n=1"):
        producer.engine.add_request("c", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(
            n=2, extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
    consumer = _consumer()
    with pytest.raises(ValueError, match="remote_block_ids must be a list"):
        consumer.add_request("d", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(
            extra_args={"kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "x",
                                               "remote_host": "127.0.0.1", "remote_port": 1,
                                               "remote_request_id": "r"}}))
    consumer.shutdown()


def test_disaggregated_greedy_equals_one_engine(producer, reference):
    """Single prompts (one shorter than a block, one past the token budget: chunked prefill on
    the producer), then a shared system prompt the consumer already holds: only the pages it
    lacks are pulled."""
    consumer = _consumer()
    try:
        m = consumer.get_metrics
        for i, prompt in enumerate([_prompt(1, 5), _prompt(2, 150)]):
            pre = _prefill(producer, prompt)
            kvp = pre.kv_transfer_params
            assert kvp["do_remote_prefill"]
            assert len(kvp["remote_block_ids"]) == cdiv(len(prompt) - 1, BS)
            assert pre.outputs[0].token_ids == reference(prompt)[:1]
            before = m()["prompt_tokens_total"]
            out = _run(consumer, f"d{i}", prompt, _decode_params(kvp))
            assert out.outputs[0].token_ids == reference(prompt)
            assert m()["prompt_tokens_total"] - before == 1  # only the last prompt token
        assert m()["kv_transfer_blocks_received_total"] == 1 + 19
        system = _prompt(3, 64)  # 8 blocks every prompt below shares
        _run(consumer, "warm", system + _prompt(4, 9), SamplingParams(**GREEDY))
        got = m()["kv_transfer_blocks_received_total"]
        for j in range(2):
            prompt = system + _prompt(10 + j, 30)
            pre = _prefill(producer, prompt)
            out = _run(consumer, f"s{j}", prompt, _decode_params(pre.kv_transfer_params))
            assert out.outputs[0].token_ids == reference(prompt)
            assert out.num_cached_tokens == 64  # the shared blocks came from its own cache
            need = cdiv(len(prompt) - 1, BS) - 8
            assert m()["kv_transfer_blocks_received_total"] - got == need
            got += need
        _wait(lambda: producer.engine.kv_cache_usage == 0.0)
        assert consumer.kv_cache_usage == 0.0
        assert producer.get_metrics()["kv_transfer_requests_held"] == 0
    finally:
        consumer.shutdown()


def test_unpulled_blocks_are_freed_at_the_timeout():
    xfer = {"kv_role": "kv_producer", "kv_port": 0,
            "kv_connector_extra_config": {"abort_timeout_s": 0.3}}
    producer = AsyncLLMEngine(LLMEngine(_args(xfer), loaded=tiny()))
    try:
        pre = _prefill(producer, _prompt(5, 40))
        assert pre.kv_transfer_params["remote_block_ids"]
        _wait(lambda: producer.get_metrics().get("kv_transfer_requests_expired_total") == 1)
        _wait(lambda: producer.engine.kv_cache_usage == 0.0)
        # A pull that comes after the timeout names blocks the producer no longer holds.
        consumer = _consumer(kv_load_failure_policy="fail")
        out = _run(consumer, "late", _prompt(5, 40), _decode_params(pre.kv_transfer_params))
        assert out.outputs[0].finish_reason == "error"
        assert "holds no blocks" in out.outputs[0].stop_reason
        assert consumer.kv_cache_usage == 0.0
        consumer.shutdown()
    finally:
        producer.shutdown()
        producer.engine.shutdown()


def test_refused_and_failed_pulls_recompute_or_fail(producer, reference):
    prompt = _prompt(6, 50)
    pre = _prefill(producer, prompt)
    kvp = dict(pre.kv_transfer_params)
    # Blocks this request does not hold: refused, nothing corrupted, recomputed locally.
    forged = {**kvp, "remote_block_ids": [b + 30 for b in kvp["remote_block_ids"]]}
    consumer = _consumer()
    try:
        out = _run(consumer, "forged", prompt, _decode_params(forged))
        assert out.outputs[0].token_ids == reference(prompt)
        assert consumer.get_metrics()["kv_transfer_load_failures_total"] == 1
        # The real pull still works afterwards: the refused one changed nothing.
        out = _run(consumer, "real", prompt, _decode_params(kvp))
        assert out.outputs[0].token_ids == reference(prompt)
        # A producer that is gone: recompute (the default policy).
        pre2 = _prefill(producer, _prompt(7, 30))
        gone = {**pre2.kv_transfer_params, "remote_port": free_port()}
        out = _run(consumer, "gone", _prompt(7, 30), _decode_params(gone))
        assert out.outputs[0].token_ids == reference(_prompt(7, 30))
        assert consumer.kv_cache_usage == 0.0
    finally:
        consumer.shutdown()


def test_mismatched_engines_are_refused_at_connect(producer):
    prompt = _prompt(8, 40)
    pre = _prefill(producer, prompt)
    other = LLMEngine(_args({"kv_role": "kv_consumer", "kv_port": 0,
                             "kv_load_failure_policy": "fail"}, block_size=16), loaded=tiny())
    try:
        out = _run(other, "mm", prompt, _decode_params(pre.kv_transfer_params))
        why = out.outputs[0].stop_reason
        assert out.outputs[0].finish_reason == "error"
        assert "block_size differs between the producer (8) and the consumer (16)" in why
        assert other.kv_cache_usage == 0.0
    finally:
        other.shutdown()


def test_abort_while_pulling_frees_blocks(producer, reference):
    prompt = _prompt(9, 120)
    pre = _prefill(producer, prompt)
    consumer = _consumer()
    try:
        consumer.add_request("x", {"prompt_token_ids": prompt},
                             _decode_params(pre.kv_transfer_params))
        consumer.step()  # admitted: its blocks are allocated, its pull started
        assert consumer.scheduler.waiting_for_kv
        consumer.abort_request("x")
        assert consumer.kv_cache_usage == 0.0
        other = _prompt(11, 120)  # may reuse the freed blocks while the pages arrive
        out = _run(consumer, "y", other, SamplingParams(**GREEDY))
        assert out.outputs[0].token_ids == reference(other)
        consumer.kv_worker.wait_for_load(10)
        consumer.step()
        assert consumer.kv_cache_usage == 0.0
    finally:
        consumer.shutdown()


def test_shared_storage_connector(tmp_path, reference):
    cfg = {"kv_connector": "SharedStorageConnector",
           "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    producer = LLMEngine(_args({**cfg, "kv_role": "kv_producer"}), loaded=tiny())
    consumer = LLMEngine(_args({**cfg, "kv_role": "kv_consumer"}), loaded=tiny())
    try:
        prompt = _prompt(12, 70)
        sp = SamplingParams(**{**GREEDY, "max_tokens": 1},
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        pre = _run(producer, "p", prompt, sp)
        held = producer.cache_state()["requests"]["p"]
        assert held["held_for_kv_transfer"] and len(held["block_table"]) == 9
        producer.step()  # the save runs, then the blocks are freed
        producer.step()
        assert producer.kv_cache_usage == 0.0
        out = _run(consumer, "c", prompt, _decode_params(pre.kv_transfer_params))
        assert out.outputs[0].token_ids == reference(prompt)
        assert consumer.get_metrics()["kv_transfer_blocks_received_total"] == 69 // BS
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_one_params_object_for_several_consumer_requests(tmp_path, reference):
    """As LLM.generate(prompts, params) does: one SamplingParams for several consumer
    requests. Each pulls its own KV (the first's pull marked the shared dict done, so the
    others recomputed) and the caller's dict is left as given (vLLM clones per request)."""
    cfg = {"kv_connector": "SharedStorageConnector",
           "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    producer = LLMEngine(_args({**cfg, "kv_role": "kv_producer"}), loaded=tiny())
    consumer = LLMEngine(_args({**cfg, "kv_role": "kv_consumer"}), loaded=tiny())
    try:
        prompts = [_prompt(20 + i, 40) for i in range(2)]
        store = SamplingParams(**{**GREEDY, "max_tokens": 1},
                               extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        for i, p in enumerate(prompts):
            _run(producer, f"p{i}", p, store)
        for _ in range(3):
            producer.step()  # the saves run
        shared = SamplingParams(**GREEDY, extra_args={
            "kv_transfer_params": {"do_remote_prefill": True}})
        for i, p in enumerate(prompts):
            out = _run(consumer, f"c{i}", p, shared)
            assert out.outputs[0].token_ids == reference(p)
        assert consumer.get_metrics()["kv_transfer_blocks_received_total"] == 2 * (39 // BS)
        assert shared.extra_args["kv_transfer_params"] == {"do_remote_prefill": True}
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_consumer_request_aborted_before_its_pull_releases_the_producer(producer):
    """Found by vLLM's connector tests: a consumer request aborted while still queued (its
    pull never started) tells the producer to free the blocks it holds for it at once; they
    were held to the producer's abort_timeout_s (30 s here, 120 by default)."""
    prompt = _prompt(30, 40)
    pre = _prefill(producer, prompt)
    stats = producer.engine.scheduler.get_stats
    assert stats()["kv_transfer_requests_held"] == 1
    consumer = _consumer()
    try:
        consumer.add_request("c", {"prompt_token_ids": prompt},
                             _decode_params(pre.kv_transfer_params))
        consumer.abort_request("c")  # its client went away before it was admitted

        def released():
            consumer.step()
            return stats()["kv_transfer_requests_held"] == 0
        _wait(released, timeout=10)
        _wait(lambda: producer.engine.kv_cache_usage == 0.0, timeout=10)
    finally:
        consumer.shutdown()
