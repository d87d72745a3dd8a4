"""Decode step time per KV cache dtype at the DEFAULT pool size, side by side in one run.

The pool is sized as a user gets it (no sizing flag: 2 GiB on CPU, so fp8 holds 4x the blocks
of float32). A step whose cost grew with the pool (a copy or conversion of it) would show here
as an fp8 step many times a float32 one; the bar is fp8 <= 2x float32.
"""

from __future__ import annotations

import gc
from typing import Any

from jpaged.bench.engine_bench import host_overhead
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from models.loader import LoadedModel

KV_DTYPES = ("float32", "bfloat16", "fp8")


def decode_step_times(loaded: LoadedModel, batches: tuple[int, ...], steps: int,
                      kv_dtypes: tuple[str, ...] = KV_DTYPES) -> dict[str, Any]:
    """Per KV dtype: blocks of the default pool and the median decode step per batch."""
    rows = []
    for kvd in kv_dtypes:
        engine = LLMEngine(EngineArgs(kv_cache_dtype=kvd, disable_log_stats=True),
                           loaded=loaded)
        row: dict[str, Any] = {"kv_cache_dtype": kvd,
                               "num_blocks": engine.config.cache.num_gpu_blocks,
                               "pool_bytes": int(engine.runner.kv.k.nbytes
                                                 + engine.runner.kv.v.nbytes)}
        for b in batches:
            row[f"decode_ms_b{b}"] = host_overhead(engine, b, steps=steps)["device_ms"]
        rows.append(row)
        engine.runner.kv = None  # free this pool before the next engine allocates its own
        del engine
        gc.collect()
    base = rows[0]
    for row in rows:
        for b in batches:
            row[f"ratio_vs_{base['kv_cache_dtype']}_b{b}"] = (
                row[f"decode_ms_b{b}"] / base[f"decode_ms_b{b}"])
    return {"rows": rows, "batches": list(batches), "steps": steps}
