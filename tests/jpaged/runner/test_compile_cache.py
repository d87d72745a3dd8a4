"""The engine's persistent compilation cache: where it goes, when it is left alone, and that a
second process loads the executables the first one wrote. Each case runs in a fresh process
(JAX decides once per process whether a cache is in use)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

PROBE = """
import json, sys
import jax, jax.numpy as jnp
if sys.argv[1] == "preset":
    jax.config.update("jax_compilation_cache_dir", sys.argv[2])
jnp.zeros(3).block_until_ready()  # a compile before the cache is set: it must still count
from jpaged.runner.compile_cache import enable_compilation_cache
where = enable_compilation_cache()
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
misses = []
jax.monitoring.register_event_listener(
    lambda name, **kw: misses.append(name) if name.endswith("cache_misses") else None)
f = jax.jit(lambda x: jnp.sin(x) * 3 + jnp.cos(x) ** 2)
f(jnp.arange(17.0)).block_until_ready()
print(json.dumps({"where": where, "misses": len(misses)}))
"""


def _probe(env_dir: str | None, mode: str = "default", preset: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JPAGED_COMPILE_CACHE_DIR"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    if env_dir is not None:
        env["JPAGED_COMPILE_CACHE_DIR"] = env_dir
    proc = subprocess.run([sys.executable, "-c", PROBE, mode, preset], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    cache = tmp_path / "xla"
    first = _probe(str(cache))
    assert first["where"] == str(cache) and first["misses"] >= 1
    assert any(cache.iterdir())
    assert (cache.stat().st_mode & 0o777) == 0o700  # trusted code: the owner's alone
    assert _probe(str(cache))["misses"] == 0  # loaded from disk, not compiled


def test_off_disables_and_a_preset_directory_is_kept(tmp_path):
    assert _probe("off")["where"] is None
    preset = tmp_path / "mine"
    got = _probe(str(tmp_path / "ignored"), "preset", str(preset))
    assert got["where"] == str(preset) and not (tmp_path / "ignored").exists()
