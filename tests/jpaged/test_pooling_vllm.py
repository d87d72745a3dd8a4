"""vLLM's own pooling tests, ported onto jpaged's offline API (`LLM(runner="pooling")`,
`LLM.embed` / `encode` / `score`, `PoolingParams`).

Each test names the vLLM tests whose checks it carries over (tests/entrypoints/pooling/...,
tests/models/language/pooling/..., tests/test_pooling_params.py). vLLM's models (e5, MiniLM,
Qwen3-Embedding) become a tiny random Qwen3 checkpoint (byte tokenizer) and the embedded SmolLM2
(real tokenizer and weights); vLLM's HF / sentence-transformers references become HF
transformers' `AutoModel` / `LlamaModel` run on the same token ids and pooled the same way
(sentence-transformers' Transformer -> Pooling -> Normalize modules), in float32, so the bounds
are 1e-5 where vLLM's (bf16) are 1e-2.

Where jpaged differs from vLLM on purpose (docs/pooling.md: a prompt may have at most
max_model_len - 1 tokens) the test checks jpaged's rule; the differences the port found are
fixed (docs/reliability.md, "vLLM's own tests, ported").
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import embedded, hf_llama_twin, make_llm

from jpaged import LLM, PoolingParams
from jpaged.outputs import EmbeddingRequestOutput, PoolingRequestOutput, ScoringRequestOutput
from models import load_model

torch = pytest.importorskip("torch")

BLOCK = 4
MAX_LEN = 64
SIZING = dict(block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=4,
              max_num_batched_tokens=8, num_gpu_blocks_override=128)
HIDDEN = 64  # the tiny Qwen3's hidden size

# vLLM's test texts (tests/entrypoints/pooling/...): byte-tokenized by the tiny model.
PROMPT = "The chef prepared a delicious meal."
TEXTS = ["The cat sat on the mat.", "A feline was resting on a rug.",
         "Stars twinkle brightly in the night sky."]
TEXTS_1 = ["What is the capital of France?", "What is the capital of Germany?"]
TEXTS_2 = ["The capital of France is Paris.", "The capital of Germany is Berlin."]
SHORT = "Como o Brasil pode fomentar o desenvolvimento de modelos de IA?"
LONG = (  # vLLM's truncation tests' input: longer than any context here
    "Immerse yourself in the enchanting chronicle of calculus, a mathematical domain that has "
    "radically transformed our comprehension of change and motion. Despite its roots in "
    "ancient civilizations, the formal birth of calculus predominantly occurred in the 17th "
    "century, primarily under the influential guidance of Sir Isaac Newton and Gottfried "
    "Wilhelm Leibniz. The earliest traces of calculus concepts are found in ancient Greek "
    "mathematics, most notably in the works of Eudoxus and Archimedes, around 300 BCE. They "
    "utilized the 'method of exhaustion', a technique for computing areas and volumes through "
    "the use of finite sums. This methodology laid crucial foundational work for integral "
    "calculus. In the 17th century, both Newton and Leibniz independently pioneered calculus, "
    "each contributing unique perspectives that would shape this new field.")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3 HF checkpoint (q/k norms): its jpaged model, HF's base model, its path."""
    from tiny_models import make_hf_checkpoint
    from transformers import AutoModel

    path = tmp_path_factory.mktemp("qwen3")
    make_hf_checkpoint("qwen3_qk_norm", path)
    base = AutoModel.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    return load_model(str(path), dtype="float32"), base, path


@pytest.fixture(scope="module")
def llm(qwen3) -> LLM:
    """The tiny Qwen3 as an embedding model: LAST pooling, normalized (vLLM's default)."""
    return make_llm(qwen3[0], runner="pooling", **SIZING)


def hidden(base, ids: list[int]) -> np.ndarray:
    """HF's final hidden states of one prompt, [T, hidden] float64."""
    with torch.no_grad():
        return base(torch.tensor([ids])).last_hidden_state[0].double().numpy()


def reference(base, ids: list[int], kind: str = "LAST", normalize: bool = True,
              dimensions: int | None = None) -> np.ndarray:
    """A sentence-transformers embedding of `ids` (Pooling, Normalize), with vLLM's
    `matryoshka_fy` (the first d features, normalized again) when `dimensions` is set."""
    h = hidden(base, ids)
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
    if dimensions is not None:
        v = v[:dimensions]
    return v / np.linalg.norm(v) if normalize or dimensions is not None else v


def unit(v) -> np.ndarray:
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v)


