"""The engine end to end on a tiny random Llama: API shapes, stops, n > 1, seeds, logprobs,
aborts, priorities, compile counts, the naive baseline, and clear errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_llm, tiny

from jpaged import LLM, SamplingParams
from jpaged.config import EngineArgs
from jpaged.detokenizer import TextBuffer
from jpaged.engine import LLMEngine
from jpaged.naive import NaiveEngine
from jpaged.sampling_params import RequestOutputKind

VOCAB = 300


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm(tiny(), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                    num_gpu_blocks_override=128, block_size=8)


def _prompts(rng, n, lo=3, hi=60):
    return [rng.integers(0, 256, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _free(llm):
    m = llm.get_metrics()
    return m["kv_cache_usage"] == 0.0 and m["num_blocks_free"] == m["num_blocks_total"]


def test_outputs_in_input_order_with_shapes(llm):
    outs = llm.generate(["hello", {"prompt": "abc"}, {"prompt_token_ids": [5, 6, 7]}],
                        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [o.prompt for o in outs] == ["hello", "abc", None]
    assert outs[2].prompt_token_ids == [5, 6, 7]
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.index == 0 and len(c.token_ids) == 5
        assert c.finish_reason == "length" and isinstance(c.text, str)
    assert _free(llm)


def test_greedy_is_deterministic_and_batch_independent(llm):
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": p} for p in _prompts(rng, 6)]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    alone = [llm.generate(q, p)[0].outputs[0].token_ids for q in prompts]
    assert together == alone


def test_seeded_sampling_reproducible_and_n_children_differ(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=7, n=3,
                       ignore_eos=True)
    a = llm.generate({"prompt_token_ids": [1, 2, 3]}, p)[0]
    b = llm.generate({"prompt_token_ids": [1, 2, 3]}, p)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3
    assert _free(llm)


def test_stop_token_ids_stop_strings_and_min_tokens(llm):
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = llm.generate({"prompt_token_ids": [9, 8, 7]}, base)[0].outputs[0]
    stop_tok = ref.token_ids[4]
    first = ref.token_ids.index(stop_tok)
    out = llm.generate({"prompt_token_ids": [9, 8, 7]},
                       base.clone(stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == ref.token_ids[: first + 1]
    out = llm.generate({"prompt_token_ids": [9, 8, 7]},
                       base.clone(stop_token_ids=[stop_tok], min_tokens=first + 2))[0].outputs[0]
    assert len(out.token_ids) > first + 1
    # A stop string cut from the reference text ends the request and is not in the output.
    text = ref.text
    needle = next((text[i:i + 2] for i in range(3, len(text) - 2)
                   if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2]), None)
    if needle is not None:
        out = llm.generate({"prompt_token_ids": [9, 8, 7]}, base.clone(stop=[needle]))[0]
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == needle
        assert c.text == text[: text.index(needle)]
    assert _free(llm)


def test_min_tokens_bans_stop_tokens_and_stop_strings_until_reached(llm):
    """As vLLM: before min_tokens outputs a stop token is never sampled (its logit is -inf,
    so the request does not emit and run past it) and no stop string ends the request; the
    token that stops a request is in its token ids but not its text, unless
    include_stop_str_in_output."""
    prompt = {"prompt_token_ids": [9, 8, 7]}
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = llm.generate(prompt, base)[0].outputs[0]
    hot = next(t for t in range(VOCAB) if t not in ref.token_ids[:8])
    # A bias of 100 makes `hot` the greedy choice at every step it is allowed.
    p = base.clone(stop_token_ids=[hot], min_tokens=5, logit_bias={hot: 100.0})
    c = llm.generate(prompt, p)[0].outputs[0]
    assert c.token_ids == ref.token_ids[:5] + [hot]  # banned for 5 tokens, then it stops
    assert (c.finish_reason, c.stop_reason) == ("stop", hot)
    shown = llm.get_tokenizer().decode([hot])
    assert shown and not c.text.endswith(shown)
    c2 = llm.generate(prompt, p.clone(include_stop_str_in_output=True))[0].outputs[0]
    assert c2.token_ids == c.token_ids and c2.text == c.text + shown
    # A stop string met only in the first tokens' text is passed over before min_tokens.
    text = ref.text
    needle = next((ch for ch in text if text.count(ch) == 1 and ch.strip() and ch != "\ufffd"),
                  None)
    assert needle is not None, text
    c = llm.generate(prompt, base.clone(stop=[needle]))[0].outputs[0]
    assert c.finish_reason == "stop" and len(c.token_ids) < 12
    late = base.clone(stop=[needle], min_tokens=len(c.token_ids) + 2)
    c = llm.generate(prompt, late)[0].outputs[0]
    assert (c.finish_reason, c.text) == ("length", text)
    assert _free(llm)


@pytest.mark.parametrize("small", [TextBuffer.SMALL, 5], ids=["str", "stringio"])
def test_stop_strings_that_straddle_steps_end_exactly_there(llm, small, monkeypatch):
    """The stop search looks at the new tail only (plus the longest stop string less one
    char); a stop string spread over several tokens must still be found where it starts.
    Run with texts kept as a str and moved into the StringIO early (TextBuffer.SMALL)."""
    monkeypatch.setattr(TextBuffer, "SMALL", small)
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = llm.generate({"prompt_token_ids": [3, 1, 4]}, base)[0].outputs[0]
    text = ref.text
    cases = [(start, text[start:start + length]) for start in range(2, len(text) - 7)
             for length in (3, 7)]
    cases = [(k, n) for k, n in cases
             if "\ufffd" not in n and n.strip() and text.index(n) == k]
    assert len(cases) >= 4, text
    for start, needle in cases[:: max(1, len(cases) // 6)]:
        for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE):
            c = llm.generate({"prompt_token_ids": [3, 1, 4]},
                             base.clone(stop=["never there", needle],
                                        output_kind=kind))[0].outputs[0]
            assert (c.finish_reason, c.stop_reason, c.text) == ("stop", needle,
                                                                text[:start]), kind
    assert _free(llm)


@pytest.mark.parametrize("small", [TextBuffer.SMALL, 5], ids=["str", "stringio"])
def test_streamed_text_never_shows_a_stop_string_start_that_is_cut(llm, small, monkeypatch):
    """While a stop string may still complete, its first characters are held back: every
    cumulative text is a prefix of the final one and the deltas add up to it exactly."""
    monkeypatch.setattr(TextBuffer, "SMALL", small)
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = llm.generate({"prompt_token_ids": [3, 1, 4]}, base)[0].outputs[0]
    text = ref.text
    starts = [k for k in range(3, len(text) - 8) if "\ufffd" not in text[k:k + 3]
              and text[k:k + 3].strip() and text.index(text[k:k + 3]) == k]
    assert starts, text
    engine = llm.llm_engine
    for k in starts[:: max(1, len(starts) // 4)]:
        needle = text[k:k + 3]
        shown = {}
        for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
            engine.add_request(f"hold-{k}-{kind.name}", {"prompt_token_ids": [3, 1, 4]},
                               base.clone(stop=[needle], output_kind=kind))
            shown[kind] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                shown[RequestOutputKind[out.request_id.split("-")[2]]].append(
                    out.outputs[0].text)
        engine.step()
        assert "".join(shown[RequestOutputKind.DELTA]) == text[:k]
        assert all(text[:k].startswith(t) for t in shown[RequestOutputKind.CUMULATIVE])
        assert shown[RequestOutputKind.CUMULATIVE][-1] == text[:k]
    assert _free(llm)


def test_logprobs_top_n(llm):
    p = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    c = llm.generate({"prompt_token_ids": [4, 5]}, p)[0].outputs[0]
    assert len(c.logprobs) == 4
    for tok, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the top candidate
        assert 3 <= len(entry) <= 4 and all(lp.logprob <= 0 for lp in entry.values())
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                     zip(c.token_ids, c.logprobs, strict=True)))
    # As vLLM's: no logprobs asked, no cumulative logprob either (None, not a sum).
    assert llm.generate({"prompt_token_ids": [4, 5]}, p.clone(logprobs=None))[0].outputs[
        0].cumulative_logprob is None
    # logprobs=0 still ranks the sampled token; so does logprobs=1 for a hot draw below the
    # top candidate (the rank counts the whole vocabulary, as vLLM's).
    c = llm.generate({"prompt_token_ids": [4, 5]}, p.clone(logprobs=0))[0].outputs[0]
    assert all(list(e) == [t] and e[t].rank == 1 for t, e in zip(c.token_ids, c.logprobs,
                                                                 strict=True))
    hot = SamplingParams(temperature=5.0, max_tokens=12, logprobs=1, seed=3, ignore_eos=True)
    c = llm.generate({"prompt_token_ids": [4, 5]}, hot)[0].outputs[0]
    ranks = [e[t].rank for t, e in zip(c.token_ids, c.logprobs, strict=True)]
    assert all(isinstance(r, int) and 1 <= r <= VOCAB for r in ranks) and max(ranks) > 1
    for t, e in zip(c.token_ids, c.logprobs, strict=True):  # the top candidate outranks it
        top = next(x for x in e.values() if x.rank == 1)
        assert e[t].rank == 1 or top.logprob >= e[t].logprob


def test_truncation_side_and_max_logprobs(llm):
    """truncate_prompt_tokens keeps the prompt's last tokens, or with truncation_side "right"
    its first ones (vLLM's); logprobs over the engine's max_logprobs (20 by default) are
    refused by name, and max_logprobs=-1 lets -1 return the whole vocabulary."""
    ids = list(range(10, 30))
    for side, want in (("left", ids[-5:]), ("right", ids[:5])):
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(
            max_tokens=1, truncate_prompt_tokens=5, truncation_side=side))[0]
        assert out.prompt_token_ids == want, side
    for params in (SamplingParams(max_tokens=1, logprobs=21),
                   SamplingParams(max_tokens=1, logprobs=-1),
                   SamplingParams(max_tokens=1, prompt_logprobs=-1)):
        with pytest.raises(ValueError, match="max_logprobs"):
            llm.generate({"prompt_token_ids": [4, 5]}, params)
    assert _free(llm)
    whole = make_llm(tiny(), max_model_len=64, max_num_seqs=2, num_gpu_blocks_override=32,
                     block_size=8, max_logprobs=-1)
    out = whole.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(
        temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1, ignore_eos=True))[0]
    assert [len(e) for e in out.outputs[0].logprobs] == [VOCAB, VOCAB]
    assert [len(e) for e in out.prompt_logprobs[1:]] == [VOCAB, VOCAB]
    entry = out.outputs[0].logprobs[0]
    assert sorted(lp.rank for lp in entry.values()) == list(range(1, VOCAB + 1))


def test_abort_frees_blocks_and_engine_keeps_serving(llm):
    eng = llm.llm_engine
    p = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    eng.add_request("a", {"prompt_token_ids": list(range(40))}, p)
    eng.add_request("b", {"prompt_token_ids": list(range(30))}, p)
    for _ in range(3):
        eng.step()
    assert llm.get_metrics()["kv_cache_usage"] > 0
    eng.abort_request("a")
    done = []
    while eng.has_unfinished_requests():
        done += [o.request_id for o in eng.step() if o.finished]
    assert done == ["b"] and _free(llm)
    assert eng.get_metrics()["num_requests_aborted"] >= 1


def test_request_histograms_are_observed_when_a_request_finishes(llm):
    """vLLM's request_params_n and request_max_num_generation_tokens, one per user request,
    and request_params_max_tokens, one per sequence, observed when it finishes (they were
    observed when it was added); an aborted request is not observed (as vLLM)."""
    from prometheus_client.parser import text_string_to_metric_families

    from jpaged.metrics import build_registry, render

    eng = llm.llm_engine
    sl = eng.stat_logger
    names = ("request_params_n", "request_params_max_tokens",
             "request_max_num_generation_tokens")

    def counts() -> dict[str, tuple[float, float]]:
        body, _ = render(build_registry(dict, sl))
        out = {}
        for fam in text_string_to_metric_families(body.decode()):
            if fam.name.removeprefix("jpaged:") in names:
                smp = {s.name.rsplit("_", 1)[-1]: s.value for s in fam.samples
                       if not s.name.endswith("_bucket")}
                out[fam.name.removeprefix("jpaged:")] = (smp["count"], smp["sum"])
        return out

    before = counts()
    eng.add_request("n3", {"prompt_token_ids": [5, 6, 7]},
                    SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True))
    eng.add_request("cut", {"prompt_token_ids": [8, 9]},
                    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert counts() == before  # nothing at add
    for _ in range(3):
        eng.step()
    eng.abort_request("cut")
    while eng.has_unfinished_requests():
        eng.step()
    after = counts()
    delta = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in names}
    assert delta["request_params_n"] == (1, 3)
    assert delta["request_params_max_tokens"] == (3, 3 * 6)
    assert delta["request_max_num_generation_tokens"] == (1, 6)


def test_priorities_accepted_and_all_finish(llm):
    outs = llm.generate([{"prompt_token_ids": [i + 1] * 5} for i in range(4)],
                        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                        priority=[3, 0, 2, 1])
    assert all(o.finished for o in outs) and _free(llm)
    # As vLLM's LLM.generate: one integer for every prompt, and a single prompt's list.
    prompts = ["abc", "de"]
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert len(llm.generate(prompts, p, priority=1)) == 2
    assert len(llm.generate(prompts[0], p, priority=[0])) == 1
    for bad in ([0], [], [0, 1, 2]):
        with pytest.raises(ValueError, match="priority must have one entry per prompt"):
            llm.generate(prompts, p, priority=bad)
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.generate(prompts, p, priority=["high", "low"])
    assert _free(llm)


def test_no_compilation_after_warmup():
    llm = make_llm(tiny(), max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64,
                   num_gpu_blocks_override=80, block_size=8)
    runner = llm.llm_engine.runner
    warm = runner.warmup()
    assert warm == len(runner.plan.all_shapes())
    rng = np.random.default_rng(3)
    eng = llm.llm_engine
    for i in range(40):  # random arrivals, lengths, sampling; a pool small enough to preempt
        p = SamplingParams(temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.choice(
            [-1, 5])), max_tokens=int(rng.integers(1, 30)), seed=i, ignore_eos=True)
        eng.add_request(f"w{i}", {"prompt_token_ids": _prompts(rng, 1, 2, 120)[0]}, p,
                        priority=int(rng.integers(0, 3)))
        for _ in range(int(rng.integers(0, 3))):
            eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    assert runner.num_compiled == warm
    assert _free(llm)


def test_naive_baseline_matches_paged(llm):
    rng = np.random.default_rng(5)
    prompts = _prompts(rng, 5)
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    paged = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": q} for q in prompts], p)]
    naive = NaiveEngine(tiny(), max_model_len=256, kv_cache_memory_bytes=3 * 256 * 2 * 2 * 2 * 16
                        * 4)
    assert naive.rows == 3
    assert naive.generate(prompts, p) == paged
    assert 0 < naive.stats.waste < 1 and naive.stats.max_concurrency == 3
    one_row = NaiveEngine(tiny(), max_model_len=256, kv_cache_memory_bytes=10**6, max_rows=1)
    assert one_row.rows == 1 and one_row.generate(prompts[:2], p) == paged[:2]


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm):
    """vLLM's detokenize=False: token ids only; text stays empty and logprob entries (sampled
    and prompt) have no decoded_token, streamed or not; n > 1 and seeds as with text."""
    kw = dict(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, n=2, logprobs=2,
              prompt_logprobs=2)
    prompts = ["The paged KV cache", "abc"]
    with_text = llm.generate(prompts, SamplingParams(**kw))
    bare = llm.generate(prompts, SamplingParams(detokenize=False, **kw))
    for a, b in zip(with_text, bare, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert all(c.text for c in a.outputs) and all(c.text == "" for c in b.outputs)
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert [{t: lp.logprob for t, lp in e.items()} for e in ca.logprobs] == [
                {t: lp.logprob for t, lp in e.items()} for e in cb.logprobs]
            assert all(lp.decoded_token is None for e in cb.logprobs for lp in e.values())
            assert all(lp.decoded_token is not None for e in ca.logprobs for lp in e.values())
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs) > 1
        assert all(lp.decoded_token is None for e in b.prompt_logprobs[1:] for lp in e.values())
    engine = llm.llm_engine
    engine.add_request("bare-stream", prompts[0], SamplingParams(
        detokenize=False, max_tokens=6, ignore_eos=True, temperature=0,
        output_kind=RequestOutputKind.DELTA))
    ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.outputs[0].text == ""
            ids += out.outputs[0].token_ids
    greedy = llm.generate(prompts[0], SamplingParams(max_tokens=6, ignore_eos=True,
                                                     temperature=0))[0].outputs[0]
    assert ids == greedy.token_ids and greedy.text


@pytest.mark.parametrize("prompt,msg", [
    ("", "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, VOCAB]}, "vocabulary"),
    ({"prompt_token_ids": [-1]}, "vocabulary"),
    ({"prompt_token_ids": [1] * 256}, "max_model_len"),
    ({"text": "x"}, "prompt_token_ids"),
    (42, "str or a dict"),
])
def test_bad_prompts_raise_and_engine_keeps_serving(llm, prompt, msg):
    with pytest.raises(ValueError, match=msg):
        llm.generate([{"prompt_token_ids": [1, 2]}, prompt], SamplingParams(max_tokens=2))
    assert _free(llm) and not llm.llm_engine.has_unfinished_requests()
    assert llm.generate("ok", SamplingParams(max_tokens=2))[0].finished


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"), (dict(logprobs=-2), "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"), (dict(truncation_side="middle"),
                                                    "truncation_side"),
    (dict(temperature=float("inf")), "temperature"), (dict(stop_token_ids=[True]),
                                                       "stop_token_ids"),
    # vLLM V1 refuses these two too (ValueError, not a TypeError for an unknown keyword).
    (dict(n=2, best_of=3), "best_of"), (dict(logits_processors=[lambda ids, x: x]),
                                        "logits_processors"),
    (dict(detokenize=False, stop=["x"]), "stop"), (dict(detokenize=1), "detokenize"),
    # An infinite penalty made a seen token with logit 0 a nan (0 * inf).
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_vllm_temperature_floor_and_seed_minus_one(llm):
    """As vLLM's SamplingParams: a temperature in (0, 0.01) is raised to 0.01 (0 stays
    greedy), and seed=-1 means no seed (two runs draw differently)."""
    assert SamplingParams(temperature=0.005).temperature == 0.01
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(seed=-1).seed is None
    p = SamplingParams(temperature=1.5, seed=-1, max_tokens=12, ignore_eos=True)
    runs = {tuple(llm.generate("abc", p)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(runs) > 1


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_size=12), "block_size"), (dict(gpu_memory_utilization=0.0),
                                          "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(kv_cache_dtype="int3"), "kv_cache_dtype"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(preemption_mode="drop"), "preemption_mode"), (dict(max_model_len=100000),
                                                        "max_model_len"),
    (dict(max_logprobs=-2), "max_logprobs"), (dict(logprobs_mode="raw"), "logprobs_mode"),
    # vLLM's other modes: refused by name, as jpaged's logprobs are raw_logprobs only.
    (dict(logprobs_mode="processed_logprobs"), "logprobs_mode"),
    (dict(logprobs_mode="raw_logits"), "logprobs_mode"),
])
def test_bad_engine_args(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLMEngine(EngineArgs(**kwargs), loaded=tiny())


def test_vllm_enforce_eager_and_trust_remote_code_are_taken():
    """vLLM scripts pass these: enforce_eager (no CUDA graphs; on a CPU nothing changes) and
    trust_remote_code (jpaged runs no checkpoint code): the same tokens."""
    kw = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
              num_gpu_blocks_override=16, block_size=8)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    base = make_llm(tiny(), **kw).generate("abc", p)[0].outputs[0].token_ids
    eager = make_llm(tiny(), enforce_eager=True, trust_remote_code=True, **kw)
    assert eager.llm_engine.config.model.enforce_eager
    assert eager.generate("abc", p)[0].outputs[0].token_ids == base
    with pytest.raises(ValueError, match="enforce_eager"):
        make_llm(tiny(), enforce_eager="yes", **kw)


def test_unknown_engine_argument_is_named():
    with pytest.raises(TypeError, match="enable_prefix_cachin"):
        LLM(model="unused", enable_prefix_cachin=True)


def test_a_refused_n_request_queues_none_of_its_sequences(llm):
    engine = llm.llm_engine
    engine.add_request("1_x", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
    # Its second sequence would be "1_x": refused, and its first ("0_x") is not left queued.
    with pytest.raises(ValueError, match="'1_x' is already in use"):
        engine.add_request("x", {"prompt_token_ids": [4, 5]}, SamplingParams(n=2, max_tokens=2))
    assert set(engine.scheduler.requests) == {"1_x"}
    assert engine.get_num_unfinished_requests() == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert _free(llm)


def test_cpu_engine_scans_stacked_layers_and_leaves_a_callers_model_whole():
    """On XLA:CPU the engine runs the layers as one scan over stacked weights (one layer's code
    to compile); the LoadedModel a caller passed keeps its per-layer arrays, and the tokens
    equal the per-layer model's (the naive engine runs it unstacked)."""
    from models.llama import ScannedLayers

    loaded = tiny()
    llm = make_llm(loaded, max_model_len=64, max_num_seqs=2)
    assert isinstance(llm.llm_engine.loaded.model.model.layers, ScannedLayers)
    assert not isinstance(loaded.model.model.layers, ScannedLayers)
    assert len(loaded.model.model.layers) == loaded.spec.num_layers
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    got = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    naive = NaiveEngine(loaded, max_model_len=64, kv_cache_memory_bytes=10**6, max_rows=2)
    assert naive.generate(prompts, sp) == got


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """A tiny GGUF model whose tokenizer has one two-character token (" t", "Ġt"), so one
    step can add text that completes several stop strings, and its id."""
    from tiny_models import random_weights, tiny_spec, write_gguf

    spec = tiny_spec()
    path = write_gguf(tmp_path_factory.mktemp("merged") / "tiny.gguf", spec,
                      random_weights(spec, seed=0))
    llm = LLM(model=str(path), max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
              num_gpu_blocks_override=16, block_size=8)
    tok = llm.get_tokenizer()
    (t,) = tok.encode(" t", add_special_tokens=False)
    assert tok.decode([t]) == " t"
    return llm, t


