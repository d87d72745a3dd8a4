"""The two generation endpoints: requests in, OpenAI responses or server-sent events out."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import jinja2
from starlette.requests import Request as HTTPRequest

from jpaged.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from jpaged.frontend import truncation_keep
from jpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jpaged.sampling_params import SamplingParams
from jpaged.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    bad_value,
    error_body,
)

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


class _Batch:
    """The engine requests behind one HTTP request (one per prompt), on one shared queue."""

    def __init__(self, engine: AsyncLLMEngine, base_id: str, params: SamplingParams,
                 priority: int) -> None:
        self.engine, self.base_id, self.params, self.priority = engine, base_id, params, priority
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
        self.continuous_usage = bool(req.stream_options and req.stream_options.include_usage
                                     and req.stream_options.continuous_usage_stats)
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
                                              queue=self.queue)
                # Only once added: a refused id (one in use) belongs to another request, which
                # close() must never abort. (A cancelled add aborts itself if it went in.)
                self.pending.add(rid)
        except ValueError as e:
            self.close()
            if self.so_param is not None and str(e).startswith("structured_outputs"):
                # The grammar did not compile: name the field it came from.
                raise OpenAIError(400, self.so_param + str(e)[len("structured_outputs"):],
                                  param=self.so_param) from None
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
            if item.finished:
                self.pending.discard(item.request_id)
                if item.kv_transfer_params is not None:
                    self.kv_transfer_params = item.kv_transfer_params
            yield i, item

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


# The least logprob a response carries, as vLLM writes it: a token a constraint (a grammar, a
# structured choice) masks out has logprob -inf, which JSON cannot hold (OpenAI documents
# -9999.0 as "very unlikely"). Every logprob a response serializes goes through json_logprob.
MIN_JSON_LOGPROB = -9999.0


def json_logprob(logprob: float) -> float:
    """A logprob as a response writes it: -inf (a masked token) becomes MIN_JSON_LOGPROB."""
    return max(logprob, MIN_JSON_LOGPROB)


def prompt_logprobs_json(plp: list[dict[int, Logprob] | None] | None) -> list[Any] | None:
    """vLLM's JSON of prompt_logprobs: None, then {token id: {logprob, rank, decoded_token}}."""
    if plp is None:
        return None
    return [None if e is None else {str(t): {"logprob": json_logprob(lp.logprob),
                                             "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in plp]


def _tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def required_tool_calls(text: str) -> list[dict[str, Any]]:
    """The tool calls of a 'required' answer: its JSON array of {name, parameters}, each a
    call; none when the array is not whole (max_tokens or a stop string cut it), as vLLM,
    which parses the whole array or nothing."""
    try:
        return [_tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                for c in json.loads(text)]
    except (ValueError, TypeError, KeyError):  # the grammar holds, unless the output stopped
        return []


def tool_call_message(text: str, finish_reason: str | None, tools: str
                      ) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice and its finish_reason, as vLLM answers them.
    No forced tool: plain content. A forced one always answers `tool_calls` with content ""
    (never the generated JSON as content): a named function's one call, its arguments as
    generated even when max_tokens cut them (finish as the output's: "stop", as OpenAI answers
    a forced call, or "length"); 'required': the calls of the generated array, none when it was
    cut, finish "tool_calls" where the output stopped by itself ("stop"), else the output's."""
    if tools == "none":
        return {"role": "assistant", "content": text}, finish_reason
    if tools != "required":
        return ({"role": "assistant", "content": "",
                 "tool_calls": [_tool_call(tools, text)]}, finish_reason)
    return ({"role": "assistant", "content": "", "tool_calls": required_tool_calls(text)},
            "tool_calls" if finish_reason == "stop" else finish_reason)


class _ToolCallStream:
    """Streamed deltas of forced tool calls: a named function's arguments as they come (its id
    and name in the first delta), cut ones too; 'required' calls whole, in the finishing chunk
    (none, and no content, when the array was cut). No content delta ever, as vLLM."""

    def __init__(self, tools: str) -> None:
        self.tools = tools
        self.text: dict[int, str] = {}
        self.started: set[int] = set()

    def delta(self, index: int, text: str, finish: str | None
              ) -> tuple[dict[str, Any] | None, str | None]:
        """(delta or None to hold it back, finish_reason) of a choice's next piece."""
        if self.tools == "none":
            return ({"content": text} if text else {}), finish
        if self.tools != "required":
            if index not in self.started:
                self.started.add(index)
                call = {"index": 0, **_tool_call(self.tools, text)}
            elif text:
                call = {"index": 0, "function": {"arguments": text}}
            else:
                return {}, finish
            return {"tool_calls": [call]}, finish
        self.text[index] = self.text.get(index, "") + text
        if finish is None:
            return None, None
        calls = required_tool_calls(self.text.pop(index))
        if not calls:  # cut: an empty finishing delta; vLLM's stream says "tool_calls" only
            return {}, finish  # after it streamed a call
        return ({"tool_calls": [{"index": i, **tc} for i, tc in enumerate(calls)]},
                "tool_calls" if finish == "stop" else finish)


def _stream_error(e: BaseException) -> dict[str, Any]:
    if isinstance(e, OpenAIError):
        return e.body()
    return error_body(str(e), "server_error", code=503 if isinstance(e, EngineDeadError) else 500)


# ------------------------------------------------------------------------------ logprobs
def _token_text(lp: Logprob, tok: int, tokenizer: Any, as_ids: bool = False) -> str:
    # vLLM's return_tokens_as_token_ids: "token_id:N" (for tokens that are not whole text).
    if as_ids:
        return f"token_id:{tok}"
    return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tok], False)


def legacy_logprobs(ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None],
                    tokenizer: Any, offset: int, as_ids: bool = False) -> dict[str, Any]:
    """The legacy completions `logprobs` object of tokens `ids` with their entries (None: a
    token nothing scored, the prompt's first: null logprob and candidates), text starting at
    offset (as_ids: tokens written "token_id:N", vLLM's return_tokens_as_token_ids)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tok, entry in zip(ids, entries, strict=False):
        if entry is None:
            s = f"token_id:{tok}" if as_ids else tokenizer.decode([tok], False)
            lp, top = None, None
        else:
            s = _token_text(entry[tok], tok, tokenizer, as_ids)
            lp = json_logprob(entry[tok].logprob)
            top = {_token_text(x, t, tokenizer, as_ids): json_logprob(x.logprob)
                   for t, x in entry.items()}
        tokens.append(s)
        token_lps.append(lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def completion_logprobs(c: CompletionOutput, tokenizer: Any, offset: int,
                        as_ids: bool = False) -> dict[str, Any] | None:
    """The legacy completions `logprobs` object for the tokens of `c` (None unless asked)."""
    if c.logprobs is None:
        return None
    return legacy_logprobs(c.token_ids, c.logprobs, tokenizer, offset, as_ids)


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


def chat_logprobs(c: CompletionOutput, tokenizer: Any, as_ids: bool = False, top_n: int = 0
                  ) -> dict[str, Any] | None:
    """The chat `logprobs` object ({"content": [...]}) for the tokens of `c`: each token's
    `top_logprobs` are its step's `top_n` most likely (-1: all the entry holds, the whole
    vocabulary; the sampled token, ranked in every entry, is among them only when it is one of
    them)."""
    if c.logprobs is None:
        return None

    def item(t: int, lp: Logprob) -> dict[str, Any]:
        s = _token_text(lp, t, tokenizer, as_ids)
        return {"token": s, "logprob": json_logprob(lp.logprob),
                "bytes": list(s.encode("utf-8"))}

    content = []
    for tok, entry in zip(c.token_ids, c.logprobs, strict=False):
        top = sorted((lp.rank, t, lp) for t, lp in entry.items() if lp.rank is not None)
        if top_n >= 0:
            top = top[:top_n]
        content.append({**item(tok, entry[tok]), "top_logprobs": [item(t, lp)
                                                                  for _, t, lp in top]})
    return {"content": content}


def _max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes any single token id decodes to (at least 1)."""
    n = tokenizer.vocab_size
    return max([1, *(len(tokenizer.decode([i], False).encode("utf-8", "surrogatepass"))
                     for i in range(n))])


