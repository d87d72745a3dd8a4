"""The /v1/chat/completions endpoint: a chat completion or its SSE stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request as HTTPRequest

from jpaged.sampling_params import BeamSearchParams, SamplingParams
from jpaged.server.batch import RequestBatch
from jpaged.server.logprobs import chat_logprobs, prompt_logprobs_json
from jpaged.server.protocol import ChatCompletionRequest, OpenAIError
from jpaged.server.reasoning_parsers import ReasoningParser, ReasoningStream
from jpaged.server.serving import EventStream, Serving, sse, until_disconnected
from jpaged.server.tool_calls import ToolCallStream


@dataclass
class ChatRun:
    """A chat request in the engine: its batch, its tool-call reader and its tool mode."""

    batch: RequestBatch
    calls: ToolCallStream
    tools: str  # 'none', 'auto', 'required' or the forced function's name
    # The server's reasoning parser where it applies (not to an output a grammar constrains
    # from its first token: that one cannot think first), and whether the answer starts in
    # thought (qwen3's enable_thinking).
    reasoning: ReasoningParser | None = None
    thinking: bool = True
    include_reasoning: bool = True  # vLLM's request field: false drops the thought

    def split(self, text: str) -> tuple[str | None, str]:
        """A finished choice's (reasoning or None, the rest) (all the rest without a parser)."""
        if self.reasoning is None:
            return None, text
        reasoning, content = self.reasoning.split(text, self.thinking)
        return reasoning, content or ""

    def stream(self) -> ReasoningStream | None:
        """A choice's streamed reasoning split (None without a parser)."""
        return None if self.reasoning is None else ReasoningStream(self.reasoning,
                                                                    self.thinking)


