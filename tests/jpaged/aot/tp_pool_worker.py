"""Run in a subprocess with forced CPU devices: compile the tensor-parallel engine step and print
one JSON line per (KV dtype, backend, shape) with what the buffer assignment says of the pool."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))

import jax.numpy as jnp  # noqa: E402
from tiny_models import tiny_spec  # noqa: E402

from jpaged.aot.cases import StepBuilder, engine_config  # noqa: E402
from jpaged.aot.report import compile_lowered  # noqa: E402


def main() -> None:
    """argv: tensor_parallel_size, then kv_dtype:backend pairs."""
    tp = int(sys.argv[1])
    spec = tiny_spec(num_heads=6, num_kv_heads=3, intermediate_size=96,
                     max_position_embeddings=256)
    config = engine_config(spec, max_num_seqs=16, max_num_batched_tokens=64,
                           tensor_parallel_size=tp)
    for pair in sys.argv[2:]:
        kv_dtype, backend = pair.split(":")
        b = StepBuilder(spec, jnp.float32, kv_dtype, backend, 4099, tensor_parallel_size=tp,
                        config=config)
        for shape in [(64, 16)]:  # a mixed step: the write, the attention and the logits
            row = compile_lowered(lambda b=b, shape=shape: b.lower_step(*shape), False, None,
                                  b.pool_shape())
            print(json.dumps({"kv_dtype": kv_dtype, "backend": backend, "shape": shape,
                              "pool_shape": b.pool_shape(), **row}), flush=True)


if __name__ == "__main__":
    main()
