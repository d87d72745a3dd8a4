"""Forced tool calls (tool_choice a function or 'required') as OpenAI messages and deltas."""

from __future__ import annotations

import json
import uuid
from typing import Any


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


class ToolCallStream:
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
