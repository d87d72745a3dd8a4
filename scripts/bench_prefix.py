"""Prefix caching on vs off: a shared system prompt and different questions, same engine.

    python scripts/bench_prefix.py [--quick] [--out docs/bench/prefix.json]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from jpaged import LLM, SamplingParams
from jpaged.bench import report
from jpaged.bench.workloads import shared_prefix_prompts, theoretical_prefix_hits


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, dict]:
    """Wall time of one batch, and the prefix-cache counters it added."""
    before = llm.get_metrics()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    dt = time.perf_counter() - t0
    after = llm.get_metrics()
    return dt, {k: after[k] - before[k] for k in ("prefix_cache_hits", "prefix_cache_queries")}


def main() -> None:
    """Parse flags, run both modes side by side, write JSON + PNG, print the table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller workload (< 3 min on 2 cores)")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/prefix.json"))
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    prefix, questions = (400, 8) if args.quick else (1000, 32)
    repeats = args.repeats or (1 if args.quick else 3)
    max_tokens = 4
    engine = dict(max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=2048,
                  block_size=16, num_gpu_blocks_override=(prefix // 16 + 8) * questions + 64)
    on = LLM(enable_prefix_caching=True, **engine)
    off = LLM(enable_prefix_caching=False, **engine)
    tok = on.get_tokenizer()
    prompts = shared_prefix_prompts(tok, prefix, questions)
    # Warm-up: same shapes, a different system prompt, so no timed step compiles.
    warm = shared_prefix_prompts(tok, prefix + 37, questions)
    for llm in (on, off):
        run(llm, warm, max_tokens)
    t_on, t_off, counters = [], [], {}
    for _ in range(repeats):
        on.reset_prefix_cache()
        dt, counters = run(on, prompts, max_tokens)
        t_on.append(dt)
        t_off.append(run(off, prompts, max_tokens)[0])
    total = sum(len(p) for p in prompts)
    theory = theoretical_prefix_hits(prompts, 16)
    data = {
        "shared_prefix_tokens": len(os.path.commonprefix(prompts)), "num_questions": questions,
        "prompt_tokens_total": total, "time_on_s": report.median(t_on),
        "time_off_s": report.median(t_off), "speedup": report.median(t_off) / report.median(t_on),
        "hit_rate": counters["prefix_cache_hits"] / counters["prefix_cache_queries"],
        "theoretical_hit_rate": theory / total, "hits_tokens": counters["prefix_cache_hits"],
        "theoretical_hits_tokens": theory, "repeats": repeats, "quick": args.quick,
    }

    def plot(ax):
        ax.bar(["caching off", "caching on"], [data["time_off_s"], data["time_on_s"]],
               color=["#999999", "#2a7ab9"])
        ax.set_ylabel("batch wall time (s)")
        ax.set_title(f"{questions} questions, shared {prefix}-token system prompt: "
                     f"{data['speedup']:.2f}x, hit rate {data['hit_rate']:.3f}", fontsize=9)

    report.write(args.out, data, plot)
    report.print_table("prefix caching", [(k, v) for k, v in data.items()])


if __name__ == "__main__":
    main()
