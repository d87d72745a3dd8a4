"""Sequence classifiers (`*ForSequenceClassification`, runner="pooling"): class probabilities
(LLM.classify) and cross-encoder scores (LLM.score) checked against HF transformers' own
classifier in float32, through chunked prefill, MEAN pooling under preemption, a jpaged
checkpoint round trip; the activation by problem type; bad input refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import make_llm, random_prompts

from jpaged import LLM, PoolingParams, SamplingParams
from jpaged.pooling_params import activation
from models import ModelSpec, load_model

torch = pytest.importorskip("torch")

SIZING = dict(block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8,
              num_gpu_blocks_override=128)
LABELS = ["negative", "neutral", "positive"]


@pytest.fixture(scope="module")
def qwen3_cls(tmp_path_factory):
    """A tiny Qwen3ForSequenceClassification of three labels: its directory, jpaged's load of
    it and HF's model."""
    from tiny_models import make_hf_classifier

    path = tmp_path_factory.mktemp("qwen3_cls")
    hf = make_hf_classifier("qwen3_qk_norm", path, LABELS)
    return path, load_model(str(path), dtype="float32"), hf


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A tiny LlamaForSequenceClassification of one label (a cross-encoder, as rerankers
    are), untied in its config as such checkpoints are."""
    from tiny_models import make_hf_classifier

    path = tmp_path_factory.mktemp("llama_ce")
    hf = make_hf_classifier("mistral", path, ["relevance"], seed=3)
    return path, load_model(str(path), dtype="float32"), hf


def hf_logits(hf, ids: list[int]) -> np.ndarray:
    """HF's class logits of one unpadded prompt (its last token's score-head row)."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_class_probabilities_equal_hfs_through_chunked_prefill(qwen3_cls):
    """Prompts of 9-29 tokens in chunks of 8: probs are the softmax of HF's logits, in the
    checkpoint's label order; use_activation=False gives the logits themselves."""
    _, loaded, hf = qwen3_cls
    assert loaded.spec.labels == tuple(LABELS) and loaded.spec.num_labels == 3
    assert loaded.spec.hf_architecture == "Qwen3ForSequenceClassification"
    llm = make_llm(loaded, runner="pooling", **SIZING)
    ps = random_prompts(5, seed=21)
    outs = llm.classify([{"prompt_token_ids": p} for p in ps])
    raw = llm.classify([{"prompt_token_ids": p} for p in ps],
                       PoolingParams(use_activation=False))
    for p, out, logits in zip(ps, outs, raw, strict=True):
        ref = hf_logits(hf, p)
        assert out.outputs.num_classes == 3 and out.prompt_token_ids == p
        np.testing.assert_allclose(out.outputs.probs, softmax(ref), atol=2e-6)
        np.testing.assert_allclose(logits.outputs.probs, ref, atol=2e-5)
    assert llm.get_metrics()["kv_cache_usage"] == 0.0


def test_mean_pooling_under_preemption_applies_the_head_to_the_mean(qwen3_cls):
    """pooler_config MEAN in a pool too small for every prompt at once: each chunk's rows go
    through the (linear) head and add up; the logits equal the head of HF's mean hidden
    state."""
    _, loaded, hf = qwen3_cls
    llm = make_llm(loaded, runner="pooling", pooler_config={"pooling_type": "MEAN"},
                   block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                   num_gpu_blocks_override=16, long_prefill_token_threshold=4)
    ps = [p[:28] for p in random_prompts(6, seed=22)]
    outs = llm.classify([{"prompt_token_ids": p} for p in ps],
                        PoolingParams(use_activation=False))
    with torch.no_grad():
        for p, out in zip(ps, outs, strict=True):
            h = hf.model(torch.tensor([p])).last_hidden_state[0].mean(0)
            np.testing.assert_allclose(out.outputs.probs, (hf.score.weight @ h).numpy(),
                                       atol=2e-5)
    assert llm.get_metrics()["num_preemptions"] > 0


def test_cross_encoder_scores_are_the_pairs_sigmoid(cross_encoder):
    """A one-label classifier scores a pair read as one prompt (the tokenizer's pair
    encoding): the sigmoid of HF's logit of those tokens; one text against many and two
    lists; token-id pairs join end to end; classify gives the same probability."""
    _, loaded, hf = cross_encoder
    assert loaded.spec.tie_word_embeddings and loaded.model.lm_head is None
    llm = make_llm(loaded, runner="pooling", **SIZING)
    tok = llm.get_tokenizer()
    query, docs = "what is paged attention", ["a KV cache in blocks", "a recipe for bread"]
    scores = llm.score(query, docs)
    for doc, s in zip(docs, scores, strict=True):
        ids = tok.encode_pair(query, doc)
        assert s.prompt_token_ids == ids
        want = 1 / (1 + np.exp(-float(hf_logits(hf, ids)[0])))
        assert abs(s.outputs.score - want) < 1e-6
    again = llm.score([query, query], docs)
    assert [s.outputs.score for s in again] == [s.outputs.score for s in scores]
    a, b = random_prompts(2, seed=23)
    joined = llm.score({"prompt_token_ids": a}, {"prompt_token_ids": b})[0]
    assert joined.prompt_token_ids == a + b
    probs = llm.classify([{"prompt_token_ids": a + b}])[0].outputs.probs
    assert probs == [joined.outputs.score]


