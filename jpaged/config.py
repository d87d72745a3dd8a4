"""Frozen engine configuration (names follow vLLM) and EngineArgs, which builds it."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jpaged.kv_events import KVEventsConfig, parse_json_config
from jpaged.pooling_params import RUNNERS, PoolerConfig

# Defaults live here and nowhere else (house rule 8).
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# /v1/responses answers a server keeps for previous_response_id (the newest first).
DEFAULT_MAX_STORED_RESPONSES = 1000
DEFAULT_KV_CACHE_DIR = "~/.cache/jpaged/kv"  # the disk KV tier when kv_cache_dir is None
# JAX's persistent compilation cache, unless JPAGED_COMPILE_CACHE_DIR says otherwise ("off":
# none) or the process configured one itself (jax_compilation_cache_dir).
DEFAULT_COMPILE_CACHE_DIR = "~/.cache/jpaged/xla"
COMPILE_CACHE_ENV = "JPAGED_COMPILE_CACHE_DIR"
# The prefix-cache hash seed when --prefix-caching-hash-seed is not given (a deployment's
# secret need not appear on a command line).
HASH_SEED_ENV = "JPAGED_PREFIX_CACHING_HASH_SEED"
DEFAULT_LOG_STATS_INTERVAL = 10.0  # seconds between periodic stats log lines
# Multi-process runs: vLLM's --master-addr/--master-port defaults; the bound on joining and on
# noticing a dead process (jpaged/runner/multiprocess.py).
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29501
DEFAULT_DISTRIBUTED_TIMEOUT_S = 120.0

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
PREEMPTION_MODES = ("recompute", "swap")
ATTENTION_BACKENDS = ("auto", "pallas", "reference", "xla")
HASH_ALGOS = ("sha256", "xxhash")
SCHEDULING_POLICIES = ("priority", "fcfs", "lpm")
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's other spellings of two of them (its --dtype choices).
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def canonical_dtype(dtype: Any) -> Any:
    """A dtype name as MODEL_DTYPES spells it ("half" -> "float16"); anything else as is."""
    return DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype
# vLLM's --quantization names jpaged has: "fp8" quantizes the decoder linears at load (or
# names an fp8 checkpoint's own), "gguf" keeps a GGUF at its own quantization; the others name
# the method of a checkpoint quantized by its producer, which loads as it is without them too
# (docs/quantization.md).
QUANTIZATION_METHODS = ("fp8", "gguf", "gptq", "awq", "compressed-tensors")
# Methods that quantize at load (the rest only confirm a checkpoint's own).
QUANTIZE_AT_LOAD = ("fp8", "gguf")
# vLLM's --max-logprobs default: the most logprobs (and prompt_logprobs) a request may ask for.
DEFAULT_MAX_LOGPROBS = 20
# vLLM's --logprobs-mode values. jpaged returns logprobs of the raw logits (no temperature or
# top-k/top-p), vLLM's default; the other three modes are refused by name.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
SUPPORTED_LOGPROBS_MODES = ("raw_logprobs",)
# Disaggregated prefill/decode (--kv-transfer-config): the connectors and roles (vLLM's names).
KV_CONNECTORS = ("JaxTransferConnector", "SharedStorageConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
DEFAULT_KV_PORT = 14579  # vLLM's default kv_port
# How long a producer keeps a finished request's blocks for a consumer that never pulls them
# (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT is 480 s; a pull takes milliseconds here).
DEFAULT_KV_ABORT_TIMEOUT_S = 120.0
DEFAULT_KV_TRANSFER_TIMEOUT_S = 30.0  # a consumer gives up on a producer that does not answer
# Structured outputs (--structured-outputs-config): the grammar behaviours a config may name,
# spelled as vLLM's backends. jpaged compiles every grammar with llguidance; "auto" behaves as
# vLLM's default (xgrammar, strict: listed properties only), "guidance" as vLLM's guidance
# backend (an object schema that does not say additionalProperties allows any other key).
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "guidance")
# Speculative decoding (--speculative-config): the methods jpaged runs (vLLM's names) and the
# most tokens one request may propose per step (each is one more row of the verifying step).
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 32


MAX_LORA_RANK = 512  # vLLM's largest


def _fail(cls: str, name: str, allowed: str, value: object) -> None:
    raise ValueError(f"{cls}.{name} must be {allowed}, got {value!r}")


def _is_classifier_dir(model: object) -> bool:
    """Whether `model` is a local directory whose config.json names a sequence classifier
    (HF `*ForSequenceClassification`)."""
    try:
        cfg = json.loads((Path(str(model)).expanduser() / "config.json").read_text())
        archs = cfg.get("architectures") or []
        return str(archs[0]).endswith("ForSequenceClassification")
    except (OSError, ValueError, AttributeError, IndexError, TypeError):
        return False


def parse_hf_overrides(value: object) -> dict[str, Any] | None:
    """EngineArgs.hf_overrides as a dict (from a dict or JSON text), or None; ValueError
    naming the field otherwise."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"EngineArgs.hf_overrides is not JSON: {e}") from e
    if not isinstance(value, Mapping):
        raise ValueError(f"EngineArgs.hf_overrides must be a JSON object of config.json "
                         f"fields, got {type(value).__name__}")
    return dict(value)


