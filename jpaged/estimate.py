"""The KV capacity planner behind `jpaged estimate`: no engine, no weights loaded.

Arithmetic, per device (``--gpu-memory`` is the memory of one device):

* bytes per token = 2 (K and V) x layers x kv heads x head_dim x kv dtype bytes;
  a block holds ``block_size`` TOKENS, so bytes per block = block_size x bytes per token
  (a "16 KB block" mixes the two: a block of LLaMA-13B in bf16 is 13.1 MB).
* parameter bytes = embedding + lm_head (unless tied) + per layer (q/k/v/o, their biases,
  q/k norms, gate/up/down, their biases, two RMSNorms) + final norm, times the weights dtype.
* activation allowance = max_num_batched_tokens x weights dtype bytes x (2 hidden + q/k/v/o
  widths + 3 intermediate) of one decoder layer (layers run one after another)
  + max_num_seqs x vocab x 4 (float32 logits), plus a fixed 256 MiB runtime margin. The engine
  itself measures the real peak from the compiled step at start-up; this is the planner's guess.
* KV budget = gpu memory x utilization - parameters - activation allowance - margin;
  num_blocks = budget // bytes per block; block 0 is the engine's null block, so
  max concurrent sequences = (num_blocks - 1) // blocks per sequence, which is
  ceil(max_model_len / block_size) for a model without sliding layers.

With tensor parallelism the attention heads, MLP columns and vocabulary are split over the
devices; KV heads are split too, or replicated (one per device) when tp > kv heads.

Hybrid models (sliding-window layers: Gemma 2/3, Mistral v0.1, Qwen with use_sliding_window)
are sized as the engine lays them out (its KV cache groups): a block id holds one group's
layers, a sliding group keeps only the blocks of its last ``window`` tokens plus the chunk
being computed (cdiv(window - 1 + max_num_batched_tokens, block_size) + 1), a full group all
cdiv(max_model_len, block_size); blocks per sequence count every group's. The full layout
(--disable-hybrid-kv-cache-manager: every layer keeps every block) is set beside it. The
largest max_model_len that fits is found by bisection over that count.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from jpaged.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    KV_CACHE_DTYPES,
    MODEL_DTYPES,
    QUANTIZATION_METHODS,
    LoRAConfig,
    canonical_dtype,
    parse_hf_overrides,
)
from jpaged.core.kv_cache_groups import (
    KVCacheLayout,
    blocks_by_length,
    kv_cache_layout,
    largest_fitting,
)
from jpaged.intmath import cdiv
from models.lora import lora_slot_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# config.json torch_dtype values -> our names ("half" and "float" appear in old configs).
_TORCH_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16",
                 "float16": "float16", "half": "float16"}
RUNTIME_MARGIN_BYTES = 256 * 2**20
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_MEMORY = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", re.IGNORECASE)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class EstimateError(ValueError):
    """Bad planner input; `flag` is the CLI flag at fault."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclass(frozen=True)
