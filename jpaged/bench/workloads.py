"""Seeded workloads for the benchmarks, and the theory they are checked against."""

from __future__ import annotations

from collections.abc import Sequence

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
