"""GGUF (llama.cpp) checkpoints -> ModelSpec, dequantized float32 tensors in HF naming, metadata.

GGUF stores tensor dims fastest-first; numpy (C-order) arrays of the bytes have the reverse
shape, which equals HF's [out, in] layout. llama.cpp's converter permutes the rows of q/k
weights for llama-arch models so its RoPE can rotate interleaved pairs; `unpermute_qk` undoes
that exactly to get back HF's half-split layout.

Gemma 3 (general.architecture "gemma3") differs in two conventions, both from llama.cpp's
convert_hf_to_gguf.py (class Gemma3Model): its q/k rows are not permuted (Gemma3Model derives
from TextModel, not LlamaModel, and llama.cpp runs gemma3 with NeoX-style RoPE, i.e. HF's
rotate_half), and every tensor whose HF name ends in "norm.weight" is stored plus 1
(`norm_shift`: HF's Gemma3RMSNorm computes x * (1 + w), llama.cpp's RMS norm x * w). The loader
subtracts that 1 again, so the tensors equal the HF Gemma3ForCausalLM state dict.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .config import ModelSpec, periodic_layer_types
from .gguf_meta import TensorInfo, read_gguf
from .gguf_quant import FLOAT_TYPES, LAYOUTS, Decoded, decode, supported_types, to_weight
from .quant import QuantWeight
from .quant_layers import QuantLayout
from .tensors import LazyTensors, TensorDict

# general.architecture -> HF architecture name. Mistral GGUFs say "llama".
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# A llama GGUF with experts (`llama.expert_count`) is Mixtral.
_MOE_ARCHITECTURES = {"llama": "MixtralForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM"}
# llama.cpp's mixture-of-experts tensors of a sparse layer: the experts stacked [E, out, in]
# (HF: one [out, in] tensor each; jpaged: one [E, in, out] Param, models/moe.py), the router,
# and Qwen2-MoE's shared expert and its gate (a vector in the GGUF, [1, hidden] in HF).
_STACKED_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                    "ffn_down_exps": "down_proj"}
_MOE_LAYER_NAMES = {"ffn_gate_inp": "gate", "ffn_gate_shexp": "shared_expert.gate_proj",
                    "ffn_up_shexp": "shared_expert.up_proj",
                    "ffn_down_shexp": "shared_expert.down_proj",
                    "ffn_gate_inp_shexp": "shared_expert_gate"}
# Architectures whose q/k rows llama.cpp's converter permutes (non-NeoX RoPE).
_PERMUTED_ARCHS = {"llama"}
# Architectures whose converter stores RMSNorm weights plus 1 (HF's norm is x * (1 + w)).
_NORM_SHIFTED_ARCHS = {"gemma3"}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's four norms a layer (gguf's tensor map for MODEL_ARCH.GEMMA3): "ffn_norm" is the norm
# before the MLP there, not the llama-style post-attention norm.
_LAYER_NAMES_BY_ARCH = {
    "gemma3": {
        **_LAYER_NAMES,
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (HF half-split -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Exact inverse of `permute_qk`: rows (head, pair, 2) -> (head, 2, pair)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """HF parameter name for a GGUF tensor name of `arch`, or None for tensors we do not load."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        moe = "block_sparse_moe" if arch == "llama" else "mlp"  # Mixtral's name, Qwen's
        if part in _STACKED_EXPERTS and suffix == "weight":  # the stacked Param's own name
            return f"model.layers.{idx}.{moe}.experts.{_STACKED_EXPERTS[part]}"
        if part in _MOE_LAYER_NAMES:
            return f"model.layers.{idx}.{moe}.{_MOE_LAYER_NAMES[part]}.{suffix}"
        mapped = _LAYER_NAMES_BY_ARCH.get(arch, _LAYER_NAMES).get(part)
        return None if mapped is None else f"model.layers.{idx}.{mapped}.{suffix}"
    mapped = _GLOBAL_NAMES.get(base)
    return None if mapped is None else f"{mapped}.{suffix}"


