"""Qwen3: Llama layers with per-head RMSNorm on q and k before RoPE (`ModelSpec.qk_norm`)."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense decoder; ModelSpec.from_hf_config sets qk_norm."""
