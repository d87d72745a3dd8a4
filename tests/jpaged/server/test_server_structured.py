"""Structured outputs through the server (tiny model, byte tokenizer): every spelling vLLM and
OpenAI use (response_format, structured_outputs, guided_*), on both endpoints; forced tool
calls whole and streamed, answered as vLLM answers them (`$defs` / `$ref` parameters, calls cut
by max_tokens); objects closed as vLLM's default backend closes them; each malformed
constraint a 400 naming its field, the engine serving on."""

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


def test_structural_tags_through_both_spellings(served):
    """vLLM's structural tag (response_format type "structural_tag", or structured_outputs'
    field): free text, but every trigger starts a structure whose JSON follows its schema.
    The tiny model is pushed to write the trigger ("<", by logit_bias), so its answer is
    structure after structure."""
    tag = {"structures": [{"begin": "<n>", "end": "</n>", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}],
        "triggers": ["<"]}
    lt = served.engine.tokenizer.encode("<", add_special_tokens=False)
    kw = {"max_tokens": 48, "temperature": 1.0, "seed": 4, "logit_bias": {str(lt[0]): 30}}
    for body in ({"response_format": {"type": "structural_tag", **tag}},
                 {"structured_outputs": {"structural_tag": json.dumps(tag)}},
                 {"structured_outputs": {"structural_tag": tag}}):
        r = _post(served.url, CHAT, {"messages": MSG, **kw, **body})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        whole = re.findall(r"<n>(.*?)</n>", text, re.S)
        assert len(whole) >= 2, text  # structures were written, each JSON of the schema
        assert all(isinstance(json.loads(j)["n"], int) for j in whole), text
        # Outside them, no trigger but the start of the last one, which max_tokens cut.
        rest = re.sub(r"<n>(.*?)</n>", "", text, flags=re.S)
        tail = rest[rest.index("<"):] if "<" in rest else ""
        assert rest.count("<") <= 1 and (tail.startswith("<n>") or "<n>".startswith(tail))
    bad = _post(served.url, CHAT, {"messages": MSG, "response_format": {
        "type": "structural_tag", "structures": tag["structures"], "triggers": ["["]}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    assert "starts with none of the triggers" in bad.json()["error"]["message"]


def test_named_tool_call_whole_and_streamed(served):
    client = served.client()
    choice = {"type": "function", "function": {"name": "weather"}}
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=60, seed=5,
                                       temperature=0.5, tools=TOOLS, tool_choice=choice)
    msg = r.choices[0].message
    assert msg.content == "" and len(msg.tool_calls) == 1  # vLLM: "" beside tool_calls
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
    # GBNF its converter refuses with a bare Exception (a 500 before): a rule used but never
    # defined, no root rule.
    (COMP, {"guided_grammar": "root ::= item"}, "guided_grammar"),
    (CHAT, {"structured_outputs": {"grammar": 'start ::= "a"'}}, "structured_outputs"),
    (COMP, {"structured_outputs": {"regex": "a", "frobnicate": 1}}, "structured_outputs"),
    (COMP, {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    (COMP, {"guided_json": {"type": "object"}, "guided_decoding_backend": "outlines"},
     "guided_decoding_backend"),
    (CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    (CHAT, {"tools": TOOLS}, "tool_choice"),  # 'auto' by default: needs a tool-call parser
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"tools": [], "tool_choice": "none"}, "tools"),  # vLLM: not an empty array
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


# A tool whose parameters reach a sub-schema through `$ref` (as pydantic writes them), and a
# second tool defining another schema under the same `$defs` name: each call must follow its
# own tool's definitions.
OPTIONS = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                            "forecast": {"type": "boolean"}},
           "required": ["unit", "forecast"], "additionalProperties": False}
REF_TOOLS = [
    {"type": "function", "function": {"name": "weather_opts", "parameters": {
        "type": "object", "properties": {"options": {"$ref": "#/$defs/Options"}},
        "required": ["options"], "additionalProperties": False,
        "$defs": {"Options": OPTIONS}}}},
    {"type": "function", "function": {"name": "days", "parameters": {
        "type": "object", "properties": {"n": {"$ref": "#/$defs/Options"}},
        "required": ["n"], "additionalProperties": False,
        "$defs": {"Options": {"type": "integer", "minimum": 1, "maximum": 7}}}}}]


def _check_ref_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "weather_opts":
        assert set(args) == {"options"} and args["options"]["unit"] in ("c", "f")
        assert isinstance(args["options"]["forecast"], bool)
    else:
        assert name == "days" and set(args) == {"n"} and 1 <= args["n"] <= 7


