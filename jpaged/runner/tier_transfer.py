"""Batched block moves between the device KV pool and the host tier's store.

Per step at most ONE gather (all outgoing blocks: one jitted take over the layer rows, then one
device_get) and ONE load (one device_put of all incoming blocks, then one jitted scatter with the
pool donated). Block counts are padded to power-of-4 buckets (4, 16, 64, ...) so the two
functions compile once per bucket, not per count. A block's host layout is
``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]`` in the page dtype (fp8 included:
numpy holds ml_dtypes' float8 types bit for bit; the device pool's fp8/bf16 bit-pattern storage
is bitcast on device, the moved blocks only); layer l's copy of block b is pool row
``l * num_blocks + b``.

Order inside ``apply``: gathers, then loads; the engine calls it before the step's forward.

Staging memory: where the pool's device offers jax's ``pinned_host`` memory kind (GPU backends,
and XLA:CPU too), gathered blocks land in pinned host buffers (the jitted gather's output
sharding) and loads are put into pinned host memory and moved to the device inside the jitted
scatter, so the copies are DMA transfers; otherwise (or for a pool sharded over a mesh) plain
device_get / device_put. The host tier's slot store itself is numpy in both cases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding
from jaxtyping import Array, Int

from jpaged.core.offload import TransferPlan
from jpaged.runner.kv_cache import KVCache
from pallas_kernels.reference import from_bits, to_bits

MIN_BUCKET = 4


def bucket(n: int) -> int:
    """The padded block count for n blocks: the smallest power of 4 >= max(n, MIN_BUCKET)."""
    b = MIN_BUCKET
    while b < n:
        b *= 4
    return b


def _rows(ids: Int[Array, " P"], num_layers: int, num_blocks: int) -> Int[Array, "P L"]:
    return ids[:, None] + jnp.arange(num_layers, dtype=ids.dtype)[None, :] * num_blocks


def _gather_impl(kv: KVCache, ids: Int[Array, " P"]) -> Array:
    """[P, L, 2, bs, H, D] copies of blocks `ids` (padding ids point at the null block 0)."""
    num_layers = kv.k.shape[0] // kv.num_blocks
    rows = _rows(ids, num_layers, kv.num_blocks).reshape(-1)
    k = jnp.take(kv.k, rows, axis=0)
    v = jnp.take(kv.v, rows, axis=0)
    out = from_bits(jnp.stack([k, v], axis=1), kv.dtype)  # [P*L, 2, bs, H, D], page dtype
    return out.reshape(ids.shape[0], num_layers, *out.shape[1:])


_gather = jax.jit(_gather_impl)


def _scatter_impl(kv: KVCache, ids: Int[Array, " P"], data: Array) -> KVCache:
    num_layers = kv.k.shape[0] // kv.num_blocks
    rows = _rows(ids, num_layers, kv.num_blocks)
    # Padding ids are -1: send them past the end, where mode="drop" writes nothing.
    rows = jnp.where(ids[:, None] < 0, kv.k.shape[0], rows).reshape(-1)
    flat = to_bits(data.reshape(-1, *data.shape[2:]))  # [P*L, 2, bs, H, D], stored dtype
    k = kv.k.at[rows].set(flat[:, 0], mode="drop")
    v = kv.v.at[rows].set(flat[:, 1], mode="drop")
    return dataclasses.replace(kv, k=k, v=v)


_scatter = jax.jit(_scatter_impl, donate_argnames=("kv",))


def pinned_staging(kv: KVCache) -> tuple[SingleDeviceSharding, SingleDeviceSharding] | None:
    """(pinned_host, device) shardings for a single-device pool whose device has pinned memory."""
    devices = kv.k.sharding.device_set
    if len(devices) != 1:
        return None
    (dev,) = devices
    try:
        kinds = {m.kind for m in dev.addressable_memories()}
    except Exception:  # backends without memory kinds
        return None
    if "pinned_host" not in kinds:
        return None
    return (SingleDeviceSharding(dev, memory_kind="pinned_host"),
            SingleDeviceSharding(dev, memory_kind="device"))


_PINNED_FNS: dict[tuple[SingleDeviceSharding, SingleDeviceSharding], tuple[Any, Any]] = {}


def _pinned_fns(host: SingleDeviceSharding, device: SingleDeviceSharding) -> tuple[Any, Any]:
    """The jitted (gather, scatter) staging through pinned host memory, one pair per device."""
    fns = _PINNED_FNS.get((host, device))
    if fns is None:
        def scatter(kv: KVCache, ids: Array, data: Array) -> KVCache:
            return _scatter_impl(kv, ids, jax.device_put(data, device))  # pinned host -> device

        fns = (jax.jit(_gather_impl, out_shardings=host),
               jax.jit(scatter, donate_argnames=("kv",)))
        _PINNED_FNS[(host, device)] = fns
    return fns


def power_of_two_chunks(n: int) -> list[int]:
    """n as a sum of distinct powers of two, largest first (24 -> [16, 8])."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