def cosine(a, b) -> float:
    return float(unit(a) @ unit(b))


def vecs(outs) -> np.ndarray:
    """The vectors of embed (EmbeddingRequestOutput) or encode (PoolingRequestOutput) outputs."""
    return np.array([o.outputs.embedding if isinstance(o, EmbeddingRequestOutput)
                     else o.outputs.data for o in outs], np.float64)


def test_text_token_id_and_mixed_prompts(llm, qwen3):
    """embed/test_offline.py (test_str_prompts, test_token_ids_prompts, test_list_prompts) and
    scoring/test_bi_encoder_offline.py::test_embed: a string, its token ids and a list mixing
    both give the same prompt ids, an embedding of the hidden size, and one vector; it is the
    reference embedding of those ids."""
    _, base, _ = qwen3
    ids = llm.get_tokenizer().encode(PROMPT)
    outs = llm.embed(PROMPT)
    assert len(outs) == 1 and isinstance(outs[0], EmbeddingRequestOutput)
    assert outs[0].prompt_token_ids == ids and outs[0].finished
    assert len(outs[0].outputs.embedding) == outs[0].outputs.hidden_size == HIDDEN
    np.testing.assert_allclose(outs[0].outputs.embedding, reference(base, ids), atol=1e-5)
    by_ids = llm.embed([{"prompt_token_ids": ids}])
    assert len(by_ids) == 1 and by_ids[0].prompt_token_ids == ids
    np.testing.assert_allclose(vecs(by_ids), vecs(outs), atol=1e-6)
    mixed = llm.embed([PROMPT, {"prompt_token_ids": ids}])
    assert len(mixed) == 2 and all(o.prompt_token_ids == ids for o in mixed)
    np.testing.assert_allclose(vecs(mixed), np.repeat(vecs(outs), 2, axis=0), atol=1e-6)
    enc = llm.encode(PROMPT)  # encode: the same vector as a float32 array
    assert len(enc) == 1 and isinstance(enc[0], PoolingRequestOutput)
    assert enc[0].outputs.data.shape == (HIDDEN,) and enc[0].outputs.data.dtype == np.float32
    np.testing.assert_allclose(enc[0].outputs.data, outs[0].outputs.embedding, atol=1e-7)


def test_a_bare_token_id_list_is_a_prompt(llm):
    """embed/test_offline.py::test_token_ids_prompts / test_list_prompts pass token ids as a
    plain list: `llm.embed([ids])` and `llm.embed([text, ids])`."""
    ids = llm.get_tokenizer().encode(PROMPT)
    want = vecs(llm.embed(PROMPT))
    outs = llm.embed([ids])
    assert len(outs) == 1 and outs[0].prompt_token_ids == ids
    mixed = llm.embed([PROMPT, ids])
    np.testing.assert_allclose(vecs(mixed), np.repeat(want, 2, axis=0), atol=1e-6)
    one = llm.embed(ids)  # one prompt, as vLLM's prompt_to_seq reads a list of ints
    assert len(one) == 1 and one[0].prompt_token_ids == ids


def test_batched_prompts_equal_single_ones_and_the_reference(llm, qwen3):
    """embed/test_online.py::test_completion_request_batched (ten copies of one text),
    openai/test_embedding.py::test_batch_embedding: a batch's vectors are each prompt's alone,
    every copy the same, each the reference embedding."""
    _, base, _ = qwen3
    tok = llm.get_tokenizer()
    batch = [PROMPT] * 10 + TEXTS
    got = vecs(llm.embed(batch))
    assert got.shape == (13, HIDDEN)
    np.testing.assert_allclose(got[:10], np.repeat(got[:1], 10, axis=0), atol=1e-6)
    singles = np.concatenate([vecs(llm.embed(t)) for t in (PROMPT, *TEXTS)])
    np.testing.assert_allclose(got[9:], singles, atol=1e-6)
    for text, v in zip((PROMPT, *TEXTS), got[9:], strict=True):
        np.testing.assert_allclose(v, reference(base, tok.encode(text)), atol=1e-5)


def test_normalize_none_true_false(llm):
    """llm/test_embedding.py::test_pooling_params, embed/test_offline.py::test_pooling_params:
    the default normalizes; normalize=False does not; normalizing it gives the default."""
    def get(normalize):
        return vecs(llm.embed([PROMPT, *TEXTS], PoolingParams(normalize=normalize)))

    default, w_normal, wo_normal = get(None), get(True), get(False)
    np.testing.assert_allclose(default, w_normal, atol=1e-7)
    assert not np.allclose(w_normal, wo_normal, atol=1e-2)
    np.testing.assert_allclose(w_normal, wo_normal / np.linalg.norm(wo_normal, axis=1,
                                                                  keepdims=True), atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(default, axis=1), 1.0, atol=1e-6)


