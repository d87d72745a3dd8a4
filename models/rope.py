"""Rotary position embeddings (half-split "rotate_half" layout, as HF Llama/Qwen use)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .config import ModelSpec


def inverse_frequencies(spec: ModelSpec) -> np.ndarray:
    """Per-pair angular frequencies, shape (head_dim // 2,), float32, with rope scaling applied."""
    exponents = np.arange(0, spec.head_dim, 2, dtype=np.float32) / np.float32(spec.head_dim)
    inv_freq = (1.0 / (np.float32(spec.rope_theta) ** exponents)).astype(np.float32)
    if spec.rope_scaling is None:
        return inv_freq
    params = dict(spec.rope_scaling)
    kind = params["rope_type"]
    if kind == "linear":
        return (inv_freq / np.float32(params["factor"])).astype(np.float32)
    if kind == "freq_factors":
        factors = np.asarray(params["factors"], dtype=np.float32)  # (half,): ModelSpec checks
        return (inv_freq / factors).astype(np.float32)
    if kind == "llama3":
        return _llama3_scale(inv_freq, params)
    raise ValueError(f"unsupported rope_type {kind!r}")


def _llama3_scale(inv_freq: np.ndarray, params: dict) -> np.ndarray:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, middle blended."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # wavelen > old_len / low  -> fully scaled; wavelen < old_len / high -> untouched.
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_cos_sin(
    inv_freq: Float[Array, " half"], positions: Int[Array, " T"]
) -> tuple[Float[Array, "T half"], Float[Array, "T half"]]:
    """cos and sin of position * frequency, float32."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: Float[Array, "T heads head_dim"],
    cos: Float[Array, "T half"],
    sin: Float[Array, "T half"],
) -> Float[Array, "T heads head_dim"]:
    """Rotate pairs (x[i], x[i + head_dim/2]) by the position angle; computed in float32."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)
