"""vLLM's own /v1/embeddings tests, ported onto jpaged's server: a real uvicorn server on
127.0.0.1 serving the tiny Llama with `runner="pooling"` (LAST, normalized), asked through the
real `openai` client (and httpx for vLLM's raw requests).

Each test names the vLLM tests whose checks it carries over (tests/entrypoints/pooling/openai/
test_embedding.py, test_embedding_dimensions.py, test_truncation.py, embed/test_online.py,
basic/test_truncation.py, test_cache_salt_validation.py). vLLM compares against a
sentence-transformers model (bf16, 1e-2); here the reference is HF's LlamaModel holding the same
weights, pooled the same way, in float32 (1e-5). Where jpaged differs on purpose (docs/pooling.md:
an input may have at most max_model_len - 1 tokens) the test checks jpaged's rule; the
differences the port found are fixed (docs/reliability.md, "vLLM's own tests, ported").
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from helpers import hf_llama_twin, tiny
from serverkit import ENGINE_ARGS, Served, pooling_server

torch = pytest.importorskip("torch")

EMBED_MODEL = "tiny-embed-vllm"
HIDDEN = 64  # the tiny model's hidden size
MAX_LEN = ENGINE_ARGS["max_model_len"]  # 128
PROMPT = "The chef prepared a delicious meal."
TEXTS = ["The cat sat on the mat.", "A feline was resting on a rug.",
         "Stars twinkle brightly in the night sky."]
SHORT = "Como o Brasil pode fomentar o desenvolvimento de modelos de IA?"
LONG = ("Immerse yourself in the enchanting chronicle of calculus, a mathematical domain that "
        "has radically transformed our comprehension of change and motion. Despite its roots "
        "in ancient civilizations, the formal birth of calculus predominantly occurred in the "
        "17th century, primarily under the influential guidance of Sir Isaac Newton and "
        "Gottfried Wilhelm Leibniz.")


@pytest.fixture(scope="module")
def pooled() -> Iterator[Served]:
    """A server of the tiny model as an embedding model (LAST pooling, normalized)."""
    with pooling_server(EMBED_MODEL) as served:
        yield served


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """HF's LlamaModel holding the tiny model's weights (float32): the reference."""
    return hf_llama_twin(tiny(), tmp_path_factory.mktemp("twin")).model.eval()


def reference(base, ids: list[int], normalize: bool = True,
              dimensions: int | None = None) -> np.ndarray:
    """The last token's final hidden state, cut to `dimensions` and normalized (vLLM's
    run_embedding_correctness_test with matryoshka_fy)."""
    with torch.no_grad():
        v = base(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
    if dimensions is not None:
        v = v[:dimensions]
    return v / np.linalg.norm(v) if normalize or dimensions is not None else v


def vectors(resp) -> np.ndarray:
    assert [d.index for d in resp.data] == list(range(len(resp.data)))
    return np.array([d.embedding for d in resp.data], dtype=np.float64)


def post(served: Served, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}/v1/embeddings", json={"model": EMBED_MODEL, **body},
                      timeout=60)


def tokens(served: Served, text: str) -> list[int]:
    return served.engine.tokenizer.encode(text)


def test_single_text_and_token_ids(pooled: Served, hf_base) -> None:
    """openai/test_embedding.py::test_single_embedding, embed/test_online.py::test_basic and
    ::test_completion_request: /v1/models and /tokenize; one text gives one vector of the
    hidden size with its tokens as usage (no completion tokens), the reference embedding; its
    token ids give the same vector and usage; five ids count five."""
    models = pooled.client().models.list()
    assert [m.id for m in models.data] == [EMBED_MODEL]
    assert httpx.get(f"{pooled.url}/v1/models").json()["data"][0]["id"] == EMBED_MODEL
    ids = tokens(pooled, PROMPT)
    tok = httpx.post(f"{pooled.url}/tokenize", json={"model": EMBED_MODEL, "prompt": PROMPT})
    assert tok.json()["tokens"] == ids
    client = pooled.client()
    resp = client.embeddings.create(model=EMBED_MODEL, input=[PROMPT], encoding_format="float")
    assert resp.id and len(resp.data) == 1 and len(resp.data[0].embedding) == HIDDEN
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == len(ids)
    assert (resp.usage.model_dump().get("completion_tokens") or 0) == 0
    np.testing.assert_allclose(vectors(resp)[0], reference(hf_base, ids), atol=1e-5)
    by_ids = client.embeddings.create(model=EMBED_MODEL, input=ids, encoding_format="float")
    assert by_ids.usage.prompt_tokens == by_ids.usage.total_tokens == len(ids)
    np.testing.assert_allclose(vectors(by_ids), vectors(resp), atol=1e-6)
    five = client.embeddings.create(model=EMBED_MODEL, input=[1, 1, 1, 1, 1],
                                    encoding_format="float")
    assert len(five.data) == 1 and len(five.data[0].embedding) == HIDDEN
    assert five.usage.prompt_tokens == five.usage.total_tokens == 5


def test_batches_equal_single_inputs(pooled: Served, hf_base) -> None:
    """openai/test_embedding.py::test_batch_embedding (three texts; four token-id lists: 17
    tokens) and embed/test_online.py::test_completion_request_batched (ten copies of a text and
    of its ids): usage is the sum of the inputs' tokens, every vector the reference one and the
    one the input gets alone."""
    client = pooled.client()
    resp = client.embeddings.create(model=EMBED_MODEL, input=TEXTS, encoding_format="float")
    assert len(resp.data) == 3 and len(resp.data[0].embedding) == HIDDEN
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(
        len(tokens(pooled, t)) for t in TEXTS)
    got = vectors(resp)
    for t, v in zip(TEXTS, got, strict=True):
        np.testing.assert_allclose(v, reference(hf_base, tokens(pooled, t)), atol=1e-5)
        alone = client.embeddings.create(model=EMBED_MODEL, input=t, encoding_format="float")
        np.testing.assert_allclose(vectors(alone)[0], v, atol=1e-6)
    id_lists = [[4, 5, 7, 9, 20], [15, 29, 49], [24, 24, 24, 24, 24], [25, 32, 64, 77]]
    resp = client.embeddings.create(model=EMBED_MODEL, input=id_lists, encoding_format="float")
    assert len(resp.data) == 4 and resp.usage.prompt_tokens == resp.usage.total_tokens == 17
    for ids, v in zip(id_lists, vectors(resp), strict=True):
        np.testing.assert_allclose(v, reference(hf_base, ids), atol=1e-5)
    n, ids = 10, tokens(pooled, PROMPT)
    texts = client.embeddings.create(model=EMBED_MODEL, input=[PROMPT] * n,
                                     encoding_format="float")
    assert len(texts.data) == n and texts.usage.prompt_tokens == n * len(ids)
    by_ids = client.embeddings.create(model=EMBED_MODEL, input=[ids] * n,
                                      encoding_format="float")
    assert by_ids.usage.total_tokens == n * len(ids)
    want = np.repeat(reference(hf_base, ids)[None], n, axis=0)
    np.testing.assert_allclose(vectors(texts), want, atol=1e-5)
    np.testing.assert_allclose(vectors(by_ids), vectors(texts), atol=1e-6)


def test_base64_float_and_default_encodings_agree(pooled: Served, hf_base) -> None:
    """openai/test_embedding.py::test_batch_base64_embedding and ::test_base64_embed_dtype
    (float32): "float", "base64" decoded by hand as float32, the client's default (base64 it
    decodes itself) and base64 with embed_dtype float32 / endianness native are one vector,
    the reference."""
    client = pooled.client()
    inputs = ["Hello my name is",
              "The best thing about vLLM is that it supports many different models"]
    floats = vectors(client.embeddings.create(model=EMBED_MODEL, input=inputs,
                                              encoding_format="float"))
    for text, v in zip(inputs, floats, strict=True):
        np.testing.assert_allclose(v, reference(hf_base, tokens(pooled, text)), atol=1e-5)
    b64 = client.embeddings.create(model=EMBED_MODEL, input=inputs, encoding_format="base64")
    decoded = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="float32")
                        for d in b64.data], np.float64)
    np.testing.assert_array_equal(decoded, floats)
    default = vectors(client.embeddings.create(model=EMBED_MODEL, input=inputs))
    np.testing.assert_array_equal(default, floats)
    raw = post(pooled, {"input": inputs, "encoding_format": "base64", "embed_dtype": "float32",
                        "endianness": "native"})
    assert raw.status_code == 200, raw.text
    got = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                    for d in raw.json()["data"]], np.float64)
    np.testing.assert_array_equal(got, floats)


def test_normalize(pooled: Served) -> None:
    """embed/test_online.py / openai/test_embedding.py::test_normalize: normalize null is the
    server's (normalized), false gives the raw vector, and normalizing that gives true's."""
    def get(normalize) -> np.ndarray:
        r = post(pooled, {"input": [PROMPT], "encoding_format": "float",
                          "normalize": normalize})
        assert r.status_code == 200, r.text
        return np.array([d["embedding"] for d in r.json()["data"]], np.float64)

    default, w_normal, wo_normal = get(None), get(True), get(False)
    np.testing.assert_allclose(default, w_normal, atol=1e-7)
    assert not np.allclose(w_normal, wo_normal, atol=1e-2)
    np.testing.assert_allclose(w_normal, wo_normal / np.linalg.norm(wo_normal, axis=1,
                                                                  keepdims=True), atol=1e-6)


def test_dimensions(pooled: Served, hf_base) -> None:
    """openai/test_embedding_dimensions.py::test_matryoshka: dimensions None keeps every
    feature; 16 and 32 keep that many, the reference's first d normalized (matryoshka_fy);
    -1 and past the hidden size are 400s. (vLLM also refuses any dimensions for a model that is
    not Matryoshka; jpaged cuts any model's vector: checked here as jpaged's rule.)"""
    client = pooled.client()
    ids = tokens(pooled, PROMPT)
    for d in (None, 16, 32):
        resp = client.embeddings.create(model=EMBED_MODEL, input=[PROMPT] * 3, dimensions=d,
                                        encoding_format="float")
        assert len(resp.data) == 3 and resp.usage.prompt_tokens == 3 * len(ids)
        assert len(resp.data[0].embedding) == (d or HIDDEN)
        want = reference(hf_base, ids, dimensions=d)
        np.testing.assert_allclose(vectors(resp), np.repeat(want[None], 3, axis=0), atol=1e-5)
    for bad in (-1, HIDDEN + 1):
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model=EMBED_MODEL, input=[PROMPT] * 3, dimensions=bad)
        assert e.value.status_code == 400 and e.value.body["param"] == "dimensions"


def test_truncate_prompt_tokens(pooled: Served, hf_base) -> None:
    """basic/test_truncation.py and openai/test_truncation.py (smaller, bigger, -1) and
    openai/test_embedding.py::test_single_embedding_truncation: 10 keeps ten tokens of a text
    or of 21 token ids (usage 10, the vector of the ten kept); -1 keeps as many as the context
    allows (jpaged: max_model_len - 1 = 127, docs/pooling.md; vLLM: 128); max_model_len + 1 on
    an input that long is a 400, as is the input untruncated."""
    client = pooled.client()
    assert len(tokens(pooled, LONG)) > MAX_LEN
    for text in (LONG, SHORT):
        r = client.post("/embeddings", cast_to=object,
                        body={"model": EMBED_MODEL, "input": text, "truncate_prompt_tokens": 10})
        assert r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"] == 10
        assert len(r["data"][0]["embedding"]) == HIDDEN
    ids = list(range(40, 61))  # 21 token ids
    resp = client.embeddings.create(model=EMBED_MODEL, input=ids, encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": 10})
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == 10
    got = vectors(resp)[0]  # the vector of ten of the ids (its first ten: truncated on the right)
    assert any(np.allclose(got, reference(hf_base, kept), atol=1e-5)
               for kept in (ids[:10], ids[-10:]))
    r = client.post("/embeddings", cast_to=object,
                    body={"model": EMBED_MODEL, "input": LONG, "truncate_prompt_tokens": -1})
    assert r["usage"]["prompt_tokens"] == MAX_LEN - 1
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/embeddings", cast_to=object,
                    body={"model": EMBED_MODEL, "input": LONG,
                          "truncate_prompt_tokens": MAX_LEN + 1})
    assert e.value.status_code == 400
    assert e.value.response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="at most 127"):
        client.embeddings.create(model=EMBED_MODEL, input=LONG)
    assert pooled.wait_drained()["kv_cache_usage"] == 0.0


def test_truncation_past_the_context_is_a_400_for_a_short_input(pooled: Served) -> None:
    """openai/test_embedding.py::test_single_embedding_truncation_invalid and
    embed/test_online.py::test_truncate_prompt_tokens: truncate 8193 on a short text."""
    with pytest.raises(openai.BadRequestError):
        pooled.client().embeddings.create(model=EMBED_MODEL, input=[SHORT],
                                          extra_body={"truncate_prompt_tokens": 8193})


def test_truncation_keeps_the_start_of_the_input(pooled: Served, hf_base) -> None:
    """basic/test_encode.py::test_right_side_truncation, on the server: the vector of 21 ids
    truncated to 5 is the first five ids' vector."""
    ids = list(range(40, 61))
    resp = pooled.client().embeddings.create(model=EMBED_MODEL, input=ids,
                                             encoding_format="float",
                                             extra_body={"truncate_prompt_tokens": 5})
    np.testing.assert_allclose(vectors(resp)[0], reference(hf_base, ids[:5]), atol=1e-5)


