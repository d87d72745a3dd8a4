"""The Pallas KV write (interpret mode) equals reference.write_kv bit for bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from pallas_kernels.kv_write import write_kv


def _bits(x: jax.Array) -> np.ndarray:
    """Raw bytes of an array, so fp8 and NaN compare exactly."""
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("dtype,hkv,heads_per_program", [
    (jnp.float32, 2, None),
    (jnp.bfloat16, 3, None),
    (jnp.float8_e4m3fn, 4, 1),
    (jnp.float8_e5m2, 3, 1),
])
def test_write_matches_reference(dtype, hkv, heads_per_program):
    rng = np.random.default_rng(hkv)
    nb, bs, d, t = 6, 4, 64, 7
    k_pages = jnp.asarray(rng.standard_normal((nb, bs, hkv, d)), dtype)
    v_pages = jnp.asarray(rng.standard_normal((nb, bs, hkv, d)), dtype)
    # Large values saturate fp8; padding (-1) and an out-of-range slot write nothing.
    k = jnp.asarray(rng.standard_normal((t, hkv, d)) * 300, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((t, hkv, d)) * 3, jnp.float32)
    slots = jnp.array([5, -1, nb * bs - 1, 0, -1, 17, nb * bs], jnp.int32)
    want = reference.write_kv(k_pages, v_pages, k, v, slots, 0.5, 2.0)
    fn = functools.partial(write_kv, interpret=True, heads_per_program=heads_per_program)
    got = jax.jit(fn, donate_argnums=(0, 1))(k_pages.copy(), v_pages.copy(), k, v, slots,
                                             0.5, 2.0)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(_bits(g), _bits(w))


def test_padding_never_clobbers_and_traced_scales():
    k_pages = jnp.full((4, 2, 1, 64), 1.0, jnp.float8_e4m3fn)
    new = jnp.full((3, 1, 64), 7.0)
    scale = jnp.float32(2.0)  # a traced scale, as the engine keeps it in the cache pytree
    kp, vp = jax.jit(functools.partial(write_kv, interpret=True))(
        k_pages, k_pages, new, new, jnp.array([3, -1, -1]), scale, scale)
    flat = np.asarray(kp, np.float32).reshape(8, 64)
    assert (flat[3] == 3.5).all()
    assert (np.delete(flat, 3, axis=0) == 1).all()
