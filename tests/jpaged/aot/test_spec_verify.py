"""`make gpu-aot --spec`: the verifying steps of speculative decoding (`jpaged.aot.spec_verify`).
Their rows and buckets, the two minima on SmolLM2's shapes, the JSON rows and table, and one
verifying step lowered and compiled for this CPU (no CUDA plugin needed)."""

from __future__ import annotations

import jax.numpy as jnp
from tiny_models import tiny_spec

from jpaged.aot.cases import DECODE_FLAGS, StepBuilder, model_spec
from jpaged.aot.markdown import programs, spec_table
from jpaged.aot.report import compile_lowered
from jpaged.aot.spec_verify import (
    SPEC_KEYS,
    spec_engine_config,
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
    # B * (k + 1) rows, padded to the next power of two: one program per (B, k) here.
    assert verify_shapes(plan) == {2: [(1, 1)], 4: [(1, 2)], 8: [(1, 4)], 16: [(1, 8)],
                                   32: [(16, 1)], 64: [(16, 2)], 128: [(16, 4)],
                                   256: [(16, 8)]}
    assert verify_rows(plan, 16, 8) == (256, 144) and verify_rows(plan, 1, 2) == (4, 3)

    class Small:  # a plan whose largest decode bucket is 16 rows
        seq_buckets = [1, 2, 4, 8, 16]

    # The plan's largest bucket caps the rows (the scheduler keeps a step's rows within it).
    assert verify_rows(Small(), 16, 1) == (16, 16)
    assert verify_shapes(Small(), (1, 4), (1, 4)) == {2: [(1, 1)], 8: [(1, 4), (4, 1)],
                                                      16: [(4, 4)]}


def test_verify_minimum_reads_each_sequence_context_once():
    params, ctx, b, k = 269_060_736, 1024, 16, 4
    rows = b * (k + 1)
    case = StepTraffic(rows, rows, ctx, SMOL.num_layers, 16, SMOL.num_kv_heads, SMOL.head_dim,
                       2, SMOL.vocab_size, params, 100_000)
    row_bytes = SMOL.num_kv_heads * SMOL.head_dim * 2  # one token's K (or V) in one layer
    new_kv = 2 * row_bytes * SMOL.num_layers * rows  # every row's K and V written once
    logits = rows * SMOL.vocab_size * 4  # every position scored: f32 logits of each row
    assert case.min_hbm_bytes() == (params + 2 * row_bytes * SMOL.num_layers * ctx * rows
                                    + new_kv + logits)
    assert case.min_hbm_bytes_verify(b) == (params + 2 * row_bytes * SMOL.num_layers * ctx * b
                                            + new_kv + logits)
    # The decode count reads each context k + 1 times: k more than the verify minimum.
    assert case.min_hbm_bytes() - case.min_hbm_bytes_verify(b) == (
        2 * row_bytes * SMOL.num_layers * ctx * b * k)
    # One row per sequence (k = 0): the two minima are the decode step's.
    one = StepTraffic(b, b, ctx, SMOL.num_layers, 16, SMOL.num_kv_heads, SMOL.head_dim, 2,
                      SMOL.vocab_size, params, 100_000)
    assert one.min_hbm_bytes_verify(b) == one.min_hbm_bytes()


def test_rows_of_a_compiled_program_and_their_table():
    base = {"model": "m", "kv_cache_dtype": "bfloat16", "backend": "pallas",
            "tensor_parallel_size": 1, "program": "spec_verify", "tokens": 8, "seqs": 8,
            "compiled": True, "kernels_per_step": 200, "command_buffers": 1}
    hbm = [{"context_len": c, "batch": b, "k": k, "rows": 8, "tokens_per_step_max": b * (k + 1),
            "hbm_bytes": 2 * 10**9, "min_hbm_bytes": 2 * 10**9, "traffic_ratio": 1.0,
            "min_hbm_bytes_verify": 10**9, "traffic_ratio_verify": 2.0,
            "predicted_step_ms": 0.42}
           for b, k in ((1, 4), (4, 1)) for c in (1024, 4096)]
    rows = verify_rows_of({**base, "hbm": hbm}, [(1, 4), (4, 1)], 8, (1024, 4096), HBM_KEYS)
    assert [(r["batch"], r["k"], r["context_len"]) for r in rows] == [
        (1, 4, 1024), (1, 4, 4096), (4, 1, 1024), (4, 1, 4096)]
    assert [bool(r.get("reuses_compile")) for r in rows] == [False, True, True, True]
    assert all(k in r for r in rows for k in (*HBM_KEYS, *SPEC_KEYS))
    doc = {"cases": [], "spec_verify": rows, "hbm_bytes_per_s": 4.8e12}
    assert programs(doc) == 1
    assert ("| m | bfloat16 | pallas | 1 | 1 | 4 | 5 | 8 | 1024 | 200 | 1 | 2.00 | 2.00 | "
            "1.00 | 1.00 | 2.00 | 0.42 |") in spec_table(doc)
    # A failed compile still gives every (B, k, context) row, its figures None.
    failed = verify_rows_of({**base, "compiled": False}, [(1, 4)], 8, (1024, 4096), HBM_KEYS)
    assert [(r["k"], r["context_len"], r["hbm_bytes"]) for r in failed] == [
        (4, 1024, None), (4, 4096, None)]


def test_a_verifying_step_compiled_for_this_cpu():
    spec = tiny_spec(max_position_embeddings=256)
    config = spec_engine_config(spec, max_num_seqs=16, max_num_batched_tokens=64)
    b = StepBuilder(spec, jnp.float32, "bfloat16", "xla", 1024, config=config)
    pairs = verify_shapes(b.plan, (1,), (4,))
    assert pairs == {8: [(1, 4)]}

    def analyze(text: str) -> list[dict]:
        return [verify_hbm(text, b, 1, 4, c) for c in (64, 128)]

    row = compile_lowered(lambda: b.lower_step(8, 8, DECODE_FLAGS), False, None, b.pool_shape(),
                          analyze=analyze)
    assert row["compiled"], row.get("error")
    rows = verify_rows_of(row, pairs[8], 8, (64, 128), HBM_KEYS)
    for r in rows:
        assert (r["rows"], r["batch"], r["k"], r["tokens_per_step_max"]) == (8, 1, 4, 5)
        assert r["hbm_bytes"] > 0 and r["context_fits_pool"]
        # The 5 rows read the sequence's context 5 times; the verify minimum reads it once.
        assert r["min_hbm_bytes_verify"] < r["min_hbm_bytes"]
        assert r["traffic_ratio_verify"] > r["traffic_ratio"]
        assert r["traffic_ratio_verify"] == round(r["hbm_bytes"] / r["min_hbm_bytes_verify"], 3)
