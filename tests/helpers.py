"""Shared test helpers: the embedded model loaded once, an HF twin of it, engine factories."""

from __future__ import annotations

import functools
from pathlib import Path

from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.llm import LLM
from models.loader import LoadedModel, load_model
from models.weights import export_weights


@functools.lru_cache(maxsize=1)
def embedded() -> LoadedModel:
    """The embedded SmolLM2 in float32, loaded once per test session."""
    return load_model(None, dtype="float32")


@functools.lru_cache(maxsize=1)
def tiny_model_dir() -> Path:
    """A 2-layer random Llama HF directory (byte tokenizer) in a temp dir, made once."""
    import tempfile

    from tiny_models import random_weights, tiny_spec, write_hf_dir

    spec = tiny_spec(max_position_embeddings=512)
    path = Path(tempfile.mkdtemp(prefix="jpaged-tiny-")) / "tiny-llama"
    return write_hf_dir(path, spec, random_weights(spec, seed=0))


@functools.lru_cache(maxsize=1)
def tiny() -> LoadedModel:
    """The tiny random Llama, loaded once."""
    return load_model(str(tiny_model_dir()), dtype="float32")


def make_llm(loaded: LoadedModel | None = None, **engine_args) -> LLM:
    """An LLM over an already loaded model (skips re-reading the weights)."""
    engine = LLMEngine(EngineArgs(**engine_args), loaded=loaded or embedded())
    return LLM.from_engine(engine)


def hf_llama_twin(loaded: LoadedModel, tmp: Path):
    """An HF transformers LlamaForCausalLM (torch, float32) holding the same weights."""
    import torch
    import transformers
    from safetensors.numpy import save_file

    spec = loaded.spec
    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, rms_norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, bos_token_id=spec.bos_token_id,
        eos_token_id=list(spec.eos_token_ids), architectures=["LlamaForCausalLM"])
    config.save_pretrained(tmp)
    weights = export_weights(loaded.model)
    if spec.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    save_file(weights, str(tmp / "model.safetensors"))
    return transformers.LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: tuple[int, ...]
              ) -> list[int]:
    """HF generate(do_sample=False) for one prompt; stops at EOS like the engine."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(
            1, len(prompt_ids), dtype=torch.long), max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=list(eos), pad_token_id=eos[0])
    return out[0, len(prompt_ids):].tolist()
