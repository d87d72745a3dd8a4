"""Qwen2: Llama layers with q/k/v projection bias (`ModelSpec.attention_bias`)."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2/Qwen2.5 decoder; ModelSpec.from_hf_config sets attention_bias and no o_proj bias."""
