"""OpenAI's Responses API as vLLM serves it: the request body, its conversation as chat
messages (a Responses request runs as the chat request it amounts to), and the response object
and its output items."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from jpaged.server.protocol import ChatCompletionRequest, OpenAIError
from models.tokenizer import message_text

# Undeclared fields taken: OpenAI's that change nothing here (echoed back where the response
# has them), and vLLM's chat_template_kwargs (chat_request reads it).
_ACCEPTED = frozenset({"service_tier", "user", "prompt_cache_key", "safety_identifier",
                       "max_tool_calls", "stream_options", "prompt_cache_retention",
                       "chat_template_kwargs"})
# Fields OpenAI defines for what this server cannot do: refused by name when set.
_REFUSED = {
    "prompt": "prompt templates (stored prompts) are not supported",
    "conversation": "conversations are not supported: pass previous_response_id, or the "
                    "whole conversation as input",
    "context_management": "context_management is not supported",
}
# The sampling fields vLLM's Responses endpoint takes beside OpenAI's, passed to the chat
# request as they are.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
             "ignore_eos", "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
             "priority", "cache_salt", "structured_outputs", "presence_penalty",
             "frequency_penalty", "min_tokens", "stop_token_ids", "bad_words",
             "allowed_token_ids")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def new_id(prefix: str) -> str:
    """A fresh id with OpenAI's prefix for its kind (resp, msg, fc, call)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(BaseModel):
    """Body of POST /v1/responses (OpenAI's fields and vLLM's extra sampling fields)."""

    model_config = ConfigDict(extra="allow")  # unknown fields: refused by name in check()

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    model: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    metadata: dict[str, str] | None = None
    request_id: str | None = None  # vLLM: the response's id

    def check(self) -> None:
        """400 naming the first field this server does not take."""
        extra = self.model_extra or {}
        for name, why in _REFUSED.items():
            if extra.get(name) is not None:
                raise OpenAIError(400, why, param=name)
        for name in extra:
            if name not in _ACCEPTED and name not in _SAMPLING:
                raise OpenAIError(400, f"unknown field {name!r}: this server does not "
                                  "implement it", param=name)
        if self.background and not self.store:
            raise OpenAIError(400, "background needs store to be true (a background "
                              "response is read back by its id)", param="background")
        if isinstance(self.input, list) and not self.input:
            raise OpenAIError(400, "input must hold at least one item", param="input")
        if self.request_id is not None and not self.request_id:
            raise OpenAIError(400, "request_id must not be empty", param="request_id")

    @property
    def logprobs(self) -> bool:
        """Whether the output text carries logprobs (include message.output_text.logprobs)."""
        return LOGPROBS_INCLUDE in (self.include or [])

    def input_messages(self) -> list[dict[str, Any]]:
        """The request's input as chat messages: a string is one user message; a list holds
        messages (text parts only), function calls (an assistant message's tool_calls, calls
        in a row joined) and their outputs (tool messages). Reasoning items are left out (the
        chat template would not render them)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise OpenAIError(400, f"{where} must be an object", param="input")
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message":
                messages.append(_message(item, where))
            elif kind == "function_call":
                call = _function_call(item, where)
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    # An answer's text and its calls are one assistant turn (a response's
                    # output items replayed as input render as previous_response_id does).
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None,
                                     "tool_calls": [call]})
            elif kind == "function_call_output":
                call_id, output = item.get("call_id"), item.get("output")
                if not isinstance(call_id, str) or not call_id:
                    raise OpenAIError(400, f"{where}.call_id must be a non-empty string",
                                      param="input")
                if not isinstance(output, str):
                    output = _text(output, f"{where}.output")
                messages.append({"role": "tool", "content": output, "tool_call_id": call_id})
            elif kind == "reasoning":
                continue
            else:
                raise OpenAIError(400, f"{where}.type {kind!r} is not supported: input items are "
                                  "messages, function_call and function_call_output",
                                  param="input")
        return messages

    def continues_final_message(self) -> bool:
        """vLLM's partial answer: the last input item is an assistant message whose status is
        in_progress or incomplete, continued instead of answered."""
        if isinstance(self.input, str) or not self.input:
            return False
        last = self.input[-1]
        return (isinstance(last, dict) and last.get("role") == "assistant"
                and last.get("type", "message") == "message"
                and last.get("status") in ("in_progress", "incomplete"))

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in chat's shape ({type, function: {name, ...}}); any other tool
        type is a 400."""
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else tool
                raise OpenAIError(400, f"tools[{i}]: type {kind!r} is not supported: this "
                                  "server runs function tools only", param="tools")
            out.append({"type": "function",
                        "function": {k: v for k, v in tool.items() if k != "type"}})
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        """tool_choice in chat's shape (a named function as {type, function: {name}})."""
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise OpenAIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                                  f"{{'type': 'function', 'name': ...}}, got {choice!r}",
                                  param="tool_choice")
            return {"type": "function", "function": {"name": choice["name"]}}
        if not self.tools and choice == "auto":
            return None  # the default, with no tools: nothing to choose from
        return choice

    def response_format(self) -> dict[str, Any] | None:
        """text.format as chat's response_format (None for plain text)."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise OpenAIError(400, "text.format.schema must be a JSON schema object",
                                  param="text")
            return {"type": "json_schema",
                    "json_schema": {"name": fmt.get("name", "response"),
                                    "schema": fmt["schema"]}}
        raise OpenAIError(400, "text.format.type must be 'text', 'json_object' or "
                          f"'json_schema', got {fmt!r}", param="text")

    def chat_request(self, history: list[dict[str, Any]], max_model_len: int
                     ) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
        """The chat request this response amounts to (the instructions as a system message,
        then `history`, an earlier response's conversation, then the input), and the
        conversation a later turn continues (`history` and the input; developer messages
        joined the instructions, which do not carry over, as vLLM keeps no system message)."""
        self.check()
        given = self.input_messages()
        # Developer messages join the instructions, the one system message (vLLM's rule:
        # chat templates know no developer role).
        system = [self.instructions or ""] + [m["content"] for m in given
                                              if m["role"] == "developer"]
        system_text = "\n\n".join(t for t in system if t)
        messages = [{"role": "system", "content": system_text}] if system_text else []
        turn = [m for m in given if m["role"] != "developer"]
        messages += history + turn
        body: dict[str, Any] = {"messages": messages, "stream": self.stream,
                                "max_tokens": self.max_output_tokens,
                                "parallel_tool_calls": self.parallel_tool_calls,
                                "request_id": self.request_id, "model": self.model}
        for name in _SAMPLING:
            value = getattr(self, name, None)
            if value is None:
                value = (self.model_extra or {}).get(name)
            if value is not None:
                body[name] = value
        tools = self.chat_tools()
        if tools:
            body["tools"] = tools
        choice = self.chat_tool_choice()
        if choice is not None:
            body["tool_choice"] = choice
        fmt = self.response_format()
        if fmt is not None:
            if "structured_outputs" in body:
                raise OpenAIError(400, "give text.format or structured_outputs, not both",
                                  param="text")
            body["response_format"] = fmt
        if self.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        kwargs = (self.model_extra or {}).get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise OpenAIError(400, "chat_template_kwargs must be an object",
                              param="chat_template_kwargs")
        effort = (self.reasoning or {}).get("effort")
        if effort is not None or kwargs:  # vLLM hands both to the chat template
            body["chat_template_kwargs"] = {**(kwargs or {}), **(
                {"reasoning_effort": effort} if effort is not None else {})}
        if self.continues_final_message():
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        if self.truncation == "auto":  # keep the conversation's end, room left to answer
            keep = max_model_len - (self.max_output_tokens or 1)
            if keep < 1:
                raise OpenAIError(400, f"max_output_tokens {self.max_output_tokens} leaves no "
                                  f"room for input in {max_model_len} tokens",
                                  param="max_output_tokens")
            body["truncate_prompt_tokens"] = keep
        try:
            return ResponsesChat.model_validate(body), history + turn
        except ValueError as e:  # a malformed message or sampling field
            raise OpenAIError(400, str(e).splitlines()[0], param="input") from None


class ResponsesChat(ChatCompletionRequest):
    """The chat request behind a Responses request: its errors name the Responses fields, and
    tools with tool_choice 'auto' on a server without a tool-call parser answer plain text
    (vLLM's Responses API; its chat endpoint refuses them)."""

    auto_tools_as_text: ClassVar[bool] = True

    @property
    def prompt_param(self) -> str:
        """Prompt errors name `input`."""
        return "input"

    def field_names(self) -> dict[str, str]:
        """max_tokens is max_output_tokens here."""
        return {"logprobs": "top_logprobs", "max_tokens": "max_output_tokens"}


def _text(content: Any, where: str) -> str:
    """The text of a content value: a string, or a list of text parts joined (a 400 naming
    `where` for any other part: this server serves text models)."""
    try:
        return message_text(content, _TEXT_PARTS)
    except ValueError as e:
        raise OpenAIError(400, f"{where}: {e}", param="input") from None


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise OpenAIError(400, f"{where}.role must be 'user', 'system', 'developer' or "
                          f"'assistant', got {role!r}", param="input")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
    if not isinstance(name, str) or not name:
        raise OpenAIError(400, f"{where}.name must be a non-empty string", param="input")
    if not isinstance(call_id, str) or not call_id:
        raise OpenAIError(400, f"{where}.call_id must be a non-empty string", param="input")
    if not isinstance(args, str):
        raise OpenAIError(400, f"{where}.arguments must be a JSON string", param="input")
    try:
        json.loads(args)
    except ValueError:
        raise OpenAIError(400, f"{where}.arguments is not valid JSON: {args[:80]!r}",
                          param="input") from None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def message_item(text: str, logprobs: list[dict[str, Any]] | None, status: str = "completed",
                 item_id: str | None = None) -> dict[str, Any]:
    """An assistant message output item (its one output_text part; none when text is empty
    and not in progress)."""
    parts = [output_text(text, logprobs)] if text or status == "in_progress" else []
    return {"type": "message", "id": item_id or new_id("msg"), "status": status,
            "role": "assistant", "content": parts}


def output_text(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """An output_text content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def function_call_item(call: dict[str, Any], status: str = "completed",
                       item_id: str | None = None) -> dict[str, Any]:
    """A function_call output item of a chat tool call ({id, function: {name, arguments}})."""
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


def output_items(message: dict[str, Any], logprobs: list[dict[str, Any]] | None
                 ) -> list[dict[str, Any]]:
    """A finished chat message as output items: the text (a message, kept when there is no
    call even if empty), then each function call."""
    calls = message.get("tool_calls") or []
    items = [message_item(message.get("content") or "", logprobs)] \
        if message.get("content") or not calls else []
    return items + [function_call_item(c) for c in calls]


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None
                   ) -> dict[str, Any]:
    """A reasoning output item (the model's thought, as a reasoning parser split it off)."""
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def history_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the chat messages a later turn's prompt holds: one assistant message
    with the text and the calls."""
    text = "".join(p["text"] for it in items if it["type"] == "message"
                   for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's usage in the Responses shape (input/output tokens)."""
    if chat_usage is None:
        return None
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": chat_usage.get("reasoning_tokens", 0)},
            "total_tokens": chat_usage["total_tokens"]}


def response_object(req: ResponsesRequest, rid: str, model: str, created: int,
                    status: str, output: list[dict[str, Any]],
                    chat_usage: dict[str, Any] | None, temperature: float, top_p: float,
                    max_output_tokens: int | None) -> dict[str, Any]:
    """The response object (OpenAI's fields; the sampling values as applied)."""
    extra = req.model_extra or {}
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "background": req.background, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": req.instructions, "max_output_tokens": max_output_tokens,
        "max_tool_calls": extra.get("max_tool_calls"), "metadata": req.metadata or {},
        "model": model, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning, "service_tier": extra.get("service_tier", "auto"),
        "store": req.store, "temperature": temperature,
        "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice,
        "tools": req.tools or [], "top_logprobs": req.top_logprobs or 0, "top_p": top_p,
        "truncation": req.truncation or "disabled", "usage": usage(chat_usage),
        "user": extra.get("user"),
    }


def now() -> int:
    """created_at: seconds since the epoch."""
    return int(time.time())
