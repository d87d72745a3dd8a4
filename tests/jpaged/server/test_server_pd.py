"""Disaggregated prefill/decode through two real OpenAI servers on 127.0.0.1 (tiny model): the
producer answers a `do_remote_decode` request with its first token and kv_transfer_params, the
consumer pulls the KV and streams the rest; the text equals one engine's; /metrics counts the
transfer; a consumer with policy "fail" answers a bad pull with a 500 naming the cause."""

from __future__ import annotations

import httpx
import openai
import pytest
from helpers import tiny
from serverkit import ENGINE_ARGS, MODEL, Served

from jpaged.async_engine import AsyncLLMEngine
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.server import BackgroundServer, build_app

PROMPT = "The paged KV cache moves between engines"


def _serve(role: str, **xfer) -> tuple[Served, BackgroundServer]:
    cfg = {"kv_role": role, "kv_port": 0, **xfer}
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**ENGINE_ARGS, kv_transfer_config=cfg),
                                      loaded=tiny()))
    server = BackgroundServer(build_app(engine, MODEL))
    return Served(engine, server.url), server


@pytest.fixture(scope="module")
def pair():
    made = [_serve("kv_producer"), _serve("kv_consumer")]
    yield made[0][0], made[1][0]
    for served, server in made:
        server.stop()
        served.engine.shutdown()
        served.engine.engine.shutdown()


def _prefill(producer: Served, prompt: str = PROMPT):
    return producer.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
        extra_body={"kv_transfer_params": {"do_remote_decode": True}})


def test_completion_streams_after_a_remote_prefill(pair):
    producer, consumer = pair
    ref = consumer.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                               temperature=0, extra_body={"ignore_eos": True})
    pre = _prefill(producer)
    kvp = pre.model_extra["kv_transfer_params"]
    assert kvp["do_remote_prefill"] and kvp["remote_block_ids"]
    assert ref.choices[0].text.startswith(pre.choices[0].text)
    consumer.engine.engine.reset_prefix_cache()  # the pages must come from the producer
    before = consumer.metrics().get("jpaged:kv_transfer_blocks_received_total", 0.0)
    stream = consumer.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "kv_transfer_params": kvp})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == ref.choices[0].text
    m = consumer.metrics()
    assert m["jpaged:kv_transfer_blocks_received_total"] - before == len(kvp["remote_block_ids"])
    assert producer.metrics()["jpaged:kv_transfer_blocks_sent_total"] >= len(
        kvp["remote_block_ids"])
    producer.wait_drained()
    consumer.wait_drained()


def test_chat_returns_kv_transfer_params(pair):
    producer, consumer = pair
    msgs = [{"role": "user", "content": "Say hello"}]
    pre = producer.client().chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=1, temperature=0,
        extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    kvp = pre.model_extra["kv_transfer_params"]
    out = consumer.client().chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=4, temperature=0,
        extra_body={"kv_transfer_params": kvp})
    assert out.choices[0].message.content.startswith(pre.choices[0].message.content)
    plain = consumer.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert plain.model_extra["kv_transfer_params"] is None


def test_bad_params_and_failed_pulls_answer_clearly(pair):
    producer, consumer = pair
    with pytest.raises(openai.BadRequestError, match="needs a consumer engine"):
        producer.client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2,
            extra_body={"kv_transfer_params": {"do_remote_prefill": True}})
    with pytest.raises(openai.BadRequestError, match="single prompt"):
        producer.client().completions.create(
            model=MODEL, prompt=["a", "b"], max_tokens=1,
            extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    served, server = _serve("kv_consumer", kv_load_failure_policy="fail")
    try:
        kvp = _prefill(producer).model_extra["kv_transfer_params"]
        forged = {**kvp, "remote_request_id": "nobody"}
        r = httpx.post(f"{served.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": forged})
        assert r.status_code == 500
        assert "holds no blocks" in r.json()["error"]["message"]
        served.wait_drained()
    finally:
        server.stop()
        served.engine.shutdown()
        served.engine.engine.shutdown()
