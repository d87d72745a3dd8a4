"""Beam search against greedy decoding of the same prompts, same engine, side by side.

    python scripts/bench_beam_search.py [--width 4] [--prompts 4] [--tokens 32] \
        [--out docs/bench/beam_search.json]

Each beam search step runs every live beam (prompts x width) as a one-token request; the
report gives its wall time over the greedy run's, and how much of the prompt tokens each step
sends again the prefix cache served.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from jpaged import LLM, BeamSearchParams, SamplingParams
from jpaged.bench import report


def main() -> None:
    """Parse flags, time greedy and beam search alternately, write the JSON, print the table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("docs/bench/beam_search.json"))
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=512, max_num_seqs=max(16, args.prompts * args.width),
              max_num_batched_tokens=512)
    prompts = [f"Write a short story about a robot named {chr(65 + i)}{i}."
               for i in range(args.prompts)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    beam = BeamSearchParams(beam_width=args.width, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, greedy)  # warm: every shape both runs take compiles here
    llm.beam_search(prompts, beam)
    rows = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        llm.generate(prompts, greedy)
        g = time.perf_counter() - t0
        before = llm.get_metrics()
        t0 = time.perf_counter()
        llm.beam_search(prompts, beam)
        b = time.perf_counter() - t0
        after = llm.get_metrics()
        queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        rows.append({"greedy_s": g, "beam_s": b, "ratio": b / g,
                     "prefix_hit_rate": hits / queries if queries else 0.0})
    med = {k: report.median([r[k] for r in rows]) for k in rows[0]}
    data = {"model": llm.llm_engine.loaded.source, "width": args.width,
            "prompts": args.prompts, "tokens": args.tokens, "runs": rows, "median": med}
    report.print_table(f"beam search (width {args.width}) vs greedy, {args.prompts} prompts x "
                       f"{args.tokens} tokens", [(k, v) for k, v in med.items()])
    report.write(args.out, data)


if __name__ == "__main__":
    main()
