"""Speculative decoding's speed-up on one model: the same requests through an engine without
proposals and engines with each method, side by side in one process.

Two workloads: copy-heavy (the request repeats a block of source code of 200-800 tokens, as
an editing agent's output copies its input) and open-ended (free answers, little
repetition). Each runs at batch 1 and batch 8, greedy and at temperature 0.8 (seeded). Every
engine first runs each workload once untimed (compiles its step shapes); then each
configuration is timed once per engine, in turn. Per method, workload, batch and temperature:
output tokens/s with and without proposals, the speed-up, the acceptance rate and mean
acceptance length (from the engine's spec_decode_* counters over the timed run), and whether
the outputs are identical (they must be, greedy or seeded, see docs/spec_decode.md).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from typing import Any

from jpaged.bench.throughput import spec_decode_summary
from jpaged.sampling_params import SamplingParams

OPEN_ENDED = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, for a ten-year-old.",
    "What are the pros and cons of working from home? Give your opinion.",
    "Describe your ideal weekend in a few paragraphs.",
    "Invent a new board game and explain its rules.",
    "Why do leaves change colour in autumn?",
    "Write a letter to a friend you have not seen for years.",
    "Give advice to someone starting to learn the piano.",
]


def _code_blocks(tokenizer: Any, n: int, lo: int = 200, hi: int = 800) -> list[str]:
    """n blocks of this package's own source, each 200-800 tokens (whole lines)."""
    import jpaged.core.scheduler as a
    import jpaged.core.step_results as b
    import jpaged.output_processor as c
    import jpaged.runner.batch as d

    blocks: list[str] = []
    for mod in (a, b, c, d):
        lines = inspect.getsource(mod).splitlines()
        start = 0
        while start < len(lines) and len(blocks) < n:
            end = start
            while end < len(lines) and len(tokenizer.encode("\n".join(lines[start:end]))) < lo:
                end += 8
            block = "\n".join(lines[start:end])
            if lo <= len(tokenizer.encode(block)) <= hi:
                blocks.append(block)
            start = end + 40
    if len(blocks) < n:
        raise ValueError(f"found {len(blocks)} code blocks of {lo}-{hi} tokens, need {n}")
    return blocks[:n]


def workloads(llm: Any, batch: int) -> dict[str, list[str]]:
    """The two workloads' chat prompts (`batch` each)."""
    tok = llm.get_tokenizer()

    def chat(text: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True)

    code = _code_blocks(tok, batch)
    return {
        "copy": [chat(f"Repeat this code exactly, with no change:\n\n{b}") for b in code],
        "open": [chat(OPEN_ENDED[i % len(OPEN_ENDED)]) for i in range(batch)],
    }


def _params(n: int, temperature: float, max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, seed=1000 + i, max_tokens=max_tokens)
            for i in range(n)]


def _timed(llm: Any, prompts: Sequence[str], params: list[SamplingParams]
           ) -> tuple[float, int, list[list[int]], dict[str, Any]]:
    engine = llm.llm_engine
    engine.reset_prefix_cache()  # each run computes its prompts (no hit from the last run)
    before = engine.get_metrics()
    t0 = time.perf_counter()
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    dt = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    spec = (spec_decode_summary(before, engine.get_metrics())
            if engine.config.speculative is not None else {})
    return dt, sum(map(len, ids)), ids, spec


def run_spec(base: Any, methods: dict[str, Any], batches: Sequence[int] = (1, 8),
             temperatures: Sequence[float] = (0.0, 0.8), max_tokens: int = 192
             ) -> dict[str, Any]:
    """Time every configuration on `base` (no proposals) and each engine of `methods`."""
    prompts = workloads(base, max(batches))
    engines = {"base": base, **methods}
    for llm in engines.values():  # untimed: compile the shapes of both workloads
        for b in sorted(batches):
            for texts in prompts.values():
                llm.generate(texts[:b], _params(b, 0.0, max_tokens), use_tqdm=False)
    rows = []
    for workload, texts in prompts.items():
        for b in batches:
            for temp in temperatures:
                params = _params(b, temp, max_tokens)
                dt0, n0, ids0, _ = _timed(base, texts[:b], params)
                for name, llm in methods.items():
                    dt, n, ids, spec = _timed(llm, texts[:b], params)
                    tps, tps0 = n / dt, n0 / dt0
                    rows.append({
                        "method": name, "workload": workload, "batch": b,
                        "temperature": temp, "output_tokens": n,
                        "tokens_per_s_spec": round(tps, 2),
                        "tokens_per_s_base": round(tps0, 2),
                        "speedup": round(tps / tps0, 3),
                        "acceptance_rate": round(spec["spec_decode_acceptance_rate"], 4),
                        "mean_accepted_length": round(
                            spec["spec_decode_mean_acceptance_length"], 3),
                        "num_drafts": spec["spec_decode_num_drafts"],
                        "outputs_identical": ids == ids0,
                    })
    return {"max_tokens": max_tokens, "rows": rows}
