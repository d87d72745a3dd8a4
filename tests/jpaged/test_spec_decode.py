"""Speculative decoding end to end on the tiny random Llama: with `ngram` and `suffix`
proposals every token, text, logprob and finish equals the engine without them (greedy and
seeded sampling alike: the verification keeps each position's own draw), through preemption,
prefix hits, penalties, min_tokens, logit_bias, allowed_token_ids, bad words and stop strings;
bad configs are refused by name; a proposer error fails only its request."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_llm, tiny

from jpaged import SamplingParams
from jpaged.config import EngineArgs, SpeculativeConfig
from jpaged.sampling_params import StructuredOutputsParams

# A small pool (preemption) and block 8 (prefix hits on shared prompt heads).
# (Few shapes: every engine compiles its own; speculation's rows reach 8 x 4 = 32.)
BASE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=8,
            num_gpu_blocks_override=30)
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
              "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 3},
}


@pytest.fixture(scope="module")
def engines():
    """No proposals; ngram (recompute preemption); suffix (swap preemption)."""
    swap = dict(preemption_mode="swap", kv_offloading_size=0.01)
    return {name: make_llm(tiny(), speculative_config=METHODS.get(name),
                           **BASE, **(swap if name == "suffix" else {})).llm_engine
            for name in ("off", "ngram", "suffix")}


def _work(seed: int, n: int) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(seed)
    head = rng.integers(3, 200, size=24).tolist()
    pattern = rng.integers(3, 200, size=6).tolist()
    work = []
    for i in range(n):
        # Repetitive prompts (the proposers find matches), half with a shared head.
        body = (pattern * int(rng.integers(2, 6)))[: int(rng.integers(8, 40))]
        prompt = (head + body) if i % 2 else body
        # Three kinds (each flag set a step can have compiles on every shape): plain greedy
        # with a stop string; seeded top-p sampling; every processor at once.
        kind = i % 3
        sp = dict(max_tokens=int(rng.integers(8, 48)), temperature=0.0)
        if kind == 0:
            sp.update(stop=[chr(pattern[2] % 94 + 33)], include_stop_str_in_output=True)
        elif kind == 1:
            sp.update(temperature=0.8, seed=100 + i, top_p=0.9)
        else:
            sp.update(repetition_penalty=1.3, frequency_penalty=0.2, min_tokens=6,
                      stop_token_ids=[pattern[0]], logit_bias={pattern[1]: 5.0}, logprobs=3,
                      bad_words=[chr(pattern[3] % 94 + 33) + chr(pattern[4] % 94 + 33)],
                      allowed_token_ids=sorted(set(pattern + head[:8])))
            if i % 2:
                sp.update(temperature=0.7, seed=7 + i)
        work.append((prompt, SamplingParams(**sp)))
    return work


def _run(engine, work):
    for e in (engine,):
        assert e.reset_prefix_cache()
    final = {}
    pending = [(f"r{i}", {"prompt_token_ids": p}, sp) for i, (p, sp) in enumerate(work)]
    while pending or engine.has_unfinished_requests():
        for rid, prompt, sp in pending[:3]:
            engine.add_request(rid, prompt, sp)
        pending = pending[3:]
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    m = engine.get_metrics()
    assert m["num_blocks_free"] == m["num_blocks_total"]
    engine.core.scheduler.kv_cache_manager.check_invariants()
    # Logprobs apart: a row's floats depend on the step's shape (rounding, ~1e-5).
    return ({rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
             for rid, o in sorted(final.items())},
            {rid: [[(t, lp.logprob, lp.rank) for t, lp in sorted(d.items())]
                   for c in o.outputs for d in c.logprobs or ()]
             for rid, o in sorted(final.items())})


def _same_logprobs(a, b):
    assert a.keys() == b.keys()
    for rid in a:
        assert len(a[rid]) == len(b[rid])
        for x, y in zip(a[rid], b[rid], strict=True):
            assert [t for t, _, _ in x] == [t for t, _, _ in y]
            np.testing.assert_allclose([lp for _, lp, _ in x], [lp for _, lp, _ in y],
                                       atol=1e-3)


@pytest.fixture(scope="module")
def spec_off_outputs(engines):
    """The no-proposals engine's outputs of _work(3, 14): both methods' baseline, run once."""
    return _run(engines["off"], _work(3, 14))


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_outputs_identical_to_spec_off(engines, spec_off_outputs, method):
    before = engines[method].get_metrics()
    base, base_lp = spec_off_outputs
    spec, spec_lp = _run(engines[method], _work(3, 14))
    assert spec == base
    _same_logprobs(spec_lp, base_lp)
    m = engines[method].get_metrics()
    assert m["spec_decode_num_drafts"] > before.get("spec_decode_num_drafts", 0)
    assert m["spec_decode_num_accepted_tokens"] > before.get("spec_decode_num_accepted_tokens", 0)
    assert m["num_preemptions"] > 0  # the small pool preempted some of them
    assert m["prefix_cache_hits"] > 0
    if method == "suffix":  # its engine preempts by swapping to the host tier
        assert m["num_swapped_out"] > 0
    per_pos = m["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == m["spec_decode_num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))


def test_speculation_pauses_while_nothing_is_accepted(engines):
    """Random prompts sampled at temperature 1: bigrams rarely recur, so proposals are few and
    rarely accepted; the engine then runs most steps overlapped (async scheduling), probing
    now and then, and outputs stay exact."""
    eng = engines["ngram"]
    rng = np.random.default_rng(9)
    work = [(rng.integers(3, 250, size=20).tolist(), SamplingParams(temperature=1.0, seed=i,
                                                                    max_tokens=40))
            for i in range(3)]
    before = eng.get_metrics()
    assert _run(eng, work)[0] == _run(engines["off"], work)[0]
    m = eng.get_metrics()
    steps = m["num_steps"] - before["num_steps"]
    overlapped = (m["spec_decode_overlapped_steps_total"]
                  - before["spec_decode_overlapped_steps_total"])
    assert overlapped > steps // 2


def test_bench_reports_acceptance(engines):
    from jpaged.bench.throughput import run_throughput, summary_line

    r = run_throughput(engines["suffix"], num_prompts=2, input_len=16, output_len=8,
                       warmup=False)
    assert r["spec_decode_num_drafts"] >= 0 and "spec_decode_acceptance_rate" in r
    assert "mean acceptance length" in summary_line(r)


def test_prometheus_exports_spec_decode_counters(engines):
    from jpaged.metrics import build_registry, render

    body, _ = render(build_registry(engines["ngram"].get_metrics))
    text = body.decode()
    assert "jpaged:spec_decode_num_draft_tokens_total" in text
    assert 'jpaged:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text


def test_a_proposer_error_fails_only_its_request(engines, monkeypatch):
    eng = engines["ngram"]
    import jpaged.core.spec_proposer as sp_mod

    real = sp_mod.propose_ngram

    def broken(tokens, config, max_new=None):
        if list(tokens[:3]) == [9, 9, 9]:
            raise RuntimeError("boom")
        return real(tokens, config, max_new)

    monkeypatch.setattr(sp_mod, "propose_ngram", broken)
    # Long enough to outlast a pause of speculation left by an earlier test.
    params = SamplingParams(max_tokens=40, temperature=0.0)
    eng.add_request("bad", {"prompt_token_ids": [9, 9, 9, 4, 5]}, params)
    eng.add_request("good", {"prompt_token_ids": [8, 8, 8, 4, 5]}, params)
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    bad, good = final["bad"].outputs[0], final["good"].outputs[0]
    assert bad.finish_reason == "error" and "boom" in str(bad.stop_reason)
    assert good.finish_reason == "length" and len(good.token_ids) == 40


def test_warm_verifying_shapes_compile_nothing_more():
    """warmup() compiles the plan's verifying shapes (T = R rows of B sequences) beside the
    decode and mixed ones; speculating afterwards compiles no step program, and each
    verifying step packs one sequence of k + 1 tokens a request."""
    llm = make_llm(tiny(), max_model_len=96, max_num_seqs=2, max_num_batched_tokens=64,
                   block_size=8, num_gpu_blocks_override=30, async_scheduling=False,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 1,
                                       "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    runner = llm.llm_engine.runner
    plan = runner.plan
    assert plan.verify_shapes() == [(2, 1, 2), (2, 2, 2), (4, 1, 4), (4, 2, 4)]
    # On XLA a decode and a mixed step of one shape are one program; so is (2, 2, 2).
    keys = ({(t, b, b) for t, b in plan.decode_shapes()}
            | {(t, b, b) for t, b in plan.mixed_shapes()} | set(plan.verify_shapes()))
    assert runner.warmup() == len(keys) == 7
    packed = []
    pack = runner.input_batch.pack

    def spy(scheduled, *args, **kw):
        out = pack(scheduled, *args, **kw)
        packed.append(out)
        return out

    runner.input_batch.pack = spy
    rng = np.random.default_rng(2)
    pattern = rng.integers(3, 200, 5).tolist()
    prompts = [{"prompt_token_ids": (pattern * 6)[:n]} for n in (12, 23)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                 use_tqdm=False)
    assert runner.num_compiled == 7
    verifying = [p for p in packed if p.first_rows is not None]
    assert verifying and llm.llm_engine.get_metrics()["spec_decode_num_drafts"] > 0
    for p in verifying:
        q = p.batch.query_start_loc
        assert p.num_rows == p.num_tokens > p.num_seqs
        q_lens = set((q[1:p.num_seqs + 1] - q[:p.num_seqs]).tolist())
        assert 2 in q_lens and q_lens <= {1, 2}  # k + 1 = 2 for a verifying request


@pytest.mark.parametrize("value, match", [
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 33}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "learned draft head"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model is required"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "model is required"),
    ({"model": "some/draft"}, "num_speculative_tokens is required"),
    ({"method": "medusa2", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown field"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "min_token_prob"),
    ('{"method": "ngram", ', "not valid JSON"),
])
def test_bad_configs_are_refused_by_name(value, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(speculative_config=value).create_engine_config(1024)


def test_config_defaults_follow_vllm():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_max": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig.parse({"method": "suffix"}).num_speculative_tokens == 24
    # vLLM's older spelling of the n-gram proposer, as its own tests write it.
    c = SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 3})
    assert (c.method, c.model) == ("ngram", None)


def test_core_process_and_stop_strings_match_spec_off():
    """A word tokenizer's stop strings, seeded sampling and n = 2 with logprobs: the engine
    without proposals, with them in process, and with them in a core process agree (tokens
    after a stop string in the same step are never shown)."""
    from jpaged.bench.host import host_model
    from jpaged.core_client import CoreProcessEngine
    from jpaged.engine import LLMEngine
    from jpaged.llm import LLM

    args = dict(max_num_seqs=8, max_model_len=128, num_gpu_blocks_override=64, block_size=16,
                disable_log_stats=True)
    rng = np.random.default_rng(5)
    pattern = rng.integers(0, 256, 5).tolist()
    prompts = [{"prompt_token_ids": (pattern * 6)[: int(k)]} for k in rng.integers(8, 30, 9)]
    base = LLM.from_engine(LLMEngine(EngineArgs(**args), loaded=host_model()))
    # Stop strings the greedy outputs reach late: words they first show after six others
    # (tokens of a step that verified several land on both sides of them).
    free = base.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24),
                         use_tqdm=False)
    texts = [o.outputs[0].text.split() for o in free]
    late = [w for words in texts for i, w in enumerate(words) if i >= 6 and w not in words[:i]]
    stops = [" " + w for w in sorted(set(late))][:2]
    kinds = [SamplingParams(temperature=0.0, max_tokens=24, stop=stops),
             SamplingParams(temperature=0.9, seed=3, max_tokens=20, stop=stops[:1]),
             SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12, logprobs=2)]
    params = [kinds[i % 3] for i in range(len(prompts))]
    spec = METHODS["ngram"]

    def outs(llm):
        return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                  None if c.logprobs is None else [sorted(d) for d in c.logprobs])
                 for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]

    ref = outs(base)
    inproc = LLM.from_engine(LLMEngine(EngineArgs(speculative_config=spec, **args),
                                       loaded=host_model()))
    assert outs(inproc) == ref
    assert inproc.llm_engine.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    assert any(isinstance(c[3], str) for o in ref for c in o)  # some stop string ended one
    core = CoreProcessEngine(EngineArgs(speculative_config=spec, **args), loader=host_model)
    try:
        assert outs(LLM.from_engine(core)) == ref
    finally:
        core.shutdown()


@pytest.mark.usefixtures("optimized_compiles_in_test")
def test_structured_outputs_verify_each_position_under_its_grammar():
    """The embedded model writing JSON for a schema, greedy and seeded: proposals are cut
    where the grammar refuses them and each position is masked by the grammar advanced past
    the proposals before it, so the outputs are the engine's without proposals (and valid)."""
    import json

    import jsonschema

    from jpaged.bench.schemas import SCHEMAS

    args = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256)
    names = list(SCHEMAS)[:3]
    base = make_llm(**args)
    spec = make_llm(speculative_config={"method": "suffix", "num_speculative_tokens": 6},
                    async_scheduling=False, **args)  # every step proposes (no pause)
    tok = base.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"A JSON {n}, twice."}],
                                       add_generation_prompt=True) for n in names] * 2
    params = [SamplingParams(temperature=0.0 if i < 3 else 0.7, seed=i, max_tokens=100,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS[n]))
              for i, n in enumerate(names * 2)]

    def run(llm):
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    want, got = run(base), run(spec)
    assert [(c.token_ids, c.finish_reason) for c in got] == \
        [(c.token_ids, c.finish_reason) for c in want]
    for c, n in zip(got, names * 2, strict=True):
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMAS[n])
    m = spec.llm_engine.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] > 0


