"""The KV pool as a pytree, its dtype, and how many blocks fit a memory budget.

Layout: all layers share one array for K and one for V, [num_layers * num_blocks, block_size,
num_kv_heads, head_dim]; layer l's copy of block b is row l * num_blocks + b. The host speaks of
blocks 0..num_blocks-1 only; the device step adds the layer offset to slot ids and block tables,
so the kernels see one big pool and the layers can run under a scan with the pool as carry.
Token slot s lives at (block s // block_size, offset s % block_size). Block 0 is the null block:
padded block-table entries point at it and it is never read unmasked. fp8 pages carry one
float32 scale per layer for K and one for V (value = stored * scale).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jpaged.config import CacheConfig
from models.config import ModelSpec

logger = logging.getLogger("jpaged")

# Default KV budget on a CPU backend when none is given (as vLLM's CPU backend, which reserves a
# fixed KV space rather than a fraction of host RAM).
CPU_DEFAULT_KV_BYTES = 2 * 2**30


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "k_scale", "v_scale"],
         meta_fields=["num_blocks"])
@dataclass
class KVCache:
    """K and V pages of every layer, per-layer fp8 scales, and the per-layer block count."""

    k: Float[Array, "layers_x_blocks bs kv_heads head_dim"]
    v: Float[Array, "layers_x_blocks bs kv_heads head_dim"]
    k_scale: Float[Array, " layers"]
    v_scale: Float[Array, " layers"]
    num_blocks: int  # blocks per layer, including the null block 0


def kv_dtype(cache_dtype: str, model_dtype: jnp.dtype) -> jnp.dtype:
    """The page dtype for a `kv_cache_dtype` setting ('auto' follows the model)."""
    table = {
        "auto": jnp.dtype(model_dtype),
        "float32": jnp.dtype(jnp.float32),
        "bfloat16": jnp.dtype(jnp.bfloat16),
        "float16": jnp.dtype(jnp.float16),
        "fp8": jnp.dtype(jnp.float8_e4m3fn),
        "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn),
        "fp8_e5m2": jnp.dtype(jnp.float8_e5m2),
    }
    if cache_dtype not in table:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(table)}, got {cache_dtype!r}")
    return table[cache_dtype]


def bytes_per_block(spec: ModelSpec, block_size: int, dtype: jnp.dtype) -> int:
    """Bytes one block takes across all layers: block_size x 2 x kv_heads x head_dim x bytes."""
    return spec.num_layers * block_size * 2 * spec.num_kv_heads * spec.head_dim * jnp.dtype(
        dtype).itemsize


def _available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def device_memory_bytes() -> int:
    """Total memory of the first device (GPU: bytes_limit; CPU: available host RAM)."""
    dev = jax.devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # backends without memory_stats
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return _available_host_bytes()


def num_blocks_for(cache: CacheConfig, spec: ModelSpec, dtype: jnp.dtype, param_bytes: int,
                   max_model_len: int) -> int:
    """Pool size: override, else explicit KV bytes, else a fraction of device memory."""
    per_block = bytes_per_block(spec, cache.block_size, dtype)
    if cache.num_gpu_blocks_override is not None:
        n = cache.num_gpu_blocks_override
        source = "num_gpu_blocks_override"
    else:
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
            source = "kv_cache_memory_bytes"
        elif jax.default_backend() == "cpu":
            budget = min(CPU_DEFAULT_KV_BYTES,
                         int(device_memory_bytes() * cache.gpu_memory_utilization) - param_bytes)
            source = "CPU default KV space"
        else:
            total = device_memory_bytes()
            margin = 256 * 2**20
            budget = int(total * cache.gpu_memory_utilization) - param_bytes - margin
            source = f"{cache.gpu_memory_utilization:.2f} x {total / 2**30:.1f} GiB - params"
        n = budget // per_block
    blocks_per_seq = -(-max_model_len // cache.block_size)
    logger.info("KV pool: %d blocks x %d tokens, %.1f KiB/block, %.2f GiB (%s)", n,
                cache.block_size, per_block / 1024, n * per_block / 2**30, source)
    if n - 1 < blocks_per_seq and cache.num_gpu_blocks_override is None:
        fit = (max(n - 1, 0)) * cache.block_size
        raise ValueError(
            f"the KV pool ({n} blocks of {cache.block_size} tokens) cannot hold one request of "
            f"max_model_len={max_model_len}; the largest max_model_len that fits is {fit}. "
            "Raise gpu_memory_utilization / kv_cache_memory_bytes or lower max_model_len.")
    if n < 2:
        raise ValueError(f"the KV pool must have at least 2 blocks (got {n})")
    return int(n)


def allocate_kv_cache(spec: ModelSpec, num_blocks: int, block_size: int,
                      dtype: jnp.dtype) -> KVCache:
    """Zeroed pages for every layer, scales 1.0."""
    shape = (spec.num_layers * num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        k_scale=jnp.ones((spec.num_layers,), jnp.float32),
        v_scale=jnp.ones((spec.num_layers,), jnp.float32),
        num_blocks=num_blocks,
    )
