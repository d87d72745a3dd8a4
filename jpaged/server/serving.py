"""What the generation endpoints share: the Serving base (prompt tokenization and its checks,
the model check, SSE framing), the event-stream type and the disconnect watch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import jinja2
from starlette.requests import Request as HTTPRequest

from jpaged.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from jpaged.beam_search import BeamSearch, BeamSearchOutput, BeamSearchSequence
from jpaged.frontend import truncation_keep
from jpaged.lora_request import LoRARequest
from jpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from jpaged.server.batch import RequestBatch
from jpaged.server.protocol import OpenAIError, error_body
from jpaged.server.reasoning_parsers import ReasoningParser
from jpaged.server.request_log import RequestLogger
from jpaged.server.tool_parsers import ToolParser

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


@dataclass
class EventStream:
    """A server-sent event stream and the abort to run however it ends (even unstarted)."""

    events: AsyncIterator[str]
    close: Callable[[], None]


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event in OpenAI's framing."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def until_disconnected(request: HTTPRequest, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it (None) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.cancelled() or not watcher.done():
            raise
        return None


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: a file's template, or the value itself when it is one (it has
    braces or a line break); a ValueError otherwise, or when it does not compile."""
    from pathlib import Path

    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: {e}") from None
    elif any(c in value for c in "{}\n"):
        text = value
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a template (no "
                         "such file; a template has {{ }} or {% %})")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not compile: {e}") from None
    return text


def stream_error(e: BaseException) -> dict[str, Any]:
    """The error body a stream ends with for `e` (an OpenAIError's own, else a 500/503)."""
    if isinstance(e, OpenAIError):
        return e.body()
    return error_body(str(e), "server_error", code=503 if isinstance(e, EngineDeadError) else 500)


