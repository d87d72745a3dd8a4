"""Seeded workloads for the benchmarks, and the theory they are checked against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jpaged.sampling_params import RequestOutputKind, SamplingParams
from models.tokenizer import Tokenizer

_TOPICS = ("paging", "caching", "scheduling", "batching", "preemption", "offloading",
           "quantization", "attention", "tokenization", "sampling", "kernels", "memory")
QUESTIONS = tuple(f"In one sentence, how does the assistant's manual describe {t}{s}?"
                  for s in ("", " in practice", " for long prompts") for t in _TOPICS)


def system_prompt(tokenizer: Tokenizer, target_tokens: int) -> str:
    """A deterministic system prompt of about `target_tokens` tokens."""
    parts = []
    i = 0
    while True:
        parts.append(f"Rule {i}: the engine keeps {_TOPICS[i % len(_TOPICS)]} simple, measured "
                     f"and documented, and it never loses a request ({i * 7 % 13}). ")
        text = "You are the jpaged manual assistant. " + "".join(parts)
        if len(tokenizer.encode(text)) >= target_tokens:
            return text
        i += 1


def shared_prefix_prompts(tokenizer: Tokenizer, prefix_tokens: int, num_questions: int
                          ) -> list[list[int]]:
    """Chat prompts sharing one system prompt, each with a different question."""
    system = system_prompt(tokenizer, prefix_tokens)
    out = []
    for i in range(num_questions):
        q = QUESTIONS[i % len(QUESTIONS)] + (f" (variant {i // len(QUESTIONS)})"
                                             if i >= len(QUESTIONS) else "")
        text = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": q}])
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def theoretical_prefix_hits(prompts: Sequence[Sequence[int]], block_size: int) -> int:
    """Tokens a perfect block-granular prefix cache serves when prompts run in order.

    Request i reuses the full blocks it shares with the longest common prefix of any earlier
    request, never its whole prompt (the last token is always recomputed).
    """
    hits = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            for a, b in zip(p, q, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        usable = min(best, len(p) - 1)
        hits += (usable // block_size) * block_size
    return hits


def mixed_length_requests(vocab_size: int, num_requests: int, seed: int,
                          prompt_range: tuple[int, int] = (32, 512),
                          output_range: tuple[int, int] = (32, 512)
                          ) -> list[tuple[list[int], int]]:
    """Seeded (prompt token ids, output length) pairs, both lengths uniform in their ranges."""
    import numpy as np

    for name, (lo, hi) in (("prompt_range", prompt_range), ("output_range", output_range)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must satisfy 1 <= lo <= hi, got {(lo, hi)}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    plens = rng.integers(prompt_range[0], prompt_range[1] + 1, num_requests)
    olens = rng.integers(output_range[0], output_range[1] + 1, num_requests)
    # Ids from the upper half of the vocabulary: no special tokens (they sit at the start).
    return [(rng.integers(vocab_size // 2, vocab_size, int(p)).tolist(), int(o))
            for p, o in zip(plens, olens, strict=True)]


def add_greedy(engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int, tag: str) -> None:
    """Queue every prompt on `engine` as `{tag}-{i}`: greedy, `max_tokens` each, final output
    only."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": list(p)}, params)
