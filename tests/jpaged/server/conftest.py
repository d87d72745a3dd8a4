"""One tiny-model engine and a real uvicorn server on 127.0.0.1 shared by the server tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serverkit import MODEL, Served, tiny_server


@pytest.fixture(scope="session")
def served() -> Iterator[Served]:
    """The shared server (no API key)."""
    with tiny_server(MODEL) as server:
        yield server
