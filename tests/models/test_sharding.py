"""The tensor-parallel parameter plan the loaders and the engine share (models/sharding.py)."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P
from tiny_models import tiny_spec

from models.sharding import param_spec, plan_layout, valid_tp_sizes


def test_layout_splits_or_replicates_kv_heads():
    spec = tiny_spec()  # 4 query heads, 2 KV heads
    two, four = plan_layout(spec, 2), plan_layout(spec, 4)
    assert (two.kv_replicas, two.kv_shards, two.stored_kv_heads) == (1, 2, 2)
    assert (four.kv_replicas, four.kv_shards, four.stored_kv_heads) == (2, 2, 4)
    assert valid_tp_sizes(spec) == [1, 2, 4]
    smol = tiny_spec(num_heads=9, num_kv_heads=3, intermediate_size=1536)
    assert valid_tp_sizes(smol) == [1, 3]


def test_layout_error_names_sizes_and_heads():
    smol = tiny_spec(num_heads=9, num_kv_heads=3, intermediate_size=1536)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*9 query heads, 3 KV heads"
                       r".*values that work: 1, 3"):
        plan_layout(smol, 2)
    with pytest.raises(ValueError, match="intermediate_size=90 does not split 4 ways"):
        plan_layout(tiny_spec(intermediate_size=90), 4)


def test_param_spec_rules_are_rank_relative():
    """A stacked layer axis or none: the same axis of each kernel is split."""
    two = plan_layout(tiny_spec(), 2)  # 2 KV heads: k/v projections split too
    for prefix in (("model", "layers"), ("model", "layers", "0")):
        for proj in ("q_proj", "k_proj", "gate_proj"):
            assert param_spec((*prefix, proj, "kernel"), 3, two, True) == P(None, None, "tp")
            assert param_spec((*prefix, proj, "kernel"), 2, two, True) == P(None, "tp")
        assert param_spec((*prefix, "o_proj", "kernel"), 2, two, True) == P("tp", None)
        assert param_spec((*prefix, "down_proj", "bias"), 1, two, True) == P()
    four = plan_layout(tiny_spec(), 4)  # KV heads replicated: k/v projections too
    assert param_spec(("model", "layers", "k_proj", "kernel"), 3, four, True) == P()
    assert param_spec(("lm_head", "kernel"), 2, two, True) == P(None, "tp")
    assert param_spec(("model", "embed_tokens", "embedding"), 2, two, False) == P()
