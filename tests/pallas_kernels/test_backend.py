"""select_backend gives the Pallas kernels and the XLA attention with the reference's signatures."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_case import make_case, rel_err

from pallas_kernels import select_backend


def test_backend_names():
    assert select_backend("auto", "cpu").name == "xla"
    assert select_backend("reference", "cpu").name == "reference"
    assert select_backend("auto", "gpu").name == "pallas"
    assert select_backend("pallas", "cpu").name == "pallas"
    with pytest.raises(ValueError, match="attention_backend"):
        select_backend("triton", "cpu")


def test_pallas_step_matches_reference_step():
    """An engine-like jitted step (write the new K/V, donate the cache, attend) on both."""
    rng = np.random.default_rng(0)
    bs, hq, hkv, d = 4, 4, 2, 64
    seqs = [(6, 6), (9, 1), (13, 4)]  # the last q_len tokens of each are this step's new tokens
    case = make_case(rng, seqs, bs=bs, hq=hq, hkv=hkv, d=d, page_dtype=jnp.float8_e4m3fn,
                     pad_seqs=1, pad_tokens=2, k_scale=0.5, v_scale=0.5)
    t = case.q.shape[0]
    new_k = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.float32)
    new_v = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.float32)
    slots = []
    for b, (seq_len, q_len) in enumerate(seqs):
        slots += [int(case.tables[b, p // bs]) * bs + p % bs
                  for p in range(seq_len - q_len, seq_len)]
    slots = jnp.asarray(slots + [-1] * (t - len(slots)), jnp.int32)

    outs = {}
    for name in ("reference", "pallas", "xla"):
        ops = select_backend(name, "cpu")

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(kp, vp, q, qsl, lens, tables, ops=ops):
            kp, vp = ops.write_kv(kp, vp, new_k, new_v, slots, 0.5, 0.5)
            out = ops.ragged_paged_attention(q, kp, vp, qsl, lens, tables, soft_cap=20.0,
                                             k_scale=0.5, v_scale=0.5)
            return kp, vp, out

        outs[name] = step(case.k_pages.copy(), case.v_pages.copy(), case.q, case.qsl,
                          case.seq_lens, case.tables)
    ref = outs["reference"]
    for other in (outs["pallas"], outs["xla"]):
        for a, b in zip(ref[:2], other[:2], strict=True):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                          np.asarray(b).view(np.uint8))
        assert rel_err(other[2], ref[2]) < 2e-5
