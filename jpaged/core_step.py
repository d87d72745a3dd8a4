"""What one engine-core step sends its front end: the sampled tokens, finishes and the rest.

Its own module, below both sides: the engine that fills it (``engine.py``) and the core process
that carries it (``engine_core.py``) import it, not each other.
"""

from __future__ import annotations

from typing import Any

from jpaged.request import Request

__all__ = ["CoreStep"]


class CoreStep:
    """One core step's sampled tokens, as sent to the front end.

    Position i: sequence `req_ids[i]` got token `token_ids[i]` (log-prob `logprobs[i]`, top
    candidates `top_ids[i]`, `top_logprobs[i]`, rank `ranks[i]`). `finished`: (position, status
    name, stop_reason) of the sequences this step ended; `num_cached`: (position, prompt tokens
    found in the prefix cache) of those that got their first token. `kv_cache_usage`: the pool's
    usage after the step. `loop_s`: the core loop's thread CPU time of its previous iteration
    (take messages, step, send). `adds_seen`: see __init__. `failures`: (request id, reason)
    of requests the core ended with an error (a LoRA adapter that no longer reads on its
    side). `req_ids` is None when it equals
    the previous CoreStep's (sent in order, so the front end keeps the last list: the batch
    is mostly unchanged).
    """

    __slots__ = ("req_ids", "token_ids", "logprobs", "top_ids", "top_logprobs", "ranks", "finished",
                 "num_cached", "prompt_logprobs", "kv_cache_usage", "loop_s", "adds_seen",
                 "failures")

    def __init__(self) -> None:
        self.req_ids: list[str] | None = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_ids: Any = None
        self.top_logprobs: Any = None
        self.ranks: Any = None
        self.finished: list[tuple[int, str, Any]] = []
        self.num_cached: list[tuple[int, int]] = []
        # (position, Request.prompt_logprob_rows) of sequences whose first token is here.
        self.prompt_logprobs: list[tuple[int, list[Any]]] = []
        self.kv_cache_usage = 0.0
        self.loop_s = 0.0
        # The front end's "add" messages the core had taken when it sent this step: a row
        # belongs to the request of its id only if that request's add is among them (an id
        # aborted and added again must not get the old request's rows).
        self.adds_seen = 0
        self.failures: list[tuple[str, str]] = []

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, k) for k in self.__slots__)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for k, v in zip(self.__slots__, state, strict=True):
            setattr(self, k, v)

    def fill(self, updated: list[Request], rows: list[int], ids: list[int], lps: list[float],
             result: Any, finished_at: list[int]) -> None:
        """Take a step's updated sequences (rows of the step's token lists)."""
        if not updated:
            return
        self.req_ids = [r.request_id for r in updated]  # (made None by the sender if unchanged)
        if len(rows) == len(ids):  # every row updated: rows are 0..n-1 (they only increase)
            self.token_ids, self.logprobs = ids, lps
            self.top_ids, self.top_logprobs = result.top_ids, result.top_logprobs
            self.ranks = result.ranks
        else:
            self.token_ids = [ids[i] for i in rows]
            self.logprobs = [lps[i] for i in rows]
            self.top_ids, self.top_logprobs = result.top_ids[rows], result.top_logprobs[rows]
            self.ranks = result.ranks[rows]
        self.finished = [(i, updated[i].status.name, updated[i].stop_reason)
                         for i in finished_at]
        self.num_cached = [(i, r.num_cached_tokens) for i, r in enumerate(updated)
                           if len(r.output_token_ids) == 1]
        self.prompt_logprobs = [(i, r.prompt_logprob_rows) for i, r in enumerate(updated)
                                if r.prompt_logprob_rows and len(r.output_token_ids) == 1]
