"""jpaged vs HF transformers `generate` and `generate_batch`: same weights, prompts, lengths.

    python scripts/bench_vs_hf.py [--quick] [--out docs/bench/vs_hf.json]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from jpaged.bench import bound, report, vs_hf
from jpaged.bench.workloads import mixed_length_requests
from models.loader import load_model


def main() -> None:
    """Parse flags, run the three side by side, write JSON + PNG, print the table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller workload (< 3 min on 2 cores)")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/vs_hf.json"))
    ap.add_argument("--model", default=None, help="model path (default: the embedded model)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch

    threads = vs_hf.xla_cpu_threads()
    torch.set_num_threads(threads)  # the same cores as XLA:CPU's thread pool
    if args.quick:
        n, prompt_range, output_len, repeats = 8, (32, 256), 16, 1
    else:
        n, prompt_range, output_len, repeats = 32, (32, 512), 64, 3
    repeats = args.repeats or repeats
    loaded = load_model(args.model, dtype="float32")
    max_len = 2048
    with tempfile.TemporaryDirectory(prefix="jpaged-hf-") as tmp:
        hf = vs_hf.hf_twin(loaded, Path(tmp))
    pad = loaded.spec.eos_token_ids[0]
    engine = vs_hf.jpaged_engine(loaded, max_len, n)
    vocab = loaded.spec.vocab_size

    def prompts(seed: int) -> list[list[int]]:
        return [p for p, _ in mixed_length_requests(vocab, n, seed, prompt_range, (1, 1))]

    # Warm-up on other prompts of the same lengths (same step shapes): no timed compiles.
    warm = [[(t + 1) % vocab for t in p] for p in prompts(args.seed)]
    vs_hf.run_jpaged(engine, warm, output_len, "warm")
    vs_hf.run_hf_generate_batch(hf, warm[:2], 2, pad)
    runs = {"jpaged": [], "hf_generate": [], "hf_generate_batch": []}
    agree = []
    for r in range(repeats):
        ps = prompts(args.seed + r)
        runs["jpaged"].append(vs_hf.run_jpaged(engine, ps, output_len, f"r{r}"))
        runs["hf_generate"].append(vs_hf.run_hf_generate(hf, ps, output_len, pad))
        runs["hf_generate_batch"].append(vs_hf.run_hf_generate_batch(hf, ps, output_len, pad))
        agree.append(vs_hf.agreement(runs["jpaged"][-1]["token_ids"],
                                     runs["hf_generate"][-1]["token_ids"]))
    # The zero-overhead bound for jpaged on these prompts at this machine's measured rates.
    rates = bound.machine_rates()
    limit = bound.workload_bound(loaded.spec, [len(p) for p in prompts(args.seed)], output_len,
                                 rates)
    med = report.median
    tps = {k: med([x["tokens_per_s"] for x in v]) for k, v in runs.items()}
    ttft = {k: med([x["ttft_s"] for x in v]) for k, v in runs.items()}
    data = {
        "jpaged_tokens_per_s": tps["jpaged"], "hf_generate_tokens_per_s": tps["hf_generate"],
        "hf_generate_batch_tokens_per_s": tps["hf_generate_batch"],
        "ratio_vs_generate": tps["jpaged"] / tps["hf_generate"],
        "ratio_vs_generate_batch": tps["jpaged"] / tps["hf_generate_batch"],
        "jpaged_ttft_s": ttft["jpaged"], "hf_generate_ttft_s": ttft["hf_generate"],
        "hf_generate_batch_ttft_s": ttft["hf_generate_batch"],
        "greedy_agreement_vs_generate": min(agree),
        "jpaged_bound_tokens_per_s": limit["bound_tokens_per_s"],
        "bound_ratio_vs_generate": limit["bound_tokens_per_s"] / tps["hf_generate"],
        "bound_ratio_vs_generate_batch": limit["bound_tokens_per_s"] / tps["hf_generate_batch"],
        "matmul_gflops": rates["matmul_flops_per_s"] / 1e9,
        "read_gb_per_s": rates["read_bytes_per_s"] / 1e9, "num_requests": n,
        "prompt_range": prompt_range, "output_len": output_len, "threads": threads,
        "repeats": repeats, "quick": args.quick,
        "wall_s": {k: [x["wall_s"] for x in v] for k, v in runs.items()},
    }

    def plot(ax):
        names = ["HF generate\n(padded batch)", "HF generate_batch\n(continuous)", "jpaged"]
        vals = [tps["hf_generate"], tps["hf_generate_batch"], tps["jpaged"]]
        ax.bar(names, vals, color=["#999999", "#bbbbbb", "#2a7ab9"])
        ax.set_ylabel("generated tokens / s")
        ax.set_title(f"{n} prompts, {output_len} tokens each, {threads} threads: "
                     f"{data['ratio_vs_generate']:.1f}x / "
                     f"{data['ratio_vs_generate_batch']:.1f}x", fontsize=9)

    report.write(args.out, data, plot)
    report.print_table("jpaged vs HF transformers",
                       [(k, v) for k, v in data.items() if k != "wall_s"])


if __name__ == "__main__":
    main()
