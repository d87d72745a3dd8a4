"""Helpers for tests/models: tiny HF checkpoints, a byte tokenizer, and a jitted jpaged forward."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer as Backend

from models import dense_causal_attention
from models.tokenizer import byte_level_backend, byte_to_unicode

VOCAB = 300  # 256 byte tokens + <s>, </s> + unused ids
BOS, EOS = 256, 257

# Tiny configs for every supported architecture; kwargs of transformers' config classes.
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, bos_token_id=BOS, eos_token_id=EOS,
)
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama3_rope_bias": ("LlamaConfig", dict(
        _COMMON, attention_bias=True, mlp_bias=True, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )),
    "llama_tied": ("LlamaConfig", dict(_COMMON, tie_word_embeddings=True, rope_theta=500.0)),
    "llama_linear_rope": ("LlamaConfig", dict(
        _COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral": ("MistralConfig", dict(_COMMON, head_dim=16, sliding_window=None)),
    "qwen2_bias": ("Qwen2Config", dict(_COMMON, use_sliding_window=False)),
    "qwen3_qk_norm": ("Qwen3Config", dict(_COMMON, head_dim=32, use_sliding_window=False)),
    # Sliding windows shorter than the test's 13-token sequence, so the window binds.
    "mistral_sliding": ("MistralConfig", dict(_COMMON, head_dim=16, sliding_window=4)),
    "qwen2_sliding_upper_layers": ("Qwen2Config", dict(
        _COMMON, num_hidden_layers=3, use_sliding_window=True, sliding_window=5,
        max_window_layers=1)),
    "gemma2": ("Gemma2Config", dict(
        _COMMON, num_hidden_layers=3, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
        hidden_activation="gelu_pytorch_tanh")),
    "gemma3": ("Gemma3TextConfig", dict(
        _COMMON, num_hidden_layers=3, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_theta=1e6, rope_local_base_freq=100.0, hidden_activation="gelu_pytorch_tanh")),
    # Mixtures of experts: 8 experts, 2 a token (Mixtral); Qwen3-MoE with 4 of 16 experts
    # renormalized and a dense layer (mlp_only_layers); Qwen2-MoE with its gated shared
    # expert and the weights not renormalized.
    "mixtral": ("MixtralConfig", dict(_COMMON, head_dim=16, num_local_experts=8,
                                      num_experts_per_tok=2, sliding_window=None)),
    # Mixtral with Mistral's window on every layer (shorter than the test's sequence).
    "mixtral_sliding": ("MixtralConfig", dict(_COMMON, head_dim=16, num_local_experts=4,
                                              num_experts_per_tok=2, sliding_window=4)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        _COMMON, num_hidden_layers=3, head_dim=16, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
        use_sliding_window=False)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        _COMMON, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40,
        shared_expert_intermediate_size=72, norm_topk_prob=False, use_sliding_window=False)),
    # A Qwen2-MoE class with no experts: every layer the dense MLP (HF's rule).
    "qwen2_moe_no_experts": ("Qwen2MoeConfig", dict(
        _COMMON, num_experts=0, num_experts_per_tok=2, moe_intermediate_size=40,
        shared_expert_intermediate_size=72, use_sliding_window=False)),
    # Widths the grouped-matmul kernel tiles on each of 2 devices (32 = 2 x 16).
    "qwen2_moe_even": ("Qwen2MoeConfig", dict(
        _COMMON, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, norm_topk_prob=True, use_sliding_window=False)),
}


def byte_tokenizer() -> Backend:
    """A 258-token byte-level tokenizer (no merges) with <s> and </s>."""
    return byte_level_backend()


def save_byte_tokenizer(path: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (with a chat template) into `path`."""
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>"},
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    }))


