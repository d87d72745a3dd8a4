"""Quantized weights on the device: the decode matmul kernels alone and the decode step, each
beside its bf16 twin (the device check's `quant` stage).

    python -m jpaged.bench.quant_check --out quant.json [--matmul-json matmul.json]
        [--decode-json decode.json] [--ceiling-json kernels.json] [--budget-s 70]
    python -m jpaged.bench.quant_check --cpu-smoke     # tiny shapes, Pallas interpreter

Kernels alone (`quant_matmul_timings`): each kernel of `pallas_kernels/decode_matmul.py` on
Llama-3-8B's shapes (`matmul_check`'s `qkv`, `gate_up`, `o`, `down`) with fp8 weights (a scale
per output channel) and int4 weights (groups of 128 as GPTQ/AWQ checkpoints store them, 32 in
the smoke run; float16 scales and mins), at 1 row first,
then (after the decode steps) 64, 16 and 256, timed as `matmul_check` times the bf16 kernels
(U calls a program on R weight sets filling 4x the L2, queued back to back), their output
checked against XLA's twin
(models/quant.py's `quant_matmul`, the models' own path, with the norm, RoPE, SiLU and residual
of `pallas_kernels/reference.py`; bf16 tolerance). Each row has `us`, `GBps` of its
`ideal_bytes` (the quantized weights once: values, scales, mins; the norm weight, the input,
the residual, the output), `pct_of_copy_16byte`, and beside it the bf16 kernel's time at the
same rows (`bf16_us`: the matmul stage's `matmul_timings` when it has the row, else timed here
once the quantized rows are done) and `bf16_over_quant` (> 1: the quantized kernel is faster).

Decode step (`quant_decode_rows`): the engine's jitted decode step (`decode_rows.time_decode`)
of a random Llama-3-8B with fp8 and with int4 decoder linears (bf16 KV) at batch 1 and 64 and
1,024 tokens of context, beside the bf16 model's step (`bf16_step_ms`: the decode stage's row,
else timed here when the budget allows) and `bf16_over_quant`; `decode_matmuls` says whether
the step ran the quantized kernels ("kernels") or XLA's GEMMs (and why). Jobs run in that
order and are skipped once `--budget-s` is spent.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.bench.decode_rows import time_decode
from jpaged.bench.fixtures import TINY_CONFIG, byte_tokenizer, random_model
from jpaged.bench.kernel_timing import pipelined, unrolled
from jpaged.bench.matmul_check import (
    NORM_EPS,
    Kernel,
    MatmulConfig,
    call_fns,
    compare,
    gpu_config,
    kernels_of,
    make_inputs,
    rope_tables,
    run_case,
)
from jpaged.bench.matmul_check import smoke_config as matmul_smoke_config
from models.build import LoadedModel, abstract_model
from models.config import ModelSpec
from models.quant import QuantWeight, quant_matmul
from pallas_kernels import decode_matmul as dm
from pallas_kernels import reference
from pallas_kernels.bench_inputs import rotations_for

KINDS = ("fp8", "int4")
MAIN_KERNELS = ("qkv", "gate_up", "o", "down")


@dataclass(frozen=True)
class QuantCheckConfig:
    """What one run times: the kernels' shapes and rows, the decode model and its rows."""

    matmul: MatmulConfig  # the shapes, dtype, repeats (matmul_check's)
    rows: tuple[int, ...]  # kernel rows, most telling first
    spec: ModelSpec  # the decode step's model
    decode_batches: tuple[int, ...]
    context_len: int
    engine_args: dict[str, Any]
    model_dtype: Any
    int4_group: int  # int4 weights' group size (the kernels alone and the decode model)


def gpu_config_quant() -> QuantCheckConfig:
    """Llama-3-8B in bf16: kernels at 1, 64, 16, 256 rows; decode steps at batch 1 and 64."""
    from jpaged.aot.cases import INT4_GROUP, LLAMA3_8B_CONFIG

    return QuantCheckConfig(gpu_config(), (1, 64, 16, 256),
                            ModelSpec.from_hf_config(LLAMA3_8B_CONFIG), (1, 64), 1024, {},
                            jnp.bfloat16, INT4_GROUP)


