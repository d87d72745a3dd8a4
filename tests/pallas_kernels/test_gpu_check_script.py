"""scripts/gpu_check.py imports and configures (its --cpu-smoke run is part of
tests/jpaged/bench/test_device_check.py)."""

import argparse
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def test_gpu_check_configures_every_mode():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for smoke, quick in [(True, False), (False, True), (False, False)]:
        cfg = mod.configure(argparse.Namespace(cpu_smoke=smoke, quick=quick))
        assert cfg["interpret"] == smoke
        assert all(p % 1 == 0 for p, *_ in cfg["tune_grid"])
        assert cfg["decode"] and cfg["mixed"]
        # The 16-byte copy's buffer: whole blocks of every Pallas copy variant.
        assert cfg["copy16_bytes"] % (16384 * 4) == 0
        assert cfg["copy16_bytes"] == (2**20 if smoke else 2**30)


def test_bench_inputs_rotations_are_disjoint():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.bench_inputs import paged_batch, rotations_for

    b = paged_batch(jax.random.key(0), [5, 16, 1], [1, 3, 1], hq=4, hkv=2, d=8, bs=4,
                    page_dtype=jnp.float8_e4m3fn, rotations=3, pad_tokens=2)
    assert b.q.shape == (7, 4, 8) and b.tables.shape == (3, 3, 4)
    assert list(np.asarray(b.qsl)) == [0, 1, 4, 5]
    used = [set(np.asarray(t)[np.asarray(t) > 0].tolist()) for t in b.tables]
    assert all(len(u) == 2 + 4 + 1 for u in used)  # blocks per sequence: 2, 4, 1
    assert not (used[0] & used[1]) and not (used[1] & used[2])
    assert b.kv_bytes == 2 * 22 * 2 * 8 * 1
    assert rotations_for(2**40) == 1 and rotations_for(1) == 8