def test_activation_follows_the_problem_type():
    """HF's problem types: softmax over labels by default, sigmoid of each label for a
    multi-label problem (and of a lone label), the logits as they are for a regression."""
    x = np.array([2.0, -1.0, 0.5], np.float32)
    np.testing.assert_allclose(activation(x, None), softmax(x), rtol=1e-6)
    np.testing.assert_allclose(activation(x, "multi_label_classification"), 1 / (1 + np.exp(-x)),
                               rtol=1e-6)
    np.testing.assert_allclose(activation(x, "regression"), x)
    np.testing.assert_allclose(activation(x[:1], None), 1 / (1 + np.exp(-x[:1])), rtol=1e-6)


def test_runner_auto_serves_a_classifier_and_a_checkpoint_keeps_it(qwen3_cls, tmp_path):
    """A directory holding a sequence classifier starts a pooling engine under runner "auto"
    (vLLM's); `jpaged convert`'s checkpoint keeps its labels and head (the same
    probabilities), and its config.json names the classifier again."""
    from models.checkpoint import save_checkpoint

    path, loaded, _ = qwen3_cls
    llm = make_llm(loaded, model=str(path), **SIZING)
    assert llm.llm_engine.pooler is not None
    p = random_prompts(1, seed=24)[0]
    want = llm.classify([{"prompt_token_ids": p}])[0].outputs.probs
    out = save_checkpoint(loaded, tmp_path / "ckpt")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForSequenceClassification"]
    assert cfg["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}
    back = load_model(str(out), dtype="float32")
    assert back.spec == loaded.spec
    got = make_llm(back, model=str(out), **SIZING).classify([{"prompt_token_ids": p}])
    np.testing.assert_allclose(got[0].outputs.probs, want, atol=1e-7)


def test_bad_input_is_refused_by_name(qwen3_cls):
    """A classifier refuses generation, embeddings, cut dimensions and disagreeing
    activation settings; scoring pairs needs one label; a bad id2label or problem_type
    names the field. The engine goes on with the same answer."""
    _, loaded, _ = qwen3_cls
    with pytest.raises(ValueError, match="sequence classifier.*runner='pooling'"):
        make_llm(loaded, runner="generate", **SIZING)
    llm = make_llm(loaded, runner="pooling", **SIZING)
    p = {"prompt_token_ids": random_prompts(1, seed=25)[0]}
    before = llm.classify([p])[0].outputs.probs
    with pytest.raises(ValueError, match="embed needs an embedding model"):
        llm.embed([p])
    with pytest.raises(ValueError, match="dimensions cuts an embedding"):
        llm.classify([p], PoolingParams(dimensions=2))
    with pytest.raises(ValueError, match="normalize and use_activation"):
        llm.classify([p], PoolingParams(normalize=True, use_activation=False))
    with pytest.raises(ValueError, match="use_activation must be a bool"):
        llm.classify([p], PoolingParams(use_activation="yes"))
    with pytest.raises(ValueError, match="needs a cross-encoder.*3 labels"):
        llm.score("a", "b")
    with pytest.raises(ValueError, match="classifies prompts"):
        llm.generate([p], SamplingParams(max_tokens=2))
    # vLLM's pooling_task: the model's own tasks, none other
    assert llm.encode([p], pooling_task="classify")[0].outputs.data.tolist() == before
    for task, match in (("embed", "is a sequence classifier, whose tasks are classify, "
                                  "score"), ("token_embed", "token-level pooling"),
                        ("reward", "pooling_task must be one of")):
        with pytest.raises(ValueError, match=match):
            llm.encode([p], pooling_task=task)
    assert llm.classify([p])[0].outputs.probs == before
    cfg = json.loads((qwen3_cls[0] / "config.json").read_text())
    for field, value, match in (("id2label", {"0": "a", "2": "b"}, "id2label.*0..n-1"),
                                ("id2label", {"x": "a"}, "id2label.*integer ids"),
                                ("num_labels", 5, "num_labels.*5.*3 labels"),
                                ("problem_type", "ranking", "problem_type.*ranking")):
        with pytest.raises(ValueError, match=match):
            ModelSpec.from_hf_config({**cfg, field: value})


def test_classify_needs_a_classifier():
    """An embedding model refuses LLM.classify and the classify task by name."""
    from helpers import tiny

    llm: LLM = make_llm(tiny(), runner="pooling", **SIZING)
    with pytest.raises(ValueError, match="classify needs a sequence classifier"):
        llm.classify(["hello"])
    with pytest.raises(ValueError, match="an embedding model, whose tasks are embed"):
        llm.encode(["hello"], pooling_task="classify")
    assert len(llm.encode(["hello"], pooling_task="embed")[0].outputs.data) == 64


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    """A tiny causal Qwen3 (untied LM head) and HF's model of it: a reranker as published
    (its answer read from the logits of chosen tokens)."""
    from tiny_models import make_hf_checkpoint

    path = tmp_path_factory.mktemp("qwen3_causal")
    hf = make_hf_checkpoint("qwen3_qk_norm", path, seed=4)
    return path, hf


def hf_next_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].numpy()


