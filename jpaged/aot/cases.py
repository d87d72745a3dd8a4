"""The engine's real jitted step (and KV tier programs) on abstract weights, lowered for a target.

Nothing is allocated: the model is built with `nnx.eval_shape`, the pool and the step batch are
ShapeDtypeStructs, and each carries the sharding of the device it is compiled for (an abstract
H200 of `target.h200_target`, or the local CPU). The step is `ModelRunner._jit_step` itself, with
the engine's bucket plan from EngineArgs defaults, so what compiles here is what the engine runs.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jpaged.aot.traffic import StepTraffic
from jpaged.config import EngineArgs, EngineConfig
from jpaged.core.kv_cache_groups import kv_cache_layout
from jpaged.runner.batch import BucketPlan, empty_step, flatten_step
from jpaged.runner.kv_cache import KVCache, kv_dtype, storage_dtype
from jpaged.runner.lora import LoraSlots
from jpaged.runner.memory_probe import abstract_kv
from jpaged.runner.model_runner import ModelRunner
from jpaged.runner.parallel import TensorParallel
from jpaged.runner.sampler import SamplingFlags
from jpaged.runner.tier_transfer import _gather_impl, _scatter_impl
from models.config import ModelSpec
from models.loader import abstract_model
from models.quant_layers import QuantLayout, apply_plan, fp8_plan
from pallas_kernels.backend import select_backend

# The step with top candidates on (what a request with logprobs runs): the default step is the
# same program without its top-k. The decode cases, whose HBM traffic is reported, compile the
# default step (DECODE_FLAGS), what a batch without logprobs requests runs (the top-20 adds
# ~40 MB to a SmolLM2 batch-64 step), as a pure decode step (the engine's T == B steps: the
# split-K kernel alone). The shapes that mixed steps share with decode, (64, 64) and
# (256, 256), are compiled as decode steps only.
TOP_FLAGS = SamplingFlags(top_logprobs=True)
DECODE_FLAGS = SamplingFlags(decode_only=True)
# A verifying step (speculative decoding) as a batch without logprobs runs it: the default
# step, its attention the tiled ragged kernel (several new tokens a sequence).
VERIFY_FLAGS = SamplingFlags()

# Meta-Llama-3-8B's config.json fields that shape the model (no weights are needed).
LLAMA3_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": False, "bos_token_id": 128000,
    "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
# google/gemma-3-270m's text config (the `gemma3` extra's GGUF holds the same shapes): 15
# sliding layers of 512 tokens, 3 global, head_dim 256 (the kernels' widest), a 262k vocabulary.
GEMMA3_270M_CONFIG: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144, "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "rope_local_base_freq": 10000.0, "sliding_window": 512, "query_pre_attn_scalar": 256,
    "max_position_embeddings": 32768, "hidden_activation": "gelu_pytorch_tanh",
    "bos_token_id": 2, "eos_token_id": 1, "torch_dtype": "bfloat16",
}
# meta-llama/Llama-3.2-1B's config.json shapes: Llama 3's tokenizer and vocabulary, so it
# drafts for Llama-3-8B (speculative decoding's `draft_model`; `make gpu-aot --spec`).
LLAMA32_1B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072, "tie_word_embeddings": True, "bos_token_id": 128000,
    "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
# Qwen/Qwen3-30B-A3B's config.json shapes: a mixture of experts, 8 of 128 experts of width 768
# a token in each of 48 layers (~3B of its 30B parameters active), q/k norms, 4 KV heads.
QWEN3_30B_A3B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "max_position_embeddings": 40960, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "tie_word_embeddings": False, "bos_token_id": 151643,
    "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
MODELS = ("smollm2-135m", "llama3-8b", "gemma3-270m", "llama3.2-1b", "qwen3-30b-a3b")
# Weights kept quantized on the device (models/quant.py), besides the model dtype's: "fp8" per
# output channel (`--quantization fp8`: every decoder linear, embeddings and head unchanged),
# "int4" in groups of 128 with float16 scales and mins (the layout of the GPTQ and AWQ 4-bit
# checkpoints of Llama-3-8B most users serve), every decoder linear and the output head (GPTQ's
# `lm_head`, as a GGUF's head is quantized too; the head runs on the decode kernels).
WEIGHTS = ("fp8", "int4")
INT4_GROUP = 128
_CONFIGS = {"llama3-8b": LLAMA3_8B_CONFIG, "gemma3-270m": GEMMA3_270M_CONFIG,
            "llama3.2-1b": LLAMA32_1B_CONFIG, "qwen3-30b-a3b": QWEN3_30B_A3B_CONFIG}

# XLA's short names of the pool storage dtypes.
_XLA_DTYPE = {"uint8": "u8", "uint16": "u16", "bfloat16": "bf16", "float16": "f16",
              "float32": "f32"}


def model_source(name: str, weights: str | None = None) -> str | None:
    """What `jpaged estimate --model` takes for a model name (None = the embedded default);
    `weights` "int4": a config whose quantization_config says 4-bit groups of INT4_GROUP
    (estimate counts a float16 scale and min a group, as the device holds them)."""
    if name == "smollm2-135m":
        return None
    if name in _CONFIGS:
        config = dict(_CONFIGS[name])
        if weights == "int4":
            config["quantization_config"] = {"quant_method": "gptq", "bits": 4,
                                             "group_size": INT4_GROUP, "lm_head": True}
        tag = f"-{weights}" if weights == "int4" else ""
        path = Path(tempfile.gettempdir()) / f"jpaged-aot-{name}{tag}" / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config))
        return str(path)
    raise ValueError(f"model must be one of {', '.join(MODELS)}; got {name!r}")


def int4_plan(model: nnx.Module, group: int = INT4_GROUP) -> dict[str, QuantLayout]:
    """Every decoder layer's linear and an untied output head as int4 in groups of `group`,
    float16 scales and mins."""
    head = ["lm_head"] if getattr(model, "lm_head", None) is not None else []
    return {path: QuantLayout("int4", group, True, "float16")
            for path in [*fp8_plan(model), *head]}


def quantize_abstract(model: nnx.Module, weights: str | None, int4_group: int = INT4_GROUP
                      ) -> nnx.Module:
    """`model` (abstract) with its decoder linears (int4: and its untied head, groups of
    `int4_group`) quantized as `weights` says (in place)."""
    if weights is None:
        return model
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)} (or None); got {weights!r}")
    apply_plan(model, fp8_plan(model) if weights == "fp8" else int4_plan(model, int4_group))
    return model


def model_spec(name: str) -> ModelSpec:
    """The ModelSpec of a named shape: the embedded GGUF's header, or a config above."""
    if name == "smollm2-135m":
        from jpaged.estimate import load_spec

        return load_spec(None)[0]
    model_source(name)  # validates the name
    return ModelSpec.from_hf_config(_CONFIGS[name])


