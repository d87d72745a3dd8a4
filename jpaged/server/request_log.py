"""vLLM's request log (`--enable-log-requests`, `--enable-log-outputs`, `--max-log-len`): a log
line per engine request as it is added (its prompt, ids and sampling parameters) and, when
asked, one as it finishes (its text, ids and finish reason)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("jpaged.server.requests")


class RequestLogger:
    """Writes the request log lines; `max_log_len` cuts prompts, outputs and id lists."""

    def __init__(self, max_log_len: int | None = None, log_outputs: bool = False) -> None:
        if max_log_len is not None and max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {max_log_len}")
        self.max_log_len = max_log_len
        self.log_outputs = log_outputs

    def _cut(self, value: Any) -> Any:
        if value is None or self.max_log_len is None:
            return value
        return value[:self.max_log_len]

    def inputs(self, request_id: str, prompt: str | None, token_ids: Sequence[int],
               params: Any) -> None:
        """The line of a request the engine took."""
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s.",
                    request_id, self._cut(prompt), params, self._cut(list(token_ids)))

    def outputs(self, request_id: str, index: int, text: str, token_ids: Sequence[int],
                finish_reason: str | None) -> None:
        """The line of a finished sequence (index: its choice; only with log_outputs)."""
        logger.info("Generated response %s (choice %d): output: %r, output_token_ids: %s, "
                    "finish_reason: %s", request_id, index, self._cut(text),
                    self._cut(list(token_ids)), finish_reason)