def test_stop_string_rules_follow_vllm(merged):
    """vLLM's stop rules where one step's text completes several stop strings: the one that
    completes first wins, ties in list order; after min_tokens each stop string is searched
    only where it can end in new text (an "t" passed over before stays passed); a stop string
    that a stop token's own text completes is the stop reason."""
    llm, t = merged
    forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            allowed_token_ids=[t])  # every token is " t"

    def run(**kw):
        c = llm.generate("abc", forced.clone(**kw))[0].outputs[0]
        return c.text, c.stop_reason, c.finish_reason

    # " t": "t" and " t" both end at 2 (ties go in list order); "t" ends before " t t".
    assert run(stop=["t", " t"]) == (" ", "t", "stop")
    assert run(stop=[" t", "t"]) == ("", " t", "stop")
    assert run(stop=[" t t", "t"]) == (" ", "t", "stop")
    # min_tokens=2 passes over " t t"; the 3rd token's "t" ends it there, not the 1st "t".
    assert run(stop=["t", "xyzw"], min_tokens=2) == (" t t ", "t", "stop")
    # The stop token " t" completes the stop string "t" in the text it adds.
    assert run(stop_token_ids=[t], include_stop_str_in_output=True, stop=["t"]) == (
        " t", "t", "stop")
    assert run(stop_token_ids=[t], include_stop_str_in_output=True)[1:] == (t, "stop")
    assert run(stop_token_ids=[t]) == ("", t, "stop")
    assert _free(llm)


