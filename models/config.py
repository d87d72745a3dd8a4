"""ModelSpec: frozen, hashable description of a decoder-only model, parsed from HF config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# HF `architectures` names this package implements. models/registry.py maps each to a class;
# tests/models check that both lists agree.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
# The mixture-of-experts ones (models/moe.py): some or all layers route each token to
# `num_experts_per_tok` of `num_experts` feed-forward experts.
MOE_ARCHITECTURES: tuple[str, ...] = (
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

# Sequence classifiers (HF `*ForSequenceClassification`): the decoder of the causal
# architecture they map to, with a `score` head [num_labels, hidden] on the pooled final
# hidden state in place of the LM head (jpaged/pooling_params.py runs them).
SEQ_CLS_ARCHITECTURES: dict[str, str] = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "Gemma2ForSequenceClassification": "Gemma2ForCausalLM",
    "Gemma3TextForSequenceClassification": "Gemma3ForCausalLM",
    "MixtralForSequenceClassification": "MixtralForCausalLM",
    "Qwen2MoeForSequenceClassification": "Qwen2MoeForCausalLM",
    "Qwen3MoeForSequenceClassification": "Qwen3MoeForCausalLM",
}
# HF's `problem_type`s of a classifier (how its scores become probabilities; none: softmax
# over two or more labels, sigmoid of one).
PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")

# Used when config.json has no `architectures` list (e.g. saved from a bare config class).
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

# HF `layer_types` entries: attention over every earlier token, or over the last
# `sliding_window` tokens (the query's own included).
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
# MLP activations: SwiGLU's silu, Gemma's GeGLU (tanh-approximated gelu).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

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
        f" and the sequence classifiers {', '.join(SEQ_CLS_ARCHITECTURES)}"
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
    hidden_act: str = "silu"  # one of ACTIVATIONS
    # One LAYER_TYPES entry per layer; None = every layer full attention.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None  # tokens a sliding layer sees, its own included
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the logits (Gemma 2)
    query_pre_attn_scalar: float | None = None  # attention scale scalar**-0.5 (Gemma)
    rope_local_base_freq: float | None = None  # RoPE base of sliding layers (Gemma 3)
    # Mixture of experts (MOE_ARCHITECTURES; 0 = a dense model): each sparse layer's router
    # picks num_experts_per_tok of num_experts experts of width moe_intermediate_size per
    # token, their weights renormalized to sum 1 when norm_topk_prob; a shared expert of
    # width shared_expert_intermediate_size (0: none) behind a sigmoid gate (Qwen2-MoE).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    # One bool per layer: True = a sparse (expert) layer, False = the dense MLP of width
    # intermediate_size (Qwen's mlp_only_layers, decoder_sparse_step). None = every layer
    # sparse when num_experts > 0.
    sparse_layers: tuple[bool, ...] | None = None
    # A sequence classifier's label names, one per row of its `score` head (HF id2label in
    # id order); () for a language model. A classifier has no LM head: its spec says
    # tie_word_embeddings (the engine's internal token comes from the embedding table).
    labels: tuple[str, ...] = ()
    problem_type: str | None = None  # one of PROBLEM_TYPES, or None (HF's)

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
        self._check_attention_kinds()
        self._check_experts()
        self._check_classifier()

    def _check_classifier(self) -> None:
        if not isinstance(self.labels, tuple) or not all(isinstance(x, str) for x in self.labels):
            raise ValueError(f"ModelSpec.labels must be a tuple of label names, got "
                             f"{self.labels!r}")
        if self.problem_type is not None and self.problem_type not in PROBLEM_TYPES:
            raise ValueError(f"ModelSpec.problem_type must be one of {', '.join(PROBLEM_TYPES)}"
                             f" or None, got {self.problem_type!r}")
        if self.labels and not self.tie_word_embeddings:
            raise ValueError("ModelSpec: a classifier (labels) has no LM head, so "
                             "tie_word_embeddings must be true")

    @property
    def num_labels(self) -> int:
        """The classifier's outputs (rows of its score head); 0 for a language model."""
        return len(self.labels)

    @property
    def hf_architecture(self) -> str:
        """The HF `architectures` name: the causal one, or its sequence classifier's."""
        if not self.labels:
            return self.architecture
        return next(k for k, v in SEQ_CLS_ARCHITECTURES.items() if v == self.architecture)

    def _check_experts(self) -> None:
        if self.architecture not in MOE_ARCHITECTURES:
            if self.num_experts or self.sparse_layers is not None:
                raise ValueError(f"ModelSpec.num_experts is for {', '.join(MOE_ARCHITECTURES)}"
                                 f", not {self.architecture}")
            return
        if self.num_experts == 0 and self.architecture != "MixtralForCausalLM":
            # Qwen's MoE classes with no experts are dense in every layer, as HF builds them.
            if self.sparse_layers is not None:
                raise ValueError("ModelSpec.sparse_layers needs num_experts >= 1")
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelSpec.{name} must be an int >= 1 for "
                                 f"{self.architecture}, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"ModelSpec.num_experts_per_tok ({self.num_experts_per_tok}) "
                             f"exceeds num_experts ({self.num_experts})")
        shared = self.shared_expert_intermediate_size
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ValueError("ModelSpec.shared_expert_intermediate_size must be an int >= 0, "
                             f"got {shared!r}")
        sparse = self.sparse_layers
        if sparse is not None and (not isinstance(sparse, tuple) or len(sparse) !=
                                   self.num_layers or not all(isinstance(b, bool) for b in sparse)):
            raise ValueError(f"ModelSpec.sparse_layers must be a tuple of num_layers="
                             f"{self.num_layers} bools or None, got {sparse!r}")

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts model (some layers route tokens to experts)."""
        return self.num_experts > 0

    def layer_is_sparse(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` is an expert layer (else a dense MLP)."""
        if not self.is_moe:
            return False
        return True if self.sparse_layers is None else self.sparse_layers[layer_idx]

    def _check_attention_kinds(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"ModelSpec.hidden_act must be one of {', '.join(ACTIVATIONS)}, "
                             f"got {self.hidden_act!r}")
        w = self.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"ModelSpec.sliding_window must be an int >= 1 or None, got {w!r}")
        if self.layer_types is not None:
            if (not isinstance(self.layer_types, tuple)
                    or len(self.layer_types) != self.num_layers):
                raise ValueError(f"ModelSpec.layer_types must be a tuple of num_layers="
                                 f"{self.num_layers} entries, got {self.layer_types!r}")
            bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES}, key=str)
            if bad:
                raise ValueError(f"ModelSpec.layer_types: unknown layer type(s) {bad}; known: "
                                 f"{', '.join(LAYER_TYPES)}")
            if SLIDING_ATTENTION in self.layer_types and w is None:
                raise ValueError("ModelSpec.layer_types has sliding_attention layers but "
                                 "sliding_window is None")
        for name in ("attn_logit_softcapping", "final_logit_softcapping",
                     "query_pre_attn_scalar", "rope_local_base_freq"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelSpec.{name} must be > 0 or None, got {value!r}")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window in tokens (None: full attention)."""
        types = self.layer_types or (FULL_ATTENTION,) * self.num_layers
        return tuple(self.sliding_window if t == SLIDING_ATTENTION else None for t in types)

    @property
    def uniform_layers(self) -> bool:
        """True when every layer attends the same way (one window, one RoPE base)."""
        return len(set(self.layer_windows)) == 1

    def window_of(self, layer_idx: Any) -> int | None:
        """Layer `layer_idx`'s window; a traced index (scanned layers) needs uniform layers."""
        if isinstance(layer_idx, int):
            return self.layer_windows[layer_idx]
        if not self.uniform_layers:
            raise ValueError("a traced layer index needs layers that all attend the same way")
        return self.layer_windows[0]

    @property
    def is_gemma(self) -> bool:
        """Gemma's block: (1 + w) RMSNorms around attention and MLP, embeddings * sqrt(hidden)."""
        return self.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")

    @property
    def attn_scale(self) -> float:
        """The factor on q.k: query_pre_attn_scalar**-0.5 (Gemma), else head_dim**-0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
        labels, problem = _classifier(cfg) if _is_classifier(cfg) else ((), None)
        # A quantization_config says how the weights are stored, not the architecture: the
        # loader reads it (models/hf_quant.py).
        gemma = arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or (
            "gelu_pytorch_tanh" if gemma else "silu")
        if act != ("gelu_pytorch_tanh" if gemma else "silu"):
            want = "'gelu_pytorch_tanh'" if gemma else "'silu'"
            raise ValueError(f"hidden_act must be {want} for {arch}, got {act!r}")
        hidden = _get_int(cfg, "hidden_size")
        heads = _get_int(cfg, "num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        max_pos = _get_int(cfg, "max_position_embeddings")
        num_layers = _get_int(cfg, "num_hidden_layers")
        layer_types, window = _layer_types(cfg, arch, num_layers, max_pos)
        rope_theta, rope_scaling = _parse_rope(cfg)

        attention_bias = bool(cfg.get("attention_bias", False))
        o_proj_bias = attention_bias
        if arch == "Qwen2ForCausalLM":  # Qwen2 always has q/k/v bias and never o_proj bias
            attention_bias, o_proj_bias = True, False
        if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
            attention_bias = o_proj_bias = False
        if arch == "Qwen2MoeForCausalLM":  # q/k/v bias unless qkv_bias says not (v5 field)
            attention_bias, o_proj_bias = bool(cfg.get("qkv_bias", True)), False

        eos = cfg.get("eos_token_id")
        eos_list = [] if eos is None else eos if isinstance(eos, list | tuple) else [eos]
        eos_ids = tuple(int(e) for e in eos_list)
        bos = cfg.get("bos_token_id")
        return cls(
            architecture=arch,
            vocab_size=_get_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_get_int(cfg, "intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(labels) or bool(cfg.get("tie_word_embeddings", gemma)),
            attention_bias=attention_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
            max_position_embeddings=max_pos,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            o_proj_bias=o_proj_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
            hidden_act=act,
            layer_types=layer_types,
            sliding_window=window,
            **(_gemma_fields(cfg, arch) if gemma else {}),
            **(_moe_fields(cfg, arch, num_layers) if arch in MOE_ARCHITECTURES else {}),
            labels=labels,
            problem_type=problem,
        )


def _is_classifier(cfg: dict[str, Any]) -> bool:
    archs = cfg.get("architectures") or []
    return isinstance(archs, list) and bool(archs) and archs[0] in SEQ_CLS_ARCHITECTURES


# vLLM's online conversion of a causal model into a sequence classifier (hf_overrides'
# `classifier_from_token` and `method`): the score head made of the LM head's rows of the
# named tokens. "from_2_way_softmax" (two tokens a, b: one label, row b - row a, so the
# sigmoid of its logit is the softmax probability of b against a: Qwen3-Reranker, mxbai-rerank);
# "no_post_processing" (one label per token, its row as it is: bge-reranker-v2-gemma).
SEQ_CLS_METHODS = ("from_2_way_softmax", "no_post_processing")


def classifier_from_tokens(cfg: dict[str, Any]) -> tuple[str, tuple[str, ...]] | None:
    """(method, tokens) of a config asking for a score head made of LM-head rows
    (`classifier_from_token`; `method`, or `is_original_qwen3_reranker`'s 2-way softmax),
    or None; ValueError naming the field when it is not one jpaged can build."""
    tokens = cfg.get("classifier_from_token")
    if tokens is None:
        return None
    if (not isinstance(tokens, list) or not tokens
            or not all(isinstance(t, str) and t for t in tokens)):
        raise ValueError(f"config field 'classifier_from_token' must be a non-empty list of "
                         f"token strings, got {tokens!r}")
    method = cfg.get("method") or (
        "from_2_way_softmax" if cfg.get("is_original_qwen3_reranker") else None)
    if method not in SEQ_CLS_METHODS:
        raise ValueError(f"config field 'method' must be one of {', '.join(SEQ_CLS_METHODS)} "
                         f"with classifier_from_token (or is_original_qwen3_reranker: true), "
                         f"got {method!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"config field 'classifier_from_token' must name two tokens for "
                         f"method from_2_way_softmax, got {tokens!r}")
    return method, tuple(tokens)


def _classifier(cfg: dict[str, Any]) -> tuple[tuple[str, ...], str | None]:
    """A classifier config's label names in id order (a score head made of LM-head rows: its
    tokens; else id2label, else num_labels' LABEL_i, else HF's default of two) and
    problem_type."""
    recipe = classifier_from_tokens(cfg)
    id2label = cfg.get("id2label")
    if recipe is not None:
        method, tokens = recipe
        return (tokens[1:] if method == "from_2_way_softmax" else tokens), None
    if id2label is not None:
        if not isinstance(id2label, dict) or not id2label:
            raise ValueError(f"config field 'id2label' must be a non-empty object, got "
                             f"{id2label!r}")
        try:
            ids = sorted(int(k) for k in id2label)
        except (TypeError, ValueError):
            raise ValueError(f"config field 'id2label' must have integer ids as keys, got "
                             f"{sorted(id2label)!r}") from None
        if ids != list(range(len(ids))):
            raise ValueError(f"config field 'id2label' must number its labels 0..n-1, got "
                             f"ids {ids}")
        labels = tuple(str(id2label.get(str(i), id2label.get(i))) for i in ids)  # type: ignore
    else:
        n = cfg.get("num_labels", 2)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"config field 'num_labels' must be an int >= 1, got {n!r}")
        labels = tuple(f"LABEL_{i}" for i in range(n))
    n = cfg.get("num_labels")
    if n is not None and n != len(labels):
        raise ValueError(f"config field 'num_labels' is {n!r} but id2label names "
                         f"{len(labels)} labels")
    problem = cfg.get("problem_type")
    if problem is not None and problem not in PROBLEM_TYPES:
        raise ValueError(f"config field 'problem_type' must be one of "
                         f"{', '.join(PROBLEM_TYPES)} or null, got {problem!r}")
    return labels, problem


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config field 'architectures' must be a list of names, got {archs!r}")
    if archs:
        arch = SEQ_CLS_ARCHITECTURES.get(archs[0], archs[0])
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


# HF's defaults where a Gemma config.json leaves a field out (transformers' config classes).
_GEMMA_DEFAULTS = {
    "Gemma2ForCausalLM": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              sliding_window=4096, pattern=2),
    "Gemma3ForCausalLM": dict(attn_logit_softcapping=None, final_logit_softcapping=None,
                              sliding_window=4096, pattern=6),
}


def periodic_layer_types(num_layers: int, pattern: Any) -> tuple[str, ...]:
    """Gemma's `sliding_window_pattern` as HF and llama.cpp read it: with a period n, layer i
    attends in full iff (i + 1) % n == 0 and slides otherwise."""
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise ValueError(f"'sliding_window_pattern' must be an int >= 1, got {pattern!r}")
    return tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
                 for i in range(num_layers))


def _layer_types(cfg: dict[str, Any], arch: str, num_layers: int,
                 max_pos: int) -> tuple[tuple[str, ...] | None, int | None]:
    """(layer_types, sliding_window) as HF's config classes derive them; None when every layer
    attends in full (a window as long as the context is full attention)."""
    defaults = _GEMMA_DEFAULTS.get(arch, {})
    window = cfg.get("sliding_window", defaults.get("sliding_window"))
    if arch in _QWEN and not cfg.get("use_sliding_window"):
        window = None
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list | tuple) or len(types) != num_layers:
            raise ValueError(f"config field 'layer_types' must list num_hidden_layers="
                             f"{num_layers} entries, got {types!r}")
        bad = sorted({str(t) for t in types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"config field 'layer_types' has unknown layer type(s) {bad}; "
                             f"known: {', '.join(LAYER_TYPES)}")
        types = tuple(types)
    elif window is None:
        return None, None
    elif arch in ("MistralForCausalLM", "MixtralForCausalLM"):  # one window on every layer
        types = (SLIDING_ATTENTION,) * num_layers
    elif arch in _QWEN:  # layers from max_window_layers on
        first = cfg.get("max_window_layers", 28)
        types = tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION
                      for i in range(num_layers))
    elif defaults:  # Gemma: every pattern-th layer is global
        types = periodic_layer_types(num_layers,
                                     cfg.get("sliding_window_pattern", defaults["pattern"]))
    else:
        raise ValueError(f"{arch}: sliding_window={window} without layer_types is not "
                         "supported for this architecture")
    if SLIDING_ATTENTION not in types:
        return None, None
    if window is None or not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"config field 'sliding_window' must be an int >= 1 for "
                         f"sliding_attention layers, got {window!r}")
    if window >= max_pos:  # it never binds: full attention, the same result
        return None, None
    return types, window


def _moe_fields(cfg: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """The expert fields of a mixture-of-experts config, as HF's config classes read them:
    Mixtral's experts are intermediate_size wide on every layer, always renormalized; Qwen's
    are moe_intermediate_size wide on the layers decoder_sparse_step and mlp_only_layers
    leave sparse."""
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts (Mixtral's name).
    count = "num_experts" if "num_experts" in cfg or "num_local_experts" not in cfg \
        else "num_local_experts"
    if arch != "MixtralForCausalLM" and cfg.get(count) == 0:
        return {}  # no experts: every layer the dense MLP, as HF builds it
    if arch == "MixtralForCausalLM":
        return {"num_experts": _get_int(cfg, "num_local_experts"),
                "num_experts_per_tok": _get_int(cfg, "num_experts_per_tok"),
                "moe_intermediate_size": _get_int(cfg, "intermediate_size"),
                "norm_topk_prob": True}
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"config field 'decoder_sparse_step' must be an int >= 1, got {step!r}")
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers
            for i in dense):
        raise ValueError(f"config field 'mlp_only_layers' must list layer indices in "
                         f"[0, {num_layers}), got {dense!r}")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = _get_int(cfg, "shared_expert_intermediate_size")
    norm = cfg.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ValueError(f"config field 'norm_topk_prob' must be true or false, got {norm!r}")
    return {"num_experts": _get_int(cfg, count),
            "num_experts_per_tok": _get_int(cfg, "num_experts_per_tok"),
            "moe_intermediate_size": _get_int(cfg, "moe_intermediate_size"),
            "norm_topk_prob": norm, "shared_expert_intermediate_size": shared,
            "sparse_layers": None if all(sparse) else sparse}


_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def _gemma_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Gemma's soft caps, attention scale and local RoPE base from an HF config."""
    defaults = _GEMMA_DEFAULTS[arch]
    out: dict[str, Any] = {
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping",
                                          defaults["attn_logit_softcapping"]),
        "final_logit_softcapping": cfg.get("final_logit_softcapping",
                                           defaults["final_logit_softcapping"]),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
    }
    if arch == "Gemma3ForCausalLM":
        params = cfg.get("rope_parameters") or {}
        local = params.get(SLIDING_ATTENTION) if isinstance(params, dict) else None
        theta = (local or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
        out["rope_local_base_freq"] = float(theta)
    return out


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
