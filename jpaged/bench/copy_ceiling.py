"""The device's copy rate with 16-byte accesses: the honest ceiling of a memory-bound kernel.

jax's bf16 `y = x + 1` is what the device check used as its ceiling until now (2,711 GB/s on
the first H200 run, docs/kernels.md), but XLA:GPU's elementwise kernels give each thread four
elements, so in bf16 each thread loads and stores 8 bytes at a time; PyTorch's copies, at
16 bytes a thread, reached 4.3 TB/s on these machines. Here, over one buffer of `nbytes`
(bytes moved = read + write):

* `jax_bf16`: jax's `x + 1` in bf16 (8-byte accesses), the old ceiling;
* `jax_f32`: the same in float32 (XLA's four elements a thread are then 16 bytes);
* `pallas_f32_b<N>_w<W>`, `pallas_bf16_...`, `pallas_u32_copy_...`: a Pallas (Triton) kernel,
  each program one contiguous block of N elements over W warps, so every thread owns runs of
  at least 16 contiguous bytes (Triton vectorises a contiguous block to 128-bit accesses:
  4 float32 / uint32 or 8 bf16 elements); `x + 1`, or a plain copy for uint32.

`copy_GBps_16byte` is the best of the 16-byte methods (all but `jax_bf16`), and
`copy_16byte_method` names it. Timed with `kernel_timing.pipelined` (calls back to back,
median of repeats).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jpaged.bench.kernel_timing import pipelined
from pallas_kernels._compat import pallas_call

# (dtype, block elements, warps, add one?) of the Pallas variants: 16 KiB or 64 KiB a program.
PALLAS_VARIANTS: tuple[tuple[str, int, int, bool], ...] = (
    ("float32", 4096, 4, True),
    ("float32", 16384, 8, True),
    ("bfloat16", 8192, 4, True),
    ("uint32", 4096, 4, False),
)


def _kernel(x_ref: Any, o_ref: Any, *, add: bool) -> None:
    x = x_ref[...]
    o_ref[...] = x + jnp.asarray(1, x.dtype) if add else x


def pallas_copy(x: jax.Array, *, block: int, num_warps: int, add: bool = True,
                interpret: bool = False) -> jax.Array:
    """`x + 1` (or `x`) by a Pallas kernel: one program per `block` contiguous elements."""
    (n,) = x.shape
    if n % block:
        raise ValueError(f"{n} elements are not a multiple of the block ({block})")
    spec = pl.BlockSpec((block,), lambda i: (i,))
    name = f"copy16_{jnp.dtype(x.dtype).name}_b{block}_w{num_warps}"
    return pallas_call(
        functools.partial(_kernel, add=add), grid=(n // block,), in_specs=[spec],
        out_specs=spec, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        interpret=interpret, num_warps=num_warps, num_stages=1, name=name)(x)


def _buffer(nbytes: int, dtype: str) -> jax.Array:
    """Random `nbytes` of `dtype` on the device (never zeros: METHOD.md)."""
    dt = jnp.dtype(dtype)
    n = nbytes // dt.itemsize
    if dt == jnp.uint32:
        return jax.random.bits(jax.random.key(2), (n,), jnp.uint32)
    return jax.random.normal(jax.random.key(1), (n,), dt)


def copy_rates(nbytes: int, *, interpret: bool = False, repeats: int = 5,
               target_s: float = 0.02) -> dict[str, Any]:
    """GB/s (read + write) of every method over `nbytes`; a method that fails is named with
    its error instead. Returns `rates`, `errors`, `copy_GBps_16byte`, `copy_16byte_method`,
    `copy_GBps_jax_bf16` and the buffer size."""
    rates: dict[str, float] = {}
    errors: dict[str, str] = {}

    def measure(name: str, fn: Any, dtype: str) -> None:
        x = _buffer(nbytes, dtype)
        try:
            t = pipelined(fn, (x,), repeats=repeats, target_s=target_s)
            rates[name] = round(2 * x.nbytes / t.median_s / 1e9, 1)
            print(f"  copy {name:28s} {rates[name]:8.0f} GB/s (read + write, "
                  f"{x.nbytes / 2**20:.0f} MiB)", flush=True)
        except Exception as e:  # noqa: BLE001 - one method failing leaves the others
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"  copy {name}: FAILED {errors[name]}", flush=True)
        del x

    for dtype in ("bfloat16", "float32"):
        dt = jnp.dtype(dtype)
        measure(f"jax_{'bf16' if dtype == 'bfloat16' else 'f32'}",
                jax.jit(lambda x, dt=dt: x + jnp.asarray(1, dt)), dtype)
    for dtype, block, warps, add in PALLAS_VARIANTS:
        short = {"float32": "f32", "bfloat16": "bf16", "uint32": "u32"}[dtype]
        name = f"pallas_{short}{'' if add else '_copy'}_b{block}_w{warps}"
        measure(name, jax.jit(functools.partial(pallas_copy, block=block, num_warps=warps,
                                                add=add, interpret=interpret)), dtype)
    sixteen = {k: v for k, v in rates.items() if k != "jax_bf16"}
    best = max(sixteen, key=sixteen.__getitem__) if sixteen else None
    return {"copy_bytes": nbytes, "rates": rates, "errors": errors,
            "copy_GBps_16byte": sixteen[best] if best else None,
            "copy_16byte_method": best,
            "copy_GBps_jax_bf16": rates.get("jax_bf16")}
