"""The server under load on loopback: 64 concurrent streaming clients (the official AsyncOpenAI
client), ~10% hanging up mid-stream, plus one client that times out on a long request. Every
other stream must end with the text the same prompt gets alone; afterwards no request is left,
no KV block is held, and the server logged no error or traceback."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

import openai
import pytest
from helpers import tiny
from serverkit import MODEL, Served

from jpaged.async_engine import AsyncLLMEngine
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.server import BackgroundServer, build_app

NUM_CLIENTS = 64
DROP_EVERY = 10  # clients 0, 10, ..., 60 (7 of 64) hang up after their first chunks
DROP_AFTER_CHUNKS = 2
NUM_PROMPTS = 16  # distinct prompts; client i sends prompt i % 16
# max_tokens of completing, hanging-up and timing-out clients (LONG: what max_model_len 128
# leaves after LONG_PROMPT's tokens)
SHORT, DROP_LEN, LONG = 16, 40, 110
LONG_PROMPT = "a long one"
CLIENT_TIMEOUT_S = 0.5  # usually less than LONG decode steps take (all outcomes are checked)
# Prompts are <= 8 tokens, so at the peak 57 x 2 + 7 x 3 + 8 blocks fit in 159: no preemption.
LOAD_ARGS = dict(max_model_len=128, max_num_seqs=64, max_num_batched_tokens=64, block_size=16,
                 num_gpu_blocks_override=160)
# Where a traceback would be logged: uvicorn's error log, the engine loop, asyncio, the root.
LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "jpaged", "asyncio")


def _prompt(i: int) -> str:
    return f"{i:02d} " + "wxyz"[: i % 5]


class _Records(logging.Handler):
    """Keeps every record of WARNING or above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def load_server() -> Iterator[tuple[Served, _Records]]:
    """A server of its own (64 sequences per step), with its log captured from the start."""
    records = _Records()
    for name in LOGGERS:
        logging.getLogger(name).addHandler(records)
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**LOAD_ARGS), loaded=tiny()))
    server = BackgroundServer(build_app(engine, MODEL))
    try:
        yield Served(engine, server.url), records
    finally:
        server.stop()
        engine.shutdown()
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(records)


async def _stream(client: openai.AsyncOpenAI, i: int) -> tuple[str, str, str | None]:
    drop = i % DROP_EVERY == 0
    stream = await client.completions.create(
        model=MODEL, prompt=_prompt(i % NUM_PROMPTS), max_tokens=DROP_LEN if drop else SHORT,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    text, finish, chunks = "", None, 0
    async for chunk in stream:
        chunks += 1
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
        if drop and chunks == DROP_AFTER_CHUNKS:
            await stream.close()  # the connection goes away mid-stream
            return "dropped", text, finish
    return "done", text, finish


async def _times_out(url: str) -> str:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                timeout=CLIENT_TIMEOUT_S)
    try:
        await client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=LONG,
                                        temperature=0, extra_body={"ignore_eos": True})
        return "answered"
    except openai.APITimeoutError:
        return "timed out"
    finally:
        await client.close()


def test_64_streams_with_hangups_and_a_client_timeout(load_server, monkeypatch) -> None:
    served, records = load_server
    engine = served.engine.engine
    # The reference: each prompt alone through the same engine, greedy.
    alone = {}
    with served.client() as client:
        for p in range(NUM_PROMPTS):
            out = client.completions.create(model=MODEL, prompt=_prompt(p), max_tokens=SHORT,
                                            temperature=0, extra_body={"ignore_eos": True})
            alone[p] = out.choices[0].text
    stats0, m0 = dict(engine.stats), served.engine.get_metrics()
    long_ids: list[str] = []  # the timing-out request's id, once the engine has it
    add = engine.add_request

    def add_and_note(request_id: str, prompt, *args, **kwargs):
        out = add(request_id, prompt, *args, **kwargs)
        # The server hands the engine its tokens with the text: {"prompt": ..., ...}.
        if (prompt.get("prompt") if isinstance(prompt, dict) else prompt) == LONG_PROMPT:
            long_ids.append(request_id)
        return out

    monkeypatch.setattr(engine, "add_request", add_and_note)

    async def load() -> tuple[list, str]:
        client = served.async_client()
        try:
            timeout = asyncio.ensure_future(_times_out(served.url))
            streams = await asyncio.gather(*(_stream(client, i) for i in range(NUM_CLIENTS)))
            return streams, await timeout
        finally:
            await client.close()

    t0 = time.perf_counter()
    results, timed_out = asyncio.run(load())
    elapsed = time.perf_counter() - t0
    assert timed_out == "timed out"
    dropped = [i for i, r in enumerate(results) if r[0] == "dropped"]
    assert dropped == list(range(0, NUM_CLIENTS, DROP_EVERY))
    for i, (kind, text, finish) in enumerate(results):
        want = alone[i % NUM_PROMPTS]
        if kind == "done":
            assert (text, finish) == (want, "length"), (i, text, want)
        else:  # what a hung-up client saw is the start of the same text
            assert want.startswith(text), (i, text, want)

    m = served.wait_drained(timeout=30)
    assert not engine.has_unfinished_requests() and m["num_unfinished_requests"] == 0
    assert m["kv_cache_usage"] == 0.0 and m["num_requests_running"] == 0
    stats = engine.stats
    aborted = stats["num_requests_aborted"] - stats0["num_requests_aborted"]
    finished = stats["num_requests_finished"] - stats0["num_requests_finished"]
    # The timed-out request ends one of three ways, all correct: aborted on the disconnect (the
    # usual), never added (the server had not read it when the client gave up), or finished in
    # the moment between the client's timeout and the server seeing the connection close.
    # Whichever it was, every added request ended exactly once.
    assert aborted + finished == NUM_CLIENTS + len(long_ids)
    assert aborted >= len(dropped) and finished >= NUM_CLIENTS - len(dropped)
    assert aborted <= len(dropped) + len(long_ids)
    assert served.metrics()["jpaged:kv_cache_usage_perc"] == 0.0
    bad = [r for r in records.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]
    assert not any("Traceback" in r.getMessage() for r in records.records)
    fate = "never added" if not long_ids else "aborted" if aborted > len(dropped) else "finished"
    print(f"\n{NUM_CLIENTS} streams ({len(dropped)} hung up) + 1 timeout in {elapsed:.1f}s; "
          f"preemptions {m['num_preemptions'] - m0['num_preemptions']}; "
          f"tokens {m['generation_tokens_total'] - m0['generation_tokens_total']}; "
          f"log records >= WARNING: {len(records.records)}; timed-out request {fate}")