def _require(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise ValueError(f"GGUF file {path} lacks metadata key {key!r}")
    return meta[key]


def _count(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    """A positive int metadata value (KeyError-free: ValueError naming the key)."""
    value = meta.get(key, default)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    if isinstance(value, list):
        raise ValueError(f"GGUF metadata {key!r} is per-layer ({value!r}); not supported")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GGUF metadata {key!r} must be an int >= 1, got {value!r}")
    return value


# Gemma 3's local (sliding-window) layers: HF Gemma3TextConfig's defaults, which llama.cpp also
# hard-codes for gemma3 (set_swa_pattern(6), rope_freq_base_train_swa = 10000) rather than
# storing them in the GGUF.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0


def gemma3_layer_types(num_layers: int, pattern: int | list[bool] | None = None,
                       sliding: bool = True) -> list[str]:
    """HF `layer_types` of a Gemma 3 model: with a period n, layer i attends in full iff
    (i + 1) % n == 0; a list of bools says per layer whether it uses the sliding window."""
    if not sliding:
        return ["full_attention"] * num_layers
    if pattern is None:
        pattern = GEMMA3_SLIDING_WINDOW_PATTERN
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"sliding_window_pattern lists {len(pattern)} layers, not "
                             f"{num_layers}")
        return ["sliding_attention" if swa else "full_attention" for swa in pattern]
    return list(periodic_layer_types(num_layers, pattern))


def hf_config_from_gguf(metadata: dict[str, Any],
                        tensor_names: set[str] | None = None) -> dict[str, Any]:
    """An HF Gemma3TextConfig-style config dict from a gemma3 GGUF's metadata.

    What the GGUF does not store gets HF's Gemma 3 default: the local RoPE base 10000, the
    every-sixth-layer global pattern, query_pre_attn_scalar = head_dim. For the public Gemma 3
    270M GGUF this gives what google/gemma-3-270m's config.json says (checked against a copy of
    it, transformers 4.55.0.dev0, in safety-research/circuit-tracer's
    tests/test_attributions_gemma3_nnsight.py): 18 layers, hidden 640, intermediate 2048, 4
    query heads, 1 KV head, head_dim 256, query_pre_attn_scalar 256, rms_norm_eps 1e-6,
    rope_theta 1e6, rope_local_base_freq 1e4, sliding_window 512, layers 5, 11 and 17 full
    attention and the rest sliding, max_position_embeddings 32768, vocab 262144, bos 2, eos 1,
    pad 0, no soft-capping, tied embeddings. `tensor_names`, when given, decides
    tie_word_embeddings (an "output.weight" tensor means an untied head).
    """
    arch = metadata.get("general.architecture")
    if arch != "gemma3":
        raise ValueError(f"hf_config_from_gguf reads gemma3 GGUFs; this one is {arch!r}")
    p = arch + "."
    hidden = _count(metadata, p + "embedding_length")
    heads = _count(metadata, p + "attention.head_count")
    kv_heads = _count(metadata, p + "attention.head_count_kv", heads)
    head_dim = _count(metadata, p + "attention.key_length", hidden // heads)
    if metadata.get(p + "attention.value_length", head_dim) != head_dim:
        raise ValueError(f"GGUF key_length {head_dim} != value_length "
                         f"{metadata[p + 'attention.value_length']}; not supported")
    rot = metadata.get(p + "rope.dimension_count", head_dim)
    if rot != head_dim:
        raise ValueError(f"partial rotary ({rot} of {head_dim} dims) is not supported")
    layers = _count(metadata, p + "block_count")
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = _count(metadata, p + "vocab_size", len(tokens) if tokens is not None else None)

    # llama.cpp writes a sliding window only when the model has sliding layers.
    window = metadata.get(p + "attention.sliding_window")
    types = gemma3_layer_types(layers, metadata.get(p + "attention.sliding_window_pattern"),
                               sliding=bool(window))
    scale = metadata.get(p + "attention.scale")
    query_scalar: float = head_dim
    if scale:  # the attention scale is query_pre_attn_scalar ** -0.5
        query_scalar = 1.0 / float(scale) ** 2
        if abs(query_scalar - round(query_scalar)) < 1e-3:
            query_scalar = round(query_scalar)
    rope_scaling = None
    kind = metadata.get(p + "rope.scaling.type", "none")
    if kind == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(metadata[p + "rope.scaling.factor"])}
    elif kind not in ("none", None):
        raise ValueError(f"rope scaling {kind!r} is not supported for gemma3")

    def token_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    eos = [e for e in (token_id("eos_token_id"), token_id("eot_token_id"),
                       token_id("eom_token_id")) if e is not None]
    eos = list(dict.fromkeys(eos))
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _count(metadata, p + "feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(metadata.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(metadata.get(p + "rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": float(metadata.get(p + "rope.freq_base_swa",
                                                   GEMMA3_LOCAL_ROPE_BASE)),
        "rope_scaling": rope_scaling,
        "sliding_window": int(window) if window else None,
        "layer_types": types,
        "query_pre_attn_scalar": query_scalar,
        "max_position_embeddings": _count(metadata, p + "context_length"),
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": tensor_names is None or "output.weight" not in tensor_names,
        "attention_bias": False,
        "attn_logit_softcapping": metadata.get(p + "attn_logit_softcapping"),
        "final_logit_softcapping": metadata.get(p + "final_logit_softcapping"),
        "bos_token_id": token_id("bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": token_id("padding_token_id"),
    }


