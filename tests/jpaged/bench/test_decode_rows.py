"""The synthetic decode step of jpaged/bench/decode_rows.py: what it packs, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny

from jpaged.bench.decode_rows import RANDOM_SAMPLING, decode_step, time_decode
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine


def test_each_sequence_names_its_own_blocks_up_to_the_context(runner):
    packed = decode_step(runner, 4, 20)
    b = packed.batch
    assert list(b.seq_lens) == [20] * 4 and list(b.positions) == [19] * 4
    tables = b.block_tables[:, :3]  # ceil(20 / 8) blocks each, the rest the null block
    assert (b.block_tables[:, 3:] == 0).all() and (tables > 0).all()
    assert len(set(tables.ravel().tolist())) == 12  # distinct blocks: nothing shared
    # The new token's K/V goes to position 19: block 2, slot 3 of each sequence.
    assert list(b.slot_mapping) == list(tables[:, 2] * 8 + 3)
    assert list(b.query_start_loc) == [0, 1, 2, 3, 4] and list(b.logits_indices) == [0, 1, 2, 3]
    assert (b.sampling.temperature == 0).all()


def test_refuses_what_the_pool_or_tables_cannot_hold(runner):
    with pytest.raises(ValueError, match="not a decode bucket"):
        decode_step(runner, 3, 8)
    with pytest.raises(ValueError, match="block tables hold 8"):
        decode_step(runner, 1, 65)
    with pytest.raises(ValueError, match=r"need 32 blocks; the pool has 23"):
        decode_step(runner, 4, 64)


def test_timed_row(runner):
    row = time_decode(runner, 4, 20, iters=2)
    assert row["batch"] == 4 and row["context_len"] == 20 and row["step_ms"] > 0
    assert np.isclose(row["output_tokens_per_s"], 4 / row["step_ms"] * 1e3, rtol=1e-2)


def test_sampled_step_draws_through_every_filter(runner):
    """The random row's batch: every row at RANDOM_SAMPLING (so every conditional of the
    sampler takes its largest branch), on the same compiled step as the greedy row."""
    s = decode_step(runner, 4, 20, sampled=True).batch.sampling
    assert (s.temperature == RANDOM_SAMPLING["temperature"]).all()
    assert (s.top_k == RANDOM_SAMPLING["top_k"]).all() and (s.top_k < runner.vocab_size).all()
    assert (s.top_p < 1).all() and (s.min_p > 0).all()
    compiled = runner.num_compiled
    row = time_decode(runner, 4, 20, iters=2, sampled=True)
    assert row["sampling"] == "random" and row["step_ms"] > 0
    assert runner.num_compiled == compiled


def test_ab_times_the_kernels_and_their_xla_twin_on_one_pool():
    """With the Pallas backend (the interpreter here) the engine's step runs the decode
    matmul kernels; its twin (decode_matmuls=False) compiles the same step with XLA's GEMMs
    and borrows the one pool per call, so both steps read the same pages."""
    from jpaged.bench.decode_rows import row_order, time_decode_ab, xla_twin

    engine = LLMEngine(EngineArgs(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                                  block_size=8, num_gpu_blocks_override=24,
                                  attention_backend="pallas"), loaded=tiny())
    runner = engine.runner
    assert runner.linears is not None
    twin = xla_twin(runner)
    assert twin is not None and twin.linears is None and twin.kv is None
    pool = runner.kv
    row = time_decode_ab(runner, twin, 4, 20, iters=2)
    assert row["ms_kernels"] == row["step_ms"] > 0 and row["ms_xla"] > 0
    assert row["xla_over_kernels"] == round(row["ms_xla"] / row["ms_kernels"], 3)
    assert row["decode_matmuls"] == "kernels"
    # The pool went back to the engine's runner (a new array: each step donates it).
    assert twin.kv is None and runner.kv is not None and runner.kv is not pool
    assert runner.num_compiled >= 1 and twin.num_compiled >= 1
    # The A/B batches (at most 64 rows) first, context by context, then the larger ones.
    assert row_order((1, 16, 64, 256), (1024, 4096), 64) == [
        (1, 1024), (16, 1024), (64, 1024), (1, 4096), (16, 4096), (64, 4096),
        (256, 1024), (256, 4096)]
    # The XLA backend runs no kernels: no twin.
    assert xla_twin(_xla_backend_runner()) is None


def _xla_backend_runner():
    return LLMEngine(EngineArgs(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                                block_size=8, num_gpu_blocks_override=24,
                                attention_backend="xla"), loaded=tiny()).runner