def test_the_pooler_configs_normalize(qwen3, llm):
    """models/language/pooling/test_override_pooler_config.py and
    test_pooler_config_init_behaviour.py::test_embed_models_using_normalize: an engine whose
    pooler_config says normalize false gives the raw vectors, whose normalization is the
    normalizing engine's; a request's normalize=True overrides the engine's false."""
    raw_llm = make_llm(qwen3[0], runner="pooling", pooler_config={"normalize": False}, **SIZING)
    wo = vecs(raw_llm.embed(TEXTS))
    w = vecs(llm.embed(TEXTS))
    assert not np.allclose(wo, w, atol=1e-2)
    np.testing.assert_allclose(wo / np.linalg.norm(wo, axis=1, keepdims=True), w, atol=1e-6)
    np.testing.assert_allclose(vecs(raw_llm.embed(TEXTS, PoolingParams(normalize=True))), w,
                               atol=1e-6)
    # LLM.score is a cosine whatever the engine's normalize (vLLM's bi-encoder score).
    s = raw_llm.score(TEXTS_1[0], TEXTS_2[0])[0].outputs.score
    assert s == pytest.approx(llm.score(TEXTS_1[0], TEXTS_2[0])[0].outputs.score, abs=1e-6)


def test_one_pooling_params_per_prompt_or_one_for_all(llm):
    """basic/test_encode.py::test_multiple_pooling_params: a list of params (one per prompt), a
    list of the wrong length (refused), one params object, and None."""
    prompts = [PROMPT, *TEXTS]
    params = [PoolingParams(), PoolingParams(), PoolingParams(), PoolingParams()]
    assert len(llm.encode(prompts, params)) == 4
    with pytest.raises(ValueError, match="one per prompt"):
        llm.encode(prompts, params[:3])
    assert len(llm.encode(prompts, PoolingParams())) == 4
    assert len(llm.encode(prompts, None)) == 4
    # Each prompt gets its own (a check of what the list means, beyond vLLM's lengths).
    mixed = llm.encode(prompts, [PoolingParams(dimensions=8), PoolingParams(),
                                 PoolingParams(normalize=False), PoolingParams(dimensions=3)])
    assert [len(o.outputs.data) for o in mixed] == [8, HIDDEN, HIDDEN, 3]
    assert not llm.llm_engine.has_unfinished_requests()


def test_truncate_prompt_tokens(llm, qwen3):
    """models/language/pooling/test_truncation_control.py (smaller, -1, bigger),
    openai/test_embedding.py::test_single_embedding_truncation: a prompt keeps k tokens and
    embeds as those tokens alone; -1 keeps as many as the context allows (jpaged: max_model_len
    - 1, docs/pooling.md; vLLM: max_model_len); k past max_model_len on a prompt that long is
    refused."""
    _, base, _ = qwen3
    ids = llm.get_tokenizer().encode(LONG)
    assert len(ids) > MAX_LEN
    out = llm.embed(LONG, truncate_prompt_tokens=10)[0]
    assert len(out.prompt_token_ids) == 10
    np.testing.assert_allclose(out.outputs.embedding, reference(base, out.prompt_token_ids),
                               atol=1e-5)
    same = llm.embed(LONG, PoolingParams(truncate_prompt_tokens=10))[0]  # the params' field
    assert same.prompt_token_ids == out.prompt_token_ids
    np.testing.assert_allclose(same.outputs.embedding, out.outputs.embedding, atol=1e-7)
    full = llm.embed([{"prompt_token_ids": ids}], truncate_prompt_tokens=-1)[0]
    assert len(full.prompt_token_ids) == MAX_LEN - 1  # vLLM: MAX_LEN
    short = llm.embed(SHORT, truncate_prompt_tokens=-1)[0]  # shorter than the context: whole
    assert short.prompt_token_ids == llm.get_tokenizer().encode(SHORT)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed(LONG, truncate_prompt_tokens=MAX_LEN + 1)
    with pytest.raises(ValueError, match="max_model_len"):  # no truncation: too long
        llm.embed(LONG)
    # A prompt of exactly max_model_len - 1 tokens runs; one more is refused (jpaged's rule).
    assert len(llm.embed([{"prompt_token_ids": ids[:MAX_LEN - 1]}])[0].prompt_token_ids) == 63
    with pytest.raises(ValueError, match="max_model_len - 1"):
        llm.embed([{"prompt_token_ids": ids[:MAX_LEN]}])
    assert not llm.llm_engine.has_unfinished_requests()


