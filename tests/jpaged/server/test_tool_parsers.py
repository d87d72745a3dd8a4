"""vLLM's tool_choice "auto" (--enable-auto-tool-choice --tool-call-parser): each parser on
model text, a stream's deltas adding up to the whole answer's calls, and end to end through a
real server and the openai client (the tiny model made to write a call by a structured
output, as a tool-trained model would write it)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serverkit import MODEL, Served

from jpaged.server import BackgroundServer, build_app
from jpaged.server.tool_calls import ToolCallStream, tool_call_message
from jpaged.server.tool_parsers import auto_tool_parser, get_tool_parser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string"}}}}}
HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
          '"unit": "C"}}\n</tool_call>')
# (parser, model text, content, [(name, arguments)])
CASES = [
    ("hermes", HERMES, "Let me check.", [("get_weather", {"city": "Paris"}),
                                         ("get_weather", {"city": "Oslo", "unit": "C"})]),
    ("hermes", '<tool_call>{"name": "now", "arguments": {}}', None, [("now", {})]),  # unclosed
    ("hermes", "No tools needed: 4.", "No tools needed: 4.", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
     '{"name": "now", "parameters": {}}', None, [("get_weather", {"city": "Rome"}),
                                                 ("now", {})]),
    ("llama3_json", "The answer is 4.", "The answer is 4.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city"', '{"name": "get_weather", '
     '"parameters": {"city"', []),  # cut by max_tokens: content, as vLLM
    # Prose around the calls (Llama 3 writes some): the calls are found, the prose before
    # them is content; a JSON object that is no call (no parameters) stays text.
    ("llama3_json", 'Here: {"name": "now", "parameters": {}}; {"name": "t"} Want more?',
     "Here: ", [("now", {})]),
    ("llama3_json", '{"name": "toolWithoutParams"}', '{"name": "toolWithoutParams"}', []),
    ("llama3_json", 'Use {x}: {"name": "now", "arguments": {"tz": "UTC"}}', "Use {x}: ",
     [("now", {"tz": "UTC"})]),
    ("pythonic", '[get_weather(city="Paris", unit="C"), now()]', None,
     [("get_weather", {"city": "Paris", "unit": "C"}), ("now", {})]),
    ("pythonic", "[1, 2]", "[1, 2]", []),
    ("pythonic", "Sure, here it is.", "Sure, here it is.", []),
    # A call whose arguments cannot be JSON (bytes, an infinity) is dropped, its siblings
    # kept; one that does not parse ends the list, the calls before it kept.
    ("pythonic", "[bad(x=b'z'), calc(x=1e999), now(tz='UTC')]", None, [("now", {"tz": "UTC"})]),
    ("pythonic", "[now(tz='UTC'), f(a='x 'y', b='z')]", None, [("now", {"tz": "UTC"})]),
    ("pythonic", "[f(a='x 'y' 'z), g(b='p 'q' 'r)]", "[f(a='x 'y' 'z), g(b='p 'q' 'r)]", []),
    # hermes: string arguments are JSON as they are, or made a JSON string (never raw).
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
     [("f", {"a": 1})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "hello"}</tool_call>', None,
     [("f", "hello")]),
    # mistral: a JSON list after [TOOL_CALLS], or name[ARGS]{...} per call (v11).
    ("mistral", 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}},'
     ' {"name": "now", "arguments": {}}]', "Checking. ", [("get_weather", {"city": "Rome"}),
                                                          ("now", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]now[ARGS]{}', None,
     [("get_weather", {"city": "Rome"}), ("now", {})]),
    ("mistral", "[TOOL_CALLS][{bad", "[TOOL_CALLS][{bad", []),
    ("mistral", "Plain answer.", "Plain answer.", []),
]


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in tool_calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_a_whole_answer_and_its_stream_give_the_same_calls(parser, text, content, calls):
    p = get_tool_parser(parser)
    message, finish = tool_call_message(text, "stop", "auto", p)
    assert message["content"] == content
    assert _calls(message.get("tool_calls", [])) == calls
    assert finish == ("tool_calls" if calls else "stop")
    # Streamed in pieces of 3 characters: the content deltas join to the content, the calls
    # come whole with their indices, the finish is the same.
    got_content, got_calls, got_finish = _assembled(ToolCallStream("auto", p), text, 3)
    if text.endswith('"parameters": {"city"'):
        # Cut inside a call: whole, vLLM answers the text; streamed, the call was already
        # going out as it was written (vLLM's stream too), closed as valid JSON.
        assert _calls(got_calls) == [("get_weather", {})] and got_finish == "tool_calls"
        return
    assert got_content == (content or "")
    assert _calls(got_calls) == calls and got_finish == finish
    # parallel_tool_calls false: the first call only.
    one, _ = tool_call_message(text, "stop", "auto", p, parallel=False)
    assert _calls(one.get("tool_calls", [])) == calls[:1]


def _assembled(stream: ToolCallStream, text: str, step: int | list[int]):
    """Feed `text` in pieces (`step` characters, or these cut points), assembling the deltas
    as a client does: content joined, each call's id and name from its first delta, its
    arguments joined by index. (content, calls, finish_reason)."""
    cuts = list(range(step, len(text), step)) if isinstance(step, int) else sorted(step)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    content, calls, finish = "", [], None
    for i, piece in enumerate(pieces):
        delta, fin = stream.delta(0, piece, "stop" if i == len(pieces) - 1 else None)
        if delta is None:
            continue
        content += delta.get("content") or ""
        for c in delta.get("tool_calls", []):
            if c["index"] == len(calls):  # a new call: its header
                assert c["id"].startswith("chatcmpl-tool-") and c["function"]["name"]
                calls.append({"id": c["id"], "function": dict(c["function"])})
            else:
                assert c["index"] == len(calls) - 1 and "id" not in c
                calls[-1]["function"]["arguments"] += c["function"]["arguments"]
        finish = fin
    return content, calls, finish


def test_hermes_streams_content_then_each_call_as_it_is_written():
    """As vLLM's hermes parser streams: content up to the tag, then the call's id and name
    once the name is whole, then its arguments piece by piece (never a piece that later text
    changes), joining to the whole answer's arguments."""
    stream = ToolCallStream("auto", get_tool_parser("hermes"))
    # "<tool_" might start a call: held back, not sent as content.
    assert stream.delta(0, "Let me check.<tool_", None) == ({"content": "Let me check."}, None)
    assert stream.delta(0, 'call>\n{"name": "get_wea', None) == (None, None)
    delta, _ = stream.delta(0, 'ther", "arguments": {"ci', None)
    (head,) = delta["tool_calls"]
    assert head["function"] == {"name": "get_weather", "arguments": "{"}
    delta, _ = stream.delta(0, 'ty": "Par', None)
    assert "".join(c["function"]["arguments"] for c in delta["tool_calls"]).endswith('"Par')
    content, calls, finish = _assembled(ToolCallStream("auto", get_tool_parser("hermes")),
                                        HERMES, 1)
    whole, _ = tool_call_message(HERMES, "stop", "auto", get_tool_parser("hermes"))
    assert content == whole["content"] and finish == "tool_calls"
    assert [c["function"] for c in calls] == [c["function"] for c in whole["tool_calls"]]