def test_hf_overrides_turn_a_causal_reranker_into_a_cross_encoder(causal):
    """vLLM's Qwen3-Reranker recipe: hf_overrides naming the classifier architecture,
    `classifier_from_token` ["n", "y"] and is_original_qwen3_reranker (a 2-way softmax): the
    runner is pooling under "auto", and a pair's score is HF's softmax probability of "y"
    against "n" after the pair's tokens."""
    path, hf = causal
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": ["n", "y"], "is_original_qwen3_reranker": True}
    loaded = load_model(str(path), dtype="float32", hf_overrides=overrides)
    assert loaded.spec.labels == ("y",) and loaded.model.lm_head is None
    llm = make_llm(loaded, model=str(path), hf_overrides=json.dumps(overrides), **SIZING)
    assert llm.llm_engine.pooler is not None  # runner "auto" read the overrides
    tok = llm.get_tokenizer()
    n, y = tok.token_to_id("n"), tok.token_to_id("y")
    for doc in ("a KV cache in blocks", "bread"):
        got = llm.score("what is paged attention", doc)[0]
        logits = hf_next_logits(hf, got.prompt_token_ids)
        assert abs(got.outputs.score - softmax(logits[[n, y]])[1]) < 1e-6


def test_no_post_processing_keeps_one_label_per_token(causal):
    """method no_post_processing: one label per token, its logit HF's logit of that token."""
    path, hf = causal
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": ["a", "b", "c"], "method": "no_post_processing"}
    loaded = load_model(str(path), dtype="float32", hf_overrides=overrides)
    assert loaded.spec.labels == ("a", "b", "c")
    llm = make_llm(loaded, runner="pooling", **SIZING)
    ids = [loaded.tokenizer.token_to_id(t) for t in "abc"]
    p = random_prompts(1, seed=26)[0]
    raw = llm.classify([{"prompt_token_ids": p}], PoolingParams(use_activation=False))[0]
    np.testing.assert_allclose(raw.outputs.probs, hf_next_logits(hf, p)[ids], atol=2e-5)


def test_bad_hf_overrides_are_refused_by_name(causal):
    """A token outside the vocabulary, a method jpaged lacks, a 2-way softmax of three tokens,
    overrides of a GGUF, and overrides that are not a JSON object: each names what is wrong."""
    from helpers import tiny

    path, _ = causal
    seq = {"architectures": ["Qwen3ForSequenceClassification"]}
    for extra, match in (
            ({"classifier_from_token": ["n", "no-such-token"], "method": "from_2_way_softmax"},
             "'no-such-token' is not a token"),
            ({"classifier_from_token": ["n", "y"], "method": "mean"}, "'method' must be one of"),
            ({"classifier_from_token": ["n", "y", "z"], "method": "from_2_way_softmax"},
             "must name two tokens"),
            ({"classifier_from_token": []}, "non-empty list of token strings")):
        with pytest.raises(ValueError, match=match):
            load_model(str(path), dtype="float32", hf_overrides={**seq, **extra})
    with pytest.raises(ValueError, match="hf_overrides apply to an HF model's config.json"):
        load_model(None, hf_overrides=seq)
    for bad, match in (("{not json", "hf_overrides is not JSON"),
                       ("[1, 2]", "hf_overrides must be a JSON object")):
        with pytest.raises(ValueError, match=match):
            make_llm(tiny(), hf_overrides=bad, **SIZING)


def test_estimate_reads_the_overrides(causal):
    """`jpaged estimate --hf-overrides`: the spec of the overridden config (a classifier: its
    score head counted, no LM head); overrides of a GGUF are refused naming the flag."""
    from jpaged.estimate import EstimateError, estimate_capacity

    path, _ = causal
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": ["n", "y"], "is_original_qwen3_reranker": True}
    plain = estimate_capacity(str(path), gpu_memory="1GiB", dtype="float32")
    cls = estimate_capacity(str(path), gpu_memory="1GiB", dtype="float32",
                            hf_overrides=json.dumps(overrides))
    spec = load_model(str(path), dtype="float32", hf_overrides=overrides).spec
    assert cls.architecture == "Qwen3ForSequenceClassification"
    # The untied LM head (vocab x hidden) gives way to a one-row score head.
    assert plain.param_bytes - cls.param_bytes == 4 * spec.hidden_size * (
        spec.vocab_size - 1)
    with pytest.raises(EstimateError, match="--hf-overrides"):
        estimate_capacity(None, hf_overrides=overrides)
