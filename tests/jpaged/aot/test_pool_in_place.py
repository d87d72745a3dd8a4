"""The engine's compiled CPU step updates the KV pool in place: no pool-sized copy or conversion,
for every KV dtype and attention path (xla, reference, the Pallas interpreter), tensor parallel
included, and for the KV tier transfer programs.

A copy would make every step cost in proportion to the pool (fp8 once did: 389 s for 8 tokens
at the default 2 GiB pool). The pool has 4099 blocks, more elements than any activation here, so
any buffer that large is the pool again (jpaged.aot.buffers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from helpers import xla_flags
from tiny_models import tiny_spec

from jpaged.aot.cases import StepBuilder, engine_config
from jpaged.aot.report import compile_lowered

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("tp_pool_worker.py")
NUM_BLOCKS = 4099
KV_DTYPES = ["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"]
SPEC = tiny_spec(max_position_embeddings=256)
CONFIG = engine_config(SPEC, max_num_seqs=16, max_num_batched_tokens=64)


def _builder(kv_dtype: str, backend: str) -> StepBuilder:
    return StepBuilder(SPEC, jnp.float32, kv_dtype, backend, NUM_BLOCKS, config=CONFIG)


def _check(builder: StepBuilder, lower) -> dict:
    row = compile_lowered(lower, False, None, builder.pool_shape())
    assert row["compiled"], row.get("error")
    assert row["pool_copies"] == [], row["pool_copies"]
    return row


@pytest.mark.parametrize("kv_dtype,shape", [
    *[(d, (64, 16)) for d in KV_DTYPES], ("fp8_e4m3", (16, 16))])
def test_xla_step_updates_the_pool_in_place(kv_dtype, shape):
    """Mixed steps in every KV dtype, and a decode step (the same ops at another shape)."""
    b = _builder(kv_dtype, "xla")
    assert shape in b.plan.all_shapes()
    row = _check(b, lambda: b.lower_step(*shape))
    assert row["pool_aliased"]


def test_step_activations_do_not_grow_with_the_pool():
    small, big = _builder("fp8_e4m3", "xla"), _builder("fp8_e4m3", "xla")
    big.num_blocks = 2 * NUM_BLOCKS
    temps = [_check(b, lambda b=b: b.lower_step(64, 16))["temp_bytes"] for b in (small, big)]
    assert temps[0] == temps[1]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_pallas_interpreter_step_updates_the_pool_in_place(kv_dtype):
    """The mixed step launches all three kernels. Their page BlockSpecs are the whole pool and
    fp8/bf16 pages move as bits, so the interpreter passes the pool through: at the default
    2 GiB pool a per-head page block, copied in and out by every program, made one 4-token
    generate take minutes."""
    b = _builder(kv_dtype, "pallas")
    assert _check(b, lambda: b.lower_step(64, 16))["pool_aliased"]


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3"])
def test_reference_step_updates_the_pool_in_place(kv_dtype):
    b = _builder(kv_dtype, "reference")
    assert _check(b, lambda: b.lower_step(64, 16))["pool_aliased"]


@pytest.mark.parametrize("kv_dtype", ["float32", "fp8_e4m3"])
def test_tier_transfers_touch_only_their_blocks(kv_dtype):
    b = _builder(kv_dtype, "xla")
    _check(b, lambda: b.lower_transfer("gather", 16))
    assert _check(b, lambda: b.lower_transfer("scatter", 16))["pool_aliased"]


def test_tensor_parallel_step_updates_each_shard_in_place():
    """tensor_parallel_size=3 over 3 forced CPU devices: each device's pool shard in place (the
    write under shard_map once copied it: 8 tokens took 44.6 s at 256 MiB per device)."""
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=3"),
           "JAX_PLATFORMS": "cpu"}
    pairs = ["float32:xla", "fp8_e4m3:xla", "bfloat16:reference", "fp8_e4m3:pallas"]
    proc = subprocess.run([sys.executable, str(WORKER), "3", *pairs], capture_output=True,
                          text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4
    for r in rows:
        assert r["compiled"], r.get("error")
        assert r["pool_shape"].endswith(",16,1,16]")  # one of the 3 KV heads per device
        assert r["pool_aliased"] and r["pool_copies"] == [], r
