"""One interface to choose the KV-write and attention implementations."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax

from pallas_kernels import reference, xla_attention

# jax.default_backend() says "gpu" on CUDA and ROCm; lowering platforms say "cuda"/"rocm".
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@dataclass(frozen=True)
class AttentionOps:
    """The two ops the engine's step calls; signatures are those of `pallas_kernels.reference`."""

    name: str
    write_kv: Callable
    ragged_paged_attention: Callable


def select_backend(name: str = "auto", platform: str | None = None) -> AttentionOps:
    """'xla', 'reference', 'pallas', or 'auto' (Pallas on GPU, 'xla' elsewhere).

    'xla' is the chunk-skipping jnp attention (`xla_attention`), 'reference' the simple one the
    kernels are tested against; both write K/V with `reference.write_kv`. 'pallas' off GPU runs
    the same kernels in interpret mode.
    """
    platform = platform or jax.default_backend()
    if name not in ("auto", "pallas", "reference", "xla"):
        raise ValueError("attention_backend must be one of auto, pallas, reference, xla; "
                         f"got {name!r}")
    on_gpu = platform in _GPU_PLATFORMS
    if name == "auto":
        name = "pallas" if on_gpu else "xla"
    if name == "reference":
        return AttentionOps("reference", reference.write_kv, reference.ragged_paged_attention)
    if name == "xla":
        return AttentionOps("xla", reference.write_kv, xla_attention.ragged_paged_attention)
    # Imported here so that the reference path never pulls in the Pallas machinery.
    from pallas_kernels import kv_write, ragged_paged_attention

    # Off GPU the kernels run in the Pallas interpreter (slow; for tests and debugging).
    interpret = not on_gpu
    return AttentionOps(
        "pallas",
        functools.partial(kv_write.write_kv, interpret=interpret),
        functools.partial(ragged_paged_attention.ragged_paged_attention, interpret=interpret),
    )