def test_stop_reason_of_eos_tokens(tmp_path):
    """As vLLM: the tokenizer's EOS stops with no stop_reason, even when stop_token_ids lists
    it; another EOS of the model (generation_config's) is the stop_reason."""
    import dataclasses

    loaded = tiny()
    eos = loaded.tokenizer.eos_token_id
    extra = VOCAB - 1  # an unused id, made a second EOS of the model
    spec = dataclasses.replace(loaded.spec, eos_token_ids=(*loaded.spec.eos_token_ids, extra))
    llm = make_llm(dataclasses.replace(loaded, spec=spec), max_model_len=64, max_num_seqs=2,
                   max_num_batched_tokens=32, num_gpu_blocks_override=16, block_size=8)
    p = SamplingParams(temperature=0, max_tokens=4)
    for token, params, want in ((eos, {}, None), (eos, {"stop_token_ids": [eos]}, None),
                                (extra, {}, extra),
                                (eos, {"ignore_eos": True, "stop_token_ids": [eos]}, eos)):
        c = llm.generate("abc", p.clone(allowed_token_ids=[token], **params))[0].outputs[0]
        assert (c.token_ids, c.finish_reason, c.stop_reason) == ([token], "stop", want), (
            token, params)


def test_n_children_stream_only_what_is_new(llm):
    """As vLLM's n > 1 DELTA stream: each output carries the sequences with new tokens, a
    finished one's finish_reason exactly once; the deltas add up to the CUMULATIVE result."""
    engine = llm.llm_engine
    # A third of the vocabulary stops a sequence: the seeded children end on different steps.
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=30,
                       stop_token_ids=list(range(100, 200)),
                       output_kind=RequestOutputKind.DELTA)
    engine.add_request("n-delta", "abc", p)
    ids: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finishes: dict[int, int] = {0: 0, 1: 0, 2: 0}
    lengths = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.outputs, "an output with nothing in it"
            for c in out.outputs:
                assert c.token_ids or c.finish_reason is not None
                ids[c.index] += c.token_ids
                finishes[c.index] += c.finish_reason is not None
                if c.finish_reason is not None:
                    lengths.append(len(ids[c.index]))
    assert finishes == {0: 1, 1: 1, 2: 1} and len(set(lengths)) > 1, lengths
    whole = llm.generate("abc", p.clone(output_kind=RequestOutputKind.CUMULATIVE))
    assert {c.index: c.token_ids for c in whole[0].outputs} == ids
    assert _free(llm)


def test_chat_hands_tool_calls_to_the_template_with_object_arguments(llm):
    """As vLLM's LLM.chat: an assistant message's tool_calls reach the template with their
    JSON arguments as objects; arguments that are not JSON are refused by name."""
    template = ("{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}"
                "{{ m.tool_calls[0].function.arguments.city }}{% endif %}|{{ m.content }};"
                "{% endfor %}")
    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    conv = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "cold"}]
    p = SamplingParams(temperature=0, max_tokens=2)
    out = llm.chat(conv, p, chat_template=template, add_generation_prompt=False)[0]
    assert out.prompt == "user:|hi;assistant:Oslo|;tool:|cold;"
    bad = [conv[0], {**conv[1], "tool_calls": [{**call, "function": {
        "name": "weather", "arguments": "{city"}}]}]
    with pytest.raises(ValueError, match=r"tool_calls\[0\].function.arguments is not JSON"):
        llm.chat(bad, p, chat_template=template, add_generation_prompt=False)
