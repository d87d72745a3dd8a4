"""Embedding throughput: jpaged's pooling runner vs HF transformers on the same weights.

The embedded SmolLM2 as an embedding model (LAST pooling, normalized), N prompts of mixed
lengths (64-448 tokens, random byte-level ids), embedded three ways on this CPU:

  jpaged        `LLM.embed` (runner "pooling"): chunked, paged prefill of every prompt,
                packed without padding into the engine's token budget
  hf_padded     HF `LlamaModel` (PyTorch float32, as many threads as XLA:CPU uses) on
                right-padded batches of `--hf-batch` prompts, the last real token pooled
  hf_one        HF on one prompt at a time (no padding)

Throughput is prompt tokens / wall seconds of the whole set; jpaged is warmed on other prompts
of the same lengths first (its timed run compiles nothing). `max_abs_diff` compares jpaged's
vectors with HF's. Each way runs `--rounds` times, taking turns; figures are medians.

    .venv/bin/python scripts/bench_embed.py --out docs/bench/embed.json   # ~1.5 min on 2 cores
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from jpaged.bench import report
from jpaged.bench.vs_hf import hf_twin, xla_cpu_threads
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.llm import LLM
from models.loader import load_model


def prompts_of(n: int, seed: int, vocab: int) -> list[list[int]]:
    """`n` prompts of 64-448 random token ids."""
    rng = np.random.default_rng(seed)
    return [rng.integers(256, vocab, size=int(k)).tolist()
            for k in rng.integers(64, 449, size=n)]


def run_jpaged(llm: LLM, prompts: list[list[int]]) -> tuple[float, np.ndarray]:
    """(seconds, vectors [n, hidden]) of one embed call."""
    t0 = time.perf_counter()
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts])
    return time.perf_counter() - t0, np.stack([o.outputs.data for o in outs])


def run_hf(model, prompts: list[list[int]], batch: int) -> tuple[float, np.ndarray]:
    """(seconds, vectors) of HF's base model on right-padded batches, last real token pooled
    and normalized."""
    import torch

    out = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            part = prompts[i:i + batch]
            width = max(map(len, part))
            ids = torch.zeros((len(part), width), dtype=torch.long)
            mask = torch.zeros((len(part), width), dtype=torch.long)
            for j, p in enumerate(part):
                ids[j, :len(p)] = torch.tensor(p)
                mask[j, :len(p)] = 1
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = h[torch.arange(len(part)), mask.sum(1) - 1].numpy()
            out.append(last / np.linalg.norm(last, axis=1, keepdims=True))
    return time.perf_counter() - t0, np.concatenate(out)


def main() -> None:
    """Time the three ways; write the JSON and print a table."""
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/bench/embed.json"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(xla_cpu_threads())
    loaded = load_model(None, dtype="float32")
    vocab = loaded.spec.vocab_size
    prompts = prompts_of(args.prompts, 0, vocab)
    tokens = sum(map(len, prompts))
    engine = LLMEngine(EngineArgs(runner="pooling", max_model_len=512, max_num_seqs=32,
                                  disable_log_stats=True), loaded=loaded)
    llm = LLM.from_engine(engine)
    run_jpaged(llm, prompts_of(args.prompts, 1, vocab))  # warm-up: every step shape compiled
    with tempfile.TemporaryDirectory() as tmp:
        model = hf_twin(loaded, Path(tmp)).model.eval()
    times: dict[str, list[float]] = {"jpaged": [], "hf_padded": [], "hf_one": []}
    vecs: dict[str, np.ndarray] = {}
    for _ in range(args.rounds):
        for way in times:
            if way == "jpaged":
                s, v = run_jpaged(llm, prompts)
            else:
                s, v = run_hf(model, prompts, args.hf_batch if way == "hf_padded" else 1)
            times[way].append(s)
            vecs[way] = v
    rows = []
    for way, ts in times.items():
        s = report.median(ts)
        rows.append({"way": way, "seconds": round(s, 3), "tokens_per_s": round(tokens / s, 1),
                     "max_abs_diff": float(np.abs(vecs[way] - vecs["jpaged"]).max())})
    base = rows[0]["seconds"]
    for r in rows:
        r["jpaged_speedup"] = round(r["seconds"] / base, 2)
    data = {"machine": report.machine(), "model": "SmolLM2-135M (embedded), LAST, normalized",
            "prompts": args.prompts, "prompt_tokens": tokens, "hf_batch": args.hf_batch,
            "torch_threads": torch.get_num_threads(), "rows": rows}
    report.write(args.out, data)
    report.print_table(f"Embedding {args.prompts} prompts ({tokens} tokens) on this CPU", [
        (r["way"], f"{r['seconds']} s, {r['tokens_per_s']} tok/s, jpaged x{r['jpaged_speedup']}"
                   f", max |diff| {r['max_abs_diff']:.1e}") for r in rows])


if __name__ == "__main__":
    main()