def test_required_tools_with_defs_and_refs(served):
    """tool_choice "required" with parameters that use `$defs` / `$ref` (vLLM's own test's
    shape): the calls come back, each following its own tool's definitions, whole and
    streamed; a named call too. (Seeds whose single call fits max_tokens: the tiny model
    writes much whitespace.)"""
    client = served.client()
    kw = dict(model=MODEL, messages=MSG, max_tokens=110, temperature=0.5, tools=REF_TOOLS,
              parallel_tool_calls=False)
    names = set()
    for seed in (3, 5, 6):
        r = client.chat.completions.create(seed=seed, tool_choice="required", **kw)
        assert r.choices[0].finish_reason == "tool_calls"
        [call] = r.choices[0].message.tool_calls
        _check_ref_call(call.function.name, call.function.arguments)
        names.add(call.function.name)
    assert names == {"weather_opts", "days"}  # each tool's own `Options`
    stream = client.chat.completions.create(seed=6, tool_choice="required", stream=True, **kw)
    [tc] = [tc for c in stream if c.choices for tc in c.choices[0].delta.tool_calls or []]
    _check_ref_call(tc.function.name, tc.function.arguments)
    named = client.chat.completions.create(
        seed=3, tool_choice={"type": "function", "function": {"name": "days"}}, **kw)
    _check_ref_call("days", named.choices[0].message.tool_calls[0].function.arguments)


def test_a_function_without_parameters_is_called_with_an_empty_object(served):
    """As vLLM: a tool whose parameters are absent, null or {} takes no arguments, so a
    forced call's arguments are an empty object (the schema {} would allow any JSON)."""
    client = served.client()
    for params in ({}, None):
        tools = [{"type": "function", "function": {"name": "now", "parameters": params}}]
        for choice in ("required", {"type": "function", "function": {"name": "now"}}):
            r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=60,
                                               temperature=1.0, seed=1, tools=tools,
                                               tool_choice=choice)
            [call] = r.choices[0].message.tool_calls
            assert call.function.name == "now"
            assert json.loads(call.function.arguments) == {}, (params, choice)


def test_required_tool_call_cut_by_max_tokens_is_an_empty_message(served):
    """As vLLM: a 'required' answer that max_tokens cut is no tool call and no content
    (finish "length"), never the half-written JSON as content; whole and streamed."""
    client = served.client()
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3, seed=2,
                                       temperature=0.5, tools=TOOLS, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content == "" and choice.message.tool_calls == []
    assert r.usage.completion_tokens == 3
    stream = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3, seed=2,
                                            temperature=0.5, tools=TOOLS,
                                            tool_choice="required", stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == ""
    assert not any(c.delta.tool_calls for c in chunks)
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]


def test_named_tool_call_is_tool_calls_even_when_cut(served):
    """As vLLM: a named function's call is always `tool_calls` with `content: ""`, its
    arguments as generated (cut short by max_completion_tokens: finish "length"); finished,
    content is "" too. Whole and streamed alike."""
    client = served.client()
    choice = {"type": "function", "function": {"name": "weather"}}
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_completion_tokens=4,
                                       seed=5, temperature=0.5, tools=TOOLS,
                                       tool_choice=choice)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.content == ""
    assert len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.function.name == "weather" and call.id.startswith("chatcmpl-tool-")
    cut = call.function.arguments
    assert cut.startswith("{") and r.usage.completion_tokens == 4
    with pytest.raises(ValueError):
        json.loads(cut)  # cut short: not yet a whole object
    stream = client.chat.completions.create(model=MODEL, messages=MSG, max_completion_tokens=4,
                                            seed=5, temperature=0.5, tools=TOOLS,
                                            tool_choice=choice, stream=True)
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    assert "".join(ch.delta.content or "" for ch in chunks) == ""
    args = "".join(tc.function.arguments or "" for ch in chunks
                   for tc in ch.delta.tool_calls or [])
    assert args == cut
    assert [ch.finish_reason for ch in chunks if ch.finish_reason] == ["length"]
    whole = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=60, seed=5,
                                           temperature=0.5, tools=TOOLS, tool_choice=choice)
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].message.content == ""
    json.loads(whole.choices[0].message.tool_calls[0].function.arguments)


def test_json_schema_objects_are_closed_by_default(served):
    """vLLM's default backend (xgrammar, strict) writes no property an object schema does not
    list unless it says `additionalProperties`: the same here, on both endpoints."""
    schema = {"type": "object", "properties": {"result": {"type": "integer", "minimum": 0,
                                                          "maximum": 9}},
              "required": ["result"]}
    r = _post(served.url, CHAT, {"messages": MSG, "max_tokens": 40, "temperature": 1.0, "n": 4,
                                 "seed": 7, "response_format": {"type": "json_schema",
                                                                "json_schema": {
                                                                    "name": "r",
                                                                    "schema": schema}}})
    assert r.status_code == 200, r.text
    r2 = _post(served.url, COMP, {"prompt": "x", "max_tokens": 40, "temperature": 1.0, "n": 4,
                                  "seed": 7, "guided_json": schema})
    assert r2.status_code == 200, r2.text
    texts = ([c["message"]["content"] for c in r.json()["choices"]]
             + [c["text"] for c in r2.json()["choices"]])
    for text in texts:
        assert set(json.loads(text)) <= {"result"}, text
