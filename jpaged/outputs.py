"""What the API returns: RequestOutput and CompletionOutput, and a pooling engine's
PoolingRequestOutput, EmbeddingRequestOutput, ClassificationRequestOutput and
ScoringRequestOutput, named and shaped as vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """Log-probability of one candidate token, its rank, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request (a request with n > 1 has n of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step (cumulative unless asked for deltas)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    num_cached_tokens: int = 0
    # What a decode engine needs to pull this request's KV (a producer's finished request with
    # kv_transfer_params {"do_remote_decode": true}); None otherwise.
    kv_transfer_params: dict | None = None
    # SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token
    # its logprob (and rank) plus the top-k candidates; in a DELTA stream on the first output.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's vector (vLLM's `data`: here a float32 numpy array)."""

    data: Any


@dataclass(slots=True)
class PoolingRequestOutput:
    """What a pooling engine returns for a prompt (vLLM's): `outputs` None when the request
    ended without one (aborted, or the engine failed it: `error` says why)."""

    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """One embedding (vLLM's `LLM.embed` output)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """The embedding's length."""
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """A prompt's embedding, as vLLM's `LLM.embed` returns it."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        """The embedding of a finished PoolingRequestOutput."""
        assert out.outputs is not None
        return cls(out.request_id, EmbeddingOutput([float(x) for x in out.outputs.data]),
                   out.prompt_token_ids, out.finished)


@dataclass(slots=True)
class ClassificationOutput:
    """A classifier's probabilities of a prompt, one per label (vLLM's `LLM.classify`)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        """How many labels the classifier has."""
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """A prompt's class probabilities, as vLLM's `LLM.classify` returns them."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        """The probabilities of a classifier's finished PoolingRequestOutput."""
        assert out.outputs is not None
        return cls(out.request_id, ClassificationOutput([float(x) for x in out.outputs.data]),
                   out.prompt_token_ids, out.finished)


@dataclass(slots=True)
class ScoringOutput:
    """A pair's score (vLLM's `LLM.score`: for an embedding model the cosine similarity, for
    a cross-encoder its one label's probability)."""

    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """One scored pair, as vLLM's `LLM.score` returns it (`prompt_token_ids`: both texts')."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