class CapacityEstimate:
    """What fits in the KV pool of one device for a model, dtype and memory budget."""

    model: str
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # weights dtype
    kv_cache_dtype: str  # resolved (never "auto")
    block_size: int
    max_model_len: int
    avg_len: int | None
    tensor_parallel_size: int
    gpu_memory_bytes: int  # per device
    gpu_memory_utilization: float
    bytes_per_token: int  # whole model, all devices
    bytes_per_block: int  # whole model, all devices
    param_count: int
    param_bytes: int  # whole model
    kv_heads_per_device: int
    bytes_per_token_per_device: int
    bytes_per_block_per_device: int
    param_bytes_per_device: int
    activation_bytes: int  # per device, includes nothing of the margin
    margin_bytes: int
    kv_budget_bytes: int  # per device
    num_blocks: int  # per device; every device holds the same block ids
    blocks_per_seq: int  # at max_model_len
    max_concurrent_seqs: int  # at max_model_len
    blocks_per_avg_seq: int | None
    max_concurrent_seqs_at_avg_len: int | None
    # Hybrid models (sliding-window layers): the figures above are the engine's hybrid layout
    # (a sliding group keeps its window plus a chunk of blocks per sequence); these set it
    # beside the full layout (--disable-hybrid-kv-cache-manager). None otherwise.
    sliding_layers: int = 0
    sliding_window: int | None = None
    layers_per_block: int | None = None  # layers' KV one block id holds (a group's)
    full_layout_bytes_per_seq: int | None = None  # per device, one max_model_len sequence
    hybrid_bytes_per_seq: int | None = None
    full_layout_max_concurrent_seqs: int | None = None
    hybrid_capacity_ratio: float | None = None  # full / hybrid bytes per sequence
    # A speculative draft model (--draft-model): its weights, and the KV each block holds for
    # it too (its pages share the target's block ids); counted in the budget and blocks above.
    draft_model: str | None = None
    draft_param_bytes: int = 0
    draft_bytes_per_block: int = 0
    quantization: str | None = None  # how the weights are counted ("fp8", "gguf"), or None
    lora_slot_bytes: int = 0  # --enable-lora: the adapter slots, per device (in the budget)

    def to_dict(self) -> dict[str, Any]:
        """All fields as a JSON-ready dict."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """One JSON object."""
        return json.dumps(self.to_dict())


def parse_memory(text: str | int, flag: str = "--gpu-memory") -> int:
    """Bytes in '80GiB', '80GB' (1e9), '512MiB', '1.5TiB' or plain '1024'."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _MEMORY.fullmatch(str(text))
        if not m:
            raise EstimateError(flag, f"cannot parse memory size {text!r}; use e.g. 80GiB, 80GB, "
                                "512MiB or a plain number of bytes")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if value <= 0:
        raise EstimateError(flag, f"memory size must be > 0, got {text!r}")
    return value


def load_spec(model: str | None, hf_overrides: dict[str, Any] | None = None
              ) -> tuple[Any, str | None, str]:
    """(ModelSpec, config torch_dtype or None, source) from the embedded default, a .gguf, an HF
    directory, a config.json or a hub repo id (config.json only; never weights), with
    `hf_overrides` laid over an HF config (as the loader lays them)."""
    from models.config import ModelSpec
    from models.loader import DEFAULT_MODEL, NAMED_GGUF_MODELS, embedded_gguf_path

    if hf_overrides and (model is None or model == DEFAULT_MODEL or model in NAMED_GGUF_MODELS
                         or model.lower().endswith(".gguf")):
        raise EstimateError("--hf-overrides", "hf_overrides apply to an HF model's "
                            f"config.json; {model or DEFAULT_MODEL!r} is a GGUF file")
    try:
        if model is None or model == DEFAULT_MODEL:
            return _gguf_spec(embedded_gguf_path()), None, DEFAULT_MODEL
        if model in NAMED_GGUF_MODELS:  # e.g. gemma3-270m (an optional extra)
            return _gguf_spec(NAMED_GGUF_MODELS[model]()), None, model
        path = Path(model).expanduser()
        if model.lower().endswith(".gguf"):
            if not path.is_file():
                raise FileNotFoundError(f"GGUF file not found: {path}")
            return _gguf_spec(path), None, str(path)
        if path.is_dir():
            path = path / "config.json"
            if not path.is_file():
                raise FileNotFoundError(f"config.json not found: {path}")
        elif not path.exists():
            if not _REPO_ID.match(model):
                raise FileNotFoundError(f"model not found: {model!r} (not a file, directory or "
                                        "HF repo id)")
            path = _download_config(model)
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {path} as JSON: {e}") from e
        if not isinstance(cfg, dict):
            raise ValueError(f"{path} does not hold a JSON object")
        cfg.update(hf_overrides or {})  # the loader's top-level update
        torch_dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        return ModelSpec.from_hf_config(cfg), torch_dtype, str(model)
    except (ValueError, OSError) as e:
        raise EstimateError("--model", str(e)) from e


def _gguf_spec(path: Path) -> Any:
    from models.gguf_loader import spec_from_gguf
    from models.gguf_meta import read_gguf_header

    meta, names = read_gguf_header(path)
    return spec_from_gguf(meta, names, path)


