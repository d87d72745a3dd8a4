"""Structured outputs' cost on the embedded model: output tokens/s at batch 32 unconstrained,
a quarter of the rows constrained, and all constrained, with the same tokens produced in each
run (jpaged/bench/structured.py). Writes `tokens_per_s_unconstrained`, `tokens_per_s_mixed`,
`tokens_per_s_constrained`, `overhead_constrained` (target <= 0.10), `valid_fraction` (target
1.0) and `compiles_during_timed_runs` (target 0: no grammar compiles a step).

    .venv/bin/python scripts/bench_structured.py --quick --out /tmp/structured.json  # ~2 min
    .venv/bin/python scripts/bench_structured.py --out docs/bench/structured.json    # ~5 min
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jpaged.bench import report
from jpaged.bench.structured import run_structured
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.llm import LLM


def main() -> None:
    """Parse flags, run the three configurations, write JSON, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repeat, shorter answers")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/structured.json"))
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    engine = LLMEngine(EngineArgs(model=args.model, max_model_len=512, max_num_seqs=args.batch,
                                  max_num_batched_tokens=1024, disable_log_stats=True))
    res = run_structured(LLM.from_engine(engine), batch=args.batch,
                         max_tokens=120 if args.quick else 200, repeats=1 if args.quick else 3)
    res["quick"] = args.quick
    report.write(args.out, res)
    report.print_table("structured outputs", [
        (k, res[k]) for k in ("batch", "output_tokens_per_run", "tokens_per_s_unconstrained",
                              "tokens_per_s_mixed", "tokens_per_s_constrained", "overhead_mixed",
                              "overhead_constrained", "valid_fraction",
                              "compiles_during_timed_runs")])


if __name__ == "__main__":
    main()
