"""OpenAI request bodies (pydantic), their SamplingParams, and OpenAI-shaped errors."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from jpaged.core.structured_output import relocated
from jpaged.pooling_params import PoolingParams
from jpaged.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from models.tokenizer import message_text, template_tool_calls


class OpenAIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients expect."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_FIELD_RE = re.compile(r"SamplingParams\.(\w+)")


def bad_value(e: ValueError, default_param: str | None = None,
              names: dict[str, str] | None = None) -> OpenAIError:
    """A 400 for a ValueError from SamplingParams or the engine; `param` names the field, as
    the request spells it (`names`: SamplingParams field -> request field, where they differ)."""
    msg = str(e)
    if msg.startswith("kv_transfer_params"):  # the KV connector's checks name the field
        return OpenAIError(400, msg, param="kv_transfer_params")
    m = _FIELD_RE.search(msg)
    if m is None:
        return OpenAIError(400, msg, param=default_param)
    field = (names or {}).get(m.group(1), m.group(1))
    # The request's spelling, without the Python class name.
    return OpenAIError(400, msg.replace(m.group(0), field), param=field)


class StreamOptions(BaseModel):
    """`stream_options`: whether a final chunk carries usage."""

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage so far on every chunk


# Fields vLLM's server accepts that this one does not implement yet, with the value meaning
# "not used": any other value is refused with a 400 naming the field, never ignored.
_NOT_YET: dict[str, Any] = {
    "logits_processors": None,
    "prompt_embeds": None, "vllm_xargs": None,
    "documents": None, "mm_processor_kwargs": None, "reasoning_effort": None,
    "logprob_token_ids": None, "packed_top_logprobs": False, "repetition_detection": None,
    "thinking_token_budget": None, "watermarking": None, "ec_transfer_params": None,
    "media_io_kwargs": None, "return_prompt_text": False, "stream_interval": 1,
    # OpenAI's deprecated function calling (`tools` and `tool_choice` replace them).
    "functions": None, "function_call": None,
    # OpenAI fields that change the answer in ways this server cannot give.
    "prediction": None, "modalities": None, "audio": None, "web_search_options": None,
    "verbosity": None,
}
# OpenAI fields that do not change what is generated (storage, billing tier, abuse and cache
# routing hints): accepted and not used. Any other field a request's model does not declare
# is a 400 naming it, never dropped.
_NO_EFFECT = frozenset({"metadata", "store", "service_tier", "safety_identifier",
                        "prompt_cache_key"})
# vLLM's structured-output backends this server can honour (llguidance is the one it has).
_BACKENDS = (None, "auto", "guidance", "llguidance")
_SO_FIELDS = set(StructuredOutputsParams.__dataclass_fields__)


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    model_config = ConfigDict(extra="allow")  # unknown fields: read by refuse_unimplemented

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # vLLM's; no effect with fast tokenizers
    include_stop_str_in_output: bool = False
    priority: int = 0
    # vLLM's disaggregated prefill/decode: {"do_remote_decode": true} on a producer; the
    # producer's response params (with do_remote_prefill) on a consumer.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's prefix-cache salt: requests with different salts share no cached block.
    cache_salt: str | None = None
    # vLLM: keep only k of the prompt's tokens (-1: as many as max_model_len allows), the
    # last ones, or with truncation_side "right" the first ones.
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # None: "left", vLLM's default
    # vLLM: each choice carries its token ids, and the response (first chunk) the prompt's.
    return_token_ids: bool = False
    request_id: str | None = None  # vLLM: the id the response carries
    allowed_token_ids: list[int] | None = None  # vLLM: sample only among these
    prompt_logprobs: int | None = None  # vLLM: each prompt token's logprob (+ top k)
    bad_words: list[str] | None = None  # vLLM: words the output may not contain
    return_tokens_as_token_ids: bool = False  # vLLM: logprob tokens as "token_id:N"
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and the former
    # guided_* fields (at most one of them per request).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    # vLLM's beam search: n beams, ranked by cumulative logprob / length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def beam_search_params(self, params: SamplingParams) -> BeamSearchParams | None:
        """BeamSearchParams of a `use_beam_search` request (its n beams, max_tokens,
        ignore_eos, temperature), else None. What beam search would not apply (logprobs, stop
        conditions, token constraints, an output constraint) is a 400 naming the field, never
        ignored. A stream gets the beams when the search ends, as vLLM streams them."""
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise OpenAIError(400, "length_penalty needs use_beam_search",
                                  param="length_penalty")
            return None
        names = self.field_names()
        unapplied = (("logprobs", params.logprobs is not None),
                     ("prompt_logprobs", params.prompt_logprobs is not None),
                     ("stop", bool(params.stop)), ("stop_token_ids", bool(params.stop_token_ids)),
                     ("min_tokens", params.min_tokens > 0), ("bad_words", bool(params.bad_words)),
                     ("logit_bias", bool(params.logit_bias)),
                     ("allowed_token_ids", params.allowed_token_ids is not None),
                     (self.structured_param() or "structured_outputs",
                      params.structured_outputs is not None),
                     ("kv_transfer_params", self.kv_transfer_params is not None))
        for name, used in unapplied:
            if used:
                name = names.get(name, name)
                raise OpenAIError(400, f"{name} is not applied by beam search: leave it out "
                                  "with use_beam_search", param=name)
        try:
            return BeamSearchParams(
                beam_width=params.n, max_tokens=params.max_tokens or 2**31 - 1,
                ignore_eos=params.ignore_eos, temperature=params.temperature,
                length_penalty=self.length_penalty)
        except ValueError as e:
            field = str(e).split(" ")[0].removeprefix("BeamSearchParams.")
            raise OpenAIError(400, str(e), param={"beam_width": "n"}.get(field, field)) from None

    def _constraints(self) -> list[tuple[str, dict[str, Any]]]:
        """(field, StructuredOutputsParams arguments) of each output constraint the request
        sets, in the order its fields are read (OpenAIError 400 naming a malformed one)."""
        found: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None:
            if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object",
                                                                   "json_schema",
                                                                   "structural_tag"):
                raise OpenAIError(400, "response_format.type must be 'text', 'json_object', "
                                  f"'json_schema' or 'structural_tag', got {rf!r}",
                                  param="response_format")
            if rf["type"] == "structural_tag":  # vLLM's: {structures, triggers} beside type
                found.append(("response_format", {"structural_tag": json.dumps(
                    {k: v for k, v in rf.items() if k != "type"})}))
            elif rf["type"] == "json_object":
                found.append(("response_format", {"json_object": True}))
            elif rf["type"] == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise OpenAIError(400, "response_format.json_schema.schema must be a JSON "
                                      "schema object", param="response_format")
                found.append(("response_format", {"json": schema}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            if not isinstance(so, dict):
                raise OpenAIError(400, "structured_outputs must be an object",
                                  param="structured_outputs")
            unknown = sorted(set(so) - _SO_FIELDS)
            if unknown:
                raise OpenAIError(400, f"structured_outputs has unknown fields {unknown}",
                                  param="structured_outputs")
            so = dict(so)
            if isinstance(so.get("structural_tag"), dict):  # JSON text in vLLM's class
                so["structural_tag"] = json.dumps(so["structural_tag"])
            found.append(("structured_outputs", so))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            value = getattr(self, name)
            if value is not None:
                found.append((name, {name.removeprefix("guided_"): value}))
        return found

    def structured(self) -> StructuredOutputsParams | None:
        """The request's output constraint (OpenAIError 400 naming the field when malformed)."""
        if self.guided_decoding_backend not in _BACKENDS:
            raise OpenAIError(400, f"guided_decoding_backend {self.guided_decoding_backend!r} "
                              "is not available: this server's backend is llguidance",
                              param="guided_decoding_backend")
        found = self._constraints()
        if not found:
            return None
        if len(found) > 1:
            raise OpenAIError(400, "only one structured output may be given, got "
                              f"{[n for n, _ in found]}", param=found[1][0])
        name, kw = found[0]
        if self.guided_whitespace_pattern is not None:
            kw.setdefault("whitespace_pattern", self.guided_whitespace_pattern)
        try:
            return StructuredOutputsParams(**kw)
        except (ValueError, TypeError) as e:
            raise OpenAIError(400, f"{name}: {e}", param=name) from None

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with integer token ids (OpenAI sends them as JSON object keys)."""
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise OpenAIError(400, f"logit_bias keys must be token ids, got "
                              f"{sorted(self.logit_bias)[:5]}", param="logit_bias") from None

    def refuse_unimplemented(self) -> None:
        """400 naming the first vLLM field set that this server does not implement yet, or the
        first field it does not know at all."""
        extra = self.model_extra or {}
        for name, unused in _NOT_YET.items():
            if name in extra and extra[name] != unused:
                raise OpenAIError(400, f"{name} is not supported by this server yet",
                                  param=name)
        for name in extra:
            if name not in _NOT_YET and name not in _NO_EFFECT:
                raise OpenAIError(400, f"unknown field {name!r}: this server does not "
                                  f"implement it", param=name)

    def salted(self, prompt: Any) -> Any:
        """The engine prompt with this request's cache_salt (a dict prompt when salted)."""
        if self.cache_salt is None:
            return prompt
        if not self.cache_salt:
            raise OpenAIError(400, "cache_salt must be a non-empty string", param="cache_salt")
        base = {"prompt": prompt} if isinstance(prompt, str) else dict(prompt)
        return {**base, "cache_salt": self.cache_salt}

    def _unsupported(self) -> None:
        self.refuse_unimplemented()
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true",
                              param="stream_options")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """SamplingParams for this request; a bad value raises OpenAIError(400) naming it.
        `defaults`: the engine's sampling defaults (the model's generation config) for the
        fields the request leaves unset, else SamplingParams' own; their max_tokens (the
        model's max_new_tokens) caps the request's."""
        self._unsupported()
        d = defaults or {}
        if d.get("max_tokens") is not None:  # vLLM: the model's max_new_tokens caps any ask
            max_tokens = d["max_tokens"] if max_tokens is None else min(max_tokens,
                                                                       d["max_tokens"])

        def unset_or(name: str, fallback: float) -> Any:
            value = getattr(self, name)
            return d.get(name, fallback) if value is None else value

        kw: dict[str, Any] = dict(
            n=self.n, temperature=unset_or("temperature", 1.0), top_p=unset_or("top_p", 1.0),
            top_k=unset_or("top_k", -1), min_p=unset_or("min_p", 0.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=unset_or("repetition_penalty", 1.0),
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, max_tokens=max_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side or "left",
            logit_bias=self.token_bias(), allowed_token_ids=self.allowed_token_ids,
            prompt_logprobs=self.prompt_logprobs, bad_words=self.bad_words,
            structured_outputs=self.structured_or_tools(),
            extra_args=({"kv_transfer_params": self.kv_transfer_params}
                        if self.kv_transfer_params is not None else None),
        )
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise bad_value(e, names=self.field_names()) from None

    def field_names(self) -> dict[str, str]:
        """SamplingParams fields this request spells otherwise (its errors name its own)."""
        return {}

    def structured_or_tools(self) -> StructuredOutputsParams | None:
        """The output constraint (chat requests add their tool calls' schema)."""
        return self.structured()

    def structured_param(self) -> str | None:
        """The field this request's output constraint came from (None: none)."""
        found = self._constraints()
        return found[0][0] if found else None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries usage (vLLM's continuous_usage_stats)."""
        return self.include_usage and bool(self.stream_options
                                           and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    """Body of POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM: the tokenizer's special tokens (BOS) around text

    def prompts(self) -> list[str | dict[str, Any]]:
        """The engine prompts: one per string or token-id list."""
        p = self.prompt
        if isinstance(p, str):
            out: list[Any] = [p]
        elif not p:
            raise OpenAIError(400, "prompt is empty", param="prompt")
        elif isinstance(p[0], int):
            out = [{"prompt_token_ids": list(p)}]
        elif isinstance(p[0], str):
            out = list(p)
        else:
            out = [{"prompt_token_ids": list(ids)} for ids in p]
        for x in out:
            if x == "" or (isinstance(x, dict) and not x["prompt_token_ids"]):
                raise OpenAIError(400, "prompt is empty", param="prompt")
        return [self.salted(x) for x in out]

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """SamplingParams of this completion request (`defaults`: see sampling_params)."""
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError(400, "best_of different from n is not supported", param="best_of")
        max_tokens = self.max_tokens
        if max_tokens == 0:
            if not self.echo:
                raise OpenAIError(400, "max_tokens must be >= 1 (0 only with echo: the prompt "
                                  "comes back, scored with logprobs if asked, and nothing is "
                                  "generated)", param="max_tokens")
            max_tokens = 1  # as vLLM: one token is generated, then left out of the answer
        params = self.sampling_params(max_tokens, self.logprobs, defaults)
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            # The echoed prompt's tokens come with their logprobs (an eval harness's scores).
            params = params.clone(prompt_logprobs=self.logprobs)
        return params

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt alone."""
        return self.echo and self.max_tokens == 0


class ChatMessage(BaseModel):
    """One chat message; content is a string or a list of text parts."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message content as plain text (text parts joined)."""
        try:
            return message_text(self.content)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages") from None


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as {"role", "content"} dicts for the chat template, with what a tool-use
    template reads: a message's `name`, a tool result's `tool_call_id`, an assistant's
    `tool_calls` (their JSON arguments as objects, as vLLM hands them to HF templates)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        extra = m.model_extra or {}
        if extra.get("tool_call_id") is not None:
            msg["tool_call_id"] = extra["tool_call_id"]
        thought = extra.get("reasoning_content", extra.get("reasoning"))
        if isinstance(thought, str):  # an earlier answer's thought, for templates that show it
            msg["reasoning_content"] = msg["reasoning"] = thought
        if extra.get("tool_calls") is not None:
            try:
                msg["tool_calls"] = template_tool_calls(extra["tool_calls"])
            except ValueError as e:
                raise OpenAIError(400, f"messages[{i}].{e}", param="messages") from None
        out.append(msg)
    return out


# The request fields that shape how messages are rendered by the chat template.
_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template",
                    "chat_template_kwargs")


class ChatCompletionRequest(_SamplingRequest):
    """Body of POST /v1/chat/completions."""

    # tool_choice 'auto' on a server without a tool-call parser: a 400 naming the flags
    # (vLLM's chat), or (True: vLLM's Responses API) the answer is plain text.
    auto_tools_as_text: ClassVar[bool] = False

    messages: list[ChatMessage] = Field(default_factory=list)
    # vLLM's token-in chat: the prompt's ids as /tokenize gave them, no template rendered
    # (then messages is empty and no template option is given).
    prompt_token_ids: list[int] | None = None
    # vLLM: the tokenizer's special tokens around the rendered text (the template has its own).
    add_special_tokens: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras: a Jinja template instead of the model's, variables for it, the last
    # (assistant) message continued instead of a new one, and that message echoed back.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    echo: bool = False
    # vLLM's: with a reasoning parser, false leaves the thought out of the answer.
    include_reasoning: bool = True

    def conversation(self) -> list[dict[str, Any]]:
        """Messages as dicts for the chat template (see `conversation`)."""
        return conversation(self.messages)

    @property
    def prompt_param(self) -> str:
        """The field a prompt error names: messages, or prompt_token_ids (token-in)."""
        return "messages" if self.prompt_token_ids is None else "prompt_token_ids"

    def check_prompt(self) -> None:
        """400 unless the request has messages, or (token-in) prompt_token_ids alone with no
        chat-template option."""
        if self.prompt_token_ids is None:
            if not self.messages:
                raise OpenAIError(400, "messages must hold at least one message (or pass "
                                  "prompt_token_ids instead)", param="messages")
            return
        if self.messages:
            raise OpenAIError(400, "prompt_token_ids replaces messages: send messages: [] "
                              "with it", param="prompt_token_ids")
        if not self.prompt_token_ids:
            raise OpenAIError(400, "prompt_token_ids is empty", param="prompt_token_ids")
        for name in (*_TEMPLATE_FIELDS, "add_special_tokens", "echo"):
            if name in self.model_fields_set:
                raise OpenAIError(400, f"{name} applies to rendered messages, not to "
                                  "prompt_token_ids (already tokenized)", param=name)

    def echoed(self) -> str:
        """vLLM's chat echo: the last message's text when it is the assistant's (the role the
        answer has), else nothing."""
        if not self.echo or not self.messages:
            return ""
        last = self.messages[-1]
        return last.text() if last.role == "assistant" else ""

    def tool_mode(self) -> tuple[str, dict[str, dict[str, Any]]]:
        """('none' | 'auto' | 'required' | a function's name, the tools' functions by name);
        400s name tools or tool_choice. Tools without a tool_choice: 'auto' (vLLM's default),
        which needs the server's tool-call parser (the handler checks)."""
        funcs: dict[str, dict[str, Any]] = {}
        if self.tools is not None and not self.tools:
            raise OpenAIError(400, "tools must not be an empty array (leave it out for none)",
                              param="tools")
        for i, t in enumerate(self.tools or []):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise OpenAIError(400, f"tools[{i}] must be {{'type': 'function', 'function': "
                                  "{'name': ..., 'parameters': {...}}}", param="tools")
            # No parameters (absent, null or {}): an empty object, as vLLM reads a function
            # without arguments (so a forced call's arguments are exactly {}).
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            if not isinstance(params, dict):
                raise OpenAIError(400, f"tools[{i}].function.parameters must be a JSON schema "
                                  "object", param="tools")
            funcs[fn["name"]] = {**fn, "parameters": params}
        choice = self.tool_choice
        if choice is None:
            choice = "auto" if funcs else "none"
        if choice == "none":
            return "none", funcs
        if not funcs:
            raise OpenAIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        if choice in ("auto", "required"):
            return choice, funcs
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
                choice.get("function"), dict):
            name = choice["function"].get("name")
            if name not in funcs:
                raise OpenAIError(400, f"tool_choice names function {name!r}, which tools do "
                                  f"not define (defined: {sorted(funcs)})", param="tool_choice")
            return name, funcs
        raise OpenAIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                          f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}",
                          param="tool_choice")

    def structured_param(self) -> str | None:
        """The field the output constraint came from: tools (the called function's
        parameters) for a forced tool call."""
        forced = self.tool_mode()[0] not in ("none", "auto")
        return "tools" if forced else super().structured_param()

    def field_names(self) -> dict[str, str]:
        """Chat spells logprobs' count top_logprobs, and max_tokens max_completion_tokens
        where that was given."""
        names = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    def structured_or_tools(self) -> StructuredOutputsParams | None:
        """A forced tool call constrains the output to its arguments' schema ('required': a
        JSON array of {name, parameters} calls, vLLM's shape)."""
        mode, funcs = self.tool_mode()
        if mode in ("none", "auto"):  # 'auto': the model's own syntax, found by the parser
            return self.structured()
        if self.structured() is not None:
            raise OpenAIError(400, "a forced tool call cannot be combined with a structured "
                              "output", param="tool_choice")
        if mode != "required":
            schema = funcs[mode]["parameters"]
        else:
            # Each function's parameters schema sits inside the array's: its local `$ref`s
            # (`#/$defs/X`, `#`) are rewritten to point where it now sits, so they resolve to
            # its own definitions (two tools may define the same name differently).
            where = ["/items"] if len(funcs) == 1 else [f"/items/anyOf/{i}"
                                                         for i in range(len(funcs))]
            calls = [{"type": "object", "properties": {
                "name": {"enum": [name]},
                "parameters": relocated(fn["parameters"], f"{at}/properties/parameters")},
                "required": ["name", "parameters"], "additionalProperties": False}
                for at, (name, fn) in zip(where, funcs.items(), strict=True)]
            schema = {"type": "array", "minItems": 1,
                      "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
            if self.parallel_tool_calls is False:
                schema["maxItems"] = 1
        try:
            return StructuredOutputsParams(json=schema)
        except ValueError as e:
            raise OpenAIError(400, f"tools: {e}", param="tools") from None

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """SamplingParams of this chat request (`defaults`: see sampling_params)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, defaults)


# TokenizeRequest fields that only a chat (messages) request uses.
_CHAT_ONLY = (*_TEMPLATE_FIELDS, "tools")


class _TextOrMessages(BaseModel):
    """A request that takes a text field (`_text`) or chat `messages` (with the chat-only
    fields `_chat_only`), not both."""

    _text: ClassVar[str]
    _chat_only: ClassVar[tuple[str, ...]]

    def check_one(self) -> None:
        """400 unless exactly one of the text field / messages is given, with only its own
        fields."""
        text = getattr(self, self._text)
        if (text is None) == (self.messages is None):  # type: ignore[attr-defined]
            raise OpenAIError(400, f"give exactly one of {self._text} or messages",
                              param=self._text)
        if self.messages is not None and not self.messages:  # type: ignore[attr-defined]
            raise OpenAIError(400, "messages is empty", param="messages")
        if text is not None:
            for name in self._chat_only:
                if name in self.model_fields_set:
                    raise OpenAIError(400, f"{name} applies only to messages, not to "
                                      f"{self._text}", param=name)

    @property
    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens (BOS) around the text."""
        given = getattr(self, "add_special_tokens", None)
        return given if given is not None else self.messages is None  # type: ignore

    def conversation(self) -> list[dict[str, Any]]:
        """Messages as dicts for the chat template (see `conversation`)."""
        return conversation(self.messages or [])  # type: ignore[attr-defined]


class TokenizeRequest(_TextOrMessages):
    """Body of POST /tokenize (vLLM's): a `prompt`, or chat `messages` rendered by the chat
    template as /v1/chat/completions renders them. Unknown fields are refused by name."""

    _text = "prompt"
    _chat_only = _CHAT_ONLY

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: vLLM's defaults, True for a prompt, False for messages (the template has them).
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    # Chat only, as /v1/chat/completions takes them.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def check(self) -> None:
        """400 unless exactly one of prompt / messages is given, with only its own fields."""
        self.check_one()


class DetokenizeRequest(BaseModel):
    """Body of POST /detokenize (vLLM's): token ids back to text, special tokens kept."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """Body of POST /v1/load_lora_adapter (vLLM's): the adapter's name and directory."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """Body of POST /v1/unload_lora_adapter (vLLM's): the adapter's name."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name alone identifies the adapter here


def _pooling_inputs(x: str | list[str] | list[int] | list[list[int]]
                    ) -> list[tuple[str, str | list[int]]]:
    """(how errors name it, its text or token ids) of each input of a pooling request's
    `input` field, in order; an empty input (or input list) is a 400."""
    if isinstance(x, str):
        out: list[tuple[str, Any]] = [("input", x)]
    elif not x:
        raise OpenAIError(400, "input is empty: give a string, a list of strings, a list "
                          "of token ids or a list of token id lists", param="input")
    elif isinstance(x[0], int):
        out = [("input", list(x))]
    else:
        out = [(f"input[{i}]", v) for i, v in enumerate(x)]
    for where, v in out:
        if not v:
            raise OpenAIError(400, f"{where} is empty", param="input")
    return out


def _refuse_extra(extra: dict[str, Any], not_yet: dict[str, tuple[Any, ...]],
                  endpoint: str) -> None:
    """400 naming the first extra field: one of vLLM's this server lacks (set to other than
    its unused values), or one nobody knows."""
    for name, unused in not_yet.items():
        if name in extra and extra[name] not in unused:
            raise OpenAIError(400, f"{name} is not supported by this server's {endpoint} yet",
                              param=name)
    for name in extra:
        if name not in not_yet:
            raise OpenAIError(400, f"unknown field {name!r}: this server does not implement "
                              "it", param=name)


def _check_salt(salt: str | None) -> None:
    if salt is not None and not salt:
        raise OpenAIError(400, "cache_salt must be a non-empty string", param="cache_salt")


class _PoolingRequest(BaseModel):
    """The fields every pooling request takes (vLLM's extras of /v1/embeddings, /classify,
    /score, /rerank). A field it does not know is a 400 naming it (`refuse_unknown`), never
    dropped; `_not_yet` lists vLLM's fields this server lacks, with their unused values."""

    model_config = ConfigDict(extra="allow")  # unknown fields: read by refuse_unknown
    _endpoint: ClassVar[str]
    _not_yet: ClassVar[dict[str, tuple[Any, ...]]]

    model: str | None = None
    user: str | None = None  # accepted, not used
    # vLLM: keep each text's first k tokens (-1: as many as the context allows).
    truncate_prompt_tokens: int | None = None
    # vLLM: whether the model's activation applies (an embedding's normalizing, a
    # classifier's softmax or sigmoid; false: the raw output); None: the model's default.
    use_activation: bool | None = None
    priority: int = 0
    request_id: str | None = None  # vLLM: the id the response carries
    cache_salt: str | None = None  # vLLM: keeps the prefix cache to requests of the same salt

    def refuse_unknown(self) -> None:
        """400 naming the first field set that this server does not implement or know, or
        the first the request's own checks refuse."""
        _check_salt(self.cache_salt)
        _refuse_extra(self.model_extra or {}, self._not_yet, self._endpoint)
        self.check_own()

    def check_own(self) -> None:
        """The request's own checks of its fields (none here)."""


class PoolingInputs(_TextOrMessages):
    """What /v1/embeddings and /classify take to pool: `input` (a string, strings, token ids
    or lists of them), or chat `messages` rendered by the chat template as one prompt (vLLM's
    EmbeddingChatRequest: no generation prompt and no added special tokens unless asked)."""

    _text = "input"
    _chat_only = _TEMPLATE_FIELDS

    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    # None: vLLM's defaults, True for input, False for messages (the template has them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    tools: ClassVar[None] = None  # (Serving.chat_text reads it: a pooling request has none)

    def check_own(self) -> None:
        """Exactly one of input / messages (`check_one`)."""
        self.check_one()

    def inputs(self) -> list[tuple[str, str | list[int]]]:
        """(how errors name it, its text or token ids) of each `input`, in order; an empty
        input (or input list) is a 400."""
        assert self.input is not None, "messages are rendered by the server (chat_text)"
        return _pooling_inputs(self.input)


# vLLM's /classify fields this server does not implement yet, with their unused values.
_CLASSIFY_NOT_YET: dict[str, tuple[Any, ...]] = {
    "mm_processor_kwargs": (None,), "softmax": (None,), "activation": (None,)}


class ClassificationRequest(PoolingInputs, _PoolingRequest):
    """Body of POST /classify (vLLM's, of a sequence classifier): `input` or `messages` as
    /v1/embeddings takes them; `use_activation` false gives the raw logits."""

    _endpoint = "/classify"
    _not_yet = _CLASSIFY_NOT_YET

    def pooling_params(self) -> PoolingParams:
        """The engine's PoolingParams of this request."""
        return PoolingParams(use_activation=self.use_activation,
                             truncate_prompt_tokens=self.truncate_prompt_tokens)


# vLLM's /rerank fields this server does not implement yet, with their unused values.
_RERANK_NOT_YET: dict[str, tuple[Any, ...]] = {
    "mm_processor_kwargs": (None,), "max_tokens_per_doc": (0,)}


class RerankRequest(_PoolingRequest):
    """Body of POST /rerank, /v1/rerank and /v2/rerank (vLLM's, Jina's and Cohere's shape):
    a `query` and its `documents`, answered best first (`top_n` of them; 0: all)."""

    _endpoint = "/rerank"
    _not_yet = _RERANK_NOT_YET

    query: str
    documents: list[str]
    top_n: int = 0
    return_documents: bool = True

    def check_own(self) -> None:
        """400 naming an empty query or document, or a negative top_n."""
        if not self.query:
            raise OpenAIError(400, "query is empty", param="query")
        if not self.documents:
            raise OpenAIError(400, "documents is empty: give the texts to rank",
                              param="documents")
        for i, doc in enumerate(self.documents):
            if not doc:
                raise OpenAIError(400, f"documents[{i}] is empty", param="documents")
        if self.top_n < 0:
            raise OpenAIError(400, f"top_n must be >= 0 (0: every document), got {self.top_n}",
                              param="top_n")

    def pairs(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """(where, text) of each pair's query and document, one entry per document."""
        docs = [(f"documents[{i}]", d) for i, d in enumerate(self.documents)]
        return [("query", self.query)] * len(docs), docs


# vLLM's /v1/embeddings fields this server does not implement yet, with the value meaning
# "not used": any other value is a 400 naming the field.
_EMBED_NOT_YET: dict[str, tuple[Any, ...]] = {
    "embed_dtype": ("float32",), "endianness": ("native",), "mm_processor_kwargs": (None,)}
_POOLING_FIELD_RE = re.compile(r"PoolingParams\.(\w+)")


class EmbeddingRequest(PoolingInputs, _PoolingRequest):
    """Body of POST /v1/embeddings (and /pooling): OpenAI's fields and vLLM's extras
    (`truncate_prompt_tokens`, `normalize`, `add_special_tokens`, `priority`, `request_id`,
    chat `messages`)."""

    _endpoint = "/v1/embeddings"
    _not_yet = _EMBED_NOT_YET

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # keep the first k features (Matryoshka), then normalize
    normalize: bool | None = None  # vLLM: L2-normalize (None: the server's pooler decides)

    def pooling_params(self) -> PoolingParams:
        """The engine's PoolingParams of this request."""
        return PoolingParams(normalize=self.normalize, dimensions=self.dimensions,
                             truncate_prompt_tokens=self.truncate_prompt_tokens,
                             use_activation=self.use_activation)


def input_field(where: str) -> str:
    """The request field an input's place names ("input[2]" -> "input", "text_2" -> "text_2",
    "documents[1] with query" -> "documents")."""
    return where.split(" ", 1)[0].split("[", 1)[0]


def bad_pooling_value(e: ValueError, where: str) -> OpenAIError:
    """A 400 for a ValueError of the pooling engine about input `where` ("input", "input[2]",
    "text_2[1]"): a PoolingParams field as the request spells it, token ids by their place in
    the input's field."""
    msg = str(e)
    m = _POOLING_FIELD_RE.search(msg)
    if m is not None:
        return OpenAIError(400, msg.replace(m.group(0), m.group(1)), param=m.group(1))
    if msg.startswith("prompt_token_ids"):  # prompt_token_ids[j] is ..., out of vocabulary
        return OpenAIError(400, where + msg[len("prompt_token_ids"):], param=input_field(where))
    return OpenAIError(400, f"{where}: {msg}", param=input_field(where))


# vLLM's score request names its two sides in one of these pairs (its newest: queries with
# documents or items, data_1 / data_2; its first: text_1 / text_2).
SCORE_PAIRS = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"),
               ("queries", "items"))
# Every field that names a side (what /invocations reads a score request by).
SCORE_SIDES = ("text_1", "text_2", "data_1", "data_2", "queries", "documents", "items")
# vLLM's /score fields this server does not implement yet, with the values meaning "not used":
# any other value is a 400 naming the field.
_SCORE_NOT_YET: dict[str, tuple[Any, ...]] = {
    "mm_processor_kwargs": (None,), "padding": (None, "do_not_pad"),
    "truncation_side": (None,), "max_tokens_per_query": (0,), "max_tokens_per_doc": (0,)}


class ScoreRequest(_PoolingRequest):
    """Body of POST /score and /v1/score (vLLM's score API): two sides of texts, as text_1 /
    text_2 or vLLM's newer data_1 / data_2 or queries / documents (or items); one text
    against each of the other side's, or pair i of two lists of one length."""

    _endpoint = "/score"
    _not_yet = _SCORE_NOT_YET

    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None

    def sides(self) -> tuple[str, str]:
        """The pair of fields the request names its two sides by; any other mix (one side
        missing, two names for one side) is a 400 naming a field."""
        given = [n for n in SCORE_SIDES if getattr(self, n) is not None]
        for pair in SCORE_PAIRS:
            if set(given) == set(pair):
                return pair
        firsts = [n for n in given if n in ("text_1", "data_1", "queries")]
        seconds = [n for n in given if n not in firsts]
        for side in (firsts, seconds):
            if len(side) > 1:
                raise OpenAIError(400, f"{side[0]} and {side[1]} name the same side: give only "
                                  "one of them", param=side[1])
        if not given:
            raise OpenAIError(400, "give the texts to score as text_1 and text_2 (or data_1 "
                              "and data_2, or queries and documents)", param="text_1")
        if not seconds:
            want = dict(SCORE_PAIRS)[firsts[0]]
            raise OpenAIError(400, f"{want} is missing: {firsts[0]} is scored against it",
                              param=want)
        want = {b: a for a, b in SCORE_PAIRS}[seconds[0]]
        if not firsts:
            raise OpenAIError(400, f"{want} is missing: it is scored against {seconds[0]}",
                              param=want)
        raise OpenAIError(400, f"{seconds[0]} goes with {want}, not with {firsts[0]}",
                          param=seconds[0])

    def pairs(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """(where, text) of each pair's first and second text, one list entry per pair: one
        first text against each second, or pair i of two lists of one length; an empty list
        or text, or lists of different lengths, is a 400 naming the field."""
        names = self.sides()
        left, right = (self._listed(n) for n in names)
        for name, side in zip(names, (left, right), strict=True):
            if not side:
                raise OpenAIError(400, f"{name} is empty: give a text or a list of texts",
                                  param=name)
            for where, text in side:
                if not text:
                    raise OpenAIError(400, f"{where} is empty", param=name)
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise OpenAIError(400, f"{names[0]} has {len(left)} texts and {names[1]} "
                              f"{len(right)}: give {names[0]} one text (scored against each "
                              f"of {names[1]}) or as many as {names[1]}", param=names[0])
        return left, right

    def _listed(self, name: str) -> list[tuple[str, str]]:
        """(where, text) of each text a side's field holds."""
        value = getattr(self, name)
        if isinstance(value, str):
            return [(name, value)]
        return [(f"{name}[{i}]", text) for i, text in enumerate(value)]

    def pooling_params(self) -> PoolingParams:
        """The engine's PoolingParams of each text: unit vectors, truncated as asked."""
        return PoolingParams(normalize=True, truncate_prompt_tokens=self.truncate_prompt_tokens)