def _download_config(repo_id: str) -> Path:
    """config.json of a hub repo: the local cache first, then one download (never weights)."""
    from huggingface_hub import constants, hf_hub_download

    try:
        return Path(hf_hub_download(repo_id=repo_id, filename="config.json",
                                    local_files_only=True))
    except Exception:  # not cached: go online below
        pass
    reason = ""
    host = urlparse(constants.ENDPOINT).hostname or ""
    try:  # fail fast when offline instead of waiting out the hub client's retries
        socket.getaddrinfo(host, 443)
    except OSError as e:
        reason = f"cannot resolve {host}: {e}"
    if not reason:
        try:
            return Path(hf_hub_download(repo_id=repo_id, filename="config.json"))
        except Exception as e:  # offline mode, unknown or gated repo, ...
            reason = type(e).__name__
    raise OSError(f"{repo_id!r} is not a local path and its config.json could not be downloaded "
                  f"({reason}); pass a local HF model directory, a config.json or a .gguf file")


def _split(n: int, tp: int) -> int:
    return cdiv(n, tp)


def _gated_mlp_widths(spec: Any, layer: int) -> list[int]:
    """The width of each gated MLP (gate, up [d -> w], down [w -> d]) of decoder layer
    `layer`: the dense MLP's, or every expert's and a shared expert's."""
    if not spec.layer_is_sparse(layer):
        return [spec.intermediate_size]
    shared = spec.shared_expert_intermediate_size
    return [spec.moe_intermediate_size] * spec.num_experts + ([shared] if shared else [])


def _ffn_params(spec: Any, layer: int, t: int) -> int:
    """Feed-forward parameters of decoder layer `layer` on one of `t` devices: a dense MLP,
    or the router, every expert (each split by width) and a shared expert with its gate."""
    d = spec.hidden_size
    mlps = sum(3 * d * _split(w, t) for w in _gated_mlp_widths(spec, layer))
    if not spec.layer_is_sparse(layer):
        return mlps + ((2 * _split(spec.intermediate_size, t) + d) if spec.mlp_bias else 0)
    return d * spec.num_experts + mlps + (d if spec.shared_expert_intermediate_size else 0)


