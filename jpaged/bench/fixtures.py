"""What the engine benchmarks run on when no checkpoint can be read: a tiny Llama shape, random
weights of any shape, and a byte-level tokenizer. Shared by the device check's engine half
(``gpu_engine.py``) and the host benchmarks (``host.py``), which import it, not each other."""

from __future__ import annotations

from typing import Any

from flax import nnx

from models.build import LoadedModel
from models.config import ModelSpec
from models.registry import get_model_class
from models.tokenizer import Tokenizer, byte_level_backend

__all__ = ["TINY_CONFIG", "byte_tokenizer", "random_model"]

# A Llama-shaped model small enough for the Pallas interpreter (GQA 4, head_dim 16).
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 1024, "tie_word_embeddings": False, "bos_token_id": 256,
    "eos_token_id": 257,
}


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer (256 bytes + <s>, </s>; no merges)."""
    return Tokenizer(byte_level_backend(), bos_token="<s>", eos_token="</s>")


def random_model(spec: ModelSpec, dtype: Any, seed: int = 0) -> LoadedModel:
    """The architecture of `spec` with random weights on the default device (jitted init)."""
    cls = get_model_class(spec.architecture)

    @nnx.jit
    def init() -> nnx.Module:
        return cls(spec, dtype=dtype, rngs=nnx.Rngs(seed))

    return LoadedModel(spec, init(), byte_tokenizer(), f"random:{spec.architecture}")
