"""bench/hybrid.py on a tiny Gemma 3: the hybrid layout fits more long requests in the same KV
bytes than the full-attention one, and hits the prefix cache as the block-count theory says."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import make_hf_checkpoint

from jpaged.bench.hybrid import make_engine, max_concurrent, prefix_hits, shared_prefix
from jpaged.runner.kv_cache import bytes_per_block
from models import load_model

pytest.importorskip("torch")


def test_hybrid_fits_more_long_requests_and_hits_as_theory(tmp_path):
    make_hf_checkpoint("gemma3", tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32")
    ctx = 256
    kv_bytes = int(2.5 * ctx * bytes_per_block(loaded.spec, 1, np.float32))
    engines = {h: make_engine(loaded, h, kv_bytes, ctx, 64, max_num_seqs=16)
               for h in (True, False)}
    assert engines[True].kv_layout.num_groups == 3 and engines[False].kv_layout.num_groups == 1
    cap = {h: max_concurrent(e, ctx - 64, 8, 64) for h, e in engines.items()}
    assert cap[False]["preempted"] and cap[False]["max_concurrent"] <= 3, cap
    assert cap[True]["max_concurrent"] > cap[False]["max_concurrent"], cap
    # Prefix hits on the hybrid engine equal the block-count theory (the bench's last figure;
    # the same greedy tokens with and without groups are test_sliding_window's).
    got = prefix_hits(engines[True], shared_prefix(70, 3, 9, vocab=250))
    assert got["hits"] == got["theory"] > 0, got
