"""The decode projections' kernels as the step's `DecodeLinears` (models/linear_ops.py).

With the Pallas backend, steps of at most `DECODE_MATMUL_MAX_ROWS` tokens run every decoder
layer's projections on the weight-streaming kernels of `pallas_kernels/decode_matmul.py`
(Pallas interpreter off GPU); larger steps keep XLA's GEMMs, which reuse each weight tile
across many rows. A model whose shapes the kernels cannot take keeps XLA's GEMMs, and says
why once in the log.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from models.config import ModelSpec
from models.linear_ops import DecodeLinears
from models.sharding import plan_layout
from pallas_kernels import decode_matmul as dm
from pallas_kernels.reference import rope_rows

logger = logging.getLogger("jpaged.runner")

# The largest step (tokens) that runs on the kernels. A program's tile holds up to 64 rows,
# so up to 64 rows a launch reads each weight byte once; past that each row block reads it
# again (from L2 when the blocks run together). The device check times both paths at batch
# 1/16/64/256 (`ms_xla`, `ms_kernels`): the crossover is where they meet.
DECODE_MATMUL_MAX_ROWS = 64


def unsupported_reason(spec: ModelSpec, dtype: jnp.dtype, tensor_parallel_size: int = 1
                       ) -> str | None:
    """Why this model's projections cannot take the kernels (per device), or None."""
    tp = tensor_parallel_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    # K and V split by columns unless their heads are replicated (models/sharding.py's rule).
    kv_local = kv // tp if plan_layout(spec, tp).kv_replicas == 1 else kv
    shapes = [(spec.hidden_size, (q // tp, kv_local, spec.intermediate_size // tp)),
              (q // tp, (spec.hidden_size,)), (spec.intermediate_size // tp, (spec.hidden_size,))]
    for k, ns in shapes:
        why = dm.unsupported(1, k, ns, dtype)
        if why is not None:
            return why
    return None


def kernel_linears(interpret: bool, max_rows: int = DECODE_MATMUL_MAX_ROWS) -> DecodeLinears:
    """The weight-streaming kernels behind the `DecodeLinears` seam."""

    def qkv(x: jax.Array, wq: jax.Array, wk: jax.Array, wv: jax.Array, bq: jax.Array | None,
            bk: jax.Array | None, bv: jax.Array | None, *, norm_weight: jax.Array,
            norm_eps: float, norm_offset: float,
            rope: tuple[jax.Array, jax.Array] | None = None, head_dim: int | None = None
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
        # RoPE in the kernel's epilogue where its tiles allow (head_dim / 2 >= 16), else after.
        fused = rope is not None and dm.rope_fits(head_dim, [w.shape[1] for w in (wq, wk, wv)])
        q, k, v = dm.projections(x, [wq, wk, wv], [bq, bk, bv], norm_weight=norm_weight,
                                 norm_eps=norm_eps, norm_offset=norm_offset,
                                 rope=rope if fused else None, rope_outputs=2 if fused else 0,
                                 head_dim=head_dim, interpret=interpret)
        if rope is not None and not fused:
            q, k = (rope_rows(y, *rope, head_dim) for y in (q, k))
        return q, k, v

    def gate_up(x: jax.Array, wg: jax.Array, wu: jax.Array, bg: jax.Array | None,
                bu: jax.Array | None, *, act: str, norm_weight: jax.Array, norm_eps: float,
                norm_offset: float) -> jax.Array:
        return dm.gated_up(x, wg, wu, bg, bu, act=act, norm_weight=norm_weight,
                           norm_eps=norm_eps, norm_offset=norm_offset, interpret=interpret)

    def out(x: jax.Array, w: jax.Array, b: jax.Array | None,
            residual: jax.Array | None) -> jax.Array:
        if residual is None:
            return dm.projections(x, [w], [b], interpret=interpret)[0]
        return dm.projection_residual(x, w, residual, b, interpret=interpret)

    return DecodeLinears("pallas", max_rows, qkv, gate_up, out)


def is_gpu_platform(platform: str) -> bool:
    """Whether kernels compile for a GPU on this platform (else the Pallas interpreter)."""
    return platform in ("gpu", "cuda", "rocm")


def rope_in_kernel(spec: ModelSpec) -> bool:
    """Whether every layer's q/k/v launch applies RoPE itself (no q/k norm comes between,
    half a head is >= 16 columns): the condition for writing K/V from the same launch."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return not spec.qk_norm and dm.rope_fits(spec.head_dim, [q, kv, kv])


def fused_qkv_write(x: jax.Array, wq: jax.Array, wk: jax.Array, wv: jax.Array,
                    bq: jax.Array | None, bk: jax.Array | None, bv: jax.Array | None, *,
                    pages: tuple[jax.Array, jax.Array], slot_mapping: jax.Array,
                    slot_region: int | jax.Array, scales: tuple[jax.Array, jax.Array],
                    norm_weight: jax.Array, norm_eps: float, norm_offset: float,
                    rope: tuple[jax.Array, jax.Array], head_dim: int, interpret: bool
                    ) -> tuple[jax.Array, ...]:
    """q, k, v (RoPE in the epilogue) with k and v also written into `pages` at the slot
    mapping's slots plus `slot_region` (the layer's rows of a shared pool): q, k, v, k pages,
    v pages. The region is added here, not in the kernel: one kernel serves every layer (a
    static offset would compile a variant a layer), and XLA computes all layers' slots in one
    multi-output fusion before the first layer."""
    slots = jnp.where(slot_mapping < 0, -1, slot_mapping + slot_region)
    q, k, v, kp, vp = dm.projections(
        x, [wq, wk, wv], [bq, bk, bv], norm_weight=norm_weight, norm_eps=norm_eps,
        norm_offset=norm_offset, rope=rope, rope_outputs=2, head_dim=head_dim, kv_pages=pages,
        kv_slots=slots, kv_scales=scales, interpret=interpret)
    return q, k, v, kp, vp


def select_linears(backend: str, platform: str, spec: ModelSpec, dtype: jnp.dtype,
                   tensor_parallel_size: int = 1) -> DecodeLinears | None:
    """The kernels when the attention backend is Pallas and the model's shapes fit, else None."""
    if not backend.startswith("pallas"):
        return None
    why = unsupported_reason(spec, dtype, tensor_parallel_size)
    if why is not None:
        logger.warning("decode projections stay on XLA's GEMMs: %s", why)
        return None
    return kernel_linears(interpret=not is_gpu_platform(platform))
