"""/v1/embeddings on a pooling server (--runner pooling), through a real uvicorn server and the
openai client: the vectors are LLM.embed's of the same engine settings (float and base64,
dimensions, normalize, truncate_prompt_tokens, token-id inputs); bad input is a 400 naming the
field and the server goes on; a pooling server refuses generation (and a generating server
embeddings) with a 400 that says why."""

from __future__ import annotations

import asyncio
import base64
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from helpers import free_port, make_llm, tiny, tiny_model_dir, wait_until_healthy
from serverkit import ENGINE_ARGS, MODEL, Served, pooling_server

from jpaged import LLM
from jpaged.pooling_params import PoolingParams

EMBED_MODEL = "tiny-embed"
HIDDEN = 64  # the tiny model's hidden size
TEXTS = ["The quick brown fox", "jumps over the lazy dog.", "a"]


@pytest.fixture(scope="module")
def pooled() -> Iterator[Served]:
    """A server of the tiny model as an embedding model (LAST pooling, normalized)."""
    with pooling_server(EMBED_MODEL) as served:
        yield served


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The same model and engine settings offline: the reference vectors."""
    return make_llm(tiny(), runner="pooling", **ENGINE_ARGS)


def _vectors(resp) -> np.ndarray:
    assert [d.index for d in resp.data] == list(range(len(resp.data)))
    return np.array([d.embedding for d in resp.data], dtype=np.float64)


def _reference(llm: LLM, prompts, params: PoolingParams | None = None) -> np.ndarray:
    return np.array([o.outputs.data for o in llm.encode(prompts, params)], dtype=np.float64)


def _post(served: Served, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, timeout=60)


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error", err
    return err


def test_embeddings_are_llm_embed_vectors(pooled: Served, llm: LLM) -> None:
    client = pooled.client()
    # The openai client asks for base64 unless told otherwise, and decodes it itself.
    resp = client.embeddings.create(model=EMBED_MODEL, input=TEXTS)
    assert resp.object == "list" and resp.model == EMBED_MODEL and resp.id.startswith("embd-")
    assert all(d.object == "embedding" for d in resp.data)
    got = _vectors(resp)
    want = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    assert got.shape == (3, HIDDEN)
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # normalized
    tok = pooled.engine.tokenizer
    n = sum(len(tok.encode(t)) for t in TEXTS)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == n
    # encoding_format "float": JSON floats, exactly the float32 values base64 carried.
    floats = client.embeddings.create(model=EMBED_MODEL, input=TEXTS, encoding_format="float")
    assert all(isinstance(x, float) for x in floats.data[0].embedding)
    np.testing.assert_array_equal(_vectors(floats), got)
    # One string: one vector, the same as in a list.
    one = client.embeddings.create(model=EMBED_MODEL, input=TEXTS[1])
    np.testing.assert_allclose(_vectors(one)[0], want[1], atol=1e-6)
    # base64 asked for: the client leaves it as sent, little-endian float32 bytes.
    b64 = client.embeddings.create(model=EMBED_MODEL, input=TEXTS[2], encoding_format="base64")
    data = np.frombuffer(base64.b64decode(b64.data[0].embedding), "<f4")
    np.testing.assert_array_equal(data, got[2].astype(np.float32))
    raw = _post(pooled, "/v1/embeddings", {"model": EMBED_MODEL, "input": TEXTS[2]}).json()
    assert raw["data"][0]["object"] == "embedding" and raw["object"] == "list"
    assert isinstance(raw["created"], int) and raw["model"] == EMBED_MODEL
    assert raw["usage"] == {"prompt_tokens": len(tok.encode(TEXTS[2])),
                            "total_tokens": len(tok.encode(TEXTS[2]))}
    np.testing.assert_array_equal(raw["data"][0]["embedding"], got[2])  # float by default


def test_token_id_inputs_and_pooling_options(pooled: Served, llm: LLM) -> None:
    client = pooled.client()
    ids = [[5, 17, 99, 3], [200, 1], [42]]
    got = _vectors(client.embeddings.create(model=EMBED_MODEL, input=ids))
    np.testing.assert_allclose(
        got, _reference(llm, [{"prompt_token_ids": x} for x in ids]), atol=1e-6)
    flat = client.embeddings.create(model=EMBED_MODEL, input=ids[0])  # one list of ids
    np.testing.assert_allclose(_vectors(flat)[0], got[0], atol=1e-6)
    assert flat.usage.prompt_tokens == 4
    # dimensions: the first k features, then normalized (vLLM's Matryoshka rule).
    dims = client.embeddings.create(model=EMBED_MODEL, input=TEXTS, dimensions=8)
    want = _reference(llm, TEXTS, PoolingParams(dimensions=8))
    assert _vectors(dims).shape == (3, 8)
    np.testing.assert_allclose(_vectors(dims), want, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(_vectors(dims), axis=1), 1.0, atol=1e-5)
    # vLLM's normalize=false: the pooled hidden state as it is.
    raw = client.embeddings.create(model=EMBED_MODEL, input=TEXTS,
                                   extra_body={"normalize": False})
    want = _reference(llm, TEXTS, PoolingParams(normalize=False))
    np.testing.assert_allclose(_vectors(raw), want, rtol=1e-5, atol=1e-5)
    assert np.linalg.norm(want[0]) > 1.5  # not a unit vector: normalize did change it
    # truncate_prompt_tokens: each input's first k tokens (vLLM: on the right), in the usage.
    long_ids = list(range(10, 40))
    cut = client.embeddings.create(model=EMBED_MODEL, input=[long_ids],
                                   extra_body={"truncate_prompt_tokens": 5})
    np.testing.assert_allclose(
        _vectors(cut)[0], _reference(llm, [{"prompt_token_ids": long_ids[:5]}])[0], atol=1e-6)
    assert cut.usage.prompt_tokens == 5
    # vLLM's extras pass: priority, request_id (the response's id), add_special_tokens, user.
    r = _post(pooled, "/v1/embeddings", {"model": EMBED_MODEL, "input": "x", "user": "u1",
                                         "priority": 0, "request_id": "mine",
                                         "add_special_tokens": False})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "mine"
    # A long input runs in several chunks (max_num_batched_tokens 64), all in one call.
    long_text = "many words to embed " * 5  # 100 tokens of the byte tokenizer
    got = _vectors(client.embeddings.create(model=EMBED_MODEL, input=[long_text, "b"]))
    np.testing.assert_allclose(got, _reference(llm, [long_text, "b"]), atol=1e-6)


def test_async_engine_encode(pooled: Served, llm: LLM) -> None:
    async def run() -> list:
        return [o async for o in pooled.engine.encode("hello", PoolingParams(dimensions=4))]

    outs = asyncio.run(run())
    assert len(outs) == 1 and outs[0].finished and outs[0].outputs is not None
    np.testing.assert_allclose(outs[0].outputs.data,
                               _reference(llm, ["hello"], PoolingParams(dimensions=4))[0],
                               atol=1e-6)


@pytest.mark.parametrize("body,param,words", [
    ({"input": []}, "input", "input is empty"),
    ({"input": ["ok", ""]}, "input", "input[1] is empty"),
    ({"input": [[1, 2], [3, 99999]]}, "input", "input[1][1] is 99999, out of vocabulary"),
    ({"input": [1, -4]}, "input", "input[1] is -4, out of vocabulary"),
    ({"input": "x", "dimensions": HIDDEN + 1}, "dimensions", "dimensions must be"),
    ({"input": "x", "dimensions": 0}, "dimensions", "[1, 64]"),
    ({"input": "x", "encoding_format": "float16"}, "encoding_format", "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1 or"),
    ({"input": "x", "normalize": "sometimes"}, "normalize", "normalize"),
    ({"input": [1.5]}, "input", "input"),
    ({"input": list(range(1, 129))}, "input", "at most 127"),
    ({"input": "x", "frobnicate": 1}, "frobnicate", "unknown field 'frobnicate'"),
    ({"input": "x", "embed_dtype": "float16"}, "embed_dtype", "not supported"),
])
def test_bad_input_is_a_400_naming_the_field(pooled: Served, body: dict, param: str,
                                             words: str) -> None:
    err = _error(_post(pooled, "/v1/embeddings", {"model": EMBED_MODEL, **body}))
    assert err["param"] == param and words in err["message"], err


def test_bad_requests_leave_the_server_serving(pooled: Served, llm: LLM) -> None:
    aborted0 = pooled.engine.engine.stats["num_requests_aborted"]
    # The third input is refused after two were added: those two are aborted.
    err = _error(_post(pooled, "/v1/embeddings", {"model": EMBED_MODEL,
                                                  "input": [[1, 2, 3], [4, 5], [6, 300]]}))
    assert err["message"].startswith("input[2][1] is 300")
    assert pooled.engine.engine.stats["num_requests_aborted"] - aborted0 <= 2
    r = _post(pooled, "/v1/embeddings", {"model": "other", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        pooled.client().embeddings.create(model=EMBED_MODEL, input="x", dimensions=65)
    assert e.value.body["param"] == "dimensions"
    m = pooled.wait_drained()
    assert m["kv_cache_usage"] == 0.0
    good = pooled.client().embeddings.create(model=EMBED_MODEL, input=TEXTS[:1])
    np.testing.assert_allclose(_vectors(good), _reference(llm, TEXTS[:1]), atol=1e-6)


def test_client_that_disconnects_gets_its_requests_aborted(pooled: Served) -> None:
    aborted0 = pooled.engine.engine.stats["num_requests_aborted"]
    body = {"model": EMBED_MODEL, "input": [[(7 * i + j) % 250 + 1 for j in range(120)]
                                            for i in range(40)]}

    async def give_up() -> None:
        async with httpx.AsyncClient(base_url=pooled.url) as client:
            task = asyncio.create_task(client.post("/v1/embeddings", json=body, timeout=60))
            while pooled.engine.get_metrics()["num_requests_running"] == 0:
                await asyncio.sleep(0.001)
            task.cancel()  # the connection closes while the inputs are being run
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(give_up())
    m = pooled.wait_drained(timeout=60)
    assert m["kv_cache_usage"] == 0.0
    assert pooled.engine.engine.stats["num_requests_aborted"] > aborted0


def test_pooling_server_refuses_generation_and_serves_the_rest(pooled: Served) -> None:
    for path, body in (("/v1/completions", {"model": EMBED_MODEL, "prompt": "hi"}),
                       ("/v1/chat/completions",
                        {"model": EMBED_MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/responses", {"model": EMBED_MODEL, "input": "hi"})):
        err = _error(_post(pooled, path, body))
        assert "pooling" in err["message"] and "/v1/embeddings" in err["message"], err
        assert path in err["message"]
    with pytest.raises(openai.BadRequestError, match="use /v1/embeddings"):
        pooled.client().completions.create(model=EMBED_MODEL, prompt="hi", max_tokens=2)
    assert httpx.get(f"{pooled.url}/health").status_code == 200
    models = pooled.client().models.list()
    assert [m.id for m in models.data] == [EMBED_MODEL]
    tok = _post(pooled, "/tokenize", {"model": EMBED_MODEL, "prompt": "hello"}).json()
    assert tok["tokens"] == pooled.engine.tokenizer.encode("hello")
    assert httpx.get(f"{pooled.url}/metrics").status_code == 200


def test_generating_server_refuses_embeddings(served: Served) -> None:
    err = _error(_post(served, "/v1/embeddings", {"model": MODEL, "input": "hi"}))
    assert "does not support embeddings" in err["message"]
    assert "--runner pooling" in err["message"] and err["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        served.client().embeddings.create(model=MODEL, input=["hi"])


def test_invocations_route_by_the_body(pooled: Served, served: Served) -> None:
    """SageMaker's /invocations: an embedding model's input (or messages) is embedded, a
    query with documents reranked and text pairs scored, each as its own route answers; a
    generating server's chat messages are a chat completion, a prompt a completion, and a body
    of neither a 400 naming both."""
    for path, body, key in (
            ("/v1/embeddings", {"input": TEXTS}, "data"),
            ("/v1/embeddings", {"messages": [{"role": "user", "content": TEXTS[0]}]}, "data"),
            ("/rerank", {"query": TEXTS[0], "documents": TEXTS[1:]}, "results"),
            ("/score", {"queries": TEXTS[0], "documents": TEXTS[1:]}, "data")):
        got = _post(pooled, "/invocations", {"model": EMBED_MODEL, **body})
        want = _post(pooled, path, {"model": EMBED_MODEL, **body})
        assert got.status_code == want.status_code == 200, got.text
        assert got.json()[key] == want.json()[key]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0}
    got, want = _post(served, "/invocations", chat).json(), _post(
        served, "/v1/chat/completions", chat).json()
    assert got["object"] == "chat.completion" and got["choices"] == want["choices"]
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    got, want = _post(served, "/invocations", body).json(), _post(
        served, "/v1/completions", body).json()
    assert got["object"] == "text_completion" and got["choices"] == want["choices"]
    err = _error(_post(served, "/invocations", {"model": MODEL, "input": "hi"}))
    assert "ChatCompletionRequest (messages)" in err["message"]
    assert "CompletionRequest (prompt)" in err["message"]
    err = _error(_post(served, "/invocations", {**body, "max_tokens": -1}))
    assert err["param"] == "max_tokens"


def test_jpaged_serve_runner_pooling_with_a_pooler_config() -> None:
    """`jpaged serve --runner pooling --pooler-config JSON` as a user starts it: MEAN pooling,
    not normalized, the offline LLM's vectors of the same settings."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jpaged.cli", "serve", "--model", str(tiny_model_dir()),
         "--port", str(port), "--served-model-name", "emb", "--dtype", "float32",
         "--runner", "pooling", "--pooler-config", '{"pooling_type": "mean", "normalize": false}',
         "--max-model-len", "64", "--num-gpu-blocks-override", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(proc, port, lambda: proc.communicate()[1])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=60)
        got = _vectors(client.embeddings.create(model="emb", input=TEXTS, dimensions=16))
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "pooling runner: MEAN pooling" in err
    llm = make_llm(tiny(), runner="pooling", max_model_len=64, num_gpu_blocks_override=16,
                   pooler_config={"pooling_type": "MEAN", "normalize": False})
    # Un-normalized sums of float32 rows: the server's batches are not the offline LLM's, so
    # a sum's order (and its last bits, ~1e-6 of features near 1) may differ.
    np.testing.assert_allclose(got, _reference(llm, TEXTS, PoolingParams(dimensions=16)),
                               rtol=1e-5, atol=1e-5)
    assert abs(np.linalg.norm(got[0]) - 1.0) > 0.1  # not normalized


