"""Many concurrent streams through one engine loop; clients that go away get their requests
aborted and their KV blocks freed."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from serverkit import MODEL

NUM_STREAMS = 36
DROP_EVERY = 4  # streams 0, 4, 8, ... close their connection after 3 chunks
LONG = 100  # a dropped stream would run this many tokens if nobody aborted it
SHORT = 16


async def _one(client, i: int) -> tuple[str, int, str | None, str]:
    drop = i % DROP_EVERY == 0
    stream = await client.completions.create(
        model=MODEL, prompt=f"stream number {i}:", max_tokens=LONG if drop else SHORT,
        temperature=0.8, seed=i, stream=True, extra_body={"ignore_eos": True})
    chunks, finish, text = 0, None, ""
    async for chunk in stream:
        chunks += 1
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
        if drop and chunks == 3:
            await stream.close()  # the HTTP connection goes away mid-stream
            return "dropped", chunks, finish, text
    return "done", chunks, finish, text


def test_concurrent_streams_with_dropped_clients(served):
    stats0 = served.engine.engine.stats.copy()
    gen0 = served.engine.get_metrics()["generation_tokens_total"]

    async def run() -> list:
        client = served.async_client()
        try:
            return await asyncio.gather(*(_one(client, i) for i in range(NUM_STREAMS)))
        finally:
            await client.close()

    results = asyncio.run(run())
    dropped = [r for r in results if r[0] == "dropped"]
    done = [r for r in results if r[0] == "done"]
    assert len(dropped) == NUM_STREAMS // DROP_EVERY and len(done) == NUM_STREAMS - len(dropped)
    assert all(r[2] == "length" for r in done)

    m = served.wait_drained(timeout=60)
    assert m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
    assert m["kv_cache_usage"] == 0.0
    assert not served.engine.engine.has_unfinished_requests()
    stats = served.engine.engine.stats
    assert stats["num_requests_aborted"] - stats0["num_requests_aborted"] == len(dropped)
    assert stats["num_requests_finished"] - stats0["num_requests_finished"] == len(done)
    # The dropped requests stopped early: far fewer tokens than LONG each.
    generated = m["generation_tokens_total"] - gen0
    assert len(done) * SHORT <= generated < len(done) * SHORT + len(dropped) * LONG // 2
    assert served.metrics()["jpaged:kv_cache_usage_perc"] == 0.0


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": "slow", "max_tokens": LONG,
                         "ignore_eos": True}),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": LONG, "ignore_eos": True,
                              "messages": [{"role": "user", "content": "slow"}]}),
])
def test_non_streaming_client_that_disconnects_is_aborted(served, path, body):
    aborted0 = served.engine.engine.stats["num_requests_aborted"]

    async def give_up() -> None:
        async with httpx.AsyncClient(base_url=served.url) as client:
            task = asyncio.create_task(client.post(path, json=body, timeout=60))
            while served.engine.get_metrics()["num_requests_running"] == 0:
                await asyncio.sleep(0.01)
            task.cancel()  # closes the connection while the request is being generated
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(give_up())
    m = served.wait_drained(timeout=30)
    assert served.engine.engine.stats["num_requests_aborted"] == aborted0 + 1
    assert m["kv_cache_usage"] == 0.0


def test_a_duplicate_request_id_is_refused_and_never_aborts_the_request_holding_it(served):
    """A second request that reuses a running request's `request_id` gets a 400 naming
    `request_id`; the first one is neither aborted nor left hanging: it streams to its end."""
    stats0 = served.engine.engine.stats.copy()

    async def run() -> tuple:
        client = served.async_client()
        try:
            stream = await client.completions.create(
                model=MODEL, prompt="A long story:", max_tokens=40, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "request_id": "held"})
            chunks, finish, dup = 0, None, None
            async for chunk in stream:
                chunks += 1
                finish = chunk.choices[0].finish_reason or finish
                if chunks == 2:  # the first one is running now: reuse its id
                    try:
                        await client.completions.create(
                            model=MODEL, prompt="y", max_tokens=2,
                            extra_body={"request_id": "held"})
                    except Exception as e:  # noqa: BLE001 - the API error is the result
                        dup = e
            return chunks, finish, dup
        finally:
            await client.close()

    chunks, finish, dup = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert finish == "length" and chunks >= 2, (chunks, finish)  # ran to max_tokens
    assert getattr(dup, "status_code", None) == 400, dup
    assert dup.body["param"] == "request_id" and "already in use" in dup.body["message"]
    m = served.wait_drained(timeout=60)
    assert m["kv_cache_usage"] == 0.0
    assert served.engine.engine.stats["num_requests_aborted"] == stats0["num_requests_aborted"]


def test_two_hundred_cancelled_streams_leave_nothing_behind(served, monkeypatch):
    """vLLM's request-cancellation test: 200 streams whose clients go away (half after their
    first chunk, half at a 0.5 s read timeout), then a request that must be answered; after
    it the engine holds no request, no KV block and no output sink. The tokenizer's longest
    token is measured once per server (at start-up), never per request: computed lazily, each
    request of a burst ran it again (the embedded model: 200 x 44 ms queued on the executor
    ahead of the next request's tokenization)."""
    import jpaged.server.serving as serving
    from jpaged.server import BackgroundServer, build_app

    calls = []
    measure = serving._max_token_bytes
    monkeypatch.setattr(serving, "_max_token_bytes", lambda tok: calls.append(1) or measure(tok))
    server = BackgroundServer(build_app(served.engine, MODEL))  # a new app: its own Serving
    stats0 = served.engine.engine.stats.copy()
    body = {"model": MODEL, "max_tokens": LONG, "ignore_eos": True, "stream": True}

    async def cancelled(client: httpx.AsyncClient, i: int) -> str:
        try:
            # Even: closed after the first chunk; odd: a read that waits over 0.5 s gives up.
            async with client.stream("POST", "/v1/chat/completions", json={
                    **body, "messages": [{"role": "user", "content": f"story {i}"}]},
                    timeout=60 if i % 2 == 0 else 0.5) as r:
                async for _ in r.aiter_lines():
                    if i % 2 == 0:
                        return "closed"  # leaving the block closes the connection
        except httpx.TimeoutException:
            return "timed out"
        return "finished"

    async def run() -> tuple[list[str], httpx.Response]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits) as client:
            ends = await asyncio.gather(*(cancelled(client, i) for i in range(200)))
        async with httpx.AsyncClient(base_url=server.url) as client:
            after = await client.post("/v1/chat/completions", timeout=120, json={
                "model": MODEL, "max_tokens": 5, "messages": [{"role": "user",
                                                                "content": "still there?"}]})
        return ends, after

    try:
        ends, after = asyncio.run(asyncio.wait_for(run(), timeout=300))
    finally:
        server.stop()
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"]
    assert ends.count("closed") == 100 and "timed out" in ends, ends
    m = served.wait_drained(timeout=120)
    assert m["num_unfinished_requests"] == 0 and m["kv_cache_usage"] == 0.0
    assert m["num_blocks_free"] == m["num_blocks_total"]
    assert not served.engine.engine.has_unfinished_requests()
    assert served.engine._sinks == {}  # no output queue kept for a request that is gone
    stats = served.engine.engine.stats
    added = (stats["num_requests_aborted"] - stats0["num_requests_aborted"]
             + stats["num_requests_finished"] - stats0["num_requests_finished"])
    assert added <= 201  # each one added either finished or was aborted: none left running
    assert len(calls) == 1  # once for the server, whatever the burst