def spec_from_gguf(
    meta: dict[str, Any],
    tensor_names: set[str],
    path: Path,
    rope_factors: tuple[float, ...] | None = None,
) -> ModelSpec:
    """ModelSpec from GGUF metadata, which tensors exist (biases, tied head, qk norm) and
    the contents of `rope_freqs.weight` (llama3-style per-frequency divisors), if any."""
    arch = _require(meta, "general.architecture", path)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {path}: unsupported architecture {arch!r}; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    experts = meta.get(arch + ".expert_count")
    if experts and arch not in _MOE_ARCHITECTURES:
        raise ValueError(f"GGUF file {path}: a mixture-of-experts {arch!r} model "
                         f"({arch}.expert_count={experts}) is not supported; mixtures of "
                         f"experts from GGUF: {', '.join(_MOE_ARCHITECTURES)}")
    if arch == "gemma3":  # through the HF config, so both routes share one parser
        try:
            return ModelSpec.from_hf_config(hf_config_from_gguf(meta, tensor_names))
        except ValueError as e:
            raise ValueError(f"GGUF file {path}: {e}") from e
    p = arch + "."
    n_head = _require(meta, p + "attention.head_count", path)
    n_kv = meta.get(p + "attention.head_count_kv", n_head)
    if isinstance(n_head, list) or isinstance(n_kv, list):
        raise ValueError(f"GGUF file {path}: per-layer head counts are not supported")
    hidden = _require(meta, p + "embedding_length", path)
    head_dim = meta.get(p + "attention.key_length", hidden // n_head)
    rot_dims = meta.get(p + "rope.dimension_count", head_dim)
    if rot_dims != head_dim:
        raise ValueError(f"GGUF file {path}: partial rotary ({rot_dims} of {head_dim}) unsupported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(p + "vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ValueError(f"GGUF file {path} lacks {p}vocab_size and tokenizer.ggml.tokens")

    rope_scaling = None
    kind = meta.get(p + "rope.scaling.type", "none")
    if kind == "linear":
        rope_scaling = (("factor", meta[p + "rope.scaling.factor"]), ("rope_type", "linear"))
    elif kind not in ("none", None):
        raise ValueError(f"GGUF file {path}: rope scaling {kind!r} is not supported")
    if rope_factors is not None:
        rope_scaling = (("factors", rope_factors), ("rope_type", "freq_factors"))

    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [] if eos is None else [int(eos)]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in meta and int(meta[key]) not in eos_ids:
            eos_ids.append(int(meta[key]))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelSpec(
        **{"architecture": GGUF_ARCHITECTURES[arch],
           **_moe_from_gguf(meta, arch, tensor_names, path)},
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(_require(meta, p + "feed_forward_length", path)),
        num_layers=int(_require(meta, p + "block_count", path)),
        num_heads=int(n_head),
        num_kv_heads=int(n_kv),
        head_dim=int(head_dim),
        rms_norm_eps=float(_require(meta, p + "attention.layer_norm_rms_epsilon", path)),
        rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        max_position_embeddings=int(_require(meta, p + "context_length", path)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
        o_proj_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
    )


def _moe_from_gguf(meta: dict[str, Any], arch: str, tensor_names: set[str], path: Path
                   ) -> dict[str, Any]:
    """ModelSpec's expert fields from llama.cpp's keys (empty for a dense model): the sparse
    layers are those with stacked experts; the weights renormalized as llama.cpp does (Mixtral
    and Qwen3-MoE yes, Qwen2-MoE no) unless `expert_weights_norm` says."""
    p = arch + "."
    if not meta.get(p + "expert_count"):
        return {}
    try:
        layers = _count(meta, p + "block_count")
        width = (_count(meta, p + "expert_feed_forward_length") if arch != "llama"
                 else _count(meta, p + "feed_forward_length"))
        shared = (_count(meta, p + "expert_shared_feed_forward_length")
                  if "blk.0.ffn_up_shexp.weight" in tensor_names else 0)
        fields = {"architecture": _MOE_ARCHITECTURES[arch],
                  "num_experts": _count(meta, p + "expert_count"),
                  "num_experts_per_tok": _count(meta, p + "expert_used_count"),
                  "moe_intermediate_size": width, "shared_expert_intermediate_size": shared,
                  "norm_topk_prob": bool(meta.get(p + "expert_weights_norm",
                                                  arch != "qwen2moe"))}
    except ValueError as e:
        raise ValueError(f"GGUF file {path}: {e}") from e
    sparse = tuple(f"blk.{i}.ffn_gate_exps.weight" in tensor_names for i in range(layers))
    if not any(sparse):
        raise ValueError(f"GGUF file {path}: {p}expert_count is set but no layer has stacked "
                         "experts (blk.N.ffn_gate_exps); per-expert tensors of old converters "
                         "are not supported")
    fields["sparse_layers"] = None if all(sparse) else sparse
    return fields


# Rows dequantized at a time: the temporaries stay a few MiB, whatever the tensor's size.
_DEQUANT_ROWS = 4096


def _dequantize(path: Path, t: TensorInfo) -> np.ndarray:
    """One tensor as float32 in numpy order. Its bytes are read from the file (not through a
    memory map, which would keep every page read resident in this process) and dequantized a
    slab of rows at a time, so the whole float32 tensor is the only big allocation."""
    qtype = gguf.GGMLQuantizationType(t.ggml_type)
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if t.dims and t.dims[0] % block:
        raise ValueError(f"row length {t.dims[0]} is not a multiple of {qtype.name}'s block "
                         f"of {block}")
    raw = np.fromfile(path, dtype=np.uint8, count=t.nbytes, offset=t.offset)
    if raw.size != t.nbytes:
        raise ValueError(f"{t.nbytes} bytes expected at offset {t.offset}, {raw.size} read")
    shape = t.shape
    n_rows = math.prod(shape[:-1])  # 1 for a 1-D tensor
    raw = raw.reshape(n_rows, -1)
    out = np.empty(shape, np.float32)
    rows = out.reshape(n_rows, -1)
    for i in range(0, n_rows, _DEQUANT_ROWS):
        part = raw[i:i + _DEQUANT_ROWS]
        rows[i:i + part.shape[0]] = gguf.quants.dequantize(part, qtype).reshape(
            part.shape[0], -1)
    return out


def _tensor_makers(path: Path, meta: dict[str, Any], tensors: dict[str, TensorInfo]
                   ) -> dict[str, Callable[[], np.ndarray]]:
    """HF name -> function dequantizing that tensor in HF's convention (q/k rows un-permuted
    for llama, norm weights less the converter's +1 for gemma3)."""
    arch = _require(meta, "general.architecture", path)
    heads: dict[str, int] = {}
    if arch in _PERMUTED_ARCHS:
        try:
            n_head = _count(meta, f"{arch}.attention.head_count")
            heads = {".attn_q.": n_head,
                     ".attn_k.": _count(meta, f"{arch}.attention.head_count_kv", n_head)}
        except ValueError as e:
            raise ValueError(f"GGUF file {path}: {e}") from e

    def hf_tensor(name: str, hf: str) -> np.ndarray:
        arr = _read_tensor(path, tensors[name])
        for part, n in heads.items():
            if part in name:
                arr = unpermute_qk(arr, n)
        if arch in _NORM_SHIFTED_ARCHS and hf.endswith("norm.weight"):
            arr -= 1.0
        if ".experts." in hf:  # [E, out, in] -> the stacked Param's [E, in, out]
            arr = arr.transpose(0, 2, 1)
        elif hf.endswith("shared_expert_gate.weight"):  # a vector here, [1, hidden] in HF
            arr = arr.reshape(1, -1)
        return arr

    return {hf: functools.partial(hf_tensor, name, hf) for name in tensors
            if (hf := gguf_to_hf_name(name, arch)) is not None}


def _quantized_makers(path: Path, meta: dict[str, Any], tensors: dict[str, TensorInfo]
                      ) -> tuple[dict[str, Callable[[], np.ndarray]], dict[str, QuantLayout]]:
    """As `_tensor_makers`, but a tensor of a quantized type stays quantized: its module gets
    `<module>.qweight`, `.scales` (and `.mins`) in the device layout (models/quant.py), and the
    plan says which modules those are. Float tensors (norms, F16 weights) are as before."""
    floats = _tensor_makers(path, meta, tensors)
    arch = meta["general.architecture"]
    heads: dict[str, int] = {}
    if arch in _PERMUTED_ARCHS:
        n_head = _count(meta, f"{arch}.attention.head_count")
        heads = {".attn_q.": n_head,
                 ".attn_k.": _count(meta, f"{arch}.attention.head_count_kv", n_head)}
    makers: dict[str, Callable[[], np.ndarray]] = {}
    plan: dict[str, QuantLayout] = {}
    last: dict[str, QuantWeight] = {}  # the tensor read last: its arrays are read together

    def read(t: TensorInfo, n_head: int | None, k_axis: int) -> QuantWeight:
        if t.name not in last:
            last.clear()
            last[t.name] = _quantized_tensor(path, t, n_head, k_axis)
        return last[t.name]

    for name, t in tensors.items():
        hf = gguf_to_hf_name(name, arch)
        if hf is None:
            continue
        qtype = gguf.GGMLQuantizationType(t.ggml_type)
        if qtype in FLOAT_TYPES:
            makers[hf] = floats[hf]
            continue
        if qtype not in LAYOUTS:
            raise ValueError(
                f"GGUF file {path}: tensor {name!r} is {qtype.name}, which cannot run quantized "
                f"(supported: {', '.join(supported_types())}); load it without "
                "quantization='gguf' to dequantize it")
        stacked = ".experts." in hf and len(t.shape) == 3  # a layer's experts [E, out, in]
        if not stacked and (not hf.endswith(".weight") or len(t.shape) != 2):
            raise ValueError(f"GGUF file {path}: tensor {name!r} ({qtype.name}, shape "
                             f"{t.shape}) is not a matrix; only matrices run quantized")
        module = hf if stacked else hf[: -len(".weight")]
        k_axis = 1 if module.endswith("embed_tokens") or stacked else 0
        plan[module] = LAYOUTS[qtype]
        n_head = next((n for part, n in heads.items() if part in name), None)
        weight = functools.partial(read, t, n_head, k_axis)
        makers[f"{module}.qweight"] = lambda w=weight: w().q
        makers[f"{module}.scales"] = lambda w=weight: w().scales
        if LAYOUTS[qtype].has_min:
            makers[f"{module}.mins"] = lambda w=weight: w().mins
    return makers, plan


def _quantized_tensor(path: Path, t: TensorInfo, n_head: int | None, k_axis: int
                      ) -> QuantWeight:
    """One quantized GGUF tensor in the device form (q/k rows un-permuted when n_head); a
    layer's stacked experts [E, out, in] as [E, in, out] (k_axis 1), one expert at a time."""
    qtype = gguf.GGMLQuantizationType(t.ggml_type)
    try:
        raw = np.fromfile(path, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        if raw.size != t.nbytes:
            raise ValueError(f"{t.nbytes} bytes expected at offset {t.offset}, {raw.size} read")
        block, _ = gguf.GGML_QUANT_SIZES[qtype]
        if t.dims[0] % block:
            raise ValueError(f"row length {t.dims[0]} is not a multiple of {qtype.name}'s "
                             f"block of {block}")
        if len(t.shape) == 3:
            return _quantized_experts(raw.reshape(t.shape[0], t.shape[1], -1), qtype)
        dec = decode(raw.reshape(t.shape[0], -1), qtype)
        if n_head is not None:
            dec = Decoded(dec.kind, *(None if a is None else unpermute_qk(a, n_head)
                                      for a in dec[1:]))
        weight = to_weight(dec, LAYOUTS[qtype], k_axis)
        weight.check(t.name)
        return weight
    except Exception as e:
        raise ValueError(f"cannot read tensor {t.name!r} from GGUF file {path}: {e}") from e


def _quantized_experts(raw: np.ndarray, qtype: gguf.GGMLQuantizationType) -> QuantWeight:
    """Raw blocks [E, out, bytes] of a layer's stacked experts -> the stacked device form:
    values [E, in (int4: in / 2), out], scales (and mins) [E, in / group, out]."""
    layout = LAYOUTS[qtype]
    ones = [to_weight(decode(raw[e], qtype), layout, 0) for e in range(raw.shape[0])]

    def stack(arrays: list[np.ndarray | None]) -> np.ndarray | None:
        return None if arrays[0] is None else np.stack(arrays)

    return QuantWeight(ones[0].kind, stack([w.q for w in ones]),
                       stack([w.scales for w in ones]), stack([w.mins for w in ones]), 1)


def _read_tensor(path: Path, t: TensorInfo) -> np.ndarray:
    try:
        return _dequantize(path, t)
    except Exception as e:
        raise ValueError(f"cannot read tensor {t.name!r} from GGUF file {path}: {e}") from e


def _collect(path: Path, makers: dict[str, Callable[[], np.ndarray]], lazy: bool
             ) -> TensorDict | LazyTensors:
    if lazy:
        return LazyTensors(str(path), makers)
    weights = TensorDict(str(path))
    for hf, make in makers.items():
        weights[hf] = make()
        weights.files[hf] = str(path)
    return weights


def _open(path: str | Path) -> tuple[Path, dict[str, Any], dict[str, TensorInfo]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    meta, tensors = read_gguf(path)  # ValueError naming the file on bad bytes
    return path, meta, tensors


def read_gguf_tensors(path: str | Path, lazy: bool = False
                      ) -> tuple[dict[str, Any], TensorDict | LazyTensors]:
    """(metadata, float32 tensors in HF naming) of a GGUF file, without building a ModelSpec
    (so for any general.architecture whose names are known); conventions as `load_gguf`."""
    path, meta, tensors = _open(path)
    return meta, _collect(path, _tensor_makers(path, meta, tensors), lazy)


def load_gguf_quantized(path: str | Path
                        ) -> tuple[ModelSpec, LazyTensors, dict[str, QuantLayout], dict[str, Any]]:
    """(spec, tensors, plan, metadata) of a GGUF kept at its own quantization: every tensor of
    a quantized type stays quantized (`<module>.qweight`, `.scales`, `.mins`, made when read),
    and `plan` names those modules and their layouts (models/quant_layers.py)."""
    path, meta, tensors = _open(path)
    factors = None
    if "rope_freqs.weight" in tensors:
        factors = tuple(float(x) for x in _read_tensor(path, tensors["rope_freqs.weight"]).ravel())
    spec = spec_from_gguf(meta, set(tensors), path, factors)
    makers, plan = _quantized_makers(path, meta, tensors)
    return spec, LazyTensors(str(path), makers), plan, meta


def load_gguf(path: str | Path, lazy: bool = False
              ) -> tuple[ModelSpec, TensorDict | LazyTensors, dict[str, Any]]:
    """(spec, float32 tensors in HF naming, metadata) of a GGUF file; q/k un-permuted for
    llama, norm weights less the converter's +1 for gemma3.

    lazy: tensors are dequantized when read and not kept (LazyTensors), for loaders that want
    one whole tensor in memory at a time; else all are dequantized now (a TensorDict).
    """
    path, meta, tensors = _open(path)
    factors = None
    if "rope_freqs.weight" in tensors:
        factors = tuple(float(x) for x in _read_tensor(path, tensors["rope_freqs.weight"]).ravel())
    spec = spec_from_gguf(meta, set(tensors), path, factors)
    return spec, _collect(path, _tensor_makers(path, meta, tensors), lazy), meta
