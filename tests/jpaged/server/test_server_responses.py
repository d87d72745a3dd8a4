"""OpenAI's Responses API through the real openai client (tiny model, byte tokenizer): whole
and streamed answers with OpenAI's event sequence, previous_response_id conversations, function
calls and their outputs fed back, structured text, logprobs, background runs and cancel, the
store (retrieve, delete, input items), and each bad request a 400 naming its field."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from pydantic import BaseModel
from serverkit import MODEL, Served

from jpaged.server import BackgroundServer, build_app

WEATHER = {"type": "function", "name": "weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                     "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["unit", "n"], "additionalProperties": False}}


def _post(served: Served, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}/v1/responses", json={"model": MODEL, **body}, timeout=120)


def _prompt_tokens(served: Served, messages: list[dict]) -> int:
    """The tokens of `messages` rendered by the chat template, as /tokenize counts them."""
    r = httpx.post(f"{served.url}/tokenize", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_whole_and_streamed_answers_with_openais_events(served):
    client = served.client()
    kw = dict(model=MODEL, input="Hello there", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status == "incomplete"  # 8 tokens of a random model: max_output_tokens
    assert whole.incomplete_details.reason == "max_output_tokens"
    (item,) = whole.output
    assert (item.type, item.role, item.status) == ("message", "assistant", "completed")
    assert item.content[0].type == "output_text" and whole.output_text
    u = whole.usage
    assert u.input_tokens == _prompt_tokens(served, [{"role": "user", "content": "Hello there"}])
    assert (u.output_tokens, u.total_tokens) == (8, u.input_tokens + 8)
    assert u.input_tokens_details.cached_tokens >= 0
    assert u.output_tokens_details.reasoning_tokens == 0
    assert whole.max_output_tokens == 8 and whole.temperature == 0

    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == (["response.created", "response.in_progress",
                      "response.output_item.added", "response.content_part.added"]
                     + ["response.output_text.delta"] * deltas
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done", "response.completed"])
    assert deltas >= 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text  # temperature 0: the same answer
    assert final.status == "incomplete" and final.usage.output_tokens == 8
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    # A streamed response is stored as it finished.
    assert client.responses.retrieve(final.id).output_text == text


def test_previous_response_id_continues_the_conversation(served):
    client = served.client()
    first = client.responses.create(model=MODEL, input="Hi", instructions="Be brief",
                                    max_output_tokens=4, temperature=0)
    second = client.responses.create(model=MODEL, input="And then?", max_output_tokens=4,
                                     previous_response_id=first.id, temperature=0)
    # The instructions do not carry over; the first turn and its answer do.
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == _prompt_tokens(served, history)
    third = client.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Once more"}]}], instructions="Terse",
        previous_response_id=second.id, max_output_tokens=4, temperature=0)
    history += [{"role": "assistant", "content": second.output_text},
                {"role": "user", "content": "Once more"}]
    assert third.usage.input_tokens == _prompt_tokens(
        served, [{"role": "system", "content": "Terse"}] + history)
    # The stored turns: retrieve, input items (newest first by default), delete.
    items = client.responses.input_items.list(third.id)
    assert [(i.type, i.role) for i in items.data] == [("message", "user")]
    assert items.data[0].content[0].text == "Once more"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match=first.id):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    # store false: answered, never kept.
    gone = client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)


def test_input_items_pages(served):
    client = served.client()
    r = client.responses.create(model=MODEL, max_output_tokens=2, input=[
        {"role": "system", "content": "s"}, {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}])
    desc = client.responses.input_items.list(r.id)
    assert [i.content[0].text if isinstance(i.content, list) else i.content
            for i in desc.data] == ["c", "b", "a", "s"]
    asc = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.role for i in asc.data] == ["system", "user"] and asc.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=asc.last_id)
    assert [i.role for i in rest.data] == ["assistant", "user"] and not rest.has_more


def test_forced_function_call_whole_streamed_and_its_output_fed_back(served):
    client = served.client()
    kw = dict(model=MODEL, input="weather?", tools=[WEATHER], max_output_tokens=60,
              temperature=0.5, tool_choice={"type": "function", "name": "weather"},
              extra_body={"seed": 5})
    whole = client.responses.create(**kw)
    (call,) = whole.output
    assert (call.type, call.name, call.status) == ("function_call", "weather", "completed")
    args = json.loads(call.arguments)
    assert set(args) == {"unit", "n"} and call.call_id
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added"
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    streamed = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
    assert json.loads(streamed) == args  # the same seed: the same call, in pieces
    assert final.output[0].arguments == streamed
    # The agent loop's next turn: the call and its result as input items.
    follow = client.responses.create(model=MODEL, max_output_tokens=4, tools=[WEATHER],
                                     tool_choice="none", input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": call.call_id, "name": "weather",
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert follow.output[0].type == "message"
    # The same turn through previous_response_id: the stored call stands in for the items.
    chained = client.responses.create(
        model=MODEL, max_output_tokens=4, tools=[WEATHER], tool_choice="none",
        previous_response_id=whole.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert chained.usage.input_tokens == follow.usage.input_tokens


def test_structured_text_and_logprobs(served):
    client = served.client()

    class Pick(BaseModel):
        unit: str

    schema = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
              "required": ["unit"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="unit?", max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "pick",
                                                 "schema": schema, "strict": True}})
    assert Pick.model_validate_json(r.output_text).unit in ("c", "f")
    assert r.text.format.type == "json_schema"
    lp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=8,
                                 include=["message.output_text.logprobs"], top_logprobs=2,
                                 extra_body={"structured_outputs": {"choice": ["abcd"]}})
    lps = lp.output[0].content[0].logprobs
    assert lp.output_text == "abcd" and all(len(x.top_logprobs) == 2 for x in lps)
    assert [x.token for x in lps] == ["a", "b", "c", "d", "</s>"]  # the EOS scored too
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    assert plain.output[0].content[0].logprobs == []
    # Streamed: every token's logprob, those of tokens that bring no text of their own
    # (a character's first bytes, the EOS) included, as in the whole answer.
    kw = dict(model=MODEL, input="Hi", max_output_tokens=40, temperature=1.0,
              include=["message.output_text.logprobs"], extra_body={"seed": 7})
    whole = client.responses.create(**kw).output[0].content[0].logprobs
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = [x for e in events if e.type == "response.output_text.delta"
                for x in e.logprobs]
    assert len(streamed) == len(whole) == final.usage.output_tokens == 40
    assert [x.logprob for x in streamed] == [x.logprob for x in whole]
    assert len(final.output[0].content[0].logprobs) == 40


def test_background_runs_polls_and_cancels(served):
    client = served.client()
    bg = client.responses.create(model=MODEL, input="bg", background=True,
                                 max_output_tokens=6, temperature=0)
    assert bg.status in ("queued", "in_progress") and bg.background
    deadline = time.monotonic() + 120
    while (got := client.responses.retrieve(bg.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "background response never finished"
        time.sleep(0.05)
    assert got.status == "incomplete" and got.usage.output_tokens == 6
    same = client.responses.create(model=MODEL, input="bg", max_output_tokens=6,
                                   temperature=0)
    assert got.output_text == same.output_text
    # Cancel one that runs long: it stops, its tokens freed.
    long = client.responses.create(model=MODEL, input="long", background=True,
                                   max_output_tokens=100, extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    served.wait_drained()
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        client.responses.cancel(same.id)
    with pytest.raises(openai.BadRequestError, match="finished"):
        client.responses.cancel(bg.id)


def test_running_background_responses_outlive_the_store_and_need_one(served):
    """A background response still running is never evicted by newer answers (it stays
    readable and cancellable); a server that keeps no responses refuses background runs."""
    server = BackgroundServer(build_app(served.engine, MODEL, max_stored_responses=1))
    none = BackgroundServer(build_app(served.engine, MODEL, max_stored_responses=0))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                               timeout=120)
        long = client.responses.create(model=MODEL, input="long", background=True,
                                       max_output_tokens=100, extra_body={"ignore_eos": True})
        for _ in range(2):
            client.responses.create(model=MODEL, input="x", max_output_tokens=2)
        assert client.responses.retrieve(long.id).status in ("queued", "in_progress")
        assert client.responses.cancel(long.id).status == "cancelled"
        r = httpx.post(f"{none.url}/v1/responses", timeout=30, json={
            "model": MODEL, "input": "x", "background": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "background"
    finally:
        server.stop()
        none.stop()
    served.wait_drained()


def test_tools_without_a_parser_answer_text_as_vllms_responses(served):
    """tool_choice auto (the default) on a server without --tool-call-parser: vLLM's
    Responses API answers text (its chat endpoint, and jpaged's, refuse with a 400)."""
    r = served.client().responses.create(model=MODEL, input="weather?", tools=[WEATHER],
                                         max_output_tokens=3)
    assert [i.type for i in r.output] == ["message"] and r.usage.output_tokens == 3
    chat = httpx.post(f"{served.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "weather"}}]})
    assert chat.status_code == 400 and "--tool-call-parser" in chat.json()["error"]["message"]


def test_developer_messages_join_the_instructions(served):
    """vLLM folds developer messages into the instructions: one system message (chat
    templates know no developer role)."""
    client = served.client()
    r = client.responses.create(model=MODEL, max_output_tokens=2, instructions="Be kind.",
                                input=[{"role": "developer", "content": "Be concise."},
                                       {"role": "user", "content": "Hi"}])
    assert r.usage.input_tokens == _prompt_tokens(served, [
        {"role": "system", "content": "Be kind.\n\nBe concise."},
        {"role": "user", "content": "Hi"}])
    # Like the instructions they joined, they do not carry over to the next turn (no
    # developer turn reaches the template there).
    nxt = client.responses.create(model=MODEL, max_output_tokens=2, input="More",
                                  previous_response_id=r.id)
    assert nxt.usage.input_tokens == _prompt_tokens(served, [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": r.output_text},
        {"role": "user", "content": "More"}])


def test_a_background_stream_is_read_again_from_where_a_client_left(served):
    """background + stream: the events as they come; GET ?stream=true&starting_after=N gives
    the same events after N (a client that lost its connection resumes), and a response that
    was not a background stream has none to give."""
    client = served.client()
    kw = dict(model=MODEL, input="resume me", max_output_tokens=6, temperature=0,
              background=True)
    first = [e for e in client.responses.create(**kw, stream=True)]
    kinds = [e.type for e in first]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    rid = first[0].response.id
    assert [e.sequence_number for e in first] == list(range(len(first)))
    again = list(client.responses.retrieve(rid, stream=True, starting_after=3))
    assert [e.sequence_number for e in again] == list(range(4, len(first)))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in first[4:]]
    whole = client.responses.retrieve(rid)
    assert whole.status == "incomplete" and whole.output_text == first[-1].response.output_text
    plain = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="no events"):
        list(client.responses.retrieve(plain.id, stream=True))
    # Cancelled while it streams: its readers end, the engine lets it go.
    long = client.responses.create(model=MODEL, input="long", background=True, stream=True,
                                   max_output_tokens=100, extra_body={"ignore_eos": True})
    head = next(iter(long))
    assert client.responses.cancel(head.response.id).status == "cancelled"
    rest = [e.type for e in long]
    assert "response.completed" not in rest
    served.wait_drained()


