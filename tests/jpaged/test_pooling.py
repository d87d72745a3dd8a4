"""Pooling models (runner="pooling"): each prompt's final hidden states pooled into one vector
(LAST, MEAN, CLS; normalized or not), checked against HF transformers' base model
(`AutoModel`'s last_hidden_state, float32) through chunked prefill, preemption and prefix-cache
hits; PoolingParams, the sentence-transformers config, LLM.score, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import embedded, hf_llama_twin, make_llm, random_prompts

from jpaged import LLM, PoolingParams, SamplingParams
from models import load_model

torch = pytest.importorskip("torch")

BLOCK = 4
SIZING = dict(block_size=BLOCK, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8,
              num_gpu_blocks_override=128)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3 HF checkpoint (q/k norms), its jpaged model and HF's base model."""
    from tiny_models import make_hf_checkpoint
    from transformers import AutoModel

    path = tmp_path_factory.mktemp("qwen3")
    make_hf_checkpoint("qwen3_qk_norm", path)
    base = AutoModel.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    return path, load_model(str(path), dtype="float32"), base


def hidden_states(base, prompt: list[int]) -> np.ndarray:
    """HF's final hidden states (after the last norm) of one prompt, [T, hidden]."""
    with torch.no_grad():
        return base(torch.tensor([prompt])).last_hidden_state[0].numpy()


def pooled(h: np.ndarray, kind: str, normalize: bool = True) -> np.ndarray:
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
    return v / np.linalg.norm(v) if normalize else v


def vectors(llm: LLM, prompts: list[list[int]], params: PoolingParams | None = None
            ) -> list[np.ndarray]:
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts], params)
    return [np.asarray(o.outputs.data) for o in outs]


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_pooled_vectors_equal_hfs_through_chunked_prefill(qwen3, kind):
    """Prompts of 9-29 tokens in chunks of 8 (a prompt's MEAN sums every chunk's rows)."""
    _, loaded, base = qwen3
    llm = make_llm(loaded, runner="pooling", pooler_config={"pooling_type": kind}, **SIZING)
    ps = random_prompts(5, seed=11)
    for p, got in zip(ps, vectors(llm, ps), strict=True):
        assert got.dtype == np.float32 and got.shape == (loaded.spec.hidden_size,)
        np.testing.assert_allclose(got, pooled(hidden_states(base, p), kind), atol=2e-6)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.get_metrics()["kv_cache_usage"] == 0.0


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_preemption_and_prefix_cache_hits_keep_the_vectors(qwen3, kind):
    """A pool too small for every prompt at once (preemptions: a recompute starts the pooling
    over) and shared prefixes with prefix caching on (LAST reads the cached blocks; MEAN skips
    the lookup: it needs every position's hidden state)."""
    _, loaded, base = qwen3
    llm = make_llm(loaded, runner="pooling", pooler_config={"pooling_type": kind},
                   enable_prefix_caching=True, block_size=BLOCK, max_model_len=64,
                   max_num_seqs=4, max_num_batched_tokens=16, num_gpu_blocks_override=16,
                   long_prefill_token_threshold=4)  # four prompts advance side by side
    prefix = random_prompts(1, seed=5)[0][:20]
    ps = [prefix + q[:12] for q in random_prompts(6, seed=6)]
    got = vectors(llm, ps)
    for p, g in zip(ps, got, strict=True):
        np.testing.assert_allclose(g, pooled(hidden_states(base, p), kind), atol=2e-6)
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0
    assert (metrics["prefix_cache_hits"] > 0) == (kind == "LAST")


def test_pooling_params_and_score(qwen3):
    """`normalize=False` gives the raw hidden state, `dimensions` the first d features
    (normalized after the cut), `truncate_prompt_tokens` the first k tokens; LLM.score is the
    cosine of the two embeddings."""
    _, loaded, base = qwen3
    llm = make_llm(loaded, runner="pooling", **SIZING)
    p = random_prompts(1, seed=9)[0]
    h = hidden_states(base, p)
    raw = vectors(llm, [p], PoolingParams(normalize=False))[0]
    np.testing.assert_allclose(raw, h[-1], atol=2e-6)
    cut = vectors(llm, [p], PoolingParams(dimensions=16))[0]
    np.testing.assert_allclose(cut, h[-1][:16] / np.linalg.norm(h[-1][:16]), atol=2e-6)
    tail = llm.encode([{"prompt_token_ids": p}], truncate_prompt_tokens=5)[0]
    assert tail.prompt_token_ids == p[:5]
    np.testing.assert_allclose(tail.outputs.data, pooled(hidden_states(base, p[:5]), "LAST"),
                               atol=2e-6)
    q = random_prompts(2, seed=10)
    scores = llm.score({"prompt_token_ids": p}, [{"prompt_token_ids": x} for x in q])
    for s, x in zip(scores, q, strict=True):
        a, b = pooled(h, "LAST"), pooled(hidden_states(base, x), "LAST")
        assert abs(s.outputs.score - float(a @ b)) < 1e-5
    emb = llm.embed([{"prompt_token_ids": p}])[0]
    assert emb.outputs.hidden_size == loaded.spec.hidden_size


