"""Peak activation memory of the compiled step, read from XLA's memory analysis.

The pool is sized before it exists, so the step is lowered on abstract arguments
(jax.ShapeDtypeStruct): the parameters, a 2-block KV pool and the all-padding batch of the
LARGEST bucket shape. Its `temp_size_in_bytes` is what one step needs beside its arguments and
does not depend on the pool size (the pool is donated and written in place). Nothing is
allocated and the engine's own jitted step is not touched: this compiles a throwaway copy.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.runner.batch import BucketPlan, empty_step, flatten_step
from jpaged.runner.kv_cache import KVCache, storage_dtype
from jpaged.runner.model_runner import ModelRunner
from jpaged.runner.sampler import SamplingFlags
from models.config import ModelSpec
from pallas_kernels.backend import AttentionOps

logger = logging.getLogger("jpaged")

PROBE_BLOCKS = 2  # the null block plus one: the smallest legal pool


def _abstract(x: object) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)  # type: ignore[attr-defined]


def abstract_kv(spec: ModelSpec, num_blocks: int, block_size: int, dtype: jnp.dtype, *,
                kv_heads: int | None = None, sharding: Any = None,
                kv_layers: int | None = None) -> KVCache:
    """A KVCache of ShapeDtypeStructs (nothing allocated), shaped as `allocate_kv_cache`'s.

    `kv_heads`: the pool's head count when it differs from the model's (tensor parallelism
    stores replicated heads); `sharding`: placed on every leaf (a deviceless compile's device);
    `kv_layers`: slots per block when not every layer (KV cache groups).
    """
    heads = spec.num_kv_heads if kv_heads is None else kv_heads
    layers = spec.num_layers if kv_layers is None else kv_layers
    shape = (layers * num_blocks, block_size, heads, spec.head_dim)
    pages = jax.ShapeDtypeStruct(shape, storage_dtype(dtype), sharding=sharding)
    scale = jax.ShapeDtypeStruct((spec.num_layers,), jnp.float32, sharding=sharding)
    return KVCache(pages, pages, scale, scale, num_blocks, jnp.dtype(dtype))


def largest_shape(plan: BucketPlan) -> tuple[int, int]:
    """The (T, B) bucket with the most tokens, then the most sequences."""
    return max(plan.all_shapes())


def step_activation_bytes(model: nnx.Module, spec: ModelSpec, plan: BucketPlan, block_size: int,
                          dtype: jnp.dtype, ops: AttentionOps) -> int | None:
    """Temp bytes of the step compiled at the largest bucket shape; None if XLA does not say."""
    t0 = time.perf_counter()
    kv = abstract_kv(spec, PROBE_BLOCKS, block_size, dtype)
    runner = ModelRunner(model, kv, plan, block_size, spec.vocab_size, ops)
    t, b = largest_shape(plan)
    batch = jax.tree.map(_abstract, flatten_step(empty_step(plan, t, b, spec.vocab_size).batch))
    params = jax.tree.map(_abstract, runner.params)
    # With top candidates on: the step variant a request with logprobs runs holds the top-k's
    # buffers too, and the pool must leave room for it.
    compiled = runner._jit_step.lower(params, kv, batch, runner.last_tokens_spec(),
                                      flags=SamplingFlags(top_logprobs=True)).compile()
    try:
        stats = compiled.memory_analysis()
    except Exception as e:  # some backends raise instead of returning None
        logger.info("memory analysis unavailable: %s", e)
        stats = None
    temp = getattr(stats, "temp_size_in_bytes", None) if stats is not None else None
    logger.info("step memory probe at T=%d, B=%d: %s temp bytes (%.1fs)", t, b,
                "no" if temp is None else temp, time.perf_counter() - t0)
    return None if temp is None else int(temp)
