"""What the API returns: RequestOutput and CompletionOutput, named and shaped as vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


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
