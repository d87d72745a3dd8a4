"""vLLM's reasoning parsers (`--reasoning-parser`): a reasoning model thinks between
`<think>` and `</think>` before it answers, and the parser splits its text into the reasoning
(the chat message's `reasoning`, and `reasoning_content`, its former name) and the content.

- `deepseek_r1` (DeepSeek R1 and its distills, QwQ): the template opens `<think>` in the
  prompt, so the answer usually has only `</think>`; a `<think>` the model writes is dropped
  (the text around it kept, so a stream and the whole answer agree).
  No `</think>` at all: everything is reasoning (the answer was cut while thinking).
- `qwen3` (Qwen3): as deepseek_r1, except that with `chat_template_kwargs: {"enable_thinking":
  false}` (the template then closes the thinking in the prompt) the answer is all content.

The split is by text, so tags that are special tokens must be kept in the text (a server with
a reasoning parser decodes with skip_special_tokens false, as for hermes tool calls).
"""

from __future__ import annotations

from dataclasses import dataclass

from jpaged.server.tool_parsers import held_prefix


@dataclass(frozen=True)
class ReasoningParser:
    """One model family's thinking tags and what a missing end tag means."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    # Whether chat_template_kwargs' enable_thinking false makes an answer without the end tag
    # content (qwen3) rather than reasoning cut short (deepseek_r1).
    honours_enable_thinking: bool = False

    def thinking(self, chat_template_kwargs: dict | None) -> bool:
        """Whether this request's answer starts in thought."""
        if not self.honours_enable_thinking:
            return True
        return (chat_template_kwargs or {}).get("enable_thinking", True) is not False

    def split(self, text: str, thinking: bool = True, final: bool = True
              ) -> tuple[str | None, str | None]:
        """(reasoning, content) of `text`, each None when empty. While streaming (final
        False) what may be the start of a tag is left out of both (it may complete). Not
        thinking (qwen3's enable_thinking false): all content, as vLLM streams it."""
        if not thinking:
            return None, text or None
        # The start tag (before the end tag) is dropped, the text around it kept: what came
        # before it was streamed as thought already (as vLLM streams "\n<think>...").
        end = text.find(self.end)
        at = text.find(self.start, 0, len(text) if end < 0 else end)
        opened = at >= 0
        body = text[:at] + text[at + len(self.start):] if opened else text
        reasoning, tag, content = body.partition(self.end)
        if not tag:
            if not final:  # a tag cut at the end may complete: held back
                held = held_prefix(reasoning, self.end)
                if not opened:
                    held = max(held, held_prefix(reasoning, self.start))
                reasoning = reasoning[:len(reasoning) - held]
            return reasoning or None, None
        return reasoning or None, content or None


class ReasoningStream:
    """A streamed choice's text split into reasoning and content deltas as it comes."""

    def __init__(self, parser: ReasoningParser, thinking: bool) -> None:
        self.parser, self.thinking = parser, thinking
        self.text = ""
        self.sent_reasoning = self.sent_content = 0

    def delta(self, text: str, final: bool) -> tuple[str, str]:
        """(new reasoning, new content) once `text` is added."""
        self.text += text
        reasoning, content = self.parser.split(self.text, self.thinking, final)
        r, c = reasoning or "", content or ""
        out = r[self.sent_reasoning:], c[self.sent_content:]
        self.sent_reasoning, self.sent_content = max(self.sent_reasoning, len(r)), \
            max(self.sent_content, len(c))
        return out


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1"),
    "qwen3": ReasoningParser("qwen3", honours_enable_thinking=True),
}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser named `name` (None: none); a ValueError lists the ones there are."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not one of jpaged's reasoning parsers "
                         f"({', '.join(sorted(REASONING_PARSERS))})")
    return REASONING_PARSERS[name]
