"""The Pallas ragged (mixed prefill + decode) kernel, interpret mode, against the reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_case import make_case, rel_err, tolerance

from pallas_kernels import reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, tile_metadata

BS = 4
# (seq_len, q_len): whole-prompt prefill, decode at block+1, a chunk over a cached prefix, a
# block-exact prefill, a decode at block-1, a long chunk spanning several tiles, a 1-token prompt.
MIXED = [(9, 9), (BS + 1, 1), (40, 7), (BS, BS), (BS - 1, 1), (70, 33), (1, 1)]
DECODE = [(1, 1), (BS - 1, 1), (BS, 1), (BS + 1, 1), (45, 1)]

CASES = [
    # (seqs, hq, hkv, d, page dtype, q dtype, options)
    (MIXED, 4, 4, 64, jnp.float32, jnp.float32, {}),
    (MIXED, 6, 2, 128, jnp.bfloat16, jnp.bfloat16, {"soft_cap": 5.0}),
    (MIXED, 8, 1, 64, jnp.float8_e4m3fn, jnp.bfloat16,
     {"sliding_window": 6, "k_scale": 0.5, "v_scale": 2.0}),
    (MIXED, 6, 2, 64, jnp.float8_e5m2, jnp.float32,
     {"soft_cap": 4.0, "sliding_window": 11, "q_tile": 2, "pages_per_block": 1}),
    # Decode-shaped steps: through the decode kernel (fast path) and through the tiled kernel.
    (DECODE, 8, 1, 128, jnp.bfloat16, jnp.bfloat16, {"soft_cap": 5.0}),
    (DECODE, 6, 2, 64, jnp.float32, jnp.float32,
     {"sliding_window": 5, "decode_fast_path": False}),
    # The caller says which kind the step is (the engine's static flag): one kernel launched.
    (DECODE, 6, 2, 64, jnp.float8_e4m3fn, jnp.bfloat16,
     {"sliding_window": 6, "k_scale": 0.5, "decode_only": True}),
    (MIXED, 6, 2, 64, jnp.bfloat16, jnp.bfloat16, {"soft_cap": 5.0, "decode_only": False}),
    # The engine's pure decode step, T == B (two padding sequences, two padding tokens): the
    # decode kernel's rows are the result as they lie.
    (DECODE, 8, 2, 64, jnp.bfloat16, jnp.bfloat16, {"decode_only": True, "pad": (2, 2)}),
]
_KERNEL_ONLY = ("q_tile", "pages_per_block", "decode_fast_path", "decode_only")


@pytest.mark.parametrize("seqs,hq,hkv,d,page_dtype,q_dtype,opts", CASES,
                         ids=lambda x: getattr(x, "__name__", None))
def test_ragged_matches_reference(seqs, hq, hkv, d, page_dtype, q_dtype, opts):
    opts = dict(opts)
    scales = {k: opts.pop(k) for k in ("k_scale", "v_scale") if k in opts}
    tuning = {k: opts.pop(k) for k in _KERNEL_ONLY if k in opts}
    pad_seqs, pad_tokens = opts.pop("pad", (2, 3))
    rng = np.random.default_rng(hq * 100 + d)
    case = make_case(rng, seqs, bs=BS, hq=hq, hkv=hkv, d=d, page_dtype=page_dtype,
                     q_dtype=q_dtype, pad_seqs=pad_seqs, pad_tokens=pad_tokens, **scales)
    fn = functools.partial(ragged_paged_attention, interpret=True, **opts, **scales, **tuning)
    got = jax.jit(fn)(*case.ragged_args())
    want = jax.jit(functools.partial(reference.ragged_paged_attention, **opts, **scales))(
        *case.ragged_args())
    assert got.shape == case.q.shape and got.dtype == case.q.dtype
    assert rel_err(got, want) < tolerance(q_dtype, page_dtype)
    n_real = int(case.qsl[-1])
    assert not np.asarray(got[n_real:], np.float32).any()  # padding tokens are 0


def test_ragged_matches_dense_attention():
    """An independent check: plain causal attention per sequence, contiguous K/V."""
    rng = np.random.default_rng(7)
    seqs, hq, hkv, d = [(12, 12), (30, 5), (6, 1)], 4, 2, 64
    case = make_case(rng, seqs, bs=BS, hq=hq, hkv=hkv, d=d, pad_seqs=0, pad_tokens=0)
    got = np.asarray(jax.jit(functools.partial(ragged_paged_attention, interpret=True,
                                               q_tile=4))(*case.ragged_args()))
    k_all = np.asarray(case.k_pages).reshape(-1, hkv, d)
    v_all = np.asarray(case.v_pages).reshape(-1, hkv, d)
    for b, (seq_len, q_len) in enumerate(seqs):
        slots = [int(case.tables[b, p // BS]) * BS + p % BS for p in range(seq_len)]
        k = np.repeat(k_all[slots], hq // hkv, axis=1)
        v = np.repeat(v_all[slots], hq // hkv, axis=1)
        q = np.asarray(case.q[int(case.qsl[b]):int(case.qsl[b + 1])])
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        q_pos = seq_len - q_len + np.arange(q_len)
        s = np.where(np.arange(seq_len)[None, None] <= q_pos[None, :, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)
        np.testing.assert_allclose(got[int(case.qsl[b]):int(case.qsl[b + 1])], want,
                                   atol=2e-5, rtol=1e-4)


def test_tile_metadata():
    qsl = jnp.array([0, 5, 6, 6, 9], jnp.int32)  # q_len 5, 1, 0, 3
    seq_lens = jnp.array([5, 20, 0, 11], jnp.int32)
    meta = tile_metadata(qsl, seq_lens, q_tile=2, num_tiles=9)
    # Tiles: seq0 x3 (2, 2, 1 tokens), seq1 x1, seq3 x2 (2, 1), then 3 unused.
    np.testing.assert_array_equal(meta[:6, 0], [0, 0, 0, 1, 3, 3])
    np.testing.assert_array_equal(meta[:, 2], [2, 2, 1, 1, 2, 1, 0, 0, 0])
    np.testing.assert_array_equal(meta[:6, 1], [0, 2, 4, 19, 8, 10])
    # The first token's index in the flat batch: the kernel reads its q rows from there.
    np.testing.assert_array_equal(meta[:6, 3], [0, 2, 4, 5, 6, 8])


def test_inactive_kernels_do_no_work():
    """The on-device dispatch: a kernel launched with active=False reads nothing, returns 0."""
    from pallas_kernels.ragged_paged_attention import _decode_path, ragged_kernel_attention

    rng = np.random.default_rng(3)
    case = make_case(rng, DECODE, bs=BS, hq=4, hkv=2, d=64)
    common = dict(sm_scale=0.125, soft_cap=None, sliding_window=None, k_scale=1.0, v_scale=1.0)

    @jax.jit
    def both_idle(*args):
        dec = _decode_path(*args, active=jnp.bool_(False), interpret=True, **common)
        rag = ragged_kernel_attention(*args, active=jnp.bool_(False), q_tile=None,
                                      pages_per_block=None, num_warps=4, num_stages=2,
                                      interpret=True, **common)
        return dec, rag

    for out in both_idle(*case.ragged_args()):
        assert not np.asarray(out, np.float32).any()
