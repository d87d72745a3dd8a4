"""vLLM's score API (/score and /v1/score) for an embedding (bi-encoder) model: the cosine
similarity of text pairs, as `LLM.score` gives it, each distinct text embedded once."""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from starlette.requests import Request as HTTPRequest

from jpaged.server.embeddings import EmbeddingServing
from jpaged.server.protocol import ScoreRequest
from jpaged.server.serving import until_disconnected


class ScoreServing(EmbeddingServing):
    """The handler of /score (and /v1/score), over the embeddings' prompts and requests."""

    async def score(self, req: ScoreRequest, http: HTTPRequest) -> dict[str, Any] | None:
        """The score response, or None if the client went away (its requests aborted)."""
        return await until_disconnected(http, self._score(req))

    async def _score(self, req: ScoreRequest) -> dict[str, Any]:
        self.check_model(req.model)
        self.need_pooler("the score API")
        req.refuse_unknown()
        left, right = req.pairs()
        # Each distinct text runs once, named by where it first appears.
        first: dict[str, int] = {}
        texts: list[tuple[str, str | list[int]]] = []
        for where, text in (*left, *right):
            if text not in first:
                first[text] = len(texts)
                texts.append((where, text))
        params = req.pooling_params()
        inputs = await self._prompts(texts, params, cache_salt=req.cache_salt)
        base = req.request_id or f"score-{uuid.uuid4().hex}"
        outs = await self._pooled(inputs, params, base, req.priority, self.lora_for(req.model))
        data, tokens = [], 0
        for i, ((_, a), (_, b)) in enumerate(zip(left, right, strict=True)):
            x, y = outs[first[a]], outs[first[b]]
            # Unit vectors: their dot product is the cosine (LLM.score's arithmetic).
            score = float(np.dot(x.outputs.data, y.outputs.data))
            data.append({"index": i, "object": "score", "score": score})
            tokens += len(x.prompt_token_ids) + len(y.prompt_token_ids)
        return {"id": base, "object": "list", "created": int(time.time()),
                "model": self.answer_model(req.model), "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
