"""Fixtures the bench tests share."""

from __future__ import annotations

import pytest
from helpers import tiny

from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine


@pytest.fixture(scope="module")
def runner():
    """The tiny model's runner: 4 sequences of up to 64 tokens, blocks of 8, 24 blocks."""
    engine = LLMEngine(EngineArgs(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                                  block_size=8, num_gpu_blocks_override=24), loaded=tiny())
    return engine.runner
