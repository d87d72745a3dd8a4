"""The verifying step of jpaged/bench/verify_rows.py: laid out as the engine's own verification
lays out the same requests (scheduler, the runner's persistent batch), beside
the plain decode step of the same sequences; its refusals and its timed row's fields."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "core"))
from core_sim import make_scheduler  # noqa: E402

from jpaged.bench.verify_rows import (  # noqa: E402
    pack_verify,
    parse_cases,
    time_verify,
    verify_pair,
    verify_requests,
    verify_scheduled,
    verify_table,
)
from jpaged.request import Request  # noqa: E402
from jpaged.runner.batch import BucketPlan  # noqa: E402
from jpaged.runner.input_batch import InputBatch  # noqa: E402

VOCAB = 1000


def _layout(packed, context_len: int, batch: int, k: int, bs: int) -> None:
    """Sequence i: k + 1 new tokens at positions context_len - 1 .. context_len - 1 + k on its
    own block table, seq_len context_len + k, a K/V slot for every token; a sampled row at
    every token (k = 0: the plain decode step, one token and row a sequence)."""
    b, rows = packed.batch, batch * (k + 1)
    assert packed.num_seqs == batch and packed.num_tokens == packed.num_rows == rows
    assert packed.flags.decode_only == (k == 0)
    pos = np.tile(np.arange(context_len - 1, context_len + k), batch)
    assert (b.positions[:rows] == pos).all()
    assert (b.seq_lens[:batch] == context_len + k).all() and (b.seq_lens[batch:] == 0).all()
    assert (b.slot_mapping[rows:] == -1).all()
    assert (b.query_start_loc[:batch + 1] == np.arange(batch + 1) * (k + 1)).all()
    assert (b.query_start_loc[batch:] == rows).all()
    tables = b.block_tables[:batch]
    assert len({tuple(t) for t in tables}) == batch  # tables distinct
    seq = np.repeat(np.arange(batch), k + 1)
    assert (b.slot_mapping[:rows] == tables[seq, pos // bs] * bs + pos % bs).all()
    assert len(set(b.slot_mapping[:rows].tolist())) == rows  # a slot for every token
    assert (b.logits_indices[:rows] == np.arange(rows)).all()


@pytest.mark.parametrize(("batch", "k"), [(1, 3), (2, 2)])
def test_layout_is_the_engines_own_verification(batch, k):
    """The same requests through the scheduler (prefill, one token, then k proposals each)
    and the runner's path (the persistent InputBatch) pack the same arrays,
    field for field, as the bench's requests on the blocks the scheduler chose."""
    ctx, bs = 10, 4
    ours = verify_requests(batch, k, ctx, VOCAB, seed=3)
    sched = make_scheduler(64, block_size=bs, max_num_seqs=batch, max_model_len=64)
    sched.max_rows = batch * (k + 1)
    theirs = [Request(r.request_id, r.prompt_token_ids, r.sampling_params) for r in ours]
    for r in theirs:
        sched.add_request(r)
    out = sched.schedule()  # the prefill of context_len - 1 tokens, then the first token
    sched.update_from_output(out, [r.output_token_ids[0] for r in ours],
                             first_rows=list(range(batch)))
    for a, b in zip(theirs, ours, strict=True):
        assert a.all_token_ids == b.all_token_ids
        assert a.num_computed_tokens == b.num_computed_tokens == ctx - 1
        a.spec_token_ids = list(b.spec_token_ids)
    out = sched.schedule()
    assert [len(s.spec_token_ids) for s in out.scheduled] == [k] * batch
    plan = BucketPlan(batch, 64, 64, bs, num_speculative_tokens=k)
    want = InputBatch(plan, bs, VOCAB, default_seed=5).pack(out.scheduled)
    ids = np.asarray([s.block_ids[0] for s in out.scheduled])
    got = pack_verify(verify_scheduled(ours, ids), plan, bs, VOCAB, 5)
    assert (got.num_seqs, got.num_tokens, got.num_rows, got.flags, got.first_rows) == (
        want.num_seqs, want.num_tokens, want.num_rows, want.flags, want.first_rows)
    assert got.first_rows == list(range(0, batch * (k + 1), k + 1))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got.batch),
                            jax.tree_util.tree_leaves(want.batch), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    _layout(got, ctx, batch, k, bs)
    # The RNG counters count the proposals before each row (after the one output token).
    assert got.batch.sampling.counters[:batch * (k + 1)].tolist() == list(range(1, k + 2)) * batch


def test_pair_on_a_runner_and_its_refusals(runner):
    verify, decode = verify_pair(runner, 1, 3, 20)
    _layout(verify, 20, 1, 3, 8)
    _layout(decode, 20, 1, 0, 8)
    # The runner's decode bucket of 4 rows, one sequence; the decode step one row.
    assert verify.batch.input_ids.shape[0] == verify.batch.logits_indices.shape[0] == 4
    assert verify.batch.seq_lens.shape[0] == 1
    assert decode.batch.input_ids.shape[0] == 1
    # The same sequence on the same blocks; the decode step's table lacks no block it reads.
    assert (decode.batch.block_tables[0, :3] == verify.batch.block_tables[0, :3]).all()
    assert (verify.batch.sampling.temperature == 0).all()
    with pytest.raises(ValueError, match="largest decode bucket is 4"):
        verify_pair(runner, 2, 3, 20)
    with pytest.raises(ValueError, match="block tables hold 8"):
        verify_pair(runner, 1, 3, 62)
    with pytest.raises(ValueError, match=r"4 x 48 tokens need 24 blocks; the pool has 23"):
        verify_pair(runner, 4, 0, 48)


def test_timed_row_and_its_table(runner):
    row = time_verify(runner, 1, 3, 20, iters=2)
    assert (row["batch"], row["k"], row["rows"], row["bucket"], row["context_len"]) == (
        1, 3, 4, 4, 20)
    assert row["verify_ms"] > 0 and row["decode_ms"] > 0 and row["iters"] == 2
    assert row["ratio"] == row["break_even_accepted"] == round(
        row["verify_ms"] / row["decode_ms"], 3)
    again = time_verify(runner, 1, 3, 20, iters=1)
    assert again["new_programs"] == 0  # compiled by the first: the same programs
    lines = verify_table([{"kv_cache_dtype": "bfloat16", **row},
                          {"kv_cache_dtype": "bfloat16", "batch": 9, "k": 9,
                           "context_len": 20, "skipped": "time budget"}])
    assert len(lines) == 3 and "break-even" in lines[0] and "skipped: time budget" in lines[2]


def test_parse_cases():
    assert parse_cases("1x1, 1x3,16x3") == ((1, 1), (1, 3), (16, 3))
    for bad in ("1x0", "3", "ax2"):
        with pytest.raises(ValueError, match="BxK"):
            parse_cases(bad)
