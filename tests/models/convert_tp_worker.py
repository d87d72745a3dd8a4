"""A converted checkpoint on 4 forced CPU devices; run by test_convert.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python convert_tp_worker.py CKPT_DIR \
        [STACKED_DIR]

Loads CKPT_DIR (the embedded model converted to float32) through `LLM(model=CKPT_DIR)` at
tensor_parallel_size 1 and 3 (and STACKED_DIR, the same checkpoint in format version 1's
stacked layout, at 3) and prints one JSON object of facts on the last line of stdout: greedy
tokens of each, and how the restored parameters are laid out over the devices.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The repo root first: tests/jpaged would otherwise shadow the jpaged package.
sys.path[:0] = [str(ROOT)]

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("JPAGED_TEST_JAX_CACHE", str(ROOT / ".jax_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

from jpaged import LLM, SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "1, 2, 3,"]
ARGS = dict(dtype="float32", max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16,
            num_gpu_blocks_override=8)


def q_proj_facts(llm: LLM) -> dict:
    """Shard shapes and bytes of the q_proj kernel as loaded, and as the runner holds it."""
    # A CPU engine runs the stacked twin (ScannedLayers: [layers, in, out]); else layer 0.
    layers = llm.llm_engine.loaded.model.model.layers
    layer = layers.layer if hasattr(layers, "layer") else layers[0]
    loaded = layer.self_attn.q_proj.kernel[...]
    held = llm.llm_engine.runner.params["model"]["layers"]
    runner = (held["layer"] if "layer" in held else held[0])["self_attn"]["q_proj"]["kernel"]
    runner = runner[...] if hasattr(runner, "get_value") else runner
    return {
        "global_shape": list(loaded.shape),
        "global_bytes": int(loaded.nbytes),
        "shard_shapes": [list(s.data.shape) for s in loaded.addressable_shards],
        "shard_bytes": [int(s.data.nbytes) for s in loaded.addressable_shards],
        "shard_devices": sorted(s.device.id for s in loaded.addressable_shards),
        # The engine's placement found the restored arrays already where they belong.
        "runner_same_sharding": runner.sharding == loaded.sharding,
    }


def main() -> None:
    """Generate at tp 1 and 3 from the checkpoint; print the facts as JSON."""
    ckpt = sys.argv[1]
    out: dict = {"num_devices": jax.device_count()}
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    runs = [(f"tp{tp}", ckpt, tp) for tp in (1, 3)]
    if len(sys.argv) > 2:
        runs.append(("stacked_tp3", sys.argv[2], 3))
    for name, path, tp in runs:
        llm = LLM(model=path, tensor_parallel_size=tp, **ARGS)
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        out[name] = {"tokens": [o.outputs[0].token_ids for o in outs],
                     "q_proj": q_proj_facts(llm)}
        del llm
    print(json.dumps(out))


if __name__ == "__main__":
    main()
