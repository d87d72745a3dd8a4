"""Speculative decoding's speed-up on one model: the same requests through an engine without
proposals and engines with each method, side by side in one process.

Two workloads: copy-heavy (the request repeats a text of 200-400 tokens word for word, as an
editing agent's output copies its input) and open-ended (free answers, little repetition).
Each runs at batch 1 and batch 8, greedy and at temperature 0.8 (seeded). Every engine first
runs other prompts of both workloads untimed (compiles its step shapes); then each
configuration is timed once per engine, in turn, with the suffix method's tree of earlier
responses emptied before each timed run (the same prompts run in several configurations, and
a response seen before would be proposed whole). Per method, workload, batch and temperature:
output tokens/s with and without proposals, the speed-up, the acceptance rate and mean
acceptance length (from the engine's spec_decode_* counters over the timed run), and whether
the outputs are identical (they must be, greedy or seeded, see docs/spec_decode.md).
"""

from __future__ import annotations

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


# Plain sentences the copy-heavy workload's texts are drawn from (a 135M model copies prose
# faithfully; it does not copy long code).
SENTENCES = [
    "The old lighthouse stood at the edge of the cliff for more than a hundred years.",
    "Every night its keeper climbed the narrow stairs, trimmed the wick and polished the lens.",
    "Ships passing in the dark saw the light sweep across the water and knew where the rocks were.",
    "When the storms came in winter, the keeper stayed awake until morning.",
    "In the spring he painted the door red and planted flowers in the small garden.",
    "Children from the village sometimes walked up the hill to visit him.",
    "He told them stories about the sailors he had helped and what the sea left on the shore.",
    "One day a letter arrived saying the lighthouse would be replaced by an automatic lamp.",
    "The keeper read it twice, folded it carefully and put it in his pocket.",
    "The market opens at six in the morning, before the streets are full of traffic.",
    "Farmers bring baskets of apples, pears and plums from the orchards in the valley.",
    "A baker sells warm bread from a cart painted with blue and yellow stripes.",
    "By noon the square is crowded with people looking for cheese, honey and fresh fish.",
    "In the afternoon the sellers pack their tables and sweep the stones clean.",
    "The river that runs through the town was once used to carry timber to the coast.",
    "Today it is quiet, and families rent small boats to row under the old stone bridges.",
    "A museum near the harbour keeps maps, ropes and tools from the days of the timber trade.",
    "Every summer the town holds a festival with music, dancing and a race on the water.",
    "The winners receive a wooden cup carved by the oldest carpenter in the region.",
    "Scientists study the birds that nest on the islands off the coast each spring.",
    "They count the eggs, measure the chicks and record the weather every day.",
    "Over the years they have learned that warmer seas bring fewer fish near the surface.",
    "The birds must then fly farther to feed their young, and fewer of them survive.",
    "The researchers share their data with schools so that students can follow the colonies.",
]


def copy_texts(n: int, seed: int = 0) -> list[str]:
    """n texts of 12-20 of SENTENCES each (about 200-400 tokens), in a seeded order."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [" ".join(SENTENCES[j] for j in rng.permutation(len(SENTENCES))[
        :int(rng.integers(12, 21))]) for _ in range(n)]


def workloads(llm: Any, batch: int, seed: int = 0) -> dict[str, list[str]]:
    """The two workloads' chat prompts (`batch` each; another seed, other texts)."""
    tok = llm.get_tokenizer()

    def chat(text: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True)

    rot = seed % len(OPEN_ENDED)
    return {
        "copy": [chat(f"Repeat this text exactly, word for word:\n\n{t}")
                 for t in copy_texts(batch, seed)],
        "open": [chat(OPEN_ENDED[(rot + i) % len(OPEN_ENDED)]) for i in range(batch)],
    }


def _params(n: int, temperature: float, max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, seed=1000 + i, max_tokens=max_tokens)
            for i in range(n)]


def _timed(llm: Any, prompts: Sequence[str], params: list[SamplingParams]
           ) -> tuple[float, int, list[list[int]], dict[str, Any]]:
    engine = llm.llm_engine
    engine.reset_prefix_cache()  # each run computes its prompts (no hit from the last run)
    proposer = engine.core.proposer
    if proposer is not None:
        proposer.reset_cache()  # no response of an earlier run to propose from
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
    warm = workloads(base, max(batches), seed=1)
    engines = {"base": base, **methods}
    for llm in engines.values():  # untimed, other prompts: compile both workloads' shapes
        for b in sorted(batches):
            for texts in warm.values():
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