def engine_config(spec: ModelSpec, **engine_args: Any) -> EngineConfig:
    """The engine's config for this model from EngineArgs defaults (plus overrides)."""
    return EngineArgs(**engine_args).create_engine_config(spec.max_position_embeddings)


def pool_shape(spec: ModelSpec, num_blocks: int, block_size: int, kv_heads: int,
               dtype: jnp.dtype, kv_layers: int | None = None) -> str:
    """XLA's text of one pool array's shape per device, e.g. u8[61440,16,3,64] (`kv_layers`:
    the KV cache layout's slots per block when not every layer)."""
    layers = spec.num_layers if kv_layers is None else kv_layers
    dims = (layers * num_blocks, block_size, kv_heads, spec.head_dim)
    return f"{_XLA_DTYPE[storage_dtype(dtype).name]}[{','.join(map(str, dims))}]"


@dataclass
class StepBuilder:
    """One engine configuration (model, dtypes, backend, devices, pool) whose steps are lowered.

    `devices`: abstract GPU devices (a deviceless compile) or None for the local default backend.
    `weights`: decoder linears kept quantized ("fp8", "int4": `quantize_abstract`), or None.
    `lora`: (max_loras, max_lora_rank) of an engine serving LoRA adapters, or None.
    """

    spec: ModelSpec
    model_dtype: Any
    kv_cache_dtype: str
    backend: str
    num_blocks: int
    devices: Sequence[Any] | None = None
    tensor_parallel_size: int = 1
    config: EngineConfig | None = None
    weights: str | None = None
    lora: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        self.config = self.config or engine_config(self.spec)
        self.plan = BucketPlan.for_config(self.config)
        # The engine's KV cache groups (hybrid: sliding layers keep their window only).
        self.kv_layout = kv_cache_layout(
            self.spec.layer_windows,
            hybrid=not self.config.cache.disable_hybrid_kv_cache_manager)
        self.plan.num_groups = self.kv_layout.num_groups
        self.block_size = self.config.cache.block_size
        self.page_dtype = kv_dtype(self.kv_cache_dtype, self.model_dtype)
        gpu = self.devices is not None
        self.platform = "cuda" if gpu else jax.default_backend()
        self.ops = select_backend(self.backend, platform=self.platform)

    @cached_property
    def parallel(self) -> TensorParallel | None:
        """The tensor-parallel layout over the first N devices (None for one device)."""
        if self.tensor_parallel_size == 1:
            return None
        devices = self.devices if self.devices is not None else jax.devices()
        return TensorParallel(self.spec, self.tensor_parallel_size, devices)

    def _single(self) -> SingleDeviceSharding | None:
        return SingleDeviceSharding(self.devices[0]) if self.devices is not None else None

    def _abstract(self, x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=self._single())

    @property
    def stored_kv_heads(self) -> int:
        """KV heads of the pool array (replicated heads included under tensor parallelism)."""
        tp = self.parallel
        return self.spec.num_kv_heads if tp is None else tp.layout.stored_kv_heads

    @property
    def local_kv_heads(self) -> int:
        """KV heads of one device's shard of the pool."""
        return self.stored_kv_heads // self.tensor_parallel_size

    def abstract_kv(self) -> KVCache:
        """The pool as ShapeDtypeStructs (per-device placement added by ModelRunner for TP)."""
        return abstract_kv(self.spec, self.num_blocks, self.block_size, self.page_dtype,
                           kv_heads=self.stored_kv_heads, sharding=self._single(),
                           kv_layers=self.kv_layout.num_slots)

    @cached_property
    def abstract_model(self) -> nnx.Module:
        """The model with ShapeDtypeStruct weights (nothing allocated, nothing initialized),
        its decoder linears quantized as `weights` says."""
        return quantize_abstract(abstract_model(self.spec, self.model_dtype), self.weights)

    @cached_property
    def runner(self) -> ModelRunner:
        """A ModelRunner on abstract weights and pool (its jitted step is the engine's)."""
        model = self.abstract_model
        if self.parallel is None and self.devices is not None:
            graphdef, state = nnx.split(model)
            model = nnx.merge(graphdef, jax.tree.map(self._abstract, state))
        lora = None
        if self.lora is not None:  # replicated on a mesh, as the engine places them
            lora = LoraSlots.abstract(self.spec, *self.lora, self.model_dtype,
                                      self._replicated())
        return ModelRunner(model, self.abstract_kv(), self.plan, self.block_size,
                           self.spec.vocab_size, self.ops, parallel=self.parallel,
                           kv_layout=self.kv_layout, platform=self.platform, lora=lora)

    def _replicated(self) -> Any:
        """The sharding of an array whole on every device of the case."""
        if self.parallel is None:
            return self._single()
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        return NamedSharding(self.parallel.mesh, P())

    @property
    def param_bytes(self) -> int:
        """Parameter bytes per device (LoRA slots included: every step reads them)."""
        params = self.runner.params
        slots = self.runner.lora.nbytes if self.runner.lora is not None else 0
        if self.parallel is not None:
            return self.parallel.param_bytes_per_device(params) + slots
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)) + slots

    @property
    def pool_bytes(self) -> int:
        """Bytes of K and V pages per device."""
        per = (self.kv_layout.num_slots * self.num_blocks * self.block_size * self.local_kv_heads
               * self.spec.head_dim * storage_dtype(self.page_dtype).itemsize)
        return 2 * per

    @property
    def num_weights(self) -> int:
        """Leaves of the params pytree: the step's entry parameters 0..n-1 (jitted order)."""
        return len(jax.tree_util.tree_leaves(self.runner.params))

    @property
    def lookup_weights(self) -> tuple[int, ...]:
        """Entry parameter numbers of the token embedding table(s) (rows read by id)."""
        leaves = jax.tree_util.tree_leaves_with_path(self.runner.params)
        return tuple(k for k, (path, _) in enumerate(leaves)
                     if "embed_tokens" in jax.tree_util.keystr(path))

    def traffic_case(self, tokens: int, seqs: int, context_len: int) -> StepTraffic:
        """The HBM-traffic description of step (tokens, seqs) at a context length."""
        spec, tp = self.spec, self.tensor_parallel_size
        itemsize = jnp.dtype(self.model_dtype).itemsize
        width = spec.moe_intermediate_size // tp
        # One expert matrix's bytes: the model's dtype; fp8 values and a float32 scale per
        # output channel (at most hidden of them); int4 values, half a byte, and a float16
        # scale and min a group.
        elements = spec.hidden_size * width
        matrix = {"fp8": elements + 4 * spec.hidden_size,
                  "int4": elements // 2 + 4 * (elements // INT4_GROUP)}.get(
                      self.weights or "", elements * itemsize)
        moe = {} if not spec.is_moe else {
            "sparse_layers": sum(map(spec.layer_is_sparse, range(spec.num_layers))),
            "num_experts": spec.num_experts, "top_k": spec.num_experts_per_tok,
            "expert_matrix_bytes": matrix, "expert_width": width,
            "expert_hidden": spec.hidden_size}
        return StepTraffic(tokens, seqs, context_len, spec.num_layers, self.block_size,
                           self.local_kv_heads, spec.head_dim,
                           storage_dtype(self.page_dtype).itemsize, spec.vocab_size,
                           self.param_bytes, self.num_blocks, spec.layer_windows,
                           spec.num_heads // tp // self.local_kv_heads, itemsize, **moe)

    def pool_shape(self) -> str:
        """One pool array's XLA shape per device."""
        return pool_shape(self.spec, self.num_blocks, self.block_size, self.local_kv_heads,
                          self.page_dtype, self.kv_layout.num_slots)

    def _step_input(self, x: Any) -> jax.ShapeDtypeStruct:
        """A step-batch leaf as an abstract value: replicated over the mesh, or on one device."""
        if self.parallel is None:
            return self._abstract(x)
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        return jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                    sharding=NamedSharding(self.parallel.mesh, P()))

    def lower_step(self, tokens: int, seqs: int, flags: SamplingFlags = TOP_FLAGS,
                   num_rows: int | None = None) -> Any:
        """The engine step of bucket shape (tokens, seqs[, sampled rows: default seqs]),
        lowered (call inside the target's lowering context for abstract GPUs); by default the
        variant with top candidates."""
        r = self.runner
        packed = empty_step(self.plan, tokens, seqs, self.spec.vocab_size, num_rows=num_rows)
        if r.lora is not None:  # each token's adapter slot, as a LoRA engine's steps carry
            packed.batch.lora_slots = np.full(tokens, -1, np.int32)
        batch = jax.tree.map(self._step_input, flatten_step(packed.batch))
        return r._jit_step.trace(r.params, r.kv, batch, self._step_input(r.last_tokens_spec()),
                                 flags=flags, calc_scales=False,
                                 lora_weights=None if r.lora is None else r.lora.weights
                                 ).lower(lowering_platforms=(self.platform,))

    def lower_transfer(self, kind: str, num_blocks: int) -> Any:
        """The KV tier's batched gather ('gather') or donated scatter ('scatter') program."""
        kv = self.runner.kv
        ids = self._abstract(np.zeros(num_blocks, np.int32))
        if kind == "gather":
            return jax.jit(_gather_impl).trace(kv, ids).lower(
                lowering_platforms=(self.platform,))
        block = (num_blocks, self.kv_layout.num_slots, 2, self.block_size, self.stored_kv_heads,
                 self.spec.head_dim)
        data = jax.ShapeDtypeStruct(block, jnp.dtype(self.page_dtype), sharding=self._single())
        return jax.jit(_scatter_impl, donate_argnames=("kv",)).trace(kv, ids, data).lower(
            lowering_platforms=(self.platform,))
