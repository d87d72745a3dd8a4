"""HF `architectures` name -> jpaged model class."""

from __future__ import annotations

from .gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from .llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(arch: str) -> type:
    """The model class for an HF architecture name; ValueError listing the supported ones."""
    try:
        return MODEL_REGISTRY[arch]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None
