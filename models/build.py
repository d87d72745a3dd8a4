"""What every loader builds on: the dtypes, the model built for its shapes alone, and the
ready model (``LoadedModel``). Its own module so the loaders (``loader.py``) and the checkpoint
reader (``checkpoint.py``) share it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelSpec
from .registry import get_model_class
from .tokenizer import Tokenizer

__all__ = ["DTYPES", "LoadedModel", "abstract_model", "resolve_dtype"]

DTYPES: dict[str, Any] = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


@dataclass
class LoadedModel:
    """A ready model: spec, NNX module holding weights, tokenizer, and where it came from."""

    spec: ModelSpec
    model: nnx.Module
    tokenizer: Tokenizer
    source: str  # local path of the .gguf file or HF directory that was loaded
    quantization: str | None = None  # how its weights are quantized ("gguf", "fp8"), or None
    # The sampling defaults its creator recommends (generation_config.json's temperature,
    # top_p, top_k, min_p, repetition_penalty): vLLM's --generation-config auto.
    generation_config: dict[str, Any] = field(default_factory=dict)


def resolve_dtype(dtype: str) -> Any:
    """jnp dtype for 'auto' | 'float32' | 'bfloat16' | 'float16'; auto = bf16 on accelerators."""
    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if dtype not in DTYPES:
        allowed = ", ".join(map(repr, ["auto", *DTYPES]))
        raise ValueError(f"dtype must be one of {allowed}; got {dtype!r}")
    return DTYPES[dtype]


class _ShapeOnlyRngs:
    """Stands in for nnx.Rngs where a model is built for its shapes alone: every draw is one
    fixed key. nnx.Rngs counts its draws in a Variable; updating it with a traced value made
    flax probe the tracer's `.sharding`, for which jax writes an error message that walks the
    whole trace so far, so building the embedded model's 211 parameters took ~0.8 s of its
    load (~0.2 s this way; the structure and shapes are the same)."""

    def __init__(self) -> None:
        self._key = jax.random.key(0)

    def params(self) -> jax.Array:
        """The key a parameter's initializer reads (its values are never made)."""
        return self._key

    def __call__(self) -> jax.Array:
        return self._key


def abstract_model(spec: ModelSpec, dtype: Any) -> nnx.Module:
    """The spec's model with abstract parameters (shapes and dtypes; nothing allocated)."""
    cls = get_model_class(spec.architecture)
    return nnx.eval_shape(lambda: cls(spec, dtype=dtype, rngs=_ShapeOnlyRngs()))
