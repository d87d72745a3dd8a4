"""The engine requests behind one HTTP request, and their usage accounting."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from jpaged.async_engine import AsyncLLMEngine
from jpaged.frontend import truncation_keep
from jpaged.lora_request import LoRARequest
from jpaged.outputs import RequestOutput
from jpaged.sampling_params import RequestOutputKind, SamplingParams
from jpaged.server.protocol import OpenAIError, bad_value
from jpaged.server.request_log import RequestLogger


class RequestBatch:
    """The engine requests behind one HTTP request (one per prompt), on one shared queue."""

    def __init__(self, engine: AsyncLLMEngine, base_id: str, params: SamplingParams,
                 priority: int, log: RequestLogger | None = None,
                 lora_request: LoRARequest | None = None) -> None:
        self.engine, self.base_id, self.params, self.priority = engine, base_id, params, priority
        self.lora_request = lora_request  # the LoRA adapter every prompt runs with, or None
        self.log = log  # vLLM's request log (--enable-log-requests), None when off
        # (engine request id, choice) -> text and ids so far: a delta stream's whole output,
        # for the finish line of --enable-log-outputs.
        self._logged: dict[tuple[str, int], tuple[str, list[int]]] = {}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.index: dict[str, int] = {}  # engine request id -> prompt index
        self.pending: set[str] = set()  # added and not finished: aborted by close()
        # Prompt index -> its tokens as the engine keeps them (truncate_prompt_tokens applied):
        # known from start(), so a stream's first chunk can count them before any output.
        self.prompt_tokens: dict[int, int] = {}
        self.seen: set[int] = set()  # prompt indices whose first output arrived
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.choice_tokens: dict[int, int] = {}  # choice index (i * n + c.index) -> tokens
        self.kv_transfer_params: dict[str, Any] | None = None  # a producer's, at the finish
        self.return_token_ids = False  # vLLM's return_token_ids
        self.continuous_usage = False  # vLLM's stream_options.continuous_usage_stats
        self.so_param: str | None = None  # the field a grammar came from (its errors name it)
        self.tokens_as_ids = False  # vLLM's return_tokens_as_token_ids
        self.field_names: dict[str, str] = {}  # SamplingParams field -> the request's name

    def configure(self, req: Any) -> None:
        """Read the response options of the HTTP request `req`."""
        self.return_token_ids = req.return_token_ids
        self.continuous_usage = req.continuous_usage
        self.so_param = req.structured_param()
        self.tokens_as_ids = req.return_tokens_as_token_ids
        self.field_names = req.field_names()

    def chunk_usage(self, choice: int) -> dict[str, Any] | None:
        """A chunk's usage under continuous_usage_stats, as vLLM counts it: the prompt of
        choice `choice` (i * n + index) and that choice's tokens so far; else null."""
        if not self.continuous_usage:
            return None
        prompt = self.prompt_tokens.get(choice // self.params.n, 0)
        done = self.choice_tokens.get(choice, 0)
        return {"prompt_tokens": prompt, "completion_tokens": done,
                "total_tokens": prompt + done}

    async def start(self, prompts: list[Any], param: str) -> None:
        """Add every prompt; a bad one aborts those already added and raises OpenAIError."""
        try:
            limit = self.engine.max_model_len
            for i, prompt in enumerate(prompts):
                rid = f"{self.base_id}-{i}"
                self.index[rid] = i
                n = len(prompt["prompt_token_ids"])  # Serving._tokenized gave every prompt ids
                if self.params.truncate_prompt_tokens is not None:
                    n = min(n, truncation_keep(self.params.truncate_prompt_tokens, limit))
                self.prompt_tokens[i] = n
                await self.engine.add_request(rid, prompt, self.params, self.priority,
                                              queue=self.queue, lora_request=self.lora_request)
                # Only once added: a refused id (one in use) belongs to another request, which
                # close() must never abort. (A cancelled add aborts itself if it went in.)
                self.pending.add(rid)
                if self.log is not None:
                    self.log.inputs(rid, prompt.get("prompt"), prompt["prompt_token_ids"],
                                    self.params)
        except ValueError as e:
            self.close()
            if self.so_param is not None and str(e).startswith("structured_outputs"):
                # The grammar did not compile: name the field it came from.
                raise OpenAIError(400, self.so_param + str(e)[len("structured_outputs"):],
                                  param=self.so_param) from None
            elif "the engine is sleeping" in str(e):  # (sleep mode) come back after wake_up
                raise OpenAIError(503, str(e), "server_error") from None
            elif "is already in use" in str(e):
                raise OpenAIError(400, f"request_id {self.base_id!r} is already in use by a "
                                  "request that has not finished", param="request_id") from None
            raise bad_value(e, param, self.field_names) from None
        except BaseException:
            self.close()
            raise

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) until every request finished; engine failures raise."""
        while self.pending:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            i = self.index[item.request_id]
            if i not in self.seen:
                self.seen.add(i)
                self.prompt_tokens[i] = len(item.prompt_token_ids)
                self.cached_tokens += item.num_cached_tokens
            for c in item.outputs:
                k = i * self.params.n + c.index
                self.choice_tokens[k] = self.choice_tokens.get(k, 0) + len(c.token_ids)
                self.completion_tokens += len(c.token_ids)
            if self.log is not None and self.log.log_outputs:
                self._log_outputs(item)
            if item.finished:
                self.pending.discard(item.request_id)
                if item.kv_transfer_params is not None:
                    self.kv_transfer_params = item.kv_transfer_params
            yield i, item

    def _log_outputs(self, item: RequestOutput) -> None:
        """Log each sequence of `item` that finished, its whole text and ids (a delta
        stream's pieces gathered)."""
        delta = self.params.output_kind == RequestOutputKind.DELTA
        for c in item.outputs:
            key = (item.request_id, c.index)
            text, ids = c.text, list(c.token_ids)
            if delta:
                before = self._logged.pop(key, ("", []))
                text, ids = before[0] + text, before[1] + ids
            if c.finish_reason is None:
                if delta:
                    self._logged[key] = (text, ids)
                continue
            assert self.log is not None
            self.log.outputs(item.request_id, c.index, text, ids, c.finish_reason)

    def usage(self) -> dict[str, Any]:
        """OpenAI usage counts (prompt tokens once per prompt, all completion tokens)."""
        prompt = sum(self.prompt_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def close(self) -> None:
        """Abort whatever has not finished (synchronous: safe in a generator's cleanup)."""
        if self.pending:
            self.engine.abort(sorted(self.pending))
            self.pending.clear()
