"""Quantized weights against the float32 model they came from (jpaged/bench/quant.py): per
model (the embedded SmolLM2; Gemma 3 270M when its extra is installed, else a note saying it
was skipped) and format (`float32`: the GGUF dequantized, the reference; `gguf`: its own
quantization; `fp8`: decoder linears per output channel), `mean_kl` and `top1_agreement` of
the next-token distributions over 12 teacher-forced prompts, `greedy_agreement_64` of the
engine's greedy tokens, `tokens_per_s` of that generation (all prompts in one batch; median
of 3 timed rounds, the formats taking turns), and
`weight_bytes` against `weight_bytes_float32` (targets: fp8 mean KL <= 0.02 and top-1 >= 0.97;
gguf weight bytes <= 0.3x float32).

    .venv/bin/pip install -e ".[gemma3]"               # for the Gemma rows (optional)
    .venv/bin/python scripts/bench_quant.py \\
        --out docs/bench/quant.json                     # ~10 min on 2 busy cores
    .venv/bin/python scripts/bench_quant.py --models smollm2-135m --prompts 4 \\
        --max-tokens 16 --out /tmp/quant.json           # a quick look, ~2 min
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from jpaged.bench import report
from jpaged.bench.quant import FORMATS, PROMPTS, run_quant

# label -> the name load_model takes (None: the embedded default).
MODELS: dict[str, str | None] = {"smollm2-135m": None, "gemma3-270m": "gemma3-270m"}


def main() -> None:
    """Parse flags, measure every model and format, write JSON, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/bench/quant.json"))
    ap.add_argument("--models", nargs="+", default=list(MODELS),
                    help=f"labels ({', '.join(MODELS)}) or model paths")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS),
                    help=f"how many of the {len(PROMPTS)} fixed prompts")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--warmup-tokens", type=int, default=8,
                    help="tokens per prompt of the untimed call that compiles the shapes")
    ap.add_argument("--rounds", type=int, default=3,
                    help="timed generate calls per format, the formats taking turns (median)")
    args = ap.parse_args()
    if "float32" not in args.formats:
        ap.error("--formats must include float32, the reference")
    res = run_quant({m: MODELS.get(m, m) for m in args.models}, args.formats, args.prompts,
                    args.max_tokens, args.warmup_tokens, args.rounds)
    env = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    res["command"] = env + shlex.join([os.path.relpath(sys.executable), *sys.argv])
    report.write(args.out, res)
    agree = f"greedy_agreement_{args.max_tokens}"
    report.print_table("quantized weights vs float32", [
        (f"{r['model']} {r['format']}",
         f"KL {r['mean_kl']:.4g}  top1 {r['top1_agreement']:.3f}  greedy {r[agree]:.3f}  "
         f"{r['tokens_per_s']:.1f} tok/s ({r['tokens_per_s_vs_float32']:.2f}x)  "
         f"{r['weight_bytes'] / r['weight_bytes_float32']:.3f}x bytes")
        for r in res["rows"]] + [(f"{s['model']} skipped", s["reason"][:80])
                                 for s in res["skipped"]])


if __name__ == "__main__":
    main()