def test_auto_function_calls_with_the_servers_parser(served):
    """tool_choice auto (the default) with --tool-call-parser hermes: the model's own call
    comes back as a function_call item, whole and streamed."""
    call = '<tool_call>{"name":"weather","arguments":{"unit":"c","n":3}}</tool_call>'
    forced = {"structured_outputs": {"choice": [call]}}
    server = BackgroundServer(build_app(served.engine, MODEL, enable_auto_tool_choice=True,
                                        tool_call_parser="hermes"))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                               timeout=120)
        kw = dict(model=MODEL, input="weather?", tools=[WEATHER], extra_body=forced)
        (item,) = client.responses.create(**kw).output
        assert (item.type, item.name, json.loads(item.arguments)) == (
            "function_call", "weather", {"unit": "c", "n": 3})
        with client.responses.stream(**kw) as stream:
            final = stream.get_final_response()
        assert [(i.type, i.name) for i in final.output] == [("function_call", "weather")]
        # Text and a call: replaying the output items as input renders the turn as
        # previous_response_id does (one assistant turn with its text and its call).
        both = client.responses.create(model=MODEL, input="weather?", tools=[WEATHER],
                                       extra_body={"structured_outputs": {
                                           "choice": ["Let me check." + call]}})
        assert [i.type for i in both.output] == ["message", "function_call"]
        result = {"type": "function_call_output", "call_id": both.output[1].call_id,
                  "output": "18 C"}
        chained = client.responses.create(model=MODEL, input=[result], tools=[WEATHER],
                                          previous_response_id=both.id, tool_choice="none",
                                          max_output_tokens=2)
        replayed = client.responses.create(
            model=MODEL, tools=[WEATHER], tool_choice="none", max_output_tokens=2,
            input=[{"role": "user", "content": "weather?"},
                   *[i.model_dump(exclude_none=True) for i in both.output], result])
        assert chained.usage.input_tokens == replayed.usage.input_tokens
    finally:
        server.stop()


