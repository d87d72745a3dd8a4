"""Embedding (and reranking) throughput: jpaged's pooling runner vs HF transformers on the
same weights.

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

`--task rerank` times a cross-encoder instead: the same weights as a causal reranker run
through vLLM's `hf_overrides` (`classifier_from_token` ["no", "yes"], a 2-way softmax), one
query of 32 tokens scored against each prompt (`LLM.score`: each pair one prompt); HF reads
the same pairs' last hidden state through the same head (the "yes" row minus the "no" row of
its LM head, then a sigmoid), padded or one at a time.

    .venv/bin/python scripts/bench_embed.py --task rerank --out docs/bench/rerank.json
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


QUERY_LEN = 32
RERANK_TOKENS = ["no", "yes"]


def run_jpaged(llm: LLM, prompts: list[list[int]], query: list[int] | None = None
               ) -> tuple[float, np.ndarray]:
    """(seconds, vectors [n, hidden]) of one embed call; with a `query`, (seconds, scores
    [n, 1]) of one score call of the query against each prompt."""
    t0 = time.perf_counter()
    if query is not None:
        scored = llm.score({"prompt_token_ids": query}, [{"prompt_token_ids": p}
                                                         for p in prompts])
        return time.perf_counter() - t0, np.array([[o.outputs.score] for o in scored])
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts])
    return time.perf_counter() - t0, np.stack([o.outputs.data for o in outs])


def run_hf(model, prompts: list[list[int]], batch: int, head: np.ndarray | None = None
           ) -> tuple[float, np.ndarray]:
    """(seconds, vectors) of HF's base model on right-padded batches, last real token pooled
    and normalized; with a cross-encoder `head` [hidden] (prompts being the joined pairs),
    the sigmoid of the pooled state's product with it."""
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
            if head is not None:
                out.append(1 / (1 + np.exp(-(last @ head)[:, None])))
            else:
                out.append(last / np.linalg.norm(last, axis=1, keepdims=True))
    return time.perf_counter() - t0, np.concatenate(out)


def main() -> None:
    """Time the three ways; write the JSON and print a table."""
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=("embed", "rerank"), default="embed")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rerank = args.task == "rerank"
    out = args.out or Path(f"docs/bench/{args.task}.json")
    torch.set_num_threads(xla_cpu_threads())
    loaded = load_model(None, dtype="float32")
    vocab = loaded.spec.vocab_size
    prompts = prompts_of(args.prompts, 0, vocab)
    query = prompts_of(1, 2, vocab)[0][:QUERY_LEN] if rerank else None
    sizing = dict(max_model_len=512 + (QUERY_LEN if rerank else 0), max_num_seqs=32,
                  disable_log_stats=True)
    head = None
    with tempfile.TemporaryDirectory() as tmp:
        twin = hf_twin(loaded, Path(tmp))
        model = twin.model.eval()
        if rerank:  # the same weights as a causal reranker, through vLLM's hf_overrides
            overrides = {"architectures": ["LlamaForSequenceClassification"],
                         "classifier_from_token": RERANK_TOKENS, "method": "from_2_way_softmax"}
            loaded = load_model(tmp, dtype="float32", hf_overrides=overrides)
            no, yes = (loaded.tokenizer.token_to_id(t) for t in RERANK_TOKENS)
            w = twin.lm_head.weight.detach().numpy()
            head = w[yes] - w[no]
    engine = LLMEngine(EngineArgs(runner="pooling", **sizing), loaded=loaded)
    llm = LLM.from_engine(engine)
    pairs = [query + p for p in prompts] if query is not None else prompts
    tokens = sum(map(len, pairs))
    run_jpaged(llm, prompts_of(args.prompts, 1, vocab), query)  # warm-up: every step shape
    times: dict[str, list[float]] = {"jpaged": [], "hf_padded": [], "hf_one": []}
    vecs: dict[str, np.ndarray] = {}
    for _ in range(args.rounds):
        for way in times:
            if way == "jpaged":
                s, v = run_jpaged(llm, prompts, query)
            else:
                s, v = run_hf(model, pairs, args.hf_batch if way == "hf_padded" else 1, head)
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
    model_name = ("SmolLM2-135M (embedded) as a cross-encoder: classifier_from_token no/yes, "
                  f"a {QUERY_LEN}-token query per pair" if rerank else
                  "SmolLM2-135M (embedded), LAST, normalized")
    data = {"machine": report.machine(), "task": args.task, "model": model_name,
            "prompts": args.prompts, "prompt_tokens": tokens, "hf_batch": args.hf_batch,
            "torch_threads": torch.get_num_threads(), "rows": rows}
    report.write(out, data)
    what = "Scoring" if rerank else "Embedding"
    report.print_table(f"{what} {args.prompts} prompts ({tokens} tokens) on this CPU", [
        (r["way"], f"{r['seconds']} s, {r['tokens_per_s']} tok/s, jpaged x{r['jpaged_speedup']}"
                   f", max |diff| {r['max_abs_diff']:.1e}") for r in rows])


if __name__ == "__main__":
    main()
