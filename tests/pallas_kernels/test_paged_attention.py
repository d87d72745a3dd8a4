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
    merge_chunk,
    merge_partials,
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


# Several partitions of 2 pages (8 keys) each: the merge kernel runs (one partition: jnp).
MULTI_PARTITION_CASES = [
    (6, 2, 64, jnp.bfloat16, jnp.bfloat16, {}),  # G = 3: rows padded to 16, 3 stored
    (8, 1, 64, jnp.float8_e4m3fn, jnp.bfloat16, {"k_scale": 0.5, "v_scale": 2.0}),
    (4, 2, 64, jnp.float32, jnp.float32, {"sliding_window": 11, "soft_cap": 4.0}),
]


@pytest.mark.parametrize("hq,hkv,d,page_dtype,q_dtype,opts", MULTI_PARTITION_CASES,
                         ids=lambda x: getattr(x, "__name__", None))
def test_decode_over_several_partitions_matches_reference(hq, hkv, d, page_dtype, q_dtype,
                                                          opts):
    opts = dict(opts)
    scales = {k: opts.pop(k) for k in ("k_scale", "v_scale") if k in opts}
    case = _decode_case(hq * 7 + d, hq, hkv, d, page_dtype, q_dtype, **scales)
    args = (case.q, case.k_pages, case.v_pages, case.seq_lens, case.tables)
    fn = functools.partial(paged_decode_attention, interpret=True, pages_per_partition=2,
                           pages_per_block=1, **opts, **scales)
    assert "paged_merge_pk8" in str(jax.make_jaxpr(fn)(*args))  # 12 pages: 6 partitions
    got = jax.jit(fn)(*args)
    want = jax.jit(functools.partial(reference.paged_decode_attention, **opts, **scales))(*args)
    assert got.shape == case.q.shape and got.dtype == case.q.dtype
    assert rel_err(got, want) < tolerance(q_dtype, page_dtype)
    assert not np.asarray(got[-1], np.float32).any()  # the padded sequence (seq_len 0) is 0


@pytest.mark.parametrize("window", [None, 6, 17])
def test_merge_kernel_reads_only_partitions_with_keys(window):
    """Partials of partitions without a visible key hold NaN (never stored, so anything): the
    kernel's result equals the jnp merge of the active ones, and is finite. 12 partitions of 4
    keys, merged 4 at a time: the active ones start and end inside a chunk."""
    b, k, parts, rows, g, d, part_keys = 6, 2, 12, 16, 3, 32, 4
    assert merge_chunk(parts, g, d) == 4
    rng = np.random.default_rng(3)
    lens = jnp.array([0, 1, 8, 9, 30, 48], jnp.int32)
    acc = rng.normal(size=(b, k, parts, rows, d)).astype(np.float32)
    m = rng.normal(size=(b, k, parts, rows)).astype(np.float32)
    lsum = rng.uniform(0.5, 2.0, size=(b, k, parts, rows)).astype(np.float32)
    on = np.asarray(partition_active(lens, parts, part_keys, part_keys, window))
    off = ~on[:, None, :]
    acc[np.broadcast_to(off[..., None, None], acc.shape)] = np.nan
    m[np.broadcast_to(off[..., None], m.shape)] = np.nan
    lsum[np.broadcast_to(off[..., None], lsum.shape)] = np.nan
    acc[:, :, :, g:], m[:, :, :, g:], lsum[:, :, :, g:] = np.nan, np.nan, np.nan  # padding rows
    got = merge_partials(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(lsum), lens, heads=g,
                         part_keys=part_keys, sliding_window=window, v_scale=0.5,
                         out_dtype=jnp.float32, interpret=True)
    want = 0.5 * merge_partitions(jnp.asarray(acc[:, :, :, :g]), jnp.asarray(m[:, :, :, :g]),
                                  jnp.asarray(lsum[:, :, :, :g]), jnp.asarray(on))
    assert got.shape == (b, k, g, d) and np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.asarray(got[0]).any()  # length 0: no partition, zeros


def test_merge_chunk_divides_the_partitions_and_bounds_the_block():
    assert merge_chunk(32, 4, 128) == 8  # the 8B at batch 1: 8 x 4 x 128 values
    assert merge_chunk(6, 4, 128) == 2 and merge_chunk(7, 4, 128) == 1
    assert merge_chunk(32, 4, 256) == 8 and merge_chunk(32, 16, 256) == 2
    assert merge_chunk(32, 64, 256) == 1  # one partition's rows already fill the budget


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
