"""vLLM's score API (/score and /v1/score) on a pooling server (--runner pooling), through a
real uvicorn server and httpx: the scores are LLM.score's of the same engine settings and the
cosines of /v1/embeddings' vectors (one text against many, pairs of two lists, vLLM's field
names); each distinct text runs once; bad input is a 400 naming the field and the server goes
on; a generating server answers /score with a 400 naming --runner pooling."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from helpers import make_llm, tiny
from serverkit import ENGINE_ARGS, MODEL, Served, pooling_server

from jpaged import LLM
from jpaged.server.protocol import SCORE_PAIRS

EMBED_MODEL = "tiny-score"
QUERY = "What is the capital of France?"
DOCS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris.",
        "Paged attention"]
LONG = "x" * 200  # 200 tokens of the byte tokenizer: past max_model_len (128)


@pytest.fixture(scope="module")
def pooled() -> Iterator[Served]:
    """A server of the tiny model as an embedding model (LAST pooling, normalized)."""
    with pooling_server(EMBED_MODEL) as served:
        yield served


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The same model and engine settings offline: the reference scores."""
    return make_llm(tiny(), runner="pooling", **ENGINE_ARGS)


def _post(served: Served, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, timeout=60)


def _score(served: Served, body: dict, path: str = "/score") -> dict:
    r = _post(served, path, {"model": EMBED_MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _scores(resp: dict) -> list[float]:
    assert [d["index"] for d in resp["data"]] == list(range(len(resp["data"])))
    assert all(d["object"] == "score" for d in resp["data"])
    return [d["score"] for d in resp["data"]]


def _reference(llm: LLM, data_1, data_2, **kw) -> list[float]:
    return [o.outputs.score for o in llm.score(data_1, data_2, **kw)]


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error", err
    return err


def test_one_against_many_is_llm_score(pooled: Served, llm: LLM) -> None:
    resp = _score(pooled, {"text_1": QUERY, "text_2": DOCS})
    assert resp["id"].startswith("score-") and resp["object"] == "list"
    assert isinstance(resp["created"], int) and resp["model"] == EMBED_MODEL
    got = _scores(resp)
    want = llm.score(QUERY, DOCS)
    np.testing.assert_allclose(got, [o.outputs.score for o in want], atol=1e-6)
    # The cosine of the /v1/embeddings vectors of the same texts.
    emb = _post(pooled, "/v1/embeddings", {"model": EMBED_MODEL, "input": [QUERY, *DOCS]})
    v = np.array([d["embedding"] for d in emb.json()["data"]], dtype=np.float64)
    cos = v[1:] @ v[0] / (np.linalg.norm(v[1:], axis=1) * np.linalg.norm(v[0]))
    np.testing.assert_allclose(got, cos, atol=1e-6)
    assert len(set(np.round(got, 4))) == 3  # not all alike: the check can tell them apart
    # Usage: each pair's tokens, both texts (LLM.score's prompt_token_ids).
    tok = pooled.engine.tokenizer
    n = sum(len(tok.encode(QUERY)) + len(tok.encode(d)) for d in DOCS)
    assert n == sum(len(o.prompt_token_ids) for o in want)
    assert resp["usage"] == {"prompt_tokens": n, "total_tokens": n}
    # /v1/score is the same handler; a one-text list is one text.
    for path, body in (("/v1/score", {"text_1": QUERY, "text_2": DOCS}),
                       ("/score", {"text_1": [QUERY], "text_2": DOCS})):
        again = _score(pooled, body, path)
        np.testing.assert_allclose(_scores(again), got, atol=1e-6)
        assert again["usage"] == resp["usage"]
    one = _score(pooled, {"text_1": QUERY, "text_2": DOCS[1]})
    np.testing.assert_allclose(_scores(one), got[1:2], atol=1e-6)


def test_pairs_of_two_lists_embed_each_text_once(pooled: Served, llm: LLM) -> None:
    firsts = [QUERY, "Where is Paris?", "attention"]
    got = _scores(_score(pooled, {"text_1": firsts, "text_2": DOCS}, "/v1/score"))
    np.testing.assert_allclose(got, _reference(llm, firsts, DOCS), atol=1e-6)
    # Five pairs of three distinct texts: three engine requests; a text with itself scores 1.
    stats = pooled.engine.engine.stats
    done0 = stats["num_requests_finished"]
    left, right = [QUERY, QUERY, DOCS[0], DOCS[1], QUERY], [DOCS[0], DOCS[1], DOCS[0], QUERY,
                                                            QUERY]
    resp = _score(pooled, {"text_1": left, "text_2": right})
    assert stats["num_requests_finished"] - done0 == 3
    got = _scores(resp)
    np.testing.assert_allclose(got, _reference(llm, left, right), atol=1e-6)
    assert abs(got[2] - 1.0) < 1e-5 and abs(got[4] - 1.0) < 1e-5
    assert got[1] == got[3]  # the same pair either way round
    tok = pooled.engine.tokenizer
    n = sum(len(tok.encode(a)) + len(tok.encode(b)) for a, b in zip(left, right, strict=True))
    assert resp["usage"]["prompt_tokens"] == n


def test_vllm_field_names_and_extras(pooled: Served, llm: LLM) -> None:
    want = _reference(llm, QUERY, DOCS)
    for first, second in SCORE_PAIRS:  # text_1/2, data_1/2, queries with documents or items
        got = _scores(_score(pooled, {first: QUERY, second: DOCS}))
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=f"{first}, {second}")
    # vLLM's extras: request_id (the response's id), priority, user, cache_salt, and
    # use_activation (a cosine is the same either way), padding "do_not_pad".
    resp = _score(pooled, {"text_1": QUERY, "text_2": DOCS, "request_id": "mine",
                           "priority": 0, "user": "u1", "cache_salt": "salt",
                           "use_activation": False, "padding": "do_not_pad"})
    assert resp["id"] == "mine"
    np.testing.assert_allclose(_scores(resp), want, atol=1e-6)
    # truncate_prompt_tokens: each text's first k tokens, in the usage too.
    cut = _score(pooled, {"text_1": QUERY, "text_2": DOCS, "truncate_prompt_tokens": 4})
    np.testing.assert_allclose(
        _scores(cut), _reference(llm, QUERY, DOCS, truncate_prompt_tokens=4), atol=1e-6)
    assert cut["usage"]["prompt_tokens"] == 4 * 2 * len(DOCS)
    # -1: as many as the context allows, so a text past it is scored on its first 127.
    full = _score(pooled, {"text_1": LONG, "text_2": DOCS[0], "truncate_prompt_tokens": -1})
    np.testing.assert_allclose(
        _scores(full), _reference(llm, LONG, DOCS[0], truncate_prompt_tokens=-1), atol=1e-6)


@pytest.mark.parametrize("body,param,words", [
    ({"text_1": QUERY, "text_2": []}, "text_2", "text_2 is empty"),
    ({"text_1": [], "text_2": DOCS}, "text_1", "text_1 is empty"),
    ({"text_1": QUERY, "text_2": ["ok", ""]}, "text_2", "text_2[1] is empty"),
    ({"text_1": ["a", "b"], "text_2": DOCS}, "text_1", "text_1 has 2 texts and text_2 3"),
    ({"text_1": ["a", "b"], "text_2": "c"}, "text_1", "text_1 has 2 texts and text_2 1"),
    ({"data_1": ["a", "b"], "data_2": DOCS}, "data_1", "data_1 has 2 texts and data_2 3"),
    ({"text_1": QUERY, "text_2": ["ok", LONG]}, "text_2", "text_2[1] has 200 tokens"),
    ({"text_1": LONG, "text_2": "ok"}, "text_1", "text_1 has 200 tokens"),
    ({"queries": "a" * 100_000, "documents": "ok"}, "queries", "100000 bytes"),
    ({"text_1": QUERY}, "text_2", "text_2 is missing"),
    ({"documents": DOCS}, "queries", "queries is missing"),
    ({}, "text_1", "text_1 and text_2"),
    ({"text_1": QUERY, "data_2": DOCS}, "data_2", "data_2 goes with data_1, not with text_1"),
    ({"queries": QUERY, "documents": DOCS, "items": DOCS}, "items", "documents and items"),
    ({"text_1": QUERY, "data_1": QUERY, "text_2": DOCS}, "data_1", "text_1 and data_1"),
    ({"text_1": {"content": []}, "text_2": DOCS}, "text_1", "text_1"),
    ({"text_1": [1, 2], "text_2": DOCS}, "text_1", "text_1"),
    ({"text_1": QUERY, "text_2": DOCS, "frobnicate": 1}, "frobnicate", "unknown field"),
    ({"text_1": QUERY, "text_2": DOCS, "encoding_format": "float"}, "encoding_format",
     "unknown field 'encoding_format'"),
    ({"text_1": QUERY, "text_2": DOCS, "normalize": False}, "normalize", "unknown field"),
    ({"text_1": QUERY, "text_2": DOCS, "max_tokens_per_doc": 4}, "max_tokens_per_doc",
     "not supported"),
    ({"text_1": QUERY, "text_2": DOCS, "truncation_side": "left"}, "truncation_side",
     "not supported"),
    ({"text_1": QUERY, "text_2": DOCS, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     "-1 or"),
    ({"text_1": QUERY, "text_2": DOCS, "truncate_prompt_tokens": 500},
     "truncate_prompt_tokens", "truncate_prompt_tokens"),
    ({"text_1": QUERY, "text_2": DOCS, "cache_salt": ""}, "cache_salt", "non-empty"),
    ({"text_1": QUERY, "text_2": DOCS, "priority": "high"}, "priority", "priority"),
])
def test_bad_input_is_a_400_naming_the_field(pooled: Served, body: dict, param: str,
                                             words: str) -> None:
    err = _error(_post(pooled, "/score", {"model": EMBED_MODEL, **body}))
    assert err["param"] == param and words in err["message"], err


def test_bad_requests_leave_the_server_serving(pooled: Served, llm: LLM) -> None:
    r = _post(pooled, "/score", {"model": "other", "text_1": "a", "text_2": "b"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    for body in ({"text_1": QUERY, "text_2": [*DOCS, LONG]},
                 {"text_1": QUERY, "text_2": DOCS, "truncate_prompt_tokens": 0},
                 {"text_1": ["a", "b"], "text_2": DOCS}):
        _error(_post(pooled, "/v1/score", {"model": EMBED_MODEL, **body}))
    m = pooled.wait_drained()
    assert m["kv_cache_usage"] == 0.0 and m["num_unfinished_requests"] == 0
    got = _scores(_score(pooled, {"text_1": QUERY, "text_2": DOCS}))
    np.testing.assert_allclose(got, _reference(llm, QUERY, DOCS), atol=1e-6)


def test_client_that_disconnects_gets_its_requests_aborted(pooled: Served) -> None:
    aborted0 = pooled.engine.engine.stats["num_requests_aborted"]
    docs = [f"{i:03d} " + "".join(chr(97 + (7 * i + j) % 26) for j in range(116))
            for i in range(40)]  # 40 distinct texts of 120 tokens
    body = {"model": EMBED_MODEL, "text_1": QUERY, "text_2": docs}

    async def give_up() -> bool:
        """Whether the client went away before its answer came."""
        async with httpx.AsyncClient(base_url=pooled.url) as client:
            task = asyncio.create_task(client.post("/score", json=body, timeout=60))
            # The short query may be through before the documents are added: wait for them.
            for _ in range(30_000):
                if task.done() or pooled.engine.get_metrics()["num_unfinished_requests"] >= 8:
                    break
                await asyncio.sleep(0.001)
            task.cancel()  # the connection closes while the texts are being run
            try:
                await task
            except asyncio.CancelledError:
                return True
            return False

    # On a busy machine the engine can keep up with the texts as the server adds them, so
    # that a try never sees them in flight and is answered whole: then it tries again. (It
    # had waited for 20 at once and failed on such a machine.)
    assert any(asyncio.run(give_up()) for _ in range(3)), "the answer always came first"
    m = pooled.wait_drained(timeout=60)
    assert m["kv_cache_usage"] == 0.0
    assert pooled.engine.engine.stats["num_requests_aborted"] > aborted0


def test_generating_server_refuses_score(served: Served) -> None:
    for path in ("/score", "/v1/score"):
        err = _error(_post(served, path, {"model": MODEL, "text_1": "a", "text_2": ["b"]}))
        assert "does not support the score API" in err["message"], err
        assert "--runner pooling" in err["message"] and err["param"] == "model"
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_pooling_server_points_generation_at_score(pooled: Served) -> None:
    err = _error(_post(pooled, "/v1/completions", {"model": EMBED_MODEL, "prompt": "hi"}))
    assert "/v1/embeddings" in err["message"] and "/score" in err["message"]


def test_rerank_orders_documents_by_their_score(pooled: Served, llm: LLM) -> None:
    """/rerank (and /v1/rerank, /v2/rerank) of an embedding model: the documents by cosine,
    best first, each with its index and text; top_n keeps the best n; return_documents
    false leaves the text out; usage is /score's."""
    want = _reference(llm, QUERY, DOCS)
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = _post(pooled, path, {"model": EMBED_MODEL, "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        resp = r.json()
        assert resp["id"].startswith("rerank-") and resp["model"] == EMBED_MODEL
        assert [x["index"] for x in resp["results"]] == order
        np.testing.assert_allclose([x["relevance_score"] for x in resp["results"]],
                                   [want[i] for i in order], atol=1e-6)
        assert [x["document"]["text"] for x in resp["results"]] == [DOCS[i] for i in order]
        score = _score(pooled, {"text_1": QUERY, "text_2": DOCS})
        assert resp["usage"] == score["usage"]
    top = _post(pooled, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 1,
                                    "return_documents": False}).json()
    assert top["results"] == [{"index": order[0], "relevance_score": top["results"][0][
        "relevance_score"]}]


@pytest.mark.parametrize("body, param", [
    ({"query": "", "documents": ["a"]}, "query"),
    ({"query": "q", "documents": []}, "documents"),
    ({"query": "q", "documents": ["a", ""]}, "documents"),
    ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ({"query": "q", "documents": ["a"], "rank_fusion": True}, "rank_fusion"),
    ({"query": "q", "documents": [LONG]}, "documents"),
])
def test_bad_rerank_input_is_a_400_naming_the_field(pooled: Served, body: dict,
                                                    param: str) -> None:
    err = _error(_post(pooled, "/rerank", {"model": EMBED_MODEL, **body}))
    assert err["param"] == param, err
