"""A sequence classifier behind the server (runner "pooling", a one-label cross-encoder):
vLLM's /classify, and /score and /rerank reading each pair as one prompt, through a real
uvicorn server and httpx, each equal to LLM.classify / LLM.score of the same engine settings;
the APIs of the other kind of pooling model are a 400 naming what to use, and bad input a 400
naming the field while the server goes on."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from helpers import make_llm
from serverkit import ENGINE_ARGS, Served, pooling_server

from jpaged import LLM, PoolingParams
from models import load_model

NAME = "tiny-reranker"
QUERY = "What is the capital of France?"
DOCS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris.",
        "Paged attention"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """A tiny one-label MistralForSequenceClassification (a cross-encoder)."""
    from tiny_models import make_hf_classifier

    path = tmp_path_factory.mktemp("reranker")
    make_hf_classifier("mistral", path, ["relevant"], seed=7)
    return load_model(str(path), dtype="float32")


@pytest.fixture(scope="module")
def ranked(loaded) -> Iterator[Served]:
    with pooling_server(NAME, loaded) as served:
        yield served


@pytest.fixture(scope="module")
def llm(loaded) -> LLM:
    return make_llm(loaded, runner="pooling", **ENGINE_ARGS)


def _post(served: Served, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json={"model": NAME, **body}, timeout=60)


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_classify_is_llm_classify(ranked: Served, llm: LLM) -> None:
    """One input or several (texts or token ids): each its probabilities, the label of the
    largest and the class count; use_activation false gives the logit."""
    resp = _ok(_post(ranked, "/classify", {"input": [QUERY, *DOCS]}))
    assert resp["id"].startswith("classify-") and resp["object"] == "list"
    want = llm.classify([QUERY, *DOCS])
    for i, (d, w) in enumerate(zip(resp["data"], want, strict=True)):
        assert d["index"] == i and d["object"] == "classify" and d["num_classes"] == 1
        assert d["label"] == "relevant"
        np.testing.assert_allclose(d["probs"], w.outputs.probs, atol=1e-6)
    n = sum(len(w.prompt_token_ids) for w in want)
    assert resp["usage"] == {"prompt_tokens": n, "total_tokens": n}
    raw = _ok(_post(ranked, "/classify", {"input": [1, 2, 3], "use_activation": False}))
    logit = llm.classify([[1, 2, 3]], PoolingParams(use_activation=False))[0].outputs.probs
    np.testing.assert_allclose(raw["data"][0]["probs"], logit, atol=1e-6)
    prob = _ok(_post(ranked, "/classify", {"input": [1, 2, 3]}))["data"][0]["probs"][0]
    assert abs(1 / (1 + np.exp(-raw["data"][0]["probs"][0])) - prob) < 1e-6


def test_classify_takes_chat_messages(ranked: Served, llm: LLM) -> None:
    """`messages` rendered by the chat template are classified as one prompt."""
    messages = [{"role": "user", "content": QUERY}]
    text = ranked.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    ids = ranked.engine.tokenizer.encode(text, add_special_tokens=False)
    resp = _ok(_post(ranked, "/classify", {"messages": messages}))
    assert resp["usage"]["prompt_tokens"] == len(ids)
    want = llm.classify([{"prompt_token_ids": ids}])[0].outputs.probs
    np.testing.assert_allclose(resp["data"][0]["probs"], want, atol=1e-6)


def test_score_and_rerank_read_each_pair_as_one_prompt(ranked: Served, llm: LLM) -> None:
    """/score's and /rerank's scores are LLM.score's (the sigmoid of the pair's logit), the
    usage counts each joined prompt once; rerank orders them best first."""
    want = [o.outputs.score for o in llm.score(QUERY, DOCS)]
    assert len(set(np.round(want, 5))) == 3
    resp = _ok(_post(ranked, "/score", {"text_1": QUERY, "text_2": DOCS}))
    np.testing.assert_allclose([d["score"] for d in resp["data"]], want, atol=1e-6)
    tok = ranked.engine.tokenizer
    n = sum(len(tok.encode_pair(QUERY, d)) for d in DOCS)
    assert resp["usage"]["prompt_tokens"] == n
    ranks = _ok(_post(ranked, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2}))
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in ranks["results"]] == order
    np.testing.assert_allclose([x["relevance_score"] for x in ranks["results"]],
                               [want[i] for i in order], atol=1e-6)
    assert ranks["usage"]["total_tokens"] == n
    raw = _ok(_post(ranked, "/score", {"text_1": QUERY, "text_2": DOCS[0],
                                       "use_activation": False}))
    assert abs(1 / (1 + np.exp(-raw["data"][0]["score"])) - want[0]) < 1e-6


def test_invocations_answer_each_api_by_its_fields(ranked: Served) -> None:
    """SageMaker's /invocations on a classifier: an input is classified, a query and its
    documents reranked, text pairs scored, each as its own route answers; a body of none of
    them, or not an object, is a 400 listing what it takes; a bad field is its API's own
    400."""
    for path, body, key in (("/classify", {"input": [QUERY, DOCS[1]]}, "data"),
                            ("/rerank", {"query": QUERY, "documents": DOCS}, "results"),
                            ("/score", {"text_1": QUERY, "text_2": DOCS}, "data")):
        got, want = _ok(_post(ranked, "/invocations", body)), _ok(_post(ranked, path, body))
        assert got["id"].split("-")[0] == want["id"].split("-")[0]
        assert got[key] == want[key] and got["usage"] == want["usage"]
    err = _error(_post(ranked, "/invocations", {"prompt": QUERY}))
    assert "no API of this model takes the request" in err["message"]
    assert "ClassificationRequest (input or messages)" in err["message"]
    assert "RerankRequest (query)" in err["message"] and "ScoreRequest (text_1" in err["message"]
    err = _error(_post(ranked, "/invocations", {"input": QUERY, "dimensionz": 4}))
    assert err["param"] == "dimensionz"
    err = _error(_post(ranked, "/invocations", {"query": QUERY, "documents": []}))
    assert err["param"] == "documents"
    r = httpx.post(f"{ranked.url}/invocations", json=[QUERY], timeout=60)
    assert "must be a JSON object" in _error(r)["message"]
    r = httpx.post(f"{ranked.url}/invocations", content=b"{not json", timeout=60)
    assert "not valid JSON" in _error(r)["message"]


def test_pooling_api_gives_a_classifiers_probabilities(ranked: Served, llm: LLM) -> None:
    """vLLM's /pooling: a classifier's probabilities and an embedding model's vectors under
    `data` (the embedding server's: in test_the_other_apis_point_at_the_right_one)."""
    resp = _ok(_post(ranked, "/pooling", {"input": [QUERY, DOCS[0]]}))
    assert resp["id"].startswith("pool-") and resp["object"] == "list"
    want = llm.classify([QUERY, DOCS[0]])
    for i, (d, w) in enumerate(zip(resp["data"], want, strict=True)):
        assert d["index"] == i and d["object"] == "pooling"
        np.testing.assert_allclose(d["data"], w.outputs.probs, atol=1e-6)


def test_the_other_apis_point_at_the_right_one(ranked: Served) -> None:
    """Embeddings of a classifier, classify of an embedding model, generation of either:
    a 400 naming what to use; the server goes on. An embedding server takes use_activation
    as normalize, and its /pooling gives /v1/embeddings' vectors."""
    import base64

    err = _error(_post(ranked, "/v1/embeddings", {"input": "hi"}))
    assert "sequence classifier" in err["message"] and "/classify" in err["message"]
    err = _error(_post(ranked, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi"}]}))
    assert "/classify" in err["message"]
    with pooling_server("tiny-embed") as embed:
        err = _error(httpx.post(f"{embed.url}/classify", json={"input": "hi"}, timeout=60))
        assert "not a sequence classifier" in err["message"] and err["param"] == "model"
        # (vLLM's newer name for an embedding's normalize)
        vecs = [httpx.post(f"{embed.url}/v1/embeddings", json={"input": "hi", key: False},
                           timeout=60).json()["data"][0]["embedding"]
                for key in ("normalize", "use_activation")]
        assert vecs[0] == vecs[1] and abs(np.linalg.norm(vecs[0]) - 1) > 1e-3
        # /pooling of an embedding model: /v1/embeddings' vector (base64 alike) under `data`
        body = {"input": "hi", "encoding_format": "base64"}
        got = httpx.post(f"{embed.url}/pooling", json=body, timeout=60).json()["data"][0]
        want = httpx.post(f"{embed.url}/v1/embeddings", json=body, timeout=60).json()
        assert got["object"] == "pooling" and got["data"] == want["data"][0]["embedding"]
        assert np.frombuffer(base64.b64decode(got["data"]), "<f4").shape == (64,)
    _ok(_post(ranked, "/classify", {"input": "hi"}))


@pytest.mark.parametrize("path, body, param", [
    ("/classify", {"input": []}, "input"),
    ("/classify", {"input": "x" * 200}, "input"),
    ("/classify", {"input": "hi", "dimensions": 2}, "dimensions"),
    ("/classify", {"input": "hi", "softmax": False}, "softmax"),
    ("/classify", {"input": [[1, 2], [1, 99999]]}, "input"),
    ("/score", {"text_1": "q", "text_2": "x" * 200}, "text_2"),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": -2}, "top_n"),
])
def test_bad_input_is_a_400_naming_the_field(ranked: Served, path: str, body: dict,
                                             param: str) -> None:
    assert _error(_post(ranked, path, body))["param"] == param


def test_run_batch_answers_the_pooling_urls(ranked: Served) -> None:
    """vLLM's run-batch lines for /classify, /v1/score and /v1/rerank get the server's own
    answers; /v1/embeddings of a classifier gets its 400 as an output line."""
    import asyncio
    import json

    from jpaged.server import build_app
    from jpaged.server.run_batch import run_batch_lines

    bodies = {"/classify": {"input": [QUERY, DOCS[0]]},
              "/v1/score": {"text_1": QUERY, "text_2": DOCS},
              "/v1/rerank": {"query": QUERY, "documents": DOCS},
              "/v1/embeddings": {"input": "hi"}}
    lines = [json.dumps({"custom_id": url, "method": "POST", "url": url,
                         "body": {"model": NAME, **body}}) for url, body in bodies.items()]
    result = asyncio.run(run_batch_lines(build_app(ranked.engine, NAME), lines))
    assert result.malformed == []
    out = {a["custom_id"]: a for a in result.lines}
    for url in ("/classify", "/v1/score"):
        want = _ok(_post(ranked, url, bodies[url]))["data"]
        assert out[url]["response"]["body"]["data"] == want, url
    want = _ok(_post(ranked, "/v1/rerank", bodies["/v1/rerank"]))["results"]
    assert out["/v1/rerank"]["response"]["body"]["results"] == want
    bad = out["/v1/embeddings"]
    assert bad["response"]["status_code"] == 400 and "/classify" in bad["error"]["message"]
