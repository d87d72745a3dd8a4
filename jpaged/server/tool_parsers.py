"""vLLM's tool-call parsers (`--tool-call-parser`), for `tool_choice: "auto"`: the model writes
its calls in its own syntax, and the parser turns the finished text (or a stream's text so
far) into plain content and OpenAI tool calls.

- `hermes` (Hermes 2 Pro, Qwen 2.5 / Qwen 3): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks; the text before the first one is content.
- `llama3_json` (Llama 3.1 / 3.2 JSON tool calling): `{"name": ..., "parameters": {...}}`
  objects (`;`-separated, `<|python_tag|>` before them allowed), found amid prose too; the
  text before the first one is content. Streamed as it is written, as hermes.
- `pythonic` (Llama 3.2 / 4 pythonic calls): the whole answer is a list of calls,
  `[get_weather(city="Paris"), now()]`, with literal arguments.
- `mistral` (Mistral models): `[TOOL_CALLS]` then a JSON list of {"name", "arguments"}, or
  `[TOOL_CALLS]name[ARGS]{...}` per call (v11 tokenizers); the text before is content.

An answer whose calls do not parse is plain content, never an error (vLLM's rule); every
call's arguments are valid JSON.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("jpaged.server")

# (name, arguments as a JSON string)
Call = tuple[str, str]


@dataclass
class Parsed:
    """What a parser found in text: how much of it is content, and the complete calls."""

    content_end: int  # text[:content_end] is plain content (may grow while streaming)
    calls: list[Call] = field(default_factory=list)


class ToolParser:
    """One model family's tool-call syntax. `parse(text, final)`: while streaming (final
    False) content_end holds back what may yet be a call, and calls are those complete so far
    (a prefix of the final ones); at the end, everything."""

    name = ""
    # vLLM's hermes parser keeps special tokens in the text: some models mark their tool-call
    # tags special, and skipping them would hide the calls.
    keeps_special_tokens = False

    def parse(self, text: str, final: bool) -> Parsed:
        """The content and calls of `text` (see the class docstring)."""
        raise NotImplementedError

    def in_progress(self, text: str) -> tuple[str, str, str, int] | None:
        """While streaming: the call being written after the complete ones, as (its name, a
        prefix of its final arguments string that no later text can change, its arguments
        closed as they stand: what a stream that ends here completes them with, where in
        `text` the call starts: content ends there), or None when there is none or this
        parser sends calls whole."""
        return None


def _arguments(value: Any) -> str:
    """A call's arguments as OpenAI's JSON string, always valid JSON: an object (or any JSON
    value) serialized; a string that is JSON already kept as is (not encoded twice), any
    other string serialized as a JSON string (vLLM's rule)."""
    if isinstance(value, str):
        try:
            json.loads(value)
            return value
        except ValueError:
            return json.dumps(value, ensure_ascii=False)
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def _json_call(obj: Any, args_keys: tuple[str, ...], need_args: bool = False) -> Call:
    """(name, arguments) of a {"name": ..., <one of args_keys>: ...} object (`need_args`: one
    of those keys must be there); ValueError else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError(f"not a tool call: {obj!r}")
    if need_args and not any(k in obj for k in args_keys):
        raise ValueError(f"a tool call without {' or '.join(args_keys)}: {obj!r}")
    args = next((obj[k] for k in args_keys if k in obj), {})
    return obj["name"], _arguments(args)


# A whole JSON string, a bracket, a colon or a comma; a lone quote starts a string that the
# text cut short.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]++|\\.)*+"|[{}\[\]:,]|"')
# The end of a cut string that cannot be kept: a lone backslash, a \u escape cut short, or
# a high surrogate whose pair has not come yet.
_CUT_ESCAPE = re.compile(r'(?:\\u[dD][89abAB][0-9a-fA-F]{2}|\\u[0-9a-fA-F]{0,3})$')


def _closed_json(text: str) -> tuple[str, bool] | None:
    """`text`, a JSON value that may be cut anywhere, made whole JSON: (the JSON text, whether
    `text` held the whole value), or None when nothing of it can be kept yet. A cut string
    value is kept as far as it goes; a cut key, number or literal (its value may yet change)
    and a dangling comma or colon are dropped; open brackets are closed. Regular expressions
    find the tokens (strings at C speed), so a long string costs little to re-read.
    ValueError: not JSON."""
    stack: list[str] = []
    safe: tuple[int, str] | None = None  # (where the text can be cut, the closers then)
    state = "value"  # what may come: value, key, colon, after (a value), or value/key or close
    at = 0
    for m in _JSON_TOKEN.finditer(text):
        tok, start = m.group(), m.start()
        gap = text[at:start].strip()
        if gap:  # a number or literal, whole since a token follows it
            if state not in ("value", "value_or_close"):
                raise ValueError(f"unexpected {gap[:20]!r}")
            json.loads(gap)
            state = "after"
            safe = (at + len(text[at:start].rstrip()), "".join(reversed(stack)))
        at = m.end()
        if tok in "{[" and len(tok) == 1:
            if state not in ("value", "value_or_close"):
                raise ValueError(f"unexpected {tok}")
            stack.append("}" if tok == "{" else "]")
            state = "key_or_close" if tok == "{" else "value_or_close"
            safe = (at, "".join(reversed(stack)))
        elif tok in "}]" and len(tok) == 1:
            if not stack or stack[-1] != tok or state not in (
                    "after", "key_or_close" if tok == "}" else "value_or_close"):
                raise ValueError(f"unexpected {tok}")
            stack.pop()
            state = "after"
            if not stack:
                return text[:at], True
            safe = (at, "".join(reversed(stack)))
        elif tok == ":":
            if state != "colon":
                raise ValueError("unexpected ':'")
            state = "value"
        elif tok == ",":
            if state != "after":
                raise ValueError("unexpected ','")
            state = "key" if stack[-1] == "}" else "value"
        elif len(tok) > 1:  # a whole string
            if state in ("key", "key_or_close"):
                state = "colon"
            elif state in ("value", "value_or_close"):
                state = "after"
                safe = (at, "".join(reversed(stack)))
            else:
                raise ValueError("unexpected string")
        else:  # a string the text cut: kept as a value, dropped as a key
            if state in ("value", "value_or_close"):
                body, before = text[start:], None
                while body != before:  # e.g. a high surrogate, then a cut \u, then a "\"
                    before = body
                    if (len(body) - len(body.rstrip("\\"))) % 2:
                        body = body[:-1]
                    body = _CUT_ESCAPE.sub("", body)
                return text[:start] + body + '"' + "".join(reversed(stack)), False
            break
    if safe is None:
        return None
    return text[:safe[0]] + safe[1], False


def _first_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose repeated key keeps its first value (a streamed call sends the
    first before the second is written, so the whole answer reads it the same way)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        out.setdefault(k, v)
    return out


def _stable_arguments(value: dict[str, Any], whole: bool) -> tuple[str, str]:
    """(the part of a call's arguments string (json.dumps, as `_arguments` writes it) that
    more text cannot change: all of it when whole, else without its closing quotes and
    brackets; the whole string as it stands)."""
    dumped = json.dumps(value, ensure_ascii=False)
    return (dumped if whole else dumped.rstrip('"]}')), dumped


def _call_in_progress(body: str, args_keys: tuple[str, ...]
                      ) -> tuple[str, str, str] | None:
    """`in_progress` of a JSON call object {"name", <an args key>: {...}} that `body` starts,
    cut anywhere: once its name is whole (the arguments come after it, so they started),
    (name, the arguments' stable prefix, the arguments closed as they stand)."""
    try:
        closed = _closed_json(body)
        if closed is None:
            return None
        obj, whole = json.loads(closed[0], object_pairs_hook=_first_wins), closed[1]
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    # The arguments come after the name, so the name is whole once they start; a key after
    # them ends them.
    keys = list(obj)
    key = next((k for k in args_keys if k in obj), None)
    if key is None or keys.index(key) < keys.index("name") or \
            not isinstance(obj[key], dict) or not obj["name"]:
        return None
    return (obj["name"], *_stable_arguments(obj[key], whole or keys[-1] != key))


def held_prefix(text: str, tag: str) -> int:
    """Chars at the end of `text` that may be the start of `tag` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesParser(ToolParser):
    """`<tool_call>{...}</tool_call>` blocks (the last one may be left unclosed at the end)."""

    name = "hermes"
    keeps_special_tokens = True
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(self.START)
        if start < 0:
            return Parsed(len(text) if final else len(text) - held_prefix(text, self.START))
        calls: list[Call] = []
        rest = text[start:]
        closed = rest.rfind(self.END)  # blocks end there: the open one is not searched
        try:
            for m in self._BLOCK.finditer(rest, 0, closed + len(self.END) if closed >= 0 else 0):
                calls.append(_json_call(json.loads(m.group(1), object_pairs_hook=_first_wins),
                                        ("arguments", "parameters")))
            if final:
                tail = rest[rest.rfind(self.END) + len(self.END):] if self.END in rest else rest
                t = tail.find(self.START)
                if t >= 0 and tail[t + len(self.START):].strip():  # an unclosed last call
                    calls.append(_json_call(json.loads(tail[t + len(self.START):],
                                                       object_pairs_hook=_first_wins),
                                            ("arguments", "parameters")))
        except ValueError:
            # A block that is not a call: while streaming wait for the end; at the end the
            # whole answer is content (vLLM's fallback).
            return Parsed(len(text) if final else start)
        if final and not calls:
            return Parsed(len(text))
        return Parsed(start, calls)

    def in_progress(self, text: str) -> tuple[str, str, str, int] | None:
        """The unclosed last block's call, once its name is whole (its arguments follow it)."""
        start = text.rfind(self.START)
        if start < 0 or self.END in text[start:]:
            return None
        found = _call_in_progress(text[start + len(self.START):], ("arguments", "parameters"))
        return None if found is None else (*found, text.find(self.START))


class Llama3JsonParser(ToolParser):
    """`{"name": ..., "parameters": {...}}` objects (or "arguments"), `;` or newline
    separated, `<|python_tag|>` before them allowed, prose around them too (vLLM finds calls
    anywhere in the answer): content is the text before the first call; an object without
    a name and parameters (or arguments) is not a call."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        # The last text read and what it held: a stream's delta asks parse and in_progress
        # of the same text (one event loop uses a parser: no two readers at once).
        self._last: tuple[str, tuple[int, list[Call], int]] | None = None

    def _calls(self, text: str) -> tuple[int, list[Call], int]:
        """(where the first call starts, else len(text); the complete calls, in order; where
        the last one ends, else 0)."""
        if self._last is not None and self._last[0] is text:
            return self._last[1]
        found = self._scan(text)
        self._last = (text, found)
        return found

    @staticmethod
    def _scan(text: str) -> tuple[int, list[Call], int]:
        decoder = json.JSONDecoder(object_pairs_hook=_first_wins)
        calls: list[Call] = []
        first, at, last_end = len(text), text.find("{"), 0
        while at >= 0:
            try:
                obj, end = decoder.raw_decode(text, at)
                calls.append(_json_call(obj, ("parameters", "arguments"), need_args=True))
            except ValueError:
                at = text.find("{", at + 1)  # not a (whole) call here: look further on
                continue
            first, last_end = min(first, at), end
            at = text.find("{", end)
        return first, calls, last_end

    def parse(self, text: str, final: bool) -> Parsed:
        first, calls, _ = self._calls(text)
        if not calls:
            if final:
                return Parsed(len(text))
            # Streaming: what may yet be a call (from its "{", or the tag) is held back.
            brace = text.find("{")
            tag = text.find(self.TAG)
            hold = min(i for i in (brace, tag, len(text) - held_prefix(text, self.TAG))
                       if i >= 0)
            return Parsed(hold)
        tag = text.rfind(self.TAG, 0, first)
        if tag >= 0 and not text[tag + len(self.TAG):first].strip():
            first = tag  # the tag before the first call is not content
        return Parsed(first, calls)

    def in_progress(self, text: str) -> tuple[str, str, str, int] | None:
        """The call object being written after the complete ones (the first "{" after them
        that opens a {"name", "parameters"} object cut short)."""
        first, _, last_end = self._calls(text)
        at = text.find("{", last_end)
        while at >= 0:
            found = _call_in_progress(text[at:], ("parameters", "arguments"))
            if found is not None:
                start = min(first, at)
                tag = text.rfind(self.TAG, 0, start)
                if tag >= 0 and not text[tag + len(self.TAG):start].strip():
                    start = tag  # the tag before the first call is not content
                return (*found, start)
            at = text.find("{", at + 1)
        return None


class PythonicParser(ToolParser):
    """An answer that is a Python list of calls with literal keyword arguments. A call whose
    arguments cannot be JSON (bytes, infinities, other than literals) is dropped and the
    others kept; a list none of whose calls parse is content (vLLM's rules)."""

    name = "pythonic"
    MAX_CHARS = 65536  # the call-by-call recovery parses prefixes: bounded

    @staticmethod
    def _call(node: ast.AST) -> Call:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("not a call with keyword arguments")
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords
                if kw.arg is not None}
        return node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False)

    def _calls(self, body: str) -> list[Call]:
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return self._recovered(body)
        if not isinstance(tree, ast.List):
            return []
        calls = []
        for node in tree.elts:
            try:
                calls.append(self._call(node))
            except (ValueError, TypeError, SyntaxError):
                continue  # this call cannot be JSON: its siblings stand
        return calls

    def _recovered(self, body: str) -> list[Call]:
        """The calls before the first one that does not parse (each tried on its own)."""
        if len(body) > self.MAX_CHARS:
            return []
        calls: list[Call] = []
        at = 1
        while True:
            while at < len(body) and body[at] in " \t\r\n,":
                at += 1
            end = body.find(")", at)
            while end >= 0:
                try:
                    node = ast.parse(body[at:end + 1], mode="eval").body
                except SyntaxError:
                    end = body.find(")", end + 1)
                    continue
                try:
                    calls.append(self._call(node))
                except (ValueError, TypeError, SyntaxError):
                    pass
                break
            if end < 0:
                return calls
            at = end + 1

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.strip()
        if not body:
            return Parsed(len(text) if final else 0)
        if not body.startswith("["):
            return Parsed(len(text))
        if not final:
            return Parsed(0)
        calls = self._calls(body)
        return Parsed(0, calls) if calls else Parsed(len(text))


class MistralParser(ToolParser):
    """Mistral's `[TOOL_CALLS]` then a JSON list of {"name", "arguments"} calls, or (its
    v11 tokenizers) `[TOOL_CALLS]name[ARGS]{...}` per call; the text before is content."""

    name = "mistral"
    keeps_special_tokens = True  # [TOOL_CALLS] is a special token
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(self.TAG)
        if start < 0:
            return Parsed(len(text) if final else len(text) - held_prefix(text, self.TAG))
        if not final:
            return Parsed(start)  # calls: parsed once the answer is whole
        calls: list[Call] = []
        try:
            segments = text[start:].split(self.TAG)[1:]
            if any(self.ARGS in seg for seg in segments):
                for seg in segments:
                    name, sep, args = seg.partition(self.ARGS)
                    if not sep or not name.strip():
                        raise ValueError("a call without a name or [ARGS]")
                    obj, _ = json.JSONDecoder().raw_decode(args.strip())
                    calls.append((name.strip(), _arguments(obj)))
            else:
                obj, _ = json.JSONDecoder().raw_decode(text[start + len(self.TAG):].strip())
                for c in obj if isinstance(obj, list) else [obj]:
                    calls.append(_json_call(c, ("arguments", "parameters")))
        except ValueError:
            return Parsed(len(text))
        return Parsed(start, calls) if calls else Parsed(len(text))


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, PythonicParser, MistralParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser named `name`; a ValueError lists the ones there are."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not one of jpaged's tool-call parsers "
                         f"({', '.join(sorted(TOOL_PARSERS))})")
    return TOOL_PARSERS[name]()


def auto_tool_parser(enable_auto_tool_choice: bool, name: str | None) -> ToolParser | None:
    """The parser serving tool_choice 'auto' (vLLM's pair of flags), or None; a bad pair is
    a ValueError naming the flags."""
    if not enable_auto_tool_choice:
        if name is not None:
            get_tool_parser(name)  # a bad name is refused either way
            logger.warning("--tool-call-parser %s does nothing without "
                           "--enable-auto-tool-choice", name)
        return None
    if name is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(sorted(TOOL_PARSERS))})")
    return get_tool_parser(name)
