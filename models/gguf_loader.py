"""GGUF (llama.cpp) checkpoints -> ModelSpec, dequantized float32 tensors in HF naming, metadata.

GGUF stores tensor dims fastest-first; the `gguf` reader already hands back numpy (C-order)
arrays, whose shape is the reverse of `ReaderTensor.shape` and equals HF's [out, in] layout.
llama.cpp's converter permutes the rows of q/k weights for llama-arch models so its RoPE can
rotate interleaved pairs; `unpermute_qk` undoes that exactly to get back HF's half-split layout.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .config import ModelSpec
from .tensors import LazyTensors, TensorDict

# general.architecture -> HF architecture name. Mistral GGUFs say "llama".
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Architectures whose q/k rows llama.cpp's converter permutes (non-NeoX RoPE).
_PERMUTED_ARCHS = {"llama"}

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


def gguf_to_hf_name(name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None for tensors we do not load."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        mapped = _LAYER_NAMES.get(part)
        return None if mapped is None else f"model.layers.{idx}.{mapped}.{suffix}"
    mapped = _GLOBAL_NAMES.get(base)
    return None if mapped is None else f"{mapped}.{suffix}"


def read_gguf_metadata(reader: Any) -> dict[str, Any]:
    """All key/value fields of an open GGUFReader as plain Python values."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        value = field.contents()
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))  # 1e-05, not 9.999999747378752e-06
        out[key] = value
    return out


def _require(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise ValueError(f"GGUF file {path} lacks metadata key {key!r}")
    return meta[key]


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
        architecture=GGUF_ARCHITECTURES[arch],
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


# Rows dequantized at a time: the temporaries stay a few MiB, whatever the tensor's size.
_DEQUANT_ROWS = 4096


def _dequantize(path: Path, t: Any, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor as float32 `shape`. Its bytes are read from the file (not through the
    reader's memory map, which would keep every page read resident in this process) and
    dequantized a slab of rows at a time, so the whole float32 tensor is the only big
    allocation."""
    layout = t.data  # a memory-mapped view: its shape and dtype, no page touched
    raw = np.fromfile(path, dtype=layout.dtype, count=layout.size,
                      offset=int(t.data_offset)).reshape(layout.shape)
    out = np.empty(shape, np.float32)
    if raw.ndim < 2:
        out.reshape(-1)[:] = gguf.quants.dequantize(raw, t.tensor_type).reshape(-1)
        return out
    rows = out.reshape(raw.shape[0], -1)  # invariant: axis 0 of the bytes is the row axis
    for i in range(0, raw.shape[0], _DEQUANT_ROWS):
        part = raw[i:i + _DEQUANT_ROWS]
        rows[i:i + part.shape[0]] = gguf.quants.dequantize(part, t.tensor_type).reshape(
            part.shape[0], -1)
    return out


def load_gguf(path: str | Path, lazy: bool = False
              ) -> tuple[ModelSpec, TensorDict | LazyTensors, dict[str, Any]]:
    """(spec, float32 tensors in HF naming, metadata) of a GGUF file; q/k un-permuted for llama.

    lazy: tensors are dequantized when read and not kept (LazyTensors), for loaders that want
    one whole tensor in memory at a time; else all are dequantized now (a TensorDict).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(str(path))
        meta = read_gguf_metadata(reader)
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad bytes
        raise ValueError(f"corrupt or truncated GGUF file {path}: {e}") from e
    tensors = {t.name: t for t in reader.tensors}

    def dequantized(name: str) -> np.ndarray:
        t = tensors[name]
        want = tuple(int(d) for d in reversed(t.shape))  # numpy order of the GGUF dims
        try:
            return _dequantize(path, t, want)
        except Exception as e:
            raise ValueError(f"cannot read tensor {name!r} from GGUF file {path}: {e}") from e

    factors = None
    if "rope_freqs.weight" in tensors:
        factors = tuple(float(x) for x in dequantized("rope_freqs.weight").ravel())
    spec = spec_from_gguf(meta, set(tensors), path, factors)
    arch = meta["general.architecture"]

    def hf_tensor(name: str) -> np.ndarray:
        arr = dequantized(name)
        if arch in _PERMUTED_ARCHS and ".attn_q." in name:
            arr = unpermute_qk(arr, spec.num_heads)
        elif arch in _PERMUTED_ARCHS and ".attn_k." in name:
            arr = unpermute_qk(arr, spec.num_kv_heads)
        return arr

    makers = {hf: functools.partial(hf_tensor, name) for name in tensors
              if (hf := gguf_to_hf_name(name)) is not None}
    if lazy:
        return spec, LazyTensors(str(path), makers), meta
    weights = TensorDict(str(path))
    for hf, make in makers.items():
        weights[hf] = make()
        weights.files[hf] = str(path)
    return spec, weights, meta