def test_truncation_past_the_context_is_refused_for_a_short_prompt(llm):
    """openai/test_embedding.py::test_single_embedding_truncation_invalid: truncate 8193 on a
    short text is a validation error."""
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.embed(SHORT, truncate_prompt_tokens=8193)


def test_truncation_keeps_the_start_of_the_prompt(llm):
    """basic/test_encode.py::test_right_side_truncation ("Embeddings models should truncate
    the end of the prompt"): with truncate_prompt_tokens k a pooling request keeps the first
    k tokens."""
    ids = llm.get_tokenizer().encode(LONG)
    assert llm.embed(LONG, truncate_prompt_tokens=10)[0].prompt_token_ids == ids[:10]
    assert llm.embed([{"prompt_token_ids": ids}], truncate_prompt_tokens=5
                     )[0].prompt_token_ids == ids[:5]


def test_dimensions_are_matryoshka_cuts(llm, qwen3):
    """test_pooling_params.py::test_embed_dimensions and
    ::test_embed_dimensions_matryoshka_without_list_upper_bound, openai/
    test_embedding_dimensions.py::test_matryoshka (vLLM's matryoshka_fy reference): None keeps
    every feature; d keeps the first d, normalized after the cut; past the hidden size, zero,
    negative and non-integers are refused naming the field. (jpaged cuts any model's vector;
    vLLM refuses dimensions for a model that is not Matryoshka.)"""
    _, base, _ = qwen3
    ids = llm.get_tokenizer().encode(PROMPT)
    assert len(llm.embed(PROMPT, PoolingParams(dimensions=None))[0].outputs.embedding) == HIDDEN
    for d in (1, 8, 32, HIDDEN):
        got = llm.embed([PROMPT] * 3, PoolingParams(dimensions=d))
        assert all(len(o.outputs.embedding) == d for o in got)
        np.testing.assert_allclose(vecs(got), np.repeat(
            reference(base, ids, dimensions=d)[None], 3, axis=0), atol=1e-5)
    raw = llm.embed(PROMPT, PoolingParams(dimensions=16, normalize=False))[0]
    np.testing.assert_allclose(raw.outputs.embedding,
                               reference(base, ids, normalize=False)[:16], atol=1e-5)
    for bad in (-1, 0, HIDDEN + 1, 1.5, True, "8"):
        with pytest.raises(ValueError, match=r"PoolingParams\.dimensions must be an integer in "
                           r"\[1, 64\]"):
            llm.embed(PROMPT, PoolingParams(dimensions=bad))
    assert not llm.llm_engine.has_unfinished_requests()


def test_pooling_params_validation(llm):
    """test_pooling_params.py::test_embed (normalize None / True / False accepted, and its
    newer name use_activation; other tasks' parameters refused) and the truncation bounds: a
    bad value is a ValueError naming the field, the engine goes on with the same vector."""
    want = vecs(llm.embed(PROMPT))
    for normalize in (None, True, False):
        PoolingParams(normalize=normalize).check(HIDDEN)
    for field in ("step_tag_id", "returned_token_ids", "task"):
        with pytest.raises(TypeError):
            PoolingParams(**{field: True})
    # vLLM's newest name for normalize (its embed task takes either).
    np.testing.assert_array_equal(vecs(llm.embed(PROMPT, PoolingParams(use_activation=False))),
                                  vecs(llm.embed(PROMPT, PoolingParams(normalize=False))))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or an integer"):
            llm.embed(PROMPT, PoolingParams(truncate_prompt_tokens=bad))
    with pytest.raises(ValueError, match="normalize must be a bool or None"):
        llm.embed(PROMPT, PoolingParams(normalize="yes"))
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.embed("")
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.embed([{"prompt_token_ids": []}])
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.embed([{"prompt_token_ids": [1, -1]}])
    assert not llm.llm_engine.has_unfinished_requests()
    np.testing.assert_array_equal(vecs(llm.embed(PROMPT)), want)


