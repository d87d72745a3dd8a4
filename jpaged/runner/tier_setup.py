"""Building the KV tiers of an engine: host tier size, disk tier directory and fingerprint."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from typing import Any

import jax
import numpy as np
from flax import nnx

from jpaged.config import DEFAULT_KV_CACHE_DIR, CacheConfig
from jpaged.core.block_hash import seed_digest
from jpaged.core.disk_tier import DiskTier, model_fingerprint
from jpaged.core.offload import HostTier, KVTiers
from jpaged.runner.kv_cache import KVCache, available_host_bytes
from models.config import ModelSpec

logger = logging.getLogger("jpaged")

DIGEST_ROWS = 8  # embedding rows hashed at each end of the table for weights_digest


def check_tier_config(cache: CacheConfig) -> None:
    """Refuse tier settings that cannot work, naming the field (before any weights load)."""
    if cache.preemption_mode == "swap" and cache.kv_offloading_size <= 0:
        raise ValueError("preemption_mode='swap' needs a host tier: set kv_offloading_size > 0")
    if cache.swap_space > 0 and cache.kv_offloading_size <= 0:
        raise ValueError("swap_space > 0 (the disk KV tier) is fed by the host tier: set "
                         "kv_offloading_size > 0 too")
    if cache.swap_space > 0:  # the disk tier opens after the first step: its folder now
        directory = disk_tier_dir(cache)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_cache_dir={directory!r}: cannot make the disk KV tier's "
                             f"folder ({e.strerror or e})") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ValueError(f"kv_cache_dir={directory!r} is not writable")
        free = shutil.disk_usage(directory).free
        if cache.swap_space * 2**30 > free:
            logger.warning("swap_space=%s GiB is more than the free space under %s (%.1f GiB): "
                           "the disk KV tier will fail to write past it", cache.swap_space,
                           directory, free / 2**30)
    elif cache.kv_cache_dir is not None:
        logger.warning("kv_cache_dir is set but swap_space is 0: no disk KV tier is used")
    if (cache.kv_offloading_size > 0 and not cache.enable_prefix_caching
            and cache.preemption_mode != "swap"):
        logger.warning("kv_offloading_size > 0 with prefix caching off and recompute preemption: "
                       "the KV tiers hold cached prefixes and swapped requests, so they stay "
                       "empty")


def disk_tier_dir(cache: CacheConfig) -> str:
    """The disk tier's folder: kv_cache_dir, else the default, with ~ expanded."""
    return os.path.expanduser(cache.kv_cache_dir or DEFAULT_KV_CACHE_DIR)


def block_shape(spec: ModelSpec, block_size: int,
                kv_layers: int | None = None) -> tuple[int, int, int, int, int]:
    """Host layout of one block: (num_layers, 2, block_size, num_kv_heads, head_dim); with KV
    cache groups `kv_layers` (the layout's slots) instead of num_layers."""
    layers = spec.num_layers if kv_layers is None else kv_layers
    return (layers, 2, block_size, spec.num_kv_heads, spec.head_dim)


def build_host_tier(cache: CacheConfig, spec: ModelSpec, kv_dtype: Any,
                    kv_layers: int | None = None) -> KVTiers | None:
    """The host tier of `kv_offloading_size` GiB (None when it is 0)."""
    if cache.kv_offloading_size <= 0:
        return None
    shape = block_shape(spec, cache.block_size, kv_layers)
    per_block = int(np.prod(shape)) * np.dtype(kv_dtype).itemsize
    capacity = int(cache.kv_offloading_size * 2**30) // per_block
    if capacity < 1:
        raise ValueError(f"kv_offloading_size={cache.kv_offloading_size} GiB holds no KV block "
                         f"of {per_block} bytes; raise it")
    available = available_host_bytes()
    if capacity * per_block > available:
        raise ValueError(f"kv_offloading_size={cache.kv_offloading_size} GiB is more than the "
                         f"host memory available now ({available / 2**30:.1f} GiB); lower it")
    logger.info("host KV tier: %d blocks, %.2f GiB", capacity, capacity * per_block / 2**30)
    return KVTiers(HostTier(capacity, shape, np.dtype(kv_dtype)))


def weights_digest(model: nnx.Module) -> str:
    """sha256 over the first and last DIGEST_ROWS rows of the embedding table (+ its shape)."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model))
    named = [(jax.tree_util.keystr(p), x) for p, x in leaves]
    embeds = [x for name, x in named if "embed" in name]
    table = embeds[0] if embeds else min(named, key=lambda t: t[0])[1]
    arr = np.asarray(jax.device_get(table))
    h = hashlib.sha256(repr((arr.shape, arr.dtype.name)).encode())
    h.update(np.ascontiguousarray(arr[:DIGEST_ROWS]).tobytes())
    h.update(np.ascontiguousarray(arr[-DIGEST_ROWS:]).tobytes())
    return h.hexdigest()


def open_disk_tier(cache: CacheConfig, spec: ModelSpec, kv_dtype: Any, source: str,
                   model: nnx.Module, kv: KVCache, kv_groups: Any = None,
                   directory: str | None = None, capacity_bytes: int | None = None) -> DiskTier:
    """The disk tier for this model, dtype, block size and the pool's current fp8 scales
    (`kv_groups`: the KVCacheLayout when it has more than one group or slides); `directory`
    and `capacity_bytes` default to kv_cache_dir and swap_space."""
    scales = tuple(float(s) for s in np.concatenate(
        [np.asarray(jax.device_get(kv.k_scale)), np.asarray(jax.device_get(kv.v_scale))]))
    fp = model_fingerprint(source=os.path.abspath(source) if os.path.exists(source) else source,
                           spec_repr=repr(spec), kv_dtype=np.dtype(kv_dtype).name,
                           block_size=cache.block_size,
                           hash_algo=cache.prefix_caching_hash_algo,
                           weights_digest=weights_digest(model), kv_scales=scales,
                           kv_groups=None if kv_groups is None else repr(kv_groups.describe()),
                           seed_digest=seed_digest(cache.prefix_caching_hash_seed))
    directory = os.path.expanduser(directory) if directory else disk_tier_dir(cache)
    capacity = int(cache.swap_space * 2**30) if capacity_bytes is None else capacity_bytes
    disk = DiskTier(directory, capacity, fp,
                    block_shape(spec, cache.block_size,
                                None if kv_groups is None else kv_groups.num_slots),
                    np.dtype(kv_dtype), seed_digest=seed_digest(cache.prefix_caching_hash_seed))
    logger.info("disk KV store: %s/%s, %d blocks found, %.2f GiB", directory, fp[:12],
                len(disk), capacity / 2**30)
    others = _other_folders_bytes(directory, fp)
    if others > capacity:
        # swap_space caps each fingerprint's folder; the others (other models, dtypes, block
        # sizes, or fp8 scales calculated from another first batch) are never deleted here.
        logger.warning("kv_cache_dir %s holds %.2f GiB of other disk KV tiers (other models, "
                       "dtypes or calculated fp8 scales) beside this one's %.2f GiB cap; "
                       "swap_space caps each, so delete the folders you no longer use",
                       directory, others / 2**30, capacity / 2**30)
    return disk


def _other_folders_bytes(directory: str, fingerprint: str) -> int:
    """Bytes of the files in `directory`'s subfolders other than `fingerprint`'s."""
    total = 0
    try:
        with os.scandir(directory) as entries:
            folders = [e.path for e in entries if e.is_dir() and e.name != fingerprint]
        for folder in folders:
            for root, _, files in os.walk(folder):
                total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    except OSError:  # a folder removed meanwhile: its bytes are gone anyway
        pass
    return total
