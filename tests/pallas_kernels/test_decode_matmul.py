"""The weight-streaming decode matmuls (interpret mode) against their jnp twins, on random
shapes: 1 to 300 rows, sizes that are odd multiples of a power of two (576 = 9 x 64, as
SmolLM2), bf16 and float32, with and without the norm prologue, biases and the residual."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import decode_matmul as dm
from pallas_kernels import reference as ref

SETTINGS = settings(max_examples=4, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
ROWS = st.one_of(st.integers(1, 20), st.sampled_from([64, 65, 127, 300]))
SIZES = st.sampled_from([16, 48, 64, 96, 192, 576])
DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16])


def _tol(dtype: jnp.dtype) -> dict:
    # bf16: the kernel and XLA may accumulate in another order and round one ulp apart.
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == jnp.float32 else {"atol": 0.06, "rtol": 0.02}


def _arrays(seed: int, dtype: jnp.dtype, *shapes: tuple[int, ...]) -> list[jax.Array]:
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    # Weights ~ 1/sqrt(K) keep outputs O(1) whatever K, so one tolerance fits every shape.
    return [(jax.random.normal(k, s) / (np.sqrt(s[0]) if len(s) == 2 else 1)).astype(dtype)
            for k, s in zip(keys, shapes, strict=True)]


def _close(got: jax.Array, want: jax.Array, dtype: jnp.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **_tol(dtype))


@SETTINGS
@given(rows=ROWS, k=SIZES, n1=SIZES, n2=SIZES, dtype=DTYPES, norm=st.sampled_from([None, 0, 1]),
       bias=st.booleans())
def test_projections_match_reference(rows, k, n1, n2, dtype, norm, bias):
    x, g, w1, w2, w3, b1, b3 = _arrays(rows * k, dtype, (rows, k), (k,), (k, n1), (k, n2),
                                       (k, n2), (n1,), (n2,))
    biases = [b1, None, b3] if bias else None
    kw = {} if norm is None else {"norm_weight": g, "norm_eps": 1e-5, "norm_offset": float(norm)}
    got = dm.projections(x, [w1, w2, w3], biases, interpret=True, **kw)
    want = ref.projections(x, [w1, w2, w3], biases, **kw)
    for a, b in zip(got, want, strict=True):
        _close(a, b, dtype)


@SETTINGS
@given(rows=ROWS, k=SIZES, n=SIZES, dtype=DTYPES, act=st.sampled_from(dm.ACTIVATIONS),
       offset=st.sampled_from([0.0, 1.0]), bias=st.booleans())
def test_gated_up_matches_reference(rows, k, n, dtype, act, offset, bias):
    x, g, wg, wu, bg, bu = _arrays(rows + n, dtype, (rows, k), (k,), (k, n), (k, n), (n,), (n,))
    b = (bg, bu) if bias else (None, None)
    kw = {"act": act, "norm_weight": g, "norm_eps": 1e-6, "norm_offset": offset}
    _close(dm.gated_up(x, wg, wu, *b, interpret=True, **kw), ref.gated_up(x, wg, wu, *b, **kw),
           dtype)


@SETTINGS
@given(rows=ROWS, k=SIZES, n=SIZES, dtype=DTYPES, bias=st.booleans())
def test_projection_residual_matches_reference(rows, k, n, dtype, bias):
    x, w, r, b = _arrays(rows * 7 + k, dtype, (rows, k), (k, n), (rows, n), (n,))
    b = b if bias else None
    _close(dm.projection_residual(x, w, r, b, interpret=True),
           ref.projection_residual(x, w, r, b), dtype)


def test_rows_past_the_batch_are_never_written():
    """Rows of a partial row block are masked: outputs hold exactly the batch's rows."""
    x, w = _arrays(3, jnp.float32, (70, 64), (64, 32))
    got = dm.projections(x, [w], interpret=True)[0]
    assert got.shape == (70, 32)
    np.testing.assert_allclose(got, ref.linear(x, w), atol=1e-5, rtol=1e-5)


