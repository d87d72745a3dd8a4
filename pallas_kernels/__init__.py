"""Paged-attention kernels: a pure-jnp reference and Pallas GPU kernels behind one interface."""

from pallas_kernels.backend import AttentionOps, select_backend

# Launch-name prefixes of the Pallas kernels (their `name=` in pallas_call), by which compiled
# programs are searched for them (jpaged.aot.kernels).
KERNEL_PREFIXES = (
    "kv_write", "ragged_paged_", "paged_decode_", "paged_merge_", "decode_matmul_", "moe_")

__all__ = ["KERNEL_PREFIXES", "AttentionOps", "select_backend"]
