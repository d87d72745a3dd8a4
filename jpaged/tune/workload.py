"""Workloads `jpaged tune` replays: a JSONL file of requests, or a synthetic spec.

A JSONL line is one request: {"prompt": "..."} or {"prompt_token_ids": [...]} or
{"messages": [{"role": ..., "content": ...}, ...]} (chat template applied), with an optional
output length "max_tokens" (or "output_len"). A synthetic spec is comma-separated key=value:
``n`` requests, ``in`` prompt tokens, ``out`` output tokens, ``prefix`` tokens shared by every
prompt (a system prompt), ``seed`` (e.g. ``n=64,in=256,out=64,prefix=128``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jpaged.intmath import cdiv

DEFAULT_OUTPUT_LEN = 128
SYNTHETIC_DEFAULT = "n=64,in=256,out=64,prefix=0,seed=0"
SYNTHETIC_QUICK = "n=16,in=128,out=32,prefix=0,seed=0"


@dataclass(frozen=True)
class WorkloadRequest:
    """One request to replay: its prompt tokens and how many tokens it generates."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class SyntheticSpec:
    """Random-token requests, optionally sharing a prefix."""

    n: int = 64
    input_len: int = 256
    output_len: int = 64
    prefix_len: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name, v, lo in (("n", self.n, 1), ("in", self.input_len, 1),
                            ("out", self.output_len, 1), ("prefix", self.prefix_len, 0)):
            if v < lo:
                raise ValueError(f"--synthetic {name} must be >= {lo}, got {v}")
        if self.prefix_len >= self.input_len:
            raise ValueError(f"--synthetic prefix ({self.prefix_len}) must be < in "
                             f"({self.input_len})")


_KEYS = {"n": "n", "in": "input_len", "out": "output_len", "prefix": "prefix_len", "seed": "seed"}


def parse_synthetic(spec: str) -> SyntheticSpec:
    """Parse 'n=64,in=256,out=64,prefix=0,seed=0' (any subset; the rest default)."""
    kw: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in _KEYS:
            raise ValueError(f"--synthetic: expected key=value with key in {sorted(_KEYS)}, "
                             f"got {part!r}")
        try:
            kw[_KEYS[key.strip()]] = int(value)
        except ValueError:
            raise ValueError(f"--synthetic {key.strip()} must be an integer, got {value!r}"
                             ) from None
    return SyntheticSpec(**kw)


def synthetic(spec: SyntheticSpec, vocab_size: int) -> list[WorkloadRequest]:
    """Seeded random prompts; the first `prefix_len` tokens are the same in every prompt."""
    rng = np.random.default_rng(spec.seed)
    prefix = rng.integers(0, vocab_size, spec.prefix_len).tolist()
    tails = rng.integers(0, vocab_size, (spec.n, spec.input_len - spec.prefix_len)).tolist()
    return [WorkloadRequest(tuple(prefix + t), spec.output_len) for t in tails]


def _request(obj: Any, tokenizer: Any, where: str) -> WorkloadRequest:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"{where}: prompt_token_ids must be a list of integers")
    elif "messages" in obj:
        text = tokenizer.apply_chat_template(obj["messages"])
        ids = tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(obj.get("prompt"), str):
        ids = tokenizer.encode(obj["prompt"])
    else:
        raise ValueError(f"{where}: needs 'prompt', 'prompt_token_ids' or 'messages'")
    if not ids:
        raise ValueError(f"{where}: the prompt is empty")
    out = obj.get("max_tokens", obj.get("output_len", DEFAULT_OUTPUT_LEN))
    if not isinstance(out, int) or out < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {out!r}")
    return WorkloadRequest(tuple(ids), out)


def load_jsonl(path: Path, tokenizer: Any) -> list[WorkloadRequest]:
    """Every request of a JSONL workload file (blank lines skipped)."""
    if not path.exists():
        raise FileNotFoundError(f"--workload file not found: {path}")
    reqs = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
        reqs.append(_request(obj, tokenizer, f"{path}:{lineno}"))
    if not reqs:
        raise ValueError(f"--workload file {path} holds no requests")
    return reqs


def sample(requests: list[WorkloadRequest], n: int | None, seed: int = 0
           ) -> list[WorkloadRequest]:
    """`n` requests drawn without replacement, in their original order (all when n is None)."""
    if n is None or n >= len(requests):
        return list(requests)
    if n < 1:
        raise ValueError(f"--num-requests must be >= 1, got {n}")
    keep = sorted(np.random.default_rng(seed).choice(len(requests), n, replace=False).tolist())
    return [requests[i] for i in keep]


def fit(requests: list[WorkloadRequest], max_model_len: int) -> list[WorkloadRequest]:
    """Clip output lengths to max_model_len (a warning counts them); ValueError naming a
    prompt that cannot fit."""
    out = []
    clipped = 0
    for i, r in enumerate(requests):
        room = max_model_len - len(r.prompt_token_ids)
        if room < 1:
            raise ValueError(f"workload request {i} has {len(r.prompt_token_ids)} prompt tokens; "
                             f"max_model_len ({max_model_len}) leaves no room to generate: "
                             "raise --max-model-len")
        out.append(WorkloadRequest(r.prompt_token_ids, min(r.max_tokens, room)))
        clipped += r.max_tokens > room
    if clipped:
        logging.getLogger("jpaged.tune").warning(
            "%d workload request(s) ask for more tokens than max_model_len=%d leaves after "
            "their prompt: replayed with max_tokens cut to fit (a server would refuse them)",
            clipped, max_model_len)
    return out


def blocks_needed(requests: list[WorkloadRequest], block_size: int) -> int:
    """KV blocks (null block included) that hold every request at full length at once."""
    return 1 + sum(cdiv(len(r.prompt_token_ids) + r.max_tokens - 1, block_size)
                   for r in requests)
