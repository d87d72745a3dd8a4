"""vLLM's `use_beam_search` on the OpenAI server: n beams, best first, the same sequences as
`LLM.beam_search` on the same model; what beam search would not apply is a 400 naming it."""

from __future__ import annotations

import httpx
import pytest
from helpers import make_llm, tiny
from serverkit import ENGINE_ARGS, MODEL

from jpaged import BeamSearchParams


@pytest.fixture(scope="module")
def offline():
    return make_llm(tiny(), **ENGINE_ARGS)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=120)


def test_completion_beams_equal_the_offline_beam_search(served, offline):
    prompts = ["The paged KV cache", "abc"]
    out = served.client().completions.create(
        model=MODEL, prompt=prompts, n=3, max_tokens=5,
        extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True})
    want = offline.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=5,
                                                         ignore_eos=True))
    tok = offline.get_tokenizer()
    assert [c.index for c in out.choices] == list(range(6))
    for c in out.choices:
        seq = want[c.index // 3].sequences[c.index % 3]
        extra = c.model_extra
        assert extra["token_ids"] == seq.output_token_ids
        assert extra["prompt_token_ids"] == seq.tokens[:seq.num_prompt_tokens]
        assert c.text == tok.decode(seq.output_token_ids) and c.finish_reason == "length"
    prompt_tokens = sum(len(tok.encode(p)) for p in prompts)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 30)


def test_chat_beams_and_length_penalty(served, offline):
    msgs = [{"role": "user", "content": "hello"}]
    out = served.client().chat.completions.create(
        model=MODEL, messages=msgs, n=2, max_tokens=4,
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.finish_reason == "length"
               for c in out.choices)
    assert out.choices[0].message.content != out.choices[1].message.content
    assert out.usage.completion_tokens == 8


def test_streamed_beams_are_the_beams(served):
    """As vLLM, a streamed beam search sends each beam whole once the search ends: the same
    choices as the unstreamed answer, then the usage chunk."""
    client = served.client()
    kw = dict(model=MODEL, max_tokens=4, n=2,
              extra_body={"use_beam_search": True, "ignore_eos": True})
    whole = client.completions.create(prompt=["abc", "The paged"], **kw)
    chunks = list(client.completions.create(
        prompt=["abc", "The paged"], stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw))
    assert [(c.index, c.text, c.finish_reason) for ch in chunks[:-1] for c in ch.choices] == [
        (c.index, c.text, c.finish_reason) for c in whole.choices]
    assert all(ch.usage.completion_tokens == 4 for ch in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    msgs = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(messages=msgs, **kw)
    text: dict[int, str] = {}
    finish: dict[int, str] = {}
    stream = client.chat.completions.create(messages=msgs, stream=True, **kw)
    for ch in stream:
        assert ch.object == "chat.completion.chunk" and ch.usage is None
        for c in ch.choices:
            if c.delta.role is not None:
                assert c.index not in text and c.delta.role == "assistant"
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert text == {c.index: c.message.content for c in whole.choices}
    assert finish == {0: "length", 1: "length"}


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/completions", {"stop": ["x"]}, "stop"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"n": 11}, "n"),  # 22 candidates a step > max_logprobs 20
    ("/v1/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"tool_choice": "required", "tools": [{
        "type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     "tools"),
])
def test_what_beam_search_does_not_apply_is_refused_by_name(served, path, extra, param):
    body = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
            else {"prompt": "hi"})
    r = _post(served.url, path, {**body, "max_tokens": 2, "use_beam_search": True, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_length_penalty_needs_beam_search_and_the_server_goes_on(served):
    r = _post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                             "length_penalty": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
    ok = _post(served.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                              "use_beam_search": True})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1
    assert served.wait_drained()["num_requests_running"] == 0
