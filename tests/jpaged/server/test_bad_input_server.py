"""Bad input through the HTTP server: a 4xx with an OpenAI-shaped error body naming the param,
and the same server then answers a good request correctly (tests/bad_input_cases.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from bad_input_cases import GOOD_MAX_TOKENS, GOOD_PROMPT, REQUEST_CASES, RequestCase
from serverkit import MODEL, Served

GOOD = {"model": MODEL, "prompt": GOOD_PROMPT, "max_tokens": GOOD_MAX_TOKENS,
        "temperature": 0, "ignore_eos": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": GOOD_PROMPT}], "max_tokens": 4}
DROP = object()  # a field left out of the body


def _post(served: Served, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", timeout=60, **kw)


@pytest.fixture(scope="module")
def reference(served: Served) -> str:
    """Greedy text of the good request, before any bad one."""
    r = _post(served, "/v1/completions", json=GOOD)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _check_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    if param is not None:
        assert param in err["message"], err


def _still_serves(served: Served, reference: str) -> None:
    m = served.wait_drained(timeout=30)  # nothing half-queued, no KV block held
    assert m["num_unfinished_requests"] == 0 and m["kv_cache_usage"] == 0.0
    r = _post(served, "/v1/completions", json=GOOD)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference


@pytest.mark.parametrize("case", REQUEST_CASES, ids=lambda c: c.name)
def test_bad_request_on_the_server(served: Served, reference: str, case: RequestCase) -> None:
    _check_error(_post(served, "/v1/completions", json={**GOOD, **case.http}), 400, case.field)
    if case.is_sampling:  # the same value on the chat endpoint, streaming or not
        for stream in (False, True):
            body = {**CHAT, "stream": stream, **case.http}
            _check_error(_post(served, "/v1/chat/completions", json=body), 400, case.field)
    _still_serves(served, reference)


# Bodies that are not JSON, not an object, or hold a value of the wrong type: 400 (as vLLM),
# naming the field where there is one (OpenAI clients read `param`).
MALFORMED = [
    ("not_json", "/v1/completions", b"{not json", None),
    ("truncated_json", "/v1/completions", b'{"model": "tiny-test", "prompt": "x"', None),
    ("empty_body", "/v1/completions", b"", None),
    ("json_array", "/v1/completions", b'["prompt", "x"]', None),
    ("json_null", "/v1/completions", b"null", None),
    ("bytes_not_utf8", "/v1/completions", b'{"prompt": "\xff\xfe"}', None),
]
WRONG_TYPES = [
    ("prompt_number", "/v1/completions", {"prompt": 5}, "prompt"),
    ("prompt_mixed_list", "/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("prompt_missing", "/v1/completions", {"prompt": DROP}, "prompt"),
    ("max_tokens_string", "/v1/completions", {"max_tokens": "many"}, "max_tokens"),
    ("max_tokens_float", "/v1/completions", {"max_tokens": 2.5}, "max_tokens"),
    ("temperature_string", "/v1/completions", {"temperature": "hot"}, "temperature"),
    ("top_k_float", "/v1/completions", {"top_k": 1.5}, "top_k"),
    ("n_list", "/v1/completions", {"n": [2]}, "n"),
    ("stop_number", "/v1/completions", {"stop": 7}, "stop"),
    ("stream_string", "/v1/completions", {"stream": "maybe"}, "stream"),
    ("messages_string", "/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("message_content_number", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("message_without_role", "/v1/chat/completions", {"messages": [{"content": "x"}]},
     "messages"),
]


@pytest.mark.parametrize("name,path,raw,param", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_json(served: Served, reference: str, name: str, path: str, raw: bytes,
                        param: str | None) -> None:
    r = _post(served, path, content=raw, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    _check_error(r, r.status_code, param)
    _still_serves(served, reference)


@pytest.mark.parametrize("name,path,fields,param", WRONG_TYPES, ids=[w[0] for w in WRONG_TYPES])
def test_wrong_types(served: Served, reference: str, name: str, path: str, fields: dict,
                     param: str) -> None:
    body = {**(GOOD if path == "/v1/completions" else CHAT), **fields}
    body = {k: v for k, v in body.items() if v is not DROP}
    _check_error(_post(served, path, json=body), 400, param)
    _still_serves(served, reference)


def test_nan_and_extreme_values(served: Served, reference: str) -> None:
    # JSON's NaN extension parses; SamplingParams rejects it by name.
    raw = b'{"model": "tiny-test", "prompt": "x", "temperature": NaN}'
    r = _post(served, "/v1/completions", content=raw, headers={"content-type": "application/json"})
    _check_error(r, 400, "temperature")

    # Valid but extreme values, next to a good request: neither fails the engine step.
    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            wild = {**GOOD, "top_k": 10**12, "seed": 2**63 - 1, "priority": -(2**70)}
            return await asyncio.gather(client.post("/v1/completions", json=wild),
                                        client.post("/v1/completions", json=GOOD))
    for r in asyncio.run(both()):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference
    _still_serves(served, reference)


def test_max_tokens_past_the_context_and_a_huge_prompt_are_refused(served: Served,
                                                                    reference: str) -> None:
    """As vLLM's server: max_tokens beyond what max_model_len leaves after the prompt is a 400
    (not cut short in silence); a prompt of megabytes is refused by its size alone, before
    it is tokenized."""
    limit = served.engine.max_model_len
    for path, body in (("/v1/completions", {**GOOD, "max_tokens": 1000}),
                       ("/v1/chat/completions", {**CHAT, "max_tokens": 1000})):
        r = _post(served, path, json=body)
        _check_error(r, 400, "max_tokens")
        assert f"maximum context length is {limit} tokens" in r.json()["error"]["message"]
    n = len(served.engine.tokenizer.encode(GOOD_PROMPT))
    r = _post(served, "/v1/completions", json={**GOOD, "max_tokens": limit - n})  # fits
    assert r.status_code == 200, r.text
    r = _post(served, "/v1/completions", json={**GOOD, "prompt": "word " * 2_000_000})
    _check_error(r, 400, "prompt")
    assert "bytes is longer" in r.json()["error"]["message"]
    _still_serves(served, reference)


def test_chat_errors_name_the_chat_spelling_of_a_field(served: Served, reference: str) -> None:
    """Chat spells logprobs' count `top_logprobs` and may spell max_tokens
    `max_completion_tokens`: their errors name those, as does a forced tool call's bad
    schema (`tools`), and a duplicate of a running request's id (`request_id`) is checked
    in the engine yet named as the request spells it."""
    cases = [({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
             ({"max_completion_tokens": -5}, "max_completion_tokens"),
             ({"max_completion_tokens": 1000}, "max_completion_tokens"),
             ({"tools": [{"type": "function", "function": {
                 "name": "f", "parameters": {"type": "object", "properties": {
                     "a": {"type": "string", "pattern": "([a-"}}}}}],
               "tool_choice": "required"}, "tools")]
    for extra, param in cases:
        _check_error(_post(served, "/v1/chat/completions", json={**CHAT, **extra}), 400, param)
    _still_serves(served, reference)
