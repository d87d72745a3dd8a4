"""Shared test helpers: the embedded model loaded once, an HF twin of it, engine factories."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.llm import LLM
from models.loader import LoadedModel, load_model


def xla_flags(*extra: str) -> str:
    """XLA_FLAGS for a process a test starts: the suite's (tests/conftest.py) plus `extra`."""
    return " ".join([os.environ.get("XLA_FLAGS", ""), *extra]).strip()


def run_on_cpu_devices(script: str, num_devices: int, cwd: Path) -> str:
    """Run a `python -c` script on `num_devices` forced CPU devices (a fresh process: the
    count is fixed when jax starts) and return its stdout; fails the test, with the output's
    tail, if it exits non-zero or does not end with "tp ok"."""
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={num_devices}"))
    proc = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("tp ok"), proc.stdout[-2000:]
    return proc.stdout


def free_port(span: int = 1) -> int:
    """A port P of 127.0.0.1 with P .. P+span-1 free now (a multi-process run uses P and P+1)."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span > 65535:
            continue
        try:
            for k in range(1, span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + k))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {span} consecutive free ports on 127.0.0.1")


def wait_until_healthy(proc, port: int, output, timeout: float = 180.0) -> None:
    """Until `jpaged serve` (subprocess `proc`) answers 200 on /health at 127.0.0.1:`port`;
    fails with `output()` (what the process wrote) if it exits first, or at the timeout."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, output()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.25)


@functools.lru_cache(maxsize=1)
def embedded() -> LoadedModel:
    """The embedded SmolLM2 in float32, loaded once per test session."""
    return load_model(None, dtype="float32")


@functools.lru_cache(maxsize=1)
def tiny_model_dir() -> Path:
    """A 2-layer random Llama HF directory (byte tokenizer) in a temp dir, made once."""
    import tempfile

    from tiny_models import random_weights, tiny_spec, write_hf_dir

    spec = tiny_spec(max_position_embeddings=512)
    path = Path(tempfile.mkdtemp(prefix="jpaged-tiny-")) / "tiny-llama"
    return write_hf_dir(path, spec, random_weights(spec, seed=0))


@functools.lru_cache(maxsize=1)
def tiny() -> LoadedModel:
    """The tiny random Llama, loaded once."""
    return load_model(str(tiny_model_dir()), dtype="float32")


SIZING_ARGS = ("num_gpu_blocks_override", "kv_cache_memory_bytes", "gpu_memory_utilization")


def make_llm(loaded: LoadedModel | None = None, **engine_args) -> LLM:
    """An LLM over an already loaded model (skips re-reading the weights).

    Without a sizing argument the pool gets a fixed 256 MiB budget, which skips the start-up
    memory probe (a compile of the largest step shape; tests/jpaged/runner/test_kv_cache.py
    covers it).
    """
    if not any(k in engine_args for k in SIZING_ARGS):
        engine_args["kv_cache_memory_bytes"] = 256 * 2**20
    engine = LLMEngine(EngineArgs(**engine_args), loaded=loaded or embedded())
    return LLM.from_engine(engine)


def hf_llama_twin(loaded: LoadedModel, tmp: Path):
    """An HF transformers LlamaForCausalLM (torch, float32) holding the same weights."""
    from jpaged.bench.vs_hf import hf_twin

    return hf_twin(loaded, tmp)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int,
              eos: tuple[int, ...] | None = None) -> list[int]:
    """HF generate(do_sample=False) for one prompt (an HF or a peft model); stops at `eos`
    like the engine, or (None) runs to max_new_tokens. An explicit mask: token 0 is not taken
    for padding."""
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(
            1, len(prompt_ids), dtype=torch.long), max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=None if eos is None else list(eos),
            pad_token_id=0 if eos is None else eos[0])
    return out[0, len(prompt_ids):].tolist()


def random_prompts(n: int, seed: int = 3) -> list[list[int]]:
    """`n` prompts of 9-29 random byte tokens (the tiny HF checkpoints' vocabulary)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(k)).tolist() for k in rng.integers(9, 30, size=n)]


def hf_cases(tmp_path_factory, num_prompts: int, new_tokens: int):
    """get(kind) -> (checkpoint dir, loaded model, prompts, HF's greedy tokens), each tiny HF
    checkpoint kind built once; get.hf[kind] is HF's model, for references on other prompts."""
    from tiny_models import make_hf_checkpoint

    built: dict[str, tuple] = {}

    def get(kind: str) -> tuple:
        if kind not in built:
            path = tmp_path_factory.mktemp(kind)
            hf = make_hf_checkpoint(kind, path)
            hf.generation_config.eos_token_id = None
            get.hf[kind] = hf
            ps = random_prompts(num_prompts)
            built[kind] = (path, load_model(str(path), dtype="float32"), ps,
                           [hf_greedy(hf, p, new_tokens) for p in ps])
        return built[kind]

    get.hf = {}
    return get


def lower_for_cuda(fn, *avals) -> str:
    """StableHLO text of fn lowered for CUDA on this CPU-only machine (no GPU needed)."""
    import jax

    try:
        return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as e:  # jax >= 0.11 wants an abstract GPU to lower for
        if "abstract GPU device" not in str(e):
            raise
    from jax.sharding import AbstractDevice, AbstractMesh

    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h200)):
        return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
