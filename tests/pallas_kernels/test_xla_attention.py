"""The chunk-skipping XLA paged attention equals the reference on every kind of step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_case import make_case, rel_err

from pallas_kernels import reference, xla_attention

# (seq_len, q_len) per sequence: decode, prefill from scratch, chunked prefill over a cached
# prefix, and short sequences next to long ones (the ones the reference over-computes).
STEPS = {
    "decode": [(1, 1), (5, 1), (16, 1), (17, 1), (130, 1), (301, 1)],
    "prefill": [(97, 97), (33, 33), (8, 8)],
    "mixed": [(300, 300), (7, 1), (64, 17), (200, 1), (3, 3), (129, 40)],
}


@pytest.mark.parametrize("kind", sorted(STEPS))
# Short chunks and small groups (many loop iterations per tile), and the defaults.
@pytest.mark.parametrize("chunk_tokens,rows", [(16, 4), (128, None)])
def test_matches_reference(kind, chunk_tokens, rows):
    rng = np.random.default_rng(len(kind) * 31 + chunk_tokens + (rows or 0))
    case = make_case(rng, STEPS[kind], bs=8, hq=6, hkv=2, d=16, pad_seqs=2, pad_tokens=5)
    want = jax.jit(reference.ragged_paged_attention)(*case.ragged_args())
    fn = jax.jit(lambda *a: xla_attention.ragged_paged_attention(
        *a, chunk_tokens=chunk_tokens, rows_per_iter=rows))
    got = fn(*case.ragged_args())
    assert got.shape == want.shape
    assert rel_err(got, want) < 2e-6
    # Padding tokens (past query_start_loc[-1]) come back as zeros, as in the reference.
    n = int(case.qsl[-1])
    assert not np.asarray(got[n:]).any()


def test_soft_cap_window_and_fp8_scales():
    rng = np.random.default_rng(3)
    seqs = [(90, 90), (45, 1), (20, 6)]
    case = make_case(rng, seqs, bs=4, hq=4, hkv=4, d=8, page_dtype=jnp.float8_e4m3fn,
                     k_scale=0.5, v_scale=2.0)
    kw = dict(soft_cap=5.0, sliding_window=23, k_scale=0.5, v_scale=2.0)
    want = reference.ragged_paged_attention(*case.ragged_args(), **kw)
    got = xla_attention.ragged_paged_attention(*case.ragged_args(), chunk_tokens=8, **kw)
    assert rel_err(got, want) < 2e-6


def test_all_padding_step_is_zero():
    rng = np.random.default_rng(4)
    case = make_case(rng, [(5, 5)], bs=4, hq=2, hkv=1, d=8, pad_seqs=3)
    args = list(case.ragged_args())
    args[3] = jnp.zeros_like(args[3])  # no sequence has new tokens
    args[4] = jnp.zeros_like(args[4])
    out = xla_attention.ragged_paged_attention(*args)
    assert not np.asarray(out).any()


# Window edges against 4-token blocks: smaller than a block, one block, not a multiple of the
# block size, and longer than every context (no page skipped).
@pytest.mark.parametrize("window", [1, 3, 4, 6, 500])
@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_window_pages_out_of_reach_are_never_read(window, backend):
    """Pages wholly before every query's window hold NaN: the result equals the reference on
    clean pages, so those pages were skipped (a masked read would give 0 * NaN = NaN)."""
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention as pallas_rpa

    bs = 4
    seqs = [(37, 1), (23, 5), (9, 9), (30, 1)]  # decodes, a prefill chunk, a whole prefill
    case = make_case(np.random.default_rng(window), seqs, bs=bs, hq=4, hkv=2, d=8)
    want = reference.ragged_paged_attention(*case.ragged_args(), sliding_window=window)
    k, v, tables = np.array(case.k_pages), np.array(case.v_pages), np.asarray(case.tables)
    poisoned = 0
    for b, (seq_len, q_len) in enumerate(seqs):
        first_visible = max(seq_len - q_len - window + 1, 0)  # of the first new token
        for blk in range(first_visible // bs):
            k[tables[b, blk]] = v[tables[b, blk]] = np.nan
            poisoned += 1
    assert poisoned > 0 or window == 500
    args = list(case.ragged_args())
    args[1], args[2] = jnp.asarray(k), jnp.asarray(v)
    if backend == "xla":
        got = xla_attention.ragged_paged_attention(*args, sliding_window=window, chunk_tokens=bs)
    else:
        got = pallas_rpa(*args, sliding_window=window, pages_per_block=1, interpret=True)
    assert rel_err(got, want) < 2e-6
