"""Pooling models (vLLM's `--runner pooling`): how a prompt's hidden states become one vector.

An engine whose runner is "pooling" serves embedding requests instead of generation: each
prompt runs through the model once (prefill only, chunked and paged as any prompt) and its
final hidden states (after the model's last norm) are pooled into one vector:

  LAST  the last prompt token's hidden state (causal decoders: Qwen3-Embedding, e5-mistral)
  MEAN  the mean over every prompt token
  CLS   the first prompt token's

then L2-normalized when the pooler (or the request) says so. A sequence classifier
(`*ForSequenceClassification`: ModelSpec.labels) pools the same way and its score head maps
the pooled state to one logit per label, which `activation` turns into probabilities
(vLLM's classify and cross-encoder score tasks). `PoolerConfig` is the engine's
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

__all__ = ["POOLING_TYPES", "PoolerConfig", "PoolingParams", "activation",
           "check_cross_encoder", "cross_encoder_prompt", "pool",
           "pooler_from_checkpoint", "refuse_unrun_st_modules"]

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
    the context allows), `use_activation` (a classifier's: its logits through softmax or
    sigmoid, the default, or raw when False; for an embedding model, `normalize`'s newer
    name)."""

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None

    def check(self, hidden_size: int, num_labels: int = 0) -> None:
        """ValueError naming the field when it does not fit a model of `hidden_size` (a
        classifier: of `num_labels` outputs)."""
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"PoolingParams.{name} must be a bool or None, got {value!r}")
        if (self.normalize is not None and self.use_activation is not None
                and self.normalize != self.use_activation):
            raise ValueError("PoolingParams.normalize and use_activation are one setting "
                             "under two names; they must agree")
        if num_labels and self.dimensions is not None:
            raise ValueError("PoolingParams.dimensions cuts an embedding; this model is a "
                             f"classifier ({num_labels} labels)")
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


def activation(logits: np.ndarray, problem_type: str | None) -> np.ndarray:
    """A classifier's probabilities of its logits, as HF trains it (vLLM's rule): softmax
    over two or more labels, sigmoid of one or for multi-label problems, the logits
    themselves for a regression."""
    x = np.asarray(logits, np.float64)
    if problem_type == "regression":
        out = x
    elif problem_type == "multi_label_classification" or x.shape[-1] < 2:
        out = 1.0 / (1.0 + np.exp(-x))
    else:
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        out = e / e.sum(axis=-1, keepdims=True)
    return out.astype(np.float32)


def pool(vector: np.ndarray, params: PoolingParams, pooler: PoolerConfig,
         classifier: str | None = None) -> np.ndarray:
    """A pooled hidden state as the request gets it: truncated to `dimensions`, then
    L2-normalized where the request (else the pooler) says; float32. `classifier`: the
    vector is a classifier's logits (its problem type, "" for HF's default), put through
    `activation` unless the request says use_activation=False."""
    out = np.asarray(vector, np.float32)
    if classifier is not None:
        on = params.use_activation if params.use_activation is not None else params.normalize
        return activation(out, classifier or None) if on is not False else out
    if params.dimensions is not None:
        out = out[:params.dimensions]
    normalize = params.normalize if params.normalize is not None else (
        params.use_activation if params.use_activation is not None else pooler.normalize)
    if normalize:
        out = out / max(float(np.linalg.norm(out)), 1e-12)
    return out


def check_cross_encoder(spec: Any) -> None:
    """ValueError unless the model (a ModelSpec) scores pairs as a cross-encoder: a sequence
    classifier of one label (vLLM's rule)."""
    if spec.num_labels != 1:
        raise ValueError(f"scoring pairs with a classifier needs a cross-encoder (one label); "
                         f"{spec.hf_architecture} has {spec.num_labels} labels: classify "
                         "its prompts instead (LLM.classify, /classify)")


def cross_encoder_prompt(tokenizer: Any, first: Any, second: Any) -> dict[str, Any]:
    """The one prompt a cross-encoder scores a pair as: two texts joined as the tokenizer
    joins a pair (`encode_pair`), two token-id lists (or `prompt_token_ids` dicts) one after
    the other. ValueError naming the side that is neither."""
    def side(value: Any, name: str) -> str | list[int]:
        if isinstance(value, dict):
            value = value.get("prompt", value.get("prompt_token_ids"))
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value:
            return value
        raise ValueError(f"{name} of a scored pair must be a non-empty text or token-id list, "
                         f"got {value!r}")

    a, b = side(first, "data_1"), side(second, "data_2")
    if isinstance(a, str) and isinstance(b, str):
        return {"prompt_token_ids": tokenizer.encode_pair(a, b)}
    if isinstance(a, list) and isinstance(b, list):
        return {"prompt_token_ids": [*a, *b]}
    raise ValueError("a scored pair must be two texts or two token-id lists, not one of each")


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
