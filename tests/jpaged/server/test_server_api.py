"""The OpenAI-compatible API through the official `openai` client against a real uvicorn server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from helpers import tiny
from serverkit import ENGINE_ARGS, MODEL

from jpaged.server import BackgroundServer, build_app

GREEDY = dict(model=MODEL, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def test_completion_stream_equals_full_text_and_usage(served):
    client = served.client()
    prompt = "The paged KV cache"
    full = client.completions.create(prompt=prompt, **GREEDY)
    assert full.object == "text_completion" and full.model == MODEL
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    n_prompt = len(served.engine.tokenizer.encode(prompt))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (n_prompt, 12)
    assert full.usage.total_tokens == n_prompt + 12

    chunks = list(client.completions.create(prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1  # it streamed
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == n_prompt


def test_completion_prompt_list_token_ids_n_and_echo(served):
    client = served.client()
    ids = served.engine.tokenizer.encode("token ids", add_special_tokens=False)
    out = client.completions.create(model=MODEL, prompt=["first", "second"], n=2, max_tokens=5,
                                    temperature=0.9, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 20
    tok = served.engine.tokenizer
    assert out.usage.prompt_tokens == len(tok.encode("first")) + len(tok.encode("second"))
    again = client.completions.create(model=MODEL, prompt=["first", "second"], n=2,
                                      max_tokens=5, temperature=0.9, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded
    by_ids = client.completions.create(prompt=ids, echo=True, **GREEDY)
    assert by_ids.choices[0].text.startswith("token ids")
    assert by_ids.usage.prompt_tokens == len(ids)


def test_completion_logprobs(served):
    out = served.client().completions.create(prompt="log probs", logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    # Offsets advance by each token's own text (a byte token alone may decode to U+FFFD).
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # Keys are token texts: distinct byte tokens decoding to U+FFFD share one key.
        assert val <= 0.0 and 1 <= len(top) <= 3 and tok in top


def test_echo_with_logprobs_scores_the_prompt_and_max_tokens_0_only_scores(served):
    """As vLLM (an eval harness's log-likelihood call): echo with logprobs returns the prompt's
    tokens, each with its logprob (the first null), then the generated ones; max_tokens 0
    with echo returns the prompt alone, scored, streamed or not."""
    client, tok = served.client(), served.engine.tokenizer
    prompt = "The capital of France is"
    n = len(tok.encode(prompt))
    kw = {**GREEDY, "max_tokens": 3}
    plain = client.completions.create(prompt=prompt, logprobs=2, **kw).choices[0]
    scored = client.completions.create(prompt=prompt, max_tokens=1, temperature=0,
                                       model=MODEL, extra_body={"prompt_logprobs": 2})
    want_prompt = [None] + [e[str(t)]["logprob"] for t, e in zip(
        tok.encode(prompt)[1:], scored.choices[0].prompt_logprobs[1:], strict=True)]
    echo = client.completions.create(prompt=prompt, logprobs=2, echo=True, **kw).choices[0]
    lp = echo.logprobs
    assert echo.text == prompt + plain.text
    assert len(lp.tokens) == n + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[:n] == pytest.approx(want_prompt, abs=1e-5)
    assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 3)]
    only = client.completions.create(prompt=prompt, logprobs=1, echo=True,
                                     **{**kw, "max_tokens": 0}).choices[0]
    assert only.text == prompt and only.finish_reason == "length"
    assert only.logprobs.token_logprobs == pytest.approx(want_prompt, abs=1e-5)
    chunks = list(client.completions.create(prompt=prompt, logprobs=2, echo=True, stream=True,
                                            **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echo.text
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:],
                                                                 abs=1e-5)
    r = _post(served.url, "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                     "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_chat_stream_equals_full_reply(served):
    client = served.client()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    full = client.chat.completions.create(messages=msgs, **GREEDY)
    assert full.object == "chat.completion"
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content and full.choices[0].finish_reason == "length"
    prompt = served.engine.tokenizer.apply_chat_template(msgs)
    n_prompt = len(served.engine.tokenizer.encode(prompt, add_special_tokens=False))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (n_prompt, 12)

    chunks = list(client.chat.completions.create(messages=msgs, stream=True,
                                                 stream_options={"include_usage": True},
                                                 **GREEDY))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == msg.content
    assert body[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == n_prompt

    lp = client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=2, **GREEDY)
    content = lp.choices[0].logprobs.content
    assert len(content) == 12 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob, abs=1e-5)
    # A hot draw below the top two still lists only the top two; top_logprobs 0, none.
    hot = {**GREEDY, "temperature": 5.0, "seed": 3}
    for k in (0, 2):
        content = client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=k,
                                                 **hot).choices[0].logprobs.content
        assert all(len(c.top_logprobs) == k for c in content), k


def _post(url: str, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", timeout=60, **kw)


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 5}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 300}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 99999]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": None}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True,
                         "stream_options": {"include_usage": None}}, 400, "stream_options"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [99999]}, 400,
     "stop_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
    ("/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400,
     "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages"),
])
def test_bad_requests_get_openai_errors(served, path, body, status, param):
    r = _post(served.url, path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert served.engine.get_metrics()["num_unfinished_requests"] == 0


def test_malformed_json_and_unknown_route_then_still_serving(served):
    r = _post(served.url, "/v1/completions", content=b"{not json",
              headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = _post(served.url, "/v1/nothing-here", json={})
    assert r.status_code == 404 and r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        served.client().completions.create(model=MODEL, prompt="x", top_p=3)
    assert e.value.body["param"] == "top_p"
    ok = served.client().completions.create(model=MODEL, prompt="still", max_tokens=2)
    assert ok.choices[0].text is not None
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_api_key(served):
    server = BackgroundServer(build_app(served.engine, MODEL, api_key="sekrit"))
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = httpx.get(f"{server.url}/v1/models", headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
            # The key is checked before the body is read: a malformed body is a 401 too.
            r = httpx.post(f"{server.url}/v1/completions", headers=headers, content=b"{bad")
            assert r.status_code == 401, r.text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong",
                          max_retries=0).completions.create(model=MODEL, prompt="x")
        good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekrit", max_retries=0)
        assert [m.id for m in good.models.list()] == [MODEL]
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
        assert httpx.get(f"{server.url}/health").status_code == 200  # open, as vLLM's
        assert httpx.get(f"{server.url}/metrics").status_code == 200
    finally:
        server.stop()
    assert served.engine.is_running  # the app does not own (or stop) a shared engine


def test_several_served_names(served):
    """vLLM's --served-model-name a b: requests may name either, /v1/models lists both, the
    answers and metrics carry the first; any other name is a 404."""
    server = BackgroundServer(build_app(served.engine, ["first", "alias"]))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list()] == ["first", "alias"]
        assert client.models.retrieve("alias").id == "alias"
        r = client.completions.create(model="alias", prompt="x", max_tokens=2)
        assert r.model == "first"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="x", max_tokens=2)
        assert 'model_name="first"' in httpx.get(f"{server.url}/metrics", timeout=30).text
    finally:
        server.stop()


def test_cors_as_vllms_and_preflights_pass_the_key(served):
    """vLLM's CORS: every origin by default, so a browser page may call the API; a preflight
    (OPTIONS, which carries no key) is answered, the request itself still needs the key;
    --allowed-origins narrows it."""
    pre = {"Origin": "http://page.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    for origins, allowed in ((("*",), True), (("http://other.example",), False)):
        server = BackgroundServer(build_app(served.engine, MODEL, api_key="k",
                                            allowed_origins=origins))
        try:
            r = httpx.options(f"{server.url}/v1/chat/completions", headers=pre)
            assert (r.status_code == 200) == allowed, r.text
            got = r.headers.get("access-control-allow-origin")
            assert (got in ("*", "http://page.example")) == allowed, got
            r = httpx.get(f"{server.url}/v1/models", headers={
                "Origin": "http://page.example", "Authorization": "Bearer k"})
            assert r.status_code == 200
            assert ("access-control-allow-origin" in r.headers) == allowed
            assert httpx.get(f"{server.url}/v1/models", headers={
                "Origin": "http://page.example"}).status_code == 401
        finally:
            server.stop()


def test_models_health_and_metrics(served):
    models = served.client().models.list()
    assert [m.id for m in models] == [MODEL]
    assert httpx.get(f"{served.url}/health").status_code == 200
    before = served.metrics()
    served.client().completions.create(prompt="count me", **GREEDY)
    m = served.metrics()
    for name in ("jpaged:num_preemptions_total", "jpaged:kv_cache_usage_perc",
                 "jpaged:prefix_cache_queries_total", "jpaged:prefix_cache_hits_total",
                 "jpaged:num_requests_running", "jpaged:num_requests_waiting",
                 "jpaged:prompt_tokens_total", "jpaged:generation_tokens_total",
                 "jpaged:time_to_first_token_seconds_count",
                 "jpaged:inter_token_latency_seconds_count",
                 "jpaged:e2e_request_latency_seconds_count", "jpaged:request_success_total",
                 "jpaged:num_blocks_usable"):
        assert name in m, name
    assert m["jpaged:generation_tokens_total"] - before["jpaged:generation_tokens_total"] == 12
    prompt = len(served.engine.tokenizer.encode("count me"))
    assert m["jpaged:prompt_tokens_total"] - before["jpaged:prompt_tokens_total"] == prompt
    # Sent again, the prompt is counted whole again (vLLM's prompt_tokens), though its blocks
    # come from the prefix cache; the computed count grows by what was recomputed.
    served.client().completions.create(prompt="count me", **GREEDY)
    again = served.metrics()
    assert again["jpaged:prompt_tokens_total"] - m["jpaged:prompt_tokens_total"] == prompt
    assert 0 < (again["jpaged:prompt_tokens_computed_total"]
                - m["jpaged:prompt_tokens_computed_total"]) <= prompt
    assert m["jpaged:time_to_first_token_seconds_count"] == (
        before["jpaged:time_to_first_token_seconds_count"] + 1)
    assert m["jpaged:inter_token_latency_seconds_count"] == (
        before["jpaged:inter_token_latency_seconds_count"] + 11)
    assert m["jpaged:e2e_request_latency_seconds_sum"] > 0
    assert 0.0 <= m["jpaged:kv_cache_usage_perc"] <= 1.0
    assert m["jpaged:num_requests_running"] == 0 and m["jpaged:num_preemptions_total"] == 0
    assert m["jpaged:num_blocks_usable"] == 159
    # As vLLM's: every series carries the served model's name and the engine's index.
    text = httpx.get(f"{served.url}/metrics", timeout=30).text
    samples = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert samples and all(f'model_name="{MODEL}"' in ln and 'engine="0"' in ln
                           for ln in samples)
    # vLLM's request phase, size and iteration families: one finished sequence more.
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_params_n",
                 "request_params_max_tokens", "request_max_num_generation_tokens"):
        key = f"jpaged:{name}_count"
        assert m[key] == before.get(key, 0) + 1, name
    for name in ("request_generation_tokens", "request_max_num_generation_tokens"):
        key = f"jpaged:{name}_sum"
        assert m[key] - before.get(key, 0) == 12, name
    assert m["jpaged:iteration_tokens_total_count"] > before.get(
        "jpaged:iteration_tokens_total_count", 0)
    text = httpx.get(f"{served.url}/metrics", timeout=30).text
    assert 'jpaged:cache_config_info{block_size="16"' in text


def test_streams_answer_as_vllms(served):
    """n > 1 streams send each choice's final chunk once; streamed text_offset equals the
    non-streamed one while a stop string holds text back; "model": "" is the served model;
    client.models.retrieve works; seeds 0 and 2^32 draw differently."""
    client = served.client()
    prompt = "Once upon a time"
    for stream_kw in ({}, {"n": 3, "temperature": 1.0, "seed": 7}):
        kw = {**GREEDY, "max_tokens": 6, **stream_kw}
        chunks = list(client.completions.create(prompt=prompt, stream=True, **kw))
        finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
        assert sorted(c.choices[0].index for c in finals) == list(range(kw.get("n", 1)))
        chat = list(client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], stream=True, **kw))
        finals = [c for c in chat if c.choices and c.choices[0].finish_reason is not None]
        assert sorted(c.choices[0].index for c in finals) == list(range(kw.get("n", 1)))
    # A stop string that cannot match holds back its length's text every step.
    kw = {**GREEDY, "max_tokens": 8, "logprobs": 1, "stop": ["zzzzzz-never"]}
    full = client.completions.create(prompt=prompt, **kw).choices[0].logprobs.text_offset
    streamed = [o for c in client.completions.create(prompt=prompt, stream=True, **kw)
                if c.choices and c.choices[0].logprobs
                for o in c.choices[0].logprobs.text_offset]
    assert streamed == full
    assert client.completions.create(prompt=prompt, **{**GREEDY, "model": ""}).choices[0].text
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    draws = {s: client.completions.create(prompt=prompt, model=MODEL, max_tokens=8, seed=s,
                                          temperature=1.0).choices[0].text
             for s in (0, 2**32)}
    assert draws[0] != draws[2**32]


def test_cache_salt_isolates_tenants(served):
    client = served.client()
    prompt = "A shared system prompt, long enough for some blocks. " * 2
    kw = {"model": MODEL, "temperature": 0, "max_tokens": 2}

    def ask(salt):
        return client.completions.create(prompt=prompt, extra_body={"cache_salt": salt}, **kw)
    ask("a")
    again, other = ask("a"), ask("b")
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("field,value", [
    ("logits_processors", ["x"]), ("reasoning_effort", "low"),
    ("documents", [{"text": "x"}]),
    ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"),
    # Found porting vLLM's server tests: these were accepted and dropped.
    ("logprob_token_ids", [100]), ("packed_top_logprobs", True), ("watermarking", {}),
    ("thinking_token_budget", 8), ("stream_interval", 4), ("prediction", {"type": "content"}),
    # A field nobody defines: named too, never dropped.
    ("top_n_tokens", 3), ("kv_transfer_params", {"return_last_hidden_state": True})])
def test_vllm_fields_not_implemented_are_refused_by_name(served, field, value):
    chat = field in ("documents", "functions", "function_call", "logprob_token_ids",
                     "prediction")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "x"}
    r = _post(served.url, path, json={"model": MODEL, "max_tokens": 1, **body, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]
    if field == "kv_transfer_params":
        assert "return_last_hidden_state" in r.json()["error"]["message"]


def test_openai_fields_without_effect_are_accepted(served):
    """OpenAI's storage / billing / routing hints change nothing generated: accepted."""
    r = _post(served.url, "/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
        "safety_identifier": "u1", "prompt_cache_key": "k"})
    assert r.status_code == 200, r.text