def _runner(runner: object, pooler_config: object, model: object = None,
            hf_overrides: dict[str, Any] | None = None) -> str:
    """EngineArgs.runner resolved: "auto" is "pooling" when a pooler_config is given or the
    model is a local sequence classifier (its config.json, or hf_overrides' architectures, as
    vLLM's auto runner)."""
    if runner not in RUNNERS:
        _fail("EngineArgs", "runner", f"one of {RUNNERS}", runner)
    if runner == "auto":
        archs = (hf_overrides or {}).get("architectures")
        named = (str(archs[0]).endswith("ForSequenceClassification")
                 if isinstance(archs, list) and archs else _is_classifier_dir(model))
        return "pooling" if pooler_config is not None or named else "generate"
    if runner == "generate" and pooler_config is not None:
        raise ValueError("EngineArgs.pooler_config is for runner 'pooling', not 'generate'")
    return str(runner)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_pow2(x: int) -> bool:
    return isinstance(x, int) and x >= 1 and (x & (x - 1)) == 0


def _is_num(x: object) -> bool:
    """A real number (bools excluded): range checks on anything else would raise TypeError."""
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclass(frozen=True)
class CacheConfig:
    """The KV pool: block size, memory budget, dtype, prefix caching and offload tiers."""

    block_size: int = DEFAULT_BLOCK_SIZE
    # None: 0.9 on an accelerator; on CPU a fixed 2 GiB KV space capped by what 0.9 of RAM
    # allows. An explicit value is that fraction of device memory (CPU: available RAM).
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False  # fp8 only: scales from the first batch, then fixed
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    # A deployment's secret mixed into the root of every prefix hash chain (any algorithm):
    # None keeps the public, fixed root. Every process of a deployment must share it.
    prefix_caching_hash_seed: str | None = None
    kv_offloading_size: float = 0.0  # GiB of host RAM for the offload tier
    swap_space: float = 0.0  # GiB of disk for the third tier
    kv_cache_dir: str | None = None
    preemption_mode: str = "recompute"
    # vLLM's flag: one full-attention KV cache group over all layers even when some slide (each
    # layer then keeps every token's KV). A no-op for models without sliding layers.
    disable_hybrid_kv_cache_manager: bool = False
    # Derived at start-up (dataclasses.replace); None until the pool is sized.
    num_gpu_blocks: int | None = None

    def __post_init__(self) -> None:
        c = "CacheConfig"
        if not _is_pow2(self.block_size) or not 1 <= self.block_size <= 1024:
            _fail(c, "block_size", "a power of two in [1, 1024]", self.block_size)
        u = self.gpu_memory_utilization
        if u is not None and not (_is_num(u) and 0.0 < u <= 1.0):
            _fail(c, "gpu_memory_utilization", "in (0, 1] or None (backend default)", u)
        kv_bytes = self.kv_cache_memory_bytes
        if kv_bytes is not None and not (_is_num(kv_bytes) and kv_bytes > 0):
            _fail(c, "kv_cache_memory_bytes", "> 0 or None", kv_bytes)
        blocks = self.num_gpu_blocks_override
        if blocks is not None and not (isinstance(blocks, int) and blocks >= 2):
            _fail(c, "num_gpu_blocks_override", ">= 2 (block 0 is the null block) or None",
                  self.num_gpu_blocks_override)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            _fail(c, "kv_cache_dtype", f"one of {KV_CACHE_DTYPES}", self.kv_cache_dtype)
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            _fail(c, "prefix_caching_hash_algo", f"one of {HASH_ALGOS}",
                  self.prefix_caching_hash_algo)
        seed = self.prefix_caching_hash_seed
        if seed is not None and (not isinstance(seed, str) or not seed):
            raise ValueError("CacheConfig.prefix_caching_hash_seed must be a non-empty string "
                             "or None")  # the value is a secret: never echoed
        if not (_is_num(self.kv_offloading_size) and self.kv_offloading_size >= 0):
            _fail(c, "kv_offloading_size", ">= 0 (GiB)", self.kv_offloading_size)
        if not (_is_num(self.swap_space) and self.swap_space >= 0):
            _fail(c, "swap_space", ">= 0 (GiB)", self.swap_space)
        if self.preemption_mode not in PREEMPTION_MODES:
            _fail(c, "preemption_mode", f"one of {PREEMPTION_MODES}", self.preemption_mode)
        if not isinstance(self.disable_hybrid_kv_cache_manager, bool):
            _fail(c, "disable_hybrid_kv_cache_manager", "true or false",
                  self.disable_hybrid_kv_cache_manager)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences, token budget per step, chunked prefill, policy."""

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # Longest prompt chunk one request may take in a step (None: the whole token budget).
    long_prefill_token_threshold: int | None = None
    scheduling_policy: str = "priority"
    # Overlapped loop: step N+1 is dispatched before step N's tokens reach the host.
    async_scheduling: bool = True

    @property
    def chunk_limit(self) -> int | None:
        """max_chunk_tokens with chunked prefill; None without (a request's one chunk is its
        whole length, whatever that length: kv_cache_groups.blocks_by_length's `chunk`)."""
        return self.max_chunk_tokens if self.enable_chunked_prefill else None

    @property
    def max_chunk_tokens(self) -> int:
        """Most new tokens one request computes in a step (what a sliding window's blocks must
        cover beyond the window): a prefill chunk, or the whole context without chunking."""
        if not self.enable_chunked_prefill:
            return self.max_model_len
        t = self.long_prefill_token_threshold
        return min(self.max_num_batched_tokens, t) if t else self.max_num_batched_tokens

    def __post_init__(self) -> None:
        c = "SchedulerConfig"
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            _fail(c, "max_num_seqs", "an integer >= 1", self.max_num_seqs)
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            _fail(c, "max_num_batched_tokens", "an integer >= 1", self.max_num_batched_tokens)
        if not isinstance(self.max_model_len, int) or self.max_model_len < 1:
            _fail(c, "max_model_len", "an integer >= 1", self.max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            _fail(c, "max_num_batched_tokens", f">= max_model_len ({self.max_model_len}) when "
                  "chunked prefill is disabled", self.max_num_batched_tokens)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            _fail(c, "scheduling_policy", f"one of {SCHEDULING_POLICIES}", self.scheduling_policy)
        if not isinstance(self.async_scheduling, bool):
            _fail(c, "async_scheduling", "True or False", self.async_scheduling)


@dataclass(frozen=True)
class ParallelConfig:
    """Device mesh: tensor parallel size."""

    tensor_parallel_size: int = 1
    # This engine's rank among data-parallel replicas (None: not a replica); it tags its KV
    # cache events (jpaged/dp).
    data_parallel_rank: int | None = None

    # Several processes, one model (jpaged/runner/multiprocess.py); vLLM's flag names.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    distributed_timeout_s: float = DEFAULT_DISTRIBUTED_TIMEOUT_S

    def __post_init__(self) -> None:
        c = "ParallelConfig"
        if not _is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            _fail(c, "tensor_parallel_size", "an integer >= 1", self.tensor_parallel_size)
        r = self.data_parallel_rank
        if r is not None and (not _is_int(r) or r < 0):
            _fail(c, "data_parallel_rank", "an integer >= 0 or None", r)
        if not _is_int(self.nnodes) or self.nnodes < 1:
            _fail(c, "nnodes", "an integer >= 1", self.nnodes)
        if not _is_int(self.node_rank) or not 0 <= self.node_rank < self.nnodes:
            _fail(c, "node_rank", f"an integer in [0, nnodes={self.nnodes})", self.node_rank)
        if not isinstance(self.master_addr, str) or not self.master_addr:
            _fail(c, "master_addr", "a host name or address", self.master_addr)
        if not _is_int(self.master_port) or not 1 <= self.master_port < 65535:
            _fail(c, "master_port", "a port in [1, 65534] (the step channel uses port + 1)",
                  self.master_port)
        t = self.distributed_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not t > 0:
            _fail(c, "distributed_timeout_s", "a number of seconds > 0", t)
        if self.nnodes > 1 and self.data_parallel_rank is not None:
            _fail(c, "nnodes", "1 for a data-parallel replica (one process each)", self.nnodes)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how: source (None = embedded default), dtype, backend."""

    model: str | None = None
    dtype: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0
    # vLLM's: the most logprobs / prompt_logprobs a request may ask for (-1: the whole
    # vocabulary); also how many candidates a step with logprobs computes.
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    logprobs_mode: str = "raw_logprobs"  # vLLM's; only its default is implemented
    quantization: str | None = None  # a QUANTIZATION_METHODS name, or None
    enforce_eager: bool = False  # vLLM's: on a GPU, steps outside CUDA graphs
    generation_config: str = "auto"  # "auto" | "vllm" | a directory (sampling defaults)
    enable_sleep_mode: bool = False  # vLLM's: LLM.sleep / wake_up may give the device back
    runner: str = "generate"  # "generate" | "pooling" (vLLM's --runner; "auto" resolved)
    pooler_config: Any = None  # a PoolerConfig (pooling: None until the engine resolves it)

    def __post_init__(self) -> None:
        if self.runner not in ("generate", "pooling"):
            _fail("ModelConfig", "runner", '"generate" or "pooling"', self.runner)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            _fail("ModelConfig", "generation_config", '"auto", "vllm" or a directory',
                  self.generation_config)
        if self.generation_config not in ("auto", "vllm") and not Path(
                self.generation_config).expanduser().is_dir():
            _fail("ModelConfig", "generation_config",
                  '"auto", "vllm" or a directory holding generation_config.json',
                  self.generation_config)
        if not isinstance(self.enforce_eager, bool):
            _fail("ModelConfig", "enforce_eager", "True or False", self.enforce_eager)
        if self.dtype not in MODEL_DTYPES:
            _fail("ModelConfig", "dtype", f"one of {MODEL_DTYPES}", self.dtype)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            _fail("ModelConfig", "quantization", f"one of {QUANTIZATION_METHODS} (or unset)",
                  self.quantization)
        if self.attention_backend not in ATTENTION_BACKENDS:
            _fail("ModelConfig", "attention_backend", f"one of {ATTENTION_BACKENDS}",
                  self.attention_backend)
        if not _is_int(self.max_logprobs) or self.max_logprobs < -1:
            _fail("ModelConfig", "max_logprobs", "an integer >= 0, or -1 (the whole vocabulary)",
                  self.max_logprobs)
        if self.logprobs_mode not in LOGPROBS_MODES:
            _fail("ModelConfig", "logprobs_mode", f"one of {LOGPROBS_MODES}", self.logprobs_mode)
        if self.logprobs_mode not in SUPPORTED_LOGPROBS_MODES:
            raise ValueError(f"ModelConfig.logprobs_mode {self.logprobs_mode!r} is not supported "
                             "by jpaged, whose logprobs are vLLM's default 'raw_logprobs' ("
                             "taken before logit_bias, penalties, temperature and "
                             "top-k/top-p/min-p)")

    def logprobs_limit(self, vocab_size: int) -> int:
        """The most logprobs a request may ask for: max_logprobs, or with -1 the vocabulary."""
        return vocab_size if self.max_logprobs == -1 else self.max_logprobs


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's `--kv-transfer-config`: which KV connector moves blocks between engines, and how.

    `kv_connector_extra_config` takes, for JaxTransferConnector, `abort_timeout_s` (how long a
    producer holds a finished request's blocks for its consumer) and `transfer_timeout_s` (how
    long a consumer waits on a producer); for SharedStorageConnector, `shared_storage_path`
    (the directory both engines see).
    """

    kv_connector: str = "JaxTransferConnector"
    kv_role: str = "kv_both"
    engine_id: str | None = None  # None: a random id per engine
    kv_ip: str = DEFAULT_HOST  # the producer's control and transfer servers bind here
    kv_port: int = DEFAULT_KV_PORT  # the control socket's port (0: any free port)
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"  # a failed pull: recompute locally, or fail it

    def __post_init__(self) -> None:
        c = "kv_transfer_config"  # errors name the flag's fields
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"{c}.kv_connector must be one of {KV_CONNECTORS}, "
                             f"got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"{c}.kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"{c}.kv_load_failure_policy must be one of "
                             f"{KV_LOAD_FAILURE_POLICIES}, got {self.kv_load_failure_policy!r}")
        if self.engine_id is not None and (not isinstance(self.engine_id, str)
                                           or not self.engine_id):
            raise ValueError(f"{c}.engine_id must be a non-empty string or null, "
                             f"got {self.engine_id!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"{c}.kv_ip must be a host address, got {self.kv_ip!r}")
        if not _is_int(self.kv_port) or not 0 <= self.kv_port <= 65535:
            raise ValueError(f"{c}.kv_port must be an integer in [0, 65535], "
                             f"got {self.kv_port!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, Mapping):
            raise ValueError(f"{c}.kv_connector_extra_config must be a JSON object, "
                             f"got {extra!r}")
        known = (("shared_storage_path",) if self.kv_connector == "SharedStorageConnector"
                 else ("abort_timeout_s", "transfer_timeout_s"))
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"{c}.kv_connector_extra_config has unknown field(s) {unknown} "
                             f"for {self.kv_connector}; known: {list(known)}")
        for name in ("abort_timeout_s", "transfer_timeout_s"):
            v = extra.get(name)
            if v is not None and (not _is_num(v) or v <= 0):
                raise ValueError(f"{c}.kv_connector_extra_config.{name} must be a number > 0, "
                                 f"got {v!r}")
        if self.kv_connector == "SharedStorageConnector":
            path = extra.get("shared_storage_path")
            if not isinstance(path, str) or not path:
                raise ValueError(f"{c}.kv_connector_extra_config.shared_storage_path must name "
                                 f"the directory both engines share, got {path!r}")

    @property
    def is_producer(self) -> bool:
        """True if this engine's finished prefills keep their blocks for a consumer."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """True if this engine loads KV that another engine computed."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def abort_timeout_s(self) -> float:
        """Seconds a producer holds blocks nobody pulled."""
        return float(self.kv_connector_extra_config.get("abort_timeout_s",
                                                        DEFAULT_KV_ABORT_TIMEOUT_S))

    @property
    def transfer_timeout_s(self) -> float:
        """Seconds a consumer waits on a producer's answer or its pages."""
        return float(self.kv_connector_extra_config.get("transfer_timeout_s",
                                                        DEFAULT_KV_TRANSFER_TIMEOUT_S))

    @classmethod
    def parse(cls, value: KVTransferConfig | Mapping[str, Any] | str | None
              ) -> KVTransferConfig | None:
        """From a KVTransferConfig, a dict, or its JSON text (the CLI flag); None stays None."""
        return parse_json_config(cls, value, "kv_transfer_config")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's `--structured-outputs-config`: the engine-wide defaults of structured outputs.

    `backend` "auto" (vLLM's default, xgrammar's strict mode): an object schema that lists
    `properties` and says neither `additionalProperties` nor `unevaluatedProperties` allows
    only the listed keys. "guidance" (vLLM's guidance backend): such objects allow any other
    key too, unless `disable_additional_properties` (here or per request) closes them.
    `disable_any_whitespace`: no whitespace inside JSON (as a request's own flag).
    """

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        c = "structured_outputs_config"  # errors name the flag's fields
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"{c}.backend must be one of {STRUCTURED_OUTPUTS_BACKENDS}, got "
                             f"{self.backend!r} (jpaged compiles every grammar with llguidance; "
                             "'auto' behaves as vLLM's default xgrammar backend)")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{c}.{name} must be true or false, "
                                 f"got {getattr(self, name)!r}")
        # vLLM's own checks: these two switch behaviours of a named backend.
        if self.disable_any_whitespace and self.backend != "guidance":
            raise ValueError(f"{c}.disable_any_whitespace needs backend 'guidance' (as vLLM, "
                             "where it needs xgrammar or guidance)")
        if self.disable_additional_properties and self.backend != "guidance":
            raise ValueError(f"{c}.disable_additional_properties needs backend 'guidance' (as "
                             "vLLM; 'auto' already allows only the listed properties)")

    @property
    def open_objects(self) -> bool:
        """Whether an object schema that does not say additionalProperties allows other keys."""
        return self.backend == "guidance" and not self.disable_additional_properties

    @classmethod
    def parse(cls, value: StructuredOutputsConfig | Mapping[str, Any] | str | None
              ) -> StructuredOutputsConfig:
        """From a StructuredOutputsConfig, a dict, or its JSON text (the CLI flag); None gives
        the defaults."""
        return parse_json_config(cls, value, "structured_outputs_config") or cls()


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config`: speculative decoding by prompt lookup (`ngram`), suffix
    decoding (`suffix`) or a smaller model sharing the target's tokenizer (`draft_model`, or
    just `model`); the target model verifies every proposal in one step.

    ngram: `num_speculative_tokens` required; `prompt_lookup_min`/`prompt_lookup_max` default
    as vLLM's (both unset: 5; one unset: the other). suffix: `num_speculative_tokens` defaults
    to `suffix_decoding_max_tree_depth`; the `suffix_decoding_*` fields are Arctic Inference's.
    draft_model: `model` (anything jpaged loads) and `num_speculative_tokens` required. EAGLE,
    MTP and the other learned heads are refused by name.
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # vLLM's fields with one value here: a draft model runs unsharded, drafting one token a
    # pass, as the engine runs (accepted so vLLM's configs load; another value is refused).
    draft_tensor_parallel_size: int | None = None
    parallel_drafting: bool = False
    enforce_eager: bool | None = None
    # vLLM's: no proposals for a request once it would pass this many tokens (None: the
    # engine's max_model_len); proposing stops there, decoding goes on.
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        c = "speculative_config"  # errors name the flag's fields
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(f"{c}.draft_tensor_parallel_size must be 1 (a draft model runs "
                             f"unsharded here), got {self.draft_tensor_parallel_size!r}")
        if self.parallel_drafting is not False:
            raise ValueError(f"{c}.parallel_drafting is not supported: drafts are proposed "
                             "one token a pass")
        if self.max_model_len is not None and (not _is_int(self.max_model_len)
                                               or self.max_model_len < 1):
            _fail(c, "max_model_len", "an integer >= 1", self.max_model_len)
        if self.enforce_eager not in (None, False, True):
            _fail(c, "enforce_eager", "true or false (the draft runs as the engine does)",
                  self.enforce_eager)
        if self.method in ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator"):
            raise ValueError(f"{c}.method {self.method!r} (a learned draft head) is not "
                             "supported by jpaged yet; use 'ngram', 'suffix' or 'draft_model'")
        if self.model == "[ngram]" and self.method in (None, "ngram"):
            # vLLM's older spelling of the n-gram proposer (its own tests still use it).
            object.__setattr__(self, "model", None)
            object.__setattr__(self, "method", "ngram")
        if self.method is None and self.model is not None:
            object.__setattr__(self, "method", "draft_model")  # vLLM: a model alone is a draft
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"{c}.method must be one of {SPECULATIVE_METHODS}, got "
                             f"{self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(f"{c}.model is required for method 'draft_model' and only for it "
                             f"(method {self.method!r}, model {self.model!r})")
        k = self.num_speculative_tokens
        if k is None:
            if self.method != "suffix":
                raise ValueError(f"{c}.num_speculative_tokens is required for method "
                                 f"{self.method!r}")
            k = self.suffix_decoding_max_tree_depth
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            _fail(c, "num_speculative_tokens", f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]",
                  k)
        object.__setattr__(self, "num_speculative_tokens", k)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _is_int(v) or v < 1:
                _fail(c, name, "an integer >= 1", v)
        if lo > hi:
            raise ValueError(f"{c}.prompt_lookup_min ({lo}) must be <= prompt_lookup_max "
                             f"({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if not _is_int(self.suffix_decoding_max_tree_depth) or \
                self.suffix_decoding_max_tree_depth < 1:
            _fail(c, "suffix_decoding_max_tree_depth", "an integer >= 1",
                  self.suffix_decoding_max_tree_depth)
        if not _is_int(self.suffix_decoding_max_cached_requests) or \
                self.suffix_decoding_max_cached_requests < 0:
            _fail(c, "suffix_decoding_max_cached_requests", "an integer >= 0",
                  self.suffix_decoding_max_cached_requests)
        if not _is_num(self.suffix_decoding_max_spec_factor) or \
                self.suffix_decoding_max_spec_factor <= 0:
            _fail(c, "suffix_decoding_max_spec_factor", "a number > 0",
                  self.suffix_decoding_max_spec_factor)
        if not _is_num(self.suffix_decoding_min_token_prob) or \
                not 0 <= self.suffix_decoding_min_token_prob <= 1:
            _fail(c, "suffix_decoding_min_token_prob", "a number in [0, 1]",
                  self.suffix_decoding_min_token_prob)

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None
              ) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, a dict, or its JSON text (the CLI flag); None: off."""
        return parse_json_config(cls, value, "speculative_config")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (vLLM's --enable-lora): how many run on the device at once, their
    largest rank, and how many the host keeps read."""

    max_loras: int = 1  # adapters on the device at once (and in one step)
    max_lora_rank: int = 16  # every slot holds this rank; a larger adapter is refused
    max_cpu_loras: int | None = None  # adapters kept read on the host (None: max_loras)

    def __post_init__(self) -> None:
        if not _is_int(self.max_loras) or self.max_loras < 1:
            _fail("EngineArgs", "max_loras", "an integer >= 1", self.max_loras)
        if not _is_int(self.max_lora_rank) or not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            _fail("EngineArgs", "max_lora_rank", f"an integer in [1, {MAX_LORA_RANK}]",
                  self.max_lora_rank)
        if self.max_cpu_loras is not None and (not _is_int(self.max_cpu_loras)
                                               or self.max_cpu_loras < self.max_loras):
            _fail("EngineArgs", "max_cpu_loras", f"an integer >= max_loras ({self.max_loras})",
                  self.max_cpu_loras)

    @property
    def host_capacity(self) -> int:
        """Adapters the host keeps read."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, grouped."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    kv_events: KVEventsConfig | None = None  # KV cache events (None: none)
    kv_transfer: KVTransferConfig | None = None  # a KV connector (None: none)
    # Structured outputs' engine-wide defaults (the grammar compiler reads them).
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig | None = None  # speculative decoding (None: off)
    lora: LoRAConfig | None = None  # LoRA adapters (None: --enable-lora not given)

    def with_num_blocks(self, num_blocks: int) -> EngineConfig:
        """The same config with the pool size filled in."""
        return dataclasses.replace(
            self, cache=dataclasses.replace(self.cache, num_gpu_blocks=num_blocks))


@dataclass
class EngineArgs:
    """Flat engine arguments, as vLLM's; `create_engine_config()` validates and groups them.

    Each field's docstring is its documentation and the help of its `jpaged` flag (the CLI
    derives every engine flag from these fields: jpaged/cli_engine_flags.py).
    """

    model: str | None = None
    """The model: a Hugging Face directory or hub repo id, a .gguf file, or a checkpoint
    written by `jpaged convert`. Unset: the embedded SmolLM2."""
    dtype: str = "auto"
    """Dtype of the weights and activations ("auto": bfloat16 on an accelerator, float32 on
    CPU; vLLM's "half" and "float" are float16 and float32)."""
    seed: int = 0
    """Engine seed: a request without a seed of its own samples with one derived from it and
    the request's arrival order, so the same requests with the same seed sample alike."""
    quantization: str | None = None
    """Weights kept quantized on the device: "gguf" runs a GGUF at its own quantization (every
    quantized tensor stays as stored; unset, a GGUF is dequantized to dtype), "fp8" quantizes
    the decoder layers' linears per output channel at load (embeddings and head stay in dtype).
    A checkpoint written quantized (`jpaged convert --quantization`) loads as it was."""
    attention_backend: str = "auto"
    """Attention kernels: pallas (the Pallas kernels; off GPU their slow interpreter), xla
    (jnp attention that skips empty chunks), reference (the plain version the kernels are
    tested against), or auto (pallas on GPU, xla elsewhere)."""
    enforce_eager: bool = False
    """vLLM's: no CUDA graphs. On a GPU every kernel of a step is launched on its own instead
    of in XLA command buffers (CUDA graphs): for profiling and debugging, slower at small
    batches. The steps are still compiled (XLA has no eager mode). No effect on a CPU."""
    generation_config: str = "auto"
    """vLLM's: where requests' default sampling parameters (temperature, top_p, top_k, min_p,
    repetition_penalty; a field a request leaves unset; and max_new_tokens, which caps a
    server request's max_tokens) come from: "auto", the model's generation_config.json (its
    creator's recommendation), "vllm", SamplingParams' own defaults, or a directory holding a
    generation_config.json."""
    trust_remote_code: bool = False
    """Accepted for vLLM's scripts: jpaged runs only its own model implementations, never
    Python code shipped with a checkpoint, so True and False load a model the same way (an
    architecture jpaged lacks is refused either way, naming it)."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV cache block: a power of two, at most 1024."""
    gpu_memory_utilization: float | None = None
    """Fraction of device memory, in (0, 1], for the weights, the activations and the KV pool.
    Unset: 0.9 on an accelerator; on CPU a 2 GiB KV pool, capped by what 0.9 of the RAM
    allows (a value given there is a fraction of the available RAM)."""
    kv_cache_memory_bytes: int | None = None
    """Size of the KV pool in bytes, taken as is (nothing measured or subtracted); overrides
    gpu_memory_utilization."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV blocks per layer, block 0 (the null block) included, so at least 2;
    overrides every other sizing."""
    kv_cache_dtype: str = "auto"
    """Dtype of the KV pages ("auto": the model's dtype; fp8 is fp8_e4m3)."""
    calculate_kv_scales: bool = False
    """fp8 KV only: per-layer K and V scales computed from the first batch, then fixed (off: a
    scale of 1)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes already computed (automatic prefix caching)."""
    prefix_caching_hash_algo: str = "sha256"
    """Hash that keys prefix-cache blocks."""
    prefix_caching_hash_seed: str | None = None
    """A deployment's secret mixed into every prefix-cache block hash, so other deployments
    cannot predict or share them; every process and restart must use the same one. Unset:
    $JPAGED_PREFIX_CACHING_HASH_SEED, else none."""
    kv_offloading_size: float = 0.0
    """GiB of host RAM for the KV tier below the device pool: evicted prefix blocks are kept
    there and loaded back on a hit (0: no host tier)."""
    swap_space: float = 0.0
    """GiB of disk for the KV tier below host RAM, under kv_cache_dir: the host tier's evicted
    blocks, kept across restarts (0: no disk tier)."""
    kv_cache_dir: str | None = None
    """Directory of the disk KV tier (unset: ~/.cache/jpaged/kv)."""
    preemption_mode: str = "recompute"
    """What a request preempted for memory loses: recompute drops its KV and computes it
    again; swap moves its blocks to the host tier (kv_offloading_size > 0) and back."""
    disable_hybrid_kv_cache_manager: bool = False
    """Keep every token's KV in every layer, sliding-window layers too (one full-attention
    group); by default sliding-window layers free the blocks behind their window."""
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    """Most sequences in one step."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step. Unset: 2048, or max_model_len when that is larger and
    chunked prefill is off."""
    max_model_len: int | None = None
    """Longest sequence, prompt and output together. Unset: the model's context length, at
    most 2048; -1 (the CLI's "auto", vLLM's): the model's whole context length."""
    enable_chunked_prefill: bool = True
    """Split a prompt longer than the step's token budget over several steps (off: a prompt
    is computed in one step, so the budget must hold max_model_len)."""
    long_prefill_token_threshold: int | None = None
    """Most prompt tokens one request computes in a step (unset: the whole token budget)."""
    scheduling_policy: str = "priority"
    """Order of the waiting requests: priority (by request priority, then arrival), fcfs
    (arrival), or lpm (longest cached prefix first, within a priority)."""
    tensor_parallel_size: int = 1
    """Devices one model's weights and KV heads are split over (tensor parallelism)."""
    data_parallel_rank: int | None = None
    """This engine's rank among data-parallel replicas, which tags its KV cache events; set
    by the data-parallel client for each replica it starts (None: not a replica)."""
    nnodes: int = 1
    """Processes (hosts) one model spans; each runs the same command."""
    node_rank: int = 0
    """This process's rank in [0, nnodes): 0 schedules and serves, the others run the steps
    process 0 sends them."""
    master_addr: str = DEFAULT_MASTER_ADDR
    """Address of process 0: the JAX coordinator listens on master_port, the step channel on
    master_port + 1."""
    master_port: int = DEFAULT_MASTER_PORT
    """Port of process 0's JAX coordinator (the step channel takes the next one)."""
    distributed_timeout_s: float = DEFAULT_DISTRIBUTED_TIMEOUT_S
    """Seconds to wait for every process to join, and to notice one that died."""
    async_scheduling: bool = True
    """Overlap the host with the device: dispatch the next step before this one's tokens are
    read back (off: the synchronous loop, the reference)."""
    engine_core_process: bool = False
    """Run the scheduler and the device step in a process of their own; tokenization,
    detokenization, stop strings and outputs stay in the caller's (vLLM V1's engine-core
    process)."""
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = None
    """KV cache events, vLLM's, as JSON (from Python also a KVEventsConfig or a dict), e.g.
    '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'
    (docs/distributed.md)."""
    kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = None
    """A KV connector that moves KV between engines (disaggregated prefill/decode), vLLM's, as
    JSON (from Python also a KVTransferConfig or a dict), e.g. '{"kv_connector":
    "JaxTransferConnector", "kv_role": "kv_producer", "kv_port": 14579}'
    (docs/distributed.md)."""
    structured_outputs_config: StructuredOutputsConfig | dict[str, Any] | str | None = None
    """Engine-wide defaults of structured outputs, vLLM's, as JSON (from Python also a
    StructuredOutputsConfig or a dict): '{"backend": "guidance"}' lets an object schema that
    does not say additionalProperties take other keys (default "auto": only the listed ones);
    "disable_additional_properties" and "disable_any_whitespace" go with "guidance"."""
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    """Speculative decoding, vLLM's, as JSON (from Python also a SpeculativeConfig or a dict):
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}' proposes the
    tokens that followed an earlier occurrence of the latest n-gram; '{"method": "suffix"}'
    proposes from suffix trees of the request and of earlier responses. The target verifies
    every proposal in one step; outputs keep the target's distribution (docs/spec_decode.md)."""
    enable_sleep_mode: bool = False
    """vLLM's sleep mode: `LLM.sleep(level)` gives the device memory of the KV cache and the
    weights back while the engine idles (level 1 keeps the weights on the host, level 2 reads
    them again at `wake_up`); the server adds /sleep, /wake_up and /is_sleeping."""
    runner: str = "auto"
    """vLLM's: "generate" (text generation), "pooling" (an embedding model: requests are
    prompts whose final hidden states are pooled into one vector each: `LLM.embed`,
    `LLM.score`, the server's /v1/embeddings; a sequence classifier's class probabilities:
    `LLM.classify`, /classify, /rerank; docs/pooling.md), or "auto" ("pooling" when
    `pooler_config` is given or the model's config.json names a `*ForSequenceClassification`,
    else "generate")."""
    hf_overrides: dict[str, Any] | str | None = None
    """vLLM's: fields laid over the model's config.json (an HF directory or hub repo) before it
    is read, as a JSON object (a top-level update). E.g. '{"architectures":
    ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": true}' runs a causal reranker as a cross-encoder, its score
    head made of the LM head's rows of those tokens (docs/pooling.md)."""
    pooler_config: dict[str, Any] | str | None = None
    """vLLM's, for runner "pooling", as JSON: '{"pooling_type": "LAST", "normalize": true}'
    (pooling_type LAST, MEAN or CLS). Unset: the checkpoint's sentence-transformers pooling
    (modules.json), else LAST and normalized."""
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT directories): a request names one with a LoRARequest (the
    server: by the adapter's name in `model`); each adapted projection adds the adapter's
    product, and the prefix cache keeps each adapter's blocks apart (docs/lora.md)."""
    max_loras: int = 1
    """LoRA adapters on the device at once; a step runs requests of at most this many."""
    max_lora_rank: int = 16
    """Largest LoRA rank served: every device slot is this wide, a larger adapter is refused."""
    max_cpu_loras: int | None = None
    """LoRA adapters kept read on the host (default: max_loras); others are read again from
    their directories when a request needs them."""
    disable_log_stats: bool = False
    """No periodic stats line in the log."""
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    """Most logprobs / prompt_logprobs a request may ask for (-1: the whole vocabulary, which
    a request then asks for with -1); a step with logprobs computes this many candidates."""
    logprobs_mode: str = "raw_logprobs"
    """What logprobs are taken from, vLLM's: only its default, raw_logprobs (the model's
    logits before temperature and top-k/top-p/min-p), is implemented."""
    extra: dict[str, Any] = field(default_factory=dict)
    """More EngineArgs fields for the engines a data-parallel client starts, laid over these
    in each replica; the engine itself reads nothing from it."""

    def __post_init__(self) -> None:
        self.dtype = canonical_dtype(self.dtype)  # one spelling for every reader

    @classmethod
    def field_names(cls) -> set[str]:
        """Names accepted as keyword arguments by LLM(...)."""
        return {f.name for f in dataclasses.fields(cls)} - {"extra"}

    def create_engine_config(self, model_max_len: int) -> EngineConfig:
        """Validate and group; `model_max_len` is the model's own context limit."""
        max_model_len = self.max_model_len if self.max_model_len is not None else min(
            model_max_len, 2048)
        if max_model_len == -1:  # vLLM's "auto": all the model has
            max_model_len = model_max_len
        if not isinstance(max_model_len, int) or max_model_len < 1:
            _fail("EngineArgs", "max_model_len", "an integer >= 1", max_model_len)
        if max_model_len > model_max_len:
            _fail("EngineArgs", "max_model_len",
                  f"<= the model's max_position_embeddings ({model_max_len})", max_model_len)
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = DEFAULT_MAX_NUM_BATCHED_TOKENS if self.enable_chunked_prefill else max(
                DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
        return EngineConfig(
            model=ModelConfig(self.model, self.dtype, self.attention_backend, self.seed,
                              max_logprobs=self.max_logprobs, quantization=self.quantization,
                              logprobs_mode=self.logprobs_mode,
                              enforce_eager=self.enforce_eager,
                              generation_config=self.generation_config,
                              enable_sleep_mode=self.enable_sleep_mode,
                              runner=_runner(self.runner, self.pooler_config, self.model,
                                             parse_hf_overrides(self.hf_overrides)),
                              pooler_config=PoolerConfig.parse(self.pooler_config)),
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_dtype=self.kv_cache_dtype,
                calculate_kv_scales=self.calculate_kv_scales,
                enable_prefix_caching=self.enable_prefix_caching,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                prefix_caching_hash_seed=(self.prefix_caching_hash_seed
                                          if self.prefix_caching_hash_seed is not None
                                          else os.environ.get(HASH_SEED_ENV) or None),
                kv_offloading_size=self.kv_offloading_size,
                swap_space=self.swap_space,
                kv_cache_dir=self.kv_cache_dir,
                preemption_mode=self.preemption_mode,
                disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                scheduling_policy=self.scheduling_policy,
                async_scheduling=self.async_scheduling,
            ),
            parallel=ParallelConfig(self.tensor_parallel_size, self.data_parallel_rank,
                                    self.nnodes, self.node_rank, self.master_addr,
                                    self.master_port, self.distributed_timeout_s),
            kv_events=KVEventsConfig.parse(self.kv_events_config),
            kv_transfer=KVTransferConfig.parse(self.kv_transfer_config),
            structured_outputs=StructuredOutputsConfig.parse(self.structured_outputs_config),
            speculative=SpeculativeConfig.parse(self.speculative_config),
            lora=(LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
                  if self.enable_lora else None),
        )