# -- draft models ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """Another tiny Llama with the target's byte tokenizer: one layer, other weights."""
    from tiny_models import random_weights, tiny_spec, write_hf_dir

    spec = tiny_spec(max_position_embeddings=512, num_layers=1)
    return str(write_hf_dir(tmp_path_factory.mktemp("draft") / "draft", spec,
                            random_weights(spec, seed=7)))


def test_draft_model_outputs_identical_and_counted_in_the_pool(engines, draft_dir):
    """A draft with other weights: most proposals are rejected, every output is the engine's
    without proposals (preemption and prefix hits included), and each block holds the
    draft's KV too, so the same KV bytes give fewer blocks."""
    cfg = {"model": draft_dir, "num_speculative_tokens": 3}
    budget = dict(BASE, num_gpu_blocks_override=None, kv_cache_memory_bytes=2**20)
    drafted = make_llm(tiny(), speculative_config=cfg, **budget).llm_engine
    target_block = 2 * 8 * tiny().spec.num_layers * tiny().spec.num_kv_heads * \
        tiny().spec.head_dim * 4
    draft_block = target_block // tiny().spec.num_layers  # the draft has one layer
    assert drafted.config.cache.num_gpu_blocks == 2**20 // (target_block + draft_block)
    assert engines["off"].config.cache.num_gpu_blocks == 30  # (BASE's override)
    eng = make_llm(tiny(), speculative_config=cfg, **BASE).llm_engine
    work = _work(3, 14)
    assert _run(eng, work)[0] == _run(engines["off"], work)[0]
    m = eng.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0 and m["num_preemptions"] > 0
    assert eng.core.draft.num_steps > 0


def test_a_draft_equal_to_the_target_accepts_every_greedy_proposal():
    """The embedded model drafting for itself: every greedy proposal is accepted."""
    from models.loader import embedded_gguf_path

    llm = make_llm(speculative_config={"model": str(embedded_gguf_path()),
                                       "num_speculative_tokens": 3},
                   max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64)
    prompts = ["The capital of France is", "List the planets of the solar system:"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12,
                                                ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    m = llm.llm_engine.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"]


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    """A tiny draft whose vocabulary is 20 tokens larger than the target's (a draft of
    another model family differs the same way; a tiny one loads in a moment)."""
    from tiny_models import random_weights, tiny_spec, write_hf_dir

    spec = tiny_spec(max_position_embeddings=512, num_layers=1,
                     vocab_size=tiny().spec.vocab_size + 20)
    other = write_hf_dir(tmp_path / "other", spec, random_weights(spec, seed=7))
    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocabulary"):
        make_llm(tiny(), speculative_config={"model": str(other), "num_speculative_tokens": 2},
                 **BASE)