def test_chat_token_in_and_add_special_tokens(served):
    """vLLM's token-in chat: prompt_token_ids (as /tokenize renders the messages) with
    messages [] gives the templated request's answer; template options beside it, or ids
    beside messages, are 400s naming them. add_special_tokens reaches the tokenizer."""
    msgs = [{"role": "user", "content": "Hello, how are you today?"}]
    ids = _post(served.url, "/tokenize", json={"messages": msgs}).json()["tokens"]
    kw = {"model": MODEL, "max_completion_tokens": 6, "temperature": 0, "ignore_eos": True}
    base = _post(served.url, "/v1/chat/completions", json={**kw, "messages": msgs}).json()
    token_in = _post(served.url, "/v1/chat/completions", json={
        **kw, "messages": [], "prompt_token_ids": ids, "return_token_ids": True}).json()
    assert token_in["prompt_token_ids"] == ids
    assert token_in["choices"][0]["message"]["content"] == base["choices"][0]["message"][
        "content"]
    for extra, param in (({"add_generation_prompt": True}, "add_generation_prompt"),
                         ({"chat_template": "{{ x }}"}, "chat_template"),
                         ({"messages": msgs}, "prompt_token_ids"),
                         ({"prompt_token_ids": []}, "prompt_token_ids"),
                         ({"prompt_token_ids": [1, 10**6]}, "prompt_token_ids")):
        r = _post(served.url, "/v1/chat/completions", json={
            **kw, "messages": [], "prompt_token_ids": ids, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    r = _post(served.url, "/v1/chat/completions", json={**kw, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_add_special_tokens_reaches_the_tokenizer():
    """vLLM's add_special_tokens: a completion's prompt gets the tokenizer's BOS unless it
    says false; a chat's rendered messages get it only when it says true."""
    import dataclasses

    from tokenizers import Tokenizer as Backend

    from jpaged.async_engine import AsyncLLMEngine
    from jpaged.config import EngineArgs
    from jpaged.engine import LLMEngine
    from models.tokenizer import Tokenizer, _set_bos_eos_processor

    loaded = tiny()
    tok = loaded.tokenizer
    backend = Backend.from_str(tok.backend.to_str())
    _set_bos_eos_processor(backend, tok.bos_token, None)  # this copy adds <s> in front
    with_bos = Tokenizer(backend, bos_token=tok.bos_token, eos_token=tok.eos_token,
                         chat_template=tok.chat_template)
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**ENGINE_ARGS),
                                      loaded=dataclasses.replace(loaded, tokenizer=with_bos)))
    server = BackgroundServer(build_app(engine, MODEL))
    bos = with_bos.bos_token_id
    kw = {"model": MODEL, "max_tokens": 1, "return_token_ids": True}
    try:
        for path, body, default in (
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                 False),
                ("/v1/completions", {"prompt": "abc"}, True)):
            for add in (None, True, False):
                extra = {} if add is None else {"add_special_tokens": add}
                got = _post(server.url, path, json={**kw, **body, **extra}).json()
                pids = got.get("prompt_token_ids") or got["choices"][0]["prompt_token_ids"]
                assert (pids[0] == bos) == (default if add is None else add), (path, add)
                assert pids.count(bos) == (pids[0] == bos)
    finally:
        server.stop()
        engine.shutdown()