@pytest.mark.parametrize("body,param,words", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "function tools only"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input", "input_image"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input", "not valid JSON"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
    ({"input": []}, "input", "at least one"),
    ({"input": "x", "background": True, "store": False}, "background", "store"),
    ({"input": "x", "max_output_tokens": 10_000}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x", "frobnicate": 1}, "frobnicate", "unknown field"),
    ({"input": "x", "prompt": {"id": "p"}}, "prompt", "prompt templates"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text",
     "schema"),
    ({"input": "x", "model": "other"}, "model", "does not exist"),
])
def test_bad_requests_name_their_field_and_the_server_serves_on(served, body, param, words):
    r = _post(served, body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    ok = _post(served, {"input": "still there?", "max_output_tokens": 2})
    assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete")


def test_truncation_auto_keeps_the_conversations_end(served):
    long = "word " * 400  # far past the tiny model's 128 tokens
    assert _post(served, {"input": long, "max_output_tokens": 4}).status_code == 400
    r = _post(served, {"input": long, "max_output_tokens": 4, "truncation": "auto"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == 128 - 4


def test_the_store_keeps_the_newest_and_none_when_told():
    from jpaged.server.protocol import OpenAIError
    from jpaged.server.responses import ResponseStore, StoredResponse

    store = ResponseStore(2)
    for rid in ("a", "b", "c"):
        store.put(rid, StoredResponse({"id": rid}, [], []))
    assert "a" not in store and store.get("c").body == {"id": "c"}
    store.get("b")
    with pytest.raises(OpenAIError, match="'a' not found"):
        store.get("a")
    none = ResponseStore(0)
    none.put("a", StoredResponse({"id": "a"}, [], []))
    with pytest.raises(OpenAIError, match="--max-stored-responses 0"):
        none.get("a")
    with pytest.raises(ValueError, match="max_stored_responses"):
        ResponseStore(-1)
