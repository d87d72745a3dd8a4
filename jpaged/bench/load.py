"""Model load time per source format: the embedded GGUF, an HF safetensors dir, jpaged orbax.

Every format holds the same embedded SmolLM2 weights: the GGUF as shipped (Q4_1, dequantized
on load), and an HF directory and jpaged checkpoints written from the loaded float32 model.
A load is `load_model(path, dtype)` until every parameter is on the device (tokenizer
included). Formats are timed in turn within each round, so machine noise hits all alike; the
first round reads the files just written (warm page cache), as every later one does.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from models.checkpoint import save_checkpoint, save_hf_dir
from models.loader import embedded_gguf_path, load_model


def _disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def prepare_formats(workdir: Path, with_bf16: bool) -> dict[str, tuple[Path, str]]:
    """name -> (path, dtype to load it in) for each format, written under `workdir`."""
    gguf = embedded_gguf_path()
    src = load_model(str(gguf), "float32")
    formats = {
        "gguf_q4_1": (gguf, "float32"),
        "hf_safetensors_f32": (save_hf_dir(src, workdir / "hf"), "float32"),
        "jpaged_orbax_f32": (save_checkpoint(src, workdir / "orbax_f32"), "float32"),
    }
    if with_bf16:
        bf16 = load_model(str(gguf), "bfloat16")
        formats["jpaged_orbax_bf16"] = (save_checkpoint(bf16, workdir / "orbax_bf16"),
                                        "bfloat16")
    return formats


def time_load(path: Path, dtype: str) -> float:
    """Seconds of one load_model until every parameter is ready on its device."""
    t0 = time.perf_counter()
    loaded = load_model(str(path), dtype)
    jax.block_until_ready(jax.tree.leaves(nnx.state(loaded.model)))
    return time.perf_counter() - t0


def measure(workdir: Path, repeats: int, with_bf16: bool) -> dict[str, Any]:
    """Median load seconds of every format over `repeats` rounds, with sizes and ratios."""
    formats = prepare_formats(workdir, with_bf16)
    times: dict[str, list[float]] = {name: [] for name in formats}
    for _ in range(repeats):
        for name, (path, dtype) in formats.items():
            times[name].append(time_load(path, dtype))
    base = statistics.median(times["gguf_q4_1"])
    rows = []
    for name, (path, dtype) in formats.items():
        med = statistics.median(times[name])
        rows.append({"format": name, "dtype": dtype, "median_s": round(med, 3),
                     "min_s": round(min(times[name]), 3),
                     "all_s": [round(t, 3) for t in times[name]],
                     "disk_mib": round(_disk_bytes(path) / 2**20, 1),
                     "speedup_vs_gguf": round(base / med, 2)})
    return {"model": "embedded SmolLM2-135M-Instruct", "repeats": repeats, "rows": rows}
