"""Random device-resident paged-attention inputs and a loop timer, for scripts/gpu_check.py.

Kept in the package (not the script) so it is linted and imported like the kernels; it builds
inputs with jax.random directly on the default device, never on the host.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from jpaged.intmath import cdiv
from pallas_kernels.reference import is_fp8, quantize


@dataclass
class PagedBatch:
    """A step over a paged pool; `tables[r]` is the r-th of R disjoint block-table sets."""

    q: Float[Array, "T q_heads head_dim"]
    k_pages: Array  # [blocks, bs, kv_heads, head_dim]
    v_pages: Array
    qsl: Int[Array, " B+1"]
    seq_lens: Int[Array, " B"]
    tables: Int[Array, "R B max_blocks"]  # padded entries are 0 (the null block)
    kv_bytes: int  # bytes of K and V the step must read (each valid token once)


def _pages(key: Array, shape: tuple[int, ...], dtype: jnp.dtype, scale: float) -> Array:
    """Random N(0, 1) pages in `dtype` (fp8: quantized with `scale`)."""
    x = jax.random.normal(key, shape, jnp.float32 if is_fp8(dtype) else dtype)
    return quantize(x, dtype, scale) if is_fp8(dtype) else x


def paged_batch(key: Array, seq_lens: list[int], q_lens: list[int], *, hq: int, hkv: int,
                d: int, bs: int, page_dtype: jnp.dtype, q_dtype: jnp.dtype = jnp.bfloat16,
                rotations: int = 1, pad_tokens: int = 0, scale: float = 1.0) -> PagedBatch:
    """A ragged batch whose K/V pages are random; each rotation uses its own shuffled blocks."""
    b = len(seq_lens)
    max_blocks = max(1, max(cdiv(n, bs) for n in seq_lens))
    need = b * max_blocks
    num_blocks = 1 + rotations * need
    kq, kk, kv, kt = jax.random.split(key, 4)
    k_pages = _pages(kk, (num_blocks, bs, hkv, d), page_dtype, scale)
    v_pages = _pages(kv, (num_blocks, bs, hkv, d), page_dtype, scale)
    tables = []
    for r, kr in enumerate(jax.random.split(kt, rotations)):
        ids = 1 + r * need + jax.random.permutation(kr, need).reshape(b, max_blocks)
        used = jnp.arange(max_blocks)[None, :] < jnp.asarray(
            [cdiv(n, bs) for n in seq_lens])[:, None]
        tables.append(jnp.where(used, ids, 0).astype(jnp.int32))
    t = sum(q_lens) + pad_tokens
    q = jax.random.normal(kq, (t, hq, d), q_dtype)
    qsl = jnp.asarray([0, *itertools.accumulate(q_lens)], jnp.int32)
    kv_bytes = 2 * sum(seq_lens) * hkv * d * jnp.dtype(page_dtype).itemsize
    return PagedBatch(q, k_pages, v_pages, qsl, jnp.asarray(seq_lens, jnp.int32),
                      jnp.stack(tables), kv_bytes)


def rotations_for(set_bytes: int, l2_bytes: int = 60 * 2**20, cap: int = 8) -> int:
    """Input sets to cycle through so that consecutive runs do not hit in L2 (>= 4x L2)."""
    return max(1, min(cap, math.ceil(4 * l2_bytes / max(1, set_bytes))))


def _median_per_iter(loop: Callable[..., Array], args: tuple, target_s: float, max_reps: int,
                     repeats: int) -> float:
    """Time `loop(n, *args)` (n iterations): pick n for ~target_s per call, median of repeats."""
    jax.block_until_ready(loop(1, *args))  # compile + warm-up
    t0 = time.perf_counter()
    jax.block_until_ready(loop(1, *args))
    one = time.perf_counter() - t0
    reps = max(1, min(max_reps, int(target_s / max(one, 1e-6))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(reps, *args))
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def time_in_loop(op: Callable[..., Array], tables: Array, *args: Array, max_reps: int = 200,
                 repeats: int = 5, target_s: float = 0.03) -> float:
    """Median seconds per `op(tables[i % R], *args)`, many calls inside one jitted loop.

    One launch per measurement keeps host dispatch out of the numbers; the table set changes
    every iteration, so nothing is loop-invariant and consecutive runs read other memory. The
    output is summed into the carry so that no part of it is dead code.
    """
    rot = tables.shape[0]

    @jax.jit
    def loop(n, tables, *args):
        def body(i, acc):
            return acc + jnp.sum(op(tables[i % rot], *args).astype(jnp.float32))
        return lax.fori_loop(0, n, body, jnp.float32(0))

    return _median_per_iter(loop, (tables, *args), target_s, max_reps, repeats)


def time_carry_loop(step: Callable[..., tuple], init: tuple, tables: Array, *args: Array,
                    max_reps: int = 200, repeats: int = 5, target_s: float = 0.03) -> float:
    """Median seconds per `carry = step(tables[i % R], carry, *args)`, e.g. an in-place write."""
    rot = tables.shape[0]

    @jax.jit
    def loop(n, init, tables, *args):
        return lax.fori_loop(0, n, lambda i, c: step(tables[i % rot], c, *args), init)

    return _median_per_iter(loop, (init, tables, *args), target_s, max_reps, repeats)


def copy_bandwidth(nbytes: int, repeats: int, dtype: Any = jnp.bfloat16) -> float:
    """Device-to-device bandwidth (bytes read + written per second) of y = x + 1 over nbytes
    of `dtype`. (XLA:GPU's elementwise kernels move 4 elements a thread: 8-byte accesses in
    bf16, 16-byte in float32.)"""
    x = jax.random.normal(jax.random.key(1), (nbytes // jnp.dtype(dtype).itemsize,), dtype)
    f = jax.jit(lambda x: x + jnp.asarray(1, dtype))
    jax.block_until_ready(f(x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / statistics.median(times)
