"""jpaged: a JAX/XLA inference engine with a vLLM-style paged KV cache.

Imports are lazy so that `jpaged.core` (plain Python) can be used without loading jax.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jpaged.llm",
    "LLMEngine": "jpaged.engine",
    "AsyncLLMEngine": "jpaged.async_engine",
    "EngineArgs": "jpaged.config",
    "SamplingParams": "jpaged.sampling_params",
    "LoRARequest": "jpaged.lora_request",
    "RequestOutputKind": "jpaged.sampling_params",
    "StructuredOutputsParams": "jpaged.sampling_params",
    "GuidedDecodingParams": "jpaged.sampling_params",
    "BeamSearchParams": "jpaged.sampling_params",
    "BeamSearchOutput": "jpaged.beam_search",
    "BeamSearchSequence": "jpaged.beam_search",
    "RequestOutput": "jpaged.outputs",
    "CompletionOutput": "jpaged.outputs",
    "PoolingParams": "jpaged.pooling_params",
    "PoolingRequestOutput": "jpaged.outputs",
    "EmbeddingRequestOutput": "jpaged.outputs",
    "ClassificationRequestOutput": "jpaged.outputs",
    "ScoringRequestOutput": "jpaged.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jpaged' has no attribute {name!r}")
