"""The interactive loop behind `jpaged chat`: chat template, streamed replies, /reset, /exit."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import Any

from jpaged.engine import LLMEngine
from jpaged.sampling_params import RequestOutputKind, SamplingParams

PROMPT = ">>> "
HELP = "Type a message. /reset clears the conversation, /exit (or Ctrl-D) quits."


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _note(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class ChatSession:
    """A conversation over an LLMEngine; each reply streams through `write` as it is made."""

    def __init__(self, engine: LLMEngine, params: SamplingParams, system: str | None = None,
                 write: Callable[[str], None] = _write) -> None:
        if not engine.tokenizer.has_chat_template:
            raise ValueError("this model has no chat template; use `jpaged generate --raw`")
        self.engine = engine
        self.params = params.clone(n=1, output_kind=RequestOutputKind.DELTA)
        self.system = system
        self.write = write
        self.history: list[dict[str, str]] = []
        self._ids = itertools.count()
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, message: str) -> str:
        """Send one user message; stream and return the reply (ValueError: nothing changed)."""
        tok = self.engine.tokenizer
        conv = [*self.history, {"role": "user", "content": message}]
        text = tok.apply_chat_template(conv, add_generation_prompt=True)
        rid = f"chat-{next(self._ids)}"
        prompt: dict[str, Any] = {"prompt": text,
                                  "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
        self.engine.add_request(rid, prompt, self.params)
        parts: list[str] = []
        try:
            finished = False
            while not finished and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    delta = out.outputs[0].text
                    if delta:
                        parts.append(delta)
                        self.write(delta)
                    finished = out.finished
        except BaseException:  # Ctrl-C mid-reply: free the request, keep the partial text out
            self.engine.abort_request(rid)
            raise
        self.write("\n")
        reply = "".join(parts)
        self.history = [*conv, {"role": "assistant", "content": reply}]
        return reply


def run_chat(session: ChatSession, read: Callable[[str], str] = input) -> None:
    """Read lines until /exit or end of input; every other line is a user message."""
    _note(HELP)
    while True:
        try:
            line = read(PROMPT)
        except (EOFError, KeyboardInterrupt):
            session.write("\n")
            return
        cmd = line.strip()
        if not cmd:
            continue
        if cmd == "/exit":
            return
        if cmd == "/reset":
            session.reset()
            _note("(conversation cleared)")
            continue
        try:
            session.ask(line)
        except ValueError as e:  # e.g. the conversation no longer fits max_model_len
            _note(f"error: {e} (use /reset to start over)")
        except KeyboardInterrupt:
            session.write("\n")
            _note("(reply interrupted)")
