"""The version- and backend-specific parts of the Pallas kernels, kept in one place.

The kernels are written against the portable `pl.pallas_call` / `pl.BlockSpec` API and lowered by
the Pallas Triton backend on GPU (or run by the interpreter on CPU). Everything that differs
between jax releases or names the Triton backend lives here:

* the compiler-params class (`jax.experimental.pallas.triton.CompilerParams` in jax 0.10-0.12;
  `TritonCompilerParams` in older releases, where the module was `pallas.gpu`);
* the DeprecationWarning that jax >= 0.11 emits when lowering a Triton kernel (silenced by message
  only, so every other deprecation still shows);
* the matrix product (`lax.dot_general` with float32 accumulation, which the Triton lowering maps
  to `tt.dot`; at DEFAULT precision float32 operands run as TF32 on the tensor cores, as XLA's
  own float32 dots do on GPU: about 3e-4 relative error, measured on an H200).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.reference import is_fp8

# Finite "minus infinity" for masked logits: exp(MASK - m) == 0 for any real m, and
# MASK - MASK == 0, so an all-masked row never produces inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

warnings.filterwarnings(
    "ignore", message=r"The Pallas Triton backend is deprecated", category=DeprecationWarning)


def _triton_params_class() -> type | None:
    """The Triton compiler-params class of the installed jax, or None if there is none."""
    for module_name in ("jax.experimental.pallas.triton", "jax.experimental.pallas.gpu"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr in ("CompilerParams", "TritonCompilerParams"):
            cls = getattr(module, attr, None)
            if cls is not None and "num_warps" in getattr(cls, "__dataclass_fields__", {}):
                return cls
    return None


def triton_compiler_params(num_warps: int, num_stages: int) -> Any:
    """Compiler params selecting the Triton lowering with these launch settings."""
    cls = _triton_params_class()
    if cls is None:
        raise RuntimeError(f"this jax ({jax.__version__}) has no Pallas Triton backend")
    return cls(num_warps=num_warps, num_stages=num_stages)


def pallas_call(
    kernel: Callable[..., None],
    *,
    grid: tuple[int, ...],
    in_specs: Sequence[pl.BlockSpec],
    out_specs: Any,
    out_shape: Any,
    interpret: bool,
    num_warps: int,
    num_stages: int,
    name: str,
    input_output_aliases: dict[int, int] | None = None,
) -> Callable[..., Any]:
    """`pl.pallas_call` with the Triton params attached (dropped in interpret mode)."""
    params = None if interpret else triton_compiler_params(num_warps, num_stages)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=list(in_specs),
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=params,
        input_output_aliases=input_output_aliases or {},
        name=name,
    )


def mm(a: jax.Array, b: jax.Array, *, trans_b: bool = False) -> jax.Array:
    """2-D product a @ b (or a @ b.T) with float32 accumulation; both operands share a dtype."""
    contract_b = 1 if trans_b else 0
    return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())),
                           preferred_element_type=jnp.float32)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def is_pow2(n: int) -> bool:
    """True when n is a positive power of two (Triton block dims must be)."""
    return n > 0 and n & (n - 1) == 0


def triton_unsupported(*pages: jax.Array, dims: tuple[int, ...] = ()) -> str | None:
    """Why the Triton lowering cannot take these page arrays / tile dims, or None if it can.

    Tiles must be powers of two. The lowering indexes an array with int32 offsets unless it is
    over 4 GiB, so a 1-byte (fp8) array of 2-4 GiB would overflow them: such pools take XLA.
    """
    if not all(is_pow2(n) for n in dims):
        return f"tile dims {dims} are not all powers of two"
    for p in pages:
        if p.size > 2**31 and p.size * p.dtype.itemsize <= 2**32:
            return f"a {p.dtype} pool of {p.size} elements overflows int32 offsets"
    return None


def check_dot_tiles(rows: int, keys: int, interpret: bool) -> None:
    """Raise ValueError unless the in-kernel products have M and K >= 16 (Triton's minimum)."""
    if not interpret and (rows < 16 or keys < 16):
        raise ValueError(f"on GPU a kernel tile needs >= 16 query rows and >= 16 keys per step; "
                         f"got rows={rows}, keys={keys} (raise q_tile/min_rows/pages_per_block)")


def compute_dtype(q_dtype: jnp.dtype, page_dtype: jnp.dtype) -> jnp.dtype:
    """Operand dtype of the in-kernel products: fp8 pages widen to bf16 (exact), then promote."""
    page = jnp.dtype(jnp.bfloat16) if is_fp8(page_dtype) else jnp.dtype(page_dtype)
    dt = jnp.promote_types(jnp.dtype(q_dtype), page)
    if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        dt = jnp.dtype(jnp.float32)
    return dt


def scale_array(x: jax.Array | float) -> jax.Array:
    """A python or traced scalar as a float32 [1] kernel input."""
    return jnp.reshape(jnp.asarray(x, jnp.float32), (1,))


def window_suffix(sliding_window: int | None) -> str:
    """'_w<N>' for a kernel specialized to an N-token sliding window ('' for full attention):
    compiled-program readers (jpaged/aot/traffic.py) learn each launch's key reach from it."""
    return "" if sliding_window is None else f"_w{sliding_window}"