def test_score_one_to_one_one_to_n_n_to_n(llm, qwen3):
    """models/language/pooling/test_scoring.py (test_embedding_1_to_1, _1_to_N, _N_to_N),
    scoring/test_bi_encoder_offline.py: LLM.score of an embedding model is the cosine
    similarity of the reference embeddings (F.cosine_similarity), pair by pair, in order."""
    _, base, _ = qwen3
    tok = llm.get_tokenizer()

    def hf_score(a: str, b: str) -> float:
        return cosine(reference(base, tok.encode(a)), reference(base, tok.encode(b)))

    one = llm.score(TEXTS_1[0], TEXTS_2[0])
    assert len(one) == 1 and isinstance(one[0], ScoringRequestOutput)
    assert one[0].outputs.score == pytest.approx(hf_score(TEXTS_1[0], TEXTS_2[0]), abs=1e-5)
    one_n = [o.outputs.score for o in llm.score(TEXTS_1[0], TEXTS_2)]
    assert one_n == pytest.approx([hf_score(TEXTS_1[0], t) for t in TEXTS_2], abs=1e-5)
    n_n = [o.outputs.score for o in llm.score(TEXTS_1, TEXTS_2)]
    assert n_n == pytest.approx([hf_score(a, b) for a, b in zip(TEXTS_1, TEXTS_2, strict=True)],
                                abs=1e-5)
    # The same as the cosine of LLM.embed's vectors, normalized or not.
    a, b = vecs(llm.embed(TEXTS_1, PoolingParams(normalize=False))), vecs(llm.embed(TEXTS_2))
    assert n_n == pytest.approx([cosine(x, y) for x, y in zip(a, b, strict=True)], abs=1e-6)
    assert one[0].prompt_token_ids == tok.encode(TEXTS_1[0]) + tok.encode(TEXTS_2[0])
    # Lengths vLLM refuses: N to M, N to 1, and nothing on either side.
    for data_1, data_2 in ((TEXTS_1, TEXTS_2 + TEXTS), (TEXTS_1, TEXTS_2[0]), (TEXTS_1, []),
                           ([], TEXTS_2)):
        with pytest.raises(ValueError, match="same length"):
            llm.score(data_1, data_2)
    assert not llm.llm_engine.has_unfinished_requests()


def test_score_too_long_and_truncated(llm, qwen3):
    """scoring/test_bi_encoder_online.py::test_score_api_max_model_len (offline): a query longer
    than the context is refused, also with truncate_prompt_tokens past max_model_len; a
    truncation that fits scores the truncated texts."""
    _, base, _ = qwen3
    query = "What is the capital of France?" * 20
    with pytest.raises(ValueError, match="max_model_len"):
        llm.score(query, TEXTS_2)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.score(query, TEXTS_2, truncate_prompt_tokens=MAX_LEN + 1)
    got = [o.outputs.score for o in llm.score(query, TEXTS_2, truncate_prompt_tokens=20)]
    # The tokens each text keeps (its first 20, truncated on the right), as LLM.embed keeps them.
    kept = [o.prompt_token_ids for o in llm.embed([query, *TEXTS_2], truncate_prompt_tokens=20)]
    assert all(len(k) == 20 for k in kept)
    want = [cosine(reference(base, kept[0]), reference(base, k)) for k in kept[1:]]
    assert got == pytest.approx(want, abs=1e-5)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_chunked_prefill_and_prefix_caching_match_hf(qwen3, kind):
    """models/language/pooling/test_all_pooling_plus_chunked_prefill.py (prompts of 55, 56, 57
    consecutive ids, chunks of 10, prefix caching on: equal to AutoModel's hidden states) and
    test_auto_prefix_cache_support.py::test_embed_models (a second run reads the cache: every
    output's num_cached_tokens > 0, vectors unchanged). MEAN and CLS need every position's
    hidden state, so jpaged's requests skip the lookup: their second run has no cached tokens
    (vLLM turns prefix caching off for such poolers)."""
    loaded, base, _ = qwen3
    llm = make_llm(loaded, runner="pooling", pooler_config={"pooling_type": kind},
                   enable_prefix_caching=True, block_size=BLOCK, max_model_len=MAX_LEN,
                   max_num_seqs=4, max_num_batched_tokens=10, num_gpu_blocks_override=128)
    prompts = [{"prompt_token_ids": [20 + i for i in range(n)]} for n in (55, 56, 57)]
    first = llm.encode(prompts)
    for p, o in zip(prompts, first, strict=True):
        np.testing.assert_allclose(o.outputs.data, reference(base, p["prompt_token_ids"], kind),
                                   atol=1e-5)
    second = llm.encode(prompts)
    if kind == "LAST":
        assert all(o.num_cached_tokens > 0 for o in second)
    else:
        assert all(o.num_cached_tokens == 0 for o in second)
    np.testing.assert_allclose(vecs(second), vecs(first), atol=1e-6)


