"""The Pallas decode kernel (interpret mode) equals the reference and jax's own paged kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
from paged_case import make_case, rel_err, tolerance

from pallas_kernels import reference
from pallas_kernels.paged_attention import (
    default_pages_per_partition,
    merge_partitions,
    paged_decode_attention,
    partition_active,
)

BS = 4
# Ragged lengths: 1, block-1, block, block+1 and long (several partitions).
LENGTHS = [1, BS - 1, BS, BS + 1, 45]


def _decode_case(seed, hq, hkv, d, page_dtype, q_dtype, lengths=LENGTHS, **kw):
    rng = np.random.default_rng(seed)
    return make_case(rng, [(n, 1) for n in lengths], bs=BS, hq=hq, hkv=hkv, d=d,
                     page_dtype=page_dtype, q_dtype=q_dtype, pad_seqs=1, pad_tokens=1, **kw)


CASES = [
    # (hq, hkv, d, page dtype, q dtype, options)
    (4, 4, 64, jnp.float32, jnp.float32, {}),
    (6, 2, 128, jnp.bfloat16, jnp.bfloat16, {"soft_cap": 5.0}),
    (8, 1, 64, jnp.float8_e4m3fn, jnp.bfloat16, {"k_scale": 0.5, "v_scale": 2.0}),
    (6, 2, 64, jnp.float8_e5m2, jnp.float32, {"sliding_window": 7, "k_scale": 0.25}),
    (8, 1, 128, jnp.float32, jnp.float32,
     {"soft_cap": 3.0, "sliding_window": 9, "pages_per_partition": 1, "pages_per_block": 1}),
]


@pytest.mark.parametrize("hq,hkv,d,page_dtype,q_dtype,opts", CASES,
                         ids=lambda x: getattr(x, "__name__", None))
def test_decode_matches_reference(hq, hkv, d, page_dtype, q_dtype, opts):
    opts = dict(opts)
    scales = {k: opts.pop(k) for k in ("k_scale", "v_scale") if k in opts}
    case = _decode_case(hq * 10 + d, hq, hkv, d, page_dtype, q_dtype, **scales)
    tuning = {k: opts.pop(k) for k in ("pages_per_partition", "pages_per_block") if k in opts}
    args = (case.q, case.k_pages, case.v_pages, case.seq_lens, case.tables)
    fn = functools.partial(paged_decode_attention, interpret=True, **opts, **scales, **tuning)
    got = jax.jit(fn)(*args)
    want = jax.jit(functools.partial(reference.paged_decode_attention, **opts, **scales))(*args)
    assert got.shape == case.q.shape and got.dtype == case.q.dtype
    assert rel_err(got, want) < tolerance(q_dtype, page_dtype)
    assert not np.asarray(got[-1], np.float32).any()  # the padded sequence (seq_len 0) is 0


def test_merge_partitions_ignores_inactive_partitions():
    acc = jnp.array([[[[[2.0]], [[jnp.nan]]]]])  # [B=1, K=1, P=2, G=1, D=1]; P1 never stored
    m = jnp.array([[[[1.0], [jnp.inf]]]])
    l_ = jnp.array([[[[4.0], [jnp.nan]]]])
    on = jnp.array([[True, False]])
    np.testing.assert_allclose(merge_partitions(acc, m, l_, on), [[[[0.5]]]])
    empty = merge_partitions(acc, m, l_, jnp.zeros_like(on))  # a sequence of length 0
    assert not np.asarray(empty).any()


@pytest.mark.parametrize("window", [None, 1, 5, 13])
def test_partition_active_is_any_visible_key(window):
    part_keys, step_keys, parts = 16, 8, 5
    lens = jnp.arange(0, parts * part_keys + 1, dtype=jnp.int32)
    got = np.asarray(partition_active(lens, parts, part_keys, step_keys, window))
    for n in range(len(lens)):
        first = 0 if window is None else max(0, n - window)
        want = [p * part_keys < n and (p + 1) * part_keys > first for p in range(parts)]
        assert list(got[n]) == want, (n, window)


def test_default_partitioning_is_valid():
    for batch, heads, blocks in [(1, 8, 32), (64, 8, 256), (128, 8, 1024), (3, 1, 5)]:
        ppp = default_pages_per_partition(batch, heads, blocks, 8)
        assert ppp % 8 == 0 and ppp & (ppp - 1) == 0


def test_decode_matches_jax_paged_attention(hq=8, hkv=2, soft_cap=4.0):
    """jax.experimental.pallas.ops.gpu.paged_attention, pages transposed to its layout."""
    d, max_blocks = 64, 16
    case = _decode_case(hq, hq, hkv, d, jnp.float32, jnp.float32,
                        lengths=[1, BS - 1, BS + 1, 45, 64], max_blocks=max_blocks)
    args = (case.q, case.k_pages, case.v_pages, case.seq_lens, case.tables)
    ours = jax.jit(functools.partial(paged_decode_attention, interpret=True,
                                     soft_cap=soft_cap))(*args)
    # jax's kernel does not scale q; pre-scale it. Its layout is [kv_heads, blocks, bs, d].
    theirs = jax_paged.paged_attention(
        case.q / np.sqrt(d), case.k_pages.transpose(2, 0, 1, 3),
        case.v_pages.transpose(2, 0, 1, 3), case.tables, case.seq_lens,
        k_splits=4, pages_per_compute_block=2, interpret=True, attn_logits_soft_cap=soft_cap)
    real = np.asarray(case.seq_lens) > 0  # jax's kernel is undefined for empty sequences
    assert rel_err(ours[real], theirs[real]) < 1e-5