def test_chat_messages_embed_as_their_rendered_prompt(pooled: Served, llm: LLM) -> None:
    """vLLM's chat embeddings: `messages` rendered by the chat template (no generation prompt,
    no added special tokens unless asked) and embedded as one prompt; giving input too, or a
    chat-only field with input, is a 400 naming it."""
    messages = [{"role": "system", "content": "Embed the query."},
                {"role": "user", "content": "paged attention"}]
    tok = pooled.engine.tokenizer
    for extra, prompt in (({}, tok.apply_chat_template(messages, add_generation_prompt=False)),
                          ({"add_generation_prompt": True, "add_special_tokens": True},
                           tok.apply_chat_template(messages, add_generation_prompt=True))):
        resp = _post(pooled, "/v1/embeddings", {"model": EMBED_MODEL, "messages": messages,
                                                **extra})
        assert resp.status_code == 200, resp.text
        ids = tok.encode(prompt, add_special_tokens=bool(extra))
        assert resp.json()["usage"]["prompt_tokens"] == len(ids)
        got = [d["embedding"] for d in resp.json()["data"]]
        np.testing.assert_allclose(got, _reference(llm, [{"prompt_token_ids": ids}]), atol=1e-6)
    for body, param in (({"messages": messages, "input": "x"}, "input"), ({}, "input"),
                        ({"messages": []}, "messages"),
                        ({"input": "x", "add_generation_prompt": True}, "add_generation_prompt"),
                        ({"messages": messages, "chat_template": "{% if %}"}, "chat_template")):
        err = _error(_post(pooled, "/v1/embeddings", {"model": EMBED_MODEL, **body}))
        assert err["param"] == param, (body, err)


def test_generating_server_refuses_pooling(served: Served) -> None:
    r = httpx.post(f"{served.url}/pooling", json={"input": "hi"}, timeout=60)
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]
