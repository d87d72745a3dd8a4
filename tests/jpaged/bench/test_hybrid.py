"""bench/hybrid.py on a tiny Gemma 3: the hybrid layout fits more long requests in the same KV
bytes than the full-attention one, generates the same greedy tokens, and hits the prefix cache
as the block-count theory says."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import make_hf_checkpoint

from jpaged.bench.hybrid import make_engine, max_concurrent, prefix_hits, run_batch, shared_prefix
from jpaged.runner.kv_cache import bytes_per_block
from models import load_model

pytest.importorskip("torch")


def test_hybrid_fits_more_long_requests_with_the_same_tokens(tmp_path):
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
    rng = np.random.default_rng(0)
    batch = [rng.integers(1, 250, size=150).tolist() for _ in range(3)]
    runs = {h: run_batch(e, batch, 6, "b") for h, e in engines.items()}
    assert runs[True][1] == runs[False][1]
    assert runs[True][2]["num_blocks_freed_out_of_window"] > 0
    prompts = shared_prefix(70, 3, 9, vocab=250)
    for e in engines.values():
        got = prefix_hits(e, prompts)
        assert got["hits"] == got["theory"] > 0, got
