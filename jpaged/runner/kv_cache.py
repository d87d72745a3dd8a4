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
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jpaged.config import CacheConfig
from jpaged.core.kv_cache_groups import largest_fitting
from jpaged.intmath import cdiv
from models.config import ModelSpec
from pallas_kernels.reference import bits_dtype, from_bits

logger = logging.getLogger("jpaged")

# Default KV budget on a CPU backend when none is given (as vLLM's CPU backend, which reserves a
# fixed KV space rather than a fraction of host RAM).
CPU_DEFAULT_KV_BYTES = 2 * 2**30
# gpu_memory_utilization when None: on GPU the fraction used; on CPU the RAM cap of the default.
DEFAULT_UTILIZATION = 0.9
# Room left beside params + step activations (allocator slack, small buffers, fragmentation).
MEMORY_MARGIN_BYTES = 256 * 2**20
# Floor of a computed fp8 scale (all-zero K or V in the first batch).
KV_SCALE_EPS = 1e-8


def storage_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype the pool arrays are stored in: uint8 for fp8 pages, uint16 for bf16, else the
    page dtype. `pallas_kernels.reference.from_bits` / `to_bits` convert between the two.

    Such pools are held as their bit patterns (vLLM holds fp8 caches as uint8 tensors too):
    XLA:CPU gathers and scatters fp8 and bf16 only after widening the operand, the whole pool,
    and a bitcast-convert between the float and the integer type is a real copy there. So the
    arrays and the jitted step's loop carry stay integers; the ops see page-dtype views made by
    bitcasts next to their own (XLA folds them; on GPU a bitcast-convert is free anyway).
    """
    dtype = jnp.dtype(dtype)
    return bits_dtype(dtype) or dtype


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "k_scale", "v_scale"],
         meta_fields=["num_blocks", "dtype"])
@dataclass
class KVCache:
    """K and V pages of every layer, per-layer fp8 scales, the block count and page dtype.

    Invariant: k and v have dtype storage_dtype(dtype); `k_pages()` / `v_pages()` are the
    page-dtype views.
    """

    k: Float[Array, "layers_x_blocks bs kv_heads head_dim"]
    v: Float[Array, "layers_x_blocks bs kv_heads head_dim"]
    k_scale: Float[Array, " layers"]
    v_scale: Float[Array, " layers"]
    num_blocks: int  # blocks per layer, including the null block 0
    dtype: jnp.dtype  # the page dtype (what the ops and the host tiers see)

    def k_pages(self) -> Array:
        """K pages in the page dtype (fp8 included)."""
        return from_bits(self.k, self.dtype)

    def v_pages(self) -> Array:
        """V pages in the page dtype (fp8 included)."""
        return from_bits(self.v, self.dtype)


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


def amax_scale(x: Float[Array, "T kv_heads head_dim"], valid: Bool[Array, " T"],
               dtype: jnp.dtype) -> Float[Array, ""]:
    """An fp8 scale from the valid tokens: max |x| / the dtype's largest finite, >= KV_SCALE_EPS."""
    fmax = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.where(valid[:, None, None], jnp.abs(x.astype(jnp.float32)), 0.0))
    return jnp.maximum(amax / fmax, KV_SCALE_EPS)


def bytes_per_block(spec: ModelSpec, block_size: int, dtype: jnp.dtype,
                    kv_head_shards: int = 1, kv_layers: int | None = None) -> int:
    """Bytes one block takes across all layers: block_size x 2 x kv_heads x head_dim x bytes.

    `kv_layers`: layers' worth of KV one block id holds when it is not every layer (KV cache
    groups: the layout's slots).

    With the KV heads split `kv_head_shards` ways (tensor parallelism) this is one device's
    share: ceil(num_kv_heads / kv_head_shards) heads, at least 1 (heads are replicated when
    there are more devices than heads).
    """
    if not isinstance(kv_head_shards, int) or kv_head_shards < 1:
        raise ValueError(f"kv_head_shards must be an integer >= 1, got {kv_head_shards!r}")
    heads = max(1, cdiv(spec.num_kv_heads, kv_head_shards))
    layers = spec.num_layers if kv_layers is None else kv_layers
    return layers * block_size * 2 * heads * spec.head_dim * jnp.dtype(dtype).itemsize


def available_host_bytes() -> int:
    """Host memory available to a new allocation (Linux MemAvailable, else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def device_memory_bytes() -> int:
    """Memory of the first device: the allocator's bytes_limit, else available host RAM (CPU)."""
    dev = jax.devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # backends without memory_stats
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return available_host_bytes()