@pytest.mark.parametrize("field", ["encoding_format", "embed_dtype", "endianness"])
def test_unsupported_encoding_params_are_400s(pooled: Served, field: str) -> None:
    """embed/test_online.py::test_params_not_supported and openai/test_embedding.py::
    test_base64_embed_dtype_not_supported: a bad encoding_format, embed_dtype or endianness
    is a 400 naming the field."""
    r = post(pooled, {"input": PROMPT, "encoding_format": "base64", field: f"bad_{field}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [[1, 300]]}, "input"),  # out of the vocabulary (300 ids)
    ({"messages": [{"role": "user", "content": "hi"}], "input": "x"}, "input"),
    ({"input": "x", "cache_salt": ""}, "cache_salt"),
])
def test_empty_and_invalid_inputs_are_400s(pooled: Served, body: dict, param: str) -> None:
    """Empty and invalid inputs (vLLM's protocol checks; test_cache_salt_validation.py's empty
    salt) are 400s naming the field; chat-style `messages` (vLLM's embed/test_online.py::
    test_chat_request, checked in test_server_embeddings.py) beside an input is one too."""
    r = post(pooled, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_a_cache_salt_is_accepted(pooled: Served) -> None:
    """test_cache_salt_validation.py::test_pooling_accepts_a_real_cache_salt, on the server."""
    r = post(pooled, {"input": PROMPT, "cache_salt": "tenant-a"})
    assert r.status_code == 200, r.text
