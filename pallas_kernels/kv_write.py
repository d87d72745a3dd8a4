"""Pallas KV write: the step's new K/V rows stored into their page slots in place.

Grid (token, kv-head group). A program copies one token's [heads_per_program, head_dim] rows of K
and of V into slot `slot_mapping[t]` (block slot // block_size, offset slot % block_size),
quantizing to the page dtype (fp8: divide by the scale, saturate). The pages are aliased input ->
output (`input_output_aliases`), so under a jit that donates them the write is in place and every
slot the step does not name keeps its bytes. A slot outside [0, num_blocks * block_size) (padding
uses -1) writes nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pallas_kernels import reference
from pallas_kernels._compat import is_pow2, pallas_call, triton_unsupported
from pallas_kernels.reference import from_bits, to_bits


def quantize(x: jax.Array, dtype: jnp.dtype, scale: jax.Array | float) -> jax.Array:
    """In-kernel twin of `reference.quantize` (also used by the decode matmuls' KV write)."""
    if not reference.is_fp8(dtype):
        return x.astype(dtype)
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)


def _write_kernel(*refs, page_dtype: jnp.dtype) -> None:
    """Store one token's rows of one head group; only the named slot is touched.

    refs: [scales (fp8 pages only)], slot, k, v, k pages in, v pages in; k and v pages out
    (aliases of the inputs). The pool refs hold `page_dtype`, or its bit patterns for fp8 /
    bf16 (`reference.to_bits`).
    """
    fp8 = reference.is_fp8(page_dtype)
    scale_ref = refs[0] if fp8 else None
    slot_ref, k_ref, v_ref, _, _, k_out_ref, v_out_ref = refs[1:] if fp8 else refs
    nb, bs, _, _ = k_out_ref.shape
    hp = k_ref.shape[0]
    grp = pl.program_id(1)
    slot = slot_ref[0]

    @pl.when((slot >= 0) & (slot < nb * bs))
    def _store():
        blk = slot // bs
        off = slot % bs
        heads = pl.ds(grp * hp, hp)
        scales = (scale_ref[0], scale_ref[1]) if fp8 else (1.0, 1.0)  # unused unless fp8
        for src, dst, scale in ((k_ref, k_out_ref, scales[0]), (v_ref, v_out_ref, scales[1])):
            row = quantize(src[...], page_dtype, scale)
            if dst.dtype != page_dtype:
                row = jax.lax.bitcast_convert_type(row, dst.dtype)
            dst[blk, off, heads, :] = row


def write_kv(
    k_pages: Float[Array, "blocks bs kv_heads head_dim"],
    v_pages: Float[Array, "blocks bs kv_heads head_dim"],
    k: Float[Array, "T kv_heads head_dim"],
    v: Float[Array, "T kv_heads head_dim"],
    slot_mapping: Int[Array, " T"],
    k_scale: Float[Array, ""] | float = 1.0,
    v_scale: Float[Array, ""] | float = 1.0,
    *,
    heads_per_program: int | None = None,
    num_warps: int = 1,
    interpret: bool = False,
) -> tuple[Array, Array]:
    """Pallas twin of `reference.write_kv`: new K/V into their slots; slot < 0 writes nothing."""
    nb, bs, hkv, d = k_pages.shape
    t_total = k.shape[0]
    if not interpret and triton_unsupported(k_pages, v_pages, dims=(d,)):
        # Shapes the Triton lowering cannot take run on the XLA scatter.
        return reference.write_kv(k_pages, v_pages, k, v, slot_mapping, k_scale, v_scale)
    # All heads of a token in one program when the head count allows a power-of-two tile.
    hp = heads_per_program or (hkv if (interpret or is_pow2(hkv)) else 1)
    if hkv % hp:
        raise ValueError(f"heads_per_program={hp} must divide kv_heads={hkv}")
    bits = to_bits(k_pages)  # fp8 / bf16 pools move as bit patterns (in place on CPU too)
    page_spec = pl.BlockSpec((nb, bs, hkv, d), lambda t, g: (0, 0, 0, 0))
    row_spec = pl.BlockSpec((None, hp, d), lambda t, g: (t, g, 0))
    specs = [pl.BlockSpec((1,), lambda t, g: (t,)),  # slot of token t
             row_spec, row_spec, page_spec, page_spec]
    args = [slot_mapping.astype(jnp.int32), k, v, bits, to_bits(v_pages)]
    # Only fp8 pages use the scales: other pools take no scale input (stacking the two per
    # layer was an XLA launch of its own in every layer of every step).
    if reference.is_fp8(k_pages.dtype):
        specs.insert(0, pl.BlockSpec((2,), lambda t, g: (0,)))  # k_scale, v_scale
        args.insert(0, jnp.stack([jnp.asarray(k_scale, jnp.float32),
                                  jnp.asarray(v_scale, jnp.float32)]))
    kb, vb = pallas_call(
        functools.partial(_write_kernel, page_dtype=k_pages.dtype),
        grid=(t_total, hkv // hp),
        in_specs=specs,
        out_specs=[page_spec, page_spec],
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, bits.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, bits.dtype)],
        input_output_aliases={len(args) - 2: 0, len(args) - 1: 1},
        interpret=interpret, num_warps=num_warps, num_stages=1,
        name="kv_write",
    )(*args)
    return from_bits(kb, k_pages.dtype), from_bits(vb, v_pages.dtype)
