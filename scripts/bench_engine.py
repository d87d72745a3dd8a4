"""Compile counts over a 200-request random workload, and host overhead per step.

    python scripts/bench_engine.py [--quick] [--out docs/bench/engine.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jpaged.bench import report
from jpaged.bench.engine_bench import count_compiles, host_overhead
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from models.loader import load_model


def main() -> None:
    """Parse flags, measure, write JSON + PNG, print the table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="shorter requests (< 3 min on 2 cores)")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/engine.json"))
    ap.add_argument("--model", default=None, help="model path (default: the embedded model)")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--skip-compiles", action="store_true", help="host overhead only")
    args = ap.parse_args()
    loaded = load_model(args.model, dtype="float32")
    prompt_range, output_range = ((4, 48), (1, 8)) if args.quick else ((16, 512), (1, 64))
    steps = 4 if args.quick else 8
    make = dict(max_model_len=2048, max_num_seqs=64, num_gpu_blocks_override=4096,
                disable_log_stats=True)
    data = {"prompt_range": prompt_range, "output_range": output_range, "quick": args.quick,
            "engine": make}
    if not args.skip_compiles:
        data.update(count_compiles(LLMEngine(EngineArgs(**make), loaded=loaded),
                                   args.num_requests, 0, prompt_range, output_range))
    engine = LLMEngine(EngineArgs(**make), loaded=loaded)
    host = [host_overhead(engine, b, steps=steps) for b in (1, 16, 64)]
    for h in host:
        data[f"host_share_b{h['batch']}"] = h["host_share"]
    data["host"] = host

    def plot(ax):
        xs = [str(h["batch"]) for h in host]
        dev = [h["device_ms"] for h in host]
        hst = [h["host_ms"] for h in host]
        ax.bar(xs, dev, label="device step (jitted call)", color="#2a7ab9")
        ax.bar(xs, hst, bottom=dev, label="host (schedule, pack, update)", color="#e08a2c")
        ax.set_xlabel("decode batch")
        ax.set_ylabel("ms per engine step")
        ax.legend(fontsize=8)
        ax.set_title(f"host share at batch 64: {data['host_share_b64']:.3f}; compiles "
                     f"{data.get('compiles_total', '-')} total, "
                     f"{data.get('compiles_after_warmup', '-')} after warm-up", fontsize=9)

    report.write(args.out, data, plot)
    report.print_table("engine: compiles and host overhead",
                       [(k, v) for k, v in data.items() if k not in ("host", "engine")])


if __name__ == "__main__":
    main()
