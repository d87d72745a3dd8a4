"""Beam search (`LLM.beam_search`, jpaged/beam_search.py): the bookkeeping on hand-made step
outputs; width 1 is greedy decoding on the tiny model; on the embedded model every beam equals
HF transformers' `generate(num_beams=...)` token for token, and an EOS ends a beam as "stop"."""

from __future__ import annotations

import math

import pytest
from helpers import embedded, hf_llama_twin, make_llm, tiny

from jpaged import BeamSearchParams, SamplingParams
from jpaged.beam_search import BeamSearch, get_beam_search_score
from jpaged.outputs import CompletionOutput, Logprob, RequestOutput

EOS = 2


def _out(prompt: list[int], cands: dict[int, float]) -> RequestOutput:
    """A one-token request's output whose logprobs hold `cands`."""
    lps = {t: Logprob(lp, rank=i + 1) for i, (t, lp) in enumerate(cands.items())}
    token = next(iter(cands))
    return RequestOutput("r", None, prompt, [CompletionOutput(
        0, "", [token], lps[token].logprob, [lps], "length")], True)


def test_bookkeeping_keeps_the_best_and_ends_beams_at_eos():
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    s = BeamSearch(1, params, eos_token_ids=[EOS], max_model_len=100)
    assert s.requests() is None and not s.done  # step 0 runs the prompt as given
    assert s.step_params.logprobs == 4 and s.step_params.max_tokens == 1
    s.advance([_out([7, 8], {10: -0.1, EOS: -0.5, 11: -1.0, 12: -3.0})])
    inst = s.instances[0]
    assert [b.tokens for b in inst.beams] == [[7, 8, 10], [7, 8, 11]]
    assert [(b.tokens, b.finish_reason) for b in inst.completed] == [([7, 8, EOS], "stop")]
    assert s.requests() == [{"prompt_token_ids": [7, 8, 10]}, {"prompt_token_ids": [7, 8, 11]}]
    s.advance([_out([7, 8, 10], {20: -2.0, 21: -2.5}), _out([7, 8, 11], {22: -0.2})])
    assert [b.tokens[-1] for b in inst.beams] == [22, 20]  # -1.2 beats -2.1
    assert math.isclose(inst.beams[0].cum_logprob, -1.2)
    assert len(inst.beams[0].logprobs) == 2 and inst.beams[0].output_token_ids == [11, 22]
    s.advance([_out(b.tokens, {30: -0.1}) for b in inst.beams])
    assert s.done
    best = s.results()[0].sequences
    # The EOS beam (-0.5 over 3 tokens, its EOS not counted: -0.25) is best.
    assert [b.tokens for b in best] == [[7, 8, EOS], [7, 8, 11, 22, 30]]
    assert [b.finish_reason for b in best] == ["stop", "length"]


def test_score_length_penalty_and_model_length():
    assert get_beam_search_score([1, 2, 3, EOS], -3.0, EOS) == -1.0
    assert get_beam_search_score([1, 2, 3, 4], -4.0, {EOS}, length_penalty=2.0) == -0.25
    s = BeamSearch(1, BeamSearchParams(beam_width=1, max_tokens=10), [EOS], max_model_len=3)
    s.advance([_out([5, 6], {9: -1.0})])  # 3 tokens: the model's length, no room for more
    assert s.done and s.results()[0].sequences[0].finish_reason == "length"
    s = BeamSearch(1, BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True), [EOS], 99)
    s.advance([_out([5], {EOS: -0.1})])
    assert [b.tokens for b in s.instances[0].beams] == [[5, EOS]]  # ignore_eos: it goes on


@pytest.mark.parametrize("kwargs,match", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=True), "max_tokens must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature must be >= 0"),
    (dict(beam_width=2, max_tokens=4, length_penalty=math.nan), "length_penalty must be a"),
    (dict(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos must be True or False"),
])
def test_bad_params_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


@pytest.fixture(scope="module")
def tiny_llm():
    return make_llm(tiny(), max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                    block_size=8, num_gpu_blocks_override=40)


def test_width_one_is_greedy_decoding(tiny_llm):
    prompts = ["Hello there", "abc"]
    beams = tiny_llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=6,
                                                           ignore_eos=True))
    greedy = tiny_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                       ignore_eos=True))
    for b, g in zip(beams, greedy, strict=True):
        (seq,) = b.sequences
        assert seq.tokens == g.prompt_token_ids + g.outputs[0].token_ids
        assert seq.num_prompt_tokens == len(g.prompt_token_ids)
        assert seq.text == tiny_llm.get_tokenizer().decode(seq.tokens, skip_special_tokens=False)
    m = tiny_llm.get_metrics()
    assert m["num_blocks_free"] == m["num_blocks_total"]  # every step's requests freed