def test_chat_stream_prompt_token_ids_on_the_first_chunk(served):
    """As vLLM: a streamed chat with return_token_ids carries the prompt's ids on its first
    chunk (the role), and on no other."""
    msgs = [{"role": "user", "content": "Repeat after me"}]
    want = _post(served.url, "/tokenize", json={"messages": msgs}).json()["tokens"]
    for n in (1, 2):
        chunks = list(served.client().chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=4, n=n, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True}))
        extras = [c.model_extra or {} for c in chunks]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert extras[0].get("prompt_token_ids") == want
        assert all("prompt_token_ids" not in e for e in extras[1:])
        assert sum(len(c.choices[0].model_extra.get("token_ids") or [])
                   for c in chunks if c.choices) == 4 * n


def test_truncate_prompt_tokens_token_ids_usage_and_request_id(served):
    client = served.client()
    tok = served.engine.tokenizer
    prompt = "one two three four five six seven eight"
    ids = tok.encode(prompt)
    kw = {**GREEDY, "max_tokens": 3}
    cut = client.completions.create(prompt=prompt, **{**kw, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 5, "return_token_ids": True,
        "request_id": "my-id-1"}})
    assert cut.id == "my-id-1" and cut.usage.prompt_tokens == 5
    choice = cut.choices[0].model_extra
    assert choice["prompt_token_ids"] == ids[-5:] and len(choice["token_ids"]) == 3
    same = client.completions.create(prompt=ids[-5:], **kw)
    assert same.choices[0].text == cut.choices[0].text
    chunks = list(client.completions.create(
        prompt=prompt, stream=True, stream_options={"include_usage": True,
                                                    "continuous_usage_stats": True},
        **{**kw, "extra_body": {"ignore_eos": True, "return_token_ids": True}}))
    content = [c for c in chunks if c.choices]
    assert all(c.usage is not None and c.usage.prompt_tokens == len(ids) for c in content)
    assert [c.usage.completion_tokens for c in content][-1] == 3
    assert content[0].choices[0].model_extra["prompt_token_ids"] == ids
    assert sum(len(c.choices[0].model_extra["token_ids"]) for c in content) == 3
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], model=MODEL, max_tokens=2,
        extra_body={"return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] and chat.choices[0].model_extra["token_ids"]


def test_logit_bias_and_allowed_token_ids(served):
    """OpenAI's logit_bias (+100 forces a token, with its id as a string key) and vLLM's
    allowed_token_ids hold for every generated token, streamed or not; bad ids or values are
    refused by name and the engine keeps serving."""
    client = served.client()
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 1.0, "seed": 1}
    forced = client.completions.create(prompt="x", logit_bias={"65": 100}, **kw,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert forced.choices[0].model_extra["token_ids"] == [65] * 6
    allowed = [66, 67, 68]
    chunks = list(client.completions.create(
        prompt="x", stream=True, **kw, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                   "allowed_token_ids": allowed}))
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert len(ids) == 6 and set(ids) <= set(allowed)
    for body, param in (({"logit_bias": {"99999": 1}}, "logit_bias"),
                        ({"logit_bias": {"65": 101}}, "logit_bias"),
                        ({"logit_bias": {"a": 1}}, "logit_bias"),
                        ({"allowed_token_ids": [99999]}, "allowed_token_ids"),
                        ({"allowed_token_ids": []}, "allowed_token_ids")):
        r = _post(served.url, "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                       "max_tokens": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert client.completions.create(prompt="x", **kw).choices[0].text is not None


def test_prompt_logprobs_on_both_endpoints(served):
    """vLLM's prompt_logprobs: per choice on /v1/completions (in a stream's first chunk), at
    the top of a chat response; None first, then {token id: {logprob, rank, decoded_token}}."""
    ids = [5, 17, 99, 42, 7]
    r = _post(served.url, "/v1/completions", json={
        "model": MODEL, "prompt": ids, "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for entry, tok in zip(plp[1:], ids[1:], strict=True):
        assert str(tok) in entry and 2 <= len(entry) <= 3
        assert entry[str(tok)]["logprob"] <= 0 and entry[str(tok)]["rank"] >= 1
    with httpx.stream("POST", f"{served.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": ids, "max_tokens": 3, "prompt_logprobs": 2,
            "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]
    with_plp = [c for c in chunks if "prompt_logprobs" in c["choices"][0]]
    assert len(with_plp) == 1 and with_plp[0]["choices"][0]["prompt_logprobs"] == plp
    chat = _post(served.url, "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "prompt_logprobs": 0})
    body = chat.json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == \
        body["usage"]["prompt_tokens"]
    bad = _post(served.url, "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                     "prompt_logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_chat_template_kwargs_continue_final_message_echo_and_token_ids(served):
    """vLLM's chat extras: a template of the request's own with its variables, the final
    assistant message continued and echoed, logprob tokens as "token_id:N"."""
    tok = served.engine.tokenizer
    msgs = [{"role": "user", "content": "hi"}]
    r = _post(served.url, "/v1/chat/completions", json={
        "model": MODEL, "messages": msgs, "max_tokens": 1,
        "chat_template": "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}",
        "chat_template_kwargs": {"greeting": "Hello: "}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("Hello: hi",
                                                                add_special_tokens=False))
    cont = [*msgs, {"role": "assistant", "content": "The answer is"}]
    r = _post(served.url, "/v1/chat/completions", json={
        "model": MODEL, "messages": cont, "max_tokens": 3, "continue_final_message": True,
        "add_generation_prompt": False, "echo": True, "temperature": 0})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert text.startswith("The answer is") and len(text) > len("The answer is")
    prompt = tok.apply_chat_template(cont, add_generation_prompt=False,
                                     continue_final_message=True)
    assert prompt.endswith("The answer is")
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": cont, "max_tokens": 3, "continue_final_message": True,
            "add_generation_prompt": False, "echo": True, "temperature": 0,
            "stream": True}) as s:
        deltas = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                  for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(deltas) == text
    r = _post(served.url, "/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 2, "logprobs": 1,
        "return_tokens_as_token_ids": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    for body, param in (({"chat_template": "{% for %}"}, "chat_template"),
                        ({"continue_final_message": True, "add_generation_prompt": True},
                         "continue_final_message"),
                        ({"chat_template_kwargs": [1]}, "chat_template_kwargs")):
        bad = _post(served.url, "/v1/chat/completions", json={
            "model": MODEL, "messages": cont, "max_tokens": 1, **body})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == param


def _sse(path_url: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed response (the [DONE] line left out)."""
    with httpx.stream("POST", path_url, timeout=60, json=body) as s:
        assert s.status_code == 200, s.read()
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


def test_logprobs_of_tokens_a_choice_masks_are_written_as_vllms_floor(served):
    """A structured choice leaves every other token -inf, which JSON cannot carry: each
    logprob a response writes is at least -9999.0, vLLM's floor, on both endpoints, whole
    and streamed (a 500 "Out of range float values are not JSON compliant" before)."""
    from jpaged.outputs import Logprob
    from jpaged.server.logprobs import prompt_logprobs_json

    choice = {"guided_choice": ["123", "456"], "max_tokens": 4, "seed": 0}
    comp = {"model": MODEL, "prompt": "x", "logprobs": 5, **choice}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
            "top_logprobs": 5, **choice}

    def values(lps: dict | None, path: str) -> list[float]:
        if lps is None:
            return []
        if path == "/v1/completions":
            return [*lps["token_logprobs"], *(v for t in lps["top_logprobs"] for v in t.values())]
        return [x for c in lps["content"] for x in
                (c["logprob"], *(t["logprob"] for t in c["top_logprobs"]))]

    for path, body in (("/v1/completions", comp), ("/v1/chat/completions", chat)):
        r = _post(served.url, path, json=body)
        assert r.status_code == 200, r.text
        whole = values(r.json()["choices"][0]["logprobs"], path)
        chunks = _sse(f"{served.url}{path}", {**body, "stream": True})
        streamed = [v for c in chunks if c["choices"]
                    for v in values(c["choices"][0].get("logprobs"), path)]
        for got in (whole, streamed):
            assert got and min(got) == -9999.0, got  # masked candidates among the top 5
            assert all(v == -9999.0 or -9999.0 < v <= 0.0 for v in got)
    # Prompt logprobs go through the same floor.
    plp = prompt_logprobs_json([None, {5: Logprob(float("-inf"), 7, "x")}])
    assert plp == [None, {"5": {"logprob": -9999.0, "rank": 7, "decoded_token": "x"}}]


def test_continuous_usage_stats_on_every_chunk_the_first_included(served):
    """stream_options {include_usage, continuous_usage_stats}: every chunk carries usage as
    vLLM counts it (the choice's prompt and its tokens so far), the chat role chunk too."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    msgs = [{"role": "user", "content": "count me"}]
    chunks = _sse(f"{served.url}/v1/chat/completions", {
        "model": MODEL, "messages": msgs, "max_tokens": 5, "ignore_eos": True, "n": 2,
        "temperature": 1.0, "seed": 3, "stream": True, "stream_options": opts})
    final = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and final["completion_tokens"] == 10
    content = chunks[:-1]
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["usage"] is not None for c in content), content[0]
    assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] for c in content)
    for i in range(2):  # each choice's count climbs from 0 (its role chunk) to max_tokens
        counts = [c["usage"]["completion_tokens"] for c in content
                  if c["choices"][0]["index"] == i]
        assert counts[0] == 0 and counts[-1] == 5 and counts == sorted(counts)
        assert all(c["usage"]["total_tokens"] == final["prompt_tokens"] + n
                   for c, n in zip([c for c in content if c["choices"][0]["index"] == i],
                                   counts, strict=True))
    comp = _sse(f"{served.url}/v1/completions", {
        "model": MODEL, "prompt": ["one", "three"], "max_tokens": 4, "ignore_eos": True,
        "stream": True, "stream_options": opts})
    tok = served.engine.tokenizer
    for c in comp[:-1]:
        i = c["choices"][0]["index"]
        assert c["usage"]["prompt_tokens"] == len(tok.encode(["one", "three"][i]))
    assert comp[-1]["usage"]["completion_tokens"] == 8


def test_iteration_tokens_count_prompt_and_every_generated_token_as_vllm(served):
    """vLLM's iteration_tokens_total: per step, the generated tokens plus the prompt of each
    sequence that got its first token; a request adds prompt + max_tokens in all, its prompt
    whole even when the prefix cache held part of it (before: prompt + max_tokens - 1)."""
    prompt = "iteration tokens " * 6  # over one 16-token block: the repeat hits the cache
    n_prompt = len(served.engine.tokenizer.encode(prompt))
    for _ in range(2):
        served.wait_drained()
        before = served.metrics()["jpaged:iteration_tokens_total_sum"]
        r = _post(served.url, "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 7, "ignore_eos": True})
        assert r.status_code == 200, r.text
        served.wait_drained()
        after = served.metrics()["jpaged:iteration_tokens_total_sum"]
        assert after - before == n_prompt + 7
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_truncation_side_keeps_the_first_or_the_last_tokens(served):
    """vLLM's truncation_side with truncate_prompt_tokens: "right" keeps the prompt's first
    tokens, "left" (the default) its last; any other value is a 400 naming the field."""
    ids = served.engine.tokenizer.encode("one two three four five six seven eight")
    kw = {"model": MODEL, "prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 5,
          "return_token_ids": True}
    for side, want in (("right", ids[:5]), ("left", ids[-5:]), (None, ids[-5:])):
        r = _post(served.url, "/v1/completions", json={**kw, "truncation_side": side})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["prompt_token_ids"] == want, side
        assert r.json()["usage"]["prompt_tokens"] == 5
    chat = _post(served.url, "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "a b c d e f g h"}],
        "max_tokens": 1, "truncate_prompt_tokens": 3, "truncation_side": "right",
        "return_token_ids": True})
    assert chat.status_code == 200, chat.text
    full = _post(served.url, "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "a b c d e f g h"}],
        "max_tokens": 1, "return_token_ids": True}).json()["prompt_token_ids"]
    assert chat.json()["prompt_token_ids"] == full[:3]
    bad = _post(served.url, "/v1/completions", json={**kw, "truncation_side": "middle"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncation_side"


def test_max_logprobs_and_the_whole_vocabulary(served):
    """vLLM's --max-logprobs (EngineArgs.max_logprobs, default 20): a request over it is a 400
    naming its field; -1 (the whole vocabulary) needs max_logprobs -1, and then every token
    of the vocabulary comes back, as logprobs and as prompt_logprobs."""
    for body, param in (({"prompt": "x", "logprobs": -1}, "logprobs"),
                        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
                        ({"prompt": "x", "logprobs": -2}, "logprobs"),
                        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                          "top_logprobs": -1}, "top_logprobs")):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = _post(served.url, path, json={"model": MODEL, "max_tokens": 1, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]

    from helpers import tiny
    from serverkit import ENGINE_ARGS

    from jpaged.async_engine import AsyncLLMEngine
    from jpaged.config import EngineArgs
    from jpaged.engine import LLMEngine

    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**{**ENGINE_ARGS, "max_logprobs": -1}),
                                      loaded=tiny()))
    server = BackgroundServer(build_app(engine, MODEL))
    try:
        vocab = engine.engine.spec.vocab_size
        r = _post(server.url, "/v1/completions", json={
            "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "logprobs": -1,
            "prompt_logprobs": -1, "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert [len(t) for t in ch["logprobs"]["top_logprobs"]] == [vocab, vocab]
        assert [len(e) for e in ch["prompt_logprobs"][1:]] == [vocab, vocab]
        chat = _post(server.url, "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
            "logprobs": True, "top_logprobs": -1})
        assert chat.status_code == 200, chat.text
        assert len(chat.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == vocab
    finally:
        server.stop()
        engine.shutdown()


def test_request_log_as_vllms(served, caplog):
    """--enable-log-requests: a line per engine request (prompt, ids, parameters) cut at
    --max-log-len; --enable-log-outputs: a line per finished choice with its whole text, a
    stream's deltas gathered."""
    import logging

    with pytest.raises(ValueError, match="--enable-log-requests"):
        build_app(served.engine, MODEL, enable_log_outputs=True)
    server = BackgroundServer(build_app(served.engine, MODEL, enable_log_requests=True,
                                        enable_log_outputs=True, max_log_len=40))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                               timeout=120)
        with caplog.at_level(logging.INFO, logger="jpaged.server.requests"):
            stream = client.completions.create(model=MODEL, prompt="Once upon a time " * 5,
                                               max_tokens=5, n=2, stream=True,
                                               extra_body={"ignore_eos": True})
            texts = ["", ""]
            for chunk in stream:
                for c in chunk.choices:
                    texts[c.index] += c.text
    finally:
        server.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "jpaged.server.requests"]
    (received,) = [m for m in lines if m.startswith("Received request")]
    assert f"prompt: {('Once upon a time ' * 5)[:40]!r}" in received
    assert "max_tokens=5" in received and "prompt_token_ids: [" in received
    done = sorted(m for m in lines if m.startswith("Generated response"))
    assert len(done) == 2
    for i, m in enumerate(done):
        assert f"(choice {i}): output: {texts[i][:40]!r}" in m and "finish_reason: length" in m
