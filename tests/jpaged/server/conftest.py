"""One tiny-model engine and a real uvicorn server on 127.0.0.1 shared by the server tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import tiny
from serverkit import ENGINE_ARGS, MODEL, Served

from jpaged.async_engine import AsyncLLMEngine
from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.server import BackgroundServer, build_app


@pytest.fixture(scope="session")
def served() -> Iterator[Served]:
    """The shared server (no API key)."""
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**ENGINE_ARGS), loaded=tiny()))
    server = BackgroundServer(build_app(engine, MODEL))
    try:
        yield Served(engine, server.url)
    finally:
        server.stop()
        engine.shutdown()