def param_counts(spec: Any, tp: int = 1) -> tuple[int, int]:
    """(parameters of the whole model, parameters held by one of `tp` devices)."""
    d, hd, v = spec.hidden_size, spec.head_dim, spec.vocab_size
    totals = []
    for t in (1, tp):
        q_heads = spec.num_heads // t
        kv = max(1, spec.num_kv_heads // t)  # replicated (one per device) when t > kv heads
        layer = d * (q_heads + 2 * kv) * hd + q_heads * hd * d  # q, k, v, o
        if spec.attention_bias:
            layer += (q_heads + 2 * kv) * hd
        if spec.o_proj_bias:
            layer += d  # row-parallel bias: whole on every device
        if spec.qk_norm:
            layer += 2 * hd
        layer += 2 * d  # two RMSNorms (replicated)
        if spec.is_gemma:
            layer += 2 * d  # Gemma's pre- and post-feedforward norms
        ffn = sum(_ffn_params(spec, i, t) for i in range(spec.num_layers))
        embed = _split(v, t) * d
        totals.append(spec.num_layers * layer + ffn
                      + embed * (1 if spec.tie_word_embeddings else 2) + d
                      + d * spec.num_labels)  # a classifier's score head (replicated)
    return totals[0], totals[1]


def _quantized_elements(spec: Any) -> tuple[int, int]:
    """(weights, output channels) a quantized model holds quantized: each layer's attention
    projections, dense MLP or experts (each expert's channels counted) and shared expert;
    routers and gates excluded. fp8 keeps a float32 scale per channel."""
    d, hd = spec.hidden_size, spec.head_dim
    q_kv = (spec.num_heads + 2 * spec.num_kv_heads) * hd
    weights = scales = 0
    for i in range(spec.num_layers):
        weights += d * q_kv + spec.num_heads * hd * d
        scales += q_kv + d
        for w in _gated_mlp_widths(spec, i):
            weights += 3 * d * w
            scales += 2 * w + d
    return weights, scales


def _ffn_width(spec: Any, tp: int) -> int:
    """The widest feed-forward activation a token makes on one of `tp` devices: the dense
    MLP's, or its experts' (num_experts_per_tok of them) plus a shared expert's."""
    widths = [_split(spec.intermediate_size, tp)]
    if spec.is_moe:
        widths.append(spec.num_experts_per_tok * _split(spec.moe_intermediate_size, tp)
                      + _split(spec.shared_expert_intermediate_size, tp))
    return max(widths)


def weight_bytes(spec: Any, wbytes: int, quantization: str | None, source: str,
                 model: str | None) -> int:
    """Bytes of the whole model's weights on the device: `wbytes` a parameter, or with
    "fp8" the decoder linears at one byte plus a float32 scale per output channel, or with
    "gguf" each tensor of the GGUF as it runs quantized (models/gguf_quant.py)."""
    n_params = param_counts(spec, 1)[0]
    qc = _hf_quantization_config(model)
    if quantization is None and qc is not None:  # a checkpoint quantized by its producer
        quantization = str(qc.get("quant_method", "")).lower()
    if quantization is None:
        return n_params * wbytes
    # The quantized matrices: every layer's projections, dense MLP or experts, shared expert
    # (routers and gates stay in the model's dtype); `channels`: their output channels.
    elements, channels = _quantized_elements(spec)
    rest = (n_params - elements) * wbytes
    if quantization in ("fp8", "compressed-tensors"):  # a float32 scale per output channel
        return rest + elements + 4 * channels
    if quantization in ("gptq", "awq"):  # int4/int8 groups, a float16 scale and min each
        bits = int((qc or {}).get("bits", 4))
        group = int((qc or {}).get("group_size", 128))
        groups = elements // group if group > 0 else channels
        total = rest + elements * bits // 8 + 4 * groups
        if (qc or {}).get("lm_head") and not spec.tie_word_embeddings:  # GPTQ's quantized head
            head = spec.hidden_size * spec.vocab_size
            head_groups = head // group if group > 0 else spec.vocab_size
            total += head * bits // 8 + 4 * head_groups - head * wbytes
        return total
    path = _gguf_path(model)
    if path is None:
        raise EstimateError("--quantization", f"'gguf' runs a GGUF at its own quantization; "
                            f"{source} is not a .gguf file")
    import gguf

    from models.gguf_loader import gguf_to_hf_name
    from models.gguf_meta import read_gguf
    from models.gguf_quant import device_bytes

    meta, tensors = read_gguf(path, full=False)
    arch = meta.get("general.architecture", "llama")
    return sum(device_bytes(gguf.GGMLQuantizationType(t.ggml_type), t.shape, wbytes)
               for t in tensors.values() if gguf_to_hf_name(t.name, arch) is not None)


def _hf_quantization_config(model: str | None) -> dict[str, Any] | None:
    """The `quantization_config` of an HF model's config.json (None: none, or not HF)."""
    if model is None or model.lower().endswith(".gguf"):
        return None
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    elif not path.exists():
        return None  # a hub id or a packaged name: config-only estimates count it unquantized
    try:
        qc = json.loads(path.read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    return qc if isinstance(qc, dict) else None


def _gguf_path(model: str | None) -> Path | None:
    """The GGUF file `model` names (the embedded default, a packaged name, a path), or None."""
    from models.loader import DEFAULT_MODEL, NAMED_GGUF_MODELS, embedded_gguf_path

    if model is None or model == DEFAULT_MODEL:
        return embedded_gguf_path()
    if model in NAMED_GGUF_MODELS:
        return NAMED_GGUF_MODELS[model]()
    return Path(model).expanduser() if model.lower().endswith(".gguf") else None


def estimate_capacity(
    model: str | None = None, *, gpu_memory: int | str = "80GiB",
    gpu_memory_utilization: float = 0.9, block_size: int = DEFAULT_BLOCK_SIZE,
    kv_cache_dtype: str = "auto", max_model_len: int | None = None, avg_len: int | None = None,
    tensor_parallel_size: int = 1, dtype: str = "auto",
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, draft_model: str | None = None,
    quantization: str | None = None, enable_lora: bool = False, max_loras: int = 1,
    max_lora_rank: int = 16, hf_overrides: dict[str, Any] | str | None = None,
) -> CapacityEstimate:
    """Plan the KV pool; raises EstimateError (a ValueError naming the flag) on bad input.
    `hf_overrides`: the engine's (a dict or JSON text), laid over an HF config.json."""
    mem = parse_memory(gpu_memory)
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise EstimateError("--gpu-memory-utilization", f"must be in (0, 1], got "
                            f"{gpu_memory_utilization}")
    if block_size < 1 or block_size & (block_size - 1) or block_size > 1024:
        raise EstimateError("--block-size", f"must be a power of two in [1, 1024] (tokens), got "
                            f"{block_size}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise EstimateError("--kv-cache-dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}; "
                            f"got {kv_cache_dtype!r}")
    dtype = canonical_dtype(dtype)
    if dtype not in MODEL_DTYPES:
        raise EstimateError("--dtype", f"must be one of {', '.join(MODEL_DTYPES)}; got {dtype!r}")
    for flag, value in (("--tensor-parallel-size", tensor_parallel_size),
                        ("--max-num-batched-tokens", max_num_batched_tokens),
                        ("--max-num-seqs", max_num_seqs)):
        if value < 1:
            raise EstimateError(flag, f"must be >= 1, got {value}")
    lora_config = None
    if enable_lora:  # the engine's rules for its LoRA slots, with the flags named
        try:
            lora_config = LoRAConfig(max_loras, max_lora_rank)
        except ValueError as e:
            flag = "--max-loras" if "max_loras" in str(e) else "--max-lora-rank"
            raise EstimateError(flag, "must " + str(e).split(" must ", 1)[1]) from None
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise EstimateError("--quantization", f"must be one of "
                            f"{', '.join(QUANTIZATION_METHODS)}; got {quantization!r}")
    try:
        overrides = parse_hf_overrides(hf_overrides)
    except ValueError as e:
        raise EstimateError("--hf-overrides", str(e)) from None
    spec, torch_dtype, source = load_spec(model, overrides)

    if dtype == "auto":  # the checkpoint's dtype; GGUF weights are dequantized to bf16 on GPUs
        dtype = _TORCH_DTYPES.get(str(torch_dtype).removeprefix("torch."), "bfloat16")
    kv_dtype = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    kv_dtype = "fp8_e4m3" if kv_dtype == "fp8" else kv_dtype
    wbytes, kvbytes = DTYPE_BYTES[dtype], DTYPE_BYTES[kv_dtype]

    model_max = spec.max_position_embeddings
    if max_model_len is None:
        max_model_len = min(model_max, 2048)  # the engine's default
    elif max_model_len == -1:  # vLLM's "auto", as the engine reads it
        max_model_len = model_max
    if not 1 <= max_model_len <= model_max:
        raise EstimateError("--max-model-len", f"must be in [1, {model_max}] (the model's "
                            f"max_position_embeddings), got {max_model_len}")
    if avg_len is not None and not 1 <= avg_len <= max_model_len:
        raise EstimateError("--avg-len", f"must be in [1, --max-model-len={max_model_len}], got "
                            f"{avg_len}")

    tp, kvh = tensor_parallel_size, spec.num_kv_heads
    if spec.num_heads % tp or (kvh % tp if tp <= kvh else tp % kvh):
        raise EstimateError("--tensor-parallel-size", f"{tp} must divide the {spec.num_heads} "
                            f"attention heads and divide (or be a multiple of) the {kvh} KV heads")
    kv_per_dev = max(1, kvh // tp)
    per_token = int(spec.kv_bytes_per_token(kvbytes))
    per_token_dev = 2 * spec.num_layers * kv_per_dev * spec.head_dim * kvbytes
    n_params, n_params_dev = param_counts(spec, tp)
    weights = weight_bytes(spec, wbytes, quantization, source, model)
    weights_dev = round(weights * n_params_dev / n_params)  # quantized bytes split as params
    widths = (2 * (spec.num_heads // tp) + 2 * kv_per_dev) * spec.head_dim
    act = (max_num_batched_tokens * wbytes
           * (2 * spec.hidden_size + widths + 3 * _ffn_width(spec, tp))
           + max_num_seqs * spec.vocab_size * 4)
    draft_params = draft_block = 0
    draft_source = None
    if draft_model is not None:  # speculative decoding: a draft sharing the blocks
        if tp > 1:
            raise EstimateError("--draft-model", "a draft model runs with tensor parallel size "
                                "1 in this version")
        dspec, _, draft_source = load_spec(draft_model)
        if dspec.vocab_size != spec.vocab_size:
            raise EstimateError("--draft-model", f"its vocabulary ({dspec.vocab_size} tokens) "
                                f"is not the target's ({spec.vocab_size})")
        draft_params = param_counts(dspec, 1)[0] * wbytes
        draft_block = block_size * int(dspec.kv_bytes_per_token(kvbytes))
    # LoRA: every slot of every projection, whole on each device (the engine replicates them).
    lora_bytes = (0 if lora_config is None else
                  lora_slot_bytes(spec, lora_config.max_loras, lora_config.max_lora_rank,
                                  wbytes))
    budget = (int(mem * gpu_memory_utilization) - weights_dev - draft_params - lora_bytes - act
              - RUNTIME_MARGIN_BYTES)
    # The engine's layout: a block id holds `num_slots` layers' KV (all of them without
    # sliding layers); a request's blocks over every group, sliding ones capped by their
    # window plus a chunk (the chunk is max_num_batched_tokens: chunked prefill is on).
    layout = kv_cache_layout(spec.layer_windows)
    layer_block_dev = block_size * per_token_dev // spec.num_layers
    block_dev = layer_block_dev * layout.num_slots + draft_block
    blocks_of = blocks_by_length(layout, block_size, max_num_batched_tokens)
    blocks_per_seq = blocks_of(max_model_len)
    if budget < 2 * block_dev:
        raise EstimateError("--gpu-memory", f"{mem:,} bytes x {gpu_memory_utilization} minus "
                            f"{weights_dev:,} bytes of weights, {act:,} of activations "
                            f"and a {RUNTIME_MARGIN_BYTES:,} margin leaves {budget:,} bytes for "
                            f"the KV cache: not two blocks of {block_dev:,} bytes (the null block "
                            "and one more)")
    num_blocks = budget // block_dev
    usable = num_blocks - 1  # block 0 is the null block
    if usable < blocks_per_seq:
        fit = largest_fitting(blocks_of, usable, max_model_len)
        raise EstimateError("--max-model-len", f"one sequence of {max_model_len} tokens needs "
                            f"{blocks_per_seq} blocks but only {usable} fit; the largest "
                            f"max_model_len that fits is {fit}")
    per_avg = None if avg_len is None else blocks_of(avg_len)
    hybrid = _hybrid_fields(spec, layout, layer_block_dev, blocks_per_seq, max_model_len,
                            block_size, usable * block_dev)
    return CapacityEstimate(
        model=source, architecture=spec.hf_architecture, num_layers=spec.num_layers,
        num_kv_heads=kvh, head_dim=spec.head_dim, dtype=dtype, kv_cache_dtype=kv_dtype,
        block_size=block_size, max_model_len=max_model_len, avg_len=avg_len,
        tensor_parallel_size=tp, gpu_memory_bytes=mem,
        gpu_memory_utilization=gpu_memory_utilization, bytes_per_token=per_token,
        bytes_per_block=block_size * per_token, param_count=n_params,
        param_bytes=weights, kv_heads_per_device=kv_per_dev,
        bytes_per_token_per_device=per_token_dev, bytes_per_block_per_device=block_dev,
        param_bytes_per_device=weights_dev, activation_bytes=act, quantization=quantization,
        margin_bytes=RUNTIME_MARGIN_BYTES, kv_budget_bytes=budget, num_blocks=num_blocks,
        blocks_per_seq=blocks_per_seq, max_concurrent_seqs=usable // blocks_per_seq,
        blocks_per_avg_seq=per_avg,
        max_concurrent_seqs_at_avg_len=None if per_avg is None else usable // per_avg,
        **hybrid, draft_model=draft_source, draft_param_bytes=draft_params,
        draft_bytes_per_block=draft_block, lora_slot_bytes=lora_bytes,
    )


def _hybrid_fields(spec: Any, layout: KVCacheLayout, layer_block_bytes: int,
                   blocks_per_seq: int, max_model_len: int, block_size: int,
                   usable_bytes: int) -> dict[str, Any]:
    """A sliding model's bytes per max_model_len sequence in the hybrid layout (the engine's)
    and in the full one (--disable-hybrid-kv-cache-manager), and what each fits."""
    sliding = [w for w in spec.layer_windows if w is not None]
    if not sliding:
        return {}
    full = spec.num_layers * cdiv(max_model_len, block_size) * layer_block_bytes
    hybrid = blocks_per_seq * layout.num_slots * layer_block_bytes
    return {"sliding_layers": len(sliding), "sliding_window": max(sliding),
            "layers_per_block": layout.num_slots,
            "full_layout_bytes_per_seq": full, "hybrid_bytes_per_seq": hybrid,
            "full_layout_max_concurrent_seqs": usable_bytes // full,
            "hybrid_capacity_ratio": full / hybrid}


def human_bytes(n: int) -> str:
    """'12.5 MiB'-style rendering (binary units)."""
    if abs(n) < 1024:
        return f"{n:,} B"
    exp = min(int(math.log(abs(n), 1024)), 4)
    return f"{n / 1024**exp:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][exp]}"


def rows(est: CapacityEstimate) -> list[tuple[str, str]]:
    """(quantity, value) rows for the table; exact figures are in `to_dict()`."""
    e, tp = est, est.tensor_parallel_size
    out = [
        ("model", e.model),
        ("layers x kv heads x head_dim", f"{e.num_layers} x {e.num_kv_heads} x {e.head_dim}"),
        ("weights / KV cache dtype", f"{e.dtype} / {e.kv_cache_dtype}"),
        ("KV bytes per token", f"{e.bytes_per_token:,} B"),
        (f"KV bytes per block ({e.block_size} tokens)",
         f"{e.bytes_per_block:,} B = {human_bytes(e.bytes_per_block)}"),
        ("parameters", f"{e.param_count / 1e9:.2f} billion = {human_bytes(e.param_bytes)}"
         + ("" if e.quantization is None else f" ({e.quantization})")),
    ]
    if tp > 1:
        out += [
            ("tensor parallel size", f"{tp} ({e.kv_heads_per_device} KV heads per device)"),
            ("KV bytes per token, per device", f"{e.bytes_per_token_per_device:,} B"),
            ("KV bytes per block, per device", human_bytes(e.bytes_per_block_per_device)),
            ("parameters, per device", human_bytes(e.param_bytes_per_device)),
        ]
    if e.lora_slot_bytes:
        out += [("LoRA adapter slots", human_bytes(e.lora_slot_bytes))]
    if e.draft_model is not None:
        out += [("draft model (speculative)", e.draft_model),
                ("draft weights", human_bytes(e.draft_param_bytes)),
                ("draft KV bytes per block", human_bytes(e.draft_bytes_per_block))]
    dev = " per device" if tp > 1 else ""
    out += [
        (f"gpu memory{dev} x utilization",
         f"{human_bytes(e.gpu_memory_bytes)} x {e.gpu_memory_utilization}"),
        ("activations + runtime margin",
         f"{human_bytes(e.activation_bytes)} + {human_bytes(e.margin_bytes)}"),
        (f"KV budget{dev}", human_bytes(e.kv_budget_bytes)),
        ("num blocks (incl. 1 null block)", f"{e.num_blocks:,}"),
        ("pool capacity", f"{(e.num_blocks - 1) * e.block_size:,} tokens" if
         e.hybrid_bytes_per_seq is None else "(in KV cache groups: blocks per sequence below)"),
        (f"blocks per {e.max_model_len}-token sequence", f"{e.blocks_per_seq:,}"),
        (f"max concurrent seqs @ {e.max_model_len} tokens", f"{e.max_concurrent_seqs:,}"),
    ]
    if e.avg_len is not None:
        out += [(f"max concurrent seqs @ {e.avg_len} tokens",
                 f"{e.max_concurrent_seqs_at_avg_len:,}")]
    if e.hybrid_bytes_per_seq is not None:
        full_layers = e.num_layers - e.sliding_layers
        out += [
            ("sliding / full-attention layers",
             f"{e.sliding_layers} (window {e.sliding_window:,}) / {full_layers}"),
            ("layers per block id (KV cache groups)",
             f"{e.layers_per_block} = {human_bytes(e.bytes_per_block_per_device)}"),
            (f"KV per seq{dev}, hybrid layout",
             f"{human_bytes(e.hybrid_bytes_per_seq)} ({e.hybrid_capacity_ratio:.2f}x less)"),
            (f"KV per seq{dev}, full layout", human_bytes(e.full_layout_bytes_per_seq)),
            ("max seqs, full layout", f"{e.full_layout_max_concurrent_seqs:,}"),
        ]
    return out
