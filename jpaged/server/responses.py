"""The /v1/responses endpoints (OpenAI's Responses API, as vLLM serves it): create (whole, as
server-sent events, or in the background), retrieve, cancel, delete, list input items; the
store that `previous_response_id` reads."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HTTPRequest

from jpaged.server.chat import ChatRun, ChatServing
from jpaged.server.logprobs import chat_logprobs
from jpaged.server.protocol import OpenAIError
from jpaged.server.responses_protocol import (
    ResponsesRequest,
    function_call_item,
    history_messages,
    message_item,
    new_id,
    now,
    output_items,
    output_text,
    reasoning_item,
    response_object,
)
from jpaged.server.serving import EventStream, stream_error, until_disconnected

# The status of a response whose output ended for this finish_reason.
_STATUS = {"length": "incomplete", "abort": "cancelled"}


@dataclass
class StoredResponse:
    """A response kept by id: the object, the conversation a later turn continues (without
    the instructions, which do not carry over), its input items, its background task."""

    body: dict[str, Any]
    history: list[dict[str, Any]]
    input_items: list[dict[str, Any]]
    task: asyncio.Task | None = field(default=None, repr=False)
    # A background stream's events so far (SSE text; event i has sequence number i), for
    # every reader (the creating request and GET ?stream=true); None when not streamed.
    events: list[str] | None = field(default=None, repr=False)
    streaming: bool = False  # its events are still coming
    changed: asyncio.Condition | None = field(default=None, repr=False)

    async def replay(self, after: int | None) -> AsyncIterator[str]:
        """The stream's events after sequence number `after` (all: None), then each new one
        as it comes, until the stream ends."""
        events, changed = self.events, self.changed
        assert events is not None and changed is not None
        i = 0
        while True:
            async with changed:
                while i >= len(events) and self.streaming:
                    await changed.wait()
            while i < len(events):
                if after is None or i > after:
                    yield events[i]
                i += 1
            if not self.streaming and i >= len(events):
                return


class ResponseStore:
    """The last `capacity` stored responses by id, the oldest finished one dropped first (0:
    none kept); background responses still running are never dropped."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, item: StoredResponse) -> None:
        """Keep `item` under `rid` (the newest), dropping the oldest finished ones beyond
        capacity (a background response still running stays: it can be read and cancelled
        until it ends, and counts against the capacity then)."""
        if not self.capacity and item.task is None:
            return
        self._items[rid] = item
        self._items.move_to_end(rid)
        excess = len(self._items) - self.capacity
        for old in [k for k, v in self._items.items() if v.task is None or v.task.done()]:
            if excess <= 0:
                break
            del self._items[old]
            excess -= 1

    def get(self, rid: str) -> StoredResponse:
        """The stored response `rid`, or a 404 naming it."""
        item = self._items.get(rid)
        if item is None:
            hint = "" if self.capacity else " (this server keeps no responses: " \
                "--max-stored-responses 0)"
            raise OpenAIError(404, f"Response with id '{rid}' not found.{hint}",
                              "invalid_request_error", param="response_id")
        return item

    def pop(self, rid: str) -> StoredResponse:
        """Remove and return `rid` (a 404 naming it when absent)."""
        item = self.get(rid)
        del self._items[rid]
        return item

    def __contains__(self, rid: str) -> bool:
        return rid in self._items

    def tasks(self) -> list[asyncio.Task]:
        """The background tasks still running."""
        return [s.task for s in self._items.values() if s.task is not None and not s.task.done()]


