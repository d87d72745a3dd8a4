"""Tool calls as OpenAI messages and deltas: forced ones (tool_choice a function or
'required'), and the model's own with tool_choice 'auto' (found by a tool-call parser)."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from jpaged.server.tool_parsers import ToolParser

logger = logging.getLogger("jpaged.server")


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


def _kept(calls: list[tuple[str, str]], parallel: bool) -> list[tuple[str, str]]:
    """The calls an answer keeps: all, or with parallel_tool_calls false the first."""
    return calls if parallel else calls[:1]


def tool_call_message(text: str, finish_reason: str | None, tools: str,
                      parser: ToolParser | None = None, parallel: bool = True
                      ) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice and its finish_reason, as vLLM answers them.
    No tool: plain content. 'auto': the calls `parser` finds (content the text before them,
    null when none; finish "tool_calls"), or the whole text as content when it has none.
    A forced one always answers `tool_calls` with content ""
    (never the generated JSON as content): a named function's one call, its arguments as
    generated even when max_tokens cut them (finish as the output's: "stop", as OpenAI answers
    a forced call, or "length"); 'required': the calls of the generated array, none when it was
    cut, finish "tool_calls" where the output stopped by itself ("stop"), else the output's.
    `parallel` False (the request's parallel_tool_calls): at most one call."""
    if tools == "none":
        return {"role": "assistant", "content": text}, finish_reason
    if tools == "auto":
        assert parser is not None
        found = parser.parse(text, final=True)
        if not found.calls:
            return {"role": "assistant", "content": text}, finish_reason
        content = text[:found.content_end]
        return ({"role": "assistant", "content": content or None,
                 "tool_calls": [_tool_call(name, args)
                                for name, args in _kept(found.calls, parallel)]}, "tool_calls")
    if tools != "required":
        return ({"role": "assistant", "content": "",
                 "tool_calls": [_tool_call(tools, text)]}, finish_reason)
    return ({"role": "assistant", "content": "", "tool_calls": required_tool_calls(text)},
            "tool_calls" if finish_reason == "stop" else finish_reason)


class ToolCallStream:
    """Streamed deltas of tool calls. Forced ones: a named function's arguments as they come
    (its id and name in the first delta), cut ones too; 'required' calls whole, in the
    finishing chunk (none, and no content, when the array was cut); no content delta ever, as
    vLLM. 'auto': content as it comes, short of what may start a call; each call as it is
    written where the parser follows a call in progress (hermes: its id and name once the
    name is whole, then its arguments as far as later text cannot change them), else whole
    once the parser has it; finish "tool_calls" when any was made."""

    def __init__(self, tools: str, parser: ToolParser | None = None,
                 parallel: bool = True) -> None:
        self.tools = tools
        self.parser = parser
        self.parallel = parallel
        self.text: dict[int, str] = {}
        self.started: set[int] = set()
        # 'auto', per choice: content chars and calls sent so far (whole, or opened: a call
        # streamed as it is written counts from its first delta).
        self.sent_content: dict[int, int] = {}
        self.sent_calls: dict[int, int] = {}
        # 'auto', per choice: the call being streamed: (its index, the arguments sent, those
        # arguments closed as they stood: what ends them if the answer stops there).
        self.open_call: dict[int, tuple[int, str, str]] = {}

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A finished choice's whole message and finish_reason (`tool_call_message`)."""
        return tool_call_message(text, finish, self.tools, self.parser, self.parallel)

    def delta(self, index: int, text: str, finish: str | None
              ) -> tuple[dict[str, Any] | None, str | None]:
        """(delta or None to hold it back, finish_reason) of a choice's next piece."""
        if self.tools == "none":
            return ({"content": text} if text else {}), finish
        if self.tools == "auto":
            return self._auto(index, text, finish)
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

    def _auto(self, index: int, text: str, finish: str | None
              ) -> tuple[dict[str, Any] | None, str | None]:
        assert self.parser is not None
        full = self.text[index] = self.text.get(index, "") + text
        found = self.parser.parse(full, final=finish is not None)
        sent, made = self.sent_content.get(index, 0), self.sent_calls.get(index, 0)
        calls = _kept(found.calls, self.parallel)
        was_open = index in self.open_call
        # The call being written, read once a delta: where it may stream (the one open, or a
        # new one where more calls are allowed).
        progress = (self.parser.in_progress(full)
                    if was_open or self.parallel or not (made or calls) else None)
        # Once a call is out (or being streamed), no more content (a later block that does
        # not parse stays out); a call that starts streaming now ends the content where it
        # starts.
        end = sent if made or was_open else found.content_end
        if not made and not was_open and finish is None and not calls and progress is not None:
            end = max(end, progress[3])
        delta: dict[str, Any] = {}
        if end > sent:
            delta["content"] = full[sent:end]
            self.sent_content[index] = end
        out: list[dict[str, Any]] = []
        opened = self.open_call.pop(index, None)
        for i, (name, args) in enumerate(calls[made:], made):
            if opened is not None and opened[0] == i:  # the rest of the call streamed so far
                streamed = opened[1]
                if not args.startswith(streamed):  # cannot happen: what was sent was stable
                    logger.warning("tool call %d's arguments changed after they were "
                                   "streamed: %r then %r", i, streamed, args)
                if args[len(streamed):]:
                    out.append({"index": i, "function": {"arguments": args[len(streamed):]}})
                opened = None
            else:
                out.append({"index": i, **_tool_call(name, args)})
        made = max(made, len(calls))
        if opened is not None:
            self.open_call[index] = opened
        if opened is not None or self.parallel or made == 0:  # (at the finish too: a call
            # cut there is streamed and closed however the text was cut into deltas)
            out += self._stream_open(index, made if opened is None else opened[0], progress,
                                     finish is not None)
        if finish is not None:
            opened = self.open_call.pop(index, None)
            if opened is not None:  # never whole (cut, or its block does not parse): what
                # was streamed is closed, so its arguments are valid JSON as every call's are
                streamed, closed = opened[1], opened[2]
                if closed.startswith(streamed) and closed[len(streamed):]:
                    out.append({"index": opened[0],
                                "function": {"arguments": closed[len(streamed):]}})
        if out:
            delta["tool_calls"] = out
        self.sent_calls[index] = made
        if finish is not None:
            self.text.pop(index, None)
            return delta, "tool_calls" if made or opened is not None else finish
        return (delta or None), None

    def _stream_open(self, index: int, slot: int,
                     found: tuple[str, str, str, int] | None, final: bool = False
                     ) -> list[dict[str, Any]]:
        """Deltas of the call being written at `slot` (`found`: the parser's in_progress of
        the text so far): its id and name once the name is whole, then its arguments as far
        as no later text can change them. At the finish (`final`) a call not opened yet is
        opened only if cut (a whole one the final parse has)."""
        if found is None:
            return []
        name, prefix, closed, _ = found
        opened = self.open_call.get(index)
        if final and opened is None and prefix == closed:
            return []
        if opened is None:  # its header, with the arguments as far as they go
            self.open_call[index] = (slot, prefix, closed)
            return [{"index": slot, **_tool_call(name, prefix)}]
        sent = opened[1]
        if len(prefix) <= len(sent) or not prefix.startswith(sent):
            return []
        self.open_call[index] = (slot, prefix, closed)
        return [{"index": slot, "function": {"arguments": prefix[len(sent):]}}]
