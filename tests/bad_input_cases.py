"""The bad-input matrix of docs/reliability.md, shared by the API/CLI and the server tests.

Each row is one kind of bad input and how every surface spells it: SamplingParams / engine
prompt (Python API), `jpaged generate` / `jpaged serve` flags (CLI), a /v1/completions body
field (server). `field` is what every surface's error must name: the OpenAI `param` on the
server, the field (and flag) in the Python and CLI messages.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# As tests/jpaged/server/serverkit.py: the API engine and the shared server compile the same
# step shapes (one KV pool of 160 blocks, buckets of <= 16 sequences, 64 tokens).
ENGINE_ARGS: dict[str, Any] = dict(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64,
                                   block_size=16, num_gpu_blocks_override=160)
VOCAB = 300  # tests/models/tiny_models.py: 256 bytes, <s>, </s>, unused ids
TOO_LONG = "x" * 200  # byte tokenizer: >= 200 tokens, more than max_model_len (128)
GOOD_PROMPT = "The paged KV cache"
GOOD_MAX_TOKENS = 8


@dataclass(frozen=True)
class RequestCase:
    """A bad request: SamplingParams kwargs or an engine prompt, its CLI and HTTP spellings."""

    name: str
    field: str
    sampling: dict[str, Any] = field(default_factory=dict)
    prompt: Any = GOOD_PROMPT
    cli: tuple[str, ...] | None = None  # `jpaged generate` arguments; None: not expressible
    http: dict[str, Any] = field(default_factory=dict)

    @property
    def is_sampling(self) -> bool:
        """True when the bad value is a sampling parameter (valid on every endpoint)."""
        return bool(self.sampling)


def _sampling(name: str, param: str, value: Any) -> RequestCase:
    flag = "--" + param.replace("_", "-")
    return RequestCase(name, param, sampling={param: value}, cli=("hi", flag, str(value)),
                       http={param: value})


def _prompt(name: str, prompt: Any, cli: tuple[str, ...] | None, http: Any) -> RequestCase:
    return RequestCase(name, "prompt", prompt=prompt, cli=cli, http={"prompt": http})


REQUEST_CASES: list[RequestCase] = [
    _prompt("empty_prompt", "", ("",), ""),
    _prompt("empty_token_ids", {"prompt_token_ids": []}, None, []),
    _prompt("prompt_longer_than_max_model_len", TOO_LONG, (TOO_LONG, "--raw"), TOO_LONG),
    _prompt("token_id_past_vocab", {"prompt_token_ids": [65, VOCAB]}, None, [65, VOCAB]),
    _prompt("token_id_negative", {"prompt_token_ids": [65, -1]}, None, [65, -1]),
    _sampling("max_tokens_zero", "max_tokens", 0),
    _sampling("max_tokens_negative", "max_tokens", -3),
    _sampling("temperature_negative", "temperature", -0.5),
    _sampling("top_p_zero", "top_p", 0.0),
    _sampling("top_p_above_one", "top_p", 1.5),
    _sampling("top_k_below_minus_one", "top_k", -2),
    _sampling("min_p_negative", "min_p", -0.1),
    _sampling("min_p_above_one", "min_p", 1.5),
    _sampling("n_zero", "n", 0),
    _sampling("n_negative", "n", -2),
]


@dataclass(frozen=True)
class ConfigCase:
    """A bad engine setting: EngineArgs kwargs and the CLI flags (None: Python only)."""

    name: str
    field: str
    engine: dict[str, Any]
    cli: tuple[str, ...] | None


def _config(name: str, param: str, value: Any, cli: bool = True) -> ConfigCase:
    flag = ("--" + param.replace("_", "-"), str(value))
    return ConfigCase(name, param, {param: value}, flag if cli else None)


CONFIG_CASES: list[ConfigCase] = [
    _config("block_size_not_pow2", "block_size", 12),
    _config("block_size_zero", "block_size", 0),
    _config("block_size_wrong_type", "block_size", "16", cli=False),
    _config("gpu_memory_utilization_zero", "gpu_memory_utilization", 0.0),
    _config("gpu_memory_utilization_above_one", "gpu_memory_utilization", 1.5),
    _config("gpu_memory_utilization_negative", "gpu_memory_utilization", -0.2),
    _config("gpu_memory_utilization_wrong_type", "gpu_memory_utilization", "0.9", cli=False),
    _config("kv_cache_dtype_unknown", "kv_cache_dtype", "int3"),
    _config("dtype_unknown", "dtype", "float8"),
    _config("scheduling_policy_unknown", "scheduling_policy", "lifo"),
    _config("prefix_caching_hash_algo_unknown", "prefix_caching_hash_algo", "md5"),
    _config("async_scheduling_wrong_type", "async_scheduling", "yes", cli=False),
]


@dataclass(frozen=True)
class ModelCase:
    """A bad --model: the path given, the exception expected, and text its message must hold."""

    name: str
    path: str
    error: type[Exception]
    needles: tuple[str, ...]


SAFETENSORS_CUTS = (0, 4, 100, "half", "minus1")  # bytes kept of model.safetensors
# Bytes kept of the embedded GGUF: nothing, part of the magic, the bare 24-byte header, inside
# the metadata, inside the tokenizer's vocabulary. A cut inside the tensor data fails too, but
# only after gguf's reader has parsed all metadata (~10 s on a CPU): not in the fast matrix.
GGUF_CUTS = (0, 3, 24, 4096, 200_000)


def build_model_cases(root: Path, hf_dir: Path, gguf: Path) -> list[ModelCase]:
    """Write the broken checkpoints under `root` (real truncated copies) and list them."""
    cases = [
        ModelCase("missing_dir", str(root / "no-such-model"), FileNotFoundError,
                  ("no-such-model",)),
        ModelCase("missing_gguf", str(root / "no-such.gguf"), FileNotFoundError,
                  ("no-such.gguf",)),
    ]
    weights = (hf_dir / "model.safetensors").read_bytes()
    for cut in SAFETENSORS_CUTS:
        keep = {"half": len(weights) // 2, "minus1": len(weights) - 1}.get(cut, cut)
        d = _copy_dir(hf_dir, root / f"st-{cut}")
        (d / "model.safetensors").write_bytes(weights[:keep])
        cases.append(ModelCase(f"safetensors_truncated_{cut}", str(d), ValueError,
                               (str(d / "model.safetensors"), "truncated")))
    with gguf.open("rb") as f:
        head = f.read(max(GGUF_CUTS))
    for cut in GGUF_CUTS:
        p = root / f"trunc-{cut}.gguf"
        p.write_bytes(head[:cut])
        cases.append(ModelCase(f"gguf_truncated_{cut}", str(p), ValueError,
                               (str(p), "truncated")))
    for name, change, needle in (
        ("unsupported_architecture", {"architectures": ["FooForCausalLM"]}, "FooForCausalLM"),
        ("architectures_not_a_list", {"architectures": "LlamaForCausalLM"}, "architectures"),
        ("config_field_wrong_type", {"hidden_size": "64"}, "hidden_size"),
    ):
        d = _copy_dir(hf_dir, root / name)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        cases.append(ModelCase(name, str(d), ValueError, (str(d / "config.json"), needle)))
    d = _copy_dir(hf_dir, root / "config_not_json")
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    cases.append(ModelCase("config_not_json", str(d), ValueError, (str(d / "config.json"),)))
    return cases


def _copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
