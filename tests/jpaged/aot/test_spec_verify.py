"""`make gpu-aot --spec`: the verifying steps of speculative decoding (`jpaged.aot.spec_verify`).
Their rows and buckets, the two minima on SmolLM2's shapes, the JSON rows and table, and one
verifying step lowered and compiled for this CPU (no CUDA plugin needed)."""

from __future__ import annotations

import jax.numpy as jnp
from tiny_models import tiny_spec

from jpaged.aot.cases import VERIFY_FLAGS, StepBuilder, model_spec
from jpaged.aot.markdown import cycle_table, programs, spec_table
from jpaged.aot.report import compile_lowered
from jpaged.aot.spec_verify import (
    DRAFT_CATCH_UP_TOKENS,
    SPEC_KEYS,
    base_shapes,
    batch_rows_of,
    cycle_rows,
    spec_engine_config,
    step_hbm,
    verify_hbm,
    verify_rows,
    verify_rows_of,
    verify_shapes,
)
from jpaged.aot.traffic import HBM_KEYS, StepTraffic
from jpaged.runner.batch import BucketPlan

SMOL = model_spec("smollm2-135m")


def test_verifying_steps_take_the_power_of_two_decode_buckets():
    plan = BucketPlan.for_config(spec_engine_config(SMOL))
    # Speculation on: decode shapes in powers of two (to 256 at least, the default max_num_seqs).
    assert plan.seq_buckets[:9] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    # B * (k + 1) rows, padded to the next power of two, of B sequences (powers of 4): one
    # program per (B, k) here.
    assert verify_shapes(plan) == {(2, 1): [(1, 1)], (4, 1): [(1, 2)], (8, 1): [(1, 4)],
                                   (16, 1): [(1, 8)], (32, 16): [(16, 1)],
                                   (64, 16): [(16, 2)], (128, 16): [(16, 4)],
                                   (256, 16): [(16, 8)]}
    assert verify_rows(plan, 16, 8) == (256, 16, 144) and verify_rows(plan, 1, 2) == (4, 1, 3)
    # Every one is a verifying shape of the plan (T = R rows, B sequences).
    assert all((t, b, t) in plan.verify_shapes() for t, b in verify_shapes(plan))

    small = BucketPlan(16, 64, 256, 16, num_speculative_tokens=4)  # rows up to 64
    assert small.seq_buckets[-1] == 64
    # The plan's largest bucket caps the rows (the scheduler keeps a step's rows within it).
    assert verify_rows(small, 16, 4) == (64, 16, 64)
    assert verify_shapes(small, (1, 4), (1, 4)) == {(2, 1): [(1, 1)], (8, 1): [(1, 4)],
                                                    (8, 4): [(4, 1)], (32, 4): [(4, 4)]}


