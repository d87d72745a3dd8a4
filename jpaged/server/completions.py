"""The /v1/completions endpoint: a completion response or its SSE stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request as HTTPRequest

from jpaged.outputs import RequestOutput
from jpaged.sampling_params import BeamSearchParams, SamplingParams
from jpaged.server.batch import RequestBatch
from jpaged.server.logprobs import completion_logprobs, legacy_logprobs, prompt_logprobs_json
from jpaged.server.protocol import CompletionRequest, OpenAIError
from jpaged.server.serving import EventStream, Serving, sse, until_disconnected


@dataclass
class _Echo:
    """A completion's echo: each prompt's text; whether its tokens come with their logprobs
    (echo with logprobs); whether the answer is the prompt alone (max_tokens 0)."""

    texts: list[str]
    logprobs: bool
    only: bool

    def head(self, i: int, out: RequestOutput, tokenizer: Any, as_ids: bool
             ) -> tuple[str, dict[str, Any] | None, int]:
        """What a choice of prompt i starts with: the prompt's text, its tokens' legacy
        logprobs (None unless asked; text offsets from 0), and where the generated tokens'
        text offsets start (after the prompt's tokens' text, or its text without logprobs)."""
        if not self.logprobs:
            return self.texts[i], None, len(self.texts[i])
        ids = out.prompt_token_ids
        lps = legacy_logprobs(ids, out.prompt_logprobs or [None] * len(ids), tokenizer, 0,
                              as_ids)
        end = lps["text_offset"][-1] + len(lps["tokens"][-1]) if ids else 0
        return self.texts[i], lps, end


def _joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two legacy logprobs objects one after the other (either may be None)."""
    if a is None or b is None:
        return a if b is None else b
    return {k: a[k] + b[k] for k in a}


