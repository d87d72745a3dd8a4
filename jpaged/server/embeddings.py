"""The /v1/embeddings endpoint (OpenAI's and vLLM's): a pooling engine's vectors of the inputs,
each input one engine request, all of them in flight together; and vLLM's /classify, a
sequence classifier's class probabilities of its inputs, run the same way."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from starlette.requests import Request as HTTPRequest

from jpaged.async_engine import RequestFailedError
from jpaged.frontend import truncation_keep
from jpaged.lora_request import LoRARequest
from jpaged.outputs import PoolingRequestOutput
from jpaged.pooling_params import PoolingParams
from jpaged.server.protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    OpenAIError,
    PoolingInputs,
    bad_pooling_value,
    input_field,
)
from jpaged.server.serving import Serving, until_disconnected


def encoded(vector: Any, encoding_format: str) -> list[float] | str:
    """A vector as the response carries it: floats, or (OpenAI's "base64") its little-endian
    float32 bytes in base64."""
    data = np.asarray(vector, dtype=np.float32)
    if encoding_format == "base64":
        return base64.b64encode(data.astype("<f4").tobytes()).decode("ascii")
    return data.tolist()


def pooling_only_error(endpoint: str) -> OpenAIError:
    """The 400 a generation endpoint answers on a server of a pooling model."""
    return OpenAIError(400, f"{endpoint} is not available: this server runs its model as a "
                       "pooling model (--runner pooling), which does not generate text; use "
                       "/v1/embeddings, /classify, /score or /rerank", param="model")


class EmbeddingServing(Serving):
    """The handlers of /v1/embeddings, /classify and /pooling."""

    async def embeddings(self, req: EmbeddingRequest, http: HTTPRequest
                         ) -> dict[str, Any] | None:
        """The embeddings response, or None if the client went away (its requests aborted)."""
        return await until_disconnected(http, self._embeddings(req))

    async def classify(self, req: ClassificationRequest, http: HTTPRequest
                       ) -> dict[str, Any] | None:
        """The classification response, or None if the client went away (its requests
        aborted)."""
        return await until_disconnected(http, self._classify(req))

    async def _classify(self, req: ClassificationRequest) -> dict[str, Any]:
        self.check_model(req.model)
        self.need_pooler("classification")
        labels = self.engine.labels
        if not labels:
            raise OpenAIError(400, f"The model `{self.model_name}` is not a sequence "
                              "classifier: it embeds; use /v1/embeddings", param="model")

        def item(out: PoolingRequestOutput) -> dict[str, Any]:
            probs = [float(x) for x in out.outputs.data]
            return {"object": "classify", "label": labels[int(np.argmax(probs))],
                    "probs": probs, "num_classes": len(probs)}

        return await self._listed(req, "classify", item)

    async def _embeddings(self, req: EmbeddingRequest) -> dict[str, Any]:
        self.check_model(req.model)
        self.need_pooler("embeddings")
        if self.engine.labels:
            raise OpenAIError(400, f"The model `{self.model_name}` is a sequence classifier: "
                              "it has no embeddings; use /classify (or /score, /rerank for a "
                              "cross-encoder)", param="model")
        return await self._listed(req, "embd", lambda o: {
            "object": "embedding", "embedding": encoded(o.outputs.data, req.encoding_format)})

    async def pooling(self, req: EmbeddingRequest, http: HTTPRequest) -> dict[str, Any] | None:
        """The pooling response, or None if the client went away (its requests aborted)."""
        return await until_disconnected(http, self._pooling(req))

    async def _pooling(self, req: EmbeddingRequest) -> dict[str, Any]:
        self.check_model(req.model)
        self.need_pooler("the pooling API")
        return await self._listed(req, "pool", lambda o: {
            "object": "pooling", "data": encoded(o.outputs.data, req.encoding_format)})

    async def _listed(self, req: EmbeddingRequest | ClassificationRequest, prefix: str,
                      item: Callable[[PoolingRequestOutput], dict[str, Any]]) -> dict[str, Any]:
        """Each input's pooled output, in input order, as `{"index", **item(output)}` in a
        list response whose id starts `prefix` (unless the request names one)."""
        req.refuse_unknown()
        params = req.pooling_params()
        inputs = await self._prompts(self.pooling_inputs(req), params, req.special_tokens,
                                     req.cache_salt)
        base = req.request_id or f"{prefix}-{uuid.uuid4().hex}"
        outs = await self._pooled(inputs, params, base, req.priority, self.lora_for(req.model))
        return self.list_response(base, req.model, [{"index": i, **item(o)}
                                                    for i, o in enumerate(outs)],
                                  sum(len(o.prompt_token_ids) for o in outs))

    def list_response(self, base: str, model: str | None, data: list[dict[str, Any]],
                      tokens: int) -> dict[str, Any]:
        """vLLM's list response of a pooling API: its id, the data items, the prompt tokens
        they took."""
        return {"id": base, "object": "list", "created": int(time.time()),
                "model": self.answer_model(model), "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def pooling_inputs(self, req: PoolingInputs) -> list[tuple[str, str | list[int]]]:
        """A pooling request's (where, text or token ids) inputs: its `input`s, or its chat
        `messages` rendered by the chat template as one text."""
        if req.messages is not None:
            return [("messages", self.chat_text(req))]
        return req.inputs()

    def need_pooler(self, what: str) -> None:
        """400 naming --runner pooling unless the engine pools (`what`: the API refused)."""
        if getattr(self.engine, "pooler", None) is None:
            raise OpenAIError(400, f"The model `{self.model_name}` does not support {what}: "
                              "this server runs it to generate text; start the server with "
                              "--runner pooling to serve it as an embedding model",
                              param="model")

    def check_text_size(self, where: str, text: str) -> None:
        """400 naming the input when its text is too long to be worth tokenizing: more bytes
        than the context could hold (see Serving._tokenized)."""
        limit = self.engine.max_model_len
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > 4 * limit * self.max_token_bytes:
            raise OpenAIError(400, f"{where} of {size} bytes is longer than this model's "
                              f"maximum context length of {limit} tokens",
                              param=input_field(where))

    async def _prompts(self, inputs: list[tuple[str, str | list[int]]], params: PoolingParams,
                       add_special_tokens: bool = True, cache_salt: str | None = None
                       ) -> list[tuple[str, dict[str, Any]]]:
        """(where, engine prompt with its token ids) of each (where, text or token ids) input:
        texts tokenized off the event loop; an input longer than the context (after
        truncate_prompt_tokens) is a 400 naming it (its field the param), as is a text too
        long to tokenize at all."""
        tok, limit = self.engine.tokenizer, self.engine.max_model_len
        loop = asyncio.get_running_loop()
        out = []
        for where, x in inputs:
            param = input_field(where)
            if isinstance(x, str):
                self.check_text_size(where, x)
                ids = await loop.run_in_executor(None, lambda t=x: tok.encode(
                    t, add_special_tokens=add_special_tokens))
                prompt: dict[str, Any] = {"prompt": x, "prompt_token_ids": ids}
            else:
                prompt = {"prompt_token_ids": x}
            if cache_salt is not None:
                prompt["cache_salt"] = cache_salt
            n = len(prompt["prompt_token_ids"])
            t = params.truncate_prompt_tokens
            if t is not None and (t == -1 or t >= 1):  # another value: the engine's 400
                n = min(n, truncation_keep(t, limit))
            # The engine runs a prompt as a prefill that leaves one position free.
            if n >= limit:
                raise OpenAIError(400, f"{where} has {n} tokens; this model's maximum context "
                                  f"length is {limit} tokens, so an input may have at most "
                                  f"{limit - 1}: shorten it, or set truncate_prompt_tokens",
                                  param=param)
            out.append((where, prompt))
        return out

    async def _pooled(self, inputs: list[tuple[str, dict[str, Any]]], params: PoolingParams,
                      base_id: str, priority: int, lora: LoRARequest | None
                      ) -> list[PoolingRequestOutput]:
        """Every input's output, in input order: all added at once (request i is
        `{base_id}-{i}`), then awaited; however it ends early (a refused input, a failed one, a
        cancellation) the others still running are aborted."""
        queue: asyncio.Queue = asyncio.Queue()
        index: dict[str, int] = {}
        pending: set[str] = set()  # added and not finished
        results: list[Any] = [None] * len(inputs)
        try:
            for i, (where, prompt) in enumerate(inputs):
                rid = f"{base_id}-{i}"
                try:
                    await self.engine.add_request(rid, prompt, params, priority, queue=queue,
                                                  lora_request=lora)
                except ValueError as e:
                    raise self._refused(e, where, base_id) from None
                # Only once added: a refused id (one in use) is another request's.
                pending.add(rid)
                index[rid] = i
                if self.request_logger is not None:
                    self.request_logger.inputs(rid, prompt.get("prompt"),
                                               prompt["prompt_token_ids"], params)
            while pending:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if not item.finished:
                    continue
                pending.discard(item.request_id)
                if item.outputs is None:  # aborted by someone else, or failed
                    raise RequestFailedError(f"request {item.request_id} ended without a "
                                             f"vector: {item.error}")
                results[index[item.request_id]] = item
        finally:
            if pending:
                self.engine.abort(sorted(pending))
        return results

    @staticmethod
    def _refused(e: ValueError, where: str, base_id: str) -> OpenAIError:
        """The OpenAIError of an input the engine refused."""
        msg = str(e)
        if "the engine is sleeping" in msg:  # (sleep mode) come back after wake_up
            return OpenAIError(503, msg, "server_error")
        if "is already in use" in msg:
            return OpenAIError(400, f"request_id {base_id!r} is already in use by a request "
                               "that has not finished", param="request_id")
        return bad_pooling_value(e, where)
