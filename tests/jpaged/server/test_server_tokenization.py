"""vLLM's tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info) and /version, /ping,
after vLLM's tests/entrypoints/openai/test_tokenization.py: the ids a chat request's messages
tokenize to are the ids /v1/chat/completions runs; bad bodies are 400s naming the field."""

from __future__ import annotations

import httpx
import pytest
from serverkit import MODEL, Served

from jpaged import __version__
from jpaged.server import BackgroundServer, build_app

# The tiny model's template ignores tools; this one writes their names first.
TOOLS_TEMPLATE = ("{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}"
                  "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}}}]


def _post(served: Served, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, timeout=60)


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenize_a_prompt(served: Served) -> None:
    tok = served.engine.tokenizer
    prompt = "jpaged1 This is a test prompt."
    for add_special in (False, True):
        out = _ok(_post(served, "/tokenize", {"model": MODEL, "prompt": prompt,
                                              "add_special_tokens": add_special}))
        ids = tok.encode(prompt, add_special_tokens=add_special)
        assert out == {"tokens": ids, "count": len(ids), "max_model_len": 128,
                       "token_strs": None}
    # Without add_special_tokens a prompt gets the tokenizer's special tokens (vLLM's default).
    default = _ok(_post(served, "/tokenize", {"prompt": prompt}))
    assert default["tokens"] == tok.encode(prompt, add_special_tokens=True)


def test_tokenize_with_token_strs(served: Served) -> None:
    tok = served.engine.tokenizer
    prompt = "This is a token_strs test prompt! jpaged1"
    out = _ok(_post(served, "/tokenize", {"prompt": prompt, "return_token_strs": True}))
    ids = tok.encode(prompt)
    assert out["tokens"] == ids and out["count"] == len(ids)
    assert out["token_strs"] == tok.convert_ids_to_tokens(ids)
    assert "".join(out["token_strs"]).replace("\u0120", " ") == prompt  # byte-level spelling


def test_tokenize_chat_messages(served: Served) -> None:
    tok = served.engine.tokenizer
    conversation = [{"role": "user", "content": "Hi there!"},
                    {"role": "assistant", "content": "Nice to meet you!"},
                    {"role": "user", "content": "Can I ask a question? jpaged1"}]
    for add_generation in (False, True):
        for add_special in (False, True):
            for continue_final in (False, True):
                if add_generation and continue_final:
                    continue
                msgs = conversation + ([{"role": "assistant", "content": "Sure,"}]
                                       if continue_final else [])
                text = tok.apply_chat_template(msgs, add_generation_prompt=add_generation,
                                               continue_final_message=continue_final)
                out = _ok(_post(served, "/tokenize", {
                    "model": MODEL, "messages": msgs, "add_generation_prompt": add_generation,
                    "continue_final_message": continue_final,
                    "add_special_tokens": add_special}))
                ids = tok.encode(text, add_special_tokens=add_special)
                assert out == {"tokens": ids, "count": len(ids), "max_model_len": 128,
                               "token_strs": None}
                if continue_final:
                    assert text.endswith("Sure,")


def test_tokenized_messages_are_what_the_chat_endpoint_runs(served: Served) -> None:
    msgs = [{"role": "user", "content": "Name a river"}]
    ids = _ok(_post(served, "/tokenize", {"messages": msgs}))["tokens"]
    chat = _ok(_post(served, "/v1/chat/completions", {
        "model": MODEL, "messages": msgs, "max_tokens": 2, "return_token_ids": True}))
    assert chat["prompt_token_ids"] == ids
    assert chat["usage"]["prompt_tokens"] == len(ids)


def test_tokenize_chat_with_tools_and_template_kwargs(served: Served) -> None:
    tok = served.engine.tokenizer
    msgs = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    out = _ok(_post(served, "/tokenize", {"messages": msgs, "tools": TOOLS,
                                          "chat_template": TOOLS_TEMPLATE}))
    text = tok.decode(out["tokens"], skip_special_tokens=False)
    assert text == "[get_weather]user: What's the weather like in Paris today?\n"
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = _ok(_post(served, "/tokenize", {"messages": msgs, "chat_template": template,
                                          "chat_template_kwargs": {"greeting": "Hello! "}}))
    assert tok.decode(out["tokens"]) == "Hello! " + msgs[0]["content"]


def test_detokenize(served: Served) -> None:
    tok = served.engine.tokenizer
    prompt = "This is a test prompt. jpaged1"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert _ok(_post(served, "/detokenize", {"model": MODEL, "tokens": ids})) == {"prompt": prompt}
    # Special tokens are kept, as vLLM's /detokenize keeps them.
    eos = tok.eos_token_id
    out = _ok(_post(served, "/detokenize", {"tokens": [*ids, eos]}))
    assert out == {"prompt": prompt + tok.eos_token}
    assert _ok(_post(served, "/detokenize", {"tokens": []})) == {"prompt": ""}


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400,
     "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, 400,
     "add_generation_prompt"),
    ("/tokenize", {"prompt": "x", "tools": TOOLS}, 400, "tools"),
    ("/tokenize", {"prompt": "x", "mm_processor_kwargs": {}}, 400, "mm_processor_kwargs"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "add_generation_prompt": True, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "chat_template": "{% for m in messages %}"}, 400, "chat_template"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "chat_template_kwargs": [1]}, 400, "chat_template_kwargs"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
])
def test_bad_bodies_name_the_field(served: Served, path: str, body: dict, status: int,
                                   param: str) -> None:
    r = _post(served, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    # The server goes on: the same endpoint answers a good body.
    good = {"prompt": "ok"} if path == "/tokenize" else {"tokens": [111, 107]}
    assert _post(served, path, good).status_code == 200


def test_version_ping_and_tokenizer_info(served: Served) -> None:
    assert _ok(httpx.get(f"{served.url}/version", timeout=30)) == {"version": __version__}
    assert httpx.get(f"{served.url}/ping", timeout=30).status_code == 200
    assert httpx.post(f"{served.url}/ping", timeout=30).status_code == 200
    # /tokenizer_info shows the chat template: only a server that opts in serves it.
    assert httpx.get(f"{served.url}/tokenizer_info", timeout=30).status_code == 404
    tok = served.engine.tokenizer
    server = BackgroundServer(build_app(served.engine, MODEL,
                                        enable_tokenizer_info_endpoint=True))
    try:
        info = _ok(httpx.get(f"{server.url}/tokenizer_info", timeout=30))
        ids = _ok(httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world!"},
                             timeout=30))
    finally:
        server.stop()
    assert info["tokenizer_class"] and info["chat_template"] == tok.chat_template
    assert (info["bos_token"], info["eos_token"]) == (tok.bos_token, tok.eos_token)
    assert info["model_max_length"] == ids["max_model_len"] == 128
    assert info["vocab_size"] == tok.vocab_size
    added = info["added_tokens_decoder"]
    assert added[str(tok.eos_token_id)]["content"] == tok.eos_token
    assert all(isinstance(v["special"], bool) for v in added.values())


