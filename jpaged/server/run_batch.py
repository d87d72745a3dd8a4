"""vLLM's `run-batch`: an OpenAI batch file (JSON lines of {"custom_id", "method", "url",
"body"}) answered by the server's own app in this process (no socket): each line is a POST to
its url, all of them in flight at once up to a bound, so the engine batches them; the output
has one line per input line, in input order, in the OpenAI batch output format.

A line that fails (not JSON, not a request, a url other than /v1/completions and
/v1/chat/completions, a stream, a bad body, a refused prompt) gets an output line saying why,
with the HTTP status the server would answer (vLLM's shape: `response.body` null, the error in
`error`); every other line is still answered. Lines that are no request at all are counted
(`jpaged run-batch` then exits 1, as vLLM's fails on them).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jpaged.server.protocol import error_body

URLS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class BatchAnswers:
    """The output lines, in input order, and the line numbers that were no request."""

    lines: list[dict[str, Any]]
    malformed: list[int]


def _output(custom_id: Any, status: int, body: dict[str, Any] | None) -> dict[str, Any]:
    """One output line (vLLM's BatchRequestOutput): a failure's body is null and its error
    ({"message", "type", "param", "code"}) is in `error`."""
    failed = status != 200
    return {"id": f"jpaged-{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"jpaged-batch-{uuid.uuid4().hex}",
                         "body": None if failed else body},
            "error": (body or {}).get("error", body) if failed else None}


class _Malformed(Exception):
    """A line that is no batch request (its output line in `answer`)."""

    def __init__(self, answer: dict[str, Any]) -> None:
        super().__init__(answer["error"]["message"])
        self.answer = answer


def _bad_line(lineno: int, custom_id: Any, msg: str, param: str | None = None,
              malformed: bool = True) -> dict[str, Any]:
    answer = _output(custom_id, 400, error_body(f"line {lineno}: {msg}", param=param))
    if malformed:
        raise _Malformed(answer)
    return answer


async def _answer(client: Any, lineno: int, line: str) -> dict[str, Any]:
    try:
        req = json.loads(line)
    except ValueError as e:
        return _bad_line(lineno, None, f"not JSON ({e})")
    if not isinstance(req, dict):
        return _bad_line(lineno, None, "must be a JSON object with custom_id, method, url, body")
    custom_id = req.get("custom_id")
    if not isinstance(custom_id, str):
        return _bad_line(lineno, custom_id, "custom_id must be a string", "custom_id")
    if req.get("method", "POST") != "POST":
        return _bad_line(lineno, custom_id, f"method must be POST, got {req.get('method')!r}",
                         "method")
    url = req.get("url")
    if url not in URLS:
        return _bad_line(lineno, custom_id, f"url {url!r} is not served here; supported: "
                         f"{', '.join(URLS)}", "url")
    body = req.get("body")
    if not isinstance(body, dict):
        return _bad_line(lineno, custom_id, "body must be a JSON object", "body")
    if body.get("stream"):
        return _bad_line(lineno, custom_id, "a batch request must not stream", "stream",
                         malformed=False)
    r = await client.post(url, json=body)
    try:
        answer = r.json()
    except ValueError:
        answer = error_body(r.text[:500] or f"HTTP {r.status_code}", "server_error",
                            code=r.status_code)
    return _output(custom_id, r.status_code, answer)


async def run_batch_lines(app: Any, lines: Sequence[str], max_in_flight: int = 256
                          ) -> BatchAnswers:
    """The output line of each non-blank input line (in order), from `app` (build_app's)
    answering at most `max_in_flight` of them at a time."""
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request
    gate = asyncio.Semaphore(max_in_flight)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch",
                                 timeout=None) as client:
        malformed: list[int] = []

        async def one(lineno: int, line: str) -> dict[str, Any]:
            async with gate:
                try:
                    return await _answer(client, lineno, line)
                except _Malformed as e:
                    malformed.append(lineno)
                    return e.answer

        answers = list(await asyncio.gather(*(one(i + 1, line) for i, line in enumerate(lines)
                                              if line.strip())))
        return BatchAnswers(answers, sorted(malformed))