@dataclass(frozen=True)
class KVPoolPlan:
    """How the pool size was found; byte fields are per device. None = not used by `source`."""

    # num_gpu_blocks_override | kv_cache_memory_bytes | gpu_memory_utilization | cpu_default
    source: str
    device_bytes: int | None
    utilization: float | None
    param_bytes: int
    activation_bytes: int | None  # temp bytes of the compiled step at the largest bucket
    margin_bytes: int
    available_bytes: int | None  # device x utilization - params - activations - margin
    kv_budget_bytes: int  # cpu_default: min(CPU_DEFAULT_KV_BYTES / host_devices, available)
    bytes_per_block: int
    num_blocks: int  # per layer, including the null block 0
    max_model_len: int
    block_size: int
    host_devices: int = 1  # CPU devices sharing the machine's RAM (the budget is one's share)
    # Blocks one max_model_len sequence holds (all KV cache groups); None: one per block_size.
    blocks_per_seq: int | None = None

    @property
    def max_concurrent_seqs(self) -> int:
        """max_model_len sequences the pool holds at once (block 0 is never handed out)."""
        per = self.blocks_per_seq or cdiv(self.max_model_len, self.block_size)
        return max(self.num_blocks - 1, 0) // per

    def log(self) -> None:
        """The start-up breakdown, at INFO."""
        gib = 2**30

        def g(x: int | None) -> str:
            return "n/a" if x is None else f"{x / gib:.3f} GiB"

        budget = f"KV budget {g(self.kv_budget_bytes)}"
        if self.available_bytes is not None:
            util = "n/a" if self.utilization is None else f"{self.utilization:g}"
            shared = (f" shared by {self.host_devices} devices" if self.host_devices > 1
                      else "")
            cap = (f" (the {g(CPU_DEFAULT_KV_BYTES)} CPU default{shared}, capped by that)"
                   if self.source == "cpu_default" else "")
            budget = (f"device memory {g(self.device_bytes)} x utilization {util} - params "
                      f"{g(self.param_bytes)} - activations {g(self.activation_bytes)} - margin "
                      f"{g(self.margin_bytes)} = {g(self.available_bytes)}; {budget}{cap}")
        logger.info("KV sizing (%s): %s; %d B/block (%.1f KiB) -> %d blocks of %d tokens; "
                    "%d concurrent sequences of max_model_len=%d", self.source, budget,
                    self.bytes_per_block, self.bytes_per_block / 1024, self.num_blocks,
                    self.block_size, self.max_concurrent_seqs, self.max_model_len)


ActivationProbe = Callable[[], "int | None"]


