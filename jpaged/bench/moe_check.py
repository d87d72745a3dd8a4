"""The mixture-of-experts grouped matmul on a lent GPU: the Pallas kernel beside XLA's ragged_dot.

Qwen3-30B-A3B's expert shapes (128 experts, 2048 -> 768, 8 a token, bf16), random routing of
T tokens (T * 8 sorted rows): each row times both ways (`us_kernel`, `us_xla`), checked against
a float32 reference of the same rows, with the bytes of the experts the rows chose
(`expert_bytes_read`) over the kernel's time as its rate (`kernel_GBps`, and as a % of the
16-byte copy ceiling when the kernels stage measured one). The same rows also run the kernel
on the experts as a Q4_K GGUF's run at its own quantization (int4 in groups of 32, float16
scales and mins: `us_kernel_int4`, `int4_bytes_read`, `int4_kernel_GBps`, checked against the
dequantized weights). Then one whole sparse block (router, routing, both expert launches and
the weighted sum) at the decode sizes the one-launch routing takes, both ways: `moe_route` and
the sorted path (`block_rows`: `us_fused`, `us_sorted`, their ratio, and the two outputs'
difference). `--cpu-smoke`: tiny shapes in the Pallas interpreter (the suite runs it).

    python -m jpaged.bench.moe_check --out OUT/moe.json [--ceiling-json OUT/kernels.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.bench.kernel_timing import pipelined
from models.quant import QuantWeight, dequantize, pack_int4
from pallas_kernels import grouped_matmul as gmm

GPU_SHAPE = {"experts": 128, "k": 2048, "n": 768, "top_k": 8, "tokens": [1, 16, 64, 256, 2048],
             "block_tokens": [1, 4, 16]}
SMOKE_SHAPE = {"experts": 8, "k": 64, "n": 32, "top_k": 2, "tokens": [1, 5],
               "block_tokens": [1, 4]}


def routed(tokens: int, experts: int, top_k: int, seed: int) -> np.ndarray:
    """Group sizes of `tokens` tokens each routed to top_k distinct random experts."""
    rng = np.random.default_rng(seed)
    chosen = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    return np.bincount(chosen.reshape(-1), minlength=experts).astype(np.int32)


def int4_experts(w: np.ndarray, group: int = 32) -> QuantWeight:
    """[E, K, N] float experts as int4 in groups of `group` along K with mins (asymmetric,
    float16 scales: a Q4_K GGUF's device form), a stacked QuantWeight."""
    e, k, n = w.shape
    g = np.asarray(w, np.float32).reshape(e, k // group, group, n)
    lo, hi = g.min(axis=2), g.max(axis=2)
    scales = np.maximum(hi - lo, 1e-8) / 15
    q = np.clip(np.rint((g - lo[:, :, None]) / scales[:, :, None]), 0, 15).reshape(e, k, n)
    packed = np.stack([pack_int4(q[i].astype(np.uint8), group) for i in range(e)])
    return QuantWeight("int4", jnp.asarray(packed), jnp.asarray(scales.astype(np.float16)),
                       jnp.asarray(lo.astype(np.float16)), 1)


def _reference(x: np.ndarray, w: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Each group of rows times its expert's weight, float32."""
    out, start = np.zeros((x.shape[0], w.shape[2]), np.float32), 0
    for i, g in enumerate(sizes):
        out[start:start + g] = x[start:start + g] @ w[i]
        start += g
    return out


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))


def run_row(tokens: int, shape: dict[str, Any], dtype: Any, interpret: bool,
            ceiling: float | None) -> dict[str, Any]:
    """One token count: both ways timed (the kernel alone in the interpreter), checked."""
    e, k, n, top = shape["experts"], shape["k"], shape["n"], shape["top_k"]
    sizes = routed(tokens, e, top, seed=tokens)
    m = int(sizes.sum())
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32) * 0.1, dtype)
    w = jnp.asarray(rng.standard_normal((e, k, n), np.float32) * 0.05, dtype)
    gs = jnp.asarray(sizes)
    kernel = jax.jit(lambda a, b, c: gmm.grouped_matmul(a, b, c, interpret=interpret))
    xla = jax.jit(lambda a, b, c: jax.lax.ragged_dot(a, b, c,
                                                     preferred_element_type=jnp.float32))
    got = np.asarray(kernel(x, w, gs))
    xf = np.asarray(x, np.float32)
    err = _rel_err(got, _reference(xf, np.asarray(w, np.float32), sizes))
    chosen = int((sizes > 0).sum())
    read = chosen * k * n * jnp.dtype(dtype).itemsize
    q4 = int4_experts(np.asarray(w, np.float32))
    got4 = np.asarray(kernel(x, q4, gs))
    dense4 = np.asarray(dequantize(q4.q, q4.scales, q4.mins, "int4", jnp.float32, k_axis=1))
    err4 = _rel_err(got4, _reference(xf, dense4, sizes))
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-3
    row: dict[str, Any] = {"tokens": tokens, "rows": m, "experts_chosen": chosen,
                           "expert_bytes_read": read, "max_rel_err": err,
                           "int4_bytes_read": chosen * (k * n // 2 + 4 * (k // 32) * n),
                           "int4_max_rel_err": err4, "ok": err < tol and err4 < tol}
    t_kernel = pipelined(kernel, (x, w, gs), repeats=3 if interpret else 5)
    row["us_kernel"] = round(t_kernel.median_s * 1e6, 2)
    t_int4 = pipelined(kernel, (x, q4, gs), repeats=3 if interpret else 5)
    row["us_kernel_int4"] = round(t_int4.median_s * 1e6, 2)
    if not interpret:
        t_xla = pipelined(xla, (x, w, gs))
        row["us_xla"] = round(t_xla.median_s * 1e6, 2)
        row["xla_over_kernel"] = round(t_xla.median_s / t_kernel.median_s, 2)
        row["kernel_GBps"] = round(read / t_kernel.median_s / 1e9, 1)
        row["int4_kernel_GBps"] = round(row["int4_bytes_read"] / t_int4.median_s / 1e9, 1)
        if ceiling:
            row["pct_of_copy_16byte"] = round(100 * row["kernel_GBps"] / ceiling, 1)
    return row


def block_row(tokens: int, shape: dict[str, Any], dtype: Any, interpret: bool
              ) -> dict[str, Any]:
    """One sparse block (Qwen3-MoE's: no shared expert) of `shape`'s experts at `tokens`
    tokens, random weights: the one-launch routing against the sorted path, timed and
    compared."""
    from flax import nnx

    from models.config import ModelSpec
    from models.moe import SparseMoeBlock, experts_run_as

    spec = ModelSpec.from_hf_config({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256,
        "hidden_size": shape["k"], "intermediate_size": shape["n"], "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 64, "num_experts": shape["experts"],
        "num_experts_per_tok": shape["top_k"], "moe_intermediate_size": shape["n"],
        "norm_topk_prob": True})
    block = nnx.jit(lambda: SparseMoeBlock(spec, dtype=dtype, rngs=nnx.Rngs(0)))()
    graphdef, state = nnx.split(block)
    impl = "interpret" if interpret else "pallas"

    def run(fused: bool):
        @jax.jit
        def f(state, x):
            m = nnx.merge(graphdef, state)
            with experts_run_as(impl):
                if fused:
                    return m(x)
                logits = jnp.dot(x, m.gate.kernel[...], preferred_element_type=jnp.float32)
                return m._sorted_route(x, logits, None).astype(x.dtype)
        return f

    x = jnp.asarray(np.random.default_rng(tokens).standard_normal(
        (tokens, shape["k"])).astype(np.float32), dtype)
    fused, sorted_ = run(True), run(False)
    a, b = (np.asarray(g(state, x), np.float32) for g in (fused, sorted_))
    err = float(np.abs(a - b).max() / max(1.0, float(np.abs(b).max())))
    row: dict[str, Any] = {"tokens": tokens, "max_rel_diff": err,
                           "ok": err < (2e-2 if dtype == jnp.bfloat16 else 1e-4)}
    t_f = pipelined(fused, (state, x), repeats=3 if interpret else 5)
    t_s = pipelined(sorted_, (state, x), repeats=3 if interpret else 5)
    row["us_fused"] = round(t_f.median_s * 1e6, 2)
    row["us_sorted"] = round(t_s.median_s * 1e6, 2)
    row["sorted_over_fused"] = round(t_s.median_s / t_f.median_s, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    """Time every row within the budget; write the JSON; exit 1 when a row is wrong."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--ceiling-json", type=Path)
    ap.add_argument("--budget-s", type=float, default=60.0)
    args = ap.parse_args(argv)
    smoke = args.cpu_smoke
    shape = SMOKE_SHAPE if smoke else GPU_SHAPE
    dtype = jnp.float32 if smoke else jnp.bfloat16
    ceiling = None
    if args.ceiling_json is not None and args.ceiling_json.exists():
        ceiling = json.loads(args.ceiling_json.read_text()).get("copy_GBps_16byte")
    doc: dict[str, Any] = {"device": str(jax.devices()[0]), "shape": shape,
                           "dtype": jnp.dtype(dtype).name, "copy_GBps_16byte": ceiling,
                           "moe_rows": [], "skipped": [], "errors": []}
    t0 = time.perf_counter()

    def rows(label: str, counts: list[int], run: Any, say: Any) -> list[dict[str, Any]]:
        """`run(tokens)` of each token count while the budget lasts (the rest listed as
        skipped), a failure named in the errors and the next row still run."""
        out = []
        for tokens in counts:
            name = f"{label}T={tokens}"
            if time.perf_counter() - t0 > args.budget_s:
                doc["skipped"].append(tokens if not label else name)
                continue
            try:
                row = run(tokens)
            except Exception as e:  # a failure is a finding
                doc["errors"].append(f"{name}: {type(e).__name__}: {e}"[:500])
                traceback.print_exc()
                continue
            out.append(row)
            print(say(row), flush=True)
        return out

    doc["moe_rows"] = rows(
        "", shape["tokens"], lambda t: run_row(t, shape, dtype, smoke, ceiling),
        lambda r: (f"moe T={r['tokens']} rows={r['rows']} experts={r['experts_chosen']}: "
                   f"kernel {r['us_kernel']} us, xla {r.get('us_xla')} us, "
                   f"{r.get('kernel_GBps')} GB/s, err {r['max_rel_err']:.1e}; int4 "
                   f"{r['us_kernel_int4']} us, {r.get('int4_kernel_GBps')} GB/s, err "
                   f"{r['int4_max_rel_err']:.1e}"))
    doc["block_rows"] = rows(
        "block ", shape["block_tokens"], lambda t: block_row(t, shape, dtype, smoke),
        lambda r: (f"moe block T={r['tokens']}: fused routing {r['us_fused']} us, sorted "
                   f"{r['us_sorted']} us (x{r['sorted_over_fused']}), diff "
                   f"{r['max_rel_diff']:.1e}"))
    args.out.write_text(json.dumps(doc, indent=1))
    bad = doc["errors"] or not all(r["ok"] for r in doc["moe_rows"] + doc["block_rows"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
