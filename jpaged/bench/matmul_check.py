"""The decode matmul kernels alone on the device: correct, and how close to their ideal bytes.

    python -m jpaged.bench.matmul_check --out matmul.json [--ceiling-json kernels.json]
    python -m jpaged.bench.matmul_check --cpu-smoke      # tiny shapes, Pallas interpreter

For Llama-3-8B's shapes in bf16 (hidden 4096, q 4096, kv 1024, intermediate 14336) at 1, 16
and 64 rows (the steps the engine runs on them) and 256 (for reference), each kernel of
`pallas_kernels/decode_matmul.py` beside XLA's equivalent, its jnp twin in
`pallas_kernels/reference.py` under jit:

* `qkv`: `projections` of q, k and v with the RMSNorm prologue and RoPE of q and k in the
  epilogue (one launch, as the engine runs it; its K/V write, a few KB, is left out);
* `gate_up`: `gated_up`, SiLU, with the RMSNorm prologue;
* `o`: `projection_residual`, K = 4096; `down`: `projection_residual`, K = 14336;
* the same four with [N, K] weights (`transposed=True`, K contiguous: 512-byte runs per
  weight row instead of 64-128), `*_nk`, at 1 and 16 rows: which layout streams HBM closer to
  the copy rate decides whether the loaders should lay the weights out transposed.

Each (kernel, rows) is one program of U calls in a row (`kernel_timing.unrolled`), each call
on its own input rows and on one of R weight sets in turn, R enough that the sets fill four
times the L2 (so every call reads its weights from HBM), timed back to back
(`kernel_timing.pipelined`, median of repeats). Reported per call: us, GB/s of its ideal
bytes (the weights once, plus the norm weight, the input rows, the residual and the output),
that as a percentage of the 16-byte copy rate (`copy_GBps_16byte`, from the kernels stage's
JSON or measured here), and XLA's time over the kernel's. The first call's outputs of the two
programs are compared (max abs error; bf16 tolerance atol 0.06 + rtol 0.02, the kernels'
tests'). Then a sweep of `StreamPlan` tiles per kernel at 1 row (block_n, block_k,
num_stages, num_warps; plans whose pipelined weight tiles would not fit shared memory are
left out) and the best plan per kernel, against `plan_stream`'s default. Jobs run in order of
priority and are skipped once `--budget-s` is spent.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.bench.copy_ceiling import copy_rates
from jpaged.bench.kernel_timing import pipelined, unrolled
from pallas_kernels import decode_matmul as dm
from pallas_kernels import reference
from pallas_kernels.bench_inputs import rotations_for

MAIN_KERNELS = ("qkv", "gate_up", "o", "down")
LAYOUT_KERNELS = ("qkv_nk", "gate_up_nk", "o_nk", "down_nk")  # [N, K] weights
KERNELS = MAIN_KERNELS + LAYOUT_KERNELS
LAYOUT_ROWS = (1, 16)
NORM_EPS = 1e-5
# bf16 tolerance of the kernels' own tests (tests/pallas_kernels/test_decode_matmul.py): the
# kernel and XLA accumulate in another order and may round an output one ulp apart.
TOL = {"bfloat16": (0.06, 0.02), "float32": (1e-4, 1e-4)}
# (block_n, block_k, num_stages, num_warps) tried at 1 row, in this order, after the default.
SWEEP = ((32, 128, 3, 4), (32, 256, 4, 4), (32, 256, 2, 4), (32, 64, 4, 4), (64, 128, 3, 4),
         (64, 256, 3, 8), (32, 256, 3, 8), (64, 128, 4, 8), (128, 64, 3, 4), (128, 128, 3, 8),
         (32, 128, 4, 4), (32, 256, 3, 4))
# Shared memory the pipelined tiles of one plan may take (an H100/H200 block gets 227 KiB).
_SMEM_LIMIT = 160 * 1024


@dataclass(frozen=True)
class MatmulConfig:
    """Shapes, rows and repetitions of one run."""

    hidden: int
    q: int
    kv: int
    inter: int
    dtype: str
    head_dim: int
    rows: tuple[int, ...]
    sweep_rows: int
    sweep: tuple[tuple[int, int, int, int], ...]
    sweep_plans: int  # at most this many plans per kernel, the default included
    interpret: bool
    repeats: int
    target_s: float
    calls: int  # U, at least: calls of the kernel per timed program
    max_sets: int = 8  # R, at most
    layouts: bool = True  # also time the [N, K] layout (`LAYOUT_KERNELS`)
    copy_bytes: int = 2**30
    priority_rows: tuple[int, ...] = field(default=(1, 16, 64))


def gpu_config() -> MatmulConfig:
    """Llama-3-8B in bf16 at 1, 16, 64 and 256 rows; the sweep at 1 row."""
    return MatmulConfig(hidden=4096, q=4096, kv=1024, inter=14336, dtype="bfloat16",
                        head_dim=128, rows=(1, 16, 64, 256), sweep_rows=1, sweep=SWEEP,
                        sweep_plans=10, interpret=False, repeats=5, target_s=0.02, calls=16)


def smoke_config() -> MatmulConfig:
    """Tiny shapes for the Pallas interpreter: every code path once."""
    return MatmulConfig(hidden=64, q=64, kv=32, inter=128, dtype="bfloat16", head_dim=32,
                        rows=(1, 4),
                        sweep_rows=1, sweep=((16, 32, 2, 4), (32, 16, 3, 4)), sweep_plans=2,
                        interpret=True, repeats=1, target_s=1e-4, calls=2, max_sets=2,
                        copy_bytes=2**20, priority_rows=(1,), layouts=False)


@dataclass(frozen=True)
class Kernel:
    """One kernel's shapes: input size K, output sizes, weights per program, prologue."""

    name: str
    k: int
    ns: tuple[int, ...]
    weights_per_program: int
    norm: bool
    residual: bool
    transposed: bool = False  # weights [N, K]

    def weight_shapes(self) -> list[tuple[int, int]]:
        if self.weights_per_program == 2:
            shapes = [(self.k, self.ns[0])] * 2
        else:
            shapes = [(self.k, n) for n in self.ns]
        return [(n, k) for k, n in shapes] if self.transposed else shapes

    def ideal_bytes(self, rows: int, itemsize: int) -> int:
        """Weights once, the norm weight, the input rows, the residual and the output."""
        n_out = sum(self.ns)
        weights = sum(k * n for k, n in self.weight_shapes())
        return itemsize * (weights + (self.k if self.norm else 0) + rows * self.k
                           + rows * n_out * (2 if self.residual else 1))