def plan_kv_pool(cache: CacheConfig, spec: ModelSpec, dtype: jnp.dtype, param_bytes: int,
                 max_model_len: int, *, activation_bytes: int | ActivationProbe | None = None,
                 kv_head_shards: int = 1, device_bytes: int | None = None,
                 platform: str | None = None, host_devices: int = 1,
                 kv_layers: int | None = None,
                 request_blocks: Callable[[int], int] | None = None,
                 extra_bytes_per_block: int = 0) -> KVPoolPlan:
    """Size the pool: override, else explicit KV bytes, else a fraction of device memory.

    budget = device memory x utilization - params - activations - margin. `activation_bytes`
    may be a callable (the compiled-step probe), called only when the budget depends on it.
    On CPU, device memory is available RAM plus `param_bytes` (the weights are already loaded
    into that RAM), and utilization None means min(CPU_DEFAULT_KV_BYTES, what 0.9 of it allows).
    `param_bytes` and `device_bytes` are per device; `kv_head_shards` splits the KV heads.
    `host_devices`: on CPU, how many of the mesh's devices share this machine's RAM (forced
    CPU devices): the RAM and the CPU default KV space are the machine's, split between them,
    so tensor parallelism over N CPU devices takes the same memory as one device, not N times.
    KV cache groups: a block holds `kv_layers` layers' KV and a request of n tokens takes
    `request_blocks(n)` blocks (all groups; None: cdiv(n, block_size), one full group), so
    the largest length that fits is exact, sliding groups included. `extra_bytes_per_block`:
    another model's KV that
    each block also holds (a speculative draft model's pages, indexed by the same block ids).
    Raises ValueError when one max_model_len request cannot fit, naming the largest that can.
    """
    if not isinstance(host_devices, int) or host_devices < 1:
        raise ValueError(f"host_devices must be an integer >= 1, got {host_devices!r}")
    per_block = bytes_per_block(spec, cache.block_size, dtype, kv_head_shards,
                                kv_layers) + extra_bytes_per_block
    platform = platform or jax.default_backend()
    share = host_devices if platform == "cpu" else 1  # devices splitting this RAM
    util = cache.gpu_memory_utilization
    dev = act = avail = None
    margin = 0
    if cache.num_gpu_blocks_override is not None:
        source, budget = "num_gpu_blocks_override", cache.num_gpu_blocks_override * per_block
    elif cache.kv_cache_memory_bytes is not None:
        # The KV budget itself: no probe, nothing else subtracted.
        source, budget = "kv_cache_memory_bytes", cache.kv_cache_memory_bytes
    else:
        on_cpu = platform == "cpu"
        if device_bytes is not None:
            dev = device_bytes
        else:  # on CPU: this device's share of the machine's RAM, plus its own weights
            dev = device_memory_bytes() // share + (param_bytes if on_cpu else 0)
        act = activation_bytes() if callable(activation_bytes) else activation_bytes
        if act is None:
            logger.warning("the backend reports no memory analysis for the step; the KV "
                           "budget counts no activations beyond the %d MiB margin",
                           MEMORY_MARGIN_BYTES // 2**20)
        margin = MEMORY_MARGIN_BYTES
        frac = util if util is not None else DEFAULT_UTILIZATION
        budget = avail = int(dev * frac) - param_bytes - (act or 0) - margin
        if on_cpu and util is None:
            source, budget = "cpu_default", min(CPU_DEFAULT_KV_BYTES // share, avail)
        else:
            source = "gpu_memory_utilization"
        util = frac
    n = (cache.num_gpu_blocks_override if cache.num_gpu_blocks_override is not None
         else max(budget, 0) // per_block)
    if request_blocks is None:
        request_blocks = partial(_full_group_blocks, block_size=cache.block_size)
    blocks_per_seq = request_blocks(max_model_len)
    plan = KVPoolPlan(source, dev, util, param_bytes, act, margin, avail, max(budget, 0),
                      per_block, int(n), max_model_len, cache.block_size, share, blocks_per_seq)
    plan.log()
    if cache.num_gpu_blocks_override is None and n - 1 < blocks_per_seq:
        fit = largest_fitting(request_blocks, int(n) - 1, max_model_len)
        what = (f"the largest max_model_len that fits is {fit}" if fit > 0
                else "not even one block fits")
        raise ValueError(
            f"the KV pool ({n} blocks of {cache.block_size} tokens, {plan.kv_budget_bytes} "
            f"bytes from {source}) cannot hold one request of max_model_len={max_model_len}; "
            f"{what}. Raise gpu_memory_utilization / kv_cache_memory_bytes or lower "
            "max_model_len.")
    if n < 2:
        raise ValueError(f"the KV pool must have at least 2 blocks (got {n})")
    return plan


def _full_group_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks a request of `num_tokens` holds in one full-attention group."""
    return cdiv(num_tokens, block_size)


def num_blocks_for(cache: CacheConfig, spec: ModelSpec, dtype: jnp.dtype, param_bytes: int,
                   max_model_len: int, *, activation_bytes: int | ActivationProbe | None = None,
                   kv_head_shards: int = 1, device_bytes: int | None = None,
                   platform: str | None = None, host_devices: int = 1,
                   kv_layers: int | None = None,
                   request_blocks: Callable[[int], int] | None = None,
                   extra_bytes_per_block: int = 0) -> int:
    """Blocks per layer for this config (see `plan_kv_pool`, which also logs the breakdown)."""
    return plan_kv_pool(cache, spec, dtype, param_bytes, max_model_len,
                        activation_bytes=activation_bytes, kv_head_shards=kv_head_shards,
                        device_bytes=device_bytes, platform=platform,
                        host_devices=host_devices, kv_layers=kv_layers,
                        request_blocks=request_blocks,
                        extra_bytes_per_block=extra_bytes_per_block).num_blocks


def zeros_as(spec: jax.ShapeDtypeStruct | jax.Array) -> jax.Array:
    """A zeroed array of `spec`'s shape, dtype and sharding, made where it lies (no host copy,
    no device holding a whole sharded array)."""
    return jax.jit(lambda: jnp.zeros(spec.shape, spec.dtype), out_shardings=spec.sharding)()


def allocate_kv_cache(spec: ModelSpec, num_blocks: int, block_size: int,
                      dtype: jnp.dtype, kv_layers: int | None = None) -> KVCache:
    """Zeroed pages for every layer (or `kv_layers` slots: KV cache groups), scales 1.0."""
    layers = spec.num_layers if kv_layers is None else kv_layers
    shape = (layers * num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    stored = storage_dtype(dtype)
    return KVCache(
        k=jnp.zeros(shape, stored),
        v=jnp.zeros(shape, stored),
        k_scale=jnp.ones((spec.num_layers,), jnp.float32),
        v_scale=jnp.ones((spec.num_layers,), jnp.float32),
        num_blocks=num_blocks,
        dtype=jnp.dtype(dtype),
    )
