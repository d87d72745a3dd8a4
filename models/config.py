"""ModelSpec: frozen, hashable description of a decoder-only model, parsed from HF config.json."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

# HF `architectures` names this package implements. models/registry.py maps each to a class;
# tests/models check that both lists agree.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# Used when config.json has no `architectures` list (e.g. saved from a bare config class).
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Keys each supported rope_type needs inside `rope_scaling`.
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    # llama.cpp's per-frequency divisors (GGUF `rope_freqs.weight`), one per rotary pair.
    "freq_factors": ("factors",),
}


def _unsupported_arch(arch: Any) -> ValueError:
    return ValueError(
        f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


@dataclass(frozen=True)
class ModelSpec:
    """Static shape and hyper-parameters of a supported decoder-only transformer."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Sorted (key, value) pairs including ("rope_type", name); None = plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    o_proj_bias: bool = False  # bias on the attention output projection (Llama attention_bias)
    mlp_bias: bool = False  # bias on gate/up/down projections (Llama mlp_bias)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise _unsupported_arch(self.architecture)
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers",
            "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelSpec.{name} must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelSpec.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelSpec.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelSpec.rope_theta must be > 0, got {self.rope_theta!r}")
        if not isinstance(self.eos_token_ids, tuple):
            raise ValueError("ModelSpec.eos_token_ids must be a tuple of ints")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, tuple):
                raise ValueError("ModelSpec.rope_scaling must be a tuple of (key, value) pairs")
            _check_rope_scaling(self.rope_scaling, self.head_dim)

    @property
    def rope_type(self) -> str:
        """'default' or the rope_scaling type ('linear', 'llama3', 'freq_factors')."""
        return "default" if self.rope_scaling is None else dict(self.rope_scaling)["rope_type"]

    def kv_bytes_per_token(self, dtype_bytes: int | float) -> int | float:
        """Bytes of K and V cache one token takes across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def replace(self, **changes: Any) -> ModelSpec:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelSpec:
        """Parse and validate an HF transformers config.json dict."""
        arch = _architecture(cfg)
        if cfg.get("quantization_config"):
            method = cfg["quantization_config"].get("quant_method", "?")
            raise ValueError(f"quantized HF checkpoints ({method}) are not supported; use GGUF")
        act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if act != "silu":
            raise ValueError(f"hidden_act must be 'silu' for {arch}, got {act!r}")
        hidden = _get_int(cfg, "hidden_size")
        heads = _get_int(cfg, "num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        max_pos = _get_int(cfg, "max_position_embeddings")
        _check_sliding_window(cfg, arch, max_pos)
        rope_theta, rope_scaling = _parse_rope(cfg)

        attention_bias = bool(cfg.get("attention_bias", False))
        o_proj_bias = attention_bias
        if arch == "Qwen2ForCausalLM":  # Qwen2 always has q/k/v bias and never o_proj bias
            attention_bias, o_proj_bias = True, False
        if arch == "MistralForCausalLM":
            attention_bias = o_proj_bias = False

        eos = cfg.get("eos_token_id")
        eos_list = [] if eos is None else eos if isinstance(eos, list | tuple) else [eos]
        eos_ids = tuple(int(e) for e in eos_list)
        bos = cfg.get("bos_token_id")
        return cls(
            architecture=arch,
            vocab_size=_get_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_get_int(cfg, "intermediate_size"),
            num_layers=_get_int(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            max_position_embeddings=max_pos,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            o_proj_bias=o_proj_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
        )


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config field 'architectures' must be a list of names, got {archs!r}")
    if archs:
        arch = archs[0]
    elif cfg.get("model_type") in _MODEL_TYPE_TO_ARCH:
        arch = _MODEL_TYPE_TO_ARCH[cfg["model_type"]]
    else:
        arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise _unsupported_arch(arch)
    return arch


def _get_int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config field {key!r} must be an int >= 1, got {value!r}")
    return value


def _check_sliding_window(cfg: dict[str, Any], arch: str, max_pos: int) -> None:
    """Reject configs whose attention is windowed within the usable context; we only do full."""
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types") or ()
    in_use = window is not None and cfg.get("use_sliding_window", True)
    if layer_types and "sliding_attention" not in layer_types:
        in_use = False
    if not in_use:
        return
    if window >= max_pos:  # a window as long as the context is full causal attention
        warnings.warn(
            f"{arch}: sliding_window={window} >= max_position_embeddings={max_pos}; "
            "using full causal attention",
            stacklevel=3,
        )
        return
    raise ValueError(
        f"{arch}: sliding_window={window} < max_position_embeddings={max_pos} is not supported "
        "(jpaged implements full causal attention only); set sliding_window to null in config.json "
        "if the model does not need it"
    )


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, rope_scaling) from either transformers-5 `rope_parameters` or v4 keys."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # keyed by layer type
        params = params.get("full_attention", next(iter(params.values())))
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: default, {', '.join(ROPE_TYPES)}"
        )
    missing = [k for k in ROPE_TYPES[rope_type] if k not in params]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {missing}")
    items = {k: params[k] for k in ROPE_TYPES[rope_type]}
    items["rope_type"] = rope_type
    return theta, tuple(sorted(items.items()))


def _check_rope_scaling(scaling: tuple[tuple[str, Any], ...], head_dim: int) -> None:
    params = dict(scaling)
    rope_type = params.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"ModelSpec.rope_scaling: unsupported rope_type {rope_type!r}")
    missing = [k for k in ROPE_TYPES[rope_type] if k not in params]
    if missing:
        raise ValueError(f"ModelSpec.rope_scaling ({rope_type}) lacks {missing}")
    if rope_type == "freq_factors" and len(params["factors"]) != head_dim // 2:
        raise ValueError(
            f"ModelSpec.rope_scaling factors must have head_dim/2={head_dim // 2} entries, "
            f"got {len(params['factors'])}"
        )