# ------------------------------------------------------------------------------ completions
class Serving:
    """Handlers of /v1/completions and /v1/chat/completions over one AsyncLLMEngine."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
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

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is absent, empty (vLLM: the default model) or the served name."""
        if model and model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist.", param="model",
                              code="model_not_found")

    async def completion(self, req: CompletionRequest, http: HTTPRequest
                         ) -> dict[str, Any] | EventStream | None:
        """A completion response dict, an SSE stream, or None if the client went away."""
        # Watched from the start: a client gone while its prompt is tokenized or added is never
        # run (the add aborts itself), rather than found out only when output is ready.
        return await until_disconnected(http, self._completion(req))

    async def _completion(self, req: CompletionRequest) -> dict[str, Any] | EventStream:
        self.check_model(req.model)
        params = req.to_sampling_params()
        prompts = await self._tokenized(req.prompts(), params, "prompt")
        if req.kv_transfer_params is not None and len(prompts) > 1:
            raise OpenAIError(400, "kv_transfer_params needs a single prompt (one request's KV "
                              "moves)", param="kv_transfer_params")
        batch = _Batch(self.engine, req.request_id or f"cmpl-{uuid.uuid4().hex}", params,
                       req.priority)
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
                "model": self.model_name}
        if req.stream:
            return EventStream(self._stream_completion(batch, head, echo, req.include_usage),
                               batch.close)
        return await self._full_completion(batch, head, echo)

    async def _full_completion(self, batch: _Batch, head: dict[str, Any],
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

    @staticmethod
    async def _framed(chunks: AsyncIterator[str], batch: _Batch, head: dict[str, Any],
                      include_usage: bool) -> AsyncIterator[str]:
        """An SSE body: the chunks, the usage chunk when asked, an error chunk if the request
        failed, then [DONE]; the batch is closed however the stream ends."""
        try:
            async for chunk in chunks:
                yield chunk
            if include_usage:
                yield sse({**head, "choices": [], "usage": batch.usage()})
        except (OpenAIError, RequestFailedError, EngineDeadError) as e:
            yield sse(_stream_error(e))
        finally:
            batch.close()
            await chunks.aclose()  # type: ignore[attr-defined]
        yield DONE

    def _stream_completion(self, batch: _Batch, head: dict[str, Any], echo: _Echo | None,
                           include_usage: bool) -> AsyncIterator[str]:
        return self._framed(self._completion_chunks(batch, head, echo, include_usage), batch,
                            head, include_usage)

    async def _completion_chunks(self, batch: _Batch, head: dict[str, Any],
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

    # -------------------------------------------------------------------------- chat
    def _chat_prompt(self, req: ChatCompletionRequest) -> dict[str, Any]:
        tok = self.engine.tokenizer
        if not tok.has_chat_template and req.chat_template is None:
            raise OpenAIError(400, "this model has no chat template; use /v1/completions or "
                              "pass chat_template", param="messages")
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
            text = tok.apply_chat_template(req.conversation(), add_generation_prompt=add_prompt,
                                           chat_template=req.chat_template,
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
        return req.salted({"prompt": text})

    async def chat(self, req: ChatCompletionRequest, http: HTTPRequest
                   ) -> dict[str, Any] | EventStream | None:
        """A chat completion dict, an SSE stream, or None if the client went away."""
        return await until_disconnected(http, self._chat(req))  # as completion(): from the start

    async def _chat(self, req: ChatCompletionRequest) -> dict[str, Any] | EventStream:
        self.check_model(req.model)
        params = req.to_sampling_params()
        tools = req.tool_mode()[0]  # 'none', 'required' or the forced function's name
        # The template holds the special tokens already: no second BOS.
        prompt = (await self._tokenized(
            [self._chat_prompt(req)], params, "messages", add_special_tokens=False,
            max_tokens_param=req.field_names().get("max_tokens", "max_tokens")))[0]
        batch = _Batch(self.engine, req.request_id or f"chatcmpl-{uuid.uuid4().hex}", params,
                       req.priority)
        batch.configure(req)
        await batch.start([prompt], "messages")
        head = {"id": batch.base_id, "created": int(time.time()), "model": self.model_name}
        echo = req.echoed() if tools == "none" else ""
        if req.stream:
            return EventStream(self._stream_chat(batch, head, req.include_usage, tools, echo),
                               batch.close)
        return await self._full_chat(batch, head, tools, echo)

    async def _full_chat(self, batch: _Batch, head: dict[str, Any], tools: str = "none",
                         echo: str = "") -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        prompt_ids: list[int] | None = None
        plp = None
        try:
            async for _, out in batch.outputs():
                prompt_ids = out.prompt_token_ids
                plp = out.prompt_logprobs if out.prompt_logprobs is not None else plp
                for c in out.outputs:
                    message, finish = tool_call_message(echo + c.text, c.finish_reason, tools)
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

    def _stream_chat(self, batch: _Batch, head: dict[str, Any], include_usage: bool,
                     tools: str = "none", echo: str = "") -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk"}
        return self._framed(self._chat_chunks(batch, head, include_usage, tools, echo), batch,
                            head, include_usage)

    async def _chat_chunks(self, batch: _Batch, head: dict[str, Any], include_usage: bool,
                           tools: str = "none", echo: str = "") -> AsyncIterator[str]:
        for i in range(batch.params.n):  # the role comes first, before any token
            # Every chunk carries usage when asked (vLLM's continuous_usage_stats: the prompt
            # and this choice's tokens so far, here none; else null until the final chunk).
            extra = {"usage": batch.chunk_usage(i)} if include_usage else {}
            yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                  "content": ""},
                                            "logprobs": None, "finish_reason": None}],
                       **extra})
            if echo:  # vLLM's echo: the continued message's text, before the new tokens
                yield sse({**head, "choices": [{"index": i, "delta": {"content": echo},
                                                "logprobs": None, "finish_reason": None}],
                           **extra})
        done: set[int] = set()  # choices whose final chunk went out (n > 1 repeats them)
        sent_prompt: set[int] = set()  # choices whose prompt_token_ids went out
        calls = _ToolCallStream(tools)
        async for _, out in batch.outputs():
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
                delta, finish = calls.delta(c.index, c.text, c.finish_reason)
                if delta is None:  # held back: 'required' calls go out whole at the finish
                    continue
                choice = {"index": c.index, "delta": delta, "logprobs": lps,
                          "finish_reason": finish, "stop_reason": c.stop_reason}
                if batch.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                chunk = {**head, "choices": [choice]}
                if batch.return_token_ids and c.index not in sent_prompt:
                    sent_prompt.add(c.index)
                    chunk["prompt_token_ids"] = out.prompt_token_ids
                if include_usage:
                    chunk["usage"] = batch.chunk_usage(c.index)
                yield sse(chunk)
