"""Structured outputs through the server (tiny model, byte tokenizer): every spelling vLLM and
OpenAI use (response_format, structured_outputs, guided_*), on both endpoints; forced tool
calls whole and streamed; each malformed constraint a 400 naming its field, the engine serving
on."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from serverkit import MODEL

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
DIGITS = r"[0-9]{3}"
WEATHER = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                            "n": {"type": "integer", "minimum": 0,
                                                  "maximum": 9}},
           "required": ["unit", "n"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop"}}]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=120)


@pytest.mark.parametrize("path,field", [
    (COMP, {"structured_outputs": {"regex": DIGITS}}), (COMP, {"guided_regex": DIGITS}),
    (CHAT, {"structured_outputs": {"regex": DIGITS}}), (CHAT, {"guided_regex": DIGITS}),
    (COMP, {"guided_choice": ["123", "456"]}),
    (CHAT, {"structured_outputs": {"choice": ["123", "456"]}})])
def test_every_spelling_constrains_both_endpoints(served, path, field):
    body = ({"prompt": "x"} if path == COMP else {"messages": MSG}) | field
    r = _post(served.url, path, {**body, "max_tokens": 8, "temperature": 1.0, "n": 3,
                                 "seed": 1})
    assert r.status_code == 200, r.text
    for ch in r.json()["choices"]:
        text = ch["text"] if path == COMP else ch["message"]["content"]
        assert re.fullmatch(DIGITS, text), text
        assert ch["finish_reason"] == "stop"


def test_response_format_json_schema_and_json_object(served):
    client = served.client()
    r = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=60, temperature=0.5, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}})
    assert r.choices[0].finish_reason == "stop"
    got = json.loads(r.choices[0].message.content)
    assert got["unit"] in ("c", "f") and 0 <= got["n"] <= 9 and set(got) == {"unit", "n"}
    r = _post(served.url, COMP, {"prompt": "x", "max_tokens": 40, "temperature": 0.0,
                                 "response_format": {"type": "json_object"},
                                 "structured_outputs": None})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text.startswith("{")  # a JSON object as far as max_tokens let it go


def test_named_tool_call_whole_and_streamed(served):
    client = served.client()
    choice = {"type": "function", "function": {"name": "weather"}}
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=60, seed=5,
                                       temperature=0.5, tools=TOOLS, tool_choice=choice)
    msg = r.choices[0].message
    assert msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.function.name == "weather" and call.id.startswith("chatcmpl-tool-")
    whole = json.loads(call.function.arguments)
    assert set(whole) == {"unit", "n"}
    stream = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=60, seed=5,
                                            temperature=0.5, tools=TOOLS, tool_choice=choice,
                                            stream=True)
    args, names, ids = "", set(), set()
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            args += tc.function.arguments or ""
            names |= {tc.function.name} - {None}
            ids |= {tc.id} - {None}
    assert names == {"weather"} and len(ids) == 1
    assert json.loads(args) == whole  # the same seed: the same call, in pieces


def test_required_tool_calls_whole_and_streamed(served):
    client = served.client()
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=110, seed=2,
                                       temperature=0.5, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("weather", "noop")
    json.loads(calls[0].function.arguments)
    stream = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=110, seed=2,
                                            temperature=0.5, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False,
                                            stream=True)
    deltas = [c.choices[0] for c in stream if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0].finish_reason == "tool_calls"
    tc = deltas[0].delta.tool_calls[0]
    assert tc.function.name == calls[0].function.name
    assert tc.function.arguments == calls[0].function.arguments


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    (CHAT, {"response_format": {"type": "yaml"}}, "response_format"),
    (COMP, {"guided_regex": "(unclosed"}, "guided_regex"),
    (COMP, {"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    (COMP, {"structured_outputs": {"choice": []}}, "structured_outputs"),
    (COMP, {"guided_choice": []}, "guided_choice"),
    (COMP, {"structured_outputs": {"regex": "a", "frobnicate": 1}}, "structured_outputs"),
    (COMP, {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    (COMP, {"guided_json": {"type": "object"}, "guided_decoding_backend": "outlines"},
     "guided_decoding_backend"),
    (CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    (CHAT, {"tools": TOOLS}, "tool_choice"),  # 'auto' by default: needs a tool-call parser
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"tools": [{"type": "function", "function": {}}], "tool_choice": "required"},
     "tools"),
    (COMP, {"logit_bias": {"99999": 1}}, "logit_bias"),
    (COMP, {"logit_bias": {"5": 500}}, "logit_bias"),
])
def test_malformed_constraints_are_400s_naming_the_field(served, path, body, param):
    base = {"prompt": "x"} if path == COMP else {"messages": MSG}
    r = _post(served.url, path, {**base, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = _post(served.url, COMP, {"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200
    assert served.engine.get_metrics()["num_unfinished_requests"] == 0


def test_bad_words_on_the_server(served):
    """Only "a" and "b" allowed, "a" a bad word: every token is "b"; a bad list is a 400."""
    r = _post(served.url, COMP, {"prompt": "x", "max_tokens": 6, "temperature": 1.0, "n": 2,
                                 "allowed_token_ids": [ord("a"), ord("b")],
                                 "bad_words": ["a"], "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == ["bbbbbb", "bbbbbb"]
    bad = _post(served.url, COMP, {"prompt": "x", "bad_words": [""]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bad_words"
