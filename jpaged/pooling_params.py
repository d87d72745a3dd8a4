"""Pooling models (vLLM's `--runner pooling`): how a prompt's hidden states become one vector.

An engine whose runner is "pooling" serves embedding requests instead of generation: each
prompt runs through the model once (prefill only, chunked and paged as any prompt) and its
final hidden states (after the model's last norm) are pooled into one vector:

  LAST  the last prompt token's hidden state (causal decoders: Qwen3-Embedding, e5-mistral)
  MEAN  the mean over every prompt token
  CLS   the first prompt token's

then L2-normalized when the pooler (or the request) says so. `PoolerConfig` is the engine's
choice (vLLM's `--pooler-config`; unset: the checkpoint's sentence-transformers config, else
LAST and normalized, vLLM's default for a decoder turned embedding model); `PoolingParams` is
a request's (vLLM's: `dimensions` truncates a Matryoshka embedding before normalizing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["POOLING_TYPES", "PoolerConfig", "PoolingParams", "pool", "pooler_from_checkpoint",
           "refuse_unrun_st_modules"]

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")


@dataclass(frozen=True)
class PoolerConfig:
    """How an engine pools: `pooling_type` (POOLING_TYPES) and whether vectors are
    L2-normalized by default."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be true or false, got "
                             f"{self.normalize!r}")

    @classmethod
    def parse(cls, value: Any) -> PoolerConfig | None:
        """A PoolerConfig from a dict or JSON text (vLLM's keys; unknown ones refused by
        name), a PoolerConfig, or None."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"pooler_config is not JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be an object, got {type(value).__name__}")
        unknown = sorted(set(value) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"pooler_config has unknown field(s) {', '.join(unknown)}; known: "
                             "pooling_type, normalize")
        kind = value.get("pooling_type", "LAST")
        return cls(kind.upper() if isinstance(kind, str) else kind,
                   value.get("normalize", True))


@dataclass(frozen=True)
class PoolingParams:
    """One pooling request's options (vLLM's): `normalize` (None: the engine's pooler),
    `dimensions` (keep the first this many features, before normalizing: Matryoshka
    embeddings), `truncate_prompt_tokens` (keep the prompt's first k tokens; -1: as many as
    the context allows)."""

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def check(self, hidden_size: int) -> None:
        """ValueError naming the field when it does not fit a model of `hidden_size`."""
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"PoolingParams.normalize must be a bool or None, got "
                             f"{self.normalize!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int)
                              or not 1 <= d <= hidden_size):
            raise ValueError(f"PoolingParams.dimensions must be an integer in [1, "
                             f"{hidden_size}] (the model's hidden size), got {d!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int)
                              or (t < 1 and t != -1)):
            raise ValueError(f"PoolingParams.truncate_prompt_tokens must be -1 or an integer "
                             f">= 1, got {t!r}")


def pool(vector: np.ndarray, params: PoolingParams, pooler: PoolerConfig) -> np.ndarray:
    """A pooled hidden state as the request gets it: truncated to `dimensions`, then
    L2-normalized where the request (else the pooler) says; float32."""
    out = np.asarray(vector, np.float32)
    if params.dimensions is not None:
        out = out[:params.dimensions]
    normalize = pooler.normalize if params.normalize is None else params.normalize
    if normalize:
        out = out / max(float(np.linalg.norm(out)), 1e-12)
    return out


# The sentence-transformers modules jpaged runs; any other (Dense, LayerNorm, WordWeights...)
# would change the vector, so a checkpoint declaring one is refused by name.
ST_MODULES_RUN = ("Transformer", "Pooling", "Normalize")


def _st_modules(model_dir: str | None) -> dict[str, dict[str, Any]] | None:
    """A sentence-transformers checkpoint's modules.json as module kind (its type's last name:
    Transformer, Pooling, ...) -> entry; None when the directory has none."""
    if model_dir is None or not Path(model_dir).is_dir():
        return None
    try:
        modules = json.loads((Path(model_dir) / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(modules, list):
        return None
    return {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}


def refuse_unrun_st_modules(model_dir: str | None) -> None:
    """ValueError naming the modules of a sentence-transformers checkpoint (modules.json) that
    jpaged does not run: its vectors would not be the model's."""
    other = [k for k in _st_modules(model_dir) or {} if k not in ST_MODULES_RUN]
    if other:
        raise ValueError(f"{Path(str(model_dir)) / 'modules.json'}: jpaged runs the sentence-"
                         f"transformers modules {', '.join(ST_MODULES_RUN)}; this checkpoint "
                         f"also has {', '.join(other)}, whose output it would not compute")


def pooler_from_checkpoint(model_dir: str | None) -> PoolerConfig | None:
    """The pooler a sentence-transformers checkpoint declares (modules.json and its Pooling
    module's config.json: lasttoken, mean or cls; a Normalize module), or None when the
    directory has none."""
    kinds = _st_modules(model_dir)
    if kinds is None or "Pooling" not in kinds:
        return None
    where = Path(str(model_dir)) / str(kinds["Pooling"].get("path", "")) / "config.json"
    try:
        cfg = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: the sentence-transformers pooling config does not read: "
                         f"{e}") from e
    modes = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}
    chosen = [kind for key, kind in modes.items() if cfg.get(key)]
    if len(chosen) != 1:
        on = sorted(k for k, v in cfg.items() if k.startswith("pooling_mode") and v)
        raise ValueError(f"{where}: jpaged pools one way (lasttoken, mean_tokens or "
                         f"cls_token), this config sets {on or 'none'}")
    return PoolerConfig(chosen[0], "Normalize" in kinds)
