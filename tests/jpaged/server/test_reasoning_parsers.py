"""vLLM's reasoning parsers (--reasoning-parser): a reasoning model's thought split from its
answer, whole and streamed (every cut of the text joins to the same split), and on chat and the
Responses API through the real openai client: the tiny model answers after a chat template
that opens the thought, as R1's does, and its random bytes never close it (a grammar, which
could write the end tag, constrains the whole output, so the parser stays out of it)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serverkit import MODEL, Served

from jpaged.server import BackgroundServer, build_app
from jpaged.server.reasoning_parsers import ReasoningStream, get_reasoning_parser

R1 = get_reasoning_parser("deepseek_r1")
QWEN3 = get_reasoning_parser("qwen3")


@pytest.mark.parametrize("text,thinking,parser,want", [
    ("<think>Let me see.</think>It is 4.", True, R1, ("Let me see.", "It is 4.")),
    ("Let me see.</think>It is 4.", True, R1, ("Let me see.", "It is 4.")),  # opened in prompt
    ("Let me see, 2 + 2", True, R1, ("Let me see, 2 + 2", None)),  # cut while thinking
    ("</think>Just the answer", True, R1, (None, "Just the answer")),
    ("<think>Only thought</think>", True, R1, ("Only thought", None)),
    ("\n<think>Thought</think>\nRest", True, R1, ("\nThought", "\nRest")),  # vLLM's stream
    ("Plain answer", False, QWEN3, (None, "Plain answer")),  # enable_thinking false
    ("Plain answer", True, QWEN3, ("Plain answer", None)),
    ("<think>a</think>\n\nb", False, QWEN3, (None, "<think>a</think>\n\nb")),
])
def test_whole_answers_split_as_vllms(text, thinking, parser, want):
    assert parser.split(text, thinking) == want


@settings(max_examples=300, deadline=None, derandomize=True)
@given(before=st.text(alphabet="a<>/thk \n", max_size=6),
       thought=st.text(alphabet="ab<>/thinkT \n", max_size=20),
       answer=st.text(alphabet="ab<>/thinkT \n", max_size=20),
       opened=st.booleans(), thinking=st.booleans(),
       cuts=st.lists(st.integers(1, 60), max_size=8))
def test_streamed_pieces_join_to_the_whole_split(before, thought, answer, opened, thinking,
                                                 cuts):
    """However the text is cut, the streamed reasoning and content join to the whole
    answer's split (a tag cut in two is held back, never sent as text; text before the start
    tag stays thought: it may have been streamed before the tag came, as vLLM streams
    "\n<think>...")."""
    text = (before + "<think>" if opened else "") + thought + "</think>" + answer
    for parser in (R1, QWEN3):
        stream = ReasoningStream(parser, thinking)
        points = sorted({c for c in cuts if c < len(text)})
        pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
        got = ["", ""]
        for i, piece in enumerate(pieces):
            r, c = stream.delta(piece, i == len(pieces) - 1)
            got[0] += r
            got[1] += c
        want = parser.split(text, thinking)
        assert (got[0] or None, got[1] or None) == want


# A template that opens the thought in the prompt, as DeepSeek R1's and Qwen3's do.
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "assistant: <think>")


def _thinking_server(served: Served, **kw) -> BackgroundServer:
    return BackgroundServer(build_app(served.engine, MODEL, reasoning_parser="deepseek_r1",
                                      chat_template=TEMPLATE, **kw))


def test_chat_answers_reasoning_apart_whole_and_streamed(served):
    answer = "2 plus 2.</think>It is 4."
    forced = {"structured_outputs": {"choice": [answer]}}
    server = _thinking_server(served)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                               timeout=120)
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "2+2?"}])
        # A grammar constrains the whole output, so it cannot think first: the parser stays
        # out of it (the text is the content) ...
        whole = client.chat.completions.create(**kw, extra_body=forced).choices[0].message
        assert whole.content == answer
        # ... while a free answer is split. The tiny model's bytes have no "</think>": all
        # of it is thought cut short, as deepseek_r1 reads an answer without the end tag.
        free = client.chat.completions.create(**kw, max_tokens=6, temperature=0)
        msg = free.choices[0].message.model_dump()
        assert msg["content"] is None and msg["reasoning"] == msg["reasoning_content"]
        assert msg["reasoning"]
        chunks = list(client.chat.completions.create(**kw, max_tokens=6, temperature=0,
                                                     stream=True))
        thought = "".join(c.choices[0].delta.model_dump().get("reasoning") or ""
                          for c in chunks if c.choices)
        assert thought == msg["reasoning"]
        assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)
        # vLLM's include_reasoning false: the thought is left out, whole and streamed.
        hidden = client.chat.completions.create(**kw, max_tokens=6, temperature=0,
                                                extra_body={"include_reasoning": False})
        assert hidden.choices[0].message.model_dump().get("reasoning") is None
        quiet = list(client.chat.completions.create(**kw, max_tokens=6, temperature=0,
                                                    stream=True,
                                                    extra_body={"include_reasoning": False}))
        assert not any(c.choices and c.choices[0].delta.model_dump().get("reasoning")
                       for c in quiet)
        # An earlier answer's reasoning reaches the template as reasoning_content.
        r = httpx.post(f"{server.url}/tokenize", timeout=30, json={
            "messages": [{"role": "assistant", "content": "x", "reasoning_content": "why"}],
            "chat_template": "{{ messages[0].reasoning_content }}",
            "add_generation_prompt": False})
        assert served.engine.tokenizer.decode(r.json()["tokens"],
                                              skip_special_tokens=True) == "why"
    finally:
        server.stop()
    with pytest.raises(ValueError, match="--reasoning-parser 'nope'"):
        build_app(served.engine, MODEL, reasoning_parser="nope")


def test_responses_api_gives_a_reasoning_item(served):
    server = _thinking_server(served)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                               timeout=120)
        kw = dict(model=MODEL, input="2+2?", max_output_tokens=6, temperature=0)
        whole = client.responses.create(**kw)
        (item,) = whole.output  # all thought (cut short): no empty message beside it
        assert item.type == "reasoning" and item.content[0].text
        assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= 6
        with client.responses.stream(**kw) as stream:
            events = list(stream)
            final = stream.get_final_response()
        kinds = [e.type for e in events]
        assert kinds[2] == "response.output_item.added" and events[2].item.type == "reasoning"
        assert "response.reasoning_text.done" in kinds
        streamed = "".join(json.loads(e.model_dump_json()).get("delta", "")
                           for e in events if e.type == "response.reasoning_text.delta")
        assert streamed == item.content[0].text == final.output[0].content[0].text
    finally:
        server.stop()