def gather_on_device(kv: KVCache, block_ids: Sequence[int]) -> list[Array]:
    """Device copies of blocks `block_ids` in the page dtype, in chunks of power-of-two sizes
    [2^k, L, 2, bs, H, D] (`power_of_two_chunks`): what a KV connector hands to another engine.
    No padding moves, and a gather compiles once per power of two."""
    out, i = [], 0
    for size in power_of_two_chunks(len(block_ids)):
        out.append(_gather(kv, jnp.asarray(np.asarray(block_ids[i:i + size], np.int32))))
        i += size
    return out


def scatter_from_device(kv: KVCache, block_ids: Sequence[int],
                        chunks: Sequence[Array]) -> KVCache:
    """Write `chunks` (from gather_on_device, already on the pool's device) into blocks
    `block_ids`, in order; `kv` is donated."""
    page = (kv.k.shape[0] // kv.num_blocks, 2, *kv.k.shape[1:])
    if sum(c.shape[0] for c in chunks) != len(block_ids) or any(
            tuple(c.shape[1:]) != page for c in chunks):
        raise ValueError(f"scatter: chunks {[tuple(c.shape) for c in chunks]} for "
                         f"{len(block_ids)} blocks of pages {page}")
    i = 0
    for c in chunks:
        ids = jnp.asarray(np.asarray(block_ids[i:i + c.shape[0]], np.int32))
        kv = _scatter(kv, ids, c)
        i += c.shape[0]
    return kv


class TierTransfer:
    """Runs a step's TransferPlan against the device pool and a host store."""

    def __init__(self, use_pinned: bool = True) -> None:
        self.num_gathers = 0  # device->host batches run
        self.num_scatters = 0  # host->device batches run
        self.use_pinned = use_pinned  # stage through pinned_host memory where the device has it

    def _staging(self, kv: KVCache) -> tuple[SingleDeviceSharding, SingleDeviceSharding] | None:
        return pinned_staging(kv) if self.use_pinned else None

    def gather(self, kv: KVCache, block_ids: Sequence[int]) -> np.ndarray:
        """Host copies [n, L, 2, bs, H, D] of device blocks `block_ids` (one device_get)."""
        n = len(block_ids)
        ids = np.zeros(bucket(n), np.int32)
        ids[:n] = block_ids
        staging = self._staging(kv)
        fn = _gather if staging is None else _pinned_fns(*staging)[0]
        return np.asarray(jax.device_get(fn(kv, jnp.asarray(ids))))[:n]

    def scatter(self, kv: KVCache, block_ids: Sequence[int], data: np.ndarray) -> KVCache:
        """Write data [n, L, 2, bs, H, D] into device blocks `block_ids`; `kv` is donated."""
        n = len(block_ids)
        if data.shape[0] != n:
            raise ValueError(f"scatter: {data.shape[0]} blocks of data for {n} block ids")
        p = bucket(n)
        ids = np.full(p, -1, np.int32)
        ids[:n] = block_ids
        padded = np.zeros((p, *data.shape[1:]), data.dtype)
        padded[:n] = data
        staging = self._staging(kv)
        if staging is None:
            return _scatter(kv, jnp.asarray(ids), jax.device_put(padded))
        return _pinned_fns(*staging)[1](kv, jnp.asarray(ids), jax.device_put(padded, staging[0]))

    def apply(self, kv: KVCache, plan: TransferPlan, store: np.ndarray) -> KVCache:
        """Run all gathers (into `store` slots), then all loads (from `store`); returns the pool.

        store: [capacity, L, 2, bs, H, D], the host tier's slots.
        """
        if plan.gathers:
            blocks, slots = zip(*plan.gathers, strict=True)
            store[list(slots)] = self.gather(kv, blocks)
            self.num_gathers += 1
        if plan.loads:
            slots, blocks = zip(*plan.loads, strict=True)
            kv = self.scatter(kv, blocks, store[list(slots)])
            self.num_scatters += 1
        return kv

    @staticmethod
    def num_compiled() -> int:
        """Executables held by the gathers and the scatters (one per bucket seen)."""
        fns = [_gather, _scatter, *(f for pair in _PINNED_FNS.values() for f in pair)]
        return sum(f._cache_size() for f in fns)
