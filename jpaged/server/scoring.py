"""vLLM's score and rerank APIs (/score, /v1/score; /rerank, /v1/rerank, /v2/rerank): text
pairs scored as `LLM.score` scores them. An embedding (bi-encoder) model's score is the cosine
of the two texts' vectors, each distinct text embedded once; a cross-encoder's (a one-label
sequence classifier) the probability its head gives the pair read as one prompt."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import numpy as np
from starlette.requests import Request as HTTPRequest

from jpaged.pooling_params import PoolingParams, check_cross_encoder, cross_encoder_prompt
from jpaged.server.embeddings import EmbeddingServing
from jpaged.server.protocol import OpenAIError, RerankRequest, ScoreRequest
from jpaged.server.serving import until_disconnected

Pairs = tuple[list[tuple[str, str]], list[tuple[str, str]]]


class ScoreServing(EmbeddingServing):
    """The handlers of /score (and /v1/score) and of /rerank, over the embeddings' prompts
    and requests."""

    async def score(self, req: ScoreRequest, http: HTTPRequest) -> dict[str, Any] | None:
        """The score response, or None if the client went away (its requests aborted)."""
        return await until_disconnected(http, self._score(req))

    async def rerank(self, req: RerankRequest, http: HTTPRequest) -> dict[str, Any] | None:
        """The rerank response, or None if the client went away (its requests aborted)."""
        return await until_disconnected(http, self._rerank(req))

    async def _score(self, req: ScoreRequest) -> dict[str, Any]:
        self.check_model(req.model)
        self.need_pooler("the score API")
        req.refuse_unknown()
        base = req.request_id or f"score-{uuid.uuid4().hex}"
        scores, tokens = await self._scores(req, req.pairs(), base)
        return self.list_response(base, req.model, [{"index": i, "object": "score", "score": s}
                                                    for i, s in enumerate(scores)], sum(tokens))

    async def _rerank(self, req: RerankRequest) -> dict[str, Any]:
        self.check_model(req.model)
        self.need_pooler("the rerank API")
        req.refuse_unknown()
        base = req.request_id or f"rerank-{uuid.uuid4().hex}"
        scores, tokens = await self._scores(req, req.pairs(), base)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties by index
        if req.top_n:
            order = order[:req.top_n]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                item["document"] = {"text": req.documents[i]}
            results.append(item)
        return {"id": base, "model": self.answer_model(req.model), "results": results,
                "usage": {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}}

    async def _scores(self, req: ScoreRequest | RerankRequest, pairs: Pairs, base: str
                      ) -> tuple[list[float], list[int]]:
        """Each pair's score and the prompt tokens it took, in pair order."""
        if self.engine.labels:
            return await self._cross_scores(req, pairs, base)
        left, right = pairs
        # Each distinct text runs once, named by where it first appears.
        first: dict[str, int] = {}
        texts: list[tuple[str, str | list[int]]] = []
        for where, text in (*left, *right):
            if text not in first:
                first[text] = len(texts)
                texts.append((where, text))
        params = PoolingParams(normalize=True, truncate_prompt_tokens=req.truncate_prompt_tokens)
        inputs = await self._prompts(texts, params, cache_salt=req.cache_salt)
        outs = await self._pooled(inputs, params, base, req.priority, self.lora_for(req.model))
        scores, tokens = [], []
        for (_, a), (_, b) in zip(left, right, strict=True):
            x, y = outs[first[a]], outs[first[b]]
            # Unit vectors: their dot product is the cosine (LLM.score's arithmetic).
            scores.append(float(np.dot(x.outputs.data, y.outputs.data)))
            tokens.append(len(x.prompt_token_ids) + len(y.prompt_token_ids))
        return scores, tokens

    async def _cross_scores(self, req: ScoreRequest | RerankRequest, pairs: Pairs, base: str
                            ) -> tuple[list[float], list[int]]:
        """A cross-encoder's scores: each pair one prompt (the tokenizer's pair encoding),
        its one label's probability (its raw logit with use_activation false)."""
        try:
            check_cross_encoder(self.engine.spec)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="model") from None
        tok = self.engine.tokenizer
        loop = asyncio.get_running_loop()
        joined: list[tuple[str, str | list[int]]] = []
        for (wa, a), (wb, b) in zip(*pairs, strict=True):
            for where, text in ((wa, a), (wb, b)):  # a text too long to tokenize at all
                self.check_text_size(where, text)
            ids = await loop.run_in_executor(
                None, lambda x=a, y=b: cross_encoder_prompt(tok, x, y)["prompt_token_ids"])
            joined.append((f"{wb} with {wa}", ids))
        params = PoolingParams(use_activation=req.use_activation,
                               truncate_prompt_tokens=req.truncate_prompt_tokens)
        inputs = await self._prompts(joined, params, cache_salt=req.cache_salt)
        outs = await self._pooled(inputs, params, base, req.priority, self.lora_for(req.model))
        return ([float(o.outputs.data[0]) for o in outs],
                [len(o.prompt_token_ids) for o in outs])