def test_load_counts_generation_requests_in_flight_when_tracked(served: Served) -> None:
    """vLLM's /load (--enable-server-load-tracking): a stream counts until its last event, a
    refused request not at all after its answer; untracked, /load is 0 throughout."""
    def load(url: str) -> int:
        return _ok(httpx.get(f"{url}/load", timeout=30))["server_load"]

    body = {"model": MODEL, "prompt": "Count with me:", "max_tokens": 100, "ignore_eos": True,
            "stream": True}
    server = BackgroundServer(build_app(served.engine, MODEL, enable_server_load_tracking=True))
    try:
        for url, in_flight in ((server.url, 1), (served.url, 0)):
            assert load(url) == 0
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                assert load(url) == in_flight  # 100 tokens: far from done after the first
                assert "data: [DONE]" in list(lines)
            assert load(url) == 0
            bad = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": -1},
                             timeout=30)
            assert bad.status_code == 400 and load(url) == 0
            ok = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2})
            assert ok.status_code == 200 and load(url) == 0
    finally:
        server.stop()


def test_a_served_chat_template_replaces_the_models(served: Served, tmp_path) -> None:
    """vLLM's --chat-template (a file, or the template itself): messages render with it (a
    request's own chat_template still wins); /tokenizer_info shows it; a value that is neither
    is refused before anything starts."""
    from jpaged.server.serving import load_chat_template

    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    tok = served.engine.tokenizer
    msgs = [{"role": "user", "content": "hey"}]
    for value in (str(path), template):
        server = BackgroundServer(build_app(served.engine, MODEL, chat_template=value,
                                            enable_tokenizer_info_endpoint=True))
        try:
            ids = _ok(httpx.post(f"{server.url}/tokenize", timeout=30, json={
                "messages": msgs, "add_special_tokens": False}))["tokens"]
            assert tok.decode(ids) == "<user>hey"
            own = _ok(httpx.post(f"{server.url}/tokenize", timeout=30, json={
                "messages": msgs, "chat_template": "{{ messages[0].content }}!"}))["tokens"]
            assert tok.decode(own, skip_special_tokens=True) == "hey!"
            info = _ok(httpx.get(f"{server.url}/tokenizer_info", timeout=30))
            assert info["chat_template"] == template
        finally:
            server.stop()
    for bad, match in (("no/such/file.jinja", "neither a file nor a template"),
                       ("{% for %}", "does not compile")):
        with pytest.raises(ValueError, match=match):
            load_chat_template(bad)
