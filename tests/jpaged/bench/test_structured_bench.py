"""The structured-output benchmark's logic on the tiny model: three runs with the same tokens,
constrained outputs checked, and no compile during the timed runs."""

from __future__ import annotations

from helpers import make_llm, tiny

from jpaged.bench.structured import run_structured


def test_three_runs_same_tokens_no_compile_when_warm():
    llm = make_llm(tiny(), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128)
    res = run_structured(llm, batch=4, max_tokens=24, repeats=1, mixed_fraction=0.5)
    assert res["mixed_constrained_rows"] == 2 and res["constrained_outputs"] == 6
    assert res["output_tokens_per_run"] == sum(res["lengths"]) > 0
    for k in ("tokens_per_s_unconstrained", "tokens_per_s_mixed", "tokens_per_s_constrained"):
        assert res[k] > 0
    assert res["compiles_during_timed_runs"] == 0
    assert 0.0 <= res["valid_fraction"] <= 1.0
    assert res["grammars_cached"] == 4  # one per schema used, each compiled once
