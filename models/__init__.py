"""Decoder-only LLMs as Flax NNX modules, checkpoint loading (safetensors, GGUF) and tokenizers."""

from .attention import AttnFn, dense_causal_attention
from .config import ModelSpec
from .loader import DEFAULT_MODEL, LoadedModel, embedded_gguf_path, load_model
from .registry import MODEL_REGISTRY, get_model_class
from .tokenizer import Tokenizer

__all__ = [
    "AttnFn",
    "DEFAULT_MODEL",
    "LoadedModel",
    "MODEL_REGISTRY",
    "ModelSpec",
    "Tokenizer",
    "dense_causal_attention",
    "embedded_gguf_path",
    "get_model_class",
    "load_model",
]