@pytest.mark.parametrize("text,finish,args", [
    # Cut by max_tokens inside a string, inside a number, and a later block that is no JSON:
    # what was streamed is closed, so every call's arguments are JSON (found by vLLM's
    # tests: the stream ended with '{"city": "San').
    ('Checking. <tool_call>{"name": "w", "arguments": {"city": "San Francisco', "length",
     ['{"city": "San Francisco"}']),
    ('<tool_call>{"name": "w", "arguments": {"n": 12', "length", ["{}"]),
    ('<tool_call>{"name": "w", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g", '
     '"arguments": {oops}}</tool_call>', "stop", ['{"a": 1}', "{}"]),
    # A repeated key: the first value, streamed before the second was written, wins in the
    # whole answer too.
    ('<tool_call>{"name": "w", "arguments": {"a": 1, "a": 2}}</tool_call>', "stop",
     ['{"a": 1}']),
])
def test_hermes_streamed_calls_always_end_as_json(text, finish, args):
    _streamed_calls_end_as_json("hermes", text, finish, args)


@pytest.mark.parametrize("text,finish,args", [
    ('Let me check. {"name": "w", "parameters": {"city": "San Francisco', "length",
     ['{"city": "San Francisco"}']),
    ('{"name": "w", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": [1, 2',
     "length", ['{"a": 1}', '{"b": [1]}']),  # the cut number may have gone on: dropped
    ('{"name": "w", "parameters": {"a": 1, "a": 2}}', "stop", ['{"a": 1}']),
])
def test_llama3_json_calls_stream_as_written_and_end_as_json(text, finish, args):
    _streamed_calls_end_as_json("llama3_json", text, finish, args)


def _streamed_calls_end_as_json(parser, text, finish, args):
    for step in (1, 3, 7):
        stream = ToolCallStream("auto", get_tool_parser(parser))
        cuts = list(range(step, len(text), step))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        calls: list[dict] = []
        for i, piece in enumerate(pieces):
            delta, fin = stream.delta(0, piece, finish if i == len(pieces) - 1 else None)
            for c in (delta or {}).get("tool_calls", []):
                if c["index"] == len(calls):
                    calls.append({"arguments": c["function"]["arguments"]})
                else:
                    calls[c["index"]]["arguments"] += c["function"]["arguments"]
        assert [c["arguments"] for c in calls] == args, (step, calls)
        assert fin == "tool_calls"
    whole, _ = tool_call_message(text, finish, "auto", get_tool_parser(parser))
    if whole.get("tool_calls"):  # parsed whole: the same arguments (the cut call left out)
        got = [c["function"]["arguments"] for c in whole["tool_calls"]]
        assert got == args[:len(got)]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6)
    | st.floats(allow_nan=False, allow_infinity=False, width=32) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=8)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(args=st.dictionaries(st.text(max_size=5), _JSON, max_size=4),
       spacing=st.sampled_from([(", ", ": "), (",", ":"), (" , ", " :  ")]),
       ascii_only=st.booleans(), cuts=st.lists(st.integers(1, 400), max_size=12),
       parser=st.sampled_from(["hermes", "llama3_json"]))