class ChatServing(Serving):
    """The handler of /v1/chat/completions."""

    def _chat_prompt(self, req: ChatCompletionRequest) -> dict[str, Any]:
        if req.prompt_token_ids is not None:  # token-in: the ids as given, no template
            return req.salted({"prompt_token_ids": list(req.prompt_token_ids)})
        return req.salted({"prompt": self.chat_text(req)})

    async def chat(self, req: ChatCompletionRequest, http: HTTPRequest
                   ) -> dict[str, Any] | EventStream | None:
        """A chat completion dict, an SSE stream, or None if the client went away."""
        return await until_disconnected(http, self._chat(req))  # as completion(): from the start

    async def _chat(self, req: ChatCompletionRequest) -> dict[str, Any] | EventStream:
        started = await self._start_chat(req, "chatcmpl")
        if not isinstance(started, ChatRun):
            return started  # beam search's whole answer
        batch = started.batch
        head = {"id": batch.base_id, "created": int(time.time()),
                "model": self.answer_model(req.model)}
        echo = req.echoed() if started.tools == "none" else ""
        if req.stream:
            return EventStream(self._stream_chat(started, head, req.include_usage, echo),
                               batch.close)
        return await self._full_chat(started, head, echo)

    async def _start_chat(self, req: ChatCompletionRequest, id_prefix: str
                          ) -> ChatRun | dict[str, Any] | EventStream:
        """Check a chat request, render and tokenize its prompt and add it to the engine (its
        id `id_prefix`-<hex> unless it names one); a beam search runs whole here."""
        self.check_model(req.model)
        req.check_prompt()
        params = req.to_sampling_params(self.engine.default_sampling)
        tools = req.tool_mode()[0]  # 'none', 'auto', 'required' or the forced function's name
        parser = self.tool_parser if tools == "auto" else None
        if tools == "auto" and parser is None and req.auto_tools_as_text:
            tools = "none"  # the tools reach the template; the answer is text
        if tools == "auto":
            if parser is None:  # vLLM's answer, and its flags' names
                raise OpenAIError(400, '"auto" tool choice requires --enable-auto-tool-choice '
                                  "and --tool-call-parser to be set", param="tool_choice")
            if parser.keeps_special_tokens:
                params = params.clone(skip_special_tokens=False)
        reasoning = self.reasoning_parser if params.structured_outputs is None else None
        if reasoning is not None and params.skip_special_tokens:
            params = params.clone(skip_special_tokens=False)  # the tags may be special tokens
        # The template holds the special tokens already: no second BOS unless asked.
        param = req.prompt_param
        prompt = (await self._tokenized(
            [self._chat_prompt(req)], params, param,
            add_special_tokens=req.add_special_tokens,
            max_tokens_param=req.field_names().get("max_tokens", "max_tokens")))[0]
        beam = req.beam_search_params(params)
        if beam is not None:
            return await self._beam_chat(req, prompt, params, beam)
        batch = RequestBatch(self.engine, req.request_id or f"{id_prefix}-{uuid.uuid4().hex}",
                             params, req.priority, self.request_logger,
                             self.lora_for(req.model))
        batch.configure(req)
        await batch.start([prompt], param)
        return ChatRun(batch, ToolCallStream(tools, parser, req.parallel_tool_calls is not False),
                       tools, reasoning,
                       reasoning is not None and reasoning.thinking(req.chat_template_kwargs),
                       req.include_reasoning)

    async def _beam_chat(self, req: ChatCompletionRequest, prompt: Any, params: SamplingParams,
                         beam: BeamSearchParams) -> dict[str, Any] | EventStream:
        """use_beam_search: the n best beams as the n choices, best first (a stream sends each
        choice's role, then its whole message, once the search ends)."""
        base = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        (result,), usage = await self._beam_search([prompt], beam, base, req.priority,
                                                   req.prompt_param, req.salted,
                                                   self.lora_for(req.model))
        echo = req.echoed()
        head = {"id": base, "created": int(time.time()), "model": self.answer_model(req.model)}
        choices = []
        for j, seq in enumerate(result.sequences):
            text = echo + self.beam_text(seq, params.skip_special_tokens)
            choices.append({"index": j, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": seq.finish_reason,
                            "stop_reason": seq.stop_reason})
            if req.return_token_ids:
                choices[-1]["token_ids"] = seq.output_token_ids
        prompt_ids = result.sequences[0].tokens[:result.sequences[0].num_prompt_tokens]
        if req.stream:
            chunks = []
            for c, seq in zip(choices, result.sequences, strict=True):
                role = {"index": c["index"], "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}
                text = c.pop("message")["content"]
                first: dict[str, Any] = {"choices": [role]}
                if req.return_token_ids and not chunks:  # as vLLM: on the first chunk only
                    first["prompt_token_ids"] = prompt_ids
                chunks += [(first, seq.num_prompt_tokens, 0),
                           ({"choices": [{**c, "delta": {"content": text}}]},
                            seq.num_prompt_tokens, len(seq.output_token_ids))]
            return self.beam_stream({**head, "object": "chat.completion.chunk"}, chunks, usage,
                                    req.include_usage, req.continuous_usage)
        body = {**head, "object": "chat.completion", "choices": choices, "usage": usage}
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        return body

    async def _full_chat(self, run: ChatRun, head: dict[str, Any], echo: str = ""
                         ) -> dict[str, Any]:
        batch, calls = run.batch, run.calls
        choices: list[dict[str, Any]] = []
        prompt_ids: list[int] | None = None
        plp = None
        try:
            async for _, out in batch.outputs():
                prompt_ids = out.prompt_token_ids
                plp = out.prompt_logprobs if out.prompt_logprobs is not None else plp
                for c in out.outputs:
                    reasoning, text = run.split(c.text)
                    message, finish = calls.message(echo + text, c.finish_reason)
                    if run.reasoning is not None:
                        message = _with_reasoning(
                            message, reasoning if run.include_reasoning else None, text)
                    choices.append({"index": c.index, "message": message,
                                    "logprobs": chat_logprobs(c, self.engine.tokenizer,
                                                              batch.tokens_as_ids,
                                                              batch.params.logprobs or 0),
                                    "finish_reason": finish,
                                    "stop_reason": c.stop_reason})
                    if batch.return_token_ids:
                        choices[-1]["token_ids"] = list(c.token_ids)
        finally:
            batch.close()
        choices.sort(key=lambda ch: ch["index"])
        body = {**head, "object": "chat.completion", "choices": choices, "usage": batch.usage(),
                "kv_transfer_params": batch.kv_transfer_params}
        if batch.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        if batch.params.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(plp)
        return body

    def _stream_chat(self, run: ChatRun, head: dict[str, Any], include_usage: bool,
                     echo: str = "") -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk"}
        return self._framed(self._chat_chunks(run, head, include_usage, echo), run.batch,
                            head, include_usage)

    async def _chat_chunks(self, run: ChatRun, head: dict[str, Any], include_usage: bool,
                           echo: str = "") -> AsyncIterator[str]:
        batch, calls = run.batch, run.calls
        thoughts: dict[int, ReasoningStream] = {}  # per choice, with a reasoning parser
        def roles(prompt_ids: list[int] | None) -> list[str]:
            """Each choice's role chunk (and echo): the first carries the prompt's ids when
            return_token_ids asks (vLLM's place for them)."""
            chunks = []
            for i in range(batch.params.n):
                # Every chunk carries usage when asked (vLLM's continuous_usage_stats: the
                # prompt and this choice's tokens so far, here none; else null until the end).
                extra = {"usage": batch.chunk_usage(i)} if include_usage else {}
                first = {"prompt_token_ids": prompt_ids} if prompt_ids is not None and i == 0 \
                    else {}
                chunks.append(sse({**head, "choices": [{
                    "index": i, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}], **first, **extra}))
                if echo:  # vLLM's echo: the continued message's text, before the new tokens
                    chunks.append(sse({**head, "choices": [{
                        "index": i, "delta": {"content": echo}, "logprobs": None,
                        "finish_reason": None}], **extra}))
            return chunks

        # The roles come first, before any token; with return_token_ids once the engine has
        # the prompt's ids (its first output), which the first role chunk carries.
        pending_roles = batch.return_token_ids
        if not pending_roles:
            for chunk in roles(None):
                yield chunk
        done: set[int] = set()  # choices whose final chunk went out (n > 1 repeats them)
        async for _, out in batch.outputs():
            if pending_roles:
                pending_roles = False
                for chunk in roles(list(out.prompt_token_ids)):
                    yield chunk
            for c in out.outputs:
                if c.index in done:
                    continue
                lps = chat_logprobs(c, self.engine.tokenizer, batch.tokens_as_ids,
                                    batch.params.logprobs or 0)
                if not c.text and c.finish_reason is None and not (
                        (lps or batch.return_token_ids) and c.token_ids):
                    continue
                if c.finish_reason is not None:
                    done.add(c.index)
                text, thought = c.text, ""
                if run.reasoning is not None:
                    split = thoughts.get(c.index)
                    if split is None:
                        split = thoughts[c.index] = run.stream()
                    thought, text = split.delta(c.text, c.finish_reason is not None)
                    thought = thought if run.include_reasoning else ""
                    if not (thought or text or c.finish_reason or lps or batch.return_token_ids):
                        continue  # what may be a tag: held back
                delta, finish = calls.delta(c.index, text, c.finish_reason)
                if thought:  # vLLM's field, and its former name (clients read either)
                    delta = {"reasoning": thought, "reasoning_content": thought, **(delta or {})}
                    if delta.get("content") == "" and "tool_calls" not in delta:
                        del delta["content"]
                if delta is None:  # held back: 'required' calls go out whole at the finish
                    continue
                choice = {"index": c.index, "delta": delta, "logprobs": lps,
                          "finish_reason": finish, "stop_reason": c.stop_reason}
                if batch.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                chunk = {**head, "choices": [choice]}
                if include_usage:
                    chunk["usage"] = batch.chunk_usage(c.index)
                yield sse(chunk)


def _with_reasoning(message: dict[str, Any], reasoning: str | None, text: str
                    ) -> dict[str, Any]:
    """A finished message with its reasoning (vLLM's `reasoning`, and `reasoning_content`,
    its former name); content null when the answer was all thought."""
    out = {**message, "reasoning": reasoning, "reasoning_content": reasoning}
    if not text and not message.get("tool_calls"):
        out["content"] = None
    return out
