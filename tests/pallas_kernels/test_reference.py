"""The reference paged attention equals plain dense causal attention per sequence."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.reference import (
    dequantize,
    quantize,
    ragged_paged_attention,
    write_kv,
)


def _dense(q, k, v, pos0, soft_cap=None, window=None):
    """q: [Q,hq,d] at positions pos0..; k,v: [L,hkv,d]."""
    hq, d = q.shape[1], q.shape[2]
    g = hq // k.shape[1]
    k = np.repeat(k, g, axis=1)
    v = np.repeat(v, g, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    qp = pos0 + np.arange(q.shape[0])
    kp = np.arange(k.shape[0])
    mask = kp[None, :] <= qp[:, None]
    if window is not None:
        mask &= kp[None, :] > qp[:, None] - window
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


def _build(rng, seqs, bs, hq, hkv, d, num_blocks, max_blocks, dtype=jnp.float32, pad_tokens=3,
           pad_seqs=1):
    """seqs: list of (seq_len, q_len). Returns inputs and the dense K/V/Q per sequence."""
    perm = rng.permutation(np.arange(1, num_blocks))
    k_pages = jnp.zeros((num_blocks, bs, hkv, d), dtype)
    v_pages = jnp.zeros((num_blocks, bs, hkv, d), dtype)
    tables = np.zeros((len(seqs) + pad_seqs, max_blocks), np.int32)
    qsl = [0]
    qs, ks, vs, slots = [], [], [], []
    used = 0
    for b, (L, ql) in enumerate(seqs):
        nblk = (L + bs - 1) // bs
        tables[b, :nblk] = perm[used:used + nblk]
        used += nblk
        k = rng.standard_normal((L, hkv, d)).astype(np.float32)
        v = rng.standard_normal((L, hkv, d)).astype(np.float32)
        ks.append(k)
        vs.append(v)
        qs.append(rng.standard_normal((ql, hq, d)).astype(np.float32))
        slot = np.array([tables[b, p // bs] * bs + p % bs for p in range(L)], np.int32)
        slots.append(slot)
        qsl.append(qsl[-1] + ql)
    allk = np.concatenate(ks)
    allv = np.concatenate(vs)
    alls = np.concatenate(slots)
    k_pages, v_pages = write_kv(k_pages, v_pages, jnp.asarray(allk), jnp.asarray(allv),
                                jnp.asarray(alls))
    qsl += [qsl[-1]] * pad_seqs
    q = np.concatenate(qs + [rng.standard_normal((pad_tokens, hq, d)).astype(np.float32)])
    seq_lens = np.array([s[0] for s in seqs] + [0] * pad_seqs, np.int32)
    return (jnp.asarray(q), k_pages, v_pages, jnp.asarray(np.array(qsl, np.int32)),
            jnp.asarray(seq_lens), jnp.asarray(tables)), (qs, ks, vs)


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (9, 3, 64), (8, 1, 32)])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_reference_matches_dense(hq, hkv, d, kind):
    rng = np.random.default_rng(hq * 7 + d)
    bs = 4
    if kind == "decode":
        seqs = [(1, 1), (bs - 1, 1), (bs, 1), (bs + 1, 1), (37, 1)]
    else:
        seqs = [(9, 9), (bs + 1, 1), (40, 7), (bs, bs), (3, 1), (70, 33)]
    inputs, (qs, ks, vs) = _build(rng, seqs, bs, hq, hkv, d, num_blocks=64, max_blocks=20,
                                  pad_seqs=1 if kind == "mixed" else 0,
                                  pad_tokens=3 if kind == "mixed" else 0)
    out = np.asarray(jax.jit(ragged_paged_attention)(*inputs))
    start = 0
    for (L, ql), qn, kn, vn in zip(seqs, qs, ks, vs, strict=True):
        want = _dense(qn, kn, vn, L - ql)
        np.testing.assert_allclose(out[start:start + ql], want, atol=2e-5, rtol=1e-4)
        start += ql


def test_soft_cap_and_window():
    rng = np.random.default_rng(0)
    seqs = [(30, 30), (17, 1)]
    inputs, (qs, ks, vs) = _build(rng, seqs, 8, 4, 2, 16, 16, 8)
    out = np.asarray(ragged_paged_attention(*inputs, soft_cap=5.0, sliding_window=6))
    start = 0
    for (L, ql), qn, kn, vn in zip(seqs, qs, ks, vs, strict=True):
        want = _dense(qn * 3, kn, vn, L - ql, soft_cap=5.0, window=6)
        got = np.asarray(ragged_paged_attention(*(inputs[0] * 3,) + inputs[1:], soft_cap=5.0,
                                                sliding_window=6))
        np.testing.assert_allclose(got[start:start + ql], want, atol=2e-5, rtol=1e-4)
        start += ql
    assert out.shape == inputs[0].shape


def test_write_kv_padding_never_clobbers():
    k_pages = jnp.ones((4, 2, 1, 2))
    v_pages = jnp.ones((4, 2, 1, 2))
    k = jnp.full((3, 1, 2), 7.0)
    kp, vp = write_kv(k_pages, v_pages, k, k, jnp.array([3, -1, -1]))
    kp = np.asarray(kp)
    assert (kp.reshape(8, 2)[3] == 7).all()
    assert (np.delete(kp.reshape(8, 2), 3, axis=0) == 1).all()


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_roundtrip_with_scale(dtype):
    x = jnp.linspace(-30, 30, 101)
    y = dequantize(quantize(x, dtype, 0.5), 0.5)
    rel = float(jnp.max(jnp.abs(y - x) / jnp.maximum(jnp.abs(x), 1.0)))
    assert rel < (0.07 if dtype == jnp.float8_e4m3fn else 0.13)
    big = dequantize(quantize(jnp.array([1e6]), dtype, 1.0), 1.0)
    assert bool(jnp.isfinite(big).all())
