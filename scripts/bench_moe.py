"""What a mixture-of-experts layer's experts cost by how they are multiplied, on this CPU.

One sparse layer's experts (SwiGLU: gate, up, down) for T tokens routed to k of E experts, as
the engine runs them on XLA:CPU (`loop`: a while loop over the row tiles of the experts the
tokens chose) beside jax.lax.ragged_dot (`xla`: XLA:CPU widens the rows to one GEMM over every
expert), side by side at decode and prefill token counts. Each row is the median of the timed
rounds, the two taking turns; `ratio` is xla's time over loop's. The weights are random float32
of Qwen3-30B-A3B's expert shape scaled down (E=64 experts of 1024 -> 512, k=8) to fit a 24 GiB
machine beside ragged_dot's temporaries; `temp_bytes` is XLA's memory analysis of each program.
A third way, `loop_int4`, runs the loop on the same experts quantized as a Q4_K GGUF's run at its
own quantization (int4 in groups of 32, float16 scales and mins: the loop dequantizes one chosen
expert at a time); `int4_over_float` is its time over the float32 loop's.

    .venv/bin/python scripts/bench_moe.py --out docs/bench/moe.json   # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.bench import report
from jpaged.bench.moe_check import int4_experts
from models.moe import grouped_matmul, route

E, HIDDEN, WIDTH, TOP_K = 64, 1024, 512, 8


def experts_fn(impl: str):
    """Jitted: x [T, hidden] routed by logits [T, E] -> the experts' weighted sum."""

    @jax.jit
    def run(x, logits, wg, wu, wd):
        weights, experts = route(logits, TOP_K, True)
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=E)
        xs = x[order // TOP_K]
        g = grouped_matmul(xs, wg, sizes, impl=impl)
        u = grouped_matmul(xs, wu, sizes, impl=impl)
        out = grouped_matmul(jax.nn.silu(g) * u, wd, sizes, impl=impl)
        pairs = out[jnp.argsort(order)].reshape(x.shape[0], TOP_K, HIDDEN)
        return jnp.einsum("tkh,tk->th", pairs, weights)

    return run


def main() -> None:
    """Time both ways at each token count; write the JSON and print a table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/bench/moe.json"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", default="1,4,16,64,256")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    w = [jnp.asarray(rng.standard_normal(s, np.float32) * 0.03)
         for s in ((E, HIDDEN, WIDTH), (E, HIDDEN, WIDTH), (E, WIDTH, HIDDEN))]
    loop = experts_fn("loop")
    fns = {"loop": loop, "xla": experts_fn("xla"), "loop_int4": loop}
    weights = {"loop": w, "xla": w, "loop_int4": [int4_experts(np.asarray(a)) for a in w]}
    rows = []
    for t in (int(n) for n in args.tokens.split(",")):
        x = jnp.asarray(rng.standard_normal((t, HIDDEN), np.float32))
        logits = jnp.asarray(rng.standard_normal((t, E), np.float32))
        temps, times = {}, {impl: [] for impl in fns}
        outs = {}
        for impl, fn in fns.items():
            compiled = fn.lower(x, logits, *weights[impl]).compile()
            temps[impl] = compiled.memory_analysis().temp_size_in_bytes
            outs[impl] = np.asarray(fn(x, logits, *weights[impl]))  # warm
        err = float(np.abs(outs["loop"] - outs["xla"]).max())
        for _ in range(args.rounds):
            for impl, fn in fns.items():
                t0 = time.perf_counter()
                fn(x, logits, *weights[impl]).block_until_ready()
                times[impl].append(time.perf_counter() - t0)
        ms = {impl: 1e3 * report.median(ts) for impl, ts in times.items()}
        rows.append({"tokens": t, "ms_loop": round(ms["loop"], 3), "ms_xla": round(ms["xla"], 3),
                     "ratio": round(ms["xla"] / ms["loop"], 2), "temp_bytes_loop": temps["loop"],
                     "temp_bytes_xla": temps["xla"], "max_abs_diff": err,
                     "ms_loop_int4": round(ms["loop_int4"], 3),
                     "int4_over_float": round(ms["loop_int4"] / ms["loop"], 2),
                     "temp_bytes_loop_int4": temps["loop_int4"]})
    int4_bytes = sum(int(a.nbytes) for q in weights["loop_int4"]
                     for a in (q.q, q.scales, q.mins))
    data = {"machine": report.machine(), "experts": E, "hidden": HIDDEN, "width": WIDTH,
            "top_k": TOP_K, "expert_bytes": E * 3 * HIDDEN * WIDTH * 4,
            "expert_bytes_int4": int4_bytes, "rows": rows}
    report.write(args.out, data)
    report.print_table("MoE experts on this CPU (E=64, 1024 -> 512, k=8)", [
        (f"T={r['tokens']}", f"loop {r['ms_loop']} ms, xla {r['ms_xla']} ms (x{r['ratio']}); "
                             f"temps {r['temp_bytes_loop'] / 2**20:.1f} / "
                             f"{r['temp_bytes_xla'] / 2**20:.1f} MiB; int4 loop "
                             f"{r['ms_loop_int4']} ms (x{r['int4_over_float']} of float)")
        for r in rows])


if __name__ == "__main__":
    main()
