"""Real PEFT LoRA adapters for the tests and their HF transformers + peft references (torch CPU).

`write_peft_adapter` saves an adapter with `peft` itself: adapter_config.json and
adapter_model.safetensors, whose keys name no adapter
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), lora_A [r, in_features],
lora_B [out_features, r]. peft applies W + (lora_alpha / r) * B @ A, or lora_alpha / sqrt(r)
with use_rslora. The LoRA weights are random (init_lora_weights=False, then re-drawn from a
seeded generator) and sized so that the adapter changes greedy continuations without blowing
up the logits.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# RMS of B A x per unit RMS of x at scale=1.0 (before peft's alpha / r). At r=8, alpha=16 on
# every linear: 0.1 leaves SmolLM2-135M's first ~10 greedy tokens as they were, 0.25 changes
# its first token yet keeps its text fluent (logits' max ~30 as without the adapter), 1.0 makes
# it babble. The 2-layer random tiny model changes from the first token at any of these.
LORA_B_STD = 0.25


def write_peft_adapter(hf_model: Any, path: Path, *, r: int = 8, alpha: float = 16,
                       targets: Sequence[str] = ALL_LINEARS, seed: int = 0,
                       use_rslora: bool = False, scale: float = 1.0,
                       layers_to_transform: list[int] | None = None) -> Path:
    """Save a seeded random peft LoRA adapter for a copy of `hf_model` into `path`; returns path."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        bias="none", use_rslora=use_rslora, init_lora_weights=False,
                        layers_to_transform=layers_to_transform)
    model = get_peft_model(copy.deepcopy(hf_model), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            # lora_A ~ N(0, 1 / in): A x keeps x's RMS. lora_B ~ N(0, (LORA_B_STD * scale)^2 / r):
            # B A x has RMS ~ LORA_B_STD * scale * RMS(x), before peft's alpha / r factor.
            if ".lora_A." in name:
                std = 1.0 / param.shape[1] ** 0.5
            elif ".lora_B." in name:
                std = LORA_B_STD * scale / param.shape[1] ** 0.5
            else:
                continue
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


def peft_model(hf_model: Any, path: Path) -> Any:
    """A peft PeftModel (eval mode) of a copy of `hf_model` with the adapter saved at `path`."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(hf_model), Path(path)).eval()


def peft_logits(model: Any, ids: list[int]) -> np.ndarray:
    """Logits of every position of `ids` (HF or peft model), float32 [len(ids), vocab]."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]),
                       attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits
    return logits[0].float().numpy()