class CompletionServing(Serving):
    """The handler of /v1/completions."""

    async def completion(self, req: CompletionRequest, http: HTTPRequest
                         ) -> dict[str, Any] | EventStream | None:
        """A completion response dict, an SSE stream, or None if the client went away."""
        # Watched from the start: a client gone while its prompt is tokenized or added is never
        # run (the add aborts itself), rather than found out only when output is ready.
        return await until_disconnected(http, self._completion(req))

    async def _completion(self, req: CompletionRequest) -> dict[str, Any] | EventStream:
        self.check_model(req.model)
        params = req.to_sampling_params(self.engine.default_sampling)
        prompts = await self._tokenized(req.prompts(), params, "prompt",
                                        add_special_tokens=req.add_special_tokens)
        beam = req.beam_search_params(params)
        if beam is not None:
            if req.echo:
                raise OpenAIError(400, "echo is not applied by beam search: leave it out with "
                                  "use_beam_search", param="echo")
            return await self._beam_completion(req, prompts, params, beam)
        if req.kv_transfer_params is not None and len(prompts) > 1:
            raise OpenAIError(400, "kv_transfer_params needs a single prompt (one request's KV "
                              "moves)", param="kv_transfer_params")
        batch = RequestBatch(self.engine, req.request_id or f"cmpl-{uuid.uuid4().hex}", params,
                             req.priority, self.request_logger, self.lora_for(req.model))
        batch.configure(req)
        await batch.start(prompts, "prompt")
        tok = self.engine.tokenizer
        echo = None
        if req.echo:  # a salted prompt is a dict that may hold the text
            echo = _Echo([p if isinstance(p, str) else p["prompt"]
                          if isinstance(p.get("prompt"), str)
                          else tok.decode(p["prompt_token_ids"], False) for p in prompts],
                         req.logprobs is not None, req.echo_only)
        head = {"id": batch.base_id, "object": "text_completion", "created": int(time.time()),
                "model": self.answer_model(req.model)}
        if req.stream:
            return EventStream(self._stream_completion(batch, head, echo, req.include_usage),
                               batch.close)
        return await self._full_completion(batch, head, echo)

    async def _beam_completion(self, req: CompletionRequest, prompts: list[Any],
                               params: SamplingParams, beam: BeamSearchParams
                               ) -> dict[str, Any] | EventStream:
        """use_beam_search: each prompt's n best beams as its n choices, best first (a stream
        sends each choice whole once the search ends)."""
        base = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        results, usage = await self._beam_search(prompts, beam, base, req.priority, "prompt",
                                                 req.salted, self.lora_for(req.model))
        chunks = []
        for i, result in enumerate(results):
            for j, seq in enumerate(result.sequences):
                choice = {"index": i * beam.beam_width + j,
                          "text": self.beam_text(seq, params.skip_special_tokens),
                          "logprobs": None, "finish_reason": seq.finish_reason,
                          "stop_reason": seq.stop_reason}
                if req.return_token_ids:
                    choice.update(prompt_token_ids=seq.tokens[:seq.num_prompt_tokens],
                                  token_ids=seq.output_token_ids)
                chunks.append(({"choices": [choice]}, seq.num_prompt_tokens,
                               len(seq.output_token_ids)))
        head = {"id": base, "object": "text_completion", "created": int(time.time()),
                "model": self.answer_model(req.model)}
        if req.stream:
            return self.beam_stream(head, chunks, usage, req.include_usage,
                                    req.continuous_usage)
        return {**head, "choices": [c["choices"][0] for c, _, _ in chunks], "usage": usage}

    async def _full_completion(self, batch: RequestBatch, head: dict[str, Any],
                               echo: _Echo | None) -> dict[str, Any]:
        n = batch.params.n
        tok, as_ids = self.engine.tokenizer, batch.tokens_as_ids
        only = echo is not None and echo.only  # the prompt alone: the generated token is left
        choices: list[dict[str, Any]] = []
        try:
            async for i, out in batch.outputs():
                for c in out.outputs:
                    prefix, plps, start = (echo.head(i, out, tok, as_ids) if echo
                                           else ("", None, 0))
                    gen = None if only else completion_logprobs(c, tok, start, as_ids)
                    choices.append({"index": i * n + c.index,
                                    "text": prefix + ("" if only else c.text),
                                    "logprobs": _joined(plps, gen),
                                    "finish_reason": c.finish_reason,
                                    "stop_reason": c.stop_reason})
                    if batch.return_token_ids:
                        choices[-1].update(prompt_token_ids=out.prompt_token_ids,
                                           token_ids=[] if only else list(c.token_ids))
                    if batch.params.prompt_logprobs is not None:
                        choices[-1]["prompt_logprobs"] = prompt_logprobs_json(
                            out.prompt_logprobs)
        finally:
            batch.close()
        choices.sort(key=lambda ch: ch["index"])
        return {**head, "choices": choices, "usage": batch.usage(),
                "kv_transfer_params": batch.kv_transfer_params}

    def _stream_completion(self, batch: RequestBatch, head: dict[str, Any], echo: _Echo | None,
                           include_usage: bool) -> AsyncIterator[str]:
        return self._framed(self._completion_chunks(batch, head, echo, include_usage), batch,
                            head, include_usage)

    async def _completion_chunks(self, batch: RequestBatch, head: dict[str, Any],
                                 echo: _Echo | None, include_usage: bool
                                 ) -> AsyncIterator[str]:
        n = batch.params.n
        tok, as_ids = self.engine.tokenizer, batch.tokens_as_ids
        only = echo is not None and echo.only  # the prompt alone: the generated token is left
        # Choice index -> where its next token's text starts: the echo plus every token's text
        # so far, as the non-streamed offsets count (text held back by a stop string moves
        # the text sent, not the tokens).
        offsets: dict[int, int] = {}
        done: set[int] = set()  # choices whose final chunk went out (n > 1 repeats them)
        sent_prompt: set[int] = set()  # choices whose prompt_token_ids went out
        plp: dict[int, Any] = {}  # prompt index -> prompt_logprobs not yet sent
        async for i, out in batch.outputs():
            if out.prompt_logprobs is not None:  # a DELTA stream has them once
                plp[i] = prompt_logprobs_json(out.prompt_logprobs)
            for c in out.outputs:
                idx = i * n + c.index
                if idx in done:
                    continue
                text = "" if only else c.text
                plps = None
                if idx not in offsets:  # the choice's first chunk: the echo goes first
                    prefix, plps, offsets[idx] = (echo.head(i, out, tok, as_ids) if echo
                                                  else ("", None, 0))
                    text = prefix + text
                lps = None if only else completion_logprobs(c, tok, offsets[idx], as_ids)
                if lps is not None:
                    offsets[idx] += sum(map(len, lps["tokens"]))
                lps = _joined(plps, lps)
                if not text and c.finish_reason is None and not (
                        (lps or batch.return_token_ids) and c.token_ids):
                    continue  # a token held back (incomplete UTF-8 character)
                if c.finish_reason is not None:
                    done.add(idx)
                choice = {"index": idx, "text": text, "logprobs": lps,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if batch.return_token_ids:
                    choice["token_ids"] = [] if only else list(c.token_ids)
                    if idx not in sent_prompt:
                        sent_prompt.add(idx)
                        choice["prompt_token_ids"] = out.prompt_token_ids
                if i in plp:  # on the prompt's first chunk that goes out
                    choice["prompt_logprobs"] = plp.pop(i)
                chunk = {**head, "choices": [choice]}
                if include_usage:
                    chunk["usage"] = batch.chunk_usage(idx)
                yield sse(chunk)
