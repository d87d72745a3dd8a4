"""Paged-attention kernels: a pure-jnp reference and Pallas GPU kernels behind one interface."""

from pallas_kernels.backend import AttentionOps, select_backend

__all__ = ["AttentionOps", "select_backend"]