def _input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items with ids (GET .../input_items lists them)."""
    if isinstance(req.input, str):
        items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": req.input}]}]
    else:
        items = [dict(it) for it in req.input]
    for it in items:
        it.setdefault("type", "message")
        prefix = {"function_call": "fc", "function_call_output": "fco"}.get(it["type"], "msg")
        it.setdefault("id", new_id(prefix))
    return items


class ResponsesServing(ChatServing):
    """The handlers of /v1/responses over the chat machinery (a Responses request runs as the
    chat request it amounts to)."""

    store: ResponseStore  # the responses kept (build_app sets it)

    async def responses(self, req: ResponsesRequest, http: HTTPRequest
                        ) -> dict[str, Any] | EventStream | None:
        """A response object, its SSE stream, or None if the client went away."""
        return await until_disconnected(http, self._responses(req))

    async def _responses(self, req: ResponsesRequest) -> dict[str, Any] | EventStream:
        self.check_model(req.model)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev.body["status"] in ("queued", "in_progress"):
                raise OpenAIError(400, f"previous response {req.previous_response_id!r} has "
                                  "not finished", param="previous_response_id")
            history = prev.history
        chat, conversation = req.chat_request(history, self.engine.max_model_len)
        if req.background and not self.store.capacity:
            raise OpenAIError(400, "background needs a response store: this server keeps none "
                              "(--max-stored-responses 0)", param="background")
        rid = req.request_id or new_id("resp")
        if req.store and rid in self.store:
            raise OpenAIError(400, f"request_id {rid!r} is already a stored response",
                              param="request_id")
        chat.request_id = rid
        started = await self._start_chat(chat, "resp")
        assert isinstance(started, ChatRun)  # a Responses request never runs beam search
        params = started.batch.params
        prompt_len = started.batch.prompt_tokens[0]
        max_out = params.max_tokens if params.max_tokens is not None \
            else self.engine.max_model_len - prompt_len

        created = now()

        def body(status: str, output: list[dict[str, Any]],
                 chat_usage: dict[str, Any] | None) -> dict[str, Any]:
            return response_object(req, rid, self.answer_model(req.model), created, status,
                                   output, chat_usage, params.temperature, params.top_p,
                                   max_out)

        # What a later turn continues: this turn's conversation without its instructions.
        kept = StoredResponse(body("queued", [], None), conversation, _input_items(req))
        if req.background and req.stream:  # runs on its own; readers replay its events
            kept.events, kept.streaming, kept.changed = [], True, asyncio.Condition()
            kept.task = asyncio.ensure_future(
                self._background_stream(req, started, body, kept))
            self.store.put(rid, kept)
            return EventStream(kept.replay(None), lambda: None)
        if req.background:
            kept.task = asyncio.ensure_future(self._background(req, started, body, kept))
            self.store.put(rid, kept)
            return kept.body
        if req.stream:
            return EventStream(self._events(req, started, body, kept), started.batch.close)
        final = await self._whole(req, started, body)
        self._keep(req, rid, kept, final)
        return final

    def _keep(self, req: ResponsesRequest, rid: str, kept: StoredResponse,
              final: dict[str, Any]) -> None:
        """Store a finished response (store true): its object and the conversation after it."""
        if not req.store:
            return
        kept.body = final
        kept.history = kept.history + history_messages(final["output"])
        self.store.put(rid, kept)

    async def _whole(self, req: ResponsesRequest, run: ChatRun, body: Any) -> dict[str, Any]:
        """The finished response object."""
        batch = run.batch
        text, finish, lps = "", None, None
        try:
            async for _, out in batch.outputs():
                c = out.outputs[0]
                text, finish = c.text, c.finish_reason
                if req.logprobs:
                    lps = self._logprobs(c, batch.params.logprobs or 0)
        finally:
            batch.close()
        reasoning, text = run.split(text)
        message, finish = run.calls.message(text, finish)
        status = _STATUS.get(finish or "", "completed")
        items = output_items(message, lps)
        if reasoning:  # the thought first; no empty message when it was all thought
            items = [reasoning_item(reasoning)] + [
                it for it in items if it["type"] != "message" or it["content"]]
        return body(status, items, self._usage(batch.usage(), reasoning))

    def _usage(self, chat_usage: dict[str, Any], reasoning: str | None) -> dict[str, Any]:
        """Chat's usage with the reasoning's tokens (its text tokenized) beside."""
        n = len(self.engine.tokenizer.encode(reasoning, add_special_tokens=False)) \
            if reasoning else 0
        return {**chat_usage, "reasoning_tokens": min(n, chat_usage["completion_tokens"])}

    def _logprobs(self, c: Any, top: int) -> list[dict[str, Any]]:
        """The output_text logprobs of an output's (new) tokens, `top` candidates each."""
        lps = chat_logprobs(c, self.engine.tokenizer, False, top)
        return (lps or {}).get("content") or []

    async def _background(self, req: ResponsesRequest, run: ChatRun, body: Any,
                          kept: StoredResponse) -> None:
        """Run a background response to its end, its stored status following it."""
        kept.body = {**kept.body, "status": "in_progress"}
        try:
            final = await self._whole(req, run, body)
        except asyncio.CancelledError:
            run.batch.close()
            raise
        except Exception as e:  # noqa: BLE001 - the stored response says what failed
            err = stream_error(e)["error"]
            kept.body = {**kept.body, "status": "failed",
                         "error": {"code": str(err.get("code") or "server_error"),
                                   "message": err["message"]}}
            return
        if kept.body["status"] != "cancelled":
            kept.history = kept.history + history_messages(final["output"])
            kept.body = final

    async def _background_stream(self, req: ResponsesRequest, run: ChatRun, body: Any,
                                 kept: StoredResponse) -> None:
        """Run a streamed background response to its end, keeping its events for readers."""
        assert kept.events is not None and kept.changed is not None
        kept.body = {**kept.body, "status": "in_progress"}
        try:
            async for text in self._events(req, run, body, kept):
                kept.events.append(text)  # numbered from 0, one by one: its index
                async with kept.changed:
                    kept.changed.notify_all()
        finally:
            kept.streaming = False
            async with kept.changed:
                kept.changed.notify_all()

    def stream_again(self, rid: str, starting_after: int | None) -> EventStream:
        """GET /v1/responses/{id}?stream=true: a background stream's events after
        `starting_after`, then the rest as they come (a client that lost its connection)."""
        kept = self.store.get(rid)
        if kept.events is None:
            raise OpenAIError(400, f"response {rid!r} was not created with background and "
                              "stream true: there are no events to stream", param="stream")
        return EventStream(kept.replay(starting_after), lambda: None)

    async def _events(self, req: ResponsesRequest, run: ChatRun, body: Any,
                      kept: StoredResponse) -> AsyncIterator[str]:
        """The response's server-sent events, as OpenAI names them: created, in_progress, each
        output item added / its deltas / done, completed (its status may be incomplete)."""
        batch, calls = run.batch, run.calls
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            data = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        items: list[dict[str, Any]] = []  # finished output items
        current: dict[str, Any] | None = None  # the item being streamed
        text_lps: list[dict[str, Any]] = []

        def close() -> list[str]:
            nonlocal current
            if current is None:
                return []
            i, out = len(items), []
            if current["type"] == "reasoning":
                text = current["content"][0]["text"]
                out.append(event("response.reasoning_text.done", item_id=current["id"],
                                 output_index=i, content_index=0, text=text))
                current = reasoning_item(text, item_id=current["id"])
            elif current["type"] == "message":
                text = current["content"][0]["text"]
                part = output_text(text, text_lps if req.logprobs else None)
                out += [event("response.output_text.done", item_id=current["id"],
                              output_index=i, content_index=0, text=text,
                              logprobs=part["logprobs"]),
                        event("response.content_part.done", item_id=current["id"],
                              output_index=i, content_index=0, part=part)]
                current = message_item(text, part["logprobs"], item_id=current["id"])
            else:
                out.append(event("response.function_call_arguments.done",
                                 item_id=current["id"], output_index=i,
                                 arguments=current["arguments"]))
                current = {**current, "status": "completed"}
            out.append(event("response.output_item.done", output_index=i, item=current))
            items.append(current)
            current = None
            return out

        start = body("in_progress", [], None)
        try:
            yield event("response.created", response=start)
            yield event("response.in_progress", response=start)
            finish = None
            # Logprobs of tokens that brought no text yet (a character's first bytes) wait for
            # the message's next delta; once it is open, such tokens (the EOS too) get a delta
            # of no text, so every token's logprob is streamed, as vLLM streams them.
            pending: list[dict[str, Any]] = []
            split = run.stream()
            reasoning = ""
            async for _, out in batch.outputs():
                c = out.outputs[0]
                finish = c.finish_reason
                text = c.text
                if split is not None:
                    thought, text = split.delta(c.text, c.finish_reason is not None)
                    if thought:  # the reasoning item, opened at its first piece
                        reasoning += thought
                        if current is None or current["type"] != "reasoning":
                            for e in close():
                                yield e
                            current = reasoning_item("", "in_progress")
                            yield event("response.output_item.added",
                                        output_index=len(items), item=current)
                        current["content"][0]["text"] += thought
                        yield event("response.reasoning_text.delta", item_id=current["id"],
                                    output_index=len(items), content_index=0, delta=thought)
                delta, _ = calls.delta(0, text, c.finish_reason)
                lps = self._logprobs(c, batch.params.logprobs or 0) if req.logprobs else []
                delta = delta or {}
                if lps and not delta.get("content"):
                    if current is not None and current["type"] == "message":
                        text_lps += lps
                        yield event("response.output_text.delta", item_id=current["id"],
                                    output_index=len(items), content_index=0, delta="",
                                    logprobs=lps)
                    else:
                        pending += lps
                    lps = []
                if delta.get("content"):
                    lps, pending = pending + lps, []
                    if current is None or current["type"] != "message":
                        for e in close():
                            yield e
                        current = message_item("", None, "in_progress")
                        text_lps = []
                        yield event("response.output_item.added", output_index=len(items),
                                    item={**current, "content": []})
                        yield event("response.content_part.added", item_id=current["id"],
                                    output_index=len(items), content_index=0,
                                    part=output_text("", None))
                    current["content"][0]["text"] += delta["content"]
                    text_lps += lps
                    yield event("response.output_text.delta", item_id=current["id"],
                                output_index=len(items), content_index=0,
                                delta=delta["content"], logprobs=lps)
                for tc in delta.get("tool_calls") or []:
                    if "id" in tc:  # a new call: its item, then its arguments as they come
                        for e in close():
                            yield e
                        current = function_call_item(
                            {**tc, "function": {**tc["function"], "arguments": ""}},
                            "in_progress")
                        yield event("response.output_item.added", output_index=len(items),
                                    item=current)
                    args = tc["function"].get("arguments") or ""
                    if args and current is not None:
                        current["arguments"] += args
                        yield event("response.function_call_arguments.delta",
                                    item_id=current["id"], output_index=len(items),
                                    delta=args)
            for e in close():
                yield e
            final = body(_STATUS.get(finish or "", "completed"), items,
                         self._usage(batch.usage(), reasoning or None))
            self._keep(req, final["id"], kept, final)
            yield event("response.completed", response=final)
        except OpenAIError as e:
            yield event("error", **_error_fields(e.body()["error"]))
        except Exception as e:  # noqa: BLE001 - an engine failure ends the stream with its error
            yield event("error", **_error_fields(stream_error(e)["error"]))
        finally:
            batch.close()

    def retrieve_response(self, rid: str) -> dict[str, Any]:
        """A stored response's object (a background one: as it stands)."""
        return self.store.get(rid).body

    async def cancel_response(self, rid: str) -> dict[str, Any]:
        """Cancel a background response still running; its object, status cancelled."""
        kept = self.store.get(rid)
        if kept.task is None:
            raise OpenAIError(400, "Cannot cancel a synchronous response.",
                              param="response_id")
        status = kept.body["status"]
        if status == "cancelled":
            return kept.body
        if status not in ("queued", "in_progress"):  # vLLM's answer: nothing left to cancel
            raise OpenAIError(400, f"Cannot cancel a response that has finished ({status}).",
                              param="response_id")
        kept.body = {**kept.body, "status": "cancelled"}
        await _stopped(kept.task)
        return kept.body

    async def delete_response(self, rid: str) -> dict[str, Any]:
        """Forget a stored response (a running one is cancelled first)."""
        kept = self.store.pop(rid)
        if kept.task is not None:
            await _stopped(kept.task)
        return {"id": rid, "object": "response", "deleted": True}

    def input_items(self, rid: str, order: str, limit: int, after: str | None
                    ) -> dict[str, Any]:
        """OpenAI's input item list of a stored response (newest first by default)."""
        if order not in ("asc", "desc"):
            raise OpenAIError(400, f"order must be 'asc' or 'desc', got {order!r}",
                              param="order")
        if not 1 <= limit <= 100:
            raise OpenAIError(400, f"limit must be between 1 and 100, got {limit}",
                              param="limit")
        items = self.store.get(rid).input_items
        items = items[::-1] if order == "desc" else list(items)
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise OpenAIError(400, f"after: no input item {after!r} in response {rid!r}",
                                  param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit}

    async def close_responses(self) -> None:
        """Cancel the background responses still running (the server is stopping)."""
        tasks = self.store.tasks()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stopped(task: asyncio.Task) -> None:
    """Cancel a background response's task and wait for it to end (its batch aborted)."""
    if task.done():
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def _error_fields(err: dict[str, Any]) -> dict[str, Any]:
    """An error event's fields (OpenAI's: code, message, param)."""
    return {"code": None if err.get("code") is None else str(err["code"]),
            "message": err["message"], "param": err.get("param")}
