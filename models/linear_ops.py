"""The seam through which a decoder layer runs its projections on fused kernels.

A step whose token count is small (decode) is bound by reading the weights, and XLA's GEMMs
stream them at well under the memory's rate (docs/kernels.md, "Decode matmuls"). When the
runner hands a layer a `DecodeLinears`, the layer calls it instead of its nnx.Linear modules:
one call for q/k/v (the input norm folded in), one for gate/up with the activation, and one
each for o and down with the residual added. The weights are the modules' own arrays, passed
as they lie. `None` (the default everywhere) is the XLA path; the two give the same values up
to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

# qkv(x, wq, wk, wv, bq, bk, bv, norm_weight, norm_eps, norm_offset, rope, head_dim)
#   -> (q, k, v), each [T, N_w]: norm(x) @ w (+ b); norm is the layer's RMSNorm (offset 1:
#   Gemma's (1 + w)); with rope = (cos, sin), each [T, head_dim / 2], q and k come rotated.
QkvFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
# qkv_write(x, wq, wk, wv, bq, bk, bv, layer_idx, attn_state, norm_weight, norm_eps,
#   norm_offset, rope, head_dim) -> (q, k, v, attn_state): as qkv with RoPE, and k and v also
#   written into the attention backend's KV cache (the AttnFn state), which it returns updated.
QkvWriteFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array, Any]]
# gate_up(x, wg, wu, bg, bu, act, norm_weight, norm_eps, norm_offset) -> act(g) * u, [T, N]
GateUpFn = Callable[..., jax.Array]
# out(x, w, b, residual) -> residual + x @ w (+ b), or x @ w (+ b) with residual None
OutFn = Callable[..., jax.Array]
# logits(h, w, transposed) -> [T, V] float32, unrounded: h @ w for lm_head's [hidden, vocab]
#   kernel, or h @ w.T for a tied [vocab, hidden] embedding table (transposed=True); w float or
#   a QuantWeight (k_axis 0 / 1 alike).
LogitsFn = Callable[..., jax.Array]


@dataclass(frozen=True)
class DecodeLinears:
    """Fused projections for steps of at most `max_rows` tokens (more: XLA's GEMMs).

    `qkv_write`, when the runner offers it for this step, takes the place of `qkv` for layers
    whose RoPE runs in the kernel (no q/k norm between): the layer then calls its AttnFn with
    `kv_written=True`, so the backend attends without writing K/V again.

    `logits`, when the model's output head suits it, computes the head (`compute_logits` given
    these linears calls it instead of XLA's GEMM); the runner hands the linears to
    `compute_logits` only for at most `logits_max_rows` rows (and steps of <= `max_rows`).
    """

    name: str
    max_rows: int
    qkv: QkvFn
    gate_up: GateUpFn
    out: OutFn
    qkv_write: QkvWriteFn | None = None
    logits: LogitsFn | None = None
    logits_max_rows: int = 0


def activation_name(hidden_act: str) -> str:
    """The kernels' name of a model's gate activation: silu, or gelu_tanh (Gemma's gelu)."""
    return "silu" if hidden_act == "silu" else "gelu_tanh"


def one_row_as_two(fn: Callable[[jax.Array], jax.Array], x: Float[Array, "T n"]) -> jax.Array:
    """fn(x), with a one-row x run on GPUs as two rows (the second zeros) and sliced back.

    XLA:GPU rewrites a [1, K] x [K, N] dot with a small N into a multiply and a reduce, and
    materializes the product: a temporary the size of the weight, written and read again on
    every decode step of batch 1 (0.5 GB per step for Llama-3-8B's k/v projections). Two rows
    keep it a GEMM that reads the weight once; the extra row costs no weight traffic. XLA:CPU's
    GEMM packs its operands (a copy of the weight at two rows) while its matrix-vector product
    does not, so one row stays one there. Chosen by the lowering platform: a deviceless H200
    compile on a CPU host gets the two rows.
    """
    if x.shape[0] != 1:
        return fn(x)
    return jax.lax.platform_dependent(
        x, cpu=fn, default=lambda x: fn(jnp.concatenate([x, jnp.zeros_like(x)]))[:1])


def matmul_precision(dtype: Any) -> jax.lax.Precision | None:
    """Full-precision matmuls for float32 models (GPUs would otherwise use TF32)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
