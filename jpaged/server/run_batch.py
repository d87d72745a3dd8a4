"""vLLM's `run-batch`: an OpenAI batch file (JSON lines of {"custom_id", "method", "url",
"body"}) answered by the server's own app in this process (no socket): each line is a POST to
its url, all of them in flight at once up to a bound, so the engine batches them; the output
has one line per input line, in input order, in the OpenAI batch output format.

A line that fails (not JSON, not a request, a url other than URLS: OpenAI's batch urls
/v1/completions, /v1/chat/completions and /v1/responses, and a pooling model's /v1/embeddings,
/classify, /score and /rerank; a stream, a background response, a bad body, a refused prompt,
an API the model does not serve) gets an output line saying why,
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

URLS = ("/v1/completions", "/v1/chat/completions", "/v1/responses",
        # a pooling model's (--runner pooling), as vLLM's run-batch takes them
        "/v1/embeddings", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
        "/v2/rerank")


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


def _bad_line(lineno: int, custom_id: Any, msg: str, param: str | None = None
              ) -> dict[str, Any]:
    return _output(custom_id, 400, error_body(f"line {lineno}: {msg}", param=param))


async def _answer(client: Any, lineno: int, line: str) -> tuple[dict[str, Any], bool]:
    """A line's output line, and whether the line was no batch request at all."""
    try:
        req = json.loads(line)
    except ValueError as e:
        return _bad_line(lineno, None, f"not JSON ({e})"), True
    if not isinstance(req, dict):
        return _bad_line(lineno, None, "must be a JSON object with custom_id, method, url, "
                         "body"), True
    custom_id = req.get("custom_id")
    if not isinstance(custom_id, str):
        return _bad_line(lineno, custom_id, "custom_id must be a string", "custom_id"), True
    if req.get("method", "POST") != "POST":
        return _bad_line(lineno, custom_id, f"method must be POST, got {req.get('method')!r}",
                         "method"), True
    url = req.get("url")
    if url not in URLS:
        return _bad_line(lineno, custom_id, f"url {url!r} is not served here; supported: "
                         f"{', '.join(URLS)}", "url"), True
    body = req.get("body")
    if not isinstance(body, dict):
        return _bad_line(lineno, custom_id, "body must be a JSON object", "body"), True
    if body.get("stream"):  # a request, which this runner does not take
        return _bad_line(lineno, custom_id, "a batch request must not stream", "stream"), False
    if url == "/v1/responses" and body.get("background"):  # the run would end before it
        return _bad_line(lineno, custom_id, "a batch response cannot run in the background",
                         "background"), False
    r = await client.post(url, json=body)
    try:
        answer = r.json()
    except ValueError:
        answer = error_body(r.text[:500] or f"HTTP {r.status_code}", "server_error",
                            code=r.status_code)
    return _output(custom_id, r.status_code, answer), False


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
        async def one(lineno: int, line: str) -> tuple[dict[str, Any], bool]:
            async with gate:
                return await _answer(client, lineno, line)

        numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
        answers = await asyncio.gather(*(one(n, line) for n, line in numbered))
        return BatchAnswers([a for a, _ in answers],
                            [n for (n, _), (_, bad) in zip(numbered, answers, strict=True)
                             if bad])