def test_streamed_arguments_always_join_to_the_whole_ones(args, spacing, ascii_only, cuts,
                                                          parser):
    """However the model spaces its JSON and however the text is cut into deltas, what is
    streamed of a call's arguments is never changed by later text: the pieces join to the
    arguments of the whole answer (hermes' blocks and Llama 3's bare objects alike)."""
    if parser == "hermes":
        body = json.dumps({"name": "f", "arguments": args}, separators=spacing,
                          ensure_ascii=ascii_only)
        text = f"Sure.<tool_call>\n{body}\n</tool_call>"
    else:
        text = "<|python_tag|>" + json.dumps({"name": "f", "parameters": args},
                                              separators=spacing, ensure_ascii=ascii_only)
    whole, _ = tool_call_message(text, "stop", "auto", get_tool_parser(parser))
    _, calls, finish = _assembled(ToolCallStream("auto", get_tool_parser(parser)), text,
                                  sorted({c for c in cuts if c < len(text)}))
    assert finish == "tool_calls"
    assert [c["function"] for c in calls] == [c["function"] for c in whole["tool_calls"]]


def test_bad_flags_are_refused_by_name():
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        auto_tool_parser(True, None)
    with pytest.raises(ValueError, match="'granite' is not one of .*hermes, llama3_json"):
        auto_tool_parser(True, "granite")
    with pytest.raises(ValueError, match="'nope' is not one"):
        auto_tool_parser(False, "nope")
    assert auto_tool_parser(False, None) is None


def test_auto_tool_choice_through_the_server(served: Served):
    """The openai client against a server with the hermes parser: the model's call comes back
    as tool_calls (finish "tool_calls"), streamed or whole; plain text stays content; a
    server without the flags answers vLLM's 400; the call's result goes back to the model as
    a "tool" message after the assistant's tool_calls (their arguments rendered as objects)."""
    call = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
    # A tool-trained model writes this by itself; the tiny one is made to by a structured
    # output (a one-choice grammar), which tool_choice "auto" leaves to the request.
    forced = {"structured_outputs": {"choice": [call]}}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model=MODEL, messages=messages, tools=[WEATHER], temperature=0)  # (byte tokens)
    server = BackgroundServer(build_app(served.engine, MODEL, enable_auto_tool_choice=True,
                                        tool_call_parser="hermes"))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                               timeout=120)
        whole = client.chat.completions.create(**kw, extra_body=forced)  # tool_choice: auto
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (tc,) = choice.message.tool_calls
        assert (tc.type, tc.function.name) == ("function", "get_weather")
        assert json.loads(tc.function.arguments) == {"city": "Paris"}
        chunks = list(client.chat.completions.create(**kw, tool_choice="auto", stream=True,
                                                     extra_body=forced))
        streamed = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
        # The call as it is written: its id and name first, then its arguments in pieces.
        assert {t.index for t in streamed} == {0} and streamed[0].id
        assert [t.function.name for t in streamed if t.function.name] == ["get_weather"]
        args = "".join(t.function.arguments or "" for t in streamed)
        assert json.loads(args) == {"city": "Paris"} and len(streamed) > 1
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        plain = client.chat.completions.create(
            **kw, extra_body={"structured_outputs": {"choice": ["Sunny."]}})
        assert plain.choices[0].message.content == "Sunny."
        assert plain.choices[0].message.tool_calls in (None, [])
        assert plain.choices[0].finish_reason == "stop"
        # The next turn: the call and its result, as an agent loop sends them back.
        follow = messages + [
            {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
            {"role": "tool", "tool_call_id": tc.id, "content": "18 C, clear"}]
        template = ("{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}"
                    "{{ m.tool_calls[0].function.arguments.city }}{% endif %}"
                    "{{ m.tool_call_id or '' }}|{{ m.content }}\n{% endfor %}")
        r = httpx.post(f"{server.url}/tokenize", timeout=30, json={
            "messages": follow, "chat_template": template, "add_generation_prompt": False})
        assert r.status_code == 200, r.text
        text = served.engine.tokenizer.decode(r.json()["tokens"], skip_special_tokens=True)
        assert text == ("user:|Weather in Paris?\nassistant:Paris|\n"
                        f"tool:{tc.id}|18 C, clear\n")
    finally:
        server.stop()
    # Without the flags: vLLM's 400, naming them.
    r = httpx.post(f"{served.url}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": messages, "tools": [WEATHER]})
    assert r.status_code == 400
    assert "--enable-auto-tool-choice and --tool-call-parser" in r.json()["error"]["message"]
