"""Speculative decoding on the embedded model: output tokens/s with and without proposals
(`ngram`, `suffix`), copy-heavy and open-ended workloads, batch 1 and 8, greedy and
temperature 0.8, side by side in one run (jpaged/bench/spec.py). Writes per row
`tokens_per_s_spec`, `tokens_per_s_base`, `speedup`, `acceptance_rate`,
`mean_accepted_length` and `outputs_identical` (targets: copy-heavy batch 1 greedy speedup
>= 2.0; open-ended >= 0.95; outputs identical everywhere).

    .venv/bin/python scripts/bench_spec.py --quick --out /tmp/spec.json   # ~6 min
    .venv/bin/python scripts/bench_spec.py --out docs/bench/spec.json     # ~15 min
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jpaged.bench import report
from jpaged.bench.spec import run_spec
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.llm import LLM
from models.loader import load_model

METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
              "prompt_lookup_min": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}


def main() -> None:
    """Parse flags, build the engines over one loaded model, run, write JSON, print."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="greedy only, shorter answers")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/spec.json"))
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    args = ap.parse_args()
    loaded = load_model(args.model)
    common = dict(model=args.model, max_model_len=1280, max_num_seqs=64,
                  max_num_batched_tokens=1024, kv_cache_memory_bytes=512 * 2**20,
                  disable_log_stats=True)

    def llm(spec: dict | None) -> LLM:
        return LLM.from_engine(LLMEngine(EngineArgs(speculative_config=spec, **common),
                                         loaded=loaded))

    res = run_spec(llm(None), {name: llm(cfg) for name, cfg in METHODS.items()},
                   temperatures=(0.0,) if args.quick else (0.0, 0.8),
                   max_tokens=128 if args.quick else 192)
    res.update(quick=args.quick, methods=METHODS)
    report.write(args.out, res)
    report.print_table("speculative decoding", [
        (f"{r['method']} {r['workload']} b{r['batch']} t{r['temperature']}",
         f"{r['speedup']:.2f}x  acc {r['acceptance_rate']:.2f}  len "
         f"{r['mean_accepted_length']:.2f}  same {r['outputs_identical']}")
        for r in res["rows"]])


if __name__ == "__main__":
    main()
