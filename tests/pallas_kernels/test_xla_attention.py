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