def smoke_config_quant() -> QuantCheckConfig:
    """The tiny shapes of the other stages' smoke runs, one row each, the interpreter."""
    return QuantCheckConfig(
        matmul_smoke_config(), (1,), ModelSpec.from_hf_config(TINY_CONFIG), (1,), 40,
        {"max_num_batched_tokens": 64, "kv_cache_memory_bytes": 16 * 2**20,
         "attention_backend": "pallas"}, jnp.float32, 32)


# ------------------------------------------------------------------------------ weights


def random_quant(key: jax.Array, kind: str, k: int, n: int, group: int) -> QuantWeight:
    """A random [k, n] weight of `kind` on the device (models/quant.py's layout), outputs O(1)
    for O(1) inputs: fp8 a float32 scale a channel; int4 groups of `group`, float16 scales and
    mins centring the values."""
    kq, ks = jax.random.split(key)
    step = 1.0 / math.sqrt(k)
    if kind == "fp8":
        q = (jax.random.normal(kq, (k, n), jnp.float32) * 64).astype(jnp.float8_e4m3fn)
        return QuantWeight("fp8", q, jnp.full((1, n), step / 64, jnp.float32), None)
    if kind != "int4":
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    q = jax.random.bits(kq, (k // 2, n), jnp.uint8)
    scales = (jax.random.uniform(ks, (k // group, n), jnp.float32, 0.5, 1.5) * step / 4)
    return QuantWeight("int4", q, scales.astype(jnp.float16),
                       (-7.5 * scales).astype(jnp.float16), 0)


def _role(path: tuple, leaf: jax.ShapeDtypeStruct) -> str:
    """What one abstract parameter is: quantized values, scales, mins, a norm weight, or
    another float array."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    names = [n for n in names if n != "value"]
    dtype = jnp.dtype(leaf.dtype)
    if dtype in (jnp.dtype(jnp.uint8), jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)):
        return "values"
    if names and names[-1] in ("scales", "mins"):
        return names[-1]
    if len(leaf.shape) == 1 and any("norm" in n for n in names):
        return "norm"
    return "float"


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _make(role: str, shape: tuple[int, ...], dtype: Any, key: jax.Array) -> jax.Array:
    """A random array of one role (one compiled program per role, shape and dtype)."""
    dtype = jnp.dtype(dtype)
    if role == "values" and dtype == jnp.uint8:
        return jax.random.bits(key, shape, jnp.uint8)
    if role == "values" and dtype == jnp.int8:
        return jax.random.randint(key, shape, -128, 128, jnp.int32).astype(jnp.int8)
    if role == "values":  # fp8
        return (jax.random.normal(key, shape, jnp.float32) * 64).astype(dtype)
    if role == "scales":
        return (jax.random.uniform(key, shape, jnp.float32, 0.5, 1.5) * 2e-3).astype(dtype)
    if role == "mins":
        return jnp.full(shape, -0.015, dtype)
    if role == "norm":
        return jnp.ones(shape, dtype)
    return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)


def random_quantized_model(spec: ModelSpec, dtype: Any, weights: str, int4_group: int,
                           seed: int = 0) -> LoadedModel:
    """The architecture of `spec` with its decoder linears quantized as `weights` says
    ("fp8" per channel, "int4" in groups of `int4_group`: jpaged.aot.cases.quantize_abstract),
    random values made on the default device, one array at a time."""
    from jpaged.aot.cases import quantize_abstract

    model = quantize_abstract(abstract_model(spec, dtype), weights, int4_group)
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    made = [_make(_role(path, leaf), tuple(leaf.shape), jnp.dtype(leaf.dtype).name, key)
            for (path, leaf), key in zip(leaves, keys, strict=True)]
    state = jax.tree_util.tree_unflatten(treedef, made)
    return LoadedModel(spec, nnx.merge(graphdef, state), byte_tokenizer(),
                       f"random:{spec.architecture}:{weights}", quantization=weights)


# --------------------------------------------------------------------------- the kernels


def q_linear(x: jax.Array, w: QuantWeight) -> jax.Array:
    """The models' quantized x @ W (QuantLinear): float32 sum, rounded once to x's dtype."""
    prec = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return quant_matmul(x, w.q, w.scales, w.mins, w.kind, x.dtype, prec).astype(x.dtype)


def quant_call_fns(kernel: Kernel, interpret: bool, head_dim: int
                   ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(Pallas kernel, XLA twin) of `kernel` on quantized weights, each taking the flat
    arguments of `matmul_check.call_fns`: x, [norm weight], weights..., [residual]."""
    if kernel.name == "qkv":
        def rope_of(x: jax.Array) -> dict[str, Any]:
            return {"rope": rope_tables(x.shape[0], head_dim), "rope_outputs": 2,
                    "head_dim": head_dim}

        def pallas(x, g, wq, wk, wv):  # noqa: ANN001, ANN202
            return dm.projections(x, [wq, wk, wv], norm_weight=g, norm_eps=NORM_EPS,
                                  interpret=interpret, **rope_of(x))

        def xla(x, g, wq, wk, wv):  # noqa: ANN001, ANN202
            h = reference.rms_norm(x, g, NORM_EPS)
            q, k, v = (q_linear(h, w) for w in (wq, wk, wv))
            cos, sin = rope_tables(x.shape[0], head_dim)
            return [reference.rope_rows(q, cos, sin, head_dim),
                    reference.rope_rows(k, cos, sin, head_dim), v]
    elif kernel.name == "gate_up":
        def pallas(x, g, wg, wu):  # noqa: ANN001, ANN202
            return dm.gated_up(x, wg, wu, act="silu", norm_weight=g, norm_eps=NORM_EPS,
                               interpret=interpret)

        def xla(x, g, wg, wu):  # noqa: ANN001, ANN202
            h = reference.rms_norm(x, g, NORM_EPS)
            return jax.nn.silu(q_linear(h, wg)) * q_linear(h, wu)
    else:
        def pallas(x, w, r):  # noqa: ANN001, ANN202
            return dm.projection_residual(x, w, r, interpret=interpret)

        def xla(x, w, r):  # noqa: ANN001, ANN202
            return r + q_linear(x, w)
    return pallas, xla


@dataclass
class QuantInputs:
    """U argument tuples (flattened, weights as QuantWeights) for one (kernel, rows, kind)."""

    flat: list[Any]
    n_args: int
    calls: int
    sets: int
    weight_bytes: int


def quant_inputs(kernel: Kernel, rows: int, cfg: MatmulConfig, kind: str, int4_group: int,
                 seed: int) -> QuantInputs:
    """Random inputs on the device: R sets of quantized weights (R filling 4x the L2 on a
    GPU), the norm weight, and each call's own x (and residual)."""
    dt = jnp.dtype(cfg.dtype)
    key = jax.random.key(seed)
    shapes = kernel.weight_shapes()
    per_elem = 1.0 if kind == "fp8" else 0.5
    set_bytes = int(sum(k * n for k, n in shapes) * per_elem)
    sets = 2 if cfg.interpret else min(cfg.max_sets, rotations_for(set_bytes, cap=cfg.max_sets))
    calls = sets * math.ceil(cfg.calls / sets)
    keys = iter(jax.random.split(key, 2 + sets * len(shapes) + 2 * calls))
    weight_sets = [[random_quant(next(keys), kind, k, n, int4_group) for k, n in shapes]
                   for _ in range(sets)]
    g = (1 + 0.1 * jax.random.normal(next(keys), (kernel.k,), jnp.float32)).astype(dt)
    flat: list[Any] = []
    for u in range(calls):
        args: list[Any] = [jax.random.normal(next(keys), (rows, kernel.k), dt)]
        args += [g] if kernel.norm else []
        args += weight_sets[u % sets]
        if kernel.residual:
            args.append(jax.random.normal(next(keys), (rows, kernel.ns[0]), dt))
        flat += args
    n_args = 1 + kernel.norm + len(shapes) + kernel.residual
    wbytes = sum(w.nbytes for w in weight_sets[0])
    return QuantInputs(flat, n_args, calls, sets, wbytes)


def ideal_bytes(kernel: Kernel, rows: int, itemsize: int, weight_bytes: int) -> int:
    """The quantized weights once, the norm weight, the input, the residual and the output."""
    return weight_bytes + itemsize * ((kernel.k if kernel.norm else 0) + rows * kernel.k
                                      + rows * sum(kernel.ns) * (2 if kernel.residual else 1))


# ------------------------------------------------------------------------------- the run


class QuantCheck:
    """Runs the jobs in order, every result in `self.doc` as it lands."""

    def __init__(self, cfg: QuantCheckConfig, copy_gbps: float | None, budget_s: float,
                 bf16_kernels: dict[tuple[str, int], float],
                 bf16_decode: dict[int, float],
                 progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.cfg, self.copy_gbps, self.budget_s = cfg, copy_gbps, budget_s
        self.kernels = kernels_of(cfg.matmul)
        self.bf16_kernels = dict(bf16_kernels)  # (kernel, rows) -> us
        self.bf16_decode = dict(bf16_decode)  # batch -> ms
        self.progress = progress
        self.t0 = time.perf_counter()
        dev = jax.devices()[0]
        m = cfg.matmul
        self.doc: dict[str, Any] = {
            "device": str(getattr(dev, "device_kind", dev.platform)), "jax": jax.__version__,
            "mode": "cpu-smoke" if m.interpret else "gpu",
            "shapes": {"hidden": m.hidden, "q": m.q, "kv": m.kv, "inter": m.inter,
                       "dtype": m.dtype, "int4_group": cfg.int4_group},
            "copy_GBps_16byte": copy_gbps, "quant_matmul_timings": [],
            "quant_decode_rows": [], "failures": []}

    def _left(self) -> bool:
        return time.perf_counter() - self.t0 < self.budget_s

    def _guard(self, name: str, fn: Callable[[], None]) -> None:
        run_case(self.doc, name, fn, not self._left(), self.budget_s, self.progress)

    def _time(self, fn: Callable[..., Any], flat: list[Any], n_args: int, calls: int
              ) -> tuple[Any, float]:
        prog = unrolled(fn, n_args)
        first = prog(*flat)[0]
        jax.block_until_ready(first)
        m = self.cfg.matmul
        t = pipelined(prog, flat, per_call=calls, repeats=m.repeats, target_s=m.target_s)
        return first, t.as_dict()["us"]

    def kernel_row(self, name: str, rows: int, kind: str) -> None:
        """One quantized kernel at `rows`: its time, rate, correctness, the bf16 kernel's."""
        m, kernel = self.cfg.matmul, self.kernels[name]
        inp = quant_inputs(kernel, rows, m, kind, self.cfg.int4_group,
                           seed=rows * 31 + MAIN_KERNELS.index(name))
        pallas, xla = quant_call_fns(kernel, m.interpret, m.head_dim)
        want = jax.jit(xla)(*inp.flat[:inp.n_args])
        got, us = self._time(pallas, inp.flat, inp.n_args, inp.calls)
        check = compare(got, want, m.dtype)
        nbytes = ideal_bytes(kernel, rows, jnp.dtype(m.dtype).itemsize, inp.weight_bytes)
        row: dict[str, Any] = {
            "kernel": name, "rows": rows, "weights": kind, "us": us,
            "ideal_bytes": nbytes, "GBps": round(nbytes / (us * 1e-6) / 1e9, 1),
            "weight_sets": inp.sets, "calls_per_program": inp.calls,
            "max_abs_err": check["max_abs_err"], "ok": check["ok"]}
        if self.copy_gbps:
            row["pct_of_copy_16byte"] = round(100 * row["GBps"] / self.copy_gbps, 1)
        self._bf16_beside(row)
        self.doc["quant_matmul_timings"].append(row)
        print(f"  {'ok  ' if row['ok'] else 'FAIL'} {name:8s} {kind:4s} rows={rows:<4} "
              f"{us:9.2f} us {row['GBps']:7.0f} GB/s{self._pct(row)} | bf16 "
              f"{row.get('bf16_us', '-')} us (bf16/quant {row.get('bf16_over_quant', '-')}x)"
              f" | max abs err {check['max_abs_err']:.3g}", flush=True)

    def _pct(self, row: dict[str, Any]) -> str:
        return f" {row['pct_of_copy_16byte']:5.1f}% of copy16" if "pct_of_copy_16byte" in row \
            else ""

    def _bf16_beside(self, row: dict[str, Any]) -> None:
        us = self.bf16_kernels.get((row["kernel"], row["rows"]))
        if us:
            row["bf16_us"] = us
            row["bf16_over_quant"] = round(us / row["us"], 3)

    def bf16_kernel(self, name: str, rows: int) -> None:
        """The bf16 kernel at `rows` (when the matmul stage left none), set beside its rows."""
        m, kernel = self.cfg.matmul, self.kernels[name]
        inp = make_inputs(kernel, rows, m, seed=rows * 31 + MAIN_KERNELS.index(name))
        pallas, _ = call_fns(kernel, m.interpret, head_dim=m.head_dim)
        _, us = self._time(pallas, inp.flat, inp.n_args, inp.calls)
        self.bf16_kernels[(name, rows)] = us
        for row in self.doc["quant_matmul_timings"]:
            if (row["kernel"], row["rows"]) == (name, rows):
                row["bf16_source"] = "timed here"
                self._bf16_beside(row)
        print(f"  bf16 {name:8s} rows={rows:<4} {us:9.2f} us (timed here)", flush=True)

    def decode_rows(self, weights: str) -> None:
        """The engine's decode step with `weights` at each decode batch (bf16 KV)."""
        from jpaged.config import EngineArgs
        from jpaged.engine import LLMEngine

        cfg = self.cfg
        loaded = (random_model(cfg.spec, cfg.model_dtype) if weights == "bfloat16" else
                  random_quantized_model(cfg.spec, cfg.model_dtype, weights,
                                                         cfg.int4_group))
        nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(loaded.model)))
        engine = LLMEngine(EngineArgs(kv_cache_dtype="bfloat16", disable_log_stats=True,
                                      max_model_len=cfg.context_len + 16,
                                      max_num_seqs=max(cfg.decode_batches), **cfg.engine_args),
                           loaded=loaded)
        runner = engine.runner
        try:
            for b in cfg.decode_batches:
                if not self._left():
                    self.doc["failures"].append({"case": f"decode {weights} B={b}",
                                                 "error": "skipped: time budget"})
                    continue
                row = {"weights": weights, "weight_bytes": nbytes,
                       **time_decode(runner, b, cfg.context_len),
                       "decode_matmuls": "kernels" if runner.linears is not None
                       and b <= runner.linears.max_rows else "XLA's GEMMs"}
                if weights == "bfloat16":
                    self.bf16_decode[b] = row["step_ms"]
                    for r in self.doc["quant_decode_rows"]:
                        if r["batch"] == b and r["weights"] != "bfloat16":
                            r.update(bf16_step_ms=row["step_ms"], bf16_source="timed here",
                                     bf16_over_quant=round(row["step_ms"] / r["step_ms"], 3))
                elif b in self.bf16_decode:
                    row.update(bf16_step_ms=self.bf16_decode[b], bf16_over_quant=round(
                        self.bf16_decode[b] / row["step_ms"], 3))
                self.doc["quant_decode_rows"].append(row)
                print(f"  decode {weights:8s} B={b:<3} ctx={cfg.context_len}: "
                      f"{row['step_ms']} ms/step ({row['decode_matmuls']}); bf16 "
                      f"{row.get('bf16_step_ms', '-')} ms, bf16/quant "
                      f"{row.get('bf16_over_quant', '-')}x; weights {nbytes / 1e9:.2f} GB",
                      flush=True)
        finally:
            runner.kv = None  # free the pool before the next engine allocates its own
            del engine, runner, loaded
            gc.collect()

    def fp8_quantize(self) -> None:
        """`quantization="fp8"`'s load-time cost on this device: the widest projection
        ([hidden, inter]) from host float32, as a loader hands it, with the scale search and
        with plain absmax (one candidate); seconds of the second call (the first compiles)."""
        import numpy as np

        from models.quant import FP8_SCALE_CANDIDATES, quantize_fp8

        m = self.cfg.matmul
        w = np.random.default_rng(0).standard_normal((m.hidden, m.inter), dtype=np.float32)
        row: dict[str, Any] = {"shape": [m.hidden, m.inter], "candidates": FP8_SCALE_CANDIDATES}
        for key, candidates in (("absmax_s", 1), ("search_s", FP8_SCALE_CANDIDATES)):
            quantize_fp8(w, candidates=candidates)
            t = time.perf_counter()
            quantize_fp8(w, candidates=candidates)
            row[key] = round(time.perf_counter() - t, 4)
        self.doc["fp8_quantize"] = row
        print(f"  fp8 at load [{m.hidden}, {m.inter}]: scale search ({FP8_SCALE_CANDIDATES}) "
              f"{row['search_s']:.3f} s, absmax {row['absmax_s']:.3f} s", flush=True)

    def run(self, decode: bool = True) -> dict[str, Any]:
        """Kernels at the first rows (1), the decode steps, the kernels at the other rows,
        then any bf16 twin the earlier stages did not time."""
        rows = self.cfg.rows
        first, rest = rows[:1], rows[1:]
        for r in first:
            for name in MAIN_KERNELS:
                for kind in KINDS:
                    self._guard(f"quant {name} {kind} rows={r}",
                                lambda n=name, r=r, k=kind: self.kernel_row(n, r, k))
        if decode:
            for weights in KINDS:
                self._guard(f"decode {weights}", lambda w=weights: self.decode_rows(w))
        for r in rest:
            for name in MAIN_KERNELS:
                for kind in KINDS:
                    self._guard(f"quant {name} {kind} rows={r}",
                                lambda n=name, r=r, k=kind: self.kernel_row(n, r, k))
        missing = sorted({(row["kernel"], row["rows"]) for row in self.doc["quant_matmul_timings"]
                          if "bf16_us" not in row}, key=lambda x: (x[1], x[0]))
        for name, r in missing:
            self._guard(f"bf16 {name} rows={r}", lambda n=name, r=r: self.bf16_kernel(n, r))
        if decode and any("bf16_step_ms" not in r for r in self.doc["quant_decode_rows"]):
            self._guard("decode bfloat16", lambda: self.decode_rows("bfloat16"))
        self._guard("fp8 quantize", self.fp8_quantize)
        self.doc["wall_s"] = round(time.perf_counter() - self.t0, 1)
        return self.doc


def _json(path: Path | None) -> dict[str, Any]:
    if path is None or not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def bf16_from_stages(matmul: dict[str, Any], decode: dict[str, Any], context_len: int
                     ) -> tuple[dict[tuple[str, int], float], dict[int, float]]:
    """The bf16 kernels' times (matmul stage: pallas rows of the [K, N] layout) and the bf16
    model's greedy decode steps (decode stage: bf16 KV at `context_len`) by rows / batch."""
    kernels = {(t["kernel"], t["rows"]): t["us"] for t in matmul.get("matmul_timings", [])
               if t.get("impl") == "pallas" and t["kernel"] in MAIN_KERNELS and t.get("us")}
    steps = {r["batch"]: r["step_ms"] for r in decode.get("decode_rows", [])
             if r.get("kv_cache_dtype") == "bfloat16" and r.get("context_len") == context_len
             and r.get("step_ms") and not r.get("sampling")}
    return kernels, steps


def main(argv: list[str] | None = None) -> int:
    """Run the stage; exit 1 when a quantized kernel's output is wrong or a job failed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, Pallas interpreter")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip jobs after this")
    p.add_argument("--ceiling-json", type=Path, help="the kernels stage's JSON (copy16)")
    p.add_argument("--matmul-json", type=Path, help="the matmul stage's JSON (bf16 kernels)")
    p.add_argument("--decode-json", type=Path, help="the decode stage's JSON (bf16 steps)")
    p.add_argument("--no-decode", action="store_true", help="the kernels alone")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
    cfg = smoke_config_quant() if args.cpu_smoke else gpu_config_quant()
    matmul, decode = _json(args.matmul_json), _json(args.decode_json)
    copy = _json(args.ceiling_json).get("copy_GBps_16byte") or matmul.get("copy_GBps_16byte")
    kernels, steps = bf16_from_stages(matmul, decode, cfg.context_len)

    def progress(doc: dict[str, Any]) -> None:  # what landed, should a time limit cut in
        if args.out:
            args.out.write_text(json.dumps(doc, indent=1))

    check = QuantCheck(cfg, copy, args.budget_s, kernels, steps, progress)
    print(f"== quantized weights (device {check.doc['device']}; bf16 twins from the earlier "
          f"stages: {len(kernels)} kernel rows, {len(steps)} decode rows)", flush=True)
    doc = check.run(decode=not args.no_decode)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    bad = [r for r in doc["quant_matmul_timings"] if not r["ok"]]
    failed = [f for f in doc["failures"] if not f["error"].startswith("skipped")]
    print(f"== quantized weights done in {doc['wall_s']} s: "
          f"{len(doc['quant_matmul_timings'])} kernel rows ({len(bad)} wrong), "
          f"{len(doc['quant_decode_rows'])} decode rows, {len(failed)} failed, "
          f"{len(doc['failures']) - len(failed)} skipped", flush=True)
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