def kernels_of(cfg: MatmulConfig) -> dict[str, Kernel]:
    main = {
        "qkv": Kernel("qkv", cfg.hidden, (cfg.q, cfg.kv, cfg.kv), 1, True, False),
        "gate_up": Kernel("gate_up", cfg.hidden, (cfg.inter,), 2, True, False),
        "o": Kernel("o", cfg.q, (cfg.hidden,), 1, False, True),
        "down": Kernel("down", cfg.inter, (cfg.hidden,), 1, False, True),
    }
    return {**main, **{f"{n}_nk": replace(k, name=f"{n}_nk", transposed=True)
                       for n, k in main.items()}}


def rope_tables(rows: int, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin [rows, head_dim / 2] of positions 1000 + row (Llama-3's base 500000)."""
    inv = 1.0 / (500000.0 ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    ang = (1000 + np.arange(rows, dtype=np.float32))[:, None] * inv[None, :]
    return jnp.asarray(np.cos(ang)), jnp.asarray(np.sin(ang))


def call_fns(kernel: Kernel, interpret: bool, plan: dm.StreamPlan | None = None,
             head_dim: int = 128) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(Pallas kernel, XLA twin) of `kernel`, each taking the same flat arguments:
    x, [norm weight], weights..., [residual]. [N, K] weights (`transposed`) reach the twin as
    `w.T`, which XLA folds into its dot."""
    tr = kernel.transposed
    t = (lambda w: w.T) if tr else (lambda w: w)  # noqa: E731
    if kernel.name.startswith("qkv"):
        def rope_of(x):  # noqa: ANN001, ANN202
            return {"rope": rope_tables(x.shape[0], head_dim), "rope_outputs": 2,
                    "head_dim": head_dim}

        def pallas(x, g, wq, wk, wv):  # noqa: ANN001, ANN202
            return dm.projections(x, [wq, wk, wv], norm_weight=g, norm_eps=NORM_EPS,
                                  transposed=tr, interpret=interpret, plan=plan, **rope_of(x))

        def xla(x, g, wq, wk, wv):  # noqa: ANN001, ANN202
            return reference.projections(x, [t(wq), t(wk), t(wv)], norm_weight=g,
                                         norm_eps=NORM_EPS, **rope_of(x))
    elif kernel.name.startswith("gate_up"):
        def pallas(x, g, wg, wu):  # noqa: ANN001, ANN202
            return dm.gated_up(x, wg, wu, act="silu", norm_weight=g, norm_eps=NORM_EPS,
                               transposed=tr, interpret=interpret, plan=plan)

        def xla(x, g, wg, wu):  # noqa: ANN001, ANN202
            return reference.gated_up(x, t(wg), t(wu), act="silu", norm_weight=g,
                                      norm_eps=NORM_EPS)
    else:
        def pallas(x, w, r):  # noqa: ANN001, ANN202
            return dm.projection_residual(x, w, r, transposed=tr, interpret=interpret,
                                          plan=plan)

        def xla(x, w, r):  # noqa: ANN001, ANN202
            return reference.projection_residual(x, t(w), r)
    return pallas, xla


@dataclass
class Inputs:
    """U argument tuples (flattened) for one (kernel, rows): own x per call, R weight sets."""

    flat: list[jax.Array]
    n_args: int
    calls: int
    sets: int


def make_inputs(kernel: Kernel, rows: int, cfg: MatmulConfig, seed: int) -> Inputs:
    """Random inputs on the device (never zeros): weights ~ N(0, 1/K) so outputs are O(1),
    the norm weight ~ 1 + N(0, 0.1^2), x and the residual ~ N(0, 1)."""
    dt = jnp.dtype(cfg.dtype)
    key = jax.random.key(seed)
    set_bytes = sum(k * n for k, n in kernel.weight_shapes()) * dt.itemsize
    sets = 2 if cfg.interpret else rotations_for(set_bytes, cap=cfg.max_sets)
    sets = min(sets, cfg.max_sets)
    calls = sets * math.ceil(cfg.calls / sets)
    keys = iter(jax.random.split(key, 4 + sets * 3 + 2 * calls))
    weight_sets = [[(jax.random.normal(next(keys), s, jnp.float32) / math.sqrt(kernel.k))
                    .astype(dt) for s in kernel.weight_shapes()] for _ in range(sets)]
    g = (1 + 0.1 * jax.random.normal(next(keys), (kernel.k,), jnp.float32)).astype(dt)
    flat: list[jax.Array] = []
    for u in range(calls):
        x = jax.random.normal(next(keys), (rows, kernel.k), dt)
        args = [x, *([g] if kernel.norm else []), *weight_sets[u % sets]]
        if kernel.residual:
            args.append(jax.random.normal(next(keys), (rows, kernel.ns[0]), dt))
        flat += args
    n_args = 1 + kernel.norm + len(kernel.weight_shapes()) + kernel.residual
    return Inputs(flat, n_args, calls, sets)


def _concat(out: Any) -> jax.Array:
    parts = out if isinstance(out, (list, tuple)) else [out]
    return jnp.concatenate([jnp.asarray(p, jnp.float32).reshape(p.shape[0], -1)
                            for p in parts], axis=1)


def compare(got: Any, want: Any, dtype: str) -> dict[str, Any]:
    """Max abs error, relative (norm) error and whether every element is within the dtype's
    tolerance (atol + rtol |want|), of a kernel's output against its twin's."""
    g, w = np.asarray(_concat(got), np.float64), np.asarray(_concat(want), np.float64)
    atol, rtol = TOL[dtype]
    finite = bool(np.isfinite(g).all())
    err = np.abs(g - w)
    return {"max_abs_err": float(err.max()) if finite else float("nan"),
            "rel_err": float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)),
            "max_abs_ref": float(np.abs(w).max()), "atol": atol, "rtol": rtol,
            "ok": finite and bool((err <= atol + rtol * np.abs(w)).all())}


def plan_dict(plan: dm.StreamPlan) -> dict[str, int]:
    return asdict(plan)


def default_plan(kernel: Kernel, rows: int, itemsize: int, head_dim: int = 128
                 ) -> dm.StreamPlan:
    return dm.plan_stream(rows, kernel.k, kernel.ns, itemsize,
                          weights_per_program=kernel.weights_per_program,
                          head_dim=head_dim if kernel.name.startswith("qkv") else None)


def sweep_plans(kernel: Kernel, cfg: MatmulConfig) -> list[dm.StreamPlan]:
    """The default plan at `cfg.sweep_rows`, then the sweep's plans that divide the shapes and
    whose pipelined tiles fit `_SMEM_LIMIT`: at most `cfg.sweep_plans` in all."""
    itemsize = jnp.dtype(cfg.dtype).itemsize
    base = default_plan(kernel, cfg.sweep_rows, itemsize, cfg.head_dim)
    plans = [base]
    for bn, bk, stages, warps in cfg.sweep:
        if any(n % bn for n in kernel.ns) or kernel.k % bk:
            continue
        if kernel.name.startswith("qkv") and not (
                bn // 2 >= 16 and (cfg.head_dim // 2) % (bn // 2) == 0):
            continue  # RoPE's half-slabs must lie within half a head
        smem = stages * bk * (bn * kernel.weights_per_program + base.block_m) * itemsize
        if smem > _SMEM_LIMIT and not cfg.interpret:
            continue
        plan = dm.StreamPlan(base.block_m, bn, bk, num_warps=warps, num_stages=stages)
        if plan not in plans:
            plans.append(plan)
    return plans[:cfg.sweep_plans]


def run_case(doc: dict[str, Any], name: str, fn: Callable[[], None], over_budget: bool,
             budget_s: float, progress: Callable[[dict[str, Any]], None] | None) -> None:
    """One case of a device-check stage, isolated: skipped once the stage's budget is spent,
    an exception recorded in doc["failures"] (the stage goes on), the partial document handed
    to `progress` after it."""
    if over_budget:
        print(f"  skipped {name}: time budget {budget_s:.0f} s spent", flush=True)
        doc["failures"].append({"case": name, "error": "skipped: time budget"})
        return
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - every case is isolated
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
        print(f"  FAILED {name}: {msg}", flush=True)
        traceback.print_exc(limit=3)
        doc["failures"].append({"case": name, "error": msg})
    if progress is not None:
        progress({**doc, "partial": True})


class MatmulCheck:
    """Runs the jobs, keeping every result in `self.doc` as it lands."""

    def __init__(self, cfg: MatmulConfig, copy_gbps: float | None, budget_s: float,
                 progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.cfg = cfg
        self.progress = progress  # called with the document after each job
        self.kernels = kernels_of(cfg)
        self.copy_gbps = copy_gbps
        self.budget_s = budget_s
        self.t0 = time.perf_counter()
        dev = jax.devices()[0]
        self.doc: dict[str, Any] = {
            "device": str(getattr(dev, "device_kind", dev.platform)), "jax": jax.__version__,
            "mode": "cpu-smoke" if cfg.interpret else "gpu",
            "shapes": {"hidden": cfg.hidden, "q": cfg.q, "kv": cfg.kv, "inter": cfg.inter,
                       "dtype": cfg.dtype},
            "copy_GBps_16byte": copy_gbps, "matmul_checks": [], "matmul_timings": [],
            "matmul_sweep": [], "matmul_best_plans": {}, "failures": []}
        self._inputs: dict[tuple[str, int], Inputs] = {}
        self._ref_out: dict[tuple[str, int], Any] = {}

    # ---------------------------------------------------------------------------- helpers
    def _over_budget(self) -> bool:
        return time.perf_counter() - self.t0 > self.budget_s

    def _guard(self, name: str, fn: Callable[[], None]) -> None:
        run_case(self.doc, name, fn, self._over_budget(), self.budget_s, self.progress)

    def inputs(self, name: str, rows: int) -> Inputs:
        key = (name, rows)
        if key not in self._inputs:
            self._inputs.clear()  # one shape's inputs on the device at a time
            self._inputs[key] = make_inputs(self.kernels[name], rows, self.cfg,
                                            seed=rows * 31 + KERNELS.index(name))
        return self._inputs[key]

    def _time(self, fn: Callable[..., Any], inp: Inputs) -> tuple[Any, dict[str, float]]:
        """The first call's output of the unrolled program, and its time per call."""
        prog = unrolled(fn, inp.n_args)
        first = prog(*inp.flat)[0]
        jax.block_until_ready(first)
        t = pipelined(prog, inp.flat, per_call=inp.calls, repeats=self.cfg.repeats,
                      target_s=self.cfg.target_s)
        return first, t.as_dict()

    def _rates(self, kernel: Kernel, rows: int, us: float) -> dict[str, Any]:
        nbytes = kernel.ideal_bytes(rows, jnp.dtype(self.cfg.dtype).itemsize)
        gbps = nbytes / (us * 1e-6) / 1e9
        out: dict[str, Any] = {"ideal_bytes": nbytes, "GBps": round(gbps, 1)}
        if self.copy_gbps:
            out["pct_of_copy_16byte"] = round(100 * gbps / self.copy_gbps, 1)
            out["ideal_us_at_copy_16byte"] = round(nbytes / (self.copy_gbps * 1e9) * 1e6, 2)
        return out

    def _ref(self, name: str, rows: int) -> tuple[Any, dict[str, float]]:
        key = (name, rows)
        if key not in self._ref_out:
            _, xla = call_fns(self.kernels[name], self.cfg.interpret,
                              head_dim=self.cfg.head_dim)
            self._ref_out[key] = self._time(xla, self.inputs(name, rows))
        return self._ref_out[key]

    # ------------------------------------------------------------------------------- jobs
    def ab(self, name: str, rows: int) -> None:
        """The kernel (default plan) and XLA's twin at `rows`: times, rates, correctness."""
        kernel, cfg = self.kernels[name], self.cfg
        inp = self.inputs(name, rows)
        ref_out, xt = self._ref(name, rows)
        pallas, _ = call_fns(kernel, cfg.interpret, head_dim=cfg.head_dim)
        out, kt = self._time(pallas, inp)
        plan = default_plan(kernel, rows, jnp.dtype(cfg.dtype).itemsize, cfg.head_dim)
        check = {"kernel": name, "rows": rows, "plan": plan_dict(plan),
                 **compare(out, ref_out, cfg.dtype)}
        self.doc["matmul_checks"].append(check)
        common = {"kernel": name, "rows": rows, "k": kernel.k, "ns": list(kernel.ns),
                  "calls_per_program": inp.calls, "weight_sets": inp.sets}
        xrow = {**common, "impl": "xla", **xt, **self._rates(kernel, rows, xt["us"])}
        krow = {**common, "impl": "pallas", "plan": plan_dict(plan), **kt,
                **self._rates(kernel, rows, kt["us"]),
                "xla_over_pallas": round(xt["us"] / kt["us"], 3),
                "max_abs_err": check["max_abs_err"], "ok": check["ok"]}
        self.doc["matmul_timings"] += [krow, xrow]
        pct = (lambda r: f" {r['pct_of_copy_16byte']:5.1f}% of copy16"  # noqa: E731
               if "pct_of_copy_16byte" in r else "")
        print(f"  {'ok  ' if check['ok'] else 'FAIL'} {name:8s} rows={rows:<4} pallas "
              f"{kt['us']:9.2f} us {krow['GBps']:7.0f} GB/s{pct(krow)} | xla {xt['us']:9.2f} us "
              f"{xrow['GBps']:7.0f} GB/s{pct(xrow)} | xla/pallas {krow['xla_over_pallas']:.2f}x"
              f" | max abs err {check['max_abs_err']:.3g}", flush=True)

    def sweep_one(self, name: str, plan: dm.StreamPlan) -> None:
        """One plan of the sweep at `sweep_rows` (the default plan's time is the A/B row's)."""
        kernel, cfg = self.kernels[name], self.cfg
        rows = cfg.sweep_rows
        default = default_plan(kernel, rows, jnp.dtype(cfg.dtype).itemsize, cfg.head_dim)
        done = [t for t in self.doc["matmul_timings"] if t["kernel"] == name
                and t["rows"] == rows and t["impl"] == "pallas"]
        if plan == default and done:
            t = done[0]
            entry = {"us": t["us"], "us_min": t["us_min"], "us_max": t["us_max"],
                     "ok": t["ok"], "max_abs_err": t["max_abs_err"]}
        else:
            ref_out, _ = self._ref(name, rows)
            pallas, _ = call_fns(kernel, cfg.interpret, plan, head_dim=cfg.head_dim)
            out, kt = self._time(pallas, self.inputs(name, rows))
            c = compare(out, ref_out, cfg.dtype)
            entry = {**kt, "ok": c["ok"], "max_abs_err": c["max_abs_err"]}
        row = {"kernel": name, "rows": rows, **plan_dict(plan), "default": plan == default,
               **entry, **self._rates(kernel, rows, entry["us"])}
        self.doc["matmul_sweep"].append(row)
        print(f"  sweep {name:8s} rows={rows} bn={plan.block_n:<3} bk={plan.block_k:<3} "
              f"stages={plan.num_stages} warps={plan.num_warps}: {row['us']:9.2f} us "
              f"{row['GBps']:7.0f} GB/s{' (default)' if row['default'] else ''}"
              f"{'' if row['ok'] else ' WRONG'}", flush=True)

    def best_plans(self) -> None:
        """Per kernel: the fastest correct plan of the sweep, against the default."""
        for name in KERNELS:
            rows = [r for r in self.doc["matmul_sweep"] if r["kernel"] == name and r["ok"]]
            if not rows:
                continue
            best = min(rows, key=lambda r: r["us"])
            default = next((r for r in rows if r["default"]), None)
            self.doc["matmul_best_plans"][name] = {
                "rows": best["rows"],
                "plan": {k: best[k] for k in ("block_m", "block_n", "block_k", "num_warps",
                                              "num_stages")},
                "us": best["us"], "GBps": best["GBps"],
                **({"pct_of_copy_16byte": best["pct_of_copy_16byte"]}
                   if "pct_of_copy_16byte" in best else {}),
                "default_us": default["us"] if default else None,
                "default_over_best": (round(default["us"] / best["us"], 3)
                                      if default else None),
                "plans_tried": len([r for r in self.doc["matmul_sweep"]
                                    if r["kernel"] == name])}

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        first = [r for r in cfg.rows if r in cfg.priority_rows]
        rest = [r for r in cfg.rows if r not in cfg.priority_rows]
        # The engine's kernels at its rows, the [N, K] layout at 1 row, the tile sweep, the
        # layout at its other rows, then the reference rows (256): most telling first.
        layout_rows = ([r for r in LAYOUT_ROWS if r in cfg.rows] or cfg.rows[:1]
                       if cfg.layouts else [])
        jobs = [(name, r) for r in first for name in MAIN_KERNELS]
        jobs += [(name, r) for r in layout_rows[:1] for name in LAYOUT_KERNELS]
        for name, rows in jobs:
            self._guard(f"matmul {name} rows={rows}", lambda n=name, r=rows: self.ab(n, r))
        for name in MAIN_KERNELS:
            for plan in sweep_plans(self.kernels[name], cfg):
                self._guard(f"sweep {name} {plan}",
                            lambda n=name, p=plan: self.sweep_one(n, p))
        later = [(name, r) for r in layout_rows[1:] for name in LAYOUT_KERNELS]
        later += [(name, r) for r in rest for name in MAIN_KERNELS]
        for name, rows in later:
            self._guard(f"matmul {name} rows={rows}", lambda n=name, r=rows: self.ab(n, r))
        self._inputs.clear()
        self._ref_out.clear()
        self.best_plans()
        self.doc["wall_s"] = round(time.perf_counter() - self.t0, 1)
        return self.doc


def summary(doc: dict[str, Any]) -> str:
    """The table printed at the end (and by device_report)."""
    lines = [f"decode matmuls on {doc['device']} ({doc['shapes']}), copy16 "
             f"{doc.get('copy_GBps_16byte')} GB/s"]
    for t in doc["matmul_timings"]:
        if t["impl"] != "pallas":
            continue
        x = next((r for r in doc["matmul_timings"] if r["impl"] == "xla"
                  and r["kernel"] == t["kernel"] and r["rows"] == t["rows"]), {})
        lines.append(f"  {t['kernel']:8s} rows={t['rows']:<4} pallas {t['us']:9.2f} us "
                     f"({t.get('pct_of_copy_16byte', '-')}% of copy16)  xla "
                     f"{x.get('us', float('nan')):9.2f} us ({x.get('pct_of_copy_16byte', '-')}%)"
                     f"  xla/pallas {t['xla_over_pallas']:.2f}x  ok={t['ok']}")
    for name, b in doc["matmul_best_plans"].items():
        lines.append(f"  best plan {name:8s} {b['plan']}: {b['us']:.2f} us "
                     f"(default {b['default_us']} us, {b['default_over_best']}x)")
    return "\n".join(lines)


def _ceiling(path: Path | None) -> tuple[float | None, dict[str, Any] | None]:
    """copy_GBps_16byte from the kernels stage's JSON, when it has one."""
    if path is None or not path.exists():
        return None, None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, None
    return doc.get("copy_GBps_16byte"), {k: doc.get(k) for k in (
        "copy_GBps_16byte", "copy_16byte_method", "copy_GBps_jax_bf16")}


def main(argv: list[str] | None = None) -> int:
    """Run the check; exit 1 if a kernel's output is wrong (or a correctness job failed)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, Pallas interpreter")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip jobs after this")
    p.add_argument("--ceiling-json", type=Path,
                   help="the kernels stage's JSON: its copy_GBps_16byte (else measured here)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
    cfg = smoke_config() if args.cpu_smoke else gpu_config()
    copy, source = _ceiling(args.ceiling_json)
    if copy is None:
        print("== copy ceiling (16-byte accesses)", flush=True)
        source = copy_rates(cfg.copy_bytes, interpret=cfg.interpret,
                            repeats=min(cfg.repeats, 3), target_s=cfg.target_s)
        copy = source["copy_GBps_16byte"]
    def progress(doc: dict[str, Any]) -> None:  # what landed, should a time limit cut in
        if args.out:
            args.out.write_text(json.dumps(doc, indent=1))

    check = MatmulCheck(cfg, copy, args.budget_s, progress)
    check.doc["copy_source"] = source
    print(f"== decode matmuls vs XLA (device {check.doc['device']}, copy16 {copy} GB/s)",
          flush=True)
    doc = check.run()
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    print(summary(doc))
    bad = [c for c in doc["matmul_checks"] if not c["ok"]]
    bad += [s for s in doc["matmul_sweep"] if not s["ok"]]
    failed = [f for f in doc["failures"] if not f["error"].startswith("skipped")]
    # A sweep plan that does not compile (shared memory, registers) is a finding, not an error.
    broken = [f for f in failed if not f["case"].startswith("sweep")]
    print(f"== matmuls done in {doc['wall_s']} s: {len(doc['matmul_checks'])} checks, "
          f"{len(bad)} wrong, {len(failed)} failed ({len(failed) - len(broken)} sweep plans), "
          f"{len(doc['failures']) - len(failed)} skipped", flush=True)
    return 1 if bad or broken else 0


if __name__ == "__main__":
    sys.exit(main())