def test_plan_fills_the_gpu_and_divides_the_shapes():
    # Llama-3-8B's q/k/v at batch 1: 6144 columns in 32-wide slabs, 192 programs.
    p = dm.plan_stream(1, 4096, [4096, 1024, 1024], 2)
    assert (p.block_m, p.block_n) == (16, 32) and 4096 % p.block_k == 0
    # Slabs stay >= 64 bytes wide; narrower only while the launch would leave SMs idle.
    for ns in ([14336], [4096], [512]):
        p = dm.plan_stream(1, 4096, ns, 2, weights_per_program=2)
        assert p.block_n >= 32 and (sum(ns) // p.block_n >= 264 or p.block_n == 32)
    assert dm.plan_stream(1, 4096, [65536], 2).block_n == 128
    # Rows beyond one block: 64-row tiles.
    assert dm.plan_stream(256, 4096, [4096], 2).block_m == 64
    # SmolLM2: 576 = 9 x 64 columns take 64-wide slabs at most... and 32 when few programs.
    p = dm.plan_stream(4, 576, [576, 192, 192], 4)
    assert 576 % p.block_n == 0 and 192 % p.block_n == 0 and 576 % p.block_k == 0
    with pytest.raises(ValueError, match="do not divide"):
        dm.plan_stream(1, 576, [576], 4, block_k=512)


@pytest.mark.parametrize("k,ns,dtype,why", [
    (4096, [4096], jnp.bfloat16, None),
    (4095, [4096], jnp.bfloat16, "input size 4095"),
    (4096, [4104], jnp.bfloat16, "output size 4104"),
    (4096, [4096], jnp.int8, "weight dtype int8"),
])
def test_unsupported_names_the_shape(k, ns, dtype, why):
    got = dm.unsupported(1, k, ns, dtype)
    assert got is None if why is None else why in got


def test_bad_arguments_are_refused():
    x, w = _arrays(0, jnp.float32, (2, 64), (64, 32))
    with pytest.raises(ValueError, match="activation 'relu'"):
        dm.gated_up(x, w, w, act="relu", interpret=True)
    with pytest.raises(ValueError, match="does not take inputs of size 64"):
        dm.projections(x, [w.T], interpret=True)
    with pytest.raises(ValueError, match="residual"):
        dm.projection_residual(x, w, x, interpret=True)


@SETTINGS
@given(rows=ROWS, k=SIZES, head_dim=st.sampled_from([32, 64, 128]), hq=st.integers(1, 6),
       hkv=st.integers(1, 3), dtype=DTYPES, bias=st.booleans())
def test_rope_in_the_epilogue_matches_reference(rows, k, head_dim, hq, hkv, dtype, bias):
    """q and k rotated in the kernel's epilogue (RoPE pairs d, d + head_dim/2 of each head);
    v untouched."""
    x, g, wq, wk, wv, bq, bk = _arrays(rows + hq, dtype, (rows, k), (k,), (k, hq * head_dim),
                                       (k, hkv * head_dim), (k, hkv * head_dim),
                                       (hq * head_dim,), (hkv * head_dim,))
    pos = jnp.arange(rows) * 37 + 5
    inv = 1.0 / (10000.0 ** (jnp.arange(0, head_dim, 2) / head_dim))
    rope = (jnp.cos(pos[:, None] * inv), jnp.sin(pos[:, None] * inv))
    ns = [hq * head_dim, hkv * head_dim, hkv * head_dim]
    assert dm.rope_fits(head_dim, ns)
    kw = {"norm_weight": g, "norm_eps": 1e-5, "rope": rope, "rope_outputs": 2,
          "head_dim": head_dim}
    biases = [bq, bk, None] if bias else None
    got = dm.projections(x, [wq, wk, wv], biases, interpret=True, **kw)
    want = ref.projections(x, [wq, wk, wv], biases, **kw)
    for a, b in zip(got, want, strict=True):
        _close(a, b, dtype)


def test_rope_fits_only_half_heads_of_16_columns_or_more():
    assert dm.rope_fits(64, [576, 192, 192]) and dm.rope_fits(128, [4096, 1024, 1024])
    assert not dm.rope_fits(16, [64, 32, 32])  # half a head is 8 columns
    assert not dm.rope_fits(64, [576, 16 * 3, 192])  # an output of 3 x 16 columns


@pytest.mark.parametrize("rows,dtype", [(1, jnp.float32), (19, jnp.bfloat16), (70, jnp.float32)])
def test_transposed_weights_give_the_same_results(rows, dtype):
    """[N, K] weights (K contiguous: the layout the device check times beside [K, N]) through
    every launch kind: q/k/v with norm and RoPE, gate/up, the residual projection."""
    k, d = 192, 64
    x, g, wq, wk, wu, r, bq = _arrays(rows, dtype, (rows, k), (k,), (k, 2 * d), (k, d), (k, d),
                                      (rows, d), (2 * d,))
    ang = jnp.arange(rows)[:, None] * (1.0 / 10000.0 ** (jnp.arange(0, d, 2) / d))
    kw = {"norm_weight": g, "rope": (jnp.cos(ang), jnp.sin(ang)), "rope_outputs": 2,
          "head_dim": d}
    want = ref.projections(x, [wq, wk, wk], [bq, None, None], **kw)
    got = dm.projections(x, [wq.T, wk.T, wk.T], [bq, None, None], transposed=True,
                         interpret=True, **kw)
    for a, b in zip(got, want, strict=True):
        _close(a, b, dtype)
    _close(dm.gated_up(x, wk.T, wu.T, norm_weight=g, transposed=True, interpret=True),
           ref.gated_up(x, wk, wu, norm_weight=g), dtype)
    _close(dm.projection_residual(x, wk.T, r, transposed=True, interpret=True),
           ref.projection_residual(x, wk, r), dtype)


@pytest.mark.parametrize("dtype,page_dtype,rows,head_dim,hkv,offset", [
    (jnp.float32, jnp.float32, 3, 64, 3, 0),
    (jnp.bfloat16, jnp.bfloat16, 19, 128, 2, 40),
    (jnp.bfloat16, jnp.float8_e4m3fn, 70, 32, 1, 8),
])
def test_kv_write_in_the_qkv_launch_matches_kv_write(dtype, page_dtype, rows, head_dim, hkv,
                                                     offset):
    """k (after RoPE) and v go into the pages at their slots (+ the layer's offset; -1 writes
    nothing; fp8 quantized by the scales) exactly as kv_write's reference stores them, every
    other slot keeps its bytes, and q, k, v come out as without the write."""
    k, hq, nb, bs = 96, 2 * hkv, 24, 4
    x, g, wq, wk, wv = _arrays(rows, dtype, (rows, k), (k,), (k, hq * head_dim),
                               (k, hkv * head_dim), (k, hkv * head_dim))
    pages = _arrays(7, jnp.float32, (nb, bs, hkv, head_dim), (nb, bs, hkv, head_dim))
    pages = tuple(p.astype(page_dtype) for p in pages)
    rng = np.random.default_rng(rows)
    slots = rng.choice(np.arange(bs, nb * bs - offset), rows, replace=False).astype(np.int32)
    slots[::4] = -1  # padding rows
    ang = jnp.arange(rows)[:, None] * (1.0 / 10000.0 ** (jnp.arange(0, head_dim, 2) / head_dim))
    kw = {"norm_weight": g, "rope": (jnp.cos(ang), jnp.sin(ang)), "rope_outputs": 2,
          "head_dim": head_dim}
    scales = (0.5, 2.0)
    at = jnp.asarray(np.where(slots < 0, -1, slots + offset))  # the layer's region added
    q, kk, v, kp, vp = dm.projections(x, [wq, wk, wv], kv_pages=pages, kv_slots=at,
                                      kv_scales=scales, interpret=True, **kw)
    want = ref.projections(x, [wq, wk, wv], **kw)
    for a, b in zip((q, kk, v), want, strict=True):
        _close(a, b, dtype)
    wk_, wv_ = (y.reshape(rows, hkv, head_dim) for y in (kk, v))
    kr, vr = ref.write_kv(*pages, wk_, wv_, at, *scales)
    written = np.zeros((nb, bs), bool)
    written.flat[np.asarray(at)[np.asarray(at) >= 0]] = True
    for a, b in ((kp, kr), (vp, vr)):
        assert a.dtype == b.dtype
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # Every other slot keeps its bytes.
        np.testing.assert_array_equal(a32[~written], b32[~written])
        # The written rows: the value the launch returns, to one rounding of the page dtype.
        # Interpreted, XLA:CPU may evaluate RoPE once for the output and once for the store
        # (x1 cos - x2 sin: a few float32 ulps of the operands apart); a wrong slot, scale or
        # rotation is off by far more.
        np.testing.assert_allclose(a32[written], b32[written],
                                   rtol=float(jnp.finfo(page_dtype).eps),
                                   atol=4 * float(jnp.finfo(jnp.float32).eps)
                                   * float(np.abs(b32[written]).max()))