def randomize_(model, seed: int = 0, std: float = 0.2) -> None:
    """Give every HF parameter (biases and norm weights included) a non-trivial random value."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)


def make_hf_checkpoint(kind: str, path: Path, seed: int = 0):
    """Build, randomize and save a tiny HF model of `kind` (float32, safetensors); return it."""
    import torch
    import transformers

    cls_name, kwargs = TINY_CONFIGS[kind]
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    randomize_(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    save_byte_tokenizer(path)
    return model


def make_hf_classifier(kind: str, path: Path, labels: list[str], seed: int = 0,
                       **extra):
    """A tiny HF sequence classifier (`*ForSequenceClassification` of `kind`'s config, a
    score head of one row per label) randomized and saved like make_hf_checkpoint."""
    import torch
    import transformers

    cls_name, kwargs = TINY_CONFIGS[kind]
    config = getattr(transformers, cls_name)(
        **kwargs, **extra, id2label=dict(enumerate(labels)),
        label2id={x: i for i, x in enumerate(labels)})
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(
        config, attn_implementation="eager").float().eval()
    randomize_(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    save_byte_tokenizer(path)
    return model


def hf_logits(model, seqs: list[list[int]]) -> list[np.ndarray]:
    """HF float32 logits of each sequence run on its own."""
    import torch

    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].float().numpy() for s in seqs]


def flatten(seqs: list[list[int]], pad_to: int | None = None):
    """(input_ids, positions, segment_ids) of sequences packed into one ragged token batch."""
    ids = np.concatenate([np.asarray(s, np.int32) for s in seqs])
    pos = np.concatenate([np.arange(len(s), dtype=np.int32) for s in seqs])
    seg = np.concatenate([np.full(len(s), i, np.int32) for i, s in enumerate(seqs)])
    if pad_to is not None and pad_to > len(ids):
        n = pad_to - len(ids)
        ids = np.concatenate([ids, np.zeros(n, np.int32)])
        pos = np.concatenate([pos, np.zeros(n, np.int32)])
        seg = np.concatenate([seg, np.full(n, -1, np.int32)])
    return ids, pos, seg


def make_logits_fn(model):
    """A jitted (ids, pos, seg) -> float32 logits using dense_causal_attention."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, ids, pos, seg):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(ids, pos, dense_causal_attention(seg, pos, m.spec))
        return m.compute_logits(hidden)

    return lambda ids, pos, seg: run(state, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg))


def jpaged_logits(model, seqs: list[list[int]], pad_to: int | None = None) -> list[np.ndarray]:
    """jpaged logits of sequences run together as one flattened batch, split per sequence."""
    ids, pos, seg = flatten(seqs, pad_to)
    logits = np.asarray(make_logits_fn(model)(ids, pos, seg))
    out, start = [], 0
    for s in seqs:
        out.append(logits[start:start + len(s)])
        start += len(s)
    return out


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours - ref| / max(1, max |ref|)."""
    return float(np.max(np.abs(ours - ref)) / max(1.0, float(np.max(np.abs(ref)))))


# ---- checkpoints without torch -------------------------------------------------------------

# A small llama-family spec used for GGUF / safetensors tests (GQA, untied head).
def tiny_spec(**changes):
    """A ModelSpec for a 2-layer llama small enough to write and jit in a second."""
    from models import ModelSpec

    base = dict(
        architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False, attention_bias=False,
        qk_norm=False, max_position_embeddings=256, bos_token_id=BOS, eos_token_ids=(EOS,),
    )
    base.update(changes)
    return ModelSpec(**base)


def hf_config_dict(spec) -> dict:
    """config.json content describing `spec` (transformers-5 style rope_parameters)."""
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling is not None:
        rope.update(dict(spec.rope_scaling))
    return {
        "architectures": [spec.architecture], "model_type": "llama",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "rms_norm_eps": spec.rms_norm_eps, "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings, "rope_parameters": rope,
        "tie_word_embeddings": spec.tie_word_embeddings, "attention_bias": spec.attention_bias,
        "bos_token_id": spec.bos_token_id, "eos_token_id": list(spec.eos_token_ids),
    }


def random_weights(spec, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors in HF naming and shapes for every parameter `spec` needs."""
    from models.registry import get_model_class
    from models.weights import hf_param_table

    abstract = nnx.eval_shape(
        lambda: get_model_class(spec.architecture)(spec, rngs=nnx.Rngs(0))
    )
    rng = np.random.default_rng(seed)
    out = {}
    for name, entry in hf_param_table(abstract).items():
        shape = entry.hf_shape()
        base = 1.0 if name.endswith("norm.weight") else 0.0
        out[name] = (base + 0.2 * rng.standard_normal(shape)).astype(np.float32)
    return out


def write_hf_dir(path: Path, spec, weights: dict[str, np.ndarray], shards: int = 1) -> Path:
    """An HF model directory: config.json, the weights (model.safetensors, or `shards` files
    and model.safetensors.index.json as HF writes big models) and a byte tokenizer."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config_dict(spec)))
    if shards == 1:
        save_file(weights, str(path / "model.safetensors"))
    else:
        names = list(weights)
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            save_file({n: weights[n] for n in part}, str(path / file))
            weight_map.update(dict.fromkeys(part, file))
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_byte_tokenizer(path)
    return path


_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    # A sparse layer's router and Qwen2-MoE's shared expert (Mixtral's block_sparse_moe too).
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Each expert's [out, in] tensor goes into its layer's stacked [E, out, in] GGUF tensor.
_EXPERT_TO_GGUF = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                   "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for an HF llama parameter name."""
    base, suffix = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, idx, part = base.split(".", 3)
        return f"blk.{idx}.{_TO_GGUF[part]}.{suffix}"
    return f"{_TO_GGUF[base]}.{suffix}"