def test_a_sentence_transformers_checkpoint_says_how_it_pools(qwen3, tmp_path):
    """modules.json with a Pooling module (mean tokens) and a Normalize module: the engine
    pools MEAN, normalized, unless pooler_config says otherwise; a config setting two modes
    is refused by name."""
    import shutil

    path, loaded, base = qwen3
    st = tmp_path / "st"
    shutil.copytree(path, st)
    (st / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    llm = LLM(model=str(st), dtype="float32", runner="pooling", **SIZING)
    assert llm.llm_engine.pooler.pooling_type == "MEAN" and llm.llm_engine.pooler.normalize
    p = random_prompts(1, seed=12)[0]
    np.testing.assert_allclose(vectors(llm, [p])[0], pooled(hidden_states(base, p), "MEAN"),
                               atol=2e-6)
    over = LLM(model=str(st), dtype="float32", runner="pooling",
               pooler_config={"pooling_type": "CLS", "normalize": False}, **SIZING)
    np.testing.assert_allclose(vectors(over, [p])[0], hidden_states(base, p)[0], atol=2e-6)
    (st / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}))
    with pytest.raises(ValueError, match="pools one way"):
        LLM(model=str(st), dtype="float32", runner="pooling", **SIZING)


def test_the_embedded_model_embeds_as_hfs_twin(tmp_path):
    """The embedded SmolLM2 (real weights, real tokenizer) as an embedding model: text
    prompts' LAST vectors equal HF's LlamaModel holding the same weights."""
    loaded = embedded()
    twin = hf_llama_twin(loaded, tmp_path).model.eval()
    llm = make_llm(loaded, runner="pooling", max_model_len=128, max_num_batched_tokens=16)
    texts = ["The capital of France is", "Paged attention keeps the KV cache in blocks."]
    outs = llm.embed(texts)
    for text, out in zip(texts, outs, strict=True):
        ids = loaded.tokenizer.encode(text)
        assert out.prompt_token_ids == ids
        np.testing.assert_allclose(out.outputs.embedding, pooled(hidden_states(twin, ids),
                                                                 "LAST"), atol=1e-5)


def test_bad_input_is_refused_by_name_and_the_engine_keeps_serving(qwen3):
    _, loaded, base = qwen3
    llm = make_llm(loaded, runner="pooling", **SIZING)
    p = random_prompts(1, seed=13)[0]
    want = vectors(llm, [p])[0]
    with pytest.raises(ValueError, match="runs a pooling model"):
        llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"dimensions must be an integer in \[1, 64\]"):
        llm.embed([{"prompt_token_ids": p}], PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.embed([{"prompt_token_ids": [1, 10**6]}])
    assert not llm.llm_engine.has_unfinished_requests()
    np.testing.assert_array_equal(vectors(llm, [p])[0], want)
    gen = make_llm(loaded, **SIZING)
    with pytest.raises(ValueError, match="need a pooling engine"):
        gen.encode([{"prompt_token_ids": p}])
    pytest.importorskip("ray")
    from jpaged.config import EngineArgs
    from jpaged.dp.client import DPEngineClient

    with pytest.raises(ValueError, match="runner 'pooling' serves from one engine"):
        DPEngineClient(EngineArgs(runner="pooling"), 2)  # refused before any replica starts
    for bad, match in (({"pooler_config": {"pooling_type": "MAX"}}, "pooling_type must be"),
                       ({"pooler_config": {"pool": "LAST"}}, "unknown field"),
                       ({"pooler_config": "{not json"}, "not JSON"),
                       ({"runner": "embed"}, "runner must be one of"),
                       ({"runner": "generate", "pooler_config": {}}, "is for runner"),
                       ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                "prompt_lookup_max": 2}},
                        "speculative_config is for generation")):
        with pytest.raises(ValueError, match=match):
            make_llm(loaded, **{"runner": "pooling", **bad, **SIZING})