def test_a_pool_too_small_for_every_beam_gives_the_same_beams(tiny_llm):
    """16 beams of up to ~40 tokens in 13 usable blocks of 8: the beams' requests wait their
    turn and the cached blocks they share are evicted and recomputed; the beams are those of
    the roomier pool."""
    prompts = ["Hello there, how are you doing today my friend", "abc",
               "The quick brown fox jumps over", "zzz top"]
    params = BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True)
    small = make_llm(tiny(), max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                     block_size=8, num_gpu_blocks_override=14)
    got = small.beam_search(prompts, params)
    want = tiny_llm.beam_search(prompts, params)
    assert [[s.tokens for s in o.sequences] for o in got] == [
        [s.tokens for s in o.sequences] for o in want]
    m = small.get_metrics()
    assert m["num_evictions"] > 0 and m["num_blocks_free"] == m["num_blocks_total"]


def test_a_width_beyond_max_logprobs_is_refused_and_the_engine_goes_on(tiny_llm):
    with pytest.raises(ValueError, match=r"beam_width 11 asks for 22 candidates .* "
                                         r"max_logprobs \(20\)"):
        tiny_llm.beam_search("abc", BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="prompts must be"):
        tiny_llm.beam_search(5, BeamSearchParams(beam_width=2, max_tokens=2))
    assert len(tiny_llm.beam_search("abc", BeamSearchParams(beam_width=2, max_tokens=2))[0]
               .sequences) == 2


@pytest.fixture(scope="module")
def embedded_llm():
    return make_llm(embedded(), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128)


def test_every_beam_equals_hf_beam_search(embedded_llm, tmp_path):
    """HF's generate(num_beams=4, num_return_sequences=4) on the same float32 weights: the same
    four sequences in the same order, and HF's scores (cumulative logprob over the generated
    length) from ours. ignore_eos (HF: no eos_token_id), so no beam ends early."""
    import torch

    hf = hf_llama_twin(embedded_llm.llm_engine.loaded, tmp_path)
    tok = embedded_llm.get_tokenizer()
    prompts = ["Once upon a time", "def fibonacci(n):"]
    width, steps = 4, 10
    outs = embedded_llm.beam_search(prompts, BeamSearchParams(beam_width=width,
                                                              max_tokens=steps, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok.encode(prompt)
        with torch.no_grad():
            g = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                           dtype=torch.long),
                            max_new_tokens=steps, num_beams=width, num_return_sequences=width,
                            do_sample=False, early_stopping=False, length_penalty=1.0,
                            eos_token_id=None, pad_token_id=0, output_scores=True,
                            return_dict_in_generate=True)
        assert [s.tokens for s in out.sequences] == g.sequences.tolist(), prompt
        assert [s.finish_reason for s in out.sequences] == ["length"] * width
        for s, score in zip(out.sequences, g.sequences_scores.tolist(), strict=True):
            assert math.isclose(s.cum_logprob / steps, score, abs_tol=2e-4)
            # The cumulative logprob is the sum of the chosen tokens' logprobs.
            chosen = sum(lps[t].logprob for lps, t in zip(s.logprobs, s.output_token_ids,
                                                          strict=True))
            assert math.isclose(s.cum_logprob, chosen, abs_tol=1e-6)


def test_an_eos_ends_the_best_beam_and_the_prefix_cache_serves_the_beams(embedded_llm):
    """An 18-token prompt: its first block (16 tokens) is computed once, then found in the
    prefix cache by every later step's beams."""
    before = embedded_llm.get_metrics()["prefix_cache_hits"]
    prompt = ("Here is a short geography fact that every school child learns early: the capital "
              "of France is")
    (out,) = embedded_llm.beam_search([{"prompt": prompt}],
                                      BeamSearchParams(beam_width=3, max_tokens=8))
    best = out.sequences[0]
    assert best.finish_reason == "stop"
    assert best.tokens[-1] in embedded_llm.llm_engine.eos_token_ids
    assert best.text.startswith(prompt + " Paris")
    assert len({tuple(s.tokens) for s in out.sequences}) == 3
    # 7 steps after the first, each beam's 16 cached tokens.
    assert embedded_llm.get_metrics()["prefix_cache_hits"] - before >= 7 * 16


def test_bench_script_reports_beam_search_beside_greedy(tmp_path, monkeypatch):
    """scripts/bench_beam_search.py on the tiny model: every field, from real runs."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    from helpers import tiny_model_dir

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_beam_search.py"
    spec = importlib.util.spec_from_file_location("bench_beam_search_script", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "beam.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_beam_search.py", "--model", str(tiny_model_dir()), "--width", "2", "--prompts",
        "2", "--tokens", "3", "--repeats", "2", "--out", str(out)])
    mod.main()
    doc = json.loads(out.read_text())
    assert (doc["width"], doc["prompts"], doc["tokens"], len(doc["runs"])) == (2, 2, 3, 2)
    assert all(r["greedy_s"] > 0 and r["beam_s"] > 0 and 0 < r["prefix_hit_rate"] <= 1
               for r in doc["runs"])
    assert doc["median"]["ratio"] > 0 and "machine" in doc