def gguf_moe_weights(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF tensors of a mixture of experts with each layer's experts stacked under llama.cpp's
    names (blk.N.ffn_*_exps.weight, [E, out, in]), the shared expert's gate as a vector, and
    the other tensors as they are (HF names, for write_gguf)."""
    import re

    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, arr in weights.items():
        m = re.match(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight$", name)
        if m:
            key = f"blk.{m[1]}.{_EXPERT_TO_GGUF[m[3]]}.weight"
            stacks.setdefault(key, {})[int(m[2])] = arr
        elif name.endswith("shared_expert_gate.weight"):
            out[name] = arr.reshape(-1)
        else:
            out[name] = arr
    for key, parts in stacks.items():
        out[key] = np.stack([parts[e] for e in range(len(parts))])
    return out


# A GGUF's types per tensor as llama.cpp's Q4_K_M mixes them (here the block-32 types, which
# the tiny widths take): int4 with mins for gate / up, int8 for down, Q8_0 attention.
MOE_GGUF_TYPES = {"ffn_gate_exps": "Q4_1", "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q8_0",
                  "mlp.gate_proj": "Q4_0", "mlp.up_proj": "Q4_0", "mlp.down_proj": "Q5_0",
                  "shared_expert.": "Q8_0",
                  **{f"self_attn.{x}_proj.weight": "Q8_0" for x in "qkvo"}}



def write_moe_gguf(path: Path, hf_dir: Path, spec, arch: str,
                   quantize: tuple[str, ...] | dict[str, str] = ()) -> Path:
    """llama.cpp's GGUF of a mixture-of-experts HF checkpoint (`hf_dir`, `spec` its
    ModelSpec): the experts stacked, the expert keys llama.cpp writes for `arch`."""
    from safetensors.numpy import load_file

    weights = gguf_moe_weights(load_file(str(Path(hf_dir) / "model.safetensors")))
    meta = {"expert_count": spec.num_experts, "expert_used_count": spec.num_experts_per_tok}
    if arch != "llama":
        meta["expert_feed_forward_length"] = spec.moe_intermediate_size
    if spec.shared_expert_intermediate_size:
        meta["expert_shared_feed_forward_length"] = spec.shared_expert_intermediate_size
    return write_gguf(path, spec, weights, quantize=quantize, arch=arch, metadata=meta)


def write_gguf(path: Path, spec, weights: dict[str, np.ndarray],
               quantize: tuple[str, ...] | dict[str, str] = (), arch: str = "llama",
               metadata: dict[str, int | float | bool] | None = None):
    """A GGUF of `arch` (llama by default) as llama.cpp's converter writes it (q/k rows
    permuted for llama); `metadata`: more `{arch}.` keys (ints, floats, bools).

    Tensors whose HF name contains a string in `quantize` are stored as Q8_0, or (a dict:
    substring -> GGML type name, first match wins) as that type. Names already in GGUF form
    (blk.N....) are written as they are.
    """
    import gguf

    from models.weights import permute_qk

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (metadata or {}).items():
        add = (w.add_bool if isinstance(value, bool) else
               w.add_uint32 if isinstance(value, int) else w.add_float32)
        add(f"{arch}.{key}", value)
    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_rope_dimension_count(spec.head_dim)
    # Tokenizer: the 256 byte tokens, <s>, </s>, one merged token, then unused slots.
    spell = byte_to_unicode()
    tokens = [spell[b] for b in range(256)] + ["<s>", "</s>", "Ġt"]
    tokens += [f"<unused{i}>" for i in range(spec.vocab_size - len(tokens))]
    types = [1] * 256 + [3, 3, 1] + [5] * (spec.vocab_size - 259)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, arr in weights.items():
        if arch != "llama":
            pass
        elif name.endswith("q_proj.weight"):
            arr = permute_qk(arr, spec.num_heads)
        elif name.endswith("k_proj.weight"):
            arr = permute_qk(arr, spec.num_kv_heads)
        types = quantize if isinstance(quantize, dict) else dict.fromkeys(quantize, "Q8_0")
        kind = next((t for part, t in types.items() if part in name), None)
        if kind is not None:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name if name.startswith("blk.") else gguf_name(name),
                         gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name if name.startswith("blk.") else gguf_name(name),
                         np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