def test_verify_minimum_reads_each_sequence_context_once():
    params, ctx, b, k = 269_060_736, 1024, 16, 4
    rows = b * (k + 1)
    case = StepTraffic(rows, b, ctx, SMOL.num_layers, 16, SMOL.num_kv_heads, SMOL.head_dim,
                       2, SMOL.vocab_size, params, 100_000, verifying=True)
    assert not case.decode and case.first_new == ctx - (k + 1)
    row_bytes = SMOL.num_kv_heads * SMOL.head_dim * 2  # one token's K (or V) in one layer
    new_kv = 2 * row_bytes * SMOL.num_layers * rows  # every row's K and V written once
    logits = rows * SMOL.vocab_size * 4  # every position scored: f32 logits of each row
    assert case.min_hbm_bytes() == (params + 2 * row_bytes * SMOL.num_layers * ctx * b
                                    + new_kv + logits)
    # As single-token rows each reads its context: k + 1 times for each sequence.
    assert case.min_hbm_bytes_rows() == (params + 2 * row_bytes * SMOL.num_layers * ctx * rows
                                         + new_kv + logits)
    # The tiled kernel's reads: a 16-query tile holds a sequence's k + 1 rows, which see the
    # keys up to position ctx - 1, in 32-key steps; a tile of 4 splits them in two (the
    # first up to its 4th row's position).
    per_tile = case.kernel_rule("ragged_paged_qt16_ppb2")
    assert per_tile.pool_read == b * ctx * row_bytes
    split = case.kernel_rule("ragged_paged_qt4_ppb2")
    first_end = ctx - (k + 1) + 4
    assert split.pool_read == b * (-(-first_end // 32) * 32 + ctx) * row_bytes
    # A prefill of the same shape starts at position 0 (tile 0 sees 16 keys: one step).
    prefill = StepTraffic(rows, b, ctx, SMOL.num_layers, 16, SMOL.num_kv_heads,
                          SMOL.head_dim, 2, SMOL.vocab_size, params, 100_000)
    assert prefill.kernel_rule("ragged_paged_qt16_ppb2").pool_read == b * 32 * row_bytes


def test_rows_of_a_compiled_program_and_their_table():
    base = {"model": "m", "kv_cache_dtype": "bfloat16", "backend": "pallas",
            "tensor_parallel_size": 1, "program": "spec_verify", "tokens": 8, "seqs": 4,
            "compiled": True, "kernels_per_step": 200, "command_buffers": 1}
    hbm = [{"context_len": c, "batch": b, "k": k, "rows": 8, "seqs_bucket": 4,
            "tokens_per_step_max": b * (k + 1), "hbm_bytes": 10**9, "min_hbm_bytes": 10**9,
            "traffic_ratio": 1.0, "min_hbm_bytes_rows": 2 * 10**9, "rows_ratio": 2.0,
            "predicted_step_ms": 0.42}
           for b, k in ((1, 4), (4, 1)) for c in (1024, 4096)]
    rows = verify_rows_of({**base, "hbm": hbm}, [(1, 4), (4, 1)], 8, (1024, 4096), HBM_KEYS, 4)
    assert [(r["batch"], r["k"], r["context_len"]) for r in rows] == [
        (1, 4, 1024), (1, 4, 4096), (4, 1, 1024), (4, 1, 4096)]
    assert [bool(r.get("reuses_compile")) for r in rows] == [False, True, True, True]
    assert all(k in r for r in rows for k in (*HBM_KEYS, *SPEC_KEYS))
    doc = {"cases": [], "spec_verify": rows, "hbm_bytes_per_s": 4.8e12}
    assert programs(doc) == 1
    assert ("| m | bfloat16 | pallas | 1 | 1 | 4 | 5 | 8 | 4 | 1024 | 200 | 1 | 1.00 | 1.00 | "
            "1.00 | 2.00 | 2.00 | 0.42 |") in spec_table(doc)
    # A failed compile still gives every (B, k, context) row, its figures None.
    failed = verify_rows_of({**base, "compiled": False}, [(1, 4)], 8, (1024, 4096), HBM_KEYS,
                            4)
    assert [(r["k"], r["context_len"], r["hbm_bytes"], r["seqs_bucket"]) for r in failed] == [
        (4, 1024, None, 4), (4, 4096, None, 4)]


def test_a_verifying_step_compiled_for_this_cpu():
    spec = tiny_spec(max_position_embeddings=256)
    config = spec_engine_config(spec, max_num_seqs=16, max_num_batched_tokens=64)
    b = StepBuilder(spec, jnp.float32, "bfloat16", "xla", 1024, config=config)
    pairs = verify_shapes(b.plan, (1,), (4,))
    assert pairs == {(8, 1): [(1, 4)]}

    def analyze(text: str) -> list[dict]:
        return [verify_hbm(text, b, 1, 4, c) for c in (64, 128)]

    row = compile_lowered(lambda: b.lower_step(8, 1, VERIFY_FLAGS, num_rows=8), False, None,
                          b.pool_shape(), analyze=analyze)
    assert row["compiled"], row.get("error")
    rows = verify_rows_of(row, pairs[(8, 1)], 8, (64, 128), HBM_KEYS, 1)
    for r in rows:
        assert (r["rows"], r["seqs_bucket"], r["batch"], r["k"], r["tokens_per_step_max"]) == (
            8, 1, 1, 4, 5)
        assert r["hbm_bytes"] > 0 and r["context_fits_pool"]
        # The 5 rows as single-token rows would read the context 5 times; this step once a
        # query tile (one here: the XLA path's tile of 8 holds the 5).
        assert r["min_hbm_bytes"] < r["min_hbm_bytes_rows"]
        assert r["rows_ratio"] == round(r["min_hbm_bytes_rows"] / r["hbm_bytes"], 3)
    # The context is read once: doubling it adds about one context's K/V, not five.
    kv_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2
    assert rows[1]["hbm_bytes"] - rows[0]["hbm_bytes"] < 2 * 64 * kv_token


def test_base_and_draft_shapes_and_the_cycle_figures():
    plan = BucketPlan.for_config(spec_engine_config(SMOL))
    # The plain decode step of each batch; the draft's catch-up (2 tokens a sequence) is one
    # mixed program for both batches.
    assert base_shapes(plan) == {(1, 1): [1], (16, 16): [16]}
    assert base_shapes(plan, tokens_per_seq=DRAFT_CATCH_UP_TOKENS) == {(64, 16): [1, 16]}
    head = {"model": "big", "kv_cache_dtype": "bfloat16", "backend": "pallas",
            "tensor_parallel_size": 1}
    rows = [{**head, "program": "spec_verify", "batch": 1, "k": 4, "context_len": 1024,
             "hbm_bytes": 12},
            {**head, "program": "spec_verify", "batch": 1, "k": 2, "context_len": 1024,
             "hbm_bytes": None},  # a failed compile: no cycle
            {**head, "program": "spec_decode_base", "batch": 1, "context_len": 1024,
             "hbm_bytes": 10},
            {**head, "model": "small", "draft_for": "big", "program": "draft_decode",
             "batch": 1, "context_len": 1024, "hbm_bytes": 2},
            {**head, "model": "small", "draft_for": "big", "program": "draft_catch_up",
             "batch": 1, "context_len": 1024, "hbm_bytes": 3}]
    cycles = cycle_rows(rows)
    assert len(cycles) == 1
    c = cycles[0]
    assert (c["model"], c["batch"], c["k"], c["decode_hbm_bytes"], c["verify_hbm_bytes"]) == (
        "big", 1, 4, 10, 12)
    assert c["break_even_tokens"] == 1.2
    # The draft's cycle: its catch-up, k - 1 single-token steps, then the verifying step.
    assert c["draft_cycle_hbm_bytes"] == 12 + 3 + 3 * 2 and c["break_even_tokens_draft"] == 2.1
    assert c["draft_model"] == "small"
    table = cycle_table({"spec_cycles": cycles})
    assert "| big | bfloat16 | 1 | 1 | 4 | 1024 |" in table and "| small |" in table
    # Without a draft only the verifying step's break-even.
    alone = cycle_rows(rows[:3])
    assert "draft_cycle_hbm_bytes" not in alone[0] and "| - | - | - |" in cycle_table(
        {"spec_cycles": alone})


def test_a_catch_up_step_compiled_for_this_cpu():
    """The draft's first step after a verification (2 tokens a sequence, a mixed program):
    its rows per batch, the new tokens counted at the context's end."""
    spec = tiny_spec(max_position_embeddings=256)
    config = spec_engine_config(spec, max_num_seqs=16, max_num_batched_tokens=64)
    b = StepBuilder(spec, jnp.float32, "bfloat16", "xla", 1024, config=config)
    shapes = base_shapes(b.plan, (1, 4), DRAFT_CATCH_UP_TOKENS)
    assert shapes == {(64, 16): [1, 4]}

    def analyze(text: str) -> list[dict]:
        return [step_hbm(text, b, n, DRAFT_CATCH_UP_TOKENS, c) for n in (1, 4)
                for c in (64, 128)]

    row = compile_lowered(lambda: b.lower_step(64, 16, VERIFY_FLAGS), False, None,
                          b.pool_shape(), analyze=analyze)
    assert row["compiled"], row.get("error")
    rows = batch_rows_of({**row, "program": "draft_catch_up"}, [1, 4], (64, 128), HBM_KEYS)
    assert [(r["batch"], r["context_len"], bool(r.get("reuses_compile"))) for r in rows] == [
        (1, 64, False), (1, 128, True), (4, 64, True), (4, 128, True)]
    assert all(r["hbm_bytes"] > 0 for r in rows)
    # Four sequences read four contexts: more than one.
    assert rows[2]["min_hbm_bytes"] > rows[0]["min_hbm_bytes"]
