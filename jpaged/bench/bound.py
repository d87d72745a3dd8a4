"""A lower bound on the time any engine needs for a workload on this machine.

The bound counts only work no engine can skip: every prompt token goes through every layer's
matmuls once (plus causal attention over its own prefix), and every decode step reads every
layer weight once from memory and runs its batch through the matmuls. It divides that work by
rates measured on this machine with XLA (a large float32 matmul, a streaming read), so it says
how fast jpaged could be with zero overhead, no padding and no attention waste; comparing it
with a baseline's measured speed says which ratios are reachable at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jpaged.bench.timing import median_call_s
from jpaged.estimate import param_counts


def machine_rates(hidden: int = 576, inter: int = 1536, tokens: int = 1024,
                  stream_bytes: int = 512 * 2**20) -> dict[str, float]:
    """float32 matmul FLOP/s ([tokens, hidden] x [hidden, inter]) and read bandwidth (B/s)."""
    a = jnp.ones((tokens, hidden), jnp.float32)
    b = jnp.ones((hidden, inter), jnp.float32)
    mm = median_call_s(jax.jit(lambda x, y: x @ y), a, b)
    x = jnp.ones((stream_bytes // 4,), jnp.float32)
    rd = median_call_s(jax.jit(jnp.sum), x)
    return {"matmul_flops_per_s": 2 * tokens * hidden * inter / mm,
            "read_bytes_per_s": stream_bytes / rd}


def workload_bound(spec: Any, prompt_lens: Sequence[int], output_len: int,
                   rates: dict[str, float], bytes_per_param: int = 4) -> dict[str, float]:
    """Seconds and tokens/s of the bound for these prompts, all decoded together."""
    total, _ = param_counts(spec)
    embed = spec.vocab_size * spec.hidden_size
    layer_params = total - embed * (1 if spec.tie_word_embeddings else 2)
    attn = 2 * 2 * spec.num_layers * spec.num_heads * spec.head_dim  # QK and PV, per key
    flops = rates["matmul_flops_per_s"]
    # Prefill: matmuls per token, causal attention ~ L^2 / 2 keys, one logits row per prompt.
    prefill_flops = sum(2 * layer_params * n + attn * n * n / 2 + 2 * embed for n in prompt_lens)
    t = prefill_flops / flops
    b = len(prompt_lens)
    weight_bytes = (layer_params + embed) * bytes_per_param
    for step in range(1, output_len):  # the first token came with the prefill
        step_flops = b * (2 * layer_params + 2 * embed) + attn * sum(
            n + step for n in prompt_lens)
        t += max(step_flops / flops, weight_bytes / rates["read_bytes_per_s"])
    return {"bound_s": t, "bound_tokens_per_s": b * output_len / t}