def test_the_embedded_model_on_real_text(tmp_path):
    """embed/test_offline.py (prompt ids are the tokenizer's, the embedding the model's size),
    openai/test_embedding.py::test_single_embedding / test_batch_embedding and
    models/language/pooling/test_embedding.py (vectors against the sentence-transformers
    model: here mean pooling and Normalize over HF's LlamaModel holding the same weights), and
    test_truncation_control.py on real text (10 tokens; -1: max_model_len - 1)."""
    from transformers import AutoTokenizer

    loaded = embedded()
    twin = hf_llama_twin(loaded, tmp_path)
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path))
    base = twin.model.eval()
    llm = make_llm(loaded, runner="pooling", pooler_config={"pooling_type": "MEAN"},
                   max_model_len=128, max_num_batched_tokens=64)
    size = loaded.spec.hidden_size
    outs = llm.embed([PROMPT, *TEXTS])
    for text, o in zip([PROMPT, *TEXTS], outs, strict=True):
        assert o.prompt_token_ids == hf_tok(text).input_ids
        assert len(o.outputs.embedding) == size
        np.testing.assert_allclose(o.outputs.embedding,
                                   reference(base, o.prompt_token_ids, "MEAN"), atol=1e-5)
    np.testing.assert_allclose(vecs(llm.embed(TEXTS[1])), vecs(outs[2:3]), atol=1e-6)
    cut = llm.embed(LONG, truncate_prompt_tokens=10)[0]
    assert len(cut.prompt_token_ids) == 10
    np.testing.assert_allclose(cut.outputs.embedding,
                               reference(base, cut.prompt_token_ids, "MEAN"), atol=1e-5)
    assert len(llm.embed(LONG, truncate_prompt_tokens=-1)[0].prompt_token_ids) == 127
    # LLM.score on real text: the cosine of the reference embeddings.
    s = [o.outputs.score for o in llm.score(TEXTS[0], [TEXTS[1], TEXTS[2]])]
    assert s == pytest.approx([cosine(reference(base, outs[1].prompt_token_ids, "MEAN"),
                                      reference(base, outs[i].prompt_token_ids, "MEAN"))
                               for i in (2, 3)], abs=1e-5)


def test_a_sentence_transformers_dense_projection_is_run_or_refused(qwen3, tmp_path):
    """models/language/pooling/test_st_projector.py (test_compare_with_hf_dimensions,
    test_embedding_numerical_similarity): a sentence-transformers checkpoint whose modules
    project the pooled vector (Dense, 64 -> 32 features) embeds to the projection's size and
    values. jpaged may instead refuse such a checkpoint naming the module; it must not answer
    the unprojected vector (with or without a pooler_config)."""
    from safetensors.numpy import save_file

    _, base, path = qwen3
    st = tmp_path / "st"
    shutil.copytree(path, st)
    mods = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense"),
            ("Normalize", "3_Normalize")]
    (st / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": where, "type": f"sentence_transformers.models.{k}"}
        for i, (k, where) in enumerate(mods)]))
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": HIDDEN, "pooling_mode_mean_tokens": True}))
    (st / "2_Dense").mkdir()
    (st / "2_Dense" / "config.json").write_text(json.dumps(
        {"in_features": HIDDEN, "out_features": 32, "bias": True,
         "activation_function": "torch.nn.modules.linear.Identity"}))
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.2, (32, HIDDEN)).astype(np.float32)
    b = rng.normal(0, 0.2, 32).astype(np.float32)
    save_file({"linear.weight": w, "linear.bias": b}, str(st / "2_Dense" / "model.safetensors"))
    ids = [5, 17, 99, 3, 42, 7, 250, 1, 64]
    want = unit(w.astype(np.float64) @ hidden(base, ids).mean(0) + b)
    for extra in ({}, {"pooler_config": {"pooling_type": "MEAN"}}):
        try:
            llm = LLM(model=str(st), dtype="float32", runner="pooling", **extra, **SIZING)
        except ValueError as e:
            assert "Dense" in str(e)
            continue
        got = llm.encode([{"prompt_token_ids": ids}])[0].outputs.data
        assert got.shape == (32,)
        np.testing.assert_allclose(got, want, atol=1e-5)