def _max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes any single token id decodes to (at least 1)."""
    n = tokenizer.vocab_size
    return max([1, *(len(tokenizer.decode([i], False).encode("utf-8", "surrogatepass"))
                     for i in range(n))])


class Serving:
    """The endpoints' shared state and steps over one AsyncLLMEngine (CompletionServing and
    ChatServing add the handlers)."""

    def __init__(self, engine: AsyncLLMEngine, model_names: Sequence[str],
                 tool_parser: ToolParser | None = None, chat_template: str | None = None,
                 request_logger: RequestLogger | None = None,
                 reasoning_parser: ReasoningParser | None = None) -> None:
        self.engine = engine
        # vLLM's --reasoning-parser: splits a reasoning model's thought from its answer.
        self.reasoning_parser = reasoning_parser
        self.request_logger = request_logger  # vLLM's --enable-log-requests (None: off)
        # The names requests may use (vLLM's --served-model-name list); answers carry the first.
        self.model_names = list(model_names)
        self.model_name = self.model_names[0]
        # vLLM's --lora-modules (and adapters loaded at run time), by the name a request's
        # `model` gives; answers to such a request carry that name.
        self.lora_modules: dict[str, LoRARequest] = {}
        # vLLM's --chat-template: the server's template in place of the model's (a request's
        # own chat_template still wins).
        self.chat_template = chat_template
        # vLLM's --tool-call-parser: finds the model's own calls (tool_choice 'auto').
        self.tool_parser = tool_parser
        # The longest token's UTF-8 text (bytes): the decode of every token id, once per server
        # and before any request. (Computed lazily, every request that arrived before the first
        # computation ended, or was cancelled during it, ran it again: 200 requests at once
        # queued 200 of them on the executor, ahead of the next request's tokenization.)
        self.max_token_bytes = _max_token_bytes(engine.tokenizer)

    async def _tokenized(self, prompts: list[Any], params: SamplingParams, param: str,
                         add_special_tokens: bool = True, max_tokens_param: str = "max_tokens"
                         ) -> list[Any]:
        """The prompts with their token ids, encoded off the event loop and checked as vLLM's
        server checks them: a prompt that leaves no room to generate, or a max_tokens past
        max_model_len, is a 400 here (the offline engine would cut max_tokens short)."""
        tok, limit = self.engine.tokenizer, self.engine.max_model_len
        loop = asyncio.get_running_loop()
        out = []
        for p in prompts:
            text = p if isinstance(p, str) else None
            if isinstance(p, dict) and "prompt_token_ids" not in p:
                text = p.get("prompt")
            if isinstance(text, str):
                size = len(text.encode("utf-8", "surrogatepass"))
                # No token covers more than the longest token's bytes (x4: normalizers may
                # shrink text), so a longer text needs more tokens than max_model_len: refused
                # without tokenizing megabytes.
                if size > 4 * limit * self.max_token_bytes:
                    raise OpenAIError(400, f"prompt of {size} bytes is longer than this model's "
                                      f"maximum context length of {limit} tokens", param=param)
                ids = await loop.run_in_executor(None, lambda t=text: tok.encode(
                    t, add_special_tokens=add_special_tokens))
                p = {**(p if isinstance(p, dict) else {}), "prompt": text,
                     "prompt_token_ids": ids}
            out.append(p)
            n = len(p["prompt_token_ids"]) if isinstance(p, dict) else 0
            if params.truncate_prompt_tokens is not None:
                n = min(n, truncation_keep(params.truncate_prompt_tokens, limit))
            if params.max_tokens is not None and n < limit and n + params.max_tokens > limit:
                raise OpenAIError(
                    400, f"{max_tokens_param} is too large: {params.max_tokens}. This model's "
                    f"maximum context length is {limit} tokens and your request has {n} input "
                    f"tokens ({params.max_tokens} > {limit} - {n})", param=max_tokens_param)
        return out

    async def _beam_search(self, prompts: list[Any], params: BeamSearchParams, base_id: str,
                           priority: int, param: str, salted: Callable[[Any], Any],
                           lora: LoRARequest | None = None
                           ) -> tuple[list[BeamSearchOutput], dict[str, Any]]:
        """Each prompt's best beams (jpaged/beam_search.py), every step's live beams run as
        one-token requests (`salted`: a beam's prompt with the request's cache_salt); and the
        usage: prompts once, completion tokens of the beams returned."""
        try:
            search = BeamSearch(len(prompts), params, self.engine.eos_token_ids,
                                self.engine.max_model_len, self.engine.logprobs_limit)
        except ValueError as e:  # more beams than max_logprobs / 2
            raise OpenAIError(400, f"n: {e}", param="n") from None
        step = search.step_params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
        prompt_tokens = cached = 0
        while not search.done:
            beams = search.requests()
            batch = RequestBatch(self.engine, f"{base_id}-beam{search.steps}", step, priority,
                                 self.request_logger, lora)
            await batch.start(prompts if beams is None else [salted(b) for b in beams], param)
            outs: list[Any] = [None] * len(batch.index)
            try:
                async for i, out in batch.outputs():
                    outs[i] = out
            finally:
                batch.close()
            if beams is None:
                prompt_tokens, cached = sum(batch.prompt_tokens.values()), batch.cached_tokens
            search.advance(outs)
        results = search.results()
        done = sum(len(s.output_token_ids) for r in results for s in r.sequences)
        return results, {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                         "total_tokens": prompt_tokens + done,
                         "prompt_tokens_details": {"cached_tokens": cached}}

    @staticmethod
    def beam_stream(head: dict[str, Any], chunks: list[tuple[dict[str, Any], int, int]],
                    usage: dict[str, Any], include_usage: bool, continuous_usage: bool,
                    ) -> EventStream:
        """A finished beam search as an SSE stream (vLLM streams beams once the search ends):
        one chunk per (its fields with "choices", its choice's prompt tokens, that choice's
        tokens so far), the usage chunk when asked, then [DONE]. Nothing runs while it
        streams, so there is nothing to abort."""
        async def events() -> AsyncIterator[str]:
            for fields, prompt, done in chunks:
                extra = ({"usage": {"prompt_tokens": prompt, "completion_tokens": done,
                                    "total_tokens": prompt + done}} if continuous_usage else {})
                yield sse({**head, **fields, **extra})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage})
            yield DONE

        return EventStream(events(), lambda: None)

    def beam_text(self, seq: BeamSearchSequence, skip_special_tokens: bool) -> str:
        """A beam's generated text, its final EOS left out (vLLM's server text)."""
        ids = seq.output_token_ids[:-1] if seq.finish_reason == "stop" else seq.output_token_ids
        return self.engine.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_text(self, req: Any) -> str:
        """The prompt text of a chat request (a ChatCompletionRequest or a TokenizeRequest with
        messages) rendered by its chat template or the model's; 400s name the field."""
        tok = self.engine.tokenizer
        template = req.chat_template if req.chat_template is not None else self.chat_template
        if not tok.has_chat_template and template is None:
            raise OpenAIError(400, "this model has no chat template; use /v1/completions, "
                              "pass chat_template, or serve with --chat-template",
                              param="messages")
        kwargs = req.chat_template_kwargs or {}
        if not isinstance(kwargs, dict):
            raise OpenAIError(400, "chat_template_kwargs must be an object",
                              param="chat_template_kwargs")
        extra = {**kwargs, **({"tools": req.tools} if req.tools else {})}
        add_prompt = req.add_generation_prompt and not req.continue_final_message
        if req.continue_final_message and "add_generation_prompt" in req.model_fields_set \
                and req.add_generation_prompt:
            raise OpenAIError(400, "continue_final_message and add_generation_prompt cannot "
                              "both be true", param="continue_final_message")
        try:
            return tok.apply_chat_template(req.conversation(), add_generation_prompt=add_prompt,
                                           chat_template=template,
                                           continue_final_message=req.continue_final_message,
                                           **extra)
        except jinja2.TemplateSyntaxError as e:
            raise OpenAIError(400, f"chat_template does not compile: {e}",
                              param="chat_template") from None
        except jinja2.TemplateError as e:
            raise OpenAIError(400, f"the chat template rejected the messages: {e}",
                              param="messages") from None
        except ValueError as e:
            raise OpenAIError(400, str(e), param="continue_final_message") from None

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is absent, empty (vLLM: the default model), a served name or a
        LoRA adapter's."""
        if model and model not in self.model_names and model not in self.lora_modules:
            raise OpenAIError(404, f"The model `{model}` does not exist.", param="model",
                              code="model_not_found")

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model)."""
        return self.lora_modules.get(model) if model else None

    def answer_model(self, model: str | None) -> str:
        """The model name an answer carries: the adapter's when `model` names one."""
        return model if model and model in self.lora_modules else self.model_name

    @staticmethod
    async def _framed(chunks: AsyncIterator[str], batch: RequestBatch, head: dict[str, Any],
                      include_usage: bool) -> AsyncIterator[str]:
        """An SSE body: the chunks, the usage chunk when asked, an error chunk if the request
        failed, then [DONE]; the batch is closed however the stream ends."""
        try:
            async for chunk in chunks:
                yield chunk
            if include_usage:
                yield sse({**head, "choices": [], "usage": batch.usage()})
        except (OpenAIError, RequestFailedError, EngineDeadError) as e:
            yield sse(stream_error(e))
        finally:
            batch.close()
            await chunks.aclose()  # type: ignore[attr-defined]
        yield DONE
