"""The host benchmark's pieces on tiny shapes: rows with their keys, both loops agree, and a
timeline with host phases and device spans (numbers are not asserted: no timing in tests)."""

from __future__ import annotations

from helpers import make_llm, tiny

from jpaged import SamplingParams
from jpaged.bench.host import (
    core_process_rows,
    embedded_rows,
    host_engine,
    host_model,
    host_rows,
    measure_host,
    overlap_rows,
    timeline,
)


def test_host_rows_and_timeline():
    loaded = host_model()
    for mode in ("sync", "async"):
        engine = host_engine(loaded, mode == "async", 4)
        row = measure_host(engine, 4, steps=3)
        assert row["mode"] == mode and row["batch"] == 4
        assert row["host_us_per_step"] > 0 and row["host_us_per_request_step"] > 0
        assert row["outputs_per_step"] == 4  # every request streams a delta every step
        assert not engine.has_unfinished_requests()
        m = engine.get_metrics()
        assert m["num_blocks_free"] == m["num_blocks_total"]
    events = timeline(engine, batch=4, steps=3)
    names = {e["name"] for e in events if e["lane"] == "host"}
    assert names == {"schedule", "pack + dispatch", "wait for tokens", "process outputs",
                     "wait for previous step"}  # the last one: XLA:CPU (wait_before_dispatch)
    device = [e for e in events if e["lane"] == "device"]
    assert len(device) >= 3 and all(e["t1"] >= e["t0"] >= 0 for e in events)
    # The wrappers are gone again.
    assert "schedule" not in engine.scheduler.__dict__
    assert "_apply" not in engine.__dict__ and "_outputs" not in engine.__dict__


def test_core_process_rows_time_both_processes():
    rows = core_process_rows((2,), steps=3, rounds=1)
    (row,) = rows
    assert row["engine_core_process"] is True and row["mode"] == "async" and row["batch"] == 2
    assert row["host_us_per_step"] > 0 and row["frontend_us_per_step"] > 0
    assert row["outputs_per_step"] == 2


def test_embedded_rows_compare_both_loops():
    res = embedded_rows(num_prompts=3, max_tokens=4, loaded=tiny(), rounds=3)
    assert res["outputs_identical"] is True
    assert res["tokens_per_s_sync"] > 0 and res["tokens_per_s_async"] > 0
    # The ratio is the median round's own sync/async wall ratio, not one across rounds.
    assert len(res["async_ratio_per_round"]) == 3
    assert res["async_ratio"] == sorted(res["async_ratio_per_round"])[1] > 0
    assert res["async_ratio_of_medians"] == round(
        res["tokens_per_s_async"] / res["tokens_per_s_sync"], 3)


def test_host_rows_alternate_the_loops():
    rows = host_rows((1, 2), steps=2, rounds=3)
    assert [(r["mode"], r["batch"]) for r in rows] == [("sync", 1), ("sync", 2), ("async", 1),
                                                       ("async", 2)]
    for r in rows:  # the reported round is the median one of three
        assert len(r["host_us_per_request_step_rounds"]) == 3
        assert r["host_us_per_request_step"] == sorted(r["host_us_per_request_step_rounds"])[1]


def test_overlap_rows_run_both_loops_on_one_engine():
    # One engine, switched between rounds: no second compilation, and it keeps its own loop.
    llm = make_llm(tiny(), async_scheduling=False, max_model_len=128, max_num_seqs=4)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 17)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    res = overlap_rows(llm, prompts, sp, rounds=2)
    assert res["outputs_identical"] is True and len(res["async_ratio_per_round"]) == 2
    assert res["tokens_per_s_sync"] > 0 and res["tokens_per_s_async"] > 0
    engine = llm.llm_engine
    assert engine.async_scheduling is False and not engine.has_unfinished_requests()
    compiled = engine.runner.num_compiled
    overlap_rows(llm, prompts, sp, rounds=1)
    assert engine.runner.num_compiled == compiled


def test_bench_host_script_keeps_its_rows_when_the_core_process_fails(tmp_path, monkeypatch):
    # scripts/bench_host.py as the device check calls it: a core process that cannot start
    # (e.g. a GPU that takes one process only) costs its own rows, not the others.
    import importlib.util
    import json
    import os
    import sys
    from pathlib import Path

    import pytest

    # The script sets XLA_FLAGS when it has none: kept from leaking into later tests' children.
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    script = Path(__file__).resolve().parents[3] / "scripts" / "bench_host.py"
    spec = importlib.util.spec_from_file_location("bench_host_script", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def refuse(*args, **kwargs):
        raise RuntimeError("no second process on this device")

    monkeypatch.setattr(mod, "core_process_rows", refuse)
    out = tmp_path / "host.json"
    monkeypatch.setattr(sys, "argv", ["bench_host.py", "--quick", "--no-embedded", "--no-plot",
                                      "--batches", "2", "--out", str(out)])
    with pytest.raises(SystemExit) as exc:
        mod.main()
    assert exc.value.code == 1
    doc = json.loads(out.read_text())
    assert doc["core_process_error"] == "RuntimeError: no second process on this device"
    assert [(r["mode"], r["batch"]) for r in doc["rows"]] == [("sync", 2), ("async", 2)]
    assert doc["core_process_rows"] == [] and list(doc["timelines"]) == ["tiny model, 2 requests"]
