"""What the server tests share: the served model name, engine settings, a running server."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from jpaged.async_engine import AsyncLLMEngine

MODEL = "tiny-test"
# Small buckets keep compiles few; 16 running sequences of <= 128 tokens
# fit in 160 blocks of 16, so there is no preemption in these tests.
ENGINE_ARGS = dict(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64,
                   block_size=16, num_gpu_blocks_override=160)


@dataclass
class Served:
    """A running server: its engine, base URL and an OpenAI client pointed at it."""

    engine: AsyncLLMEngine
    url: str

    def client(self, **kw) -> openai.OpenAI:
        """A synchronous OpenAI client without retries."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "none"),
                             max_retries=0, timeout=120, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        """An asyncio OpenAI client without retries."""
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                                  timeout=120)

    def metrics(self) -> dict[str, float]:
        """/metrics parsed: sample name (labels dropped) -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value if s.labels else s.value
        return out

    def wait_drained(self, timeout: float = 60.0) -> dict[str, float]:
        """Wait until the engine has no request left; returns its metrics then."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.engine.get_metrics()
            if m["num_unfinished_requests"] == 0 and m["kv_cache_usage"] == 0.0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"engine did not drain: {m}")
            time.sleep(0.05)


@contextlib.contextmanager
def tiny_server(name: str, loaded: Any = None, **engine_args: Any) -> Iterator[Served]:
    """A real server on 127.0.0.1 of the tiny model (or of `loaded`) with ENGINE_ARGS and
    `engine_args`, under the served name `name`, stopped on exit."""
    from helpers import tiny

    from jpaged.config import EngineArgs
    from jpaged.engine import LLMEngine
    from jpaged.server import BackgroundServer, build_app

    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**ENGINE_ARGS, **engine_args),
                                      loaded=loaded or tiny()))
    server = BackgroundServer(build_app(engine, name))
    try:
        yield Served(engine, server.url)
    finally:
        server.stop()
        engine.shutdown()


def pooling_server(name: str, loaded: Any = None) -> contextlib.AbstractContextManager[Served]:
    """A server of the tiny model as an embedding model (runner "pooling": LAST pooling,
    normalized), or of `loaded` (a classifier), under the served name `name`."""
    return tiny_server(name, loaded, runner="pooling")
